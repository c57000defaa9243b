"""What DVC costs on hidden-state-sized data: `dvc add`, `dvc status` cold and warm, `dvc push` to a local remote
and `dvc pull` into a fresh clone, for N shard-like files totalling --total-gb.

    python bench/dvc_scale.py                              # 20 GB in 1 GiB shards
    python bench/dvc_scale.py --total-gb 2 --shard-mb 1    # the same question for 2,000 small files
    python bench/dvc_scale.py --total-gb 4 --cache-type reflink,hardlink,symlink,copy   # another link order

The repository is a temporary git + DVC repo with the project's .dvc/config: its cache link type (unless
--cache-type), and its default remote, the directory beside the repository. The shards are written by the extract
stage's own writer (`write_safetensors`: aux_hidden [T, 3H] and final_hidden [T, H] in bf16 at Kimi-K2.5's
H = 7168, input_ids, loss_mask), with random values, incompressible as real hidden states are, plus a manifest.
"cold" status runs without DVC's hash database and with the files dropped from the page cache, so it re-reads and
re-hashes every byte; "warm" is the next one, answered by the database from each file's inode, size and mtime. The
remote's files are dropped from the page cache before the pull too. The peak disk use is twice --total-gb (the
linked workspace and cache, then the remote; the original repository is deleted before the pull); with less than
2.5x free, the size is scaled down, and the result says so. Everything is deleted at the end. Prints a table and
writes the JSON to bench/results/dvc_scale-<time>.json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from configobj import ConfigObj
from tabulate import tabulate

from eagle3ops.data.shards import MANIFEST, write_safetensors
from eagle3ops.fs import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GB = 1e9
HIDDEN = 7168                      # Kimi-K2.5 / DeepSeek-V3
TOKEN_BYTES = 4 * HIDDEN * 2 + 5   # three aux layers and the final state in bf16, an int32 id, a uint8 mask
PEAK_DISK_FACTOR = 2.5             # workspace + cache (linked), then the remote, and room for everyone else


def dvc(args: list[str], cwd: Path) -> float:
    """Run `dvc ARGS` in `cwd` (this venv's, no analytics); returns its wall time in seconds."""
    env = {**os.environ, "DVC_NO_ANALYTICS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    start = time.perf_counter()
    done = subprocess.run(["dvc", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"dvc {' '.join(args)} failed in {cwd}:\n{done.stdout}{done.stderr}")
    return time.perf_counter() - start


def git(args: list[str], cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.email=bench@example.com", "-c", "user.name=bench", *args], cwd=cwd,
                   check=True, capture_output=True)


def drop_from_page_cache(directory: Path) -> None:
    """Evict the files' pages (written back first), so the next read comes from the disk: this process's files
    only, not the whole machine's cache."""
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def write_shards(directory: Path, count: int, shard_bytes: int, seed: int) -> int:
    """`count` safetensors shards of ~`shard_bytes` each as the extract stage writes them; returns the bytes."""
    generator = torch.Generator().manual_seed(seed)
    tokens = max(1, shard_bytes // TOKEN_BYTES)
    shards = []
    for index in range(count):
        values = torch.randint(-2**15, 2**15, (tokens, 4 * HIDDEN), dtype=torch.int16, generator=generator)
        hidden = values.view(torch.bfloat16)  # [T, 4H]
        columns = {"aux_hidden": [hidden[:, : 3 * HIDDEN]], "final_hidden": [hidden[:, 3 * HIDDEN:]],
                   "input_ids": [torch.randint(0, 163840, (tokens,), dtype=torch.int32, generator=generator)],
                   "loss_mask": [torch.ones(tokens, dtype=torch.uint8)],
                   "offsets": [torch.tensor([0, tokens], dtype=torch.int64)]}
        name = f"shard-{index:05d}.safetensors"
        sha256 = write_safetensors(directory / name, columns, {"format": "eagle3ops-bench"})
        shards.append({"file": name, "sha256": sha256, "samples": 1, "tokens": tokens})
    write_json_atomic(directory / MANIFEST, {"shards": shards, "samples": count, "tokens": tokens * count})
    return sum(f.stat().st_size for f in directory.iterdir())


def link_type(data: Path) -> str:
    """How the checkout put a shard in the workspace: a hardlink or symlink to the cache, or its own bytes."""
    shard = next(data.glob("*.safetensors"))
    if shard.is_symlink():
        return "symlink"
    return "hardlink" if shard.stat().st_nlink > 1 else "reflink or copy"


def run(args: argparse.Namespace) -> dict:
    work = Path(args.dir)
    free = shutil.disk_usage(work).free
    total_gb = args.total_gb
    scaled_down_from = None
    if total_gb * GB * PEAK_DISK_FACTOR > free:
        scaled_down_from, total_gb = total_gb, free / GB / PEAK_DISK_FACTOR
        print(f"only {free / GB:.1f} GB free in {work}: scaled down from {scaled_down_from} GB to {total_gb:.1f} GB")
    shard_bytes = int(args.shard_mb * 2**20)
    count = max(1, round(total_gb * GB / shard_bytes))
    root = Path(tempfile.mkdtemp(dir=work, prefix="eagle3ops-dvc-scale-"))
    try:
        repo, clone = root / "repo", root / "clone"
        data = repo / "data" / "features"
        data.mkdir(parents=True)
        git(["init", "-q"], repo)
        dvc(["init", "-q"], repo)
        shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")  # default remote: root/eagle3ops-dvc-storage
        cache_type = args.cache_type or ConfigObj(str(ROOT / ".dvc" / "config"))["cache"]["type"]
        dvc(["config", "cache.type", cache_type], repo)  # tracked: the clone has it too
        dvc(["config", "--local", "core.site_cache_dir", str(root / "site-cache" / "repo")], repo)

        start = time.perf_counter()
        size = write_shards(data, count, shard_bytes, args.seed)
        timings = {"write": time.perf_counter() - start}
        files = count + 1  # the manifest
        timings["add"] = dvc(["add", "-q", "data/features"], repo)
        shutil.rmtree(root / "site-cache" / "repo")  # DVC's hash database: gone, every file is hashed again
        drop_from_page_cache(repo)
        timings["status_cold"] = dvc(["status", "-q"], repo)  # -q: exits 1 (and stops here) unless up to date
        timings["status_warm"] = dvc(["status", "-q"], repo)
        linked = link_type(data)
        git(["add", "-A"], repo)
        git(["commit", "-q", "-m", "features"], repo)
        timings["push"] = dvc(["push", "-q"], repo)

        git(["clone", "-q", str(repo), str(clone)], root)
        shutil.rmtree(repo)  # the clone pulls from the remote alone; and the disk holds two copies at most
        dvc(["config", "--local", "core.site_cache_dir", str(root / "site-cache" / "clone")], clone)
        drop_from_page_cache(root / "eagle3ops-dvc-storage")
        timings["pull"] = dvc(["pull", "-q"], clone)
        timings["status_after_pull"] = dvc(["status", "-q"], clone)
        if sorted(p.name for p in (clone / "data" / "features").iterdir()) != sorted(
                [f"shard-{i:05d}.safetensors" for i in range(count)] + [MANIFEST]):
            raise SystemExit("the pulled clone does not hold every shard")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    moved = ("write", "add", "push", "pull")  # steps that move every byte; a cold status reads and hashes them
    return {"files": files, "bytes": size, "shard_bytes": shard_bytes, "scaled_down_from_gb": scaled_down_from,
            "disk_free_gb_before": round(free / GB, 1), "cache_type": cache_type, "link_type": linked,
            "seconds": timings,
            "gb_per_s": {name: size / GB / timings[name] for name in moved},
            "hashing_gb_per_s": size / GB / timings["status_cold"],
            "dvc": version("dvc"), "cpu_count": os.cpu_count(), "dir": str(work)}


def table(result: dict) -> str:
    rates = {**result["gb_per_s"], "status_cold": result["hashing_gb_per_s"]}
    rows = [(name, f"{seconds:.2f}", f"{rates[name]:.2f}" if name in rates else "-")
            for name, seconds in result["seconds"].items()]
    head = (f"{result['files']} files, {result['bytes'] / GB:.1f} GB ({result['shard_bytes'] / 2**20:.0f} MiB "
            f"shards), cache.type {result['cache_type']}: {result['link_type']} after add, dvc {result['dvc']}, "
            f"{result['cpu_count']} CPUs\n")
    return head + tabulate(rows, headers=["step", "seconds", "GB/s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-gb", type=float, default=20.0, help="bytes in all (default: %(default)s)")
    parser.add_argument("--shard-mb", type=float, default=1024.0, help="MiB a shard (default: %(default)s)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary repos go (one disk)")
    parser.add_argument("--cache-type", help="DVC's cache.type (default: the project's .dvc/config); one that "
                        "copies on commit needs a third copy's worth of disk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="the JSON (default: bench/results/dvc_scale-<time>.json)")
    args = parser.parse_args(argv)
    result = run(args)
    print(table(result))
    out = Path(args.out or RESULTS / f"dvc_scale-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json_atomic(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
