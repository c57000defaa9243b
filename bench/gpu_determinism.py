"""Whether training on one GPU gives the same bits when run twice, and what deterministic settings cost.

Each run is a fresh process doing what `eagle3ops bench --parts train` times: the 8B-sized drafter (random weights
and inputs from a fixed seed) trained a few optimizer steps on one packed row (bf16 weights with float32 masters,
AdamW, the compiled TTT step with flex attention), then the sha256 of the trained float32 weights. Each setting runs
three times: twice with an empty compile cache (two fresh machines of the kind: Inductor chooses its kernels again)
and once more with the cache the second left (the next run in the same checkout); each is compared with the first:

- `default`: the train stage as it runs (torch.use_deterministic_algorithms(True, warn_only=True));
- `deterministic`: also CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS's deterministic workspaces) and
  TORCHINDUCTOR_DETERMINISTIC=1 (Inductor picks kernels without timing candidates on the device).

Prints a table (tok/s, the digest, whether it equals the setting's first run) and writes JSON:

    python bench/gpu_determinism.py --out bench/results/h200-determinism.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {"default": {},
            "deterministic": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TORCHINDUCTOR_DETERMINISTIC": "1"}}


def one_run(length: int, steps: int) -> dict:
    import torch

    from eagle3ops.benchmark.sizes import SIZES
    from eagle3ops.benchmark.training import bench_train, draft_config, packed_documents

    size = SIZES["8b"]()
    cfg = draft_config(size.architecture, size.draft_vocab_size)
    bench = bench_train(cfg, 1, length, steps, torch.device("cuda"), "flex",
                        documents=packed_documents(length, 1000.0, 0.8), digest=True)
    return {"tokens_per_s": bench.tokens_per_s, "first_step_s": bench.first_step_s, "losses": bench.losses,
            "weights_sha256": bench.weights_sha256, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192, help="tokens in the packed row")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps (two more run before them)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--out", default="bench/results/h200-determinism.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.length, args.steps)))
        return
    rows = []
    for setting in args.settings:
        extra = SETTINGS[setting]
        first, cache = None, None
        for cache_state in ("cold", "cold", "warm"):
            if cache_state == "cold":
                cache = tempfile.mkdtemp(prefix=f"determinism-{setting}-")
            env = {**os.environ, **extra, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
                   "TRITON_CACHE_DIR": f"{cache}/triton"}
            done = subprocess.run([sys.executable, __file__, "--child", "--length", str(args.length), "--steps",
                                   str(args.steps)], env=env, check=True, capture_output=True, text=True)
            row = {"setting": setting, "cache": cache_state, **json.loads(done.stdout.strip().splitlines()[-1])}
            first = first or row
            row["same_bits_as_first"] = row["weights_sha256"] == first["weights_sha256"] if row is not first else None
            rows.append(row)
            print(f"{setting:14} {cache_state:5} {row['tokens_per_s']:>9,.0f} tok/s  {row['weights_sha256'][:16]}  "
                  f"same bits as the first: {row['same_bits_as_first']}", flush=True)
    warm = {row["setting"]: row for row in rows if row["cache"] == "warm"}
    cost = 1 - warm["deterministic"]["tokens_per_s"] / warm["default"]["tokens_per_s"] if len(warm) == 2 else None
    print("\n| setting | cache | tok/s | weights sha256 | same bits as the first run |\n|---|---|---:|---|---|")
    for row in rows:
        print(f"| {row['setting']} | {row['cache']} | {row['tokens_per_s']:,.0f} | {row['weights_sha256'][:16]} | "
              f"{'-' if row['same_bits_as_first'] is None else row['same_bits_as_first']} |")
    if cost is not None:
        print(f"\ndeterministic settings cost {cost:.1%} of the default's tok/s (warm runs)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"length": args.length, "steps": args.steps, "runs": rows,
                                          "deterministic_cost": cost}, indent=2) + "\n")


if __name__ == "__main__":
    main()
