"""Training on data of varying length, timed from the start of a fresh process: the train stage's own loop
(training/loop.py, train_drafter: packing, compilation, AdamW, clipping, bf16 autocast on a GPU) over a seeded
log-normal set of lengths, as real reasoning traces vary. Each run is a new Python process: once with an empty
compile cache (cold: every graph compiled; it saves the train stage's compile-cache entry), once with an empty cache
again but that entry loaded first (travelling: a fresh machine after `dvc pull`, training/compile_cache.py), and once
with the cache the others left (warm: a resumed stage, the next experiment on this machine). Two epochs: the first is the figure from process start, the second the same data with nothing left
to compile. The setup before the first step is timed part by part: the interpreter, the imports, the device's start,
the random features with the stand-ins for the target's embedding and head, and the drafter, built as the train stage
builds a new one (training/init.py: initialised on the training device, the target's embedding moved there).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle3ops.benchmark.sizes import SIZES, BenchSize


def varlen_lengths(size: BenchSize, samples: int | None = None) -> list[int]:
    """The set's sample lengths (`samples` of them, else `varlen_samples`): log-normal around `varlen_median`,
    clipped to `varlen_range`, from `varlen_seed`."""
    generator = torch.Generator().manual_seed(size.varlen_seed)
    lengths = torch.empty(samples or size.varlen_samples).log_normal_(math.log(size.varlen_median), size.varlen_sigma,
                                                           generator=generator)
    return lengths.round().clamp(*size.varlen_range).int().tolist()


def bench_varlen(size_name: str, work_dir: Path) -> dict:
    """The cold, travelling and warm runs, each a fresh process with the compile cache under `work_dir`."""
    cache, entry = work_dir / "compile-cache", work_dir / "compile-cache-entry"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache.resolve()),
           "TRITON_CACHE_DIR": str(cache.resolve() / "triton")}
    runs = []
    for cache_state in ("cold", "travelling", "warm") if torch.cuda.is_available() else ("cold", "warm"):  # CPU: eager
        if cache_state != "warm":
            shutil.rmtree(cache, ignore_errors=True)
        out = work_dir / f"varlen-{cache_state}.json"
        out.unlink(missing_ok=True)
        launched = time.time()
        code = f"import time; started = time.time(); from eagle3ops.benchmark.varlen import train_from_process_start; " \
               f"train_from_process_start({size_name!r}, {str(out)!r}, {launched!r}, started, {str(entry)!r}, " \
               f"{cache_state!r})"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        run = json.loads(out.read_text())
        runs.append({"compile_cache": cache_state, "process_s": round(time.time() - launched, 1), **run})
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in run["setup_parts_s"].items())
        print(f"bench train-varlen ({cache_state} compile cache): epoch 1 in {run['epoch1_from_start_s']:.1f} s from "
              f"process start: setup {run['setup_s']:.1f} s ({parts}), first step {run['first_step_s']:.1f} s "
              f"(compiling {run['compile_s']:.1f} s), the other steps of epoch 1 "
              f"{run['epoch1_from_start_s'] - run['setup_s'] - run['first_step_s']:.1f} s", flush=True)
        if run["compile_parts_s"]:
            print("  compiling: " + ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in run["compile_parts_s"].items()),
                  flush=True)
    lengths = varlen_lengths(SIZES[size_name]())
    return {"samples": len(lengths), "tokens": sum(lengths), "median_length": sorted(lengths)[len(lengths) // 2],
            "shortest": min(lengths), "longest": max(lengths), "runs": runs}


def train_from_process_start(size_name: str, out: str, launched: float | None = None,
                             started: float | None = None, entry: str | None = None, cache_state: str = "") -> None:
    """In a fresh process: random features of the set's lengths (made on the device, kept on the host as the train
    stage keeps features), then two epochs of train_drafter; writes the timings, memory and compile figures. With
    `entry` (a folder), the cold run saves the stage's compile-cache entry there and the travelling one loads it
    before anything compiles, as the train stage does.

    `launched`: the wall clock when the parent started this process, `started`: when its code began (the interpreter
    up). Without `launched` the process's creation time stands in, which psutil reads to the second the machine booted
    in, not finer: up to a second early, so every figure from it up to a second long."""
    import psutil
    from torch._dynamo.utils import calculate_time_spent, counters

    from eagle3ops.benchmark.timing import sync
    from eagle3ops.benchmark.training import draft_config
    from eagle3ops.config import DrafterTrainConfig
    from eagle3ops.modeling.draft import compute_dtype
    from eagle3ops.training import compile_cache
    from eagle3ops.training.init import build_drafter
    from eagle3ops.training.loop import Hooks, Recipe, train_drafter

    imported = time.time()
    process_start = launched if launched is not None else psutil.Process().create_time()
    size = SIZES[size_name]()
    cfg = draft_config(size.architecture, size.draft_vocab_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.empty(1, device=device)  # the device's context
    sync(device)
    device_ready = time.time()
    features = compute_dtype(device)
    generator = torch.Generator(device).manual_seed(0)
    samples = [{"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=generator, device=device).int().cpu(),
                "loss_mask": torch.ones(n, dtype=torch.uint8),
                "aux_hidden": torch.randn(n, 3 * cfg.target_hidden_size, generator=generator, device=device,
                                          dtype=features).cpu(),
                "final_hidden": torch.randn(n, cfg.target_hidden_size, generator=generator, device=device,
                                            dtype=features).cpu()} for n in varlen_lengths(size)]
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=generator, device=device) * 0.02
    lm_head = lm_head.to(features)  # as the train stage passes the target's head
    # The target's embedding, on the host in the target's dtype as the train stage reads it, and a draft vocabulary.
    embedding = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator, device=device) * 0.02).to(features)
    embedding = embedding.cpu()
    vocab = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[: cfg.draft_vocab_size].sort()
    d2t = vocab.values - torch.arange(cfg.draft_vocab_size)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, vocab.values, True)
    sync(device)
    made_features = time.time()
    draft = build_drafter(cfg, embedding, d2t, t2d, seed=0, device=device)
    sync(device)
    built = time.time()
    if entry is not None and cache_state == "travelling":
        state, line = compile_cache.load(compile_cache.folder_entries(Path(entry)))
        print(f"bench train-varlen: {line}", flush=True)
        if state != "loaded":
            raise RuntimeError(f"the travelling run found no entry to load: {line}")
    optim = DrafterTrainConfig(epochs=2, batch_size=1, packed_length=size.varlen_packed_length, lr=1e-4,
                               optimizer="adamw", log_every=1, checkpoint_every=0)
    stamps: list[tuple[float, int]] = []  # (wall clock, epoch) at the end of each step: logging reads the loss back
    hooks = Hooks(log=lambda step, row: stamps.append((time.time(), int(row["train/epoch"]))),
                  desc="bench train-varlen")
    ready = time.time()
    result, _ = train_drafter(Recipe(draft, samples, [], lm_head, optim, 0, device), hooks)
    setup_parts = {**({"interpreter": started - process_start, "imports": imported - started} if started is not None
                      else {"interpreter and imports": imported - process_start}),
                   "device start": device_ready - imported, "random features": made_features - device_ready,
                   "drafter": built - made_features,
                   **({"compile cache loaded": ready - built} if cache_state == "travelling" else {})}
    ends = [stamp for stamp, epoch in stamps if epoch == 0]
    # dynamo's phases, nested: tracing (entire_frame_compile) holds the forward's backend_compile, Inductor's
    # code_gen and the wait for its Triton workers (async_compile.wait); entire_backward_compile is the backward's
    compile_parts = calculate_time_spent()
    epoch1_steps = len(ends)
    tokens = sum(len(s["input_ids"]) for s in samples)
    result_row = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "packed_length": optim.packed_length, "steps_per_epoch": epoch1_steps,
        "setup_s": round(ready - process_start, 1),  # the parts below
        "setup_parts_s": {name: round(seconds, 2) for name, seconds in setup_parts.items()},
        "epoch1_from_start_s": round(ends[-1] - process_start, 1),
        "epoch1_tokens_per_s_from_start": tokens / (ends[-1] - process_start),
        "first_step_s": round(stamps[0][0] - ready, 1),
        "compile_s": round(compile_parts.get("total_wall_time", 0.0), 1),  # dynamo's own count
        "compile_parts_s": {phase: round(seconds, 2) for phase, seconds in compile_parts.items()},
        "graphs": counters["stats"]["unique_graphs"],
        "epoch2_tokens_per_s": tokens / (stamps[-1][0] - ends[-1]),
        "padding_share": 1 - tokens / (epoch1_steps * optim.packed_length),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "losses": [row["train/loss"] for row in result.history],
    }
    Path(out).write_text(json.dumps(result_row))
    if entry is not None and cache_state == "cold":
        print(f"bench train-varlen: {compile_cache.save(Path(entry), {})}", flush=True)
