"""Acceptance length of the drafter-training variants on the embedded default, over several seeds.

One factor at a time against the former defaults (EAGLE-3, every TTT step at the sample's positions, AdamW; a warm
start keeping its head), then the defaults params.yaml sets now, and the training objectives (train.loss) on them.
tau is measured at eval.temperature (0, greedy) and at eval.sampled_temperature (1.0), each drafter at both. Every variant trains at the same budget
(params.yaml's train section, `--set seed=S`) and is measured by the eval stage on the benchmark sets; every command
is the project's own, as a one-off run (`--set`), so the pipeline's outputs stay as they are. Prints a table (tau
per seed, mean and spread, the change against the first row) and writes bench/results/variants-tau-zoo.json. Each
trained drafter is also exported in both serving layouts, which `eagle3ops export` validates against the target
(the run stops at an export that would not serve).

    dvc repro extract@offline          # the embedded default up to its hidden states, once
    python bench/variants_tau.py --seeds 0 1 2
    python bench/variants_tau.py --rows defaults-scratch defaults-warm   # re-measure some rows, keep the others
    python bench/variants_tau.py --lanes 3 ...   # on a GPU the small zoo leaves idle: three runs at a time

With `--lanes N`, N processes share the (row, seed) runs, each in its own copy of the checkout under
.eagle3ops/variants-tau/lane-K/ (a one-off run writes its metrics to a fixed path in its working directory), the
compile cache shared; the copies hold the data and DVC's cache, so they cost their size on disk each.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from fp8_tau import ONE_OFF, eagle3ops

WORK = Path(".eagle3ops") / "variants-tau"
BEFORE = {"train.ttt_positions": "fixed", "train.draft.fc_norm": "false", "train.draft.norm_output": "false",
          "train.optimizer": "adamw", "train.warm_start_vocab": "keep"}
# key: (what the row is, the drafter it trains, its --set values; None = params.yaml as it is)
ROWS = {
    "before": ("EAGLE-3, positions fixed, AdamW", "scratch", BEFORE),
    "raised": ("positions raised (step k at t + k)", "scratch", {**BEFORE, "train.ttt_positions": "raised"}),
    "eagle31": ("EAGLE-3.1 (fc_norm, norm_output)", "scratch",
                {**BEFORE, "train.draft.fc_norm": "true", "train.draft.norm_output": "true"}),
    "muon": ("Muon (muon_lr = 10 x lr, 3e-2)", "scratch",
             {**BEFORE, "train.optimizer": "muon", "train.muon_lr": "3e-2"}),
    "muon-lr": ("Muon (muon_lr = lr, 3e-3)", "scratch", {**BEFORE, "train.optimizer": "muon", "train.muon_lr": "3e-3"}),
    "muon-raised": ("Muon (muon_lr = lr) and positions raised", "scratch",
                    {**BEFORE, "train.optimizer": "muon", "train.muon_lr": "3e-3", "train.ttt_positions": "raised"}),
    "keep": ("warm start, head kept", "warm_start", BEFORE),
    "remap": ("warm start, re-headed", "warm_start", {**BEFORE, "train.warm_start_vocab": "remap"}),
    "defaults-scratch": ("the defaults: scratch", "scratch", None),
    "defaults-warm": ("the defaults: warm start", "warm_start", None),
    "lk-alpha": ("the defaults, LK loss alpha (-log alpha)", "scratch", {"train.loss": "lk_alpha"}),
    "lk-lambda": ("the defaults, LK loss lambda (w * KL + (1 - w) * (1 - alpha))", "scratch",
                  {"train.loss": "lk_lambda"}),
}
# the decoder measures; vLLM's agreement with it is the eval stage's own check (eval.engine), not this table's
EVAL = ["--set", "eval.engine=null"]


def measure(key: str, seed: int) -> dict:
    _, init, settings = ROWS[key]
    sets = [f"seed={seed}", f"train.out_dir={WORK / f'drafters-{key}-{seed}'}",
            *(f"{name}={value}" for name, value in (settings or {}).items())]
    options = [arg for value in sets for arg in ("--set", value)]
    eagle3ops("train", "--init", init, *options)
    train = json.loads((ONE_OFF / f"train-{init}.json").read_text())
    eagle3ops("eval", "--drafter", init, *options, *EVAL)
    evaluated = json.loads((ONE_OFF / f"eval-{init}.json").read_text())
    drafter = WORK / f"drafters-{key}-{seed}" / init
    for fmt in ("sglang", "speculators"):  # written only when validate-export passes: it raises otherwise
        eagle3ops("export", str(drafter), str(WORK / f"export-{key}-{seed}" / fmt), "--format", fmt, "--target",
                  "models/zoo/successor")
    return {"row": key, "seed": seed, "tau": evaluated["tau"], "tau_ci": [evaluated["tau_ci_low"],
                                                                         evaluated["tau_ci_high"]],
            **_sampled(evaluated), "eval_loss": train["eval/loss"], "acc_0": train["eval/acc_0"],
            "alpha_0": train.get("eval/alpha_0"), "lossless": evaluated["lossless"], "exports_valid": True}


def _sampled(evaluated: dict) -> dict:
    """tau at eval.sampled_temperature, where measured."""
    sampled = evaluated.get("sampled")
    if not sampled:
        return {}
    return {"sampled_temperature": sampled["temperature"], "tau_sampled": sampled["tau"],
            "tau_sampled_ci": [sampled["tau_ci_low"], sampled["tau_ci_high"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        help="the rows to measure at --seeds; every other row and seed is kept from --out")
    parser.add_argument("--out", default="bench/results/variants-tau-zoo.json")
    parser.add_argument("--lanes", type=int, default=1, help="runs at a time, each in its own copy of the checkout")
    args = parser.parse_args()
    if not Path("data/features/train/manifest.json").is_file():
        sys.exit("no data/features: run `dvc repro extract@offline` first")
    out = Path(args.out)
    measuring = {(key, seed) for key in args.rows for seed in args.seeds}
    kept = [run for run in json.loads(out.read_text())["runs"]
            if (run["row"], run["seed"]) not in measuring] if out.is_file() else []
    if args.lanes > 1:
        summary = write(out, kept + in_lanes(sorted(measuring, key=lambda run: (run[1], run[0])), args.lanes))
    for key in args.rows if args.lanes == 1 else ():
        for seed in args.seeds:
            kept.append(measure(key, seed))
            print(f"{key} seed {seed}: tau {kept[-1]['tau']:.3f}, sampled {kept[-1].get('tau_sampled')}", flush=True)
            summary = write(out, kept)  # after every run: an interrupted bench keeps what it measured
    first = next(iter(summary.values()))["tau_mean"]
    print("\n| variant | drafter | tau per seed | mean ± stdev | vs first row | tau sampled per seed | mean ± stdev |")
    print("|---|---|---|---|---|---|---|")
    for row in summary.values():
        sampled = row.get("tau_sampled")
        print(f"| {row['variant']} | {row['drafter']} | {' / '.join(f'{t:.3f}' for t in row['taus'])} | "
              f"{row['tau_mean']:.3f} ± {row['tau_stdev']:.3f} | {row['tau_mean'] - first:+.3f} | "
              + (f"{' / '.join(f'{t:.3f}' for t in sampled['taus'])} | {sampled['mean']:.3f} ± {sampled['stdev']:.3f} |"
                 if sampled else "| |"))


def in_lanes(runs: list[tuple[str, int]], lanes: int) -> list[dict]:
    """Measure `runs` in `lanes` processes at once, each in a copy of the checkout; returns what they measured."""
    started = []
    for lane in range(min(lanes, len(runs))):
        root = WORK / f"lane-{lane}"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(".", root, symlinks=True, ignore=lambda folder, names: {".eagle3ops", "mlruns", "mlflow.db"}
                        & set(names) if folder == "." else set())
        cache = Path(".eagle3ops", "compile-cache").absolute()
        cache.mkdir(parents=True, exist_ok=True)
        (root / ".eagle3ops").mkdir()
        (root / ".eagle3ops" / "compile-cache").symlink_to(cache)  # one compilation serves every lane
        share = runs[lane::lanes]
        command = [sys.executable, str(Path(__file__).absolute()), "--out", "lane.json", "--rows",
                   *sorted({key for key, _ in share}), "--seeds", *sorted({str(seed) for _, seed in share})]
        if len({key for key, _ in share}) * len({seed for _, seed in share}) != len(share):
            sys.exit(f"lane {lane} would measure more than its share {share}: choose --lanes to divide the runs")
        print(f"lane {lane} ({root}): {', '.join(f'{key} seed {seed}' for key, seed in share)}", flush=True)
        started.append((root, subprocess.Popen(command, cwd=root)))
    failed = [str(root) for root, process in started if process.wait()]
    if failed:
        sys.exit(f"lanes failed: {', '.join(failed)} (their lane.json holds what they measured)")
    return [run for root, _ in started for run in json.loads((root / "lane.json").read_text())["runs"]]


def write(out: Path, runs: list[dict]) -> dict:
    runs.sort(key=lambda run: (list(ROWS).index(run["row"]), run["seed"]))
    summary = {}
    for key, (label, init, settings) in ROWS.items():
        taus = [run["tau"] for run in runs if run["row"] == key]
        if taus:
            summary[key] = {"variant": label, "drafter": init, "sets": settings, "taus": taus,
                            "tau_mean": statistics.mean(taus),
                            "tau_stdev": statistics.stdev(taus) if len(taus) > 1 else 0.0}
            sampled = [run["tau_sampled"] for run in runs if run["row"] == key and "tau_sampled" in run]
            if sampled:
                summary[key]["tau_sampled"] = {
                    "temperature": next(run["sampled_temperature"] for run in runs if "tau_sampled" in run),
                    "taus": sampled, "mean": statistics.mean(sampled),
                    "stdev": statistics.stdev(sampled) if len(sampled) > 1 else 0.0}
    out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2) + "\n")
    return summary

if __name__ == "__main__":
    main()
