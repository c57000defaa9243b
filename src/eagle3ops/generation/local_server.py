"""A local OpenAI-compatible server for a model directory (`transformers serve` on loopback), for trying
`generate.backend: openai` without vLLM, and for the tests and benchmarks that need a real server."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2


def free_port() -> int:
    """A loopback TCP port nobody listens on now, for a server we start."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def local_transformers_server(model_dir: str | Path, extra_args: tuple[str, ...] = (), ready_timeout_s: float = 120.0,
                              log_path: str | Path | None = None, env: dict[str, str] | None = None) -> Iterator[str]:
    """`transformers serve` on loopback for a local model directory (tests, benchmarks, trying the backend
    without vLLM); yields its base URL and stops it on exit. `extra_args` go to the command line (e.g.
    "--continuous-batching"), `env` over this process's environment. Needs `pip install 'transformers[serving]'`."""
    port = free_port()
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", "--host", "127.0.0.1",
               "--port", str(port), *extra_args, str(model_dir)]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"transformers serve exited with code {server.returncode} before it was ready"
                                   + (f" (log: {log_path})" if log_path else ""))
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"transformers serve not ready after {ready_timeout_s:.0f}s")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and anything it started
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        if log_path:
            log.close()
