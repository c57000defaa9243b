"""The train stage's compiled graphs travelling through DVC (training/compile_cache.py), on a GPU machine.

    python3 bench/compile_cache_stage.py --out bench/results/h100-compile-cache-stage.json

In a checkout of its own: `dvc repro train@scratch` on the embedded default (every stage up to the trained drafter;
the graphs compile and the stage saves its entry), then the machine's local compile caches removed (Inductor's,
Triton's: what a fresh machine has after `dvc pull`) and `dvc repro --force -s train@scratch`: DVC removes the
stage's outputs, the stage reads its last entry from DVC's cache through dvc.lock and loads it before the first step.
Prints each run's first step, the compile-cache line the stage printed and the drafter's digest; writes the JSON.
"""
from __future__ import annotations

import argparse
import getpass
import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CACHES = (Path(".eagle3ops/compile-cache"), Path.home() / ".triton" / "cache",
          Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")


def train_stage(command: list[str]) -> dict:
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout[-3000:], done.stderr[-3000:], flush=True)
    done.check_returncode()
    metrics = json.loads(Path("metrics/train-scratch.json").read_text())
    weights = Path("models/drafters/scratch/model.safetensors").read_bytes()
    return {"command": " ".join(command), "wall_s": round(time.time() - started, 1),
            "first_step_s": metrics["first_step_s"], "tokens_per_s": metrics["tokens_per_s"],
            "compile_cache": [line.split(": ", 1)[1] for line in done.stdout.splitlines()
                              if line.startswith("train@scratch: compile cache")],
            "drafter_sha256": hashlib.sha256(weights).hexdigest()[:16]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON written")
    args = parser.parse_args()
    runs = {"first run (empty caches: compiled, entry saved)": train_stage(["dvc", "repro", "train@scratch"])}
    for cache in CACHES:
        shutil.rmtree(cache, ignore_errors=True)
    runs["fresh caches, entry from DVC's cache"] = train_stage(["dvc", "repro", "--force", "-s", "train@scratch"])
    print("\n| train@scratch | first step s | whole stage under dvc s | tokens/s | drafter sha256 | compile cache |\n"
          "|---|---|---|---|---|---|")
    for name, run in runs.items():
        print(f"| {name} | {run['first_step_s']} | {run['wall_s']} | {run['tokens_per_s']:,.0f} | "
              f"{run['drafter_sha256']} | {' / '.join(run['compile_cache'])} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
