"""Stages computing on one machine's CPU take turns for its cores instead of fighting over them.

A stage on the CPU runs `threads` threads (params.yaml; in the reproducible mode 2, or $OMP_NUM_THREADS, and never
fewer mid-run: its bits depend on that count). Where the stages' threads outnumber the cores, as with `dvc queue
start -j 2` on two cores, each does not just run at half speed: torch's OpenMP threads spin at every barrier for a
thread the kernel has taken off the core, and two train stages of the embedded default side by side on 2 cores took
over 4x the CPU time of one alone (docs/runs.md, "Experiments in parallel"). So a stage that computes on the CPU
holds one of cores // threads slots, machine-wide, for as long as it runs; the next waits and says for whom. A slot
is a lock file in the temp directory that the operating system releases when its process ends, however it ends:
nothing stale is left to clean up.
"""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from pathlib import Path

POLL_S = 1.0
_held: list = []  # the open slot file: closing it (or the process ending) frees the slot


def slots_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"eagle3ops-cpu-slots-{os.getuid()}"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def take_slot(label: str, threads: int, cores: int | None = None) -> int | None:
    """Hold a CPU slot for the rest of this process (blocks until one is free); returns its number. None where
    there is nothing to share: under torchrun, whose ranks must run together, or once this process holds one."""
    if _held or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    slots = max(1, (cores or usable_cores()) // max(1, threads))
    folder = slots_dir()
    folder.mkdir(parents=True, exist_ok=True)
    began, waiting = time.monotonic(), False
    while True:
        for number in range(slots):
            handle = open(folder / f"slot-{number}.lock", "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            handle.truncate(0)
            handle.write(f"{os.getpid()} {label}\n")
            handle.flush()
            _held.append(handle)
            if waiting:
                print(f"{label}: got a CPU slot after {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
            return number
        if not waiting:
            print(f"{label}: waiting for a CPU slot: {slots} stage(s) of {threads} thread(s) fit this machine's "
                  f"{cores or usable_cores()} cores, and {', '.join(holders(slots)) or 'others'} hold them",
                  file=sys.stderr, flush=True)
            waiting = True
        time.sleep(POLL_S)


def holders(slots: int) -> list[str]:
    """'<pid> <stage>' of each slot's holder, as the holder wrote it."""
    found = []
    for number in range(slots):
        try:
            text = (slots_dir() / f"slot-{number}.lock").read_text().strip()
        except OSError:
            continue
        if text:
            found.append(text)
    return found
