"""Where a training step's GPU time goes: the bench's 8B drafter step (eagle3ops bench, benchmark/training.py
bench_train: the fused kernel, bf16 weights with float32 masters, AdamW) on one packed row, under torch.profiler.

Kernels are grouped by what they do (matrix products, flex attention, Inductor's fused pointwise and reduction
kernels, the optimizer, the rest), summed over the timed steps alone and divided by their number: the first step
(compilation, whose autotuning runs each candidate kernel many times) and the second (the optimizer's state
created) are not recorded, nor a warm-up step after them. On the GPU's own clock, a step's span (first kernel's
start to last kernel's end, over the recorded steps) is the time some kernel ran (kernels overlapping on several
streams counted once) and the GPU waiting for the host. Prints a table per row length and writes JSON:

    python bench/profile_train_step.py --lengths 8192 16384 --out bench/results/h200-train-profile.json
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from eagle3ops.benchmark.sizes import SIZES
from eagle3ops.benchmark.training import attention_flops, bench_train, draft_config, packed_documents, train_step_flops

# first match wins; Inductor names its generated kernels triton_{poi,red,per,tem}_...
KINDS = [("matmul", re.compile(r"gemm|cutlass|nvjet|sm90_xmma|cublas", re.I)),
         ("flex attention", re.compile(r"flex|triton_tem", re.I)),
         ("optimizer", re.compile(r"multi_tensor|foreach|adam|muon|clip", re.I)),
         ("fused reductions", re.compile(r"triton_(red|per)", re.I)),
         ("fused pointwise", re.compile(r"triton_poi", re.I)),
         ("copies and fills", re.compile(r"copy|fill|memset|cat|elementwise", re.I))]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def profile_row(length: int, steps: int) -> dict:
    size = SIZES["8b"]()
    cfg = draft_config(size.architecture, size.draft_vocab_size)
    documents = packed_documents(length, 1000.0, 0.8)
    device = torch.device("cuda")
    recorded = steps - 1  # bench_train's steps + 2: not its first two, nor the first timed one (a warm-up)
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=2, warmup=1, active=recorded, repeat=1)) as prof:
        bench = bench_train(cfg, 1, length, steps, device, "flex", documents=documents, after_step=prof.step)
    by_kernel, intervals = defaultdict(float), []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kernel[event.key] += event.device_time_total / 1e3 / recorded  # ms a step
            intervals.append((event.time_range.start, event.time_range.end))
    by_kind = defaultdict(float)
    for name, ms in by_kernel.items():
        by_kind[kind_of(name)] += ms
    total = sum(by_kernel.values())
    # the GPU's own clock over the recorded steps: from the first kernel's start to the last one's end, the time
    # some kernel ran (kernels that overlap counted once) and the rest, the GPU waiting for the host
    span_ms, busy_ms = (value / 1e3 / recorded for value in timeline(intervals))
    top = sorted(by_kernel.items(), key=lambda item: -item[1])[:15]
    # what each kind of kernel achieves: the matrix products' FLOPs (all but the attention's) over their time, the
    # attention's over the flex kernels'
    attention = attention_flops(cfg, 1, documents, 7)
    products = train_step_flops(cfg, 1, documents, 7) - attention
    achieved = {kind: flops / by_kind[kind] / 1e9 if by_kind[kind] else None
                for kind, flops in (("matmul", products), ("flex attention", attention))}
    return {"length": length, "documents": len(documents), "step_ms": bench.step_ms, "mfu_tflops": bench.tflops,
            "gpu_ms_a_step": total, "gpu_span_ms_a_step": span_ms, "gpu_busy_ms_a_step": busy_ms,
            "gpu_idle_ms_a_step": span_ms - busy_ms, "kernel_overlap_ms_a_step": total - busy_ms,
            "achieved_tflops": achieved, "by_kind_ms": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
            "top_kernels_ms": [{"kernel": name[:120], "ms": ms, "kind": kind_of(name)} for name, ms in top]}


def timeline(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(span, busy) of kernel intervals (start, end): from the first start to the last end, and the length of their
    union."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, (start, end) = 0.0, intervals[0]
    for begin, finish in intervals[1:]:
        if begin > end:
            busy, start = busy + end - start, begin
        end = max(end, finish)
    return end - intervals[0][0], busy + end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384])
    parser.add_argument("--steps", type=int, default=6, help="timed steps (one more than those recorded)")
    parser.add_argument("--out", default="bench/results/h200-train-profile.json")
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        row = profile_row(length, args.steps)
        rows.append(row)
        print(f"\n1 x {length} ({row['documents']} documents): step {row['step_ms']} ms, "
              f"{row['mfu_tflops']:.0f} TFLOP/s; on the GPU's clock a step spans {row['gpu_span_ms_a_step']:.1f} ms, kernels "
              f"busy {row['gpu_busy_ms_a_step']:.1f} ms (their sum {row['gpu_ms_a_step']:.1f}: "
              f"{row['kernel_overlap_ms_a_step']:.1f} overlapped), idle {row['gpu_idle_ms_a_step']:.1f} ms; achieved TFLOP/s: "
              + ", ".join(f"{kind} {tflops:.0f}" for kind, tflops in row["achieved_tflops"].items() if tflops))
        print("| kind | ms a step | share |\n|---|---:|---:|")
        for kind, ms in row["by_kind_ms"].items():
            print(f"| {kind} | {ms:.1f} | {ms / row['gpu_ms_a_step']:.0%} |")
        print("| top kernel | kind | ms a step |\n|---|---|---:|")
        for kernel in row["top_kernels_ms"]:
            print(f"| {kernel['kernel'][:70]} | {kernel['kind']} | {kernel['ms']:.2f} |")
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
