"""`eagle3ops bench`: extraction and drafter-training speed, against the machine's own limits and a naive
baseline measured in the same run.

Targets and drafters are built from architecture configs with random weights (speed does not depend on the
values). Figures:
- ceilings: bf16 matrix product TFLOP/s, device copy GB/s (bytes read + written), disk write with fsync GB/s;
- extraction: the naive pipeline (`output_hidden_states=True`, copy to host and save after each batch) and ours
  (extraction/hf.py, extract_features: hooks, length-sorted batches, overlapped copies and shard writing), tokens/s,
  disk GB/s, MFU = 2 * target params * tokens/s over the measured matrix ceiling; ours also as the sequence
  length grows (at a fixed number of tokens per batch) and as the batch grows, each beside the target's forward
  alone at that shape, the compute limit;
- extraction with the target split layer-wise over the GPUs (`extract-split`, target.device_map "balanced" through
  the real loading code) against the same weights on one GPU: tokens/s, peak memory of each GPU, and the largest
  difference between the hidden states the two placements stored;
- training: one optimizer step of the TTT loss (modeling/draft.py) at each batch size and length (a document a
  row) and on rows packed with log-normal documents, the first step (compilation included) apart, tokens/s, peak
  memory, MFU from the step's counted FLOPs; `reference` rows run the explicit TTT attention (scores
  materialised), `flex` rows the fused kernel;
- training on data of varying length (`train-varlen`, benchmark/varlen.py): the train stage's loop from the start
  of a fresh process, with a cold and a warm compile cache; and, on a GPU, the fused step against the reference
  math on the same device (largest differences of losses and gradients);
- training variants (`train-variants`): one step on a row packed with log-normal documents for each of TTT
  positions fixed and raised, EAGLE-3 and 3.1, AdamW and Muon (beside AdamW), as the train stage runs them;
- online training (`online`, benchmark/online.py): extraction in bf16 and FP8, then the same epochs offline (from
  the shards) and online (the target beside the drafter), and the break-even number of epochs;
- data-parallel training (under torchrun, `run_data_parallel_bench`): the train stage's loop at one global
  batch on one rank alone, then over all ranks with DDP: tokens/s, scaling, and the loss of every step of both.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from eagle3ops.benchmark.extraction import bench_extraction, bench_split_extraction
from eagle3ops.benchmark.online import bench_online
from eagle3ops.benchmark.sizes import SIZES
from eagle3ops.benchmark.timing import device_name, measure_ceilings
from eagle3ops.benchmark.training import (
    bench_train,
    bench_variants,
    compare_with_reference,
    draft_config,
    packed_documents,
)
from eagle3ops.benchmark.varlen import bench_varlen


def run_bench(size_name: str, device: torch.device, work_dir: Path, parts: tuple[str, ...] = ("extract", "train"),
              kernels: tuple[str, ...] = ("flex", "reference"),
              train_shapes: list[tuple[int, int]] | None = None) -> dict:
    """`train_shapes` ((batch, length) pairs) replace the size's training shapes."""
    size = SIZES[size_name]()
    arch = size.architecture
    work_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"size": size_name, "device": device_name(device), "torch": torch.__version__,
                    "architecture": {k: arch[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                          "num_attention_heads", "num_key_value_heads", "vocab_size")}}
    result["ceilings"] = measure_ceilings(device, size.matmul_n, work_dir, size.disk_bytes)
    peak_tflops = result["ceilings"]["matmul_tflops"]
    if "extract" in parts:
        result["extract"] = bench_extraction(size, device, work_dir, peak_tflops)
    if "extract-split" in parts:
        result["extract_split"] = bench_split_extraction(size, device, work_dir)
    if "train" in parts:
        cfg = draft_config(arch, size.draft_vocab_size)
        shapes = train_shapes or [(b, size.train_seq_len) for b in size.train_batches] + [(1, n) for n in size.long_seq_lens]
        packed = [(1, n, packed_documents(n, size.varlen_median, size.varlen_sigma))
                  for n in size.train_packed_lengths]
        rows = []
        for kernel in [k for k in kernels if k == "reference" or device.type == "cuda"]:  # flex trains on GPUs only
            for batch, length, documents in [(b, n, None) for b, n in shapes] + packed:
                label = f"bench train {kernel} batch {batch} x {length}" + (f" ({len(documents)} documents)"
                                                                             if documents else "")
                try:
                    bench = bench_train(cfg, batch, length, size.train_steps, device, kernel, documents=documents)
                except torch.OutOfMemoryError:
                    print(f"{label}: out of memory", flush=True)
                    torch.cuda.empty_cache()
                    continue
                row = asdict(bench)
                row["mfu"] = bench.tflops / peak_tflops
                rows.append(row)
                print(f"{label}: {bench.tokens_per_s:,.0f} tok/s, first step {bench.first_step_s} s, peak "
                      f"{bench.peak_gib} GiB (steady {bench.steady_peak_gib})", flush=True)
                torch._dynamo.reset()  # each row alone: the last row's graphs, and the drafter they hold, let go
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        result["train"] = rows
    if "train-variants" in parts:
        length = size.train_packed_lengths[0]
        result["train_variants"] = bench_variants(arch, size.draft_vocab_size, length,
                                                  packed_documents(length, size.varlen_median, size.varlen_sigma),
                                                  size.train_steps, device, peak_tflops)
    if "online" in parts:
        result["online"] = bench_online(size, device, work_dir)
    if "train-varlen" in parts:
        if device.type == "cuda":
            result["fused_vs_reference"] = compare_with_reference(device)
            print(f"bench fused step vs reference: {result['fused_vs_reference']}", flush=True)
        result["train_varlen"] = bench_varlen(size_name, work_dir)
    return result


def bench(size_name: str, device: torch.device, work_dir: Path, parts: tuple[str, ...], kernels: tuple[str, ...],
          train_shapes: list[tuple[int, int]] | None, out: Path, command: str) -> dict | None:
    """`eagle3ops bench`: its outputs checked before measuring (they replace an earlier bench's only), then
    run_bench in one process, or data-parallel training under torchrun; the result, with the `command` that gave
    it, written to `out` (JSON, the table beside it as .md). None on the ranks other than 0."""
    from eagle3ops.benchmark.report import outputs, write_result
    from eagle3ops.benchmark.training import run_data_parallel_bench
    from eagle3ops.errors import InputError
    from eagle3ops.fs import check_output
    from eagle3ops.training.distributed import launched_world

    for path, kind in outputs(out, list(parts)):
        check_output(path, kind)
    world = launched_world().size
    if world > 1:  # under torchrun: data-parallel training, against one rank alone
        if list(parts) != ["train"]:
            raise InputError("under torchrun, bench measures data-parallel training only: give --parts train")
        result = run_data_parallel_bench(size_name, device)
        if result is None:  # not rank 0
            return None
    else:
        result = run_bench(size_name, device, work_dir, parts, kernels, train_shapes)
    launcher = f"torchrun --nproc-per-node {world} -m eagle3ops.cli" if world > 1 else "eagle3ops"
    result["command"] = f"{launcher} {command}"
    write_result(result, out)
    return result
