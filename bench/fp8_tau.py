"""Acceptance length of drafters trained on FP8 hidden states against full precision, on the embedded default.

For each seed: train@scratch on the extract stage's float32 shards and on float8_e4m3 shards of the same samples
(the extract stage run again with `--set extract.dtype=float8_e4m3` into another directory), at the same budget
(params.yaml's train section, `--set seed=S`), then eval@scratch on the benchmark sets. Every command is the
project's own, as a one-off run (`--set`): it leaves the pipeline's outputs alone. Prints a table (tau per seed, mean
and spread, bytes a token) and writes bench/results/fp8-tau-zoo.json.

    dvc repro extract@offline          # the embedded default up to its hidden states, once
    python bench/fp8_tau.py --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WORK = Path(".eagle3ops") / "fp8-tau"
ONE_OFF = Path(".eagle3ops") / "one-off" / "metrics"


def eagle3ops(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "eagle3ops.cli", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"eagle3ops {' '.join(args)} failed:\n{done.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", default="bench/results/fp8-tau-zoo.json")
    args = parser.parse_args()
    features = {"float32": "data/features", "float8_e4m3": str(WORK / "features-fp8")}
    if not Path(features["float32"], "train", "manifest.json").is_file():
        sys.exit("no data/features: run `dvc repro extract@offline` first")
    if not Path(features["float8_e4m3"], "train", "manifest.json").is_file():
        eagle3ops("extract", "--set", "extract.dtype=float8_e4m3",
                  "--set", f"extract.out_dir={features['float8_e4m3']}",
                  "--set", f"pipeline.hidden_states_dep={features['float8_e4m3']}")
    sizes = {dtype: sum(f.stat().st_size for f in Path(path).rglob("*.safetensors"))
             for dtype, path in features.items()}
    tokens = sum(json.loads(Path(features["float32"], split, "manifest.json").read_text())["tokens"]
                 for split in ("train", "eval"))
    runs = []
    for seed in args.seeds:
        for dtype, path in features.items():
            drafters = WORK / f"drafters-{dtype}-{seed}"
            common = ["--set", f"seed={seed}", "--set", f"train.out_dir={drafters}"]
            eagle3ops("train", "--init", "scratch", *common, "--set", f"extract.out_dir={path}",
                      "--set", f"pipeline.hidden_states_dep={path}")
            train = json.loads((ONE_OFF / "train-scratch.json").read_text())
            eagle3ops("eval", "--drafter", "scratch", *common)
            evaluated = json.loads((ONE_OFF / "eval-scratch.json").read_text())
            runs.append({"seed": seed, "dtype": dtype, "tau": evaluated["tau"], "eval_loss": train["eval/loss"],
                         "acc_0": train["eval/acc_0"], "lossless": evaluated["lossless"]})
            print(f"seed {seed} {dtype}: tau {evaluated['tau']:.3f}", flush=True)
    summary = {}
    for dtype in features:
        taus = [run["tau"] for run in runs if run["dtype"] == dtype]
        summary[dtype] = {"tau_mean": statistics.mean(taus),
                          "tau_stdev": statistics.stdev(taus) if len(taus) > 1 else 0.0,
                          "bytes_per_token": sizes[dtype] / tokens}
    result = {"seeds": args.seeds, "tokens": tokens, "runs": runs, "summary": summary}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("\n| features | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | stdev | bytes/token |")
    print("|---|" + "---|" * (len(args.seeds) + 3))
    for dtype, row in summary.items():
        taus = [f"{run['tau']:.3f}" for run in runs if run["dtype"] == dtype]
        print(f"| {dtype} | " + " | ".join(taus) + f" | {row['tau_mean']:.3f} | {row['tau_stdev']:.3f} | "
              f"{row['bytes_per_token']:.0f} |")


if __name__ == "__main__":
    main()
