"""Extraction speed: the naive pipeline against ours on one device, and the target split over the GPUs."""
from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path

import torch

from eagle3ops.benchmark.sizes import BenchSize
from eagle3ops.benchmark.timing import sync, timed
from eagle3ops.modeling.draft import compute_dtype
from eagle3ops.modeling.target import default_aux_layers


def build_target(architecture: dict, device: torch.device, dtype: torch.dtype):
    """A random-weight causal LM of this architecture, built directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in architecture.items() if not k.startswith("_")})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def _samples(count: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"id": f"s{i:05d}", "input_ids": torch.randint(0, vocab, (length,), generator=generator).tolist(),
             "loss_mask": [1] * length} for i in range(count)]


@torch.no_grad()
def extract_naive(model, samples: list[dict], aux_layers: list[int], batch_size: int, out_dir: Path) -> dict:
    """What a first script does: all hidden states, copied to the host and saved synchronously per batch."""
    import os

    from safetensors.torch import save

    out_dir.mkdir(parents=True, exist_ok=True)
    device, tokens, written = model.device, 0, 0
    sync(device)
    start = time.perf_counter()
    for first in range(0, len(samples), batch_size):
        ids = torch.tensor([s["input_ids"] for s in samples[first : first + batch_size]], device=device)
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
        stacked = torch.stack([states[i] for i in aux_layers] + [states[-1]], dim=2).cpu()  # [B, T, 4, H]
        data = save({"hidden_states": stacked, "input_ids": ids.cpu()})
        with (out_dir / f"batch-{first:06d}.safetensors").open("wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        tokens, written = tokens + ids.numel(), written + len(data)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "disk_gbps": written / seconds / 1e9}


def extract_ours(model, samples: list[dict], aux_layers: list[int], batch_size: int, out_dir: Path,
                 samples_per_shard: int, dtype: str = "bfloat16") -> dict:
    from eagle3ops.extraction.hf import extract_features

    sync(model.device)
    start = time.perf_counter()
    result = extract_features(model, samples, aux_layers, out_dir, batch_size, samples_per_shard=samples_per_shard,
                              dtype=dtype, desc="bench extract")
    seconds = time.perf_counter() - start
    written = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    # Steady: while the forwards run; the drain after them (the last shard's write) is paid once per run.
    return {"tokens": result.tokens, "seconds": seconds, "tokens_per_s": result.tokens / seconds,
            "disk_gbps": written / seconds / 1e9, "drain_s": result.drain_s,
            "steady_tokens_per_s": result.tokens / (seconds - result.drain_s)}


def bench_extraction(size: BenchSize, device: torch.device, work_dir: Path, peak_tflops: float) -> dict:
    """The naive pipeline and ours at the base shape, then ours at every shape of the length and batch sweeps,
    each point over the same number of tokens and beside the forward alone at its shape."""
    arch = size.architecture
    model = build_target(arch, device, compute_dtype(device))
    params = sum(p.numel() for p in model.parameters())
    aux_layers = default_aux_layers(arch["num_hidden_layers"])
    total_tokens = size.extract_sequences * size.extract_seq_len
    mfu = lambda tokens_per_s: 2 * params * tokens_per_s / (peak_tflops * 1e12)  # noqa: E731
    base = (size.extract_batch_size, size.extract_seq_len)
    shapes = sorted({base, *((size.extract_batch_tokens // n, n) for n in size.extract_lengths),
                     *((b, size.extract_seq_len) for b in size.extract_batches)}, key=lambda shape: (shape[1], shape[0]))
    result: dict = {"target_params": params, "bytes_per_token": 4 * arch["hidden_size"] * 2, "tokens_per_point": total_tokens,
                    "shard_tokens": size.extract_shard_tokens, "base": {"batch": base[0], "length": base[1]}, "runs": []}
    for batch, length in shapes:
        samples = _samples(total_tokens // length, length, arch["vocab_size"])
        ids = torch.tensor([s["input_ids"] for s in samples[:batch]], device=device)
        forward_s = timed(partial(model, input_ids=ids, logits_to_keep=1), device, repeats=3, warmup=1)  # warms up too
        shard_samples = max(batch, size.extract_shard_tokens // length)
        pipelines = {"ours": partial(extract_ours, model, samples, aux_layers, batch, samples_per_shard=shard_samples)}
        if (batch, length) == base:
            pipelines = {"naive": partial(extract_naive, model, samples, aux_layers, batch), **pipelines}
        for name, extract in pipelines.items():
            out = work_dir / f"extract-{name}"
            row = extract(out)
            shutil.rmtree(out, ignore_errors=True)
            row.update(pipeline=name, batch=batch, length=length, mfu=mfu(row["tokens_per_s"]),
                       forward_only_tokens_per_s=batch * length / forward_s, forward_only_mfu=mfu(batch * length / forward_s))
            result["runs"].append(row)
            print(f"bench extract {name} batch {batch} x {length}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def bench_split_extraction(size: BenchSize, device: torch.device, work_dir: Path) -> dict:
    """The target saved once, then loaded by the extract stage's own code (load_target) twice: whole on one
    device, and split layer-wise over every GPU (target.device_map "balanced"); the same samples extracted by
    both, and the stored hidden states compared. On a machine with fewer than two GPUs the second placement is
    one device too (a check of the bench itself, not of a split)."""
    from eagle3ops.config import TargetConfig
    from eagle3ops.data.shards import iter_samples
    from eagle3ops.modeling.target import DTYPES, load_target

    arch = size.architecture
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    target_dir = work_dir / "split-target"
    build_target(arch, device, DTYPES[dtype]).save_pretrained(target_dir)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    placements = {"one_device": {"device": str(device)},
                  "split": {"device_map": "balanced"} if gpus >= 2 else {"device_map": {"": str(device)}}}
    samples = _samples(size.extract_sequences // 2, size.extract_seq_len, arch["vocab_size"], seed=1)
    shard_samples = max(size.extract_batch_size, size.extract_shard_tokens // size.extract_seq_len)
    aux_layers = default_aux_layers(arch["num_hidden_layers"])
    runs = []
    for name, placement in placements.items():
        model = load_target(TargetConfig(path=str(target_dir), dtype=dtype, **placement))
        layout = getattr(model, "hf_device_map", {"": str(model.device)})
        for index in range(gpus):
            torch.cuda.reset_peak_memory_stats(index)
        # A whole untimed pass first: it also pins the host memory the pipeline keeps (a one-off cost of a
        # process, which would otherwise fall on whichever placement runs first).
        extract_ours(model, samples, aux_layers, size.extract_batch_size, work_dir / "split-warmup", shard_samples)
        shutil.rmtree(work_dir / "split-warmup")
        row = extract_ours(model, samples, aux_layers, size.extract_batch_size, work_dir / f"split-{name}",
                           shard_samples)
        row.update(placement=name, modules_per_device={str(d): list(layout.values()).count(d) for d in
                                                        dict.fromkeys(layout.values())},
                   peak_gib_per_gpu=[round(torch.cuda.max_memory_allocated(i) / 2**30, 2) for i in range(gpus)])
        runs.append(row)
        print(f"bench extract-split {name}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
        del model
        if gpus:
            torch.cuda.empty_cache()
    differences = {"aux_hidden": 0.0, "final_hidden": 0.0}
    pairs = zip(iter_samples(work_dir / "split-one_device"), iter_samples(work_dir / "split-split"), strict=True)
    for (id_one, one), (id_split, split) in pairs:
        if id_one != id_split:
            raise RuntimeError(f"the two placements stored samples in another order: {id_one} vs {id_split}")
        for key in differences:
            differences[key] = max(differences[key], (one[key].float() - split[key].float()).abs().max().item())
    for path in (target_dir, work_dir / "split-one_device", work_dir / "split-split"):
        shutil.rmtree(path)
    return {"gpus": gpus, "sequences": len(samples), "seq_len": size.extract_seq_len,
            "batch_size": size.extract_batch_size, "runs": runs, "max_abs_difference": differences}
