"""Online training against extraction + offline training, on one device, on the same samples of varying length.

The target (random weights, bf16) and the drafter share the device. Measured, each with the project's own code:
- extraction (extraction/hf.py) of the samples in bf16 and in FP8 (data/hidden_states.py): tokens/s, bytes a token;
- offline training: the bf16 shards read back (training/data.py), then `epochs` epochs of the train stage's loop;
- online training: the same epochs with the target beside the drafter (training/online.py), nothing stored.
Every epoch is timed from the loop's steps (the first holds the compilation, which both modes pay alike). The
break-even number of epochs is where the two totals meet: offline pays extraction and the read-back once (with bf16
or FP8 shards), online the target's forward every epoch. (Offline training from FP8 shards is taken at the bf16
shards' steady rate: the dequantisation on the device is a few elementwise kernels a step.)
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from eagle3ops.benchmark.extraction import build_target, extract_ours
from eagle3ops.benchmark.sizes import BenchSize
from eagle3ops.benchmark.training import draft_config, random_drafter
from eagle3ops.benchmark.varlen import varlen_lengths
from eagle3ops.config import DrafterTrainConfig
from eagle3ops.data.hidden_states import FP8, bytes_per_token
from eagle3ops.data.prepare import extraction_order
from eagle3ops.modeling.target import default_aux_layers
from eagle3ops.training.data import load_feature_samples
from eagle3ops.training.loop import Hooks, Recipe, train_drafter
from eagle3ops.training.online import TargetStates


def bench_online(size: BenchSize, device: torch.device, work_dir: Path, epochs: int = 3) -> dict:
    arch = size.architecture
    target = build_target(arch, device, torch.bfloat16)
    aux_layers = default_aux_layers(arch["num_hidden_layers"])
    hidden = arch["hidden_size"]
    lengths = varlen_lengths(size, size.online_samples)
    generator = torch.Generator().manual_seed(0)
    samples = [{"id": f"s{i:05d}", "loss_mask": [1] * n,
                "input_ids": torch.randint(0, arch["vocab_size"], (n,), generator=generator).tolist()}
               for i, n in enumerate(lengths)]
    tokens = sum(lengths)
    result: dict = {"samples": len(samples), "tokens": tokens, "epochs": epochs,
                    "packed_length": size.varlen_packed_length, "extract": {},
                    "target_gib": round(sum(p.numel() * p.element_size() for p in target.parameters()) / 2**30, 2)}
    for dtype in ("bfloat16", FP8):
        out = work_dir / f"online-features-{dtype}"
        shutil.rmtree(out, ignore_errors=True)
        run = extract_ours(target, samples, aux_layers, size.online_extract_batch, out, size.online_samples_per_shard,
                           dtype)
        result["extract"][dtype] = {**run, "bytes_per_token": bytes_per_token(dtype, hidden) + 5,
                                    "bytes": sum(f.stat().st_size for f in out.iterdir())}
        started = time.perf_counter()
        load_feature_samples(out)  # what offline training reads back before its first step
        result["extract"][dtype]["read_s"] = round(time.perf_counter() - started, 2)
        print(f"bench online: extraction in {dtype}: {run['tokens_per_s']:,.0f} tok/s, "
              f"{result['extract'][dtype]['bytes'] / 1e9:.2f} GB", flush=True)
    shutil.rmtree(work_dir / f"online-features-{FP8}")

    cfg = draft_config(arch, size.draft_vocab_size)
    lm_head = (torch.randn(cfg.vocab_size, hidden, generator=generator) * 0.02).to(torch.bfloat16)
    optim = DrafterTrainConfig(epochs=epochs, batch_size=1, packed_length=size.varlen_packed_length, lr=1e-4,
                               optimizer="adamw", log_every=1, checkpoint_every=0)
    features_dir = work_dir / "online-features-bfloat16"
    stored = load_feature_samples(features_dir)
    result["offline"] = _timed_epochs(Recipe(random_drafter(cfg, seed=0), stored, [], lm_head, optim, 0, device))
    shutil.rmtree(features_dir)
    del stored
    torch._dynamo.reset()
    tokens_only = [{"input_ids": torch.tensor(s["input_ids"], dtype=torch.int32),
                    "loss_mask": torch.tensor(s["loss_mask"], dtype=torch.uint8)} for s in samples]
    tokens_only = [tokens_only[i] for i in extraction_order(lengths)]
    states = TargetStates(target, aux_layers, device, len(tokens_only), 0.0)
    result["online"] = _timed_epochs(Recipe(random_drafter(cfg, seed=0), tokens_only, [], lm_head, optim, 0, device,
                                            hidden_states=states))
    # the same steps on the same states, up to the rounding of the target run on packed rows instead of batches
    result["loss_max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(result["online"]["losses"],
                                                                                      result["offline"]["losses"]))
    # Both modes compile the same drafter graphs once (the first epoch's excess over a steady one; the second run
    # finds the first's compile cache, so their first epochs do not compare): the totals leave it out.
    steady = {mode: result[mode]["steady_epoch_s"] for mode in ("offline", "online")}
    extra = steady["online"] - steady["offline"]  # what online pays each epoch beyond offline: the target's forward
    result["totals_s"], result["break_even_epochs"] = {}, {}
    for dtype, run in result["extract"].items():
        before = run["seconds"] + run["read_s"]  # extraction, then reading the shards back
        result["totals_s"][dtype] = {str(e): {"offline": round(before + e * steady["offline"], 1),
                                              "online": round(e * steady["online"], 1)} for e in range(1, epochs + 1)}
        result["break_even_epochs"][dtype] = round(before / extra, 2) if extra > 0 else None
    return result


def _timed_epochs(recipe: Recipe) -> dict:
    stamps: list[tuple[float, int]] = []  # (time, epoch) at the end of each step: logging reads the loss back
    hooks = Hooks(log=lambda step, row: stamps.append((time.perf_counter(), int(row["train/epoch"]))),
                  desc="bench online" if recipe.hidden_states else "bench offline")
    if recipe.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(recipe.device)
    started = time.perf_counter()
    result, _ = train_drafter(recipe, hooks)
    ends, last = [], started
    for epoch in range(recipe.optim.epochs):
        end = max(stamp for stamp, e in stamps if e == epoch)
        ends.append(end - last)
        last = end
    tokens = sum(len(s["input_ids"]) for s in recipe.train_samples)
    steady = sum(ends[1:]) / max(1, len(ends) - 1)
    return {"epoch_s": [round(s, 2) for s in ends], "steady_epoch_s": round(steady, 2),
            "compile_s": round(ends[0] - steady, 1),
            "steady_tokens_per_s": round(tokens / steady),
            "steps_per_epoch": sum(1 for _, e in stamps if e == 0),
            "losses": [row["train/loss"] for row in result.history],
            "peak_gib": round(torch.cuda.max_memory_allocated(recipe.device) / 2**30, 2)
            if recipe.device.type == "cuda" else None}
