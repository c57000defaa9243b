"""The drafter training recipe: one plain PyTorch loop, run by the train stage, the zoo and the bench.

    result, state = train_drafter(Recipe(draft, train_samples, eval_samples, lm_head, cfg.train, seed, device),
                                  Hooks(log=..., checkpoint=...), state)

Each optimizer step: the TTT loss of modeling/draft.py on one batch of packed rows (training/data.py), its
gradients, clipping, and the optimizers with their learning rates' warmup then cosine decay (training/optimizers.py:
AdamW, or Muon for the matrices). The compile policy is the loop's (`prepare_for_training`).
Under torchrun the ranks share each global batch (training/distributed.py); the result is the single process's.
A TrainState passed back continues the run exactly: the same batches, optimizer, scheduler and RNG, so the
weights end as those of an uninterrupted run.
"""
from __future__ import annotations

import functools
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

import torch
from tqdm import tqdm

from eagle3ops.config import DrafterTrainConfig
from eagle3ops.data.hidden_states import decode
from eagle3ops.errors import InputError
from eagle3ops.modeling.draft import Eagle3Draft, TTTResult, compute_dtype, step_loss, ttt_loss
from eagle3ops.progress import progress as progress_bar
from eagle3ops.training import compile_cache, distributed
from eagle3ops.training.data import (
    ASSEMBLED_AHEAD,
    assemble,
    assembled_ahead,
    eval_batches,
    rank_share,
    remaining_batches,
    schedule,
    to_device,
)
from eagle3ops.training.distributed import World
from eagle3ops.training.optimizers import Optimizers


@runtime_checkable
class HiddenStateSource(Protocol):
    """Where online training's hidden states come from (training/online.py): the target in this process
    (TargetStates, hooks on its layers) or a capturing vLLM server (EngineTargetStates). Offline the samples carry
    theirs, stored by the extract stage from the same sources or imported from a peer's files (extraction/), and a
    recipe has none."""
    remote: bool  # computed in another process: batches are assembled ahead of the step, on a CPU too
    aux_layers: list[int]  # HF hidden_states indices, in the configured order

    def __call__(self, rows: list[list[dict]], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The assembled `batch` (training/data.py; its rows `rows`) with aux_hidden [R, T, 3H] and final_hidden
        [R, T, H] added, on the training device."""


@dataclass
class Recipe:
    """One training run: the drafter (trained in place), its data, the target's head and the settings."""
    draft: Eagle3Draft
    train_samples: list[dict[str, torch.Tensor]]  # feature samples (training/data.py)
    eval_samples: list[dict[str, torch.Tensor]]  # held out: evaluated once at the end
    lm_head: torch.Tensor  # the target's [V, Ht], frozen: the target's distribution the loss is taken against
    optim: DrafterTrainConfig
    seed: int
    device: torch.device
    world: World | None = None  # None: the process group this process has joined, or this process alone
    warm_moments: dict | None = None  # a warm start's optimizer states, continued under this run's settings
    hidden_states: HiddenStateSource | None = None  # None: the samples carry their hidden states (offline)


@dataclass(frozen=True)
class Hooks:
    """What the caller sees of a run while it goes; on several ranks only rank 0 gets any."""
    log: Callable[[int, dict[str, float]], None] | None = None  # (step, metrics) every optim.log_every steps
    checkpoint: Callable[[TrainState], None] | None = None  # a resume point every optim.checkpoint_every steps
    probe: Callable[[Eagle3Draft], dict[str, float]] | None = None  # e.g. the acceptance simulator
    probe_every: int = 0  # steps between probes (and one at the end); 0 = none
    desc: str = "train"  # the progress bar's


@dataclass
class TrainState:
    """Where a run is: what a resume point holds (saved as a dict of tensors and plain values, loaded with
    weights_only), and, without the weights, what is saved beside a trained drafter."""
    step: int
    tokens: int  # the samples' tokens trained on so far
    optimizer: dict  # by name (training/optimizers.py)
    scheduler: dict
    torch_rng: torch.Tensor
    history: list[dict[str, float]] = field(default_factory=list)  # the logged rows, for plots/train-<init>.csv
    model: dict[str, torch.Tensor] | None = None  # the drafter's weights; None beside a saved drafter
    row_tokens: int = 0  # the packed rows' tokens so far, padding included

    def to_dict(self) -> dict:
        """The state as saved, its strings interned: pickle writes a string once per object, so a state loaded from a
        resume point (new string objects) would otherwise save to other bytes than the uninterrupted run's (the
        literals of the code, one object each), and DVC would see a changed training_state.pt."""
        return _interned({item.name: getattr(self, item.name) for item in fields(self)
                          if getattr(self, item.name) is not None})

    @classmethod
    def from_dict(cls, saved: dict) -> TrainState:
        return cls(**{item.name: saved[item.name] for item in fields(cls) if item.name in saved})


def _interned(value):
    if isinstance(value, str):
        return sys.intern(value)
    if isinstance(value, dict):
        return type(value)((_interned(key), _interned(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_interned(item) for item in value)
    return value


@dataclass
class TrainResult:
    steps: int
    tokens: int
    wall_s: float  # training alone: the probes' time is left out
    final: dict[str, float]  # held-out metrics (eval/...) and the last probe's (sim/...)
    history: list[dict[str, float]] = field(default_factory=list)
    resumed_at: tuple[int, int] = (0, 0)  # (step, tokens) this process started from
    probe_s: float = 0.0
    padding_share: float = 0.0  # of the packed rows' tokens the run trained on: their padded tails
    first_step_s: float = 0.0  # this process's first step, compilation included: a fixed cost, whatever the data

    @property
    def steps_per_s(self) -> float:
        return (self.steps - self.resumed_at[0]) / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens - self.resumed_at[1]) / self.wall_s if self.wall_s else 0.0


def train_drafter(recipe: Recipe, hooks: Hooks = Hooks(), state: TrainState | None = None
                  ) -> tuple[TrainResult, TrainState]:
    """Train `recipe.draft` in place; returns the result and the state to save beside the drafter.

    Over several ranks every rank walks the same global batches of `optim.batch_size` packed rows and trains on its
    share; DDP averages the gradients, and each TTT step's loss is normalised by the positions counted over the
    whole global batch, so losses, optimizer steps and weights are those of one process with that batch size,
    up to rounding (on GPUs the gradients are averaged in bf16). Every rank returns the same result. The held-out
    evaluation at the end, and the probe while training, see the drafter as it trains (bf16 on a GPU); the drafter
    left in `recipe.draft` has the float32 weights.
    """
    draft, optim, device = recipe.draft, recipe.optim, recipe.device
    world = recipe.world or distributed.current()
    if world.size > optim.batch_size:
        raise InputError(f"train.batch_size {optim.batch_size} is the global batch, shared by {world.size} ranks: "
                         f"make it at least {world.size}")
    seed_everything(recipe.seed)
    if state is not None and state.model is not None:
        draft.load_state_dict(state.model)  # float32, before training casts the weights
    loss = prepare_for_training(draft, device, optim)
    weights = MasterWeights(draft, compute_dtype(device))
    lm_head = recipe.lm_head.to(device, torch.bfloat16 if device.type == "cuda" else recipe.lm_head.dtype)
    # packed before the first step, so a sample longer than a row stops the run here, not after hours
    batches = schedule(recipe.train_samples, optim.packed_length, optim.batch_size, recipe.seed, optim.epochs)
    held_out = eval_batches(recipe.eval_samples, optim.packed_length, optim.batch_size)
    total_steps = sum(len(epoch) for epoch in batches)
    total_steps = min(total_steps, optim.max_steps) if optim.max_steps is not None else total_steps
    optimizers = Optimizers(list(zip(weights.names, weights.masters)), optim, total_steps, fused=device.type == "cuda")
    if recipe.warm_moments is not None and state is None:
        optimizers.continue_moments(recipe.warm_moments)
    step, tokens, history, row_tokens = 0, 0, [], 0
    if state is not None:
        optimizers.load_state_dict(state.optimizer, state.scheduler)
        torch.set_rng_state(state.torch_rng)
        step, tokens, history, row_tokens = state.step, state.tokens, state.history, state.row_tokens

    def now(with_weights: bool) -> TrainState:
        return TrainState(step, tokens, *optimizers.state_dict(), torch.get_rng_state(), history,
                          weights.state_dict() if with_weights else None, row_tokens)

    if world.size == 1:
        objective, normaliser = functools.partial(_batch_loss, draft), None
    else:
        objective, normaliser = distributed.wrap(_TTTObjective(draft), device), distributed.global_normaliser(world)
        distributed.broadcast_from_main(weights.masters)  # DDP broadcasts the drafter's weights, not the masters
    start, resumed_at, probe_s, first_step_s = time.perf_counter(), (step, tokens), 0.0, 0.0
    progress = progress_bar(total_steps, hooks.desc, "step", initial=step) if world.main else tqdm(disable=True)
    depth = assembly_depth(device, remote_states=recipe.hidden_states is not None and recipe.hidden_states.remote)
    remaining = remaining_batches(batches, step, total_steps)
    rows_per_rank = math.ceil(optim.batch_size / world.size)
    make = functools.partial(_make_batch, recipe, world, rows_per_rank)
    for epoch, rows, assembled in assembled_ahead(remaining, make, depth):
        batch = to_device(assembled, device)
        weights.release_gradients()  # none kept through the forward, where they would add to its peak memory
        result = objective(batch, lm_head, optim, normaliser, loss)
        result.loss.backward()
        grad_norm = weights.step(optimizers, optim.grad_clip)
        step += 1
        if step == resumed_at[0] + 1:
            first_step_s = time.perf_counter() - start
        tokens += sum(sample["input_ids"].shape[0] for row in rows for sample in row)
        row_tokens += len(rows) * optim.packed_length
        progress.update(1)
        if step % optim.log_every == 0 or step == total_steps:
            loss_value, losses, accs, alphas = _global_metrics(result, world, device)
            progress.set_postfix(loss=f"{loss_value:.3f}", acc0=f"{accs[0]:.2f}", refresh=False)
            row = {"train/loss": loss_value, "train/grad_norm": float(grad_norm), "train/lr": optimizers.lr,
                   "train/epoch": epoch, **{f"train/acc_{k}": a for k, a in enumerate(accs)},
                   **{f"train/alpha_{k}": a for k, a in enumerate(alphas)},
                   **{f"train/loss_{k}": v for k, v in enumerate(losses)}}
            history.append({"step": step, **row})
            if hooks.log:
                hooks.log(step, row)
        if hooks.probe and hooks.probe_every and (step % hooks.probe_every == 0 or step == total_steps):
            probe_start = time.perf_counter()
            measured = hooks.probe(draft)
            probe_s += time.perf_counter() - probe_start
            if history and history[-1]["step"] == step:
                history[-1].update(measured)
            else:
                history.append({"step": step, **measured})
            if hooks.log:
                hooks.log(step, measured)
        if hooks.checkpoint and optim.checkpoint_every and step % optim.checkpoint_every == 0 and step < total_steps:
            hooks.checkpoint(now(with_weights=True))
    progress.close()
    wall = time.perf_counter() - start - probe_s  # throughput counts training, not the simulator
    final = _evaluate(recipe, held_out, lm_head, loss, world) if held_out else {}
    if hooks.log and final:
        hooks.log(step, final)
    final.update({key: value for row in history for key, value in row.items() if key.startswith("sim/")})
    weights.restore()
    padding = 1 - tokens / row_tokens if row_tokens else 0.0
    return (TrainResult(step, tokens, wall, final, history, resumed_at, probe_s, padding, first_step_s),
            now(with_weights=False))


class MasterWeights:
    """The drafter's trainable weights as the optimizer updates them. On a GPU the drafter holds them in bf16 for
    the step (and so its gradients): the compiled TTT steps then keep no bf16 copy of every weight each for their
    backward, which autocast over float32 weights costs (the weights' size once per TTT step), and the optimizer
    updates float32 copies (SpecForge's recipe; the gradients of the K steps add up in bf16). Elsewhere, or in
    float32, the drafter's own weights are the optimizer's."""

    def __init__(self, draft: Eagle3Draft, dtype: torch.dtype):
        self.draft = draft
        self.names = [name for name, p in draft.named_parameters() if p.requires_grad]
        self.weights = [p for p in draft.parameters() if p.requires_grad]
        self.masters = self.weights
        if dtype != torch.float32:
            self.masters = [p.detach().float().clone() for p in self.weights]
            for p in self.weights:
                p.data = p.data.to(dtype)

    def release_gradients(self) -> None:
        for p in self.weights:
            p.grad = None

    def take_gradients(self) -> None:
        """After the backward: the drafter's gradients become the masters' (float32) and leave the drafter."""
        if self.masters is not self.weights:
            for master, p in zip(self.masters, self.weights):
                master.grad = p.grad.float() if p.grad is not None else None
                p.grad = None

    def update(self) -> None:
        """After the optimizer's step: the drafter's weights from the masters, whose gradients are let go."""
        if self.masters is not self.weights:
            with torch.no_grad():
                torch._foreach_copy_(self.weights, self.masters)
            for master in self.masters:
                master.grad = None

    def step(self, optimizers: Optimizers, max_norm: float) -> torch.Tensor:
        """After the backward, the optimizers' step: the gradients taken to the masters and clipped to `max_norm`,
        the masters updated, the drafter's weights from them. Returns the gradient norm before clipping."""
        self.take_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.masters, max_norm)
        optimizers.step()
        self.update()
        return grad_norm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The drafter's state with the trainable weights in float32, the masters': what a resume point keeps."""
        return {**self.draft.state_dict(), **{name: m.detach() for name, m in zip(self.names, self.masters)}}

    def restore(self) -> None:
        """The drafter's weights float32 again, the masters' values: the trained drafter as the caller keeps it."""
        if self.masters is not self.weights:
            for master, p in zip(self.masters, self.weights):
                p.data = master.detach()
                p.grad = None


def prepare_for_training(draft: Eagle3Draft, device: torch.device, optim: DrafterTrainConfig) -> Callable:
    """The loop's compile policy: move the drafter for training and return the step loss to use (`step_loss` with
    optim's train.loss and its constants).

    On a GPU the drafter's forward (one TTT step: norms, projections with the rotary embedding, the flex-attention
    kernel, SwiGLU, the head) and the step loss are compiled. Every batch has one shape (rows of
    train.packed_length) and every TTT step after the first the same inputs (modeling/draft.py, TTTContext), so a
    run compiles two graphs of the step and one of the loss, in its first step, whatever the lengths of the data
    (and as many again, without gradients, for the held-out evaluation); the local compile cache keeps them for the
    next process (training/compile_cache.py). The recompile limit is raised for processes that train several shapes (the bench): past it a graph
    would fall back to the unfused kernels. The frozen embedding (the target's, only looked up) is kept in bf16 as
    the target keeps it. Elsewhere both run eager: the same math, unfused."""
    draft.to(device).train()
    loss = (optim.loss, optim.lk_kl_scale, optim.lk_kl_decay)
    if device.type != "cuda":
        return _step_loss(*loss)
    compile_cache.use_local_cache()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    draft.embed_tokens.to(torch.bfloat16)
    draft.compile(dynamic=False)
    return _compiled_step_loss(*loss)


def _step_loss(kind: str, kl_scale: float, kl_decay: float) -> Callable:
    return functools.partial(step_loss, kind=str(kind), kl_scale=kl_scale, kl_decay=kl_decay)


@functools.cache
def _compiled_step_loss(kind: str, kl_scale: float, kl_decay: float) -> Callable:
    return torch.compile(_step_loss(kind, kl_scale, kl_decay), dynamic=False)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def assembly_depth(device: torch.device, remote_states: bool = False) -> int:
    """Batches a thread makes ahead: ASSEMBLED_AHEAD on a GPU, or where an engine elsewhere computes the hidden
    states (the thread mostly waits for it); none otherwise on a CPU, where its ops would fight the step's for the
    same cores."""
    return ASSEMBLED_AHEAD if device.type == "cuda" or remote_states else 0


def _make_batch(recipe: Recipe, world: World | None, row_count: int, batch: list[list[dict]]
                ) -> dict[str, torch.Tensor]:
    """A global batch's tensors for this rank (all of them with `world` None), on the host unless the hidden states
    come from the target (then theirs on the training device)."""
    rows = rank_share(batch, world) if world is not None else batch
    assembled = assemble(rows, recipe.optim.packed_length, row_count, pin=recipe.device.type == "cuda")
    return recipe.hidden_states(rows, assembled) if recipe.hidden_states else assembled


def _batch_loss(draft, batch, lm_head, optim: DrafterTrainConfig, normaliser=None, loss=step_loss):
    features = compute_dtype(batch["input_ids"].device)  # on a GPU bf16 as stored, not upcast for autocast to undo
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch["input_ids"].is_cuda):
        return ttt_loss(draft, batch["input_ids"].long(), decode(batch, "aux_hidden", features),
                        decode(batch, "final_hidden", features), batch["loss_mask"], batch["positions"], lm_head,
                        optim.ttt_steps, optim.loss_decay, normaliser, loss,
                        raise_positions=optim.ttt_positions == "raised")


class _TTTObjective(torch.nn.Module):
    """The TTT loss as a module's forward: DDP prepares its gradient averaging in the wrapped module's forward,
    and the drafter's own forward is one TTT step of several."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, batch, lm_head, optim, normaliser, loss) -> TTTResult:
        return _batch_loss(self.draft, batch, lm_head, optim, normaliser, loss)


def _global_metrics(result: TTTResult, world: World, device: torch.device
                    ) -> tuple[float, list[float], list[float], list[float]]:
    """(loss, loss_k, acc_k, alpha_k) of the whole global batch: the mean of the ranks' losses (see
    distributed.global_normaliser), accuracies and acceptance probabilities over the positions counted on all
    ranks."""
    if world.size == 1:
        return result.loss.item(), result.losses, result.accs, result.alphas
    K = len(result.losses)
    sums = distributed.all_reduce_sum([result.loss.item(), *result.losses, *result.counted,
                                       *(a * n for a, n in zip(result.accs, result.counted)),
                                       *(a * n for a, n in zip(result.alphas, result.counted))], device)
    counted, correct, accepted = sums[1 + K : 1 + 2 * K], sums[1 + 2 * K : 1 + 3 * K], sums[1 + 3 * K :]
    return (sums[0] / world.size, [v / world.size for v in sums[1 : 1 + K]],
            [c / max(1.0, n) for c, n in zip(correct, counted)], [a / max(1.0, n) for a, n in zip(accepted, counted)])


@torch.no_grad()
def _evaluate(recipe: Recipe, held_out: list, lm_head: torch.Tensor, loss: Callable, world: World
              ) -> dict[str, float]:
    """Held-out TTT loss (the mean over batches, weighted by their samples), per-step accuracy and acceptance
    probability (weighted by counted positions), and draft-vocab coverage, over `held_out` (data.eval_batches: the
    held-out samples packed in their own order). Over several ranks each takes every world-size-th batch and the
    sums are added up."""
    draft, optim, device = recipe.draft, recipe.optim, recipe.device
    ttt_steps = optim.ttt_steps
    draft.eval()
    loss_sum, correct, accepted = 0.0, [0.0] * ttt_steps, [0.0] * ttt_steps
    counted, masked = [0] * ttt_steps, [0] * ttt_steps
    for rows in held_out[world.rank :: world.size]:
        batch = to_device(_make_batch(recipe, None, optim.batch_size, rows), device)
        result = _batch_loss(draft, batch, lm_head, optim, loss=loss)
        for k in range(ttt_steps):
            correct[k] += result.accs[k] * result.counted[k]
            accepted[k] += result.alphas[k] * result.counted[k]
            counted[k] += result.counted[k]
            masked[k] += result.masked[k]
        loss_sum += result.loss.item() * sum(len(row) for row in rows)
    if world.size > 1:
        sums = distributed.all_reduce_sum([loss_sum, *correct, *accepted, *counted, *masked], device)
        loss_sum, rest = sums[0], sums[1:]
        correct, accepted, counted, masked = (rest[i * ttt_steps : (i + 1) * ttt_steps] for i in range(4))
    draft.train()
    metrics = {f"eval/acc_{k}": correct[k] / max(1, counted[k]) for k in range(ttt_steps)}
    metrics.update({f"eval/alpha_{k}": accepted[k] / max(1, counted[k]) for k in range(ttt_steps)})
    metrics["eval/loss"] = loss_sum / max(1, len(recipe.eval_samples))
    metrics["eval/draft_vocab_coverage"] = counted[0] / max(1, masked[0])
    return metrics
