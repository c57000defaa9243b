"""The process that keeps an engine session's vLLM server (serving/session.py) and stops it: once nobody has used
it for its idle time, on SIGTERM (`eagle3ops engine stop`, another engine making room), or when the server dies.

    python -m eagle3ops.serving.supervisor RECORD.json

It starts in a session of its own, so that the stage which started it can end without taking the engine along;
the server is its child, started with PR_SET_PDEATHSIG, so that a supervisor killed outright takes the server
with it. "Unused" is read from the session's lock file: its users hold it while they use the engine and touch it
on the way in and out; the supervisor stops the engine only while it can take that lock itself, so never in the
middle of a use. Standard library only (and the server helpers): it holds no model, and starts in a moment."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle3ops.serving.server import die_with_parent, stop_process_group

POLL_S = 2.0


def _stop_requested(signum, frame):
    raise SystemExit(0)


def supervise(record_path: Path) -> int:
    record = json.loads(record_path.read_text(encoding="utf-8"))
    lock_path, idle_s = Path(record["lock"]), float(record["idle_s"])
    signal.signal(signal.SIGTERM, _stop_requested)
    signal.signal(signal.SIGINT, _stop_requested)
    with open(record["log"], "ab") as log:
        server = subprocess.Popen(record["argv"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  cwd=record["cwd"], env={**os.environ, **record["env"]}, start_new_session=True,
                                  preexec_fn=die_with_parent)
    try:
        while server.poll() is None:
            time.sleep(POLL_S)
            if time.time() - lock_path.stat().st_mtime < idle_s:
                continue
            with open(lock_path, "a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # in use right now
                    continue
                if time.time() - lock_path.stat().st_mtime >= idle_s:
                    stop_process_group(server)
                    _forget(record_path, record)
                    return 0
        _forget(record_path, record)  # the server died: the next user starts another
        return 1
    finally:
        stop_process_group(server)
        _forget(record_path, record)


def _forget(record_path: Path, record: dict) -> None:
    """Remove the record if it is still this supervisor's (a user may have replaced a stale one)."""
    try:
        if json.loads(record_path.read_text(encoding="utf-8")).get("started_at") == record["started_at"]:
            record_path.unlink()
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1])))
