"""What the reproducible CPU mode (cpu_reproducible, src/eagle3ops/reproducible.py) costs in speed on this CPU: the
embedded default's drafter training step (the zoo's shape: hidden 64, rows of 384 tokens, batch 2, TTT 7, AdamW)
and a float32 matrix product, with this CPU's own kernels and with the mode's AVX2 ones, at 1 and 2 threads. Each
measurement a fresh process (the kernels are chosen once a process), the median of its timed repeats. Prints a
table and writes JSON:

    python bench/cpu_reproducible.py --out bench/results/cpu_reproducible-cpu-2c.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MEASURE = """
import json, os, statistics, time
import torch
if os.environ.get("PIN"):
    from eagle3ops.reproducible import pin_cpu_kernels
    pin_cpu_kernels(int(os.environ["THREADS"]))
else:
    torch.set_num_threads(int(os.environ["THREADS"]))
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft, ttt_loss
torch.manual_seed(0)
cfg = DraftConfig(hidden_size=64, intermediate_size=192, num_attention_heads=2, num_key_value_heads=2, vocab_size=512,
                  draft_vocab_size=256, target_hidden_size=64, aux_layers=[2, 4, 5], max_position_embeddings=1024)
draft = Eagle3Draft(cfg)
draft.t2d[:256] = True
optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
ids, aux, final = torch.randint(0, 512, (2, 384)), torch.randn(2, 384, 192), torch.randn(2, 384, 64)
mask, positions, head = torch.ones(2, 384, dtype=torch.long), torch.arange(384).expand(2, 384), torch.randn(512, 64)

def step():
    optimizer.zero_grad()
    ttt_loss(draft, ids, aux, final, mask, positions, head, 7).loss.backward()
    optimizer.step()

def median_s(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)

a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
print(json.dumps({"kernels": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                  "train_step_ms": 1e3 * median_s(step, 3, 15),
                  "matmul_gflops": 2 * 1024**3 / median_s(lambda: a @ b, 3, 20) / 1e9}))
"""


def measure(pinned: bool, threads: int) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")}
    env.update(THREADS=str(threads), **({"PIN": "1"} if pinned else {}))
    done = subprocess.run([sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, check=True)
    return {"mode": "reproducible (AVX2)" if pinned else "this CPU's own", **json.loads(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--out", default="bench/results/cpu_reproducible.json")
    args = parser.parse_args()
    rows = [measure(pinned, threads) for threads in args.threads for pinned in (False, True)]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"{cpu}, {os.cpu_count()} cores\n| kernels | mode | threads | train step ms | matmul GFLOP/s |\n"
          "|---|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['kernels']} | {row['mode']} | {row['threads']} | {row['train_step_ms']:.1f} | "
              f"{row['matmul_gflops']:.0f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu, "cores": os.cpu_count(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
