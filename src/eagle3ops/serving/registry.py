"""The engine sessions running on this machine (serving/session.py starts and finds them), as their records show:
one directory per machine and user (~/.cache/eagle3ops/engines, or $EAGLE3OPS_ENGINE_DIR), in it for each engine
<key>.json (its record: target, port, log, supervisor, who started it, how long its start took), <key>.lock (held by
whoever uses the engine, touched on the way in and out: its mtime is the last use) and <key>/ (its log, the drafter
it started with, its chat template). Reading them, stopping them, making room for one more: standard library and
psutil only, so that serving/vllm.py can make room before any server it starts."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

import psutil

STOP_WAIT_S = 60.0


def engine_dir() -> Path:
    """$EAGLE3OPS_ENGINE_DIR, else ~/.cache/eagle3ops/engines ($XDG_CACHE_HOME/eagle3ops/engines)."""
    chosen = os.environ.get("EAGLE3OPS_ENGINE_DIR")
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3ops" / "engines"


def record_path(key: str) -> Path:
    return engine_dir() / f"{key}.json"


def read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_record(path: Path, record: dict) -> None:
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(record, indent=1), encoding="utf-8")
    partial.replace(path)


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ago(epoch: float) -> str:
    minutes = (time.time() - epoch) / 60
    return f"{minutes:.0f} min ago" if minutes >= 1 else "just now"


def running() -> list[dict]:
    """The engines recorded here, each with `last_used` (epoch) and `alive` (its supervisor runs)."""
    engines = []
    for path in sorted(engine_dir().glob("*.json")):
        record = read_record(path)
        if record is None:
            continue
        lock = Path(record["lock"])
        record["last_used"] = lock.stat().st_mtime if lock.exists() else record["started_at"]
        record["alive"] = alive(record.get("supervisor_pid"))
        engines.append(record)
    return engines


def stop_supervised(record: dict) -> None:
    """Ask the engine's supervisor to stop it (SIGTERM to its process group), and wait until it has."""
    pid = record.get("supervisor_pid")
    if not alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_WAIT_S
    while alive(pid) and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # reaped here when this process started it
        except ChildProcessError:
            pass
        time.sleep(0.2)
    if alive(pid):
        os.killpg(pid, signal.SIGKILL)


def stop(key: str) -> bool:
    """Stop the engine `key` (a prefix of it will do) and forget it; False when no such engine is recorded."""
    matches = [r for r in running() if r["key"].startswith(key)]
    for record in matches:
        stop_supervised(record)
        record_path(record["key"]).unlink(missing_ok=True)
    return bool(matches)


def make_room(kept: int, keep_key: str | None = None) -> None:
    """Before one more server starts: stop the least recently used idle engines beyond `kept` - 1 (`keep_key`'s
    own left alone). An engine in use stays: the machine holds one more for a while."""
    others = sorted((r for r in running() if r["key"] != keep_key), key=lambda r: r["last_used"], reverse=True)
    _stop_idle(others[max(kept - 1, 0):], f"to make room (vllm.engines_kept = {kept})")


def stop_idle(why: str) -> list[str]:
    """Stop every idle engine of this machine (one in use stays), saying why; the keys of those stopped."""
    return _stop_idle(running(), why)


def _stop_idle(records: list[dict], why: str) -> list[str]:
    stopped = []
    for record in records:
        with open(record["lock"], "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            print(f"vllm: stopping engine {record['key']} (last used {ago(record['last_used'])}) {why}", flush=True)
            stop(record["key"])
            stopped.append(record["key"])
    return stopped


def describe(record: dict) -> dict:
    """What `eagle3ops engine ls` shows of an engine."""
    return {"key": record["key"], "target": record["model"], "drafter": "yes" if record["drafter"] else "no",
            "url": record["url"], "started by": record["started_by"], "since": ago(record["started_at"]),
            "last used": ago(record["last_used"]), "state": "running" if record["alive"] else "dead",
            "memory GiB": _memory_gib(record.get("supervisor_pid")), "log": record["log"]}


def _memory_gib(pid: int | None) -> float | None:
    """Resident memory of the supervisor and everything under it (the server and its engine processes)."""
    try:
        root = psutil.Process(pid)
        return round(sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**30, 2)
    except (psutil.Error, TypeError, ValueError):
        return None
