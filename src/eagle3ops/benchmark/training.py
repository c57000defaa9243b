"""Drafter training speed: the bare TTT step at fixed shapes, and the train stage's own loop over one or several
ranks."""
from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from eagle3ops.benchmark.sizes import SIZES
from eagle3ops.benchmark.timing import device_name, sync, timed
from eagle3ops.config import DrafterTrainConfig
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft, compute_dtype, ttt_loss
from eagle3ops.training import distributed
from eagle3ops.training.loop import Hooks, MasterWeights, Recipe, prepare_for_training, train_drafter
from eagle3ops.training.optimizers import Optimizers


def draft_config(architecture: dict, draft_vocab_size: int) -> DraftConfig:
    hidden = architecture["hidden_size"]
    return DraftConfig(hidden_size=hidden, intermediate_size=architecture["intermediate_size"],
                       num_attention_heads=architecture["num_attention_heads"],
                       num_key_value_heads=architecture["num_key_value_heads"], vocab_size=architecture["vocab_size"],
                       draft_vocab_size=draft_vocab_size, target_hidden_size=hidden, aux_layers=[2, 3, 4],
                       head_dim=architecture.get("head_dim"), max_position_embeddings=32768)


def train_step_flops(cfg: DraftConfig, batch: int, documents: list[int], ttt_steps: int) -> float:
    """FLOPs of one optimizer step on `batch` rows each packed with `documents` (their lengths): forward + backward
    (2x) of the drafter per TTT step, the fc once, and the target's logits (forward only: the full vocabulary for the
    argmax, the draft rows for the distribution). Attention counts the causal pairs within each document only
    (`attention_flops`); the rest is matrix products."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_width, kv_width = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_token = 2 * (2 * H * (q_width + 2 * kv_width) + q_width * H + 3 * H * I + H * cfg.draft_vocab_size)
    tokens = batch * sum(documents)
    drafter = 3 * ttt_steps * tokens * per_token + 3 * tokens * 2 * 3 * cfg.target_hidden_size * H
    target = tokens * 2 * cfg.target_hidden_size * (cfg.vocab_size + cfg.draft_vocab_size)
    return drafter + target + attention_flops(cfg, batch, documents, ttt_steps)


def attention_flops(cfg: DraftConfig, batch: int, documents: list[int], ttt_steps: int) -> float:
    """The attention's share of `train_step_flops`: scores and values over the causal pairs of each document,
    forward + backward (2x) per TTT step."""
    q_width = cfg.num_attention_heads * cfg.head_dim
    return 3 * ttt_steps * batch * 2 * 2 * q_width * sum(n * n / 2 for n in documents)


@dataclass
class TrainBench:
    kernel: str
    batch: int
    length: int
    documents: int  # a row's: 1 unless packed
    first_step_s: float
    step_ms: float
    tokens_per_s: float
    peak_gib: float | None  # over the whole run, the first step (compilation) included
    steady_peak_gib: float | None  # over the timed steps alone
    tflops: float
    losses: list[float] = field(default_factory=list)
    weights_sha256: str | None = None  # of the trained (master) weights, where asked: whether two runs agree in bits


def random_drafter(cfg: DraftConfig, seed: int, attention_kernel: str = "auto") -> Eagle3Draft:
    """Random weights (the embedding's standing in for a target's) and a random draft vocabulary, from `seed`, on the
    CPU."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg, attention_kernel)
    draft.embed_tokens.weight.data.normal_(0, 0.02)
    vocab_rows = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    draft.d2t.copy_(vocab_rows - torch.arange(cfg.draft_vocab_size))
    draft.t2d.zero_()
    draft.t2d[vocab_rows] = True
    return draft


def packed_documents(length: int, median: float, sigma: float, seed: int = 0) -> list[int]:
    """Lengths of log-normal documents (at least 16 tokens) filling a row of `length` exactly: the last one is cut."""
    generator, lengths = torch.Generator().manual_seed(seed), []
    while sum(lengths) < length:
        drawn = torch.empty(1).log_normal_(math.log(median), sigma, generator=generator)
        lengths.append(max(16, min(int(drawn), length - sum(lengths))))
    lengths[-1] -= sum(lengths) - length
    return lengths


def bench_train(cfg: DraftConfig, batch: int, length: int, steps: int, device: torch.device, kernel: str,
                ttt_steps: int = 7, seed: int = 0, documents: list[int] | None = None,
                optim: DrafterTrainConfig | None = None, after_step: Callable[[], None] | None = None,
                digest: bool = False) -> TrainBench:
    """`steps` optimizer steps on random inputs (the same for both kernels, from `seed`), each row one document or
    packed with `documents`; on a GPU bf16 weights with float32 masters, and the optimizers and TTT positions of
    `optim`, as the train stage runs. `after_step` is called after each of the steps + 2 (a profiler's step);
    `digest`: the trained weights' sha256 in the result."""
    documents = documents or [length]
    optim = optim or DrafterTrainConfig(epochs=1, lr=1e-4, optimizer="adamw", ttt_steps=ttt_steps)
    draft = random_drafter(cfg, seed, kernel)
    loss = prepare_for_training(draft, device, optim)
    lm_head = (torch.randn(cfg.vocab_size, cfg.target_hidden_size, device=device) * 0.02)
    features = compute_dtype(device)  # as the train stage passes the features and the target's lm_head
    lm_head = lm_head.to(features)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), device=device)
    aux = torch.randn(batch, length, 3 * cfg.target_hidden_size, device=device, dtype=features)
    final = torch.randn(batch, length, cfg.target_hidden_size, device=device, dtype=features)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in documents]).expand(batch, length)
    weights = MasterWeights(draft, features)
    optimizer = Optimizers(list(zip(weights.names, weights.masters)), optim, steps + 2, fused=device.type == "cuda")
    losses = []

    def step() -> None:  # as the train stage's loop takes one
        weights.release_gradients()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            result = ttt_loss(draft, ids, aux, final, mask, positions, lm_head, ttt_steps, loss=loss,
                              raise_positions=optim.ttt_positions == "raised")
        result.loss.backward()
        weights.step(optimizer, 0.5)
        losses.append(round(result.losses[0], 5))
        if after_step is not None:
            after_step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - start
    step()  # the optimizer's state exists from here on
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(step, device, repeats=steps, warmup=0)
    steady = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    flops = train_step_flops(cfg, batch, documents, ttt_steps)
    gib = (lambda value: round(value, 2) if value is not None else None)
    return TrainBench(kernel, batch, length, len(documents), round(first, 2), round(seconds * 1e3, 1),
                      batch * length / seconds, gib(max(peak, steady) if peak else None), gib(steady),
                      flops / seconds / 1e12, losses, weights_digest(weights.masters) if digest else None)


def weights_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 over the tensors' bytes, in order."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


# name: (DrafterTrainConfig fields, EAGLE-3.1); each one switch away from the first
VARIANTS = {"EAGLE-3, positions fixed, AdamW": ({}, False), "positions raised": ({"ttt_positions": "raised"}, False),
            "EAGLE-3.1": ({}, True), "Muon": ({"optimizer": "muon"}, False),
            "LK loss, alpha": ({"loss": "lk_alpha"}, False), "LK loss, lambda": ({"loss": "lk_lambda"}, False)}


def bench_variants(arch: dict, draft_vocab_size: int, length: int, documents: list[int], steps: int,
                   device: torch.device, peak_tflops: float) -> list[dict]:
    """What each training variant costs a step: one row of `length` packed with `documents`, the fused kernel on a
    GPU (the reference elsewhere), the optimizers as the train stage builds them."""
    kernel = "flex" if device.type == "cuda" else "reference"
    rows = []
    for name, (fields, eagle31) in VARIANTS.items():
        cfg = replace(draft_config(arch, draft_vocab_size), fc_norm=eagle31, norm_output=eagle31)
        bench = bench_train(cfg, 1, length, steps, device, kernel, documents=documents,
                            optim=DrafterTrainConfig(**{"epochs": 1, "lr": 1e-4, "optimizer": "adamw", **fields}))
        rows.append({"variant": name, **asdict(bench), "mfu": bench.tflops / peak_tflops})
        print(f"bench train variant {name}: {bench.tokens_per_s:,.0f} tok/s, {bench.step_ms} ms a step, peak "
              f"{bench.steady_peak_gib} GiB", flush=True)
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def random_features(cfg: DraftConfig, count: int, length: int, distinct: int, seed: int = 0) -> list[dict]:
    """`count` feature samples as extraction stores them (bf16 states, every position trained on), cycling
    through `distinct` random ones: generating them all would take longer than the bench."""
    generator = torch.Generator().manual_seed(seed)
    made = [{"input_ids": torch.randint(0, cfg.vocab_size, (length,), generator=generator, dtype=torch.int32),
             "loss_mask": torch.ones(length, dtype=torch.uint8),
             "aux_hidden": torch.randn(length, 3 * cfg.target_hidden_size, generator=generator).to(torch.bfloat16),
             "final_hidden": torch.randn(length, cfg.target_hidden_size, generator=generator).to(torch.bfloat16)}
            for _ in range(min(count, distinct))]
    return [made[i % len(made)] for i in range(count)]


def time_training(cfg: DraftConfig, samples: list[dict], lm_head: torch.Tensor, optim: DrafterTrainConfig,
                  device: torch.device, world: distributed.World) -> dict:
    """train_drafter over `world` (one rank alone: World()): seconds to the end of the first step (setup and
    compilation included), then the steady step time from the second step on, and every step's loss."""
    draft = random_drafter(cfg, seed=0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stamps, start = [], time.perf_counter()
    hooks = Hooks(log=lambda step, row: stamps.append(time.perf_counter()),  # synced: rows are read back
                  desc=f"bench train x{world.size}")
    result, _ = train_drafter(Recipe(draft, samples, [], lm_head, optim, 0, device, world), hooks)
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    tokens_per_step = optim.batch_size * samples[0]["input_ids"].shape[0]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del draft
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ranks": world.size, "batch_per_rank": math.ceil(optim.batch_size / world.size),
            "first_step_s": round(stamps[0] - start, 2), "step_ms": round(step_s * 1e3, 1),
            "tokens_per_s": tokens_per_step / step_s, "peak_gib": round(peak, 2) if peak else None,
            "losses": [row["train/loss"] for row in result.history]}


def run_data_parallel_bench(size_name: str, device: torch.device) -> dict | None:
    """Under torchrun: the train stage's loop (train_drafter: TTT 7, AdamW, clipping, bf16 autocast on GPUs) on
    random features at one global batch (at least one sample per rank), first on rank 0 alone (the one-GPU
    reference; the other ranks wait), then on all ranks with DDP. Returns the result on rank 0, None elsewhere."""
    size = SIZES[size_name]()
    cfg = draft_config(size.architecture, size.draft_vocab_size)
    with distributed.process_group(device) as (world, device):
        global_batch = math.ceil(size.data_parallel_batch / world.size) * world.size
        samples = random_features(cfg, global_batch * size.data_parallel_steps, size.train_seq_len, 2 * global_batch)
        lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=torch.Generator().manual_seed(1)) * 0.02
        optim = DrafterTrainConfig(epochs=1, batch_size=global_batch, packed_length=size.train_seq_len, lr=1e-4,
                                   optimizer="adamw", log_every=1, checkpoint_every=0)  # a sample a row
        runs = [time_training(cfg, samples, lm_head, optim, device, distributed.World())] if world.main else []
        distributed.wait_for_main(world)
        runs.append(time_training(cfg, samples, lm_head, optim, device, world))
        backend = torch.distributed.get_backend() if world.size > 1 else "-"
    if not world.main:
        return None
    alone, together = runs
    return {"size": size_name, "device": device_name(device), "torch": torch.__version__, "backend": backend,
            "data_parallel": {
                "world_size": world.size, "global_batch": global_batch, "length": size.train_seq_len,
                "steps": size.data_parallel_steps, "runs": runs,
                "speedup": together["tokens_per_s"] / alone["tokens_per_s"],
                "max_loss_rel_diff": max(abs(a - b) / abs(a) for a, b in zip(alone["losses"], together["losses"]))}}


def compare_with_reference(device: torch.device) -> dict:
    """The GPU's fused TTT step against the reference math on the same device, the drafter in float32 (the target's
    distribution, the same for both, in bf16): a small drafter on two rows packed with documents across several of
    the flex kernel's tiles, the compiled forward and loss (flex attention within documents, the later steps merged
    through its log-sum-exp) against the eager, explicit ones.
    Returns, for each train.loss, the largest relative differences of the per-step losses, of the acceptance
    probabilities and of the gradients (norm of the difference over the norm of the reference, per parameter)."""
    from eagle3ops.modeling.draft import STEP_LOSSES, step_loss

    cfg = DraftConfig(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                      vocab_size=1024, draft_vocab_size=256, target_hidden_size=256, head_dim=32)
    reference = random_drafter(cfg, seed=0, attention_kernel="reference").to(device)
    fused = random_drafter(cfg, seed=0, attention_kernel="flex").to(device)  # the same weights, from the same seed
    fused.compile(dynamic=False)
    generator = torch.Generator(device).manual_seed(0)
    rows = [[300, 5, 40, 295], [130, 2, 2, 506]]  # 640 tokens: five tiles of 128
    T = sum(rows[0])
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=generator, device=device)
    aux = torch.randn(2, T, 3 * cfg.target_hidden_size, generator=generator, device=device)
    final = torch.randn(2, T, cfg.target_hidden_size, generator=generator, device=device)
    mask = (torch.rand(2, T, generator=generator, device=device) > 0.2).long()
    positions = torch.stack([torch.cat([torch.arange(n, device=device) for n in row]) for row in rows])
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=generator, device=device) * 0.5
    by_loss = {}
    for kind in STEP_LOSSES:
        loss = functools.partial(step_loss, kind=kind)
        results = []
        for draft, step in ((reference, loss), (fused, torch.compile(loss, dynamic=False))):
            params = [p for p in draft.parameters() if p.requires_grad]
            result = ttt_loss(draft, ids, aux, final, mask, positions, lm_head, 7, loss=step)
            results.append((result, torch.autograd.grad(result.loss, params)))
        (expected, grads), (got, fused_grads) = results
        by_loss[kind] = {
            "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(got.losses, expected.losses)),
            "alpha_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(got.alphas, expected.alphas)),
            "grad_max_rel_diff": max(float((a - b).norm() / b.norm()) for a, b in zip(fused_grads, grads))}
    return {"dtype": "float32", "tokens": 2 * T, "documents": sum(len(row) for row in rows), "losses": by_loss,
            **{key: max(check[key] for check in by_loss.values())
               for key in ("loss_max_rel_diff", "alpha_max_rel_diff", "grad_max_rel_diff")}}
