"""Extraction through vLLM against the forward hooks: the extract stage itself, from a fresh process each (the
target's load or the engine's start included), on samples of varying length.

    python bench/extract_vllm.py [--target models/zoo/successor] [--samples 600] [--dtype float32] \
        [--out bench/results/extract_vllm.json]

Each backend runs `eagle3ops extract` in a scratch project holding the same prepared samples (lengths drawn
log-uniform between 32 and 1,000 tokens, like reasoning traces of varying length, seeded). Reported per backend:
the wall time of the stage, the time to its first complete shard (the load or the engine's start included), the
stage's own tokens/s over its extraction, and bytes written per token. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle3ops.data.prepare import write_tokenized

ROOT = Path(__file__).resolve().parents[1]


def prepared(root: Path, samples: int, vocab: int, seed: int = 0) -> int:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.empty(samples).uniform_(math.log(32), math.log(1000), generator=generator)).long()
    tokens = 0
    for split, share in (("train", slice(0, samples - samples // 10)), ("eval", slice(samples - samples // 10, None))):
        rows = [{"id": f"{split}-{i}", "input_ids": torch.randint(3, vocab, (int(n),), generator=generator).tolist(),
                 "loss_mask": [1] * int(n)} for i, n in enumerate(lengths[share])]
        write_tokenized(rows, root / "data" / "prepared" / split, {"split": split})
        tokens += sum(len(row["input_ids"]) for row in rows)
    return tokens


def first_shard_after(root: Path, start: float, found: dict) -> None:
    """Poll the stage's work directory for its first complete shard (the manifest entry comes with it)."""
    while "s" not in found:
        if any((root / ".eagle3ops" / "resume").glob("extract-*/train/shard-00000.safetensors")):
            found["s"] = time.perf_counter() - start
            return
        time.sleep(0.05)


def run_backend(backend: str, target: Path, samples: int, dtype: str, batch_size: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-extract-{backend}-") as scratch:
        root = Path(scratch)
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        tokens = prepared(root, samples, vocab)
        OmegaConf.save({"target": {"path": str(target), "lineage_dep": str(target / "config.json")},
                        "extract": {"backend": backend, "batch_size": batch_size, "samples_per_shard": 64,
                                    "dtype": dtype},
                        "mlflow": {"system_metrics": False, "registered_model": None}}, root / "params.yaml")
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
        found: dict = {}
        start = time.perf_counter()
        poller = threading.Thread(target=first_shard_after, args=(root, start, found), daemon=True)
        poller.start()
        done = subprocess.run([sys.executable, "-m", "eagle3ops.cli", "extract"], cwd=root, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        found.setdefault("s", float("nan"))
        if done.returncode != 0:
            raise SystemExit(f"{backend}: the extract stage failed:\n{done.stderr[-3000:]}")
        metrics = json.loads((root / "metrics" / "extract.json").read_text())
        shards = sum(f.stat().st_size for f in (root / "data" / "features").rglob("shard-*.safetensors"))
        return {"backend": backend, "samples": samples, "tokens": tokens, "dtype": dtype, "wall_s": round(wall, 1),
                "first_shard_s": round(found["s"], 1), "tokens_per_s": metrics["tokens_per_s"],
                "bytes_per_token": round(shards / tokens, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "zoo" / "successor",
                        help="a Hugging Face target directory (default: the zoo's, built by `eagle3ops zoo`)")
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--dtype", default="float32", help="extract.dtype: float32 | bfloat16 | float8_e4m3")
    parser.add_argument("--batch-size", type=int, default=16, help="extract.batch_size (vllm: requests in flight)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "extract_vllm.json")
    args = parser.parse_args()
    if not (args.target / "config.json").is_file():
        raise SystemExit(f"{args.target}: no config.json; build the zoo first (eagle3ops zoo)")
    rows = [run_backend(backend, args.target.resolve(), args.samples, args.dtype, args.batch_size)
            for backend in ("hf", "vllm")]
    header = f"{'backend':8} {'samples':>7} {'tokens':>8} {'wall s':>7} {'1st shard s':>11} {'tok/s':>9} {'B/token':>8}"
    print(header)
    for row in rows:
        print(f"{row['backend']:8} {row['samples']:>7} {row['tokens']:>8} {row['wall_s']:>7} "
              f"{row['first_shard_s']:>11} {row['tokens_per_s']:>9,.0f} {row['bytes_per_token']:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": f"{platform.machine()}, "
                                    f"{os.cpu_count()} cores", "runs": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
