"""The compiled graphs that travel with the train stage's lineage (training/compile_cache.py): saved by one process,
loaded by a fresh one with an empty local cache where the machine is the same, refused with what differs where it
is not, read back from DVC's cache once DVC removed the stage's output."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3ops.training.compile_cache import (
    INDEX,
    KEPT_MACHINES,
    folder_entries,
    last_entries,
    load,
    machine_key,
    this_machine,
)

COMPILE_AND_SAVE_OR_LOAD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from eagle3ops.training import compile_cache

    action, folder = sys.argv[1], Path(sys.argv[2])
    loaded = compile_cache.load(compile_cache.folder_entries(folder)) if action == "load" else None
    weight = torch.randn(8, 8, requires_grad=True)
    step = torch.compile(lambda x: (x @ weight).relu().sum(), dynamic=False)
    step(torch.randn(4, 8)).backward()
    # after loading, the entry saved again elsewhere: the graphs loaded count as this process's, for the next machine
    saved = compile_cache.save(folder if action == "save" else folder.parent / "saved-again",
                               compile_cache.folder_entries(folder) if action == "save" else {})
    print(json.dumps({"loaded": loaded, "saved": saved, "inductor": dict(counters["inductor"]),
                      "aot_autograd": dict(counters["aot_autograd"])}))
""")


def _entry(made_on: dict, blob: bytes, made_at: str) -> dict:
    return {"made_on": made_on, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob), "made_at": made_at}


def _write_entries(folder: Path, entries: dict[str, tuple[dict, bytes]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    index = {}
    for key, (made_on, blob) in entries.items():
        (folder / f"{key}.bin").write_bytes(blob)
        index[key] = _entry(made_on, blob, "2026-01-01T00:00:00Z")
    (folder / INDEX).write_text(json.dumps(index))


def _another_machine(**differences: str) -> dict:
    return {**this_machine(), **differences}


def test_no_earlier_entries_say_the_graphs_compile(tmp_path: Path) -> None:
    assert load(folder_entries(tmp_path / "missing")) == ("none", "compile cache: none from an earlier run; the graphs compile")


def test_an_entry_of_another_machine_is_refused_with_what_differs(tmp_path: Path) -> None:
    other = _another_machine(device="NVIDIA H200", torch="2.12.0")
    _write_entries(tmp_path, {machine_key(other): (other, b"graphs")})
    state, line = load(folder_entries(tmp_path))
    assert state == "other_machines"
    here = this_machine()
    assert line == (f"compile cache: no entry for this machine; the graphs compile. NVIDIA H200: device NVIDIA H200 "
                    f"there, {here['device']} here, torch 2.12.0 there, {here['torch']} here")


def test_an_entry_whose_bytes_are_not_its_index_is_skipped(tmp_path: Path) -> None:
    _write_entries(tmp_path, {machine_key(this_machine()): (this_machine(), b"graphs")})
    (tmp_path / f"{machine_key(this_machine())}.bin").write_bytes(b"graphz")
    state, line = load(folder_entries(tmp_path))
    assert state == "damaged" and "is not the bytes its index records" in line


@pytest.mark.processes
def test_the_last_runs_entries_come_from_dvcs_cache_once_dvc_removed_the_output(tmp_path: Path) -> None:
    """`dvc repro` removes the output before the stage runs: the entries are read through dvc.lock's md5 from DVC's
    cache. Starts `git init`, `dvc init` and `dvc add` (a few seconds)."""
    output = tmp_path / "models" / "compile-cache" / "train-scratch"
    _write_entries(output, {machine_key(this_machine()): (this_machine(), b"graphs")})
    for command in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "add", "-q", "models/compile-cache/train-scratch"]):
        subprocess.run(command, cwd=tmp_path, check=True, capture_output=True)
    md5 = (tmp_path / "models" / "compile-cache" / "train-scratch.dvc").read_text().split("md5: ")[1].split()[0]
    (tmp_path / "dvc.lock").write_text(f"schema: '2.0'\nstages:\n  train@scratch:\n    cmd: eagle3ops train scratch\n"
                                       f"    outs:\n    - path: models/compile-cache/train-scratch\n      md5: {md5}\n")
    expected = {name: path.read_bytes() for name, path in folder_entries(output).items()}
    subprocess.run(["rm", "-rf", str(output)], check=True)
    entries = last_entries("train@scratch", tmp_path)
    assert {name: path.read_bytes() for name, path in entries.items()} == expected
    assert all(".dvc/cache" in str(path) for path in entries.values())


@pytest.mark.heavy
def test_graphs_saved_by_one_process_are_loaded_by_a_fresh_one_with_an_empty_cache(tmp_path: Path) -> None:
    """A real round trip through Inductor on the CPU: one process compiles a step (forward and backward) and saves
    the stage's output beside five entries of other machines; a second, with an empty local cache, loads this
    machine's entry, compiles nothing, and saves the same graphs again (what it loaded is its to pass on). Starts
    two Python processes that compile (82 s alone on 2 cores; its own tiny step: no fixture builds one)."""
    output = tmp_path / "compile-cache" / "train-scratch"
    others = {f"gpu{n}": _another_machine(device=f"GPU {n}") for n in range(5)}
    _write_entries(output, {machine_key(made_on): (made_on, name.encode()) for name, made_on in others.items()})
    index = json.loads((output / INDEX).read_text())
    for n, key in enumerate(index):  # gpu4's entry is the newest
        index[key]["made_at"] = f"2026-01-0{n + 1}T00:00:00Z"
    (output / INDEX).write_text(json.dumps(index))

    def run(action: str, cache: str) -> dict:
        done = subprocess.run([sys.executable, "-c", COMPILE_AND_SAVE_OR_LOAD, action, str(output)], check=True,
                              capture_output=True, text=True, env={**_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache)})
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run("save", "first-machine")
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1 and first["saved"].startswith(
        "compile cache: this machine's graphs saved")
    kept = json.loads((output / INDEX).read_text())
    assert list(kept) == sorted(kept) and set(kept) == {machine_key(this_machine())} | {
        machine_key(others[f"gpu{n}"]) for n in range(5 - (KEPT_MACHINES - 1), 5)}  # the newest others
    assert sorted(path.name for path in output.iterdir()) == sorted([INDEX, *(f"{key}.bin" for key in kept)])

    second = run("load", "fresh-machine")
    state, line = second["loaded"]
    assert state == "loaded" and "inductor" in line, line
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1 and not second["inductor"].get("fxgraph_cache_miss")
    assert second["aot_autograd"].get("autograd_cache_hit", 0) >= 1
    again = json.loads((output.parent / "saved-again" / INDEX).read_text())
    assert list(again) == [machine_key(this_machine())] and again[machine_key(this_machine())]["bytes"] == kept[
        machine_key(this_machine())]["bytes"]


def _env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if not key.startswith(("TORCHINDUCTOR_", "TRITON_"))}
