"""Compiled graphs that travel with the lineage: the train stage saves PyTorch's portable cache artifacts
(`torch.compiler.save_cache_artifacts`: Inductor's and AOTAutograd's graphs with their Triton kernels) as an output
of its own, so the next run of the stage, a new experiment or a fresh machine after `dvc pull`, loads the graphs
instead of compiling them (22 s of the first step on an H100, docs/performance.md).

The output, models/compile-cache/train-<init>/, holds one entry per machine kind (<key>.bin, its bytes) and
index.json ({key: the machine it was made on, its sha256 and size}). A machine's key digests what the graphs depend
on: the GPU model and its compute capability, CUDA, torch, Triton and Python; an entry is loaded only on a machine
whose key is the same, and otherwise named and skipped with what differs. Entries of other machine kinds are carried
over (the newest KEPT_MACHINES), so hardware A and B take turns without compiling again.

DVC removes a stage's outputs before it runs it: the last run's entries are then read from DVC's cache, through the
md5s dvc.lock records for the output. The output is a cache, not a result: its bytes differ from run to run, nothing
depends on it, and `eagle3ops reproduce` leaves it out of its comparison.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from eagle3ops.fs import WORK_DIR, atomic_dir

# Inductor's and Triton's caches of this checkout, kept for the next process (a resumed or re-run stage, the next
# experiment); TORCHINDUCTOR_CACHE_DIR, when set, names another place. The entries below fill it on a new machine.
LOCAL_DIR = WORK_DIR / "compile-cache"
OUTPUT_ROOT = Path("models/compile-cache")
INDEX = "index.json"
KEPT_MACHINES = 4


def use_local_cache() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(LOCAL_DIR.resolve()))


def stage_output(stage: str) -> Path:
    """models/compile-cache/train-scratch for train@scratch (dvc.yaml names the same path)."""
    return OUTPUT_ROOT / stage.replace("@", "-")


def this_machine() -> dict[str, str]:
    """What compiled graphs depend on, beyond the code that Inductor's own keys hold."""
    on_gpu = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if on_gpu else f"cpu {platform.machine()}",
            "capability": ".".join(map(str, torch.cuda.get_device_capability())) if on_gpu else "",
            "cuda": torch.version.cuda or "", "torch": torch.__version__, "triton": _version("triton"),
            "python": platform.python_version()}


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:  # CPU-only torch comes without Triton
        return ""


def machine_key(machine: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]


def last_entries(stage: str, root: Path = Path(".")) -> dict[str, Path]:
    """{file name: a readable copy} of the stage's last output: the folder itself where it is still there (the stage
    run without DVC), else the files dvc.lock records for it, from DVC's cache (`dvc repro` removed the folder).
    Empty where neither has it: a first run, or a cache that `dvc pull` did not fill."""
    # Here, not at the top: the lineage module brings MLflow, which the training loop (the bench's processes, a GPU
    # machine with the trainer alone) neither needs nor waits for at its start.
    from eagle3ops.tracking.lineage import dir_listing, lock_stages

    output = stage_output(stage)
    if (root / output / INDEX).is_file():
        return folder_entries(root / output)
    recorded = [out for out in lock_stages(root / "dvc.lock").get(stage, {}).get("outs") or []
                if out.get("path") == output.as_posix() and str(out.get("md5", "")).endswith(".dir")]
    listing = dir_listing(recorded[0]["md5"], root.resolve()) if recorded else {}
    return {name: path for name, (_, path) in listing.items() if path.is_file()}


def folder_entries(folder: Path) -> dict[str, Path]:
    return {path.name: path for path in folder.iterdir() if path.is_file()} if folder.is_dir() else {}


def load(entries: dict[str, Path]) -> tuple[str, str]:
    """This machine's entry hot-loaded into the local caches, where there is one: (what came of it, for the run's
    tag: loaded | none | other_machines | damaged; the line to print, which says why). An entry whose bytes are not
    the index's is skipped: a cache never fails a run."""
    if INDEX not in entries:
        return "none", "compile cache: none from an earlier run; the graphs compile"
    index = json.loads(entries[INDEX].read_text(encoding="utf-8"))
    machine = this_machine()
    key = machine_key(machine)
    if key not in index:
        return "other_machines", "compile cache: no entry for this machine; the graphs compile. " + "; ".join(
            f"{other['made_on']['device']}: {_differences(other['made_on'], machine)}" for other in index.values())
    blob = entries[f"{key}.bin"].read_bytes() if f"{key}.bin" in entries else b""
    if hashlib.sha256(blob).hexdigest() != index[key]["sha256"]:
        return "damaged", f"compile cache: this machine's entry ({key}.bin) is not the bytes its index records; the graphs compile"
    use_local_cache()
    started = time.perf_counter()
    info = torch.compiler.load_cache_artifacts(blob)
    counts = {kind: len(keys) for kind, keys in (info.artifacts if info else {}).items()}
    return "loaded", (f"compile cache: loaded this machine's entry ({len(blob) / 2**20:.1f} MiB, "
            f"{', '.join(f'{n} {kind}' for kind, n in sorted(counts.items())) or 'nothing'}) in "
            f"{time.perf_counter() - started:.1f} s")


def _differences(made_on: dict[str, str], machine: dict[str, str]) -> str:
    return ", ".join(f"{name} {made_on.get(name) or '-'} there, {value or '-'} here"
                     for name, value in machine.items() if made_on.get(name) != value)


def save(output: Path, carried: dict[str, Path]) -> str:
    """`output` (stage_output's) written whole: this process's artifacts (every graph it compiled or loaded) as this
    machine's entry, beside the carried entries of other machines; the line to print, empty where there is nothing
    to say (eager on a CPU, no entry of any machine)."""
    saved = torch.compiler.save_cache_artifacts()
    index = json.loads(carried[INDEX].read_text(encoding="utf-8")) if INDEX in carried else {}
    blobs = {key: carried[f"{key}.bin"].read_bytes() for key in index if f"{key}.bin" in carried}
    machine = this_machine()
    if saved is not None:
        key = machine_key(machine)
        blobs[key] = saved[0]
        index[key] = {"made_on": machine, "sha256": hashlib.sha256(saved[0]).hexdigest(), "bytes": len(saved[0]),
                      "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    kept = sorted(blobs, key=lambda key: index[key]["made_at"], reverse=True)[:KEPT_MACHINES]
    with atomic_dir(output) as out:
        for key in kept:
            (out / f"{key}.bin").write_bytes(blobs[key])
        (out / INDEX).write_text(json.dumps({key: index[key] for key in kept}, indent=1, sort_keys=True) + "\n",
                                 encoding="utf-8")
    if saved is None:
        return f"compile cache: nothing compiled in this process; {len(kept)} entries carried over" if kept else ""
    return f"compile cache: this machine's graphs saved ({len(saved[0]) / 2**20:.1f} MiB) in {output}"
