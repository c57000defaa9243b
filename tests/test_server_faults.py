"""A managed server's faults, with real processes and sockets (no vLLM: a scripted server of a few lines stands in
for it): a server that dies is named at once with the cause its log holds and the setting behind it, and nothing
of its process group outlives the stop."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from eagle3ops.serving.http import EngineUnavailable, Retries, send
from eagle3ops.serving.server import free_port, log_cause, managed_server, stop_process_group
from eagle3ops.serving.vllm import setting_behind

# Answers /health; on /die prints an engine's failure as vLLM does (the cause, then the wrappers pointing back
# to it) and exits without answering.
DYING_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.end_headers()
            return
        print("(EngineCore pid=7) Traceback (most recent call last):", flush=True)
        print("(EngineCore pid=7) ValueError: 200.00 GiB of KV cache asked, 22.13 GiB available", flush=True)
        print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace", flush=True)
        print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
        sys.stdout.flush()
        import os
        os._exit(1)

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_the_root_cause_in_a_log_and_the_setting_behind_it(tmp_path):
    """The exception that says what went wrong, not the wrappers printed after it nor the log's last lines."""
    log = tmp_path / "vllm.log"
    log.write_text("INFO 12-06 starting\n(EngineCore pid=7) ERROR Traceback (most recent call last):\n"
                   "(EngineCore pid=7) ValueError: 200.00 GiB of KV cache asked, 22.13 GiB available\n"
                   "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
                   + "INFO 200 OK\n" * 20)
    cause = log_cause(log)
    assert cause == "ValueError: 200.00 GiB of KV cache asked, 22.13 GiB available"
    assert setting_behind(cause).startswith("vllm.kv_cache_gib")
    assert setting_behind("api_server.py: error: unrecognized arguments: --bogus") == "vllm.extra_args"
    assert setting_behind("TypeError: something else") is None
    assert log_cause(tmp_path / "missing.log") is None


def test_a_request_to_a_managed_server_that_died_is_not_retried_and_names_the_cause(tmp_path):
    """Retrying a server whose process is gone cost a stage 80-115 s and blamed URL settings nobody set."""
    port = free_port()
    with managed_server("vLLM", [sys.executable, "-c", DYING_SERVER, str(port)], port, tmp_path / "vllm.log",
                        ready_timeout_s=60, explain=setting_behind) as url:
        retries = Retries(url_setting="eval.server_url, train.online_url")
        with pytest.raises(EngineUnavailable) as failure:
            send("GET", f"{url}/die", retries=retries)
    message = str(failure.value)
    assert retries.retries <= 1, message  # one where the dropped connection came before the process had exited
    assert "vLLM exited with code 1 while serving" in message
    assert "ValueError: 200.00 GiB of KV cache asked, 22.13 GiB available" in message
    assert "the setting behind it: vllm.kv_cache_gib" in message
    assert "eval.server_url" not in message


def test_a_servers_process_group_is_stopped_after_the_server_itself_died():
    """vLLM's engine core (a process of the server's group) outlived a killed API server, holding its memory."""
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                               "print(p.pid, flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    engine_core = int(leader.stdout.readline())
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    assert running(engine_core)  # as the engine core was
    stop_process_group(leader, grace_s=10)
    deadline = time.monotonic() + 10
    while running(engine_core):
        if time.monotonic() > deadline:
            pytest.fail("the group's other process outlived the stop")
        time.sleep(0.1)


def running(pid: int) -> bool:
    """Whether `pid` runs: neither gone nor a zombie waiting for whoever adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


# A stage's process as `eagle3ops <stage>` sets itself up, started by a parent that stands in for `dvc repro`;
# prints its pid, then works until stopped, noting on its way out that its `finally` ran.
STAGE = """
import sys, time
from eagle3ops.serving.server import end_with_parent
end_with_parent()
try:
    print("started", flush=True)
    time.sleep(120)
finally:
    open(sys.argv[1], "w").write("unwound")
"""
DVC = """
import subprocess, sys
stage = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(stage.pid, stage.stdout.readline().strip(), flush=True)
import time; time.sleep(120)
"""


def test_a_stage_ends_when_the_dvc_that_started_it_ends(tmp_path):
    """SIGTERM to `dvc repro` ended dvc at once while its stage went on under PID 1 and recorded FINISHED; now the
    stage gets SIGTERM when its parent dies and unwinds (its tracking run is left FAILED, its servers stopped)."""
    marker = tmp_path / "unwound"
    dvc = subprocess.Popen([sys.executable, "-c", DVC, STAGE, str(marker)], stdout=subprocess.PIPE, text=True)
    pid, state = dvc.stdout.readline().split()
    assert state == "started"
    os.kill(dvc.pid, signal.SIGKILL)  # the harshest end of the parent: no chance to pass anything on
    dvc.wait()
    deadline = time.monotonic() + 15
    while running(int(pid)):
        if time.monotonic() > deadline:
            os.kill(int(pid), signal.SIGKILL)
            pytest.fail("the stage outlived the process that started it")
        time.sleep(0.1)
    assert marker.read_text() == "unwound"
