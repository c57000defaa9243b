"""The drafter training loop: plain PyTorch, one place, called by the train stage and by the zoo.

AdamW, linear warmup then cosine decay, gradient clipping, the TTT loss of modeling/draft.py. Batches are
right-padded (causal attention never looks right, and padded positions carry loss_mask 0), shuffled per epoch
by a generator seeded from (seed, epoch), so a run resumed from its training state sees the same batches.
Under torchrun the ranks share each global batch (training/distributed.py); the result is the single process's.
"""
from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from eagle3ops.config import DrafterTrainConfig
from eagle3ops.errors import InputError
from eagle3ops.modeling.draft import Eagle3Draft, TTTResult, compute_dtype, ttt_loss
from eagle3ops.progress import progress as progress_bar
from eagle3ops.training import distributed
from eagle3ops.training.data import PADDED_AHEAD, pad_batch, padded_ahead, remaining_batches, to_device
from eagle3ops.training.distributed import World


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _batch_loss(draft, batch, lm_head, ttt_steps, decay, normaliser=None):
    features = compute_dtype(batch["input_ids"].device)  # on a GPU bf16 as stored, not upcast for autocast to undo
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch["input_ids"].is_cuda):
        return ttt_loss(draft, batch["input_ids"].long(), batch["aux_hidden"].to(features),
                        batch["final_hidden"].to(features), batch["loss_mask"], lm_head, ttt_steps, decay, normaliser)


class _TTTObjective(torch.nn.Module):
    """The TTT loss as a module's forward: DDP prepares its gradient averaging in the wrapped module's forward,
    and the drafter itself has none (ttt_loss calls its fuse and step)."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, batch, lm_head, ttt_steps, decay, normaliser) -> TTTResult:
        return _batch_loss(self.draft, batch, lm_head, ttt_steps, decay, normaliser)


def _global_metrics(result: TTTResult, world: World, device: torch.device) -> tuple[float, list[float], list[float]]:
    """(loss, loss_k, acc_k) of the whole global batch: the mean of the ranks' losses (see
    distributed.global_normaliser), accuracies over the positions counted on all ranks."""
    if world.size == 1:
        return result.loss.item(), result.losses, result.accs
    K = len(result.losses)
    sums = distributed.all_reduce_sum([result.loss.item(), *result.losses, *result.counted,
                                       *(a * n for a, n in zip(result.accs, result.counted))], device)
    counted, correct = sums[1 + K : 1 + 2 * K], sums[1 + 2 * K :]
    return (sums[0] / world.size, [v / world.size for v in sums[1 : 1 + K]],
            [c / max(1.0, n) for c, n in zip(correct, counted)])


@torch.no_grad()
def evaluate(draft: Eagle3Draft, samples: list, lm_head: torch.Tensor, batch_size: int, ttt_steps: int,
             decay: float, device: torch.device, world: World = World()) -> dict[str, float]:
    """Held-out TTT loss and per-step accuracy (weighted by counted positions), and draft-vocab coverage.
    Over several ranks each takes every world-size-th batch and the sums are added up."""
    draft.eval()
    loss_sum, correct, counted, masked = 0.0, [0.0] * ttt_steps, [0] * ttt_steps, [0] * ttt_steps
    for start in range(world.rank * batch_size, len(samples), world.size * batch_size):
        result = _batch_loss(draft, pad_batch(samples[start : start + batch_size], device), lm_head, ttt_steps, decay)
        for k in range(ttt_steps):
            correct[k] += result.accs[k] * result.counted[k]
            counted[k] += result.counted[k]
            masked[k] += result.masked[k]
        loss_sum += result.loss.item() * len(samples[start : start + batch_size])
    if world.size > 1:
        sums = distributed.all_reduce_sum([loss_sum, *correct, *counted, *masked], device)
        loss_sum, correct = sums[0], sums[1 : 1 + ttt_steps]
        counted, masked = sums[1 + ttt_steps : 1 + 2 * ttt_steps], sums[1 + 2 * ttt_steps :]
    draft.train()
    metrics = {f"eval/acc_{k}": correct[k] / max(1, counted[k]) for k in range(ttt_steps)}
    metrics["eval/loss"] = loss_sum / max(1, len(samples))
    metrics["eval/draft_vocab_coverage"] = counted[0] / max(1, masked[0])
    return metrics


@dataclass
class TrainResult:
    steps: int
    tokens: int
    wall_s: float
    final: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    resumed_at: tuple[int, int] = (0, 0)  # (step, tokens) this process started from
    probe_s: float = 0.0  # time the acceptance simulator took, left out of wall_s

    @property
    def steps_per_s(self) -> float:
        return (self.steps - self.resumed_at[0]) / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens - self.resumed_at[1]) / self.wall_s if self.wall_s else 0.0


def train_drafter(draft: Eagle3Draft, train_samples: list, eval_samples: list, lm_head: torch.Tensor,
                  optim: DrafterTrainConfig, seed: int, device: torch.device,
                  log: Callable[[int, dict[str, float]], None] | None = None, state: dict | None = None,
                  checkpoint: Callable[[dict], None] | None = None, desc: str = "train",
                  optimizer_state: dict | None = None, probe: Callable[[Eagle3Draft], dict] | None = None,
                  probe_every: int = 0, world: World | None = None) -> tuple[TrainResult, dict]:
    """Train in place. Returns the result and the training state to save beside the checkpoint.

    `optimizer_state` (a warm start's saved AdamW state) continues its moments under this run's settings.
    `probe` (the acceptance simulator) measures the drafter every `probe_every` steps and at the end; its
    metrics go to `log` and into the history row of that step.

    `checkpoint` receives the full state (weights included) every `optim.checkpoint_every` steps; passed back
    as `state`, it resumes the run exactly where it was: same batches, same optimizer and scheduler state, same
    RNG, so the final weights equal those of an uninterrupted run.

    Over several ranks (`world`: the joined process group's by default, training/distributed.py) every rank walks the
    same global batches of `optim.batch_size` samples and trains on its share; DDP averages the gradients,
    and each TTT step's loss is normalised by the positions counted over the whole global batch, so losses,
    optimizer steps and weights are those of one process with that batch size, up to float rounding. Every
    rank returns the same result; only rank 0 should be given `log`, `checkpoint` and `probe`.
    """
    world = world or distributed.current()
    if world.size > optim.batch_size:
        raise InputError(f"train.batch_size {optim.batch_size} is the global batch, shared by {world.size} ranks: "
                         f"make it at least {world.size}")
    seed_everything(seed)
    to_training_device(draft, device)
    lm_head = lm_head.to(device, torch.bfloat16 if device.type == "cuda" else lm_head.dtype)  # as the target has it
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                                  fused=device.type == "cuda")
    if optimizer_state is not None and state is None:
        continue_moments(optimizer, optimizer_state)
    steps_per_epoch = math.ceil(len(train_samples) / optim.batch_size)
    total_steps = steps_per_epoch * optim.epochs
    if optim.max_steps is not None:
        total_steps = min(total_steps, optim.max_steps)
    scheduler = warmup_cosine(optimizer, total_steps, optim.warmup_ratio)
    step, history, tokens = 0, [], 0
    if state is not None:
        if "model" in state:
            draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, history, tokens = state["step"], state.get("history", []), state.get("tokens", 0)
        torch.set_rng_state(state["torch_rng"])

    def snapshot() -> dict:
        return {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(), "history": history, "tokens": tokens}

    if world.size == 1:
        objective, normaliser = functools.partial(_batch_loss, draft), None
    else:
        objective, normaliser = distributed.wrap(_TTTObjective(draft), device), distributed.global_normaliser(world)
    start, resumed_at, probe_s = time.perf_counter(), (step, tokens), 0.0
    progress = progress_bar(total_steps, desc, "step", initial=step) if world.main else tqdm(disable=True)
    remaining = remaining_batches(train_samples, optim.batch_size, seed, step, total_steps, optim.epochs)
    depth = PADDED_AHEAD if device.type == "cuda" else 0
    for epoch, batch_samples, padded in padded_ahead(remaining, world, device, depth):
        batch = to_device(padded, device)
        optimizer.zero_grad(set_to_none=True)  # now: kept through the forward, they would add to its peak memory
        result = objective(batch, lm_head, optim.ttt_steps, optim.loss_decay, normaliser)
        result.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        tokens += int(sum(s["input_ids"].shape[0] for s in batch_samples))
        progress.update(1)
        if step % optim.log_every == 0 or step == total_steps:
            loss_value, losses, accs = _global_metrics(result, world, device)
            progress.set_postfix(loss=f"{loss_value:.3f}", acc0=f"{accs[0]:.2f}", refresh=False)
            row = {"train/loss": loss_value, "train/grad_norm": float(grad_norm), "train/lr": scheduler.get_last_lr()[0],
                   "train/epoch": epoch, **{f"train/acc_{k}": a for k, a in enumerate(accs)},
                   **{f"train/loss_{k}": v for k, v in enumerate(losses)}}
            history.append({"step": step, **row})
            if log:
                log(step, row)
        if probe and probe_every and (step % probe_every == 0 or step == total_steps):
            probe_start = time.perf_counter()
            measured = probe(draft)
            probe_s += time.perf_counter() - probe_start
            if history and history[-1]["step"] == step:
                history[-1].update(measured)
            else:
                history.append({"step": step, **measured})
            if log:
                log(step, measured)
        if checkpoint and optim.checkpoint_every and step % optim.checkpoint_every == 0 and step < total_steps:
            checkpoint({**snapshot(), "model": draft.state_dict()})
    progress.close()
    wall = time.perf_counter() - start - probe_s  # throughput counts training, not the simulator
    final = (evaluate(draft, eval_samples, lm_head, optim.batch_size, optim.ttt_steps, optim.loss_decay, device,
                      world) if eval_samples else {})
    if log and final:
        log(step, final)
    final.update({key: value for row in history for key, value in row.items() if key.startswith("sim/")})
    return TrainResult(step, tokens, wall, final, history, resumed_at, probe_s), snapshot()


def to_training_device(draft: Eagle3Draft, device: torch.device) -> Eagle3Draft:
    """Move the drafter for training. On a GPU its frozen embedding (the target's, only looked up) is kept in
    bf16 as the target keeps it, and the blocks around the attention are compiled (see `pad_batch` for the
    lengths that keeps the number of compiled shapes small)."""
    draft.to(device).train()
    if device.type == "cuda":
        draft.embed_tokens.to(torch.bfloat16)
        draft.compile_dense_blocks()
    return draft


def continue_moments(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load another run's optimizer moments but keep this run's hyper-parameters (lr, betas, weight decay)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_state = saved.get("state", {})
    mismatched = [f"parameter {i}: saved {tuple(s['exp_avg'].shape)} vs {tuple(params[i].shape)}"
                  for i, s in saved_state.items() if i >= len(params) or s["exp_avg"].shape != params[i].shape]
    if len(params) != sum(len(g["params"]) for g in saved.get("param_groups", [])) or mismatched:
        raise InputError("the warm start's optimizer state does not fit the drafter's parameters"
                         + (":\n  " + "\n  ".join(mismatched[:10]) if mismatched else ""))
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, own in zip(optimizer.param_groups, settings):
        group.pop("initial_lr", None)
        group.update(own)
