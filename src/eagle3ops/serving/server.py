"""A server process the stages start and always stop: a free loopback port, a log kept, a readiness wait with a
timeout, and no orphan whatever ends the stage.

Stopping: the server runs in a session of its own (SIGTERM to its process group reaches whatever it started,
such as vLLM's engine-core processes), and is stopped on the way out of the `with` block, on success and on an
exception alike. While it runs, SIGTERM to the stage is turned into an exception (Python's default would end the
process without unwinding), and the server is started with PR_SET_PDEATHSIG, so that even a SIGKILLed stage
takes its server down with it: the kernel sends it SIGTERM when the stage's thread that started it dies.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2
import psutil

from eagle3ops.errors import InputError
from eagle3ops.serving.http import watched

STOP_GRACE_S = 30.0  # vLLM shuts its engine processes down on SIGTERM; past this they are killed
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child


class ServerError(InputError):
    """A server we started exited, was not ready in time, or failed while serving; the message names its log,
    where the cause is (a model it cannot load, memory, an engine crash)."""


def free_port() -> int:
    """A loopback TCP port nobody listens on now, for a server we start."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def end_with_parent() -> None:
    """This process ends, unwinding (its `finally` blocks run: a tracking run is left FAILED, servers stopped), when
    SIGTERM comes or the process that started it dies: `dvc repro` stopped by a scheduler exited at once while its
    stage, reparented to PID 1, went on and was recorded FINISHED for outputs DVC never took."""
    if threading.current_thread() is not threading.main_thread():  # a stage run inside another program's thread
        return
    signal.signal(signal.SIGTERM, _exit_on_signal)
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # died before the request took effect
        raise SystemExit(128 + signal.SIGTERM)


# An exception's line as Python prints it, maybe after a prefix of the process that raised it ("(EngineCore pid=7) ")
_EXCEPTION_LINE = re.compile(r"(?:^|[\s)\]])((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt)): (.+)$")
# exceptions that only point elsewhere, raised after the one that says what went wrong
_WRAPPERS = ("See root cause above", "Engine core initialization failed", "EngineDeadError", "EngineCore encountered")


def log_cause(path: Path) -> str | None:
    """The root cause in a server's log: the last exception it printed that is not a wrapper of an earlier one."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    causes = [f"{m[1]}: {m[2].strip()}" for line in lines if (m := _EXCEPTION_LINE.search(line))]
    return next((cause for cause in reversed(causes) if not any(w in cause for w in _WRAPPERS)), None)


def failure_text(name: str, log_path: Path, explain: Callable[[str], str | None] | None = None) -> str:
    """What a failed server's log says: its root cause, the setting behind it where `explain` knows one, and the
    log's last lines."""
    cause = log_cause(log_path)
    setting = explain(cause) if cause and explain else None
    return ((f"the cause in {name}'s log: {cause}\n" if cause else "")
            + (f"the setting behind it: {setting}\n" if setting else "")
            + f"the end of its log {log_path}:\n{log_tail(log_path)}")


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in text[-lines:])


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the main thread while inside, so `finally` blocks run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_process_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server's process group (started in a session of its own: the group's id is its pid), SIGKILL
    to whatever of it still runs after `grace_s`: the whole group even where the server itself is gone already
    (vLLM's engine core outlived a killed API server, holding its memory)."""
    deadline = time.monotonic() + grace_s
    _signal_group(process.pid, signal.SIGTERM)
    while True:
        process.poll()  # reaps the server once it has exited
        if not _group_running(process.pid):
            return
        if time.monotonic() > deadline:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
            return
        time.sleep(0.2)


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass


def _group_running(group: int) -> bool:
    """Whether a process of the group runs: zombies left to whoever adopted them (a container's PID 1 may never
    reap them) do not count."""
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == group and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


@contextmanager
def managed_server(name: str, argv: list[str], port: int, log_path: str | Path, ready_path: str = "/health",
                   env: dict[str, str] | None = None, ready_timeout_s: float = 600.0,
                   cwd: str | Path | None = None, explain: Callable[[str], str | None] | None = None
                   ) -> Iterator[str]:
    """Run `argv` (a server listening on 127.0.0.1:`port`) until the block ends; yields http://127.0.0.1:PORT
    once GET `ready_path` answers 200. Its output goes to `log_path` (kept after it stops); an exit before it is
    ready, or `ready_timeout_s` without an answer, raises ServerError with the cause from its log (`explain`: the
    setting behind a cause) and the log's last lines. While the block runs, a request to it that fails once the
    server has exited is not retried (serving/http.py, `watched`)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with _sigterm_raises(), open(log_path, "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                                  start_new_session=True, preexec_fn=die_with_parent,
                                  env={**os.environ, **(env or {})})
        try:
            wait_ready(name, server, f"{url}{ready_path}", log_path, ready_timeout_s, explain)
            gone = (lambda: None if server.poll() is None else
                    f"{name} exited with code {server.returncode} while serving; {failure_text(name, log_path, explain)}")
            try:
                with watched(url, gone):
                    yield url
            except Exception as err:
                if _healthy(server, f"{url}{ready_path}"):
                    raise
                raise ServerError(f"{err}\n{name} failed while serving; {failure_text(name, log_path, explain)}"
                                  ) from err
        finally:
            stop_process_group(server)


def _healthy(server: subprocess.Popen, health_url: str) -> bool:
    if server.poll() is not None:
        return False
    try:
        return httpx2.get(health_url, timeout=5.0).status_code == 200
    except httpx2.TransportError:
        return False


def wait_ready(name: str, server: subprocess.Popen, health_url: str, log_path: Path, timeout_s: float,
               explain: Callable[[str], str | None] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise ServerError(f"{name} exited with code {server.returncode} before it was ready; "
                              f"{failure_text(name, log_path, explain)}")
        try:
            if httpx2.get(health_url, timeout=2.0).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"{name} not ready after {timeout_s:.0f} s (no answer at {health_url}); "
                              f"{failure_text(name, log_path, explain)}")
        time.sleep(0.5)
