"""Stages computing on one machine's CPU take turns for its cores instead of fighting over them.

A stage on the CPU runs `threads` threads (params.yaml; in the reproducible mode 2, or $OMP_NUM_THREADS, and never
fewer mid-run: its bits depend on that count). Where the stages' threads outnumber the cores, as with `dvc queue
start -j 2` on two cores, each does not just run at half speed: torch's OpenMP threads spin at every barrier for a
thread the kernel has taken off the core, and two train stages of the embedded default side by side on 2 cores took
over 4x the CPU time of one alone (docs/runs.md, "Experiments in parallel"). So a stage that computes on the CPU
holds one of cores // threads slots, machine-wide, for as long as it runs; the next waits and says for whom. A slot
is a lock file in the temp directory, released when the stage ends, and by the operating system when its process
ends, however it ends: nothing stale is left to clean up.
"""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

POLL_S = 1.0


def slots_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"eagle3ops-cpu-slots-{os.getuid()}"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextmanager
def cpu_slot(label: str, threads: int, cores: int | None = None) -> Iterator[int | None]:
    """Hold a CPU slot for the block (waiting until one is free); yields its number. None under torchrun, whose
    ranks must run together."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        yield None
        return
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
            with handle:  # closing it frees the slot
                handle.truncate(0)
                handle.write(f"{os.getpid()} {label}\n")
                handle.flush()
                if waiting:
                    print(f"{label}: got a CPU slot after {time.monotonic() - began:.0f} s", file=sys.stderr,
                          flush=True)
                yield number
            return
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
