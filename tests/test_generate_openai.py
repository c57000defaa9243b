"""generate.backend openai and vllm: against a real vLLM server on loopback (the tiny target), one the stage
starts itself, and a scripted HTTP server of our own (real sockets) for the failure paths a healthy server never
shows."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest
from omegaconf import OmegaConf

from eagle3ops.config import ConfigError, OpenAIEndpointConfig, load_config
from eagle3ops.errors import InputError
from eagle3ops.generation.openai import ResumeLog, regenerate_openai, with_reasoning
from eagle3ops.serving.http import EngineError, EngineUnavailable
from eagle3ops.serving.server import free_port
from helpers import InFlight, isolate, loopback_server

ORIGINAL = "ORIGINAL ANSWER " * 12  # far longer than any regenerated turn: a prompt carrying it shows


def chats(n: int, turns: int = 2) -> list[dict]:
    """`n` conversations, each a system message then `turns` user/assistant exchanges."""
    conversations = []
    for i in range(n):
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        for t in range(turns):
            messages += [{"role": "user", "content": f"Hello world {i}, question {t}?"},
                         {"role": "assistant", "content": ORIGINAL}]
        conversations.append({"id": f"c{i:02d}", "messages": messages})
    return conversations


# ---------------------------------------------------------------- a real server: vLLM


@pytest.fixture(scope="module")
def served_target(vllm_tiny_target):
    return f"{vllm_tiny_target}/v1"


@pytest.mark.service
def test_every_turn_regenerated_in_order_conditioned_on_the_regenerated_ones(served_target, tiny_target_dir,
                                                                             tmp_path):
    from transformers import AutoTokenizer

    from eagle3ops.data.chat import prompt_ids

    conversations = chats(3)
    settings = OpenAIEndpointConfig(base_url=served_target, concurrency=1, max_retries=0)
    records, stats = regenerate_openai(conversations, settings, 12, 0.0, 0, tmp_path / "one.jsonl")

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert [r["id"] for r in records] == [c["id"] for c in conversations]
    for original, record in zip(conversations, records):
        assert [m["role"] for m in record["messages"]] == [m["role"] for m in original["messages"]]
        for before, after in zip(original["messages"], record["messages"]):
            if before["role"] == "assistant":
                assert after["content"] and after["content"] != ORIGINAL
            else:
                assert after == before
        assert [t["turn"] for t in record["generation"]] == [2, 4]
        for turn in record["generation"]:  # the server read the regenerated turns before this one, not the originals
            assert turn["prompt_tokens"] == len(prompt_ids(tokenizer, record["messages"][: turn["turn"]]))
            assert 0 < turn["completion_tokens"] <= 12 and turn["finish_reason"] in ("stop", "length")
    assert stats.turns == 6 and stats.generated == 3 and stats.resumed == 0
    assert stats.requests == 1 + 6  # GET /models (model: null), then one request per turn
    assert stats.unfinished == sum(t["finish_reason"] == "length" for r in records for t in r["generation"])
    assert stats.completion_tokens == stats.generated_tokens > 0 and stats.tokens_per_s > 0

    settings.concurrency = 4  # same greedy answers with four conversations in flight, still in input order
    concurrent, _ = regenerate_openai(conversations, settings, 12, 0.0, 0, tmp_path / "four.jsonl")
    assert concurrent == records


@pytest.mark.service
def test_a_model_the_server_does_not_serve_fails_fast_with_its_message(served_target, tmp_path):
    settings = OpenAIEndpointConfig(base_url=served_target, model="not-the-target", max_retries=5)
    with pytest.raises(EngineError, match=r"conversation 'c00', turn 2: .*HTTP 404: .*not-the-target"):
        regenerate_openai(chats(1), settings, 8, 0.0, 0, tmp_path / "log.jsonl")


@pytest.mark.service
def test_a_server_that_does_not_capture_states_is_named_by_the_extraction(vllm_tiny_target, tiny_target_dir):
    """Hidden-state capture (tests/test_vllm_extract.py) asked of a plain server, as this module serves: the error
    says what the server lacks. Here, not there, to start no server of its own."""
    from eagle3ops.config import TargetConfig
    from eagle3ops.extraction.vllm import EngineStates
    from eagle3ops.modeling.target import target_layout

    layout = target_layout(TargetConfig(path=str(tiny_target_dir), aux_layers=[1, 2, 3]))
    with pytest.raises(EngineError, match=r"/v1/completions: no kv_transfer_params.hidden_states_path .*"
                                          r"extract_hidden_states"):
        EngineStates(vllm_tiny_target, layout)([5, 6, 7])


@pytest.mark.service
@pytest.mark.processes
def test_stage_killed_midway_resumes_without_generating_anything_twice(served_target, tiny_target_dir, tmp_path,
                                                                        monkeypatch, capsys):
    """The stage runs in a process SIGKILLed after a few conversations are logged, then again in this one."""
    from eagle3ops.stages.generate import run

    conversations = chats(16)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations))
    OmegaConf.save({"target": {"path": str(tiny_target_dir), "lineage_dep": str(tiny_target_dir)},
                    "data": {"conversations": "chats.jsonl"},
                    "generate": {"backend": "openai", "max_new_tokens": 16,
                                 "openai": {"base_url": served_target, "concurrency": 2, "max_retries": 0}},
                    "mlflow": {"system_metrics": False, "registered_model": None}}, tmp_path / "params.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}

    def logged_lines() -> int:
        logs = tmp_path.glob(".eagle3ops/resume/generate-*/openai.jsonl")
        return sum(path.read_bytes().count(b"\n") for path in logs)

    child = subprocess.Popen([sys.executable, "-m", "eagle3ops.cli", "generate"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while child.poll() is None and time.monotonic() < deadline and logged_lines() < 3:
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, f"generation ended before it could be killed: {err}"
    assert not (tmp_path / "data" / "generated").exists()  # nothing half-written where DVC looks
    [log_path] = tmp_path.glob(".eagle3ops/resume/generate-*/openai.jsonl")
    logged = ResumeLog(log_path).read()
    assert 3 <= len(logged) < 16

    isolate(monkeypatch, tmp_path)
    run(load_config("params.yaml"))
    assert f"generate: resuming after {len(logged)} of 16 finished conversations" in capsys.readouterr().out
    out = [json.loads(line) for line in (tmp_path / "data/generated/conversations.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == [c["id"] for c in conversations]  # none lost, input order
    assert all(out[int(key[1:])] == record for key, record in logged.items())  # kept as the first run wrote them
    metrics = json.loads((tmp_path / "metrics" / "generate.json").read_text())
    assert metrics["turns"] == 32
    assert metrics["resumed_conversations"] == len(logged)
    assert metrics["requests"] == 1 + 2 * (16 - len(logged))  # only the missing conversations were sent
    assert metrics["tokens_per_s"] > 0 and metrics["unfinished_turns"] <= 32
    assert not list(tmp_path.glob(".eagle3ops/resume/generate-*"))


@pytest.mark.service
def test_backend_vllm_starts_and_stops_its_own_server_and_answers_as_a_running_one(served_target, tiny_target_dir,
                                                                                  tmp_path, monkeypatch):
    """generate.backend vllm: the stage starts vLLM on the target, in the target's dtype, regenerates through it as
    the openai backend does, and stops it; its greedy answers are those of a vLLM already running."""
    import psutil

    from eagle3ops.stages.generate import run

    conversations = chats(4)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations))
    OmegaConf.save({"target": {"path": str(tiny_target_dir), "lineage_dep": str(tiny_target_dir)},
                    "data": {"conversations": "chats.jsonl"},
                    "generate": {"backend": "vllm", "max_new_tokens": 12, "openai": {"concurrency": 4}},
                    "vllm": {"engine_idle_s": 0},  # a server of the stage's own (engine sessions: test_engine_session.py)
                    "mlflow": {"system_metrics": False, "registered_model": None}}, tmp_path / "params.yaml")
    def engines() -> set[int]:
        return {p.pid for p in psutil.Process().children(recursive=True) if "vllm" in " ".join(p.cmdline())}

    running_before = engines()  # the module's server
    isolate(monkeypatch, tmp_path)
    run(load_config("params.yaml"))
    assert engines() == running_before  # the stage's server and its engine process are gone
    generated = [json.loads(line) for line in (tmp_path / "data/generated/conversations.jsonl").read_text().splitlines()]
    running = OpenAIEndpointConfig(base_url=served_target, concurrency=4, max_retries=0)
    expected, _ = regenerate_openai(conversations, running, 12, 0.0, 0, tmp_path / "running.jsonl")
    assert [r["messages"] for r in generated] == [r["messages"] for r in expected]
    metrics = json.loads((tmp_path / "metrics" / "generate.json").read_text())
    assert metrics["turns"] == 8 and metrics["tokens_per_s"] > 0 and metrics["requests"] == 1 + 8
    log = (tmp_path / ".eagle3ops" / "logs" / "vllm-generate.log").read_text()
    assert "'dtype': 'float32'" in log  # the target's own, never vLLM's auto (bf16 for a float32 model)


# ---------------------------------------------------------------- a scripted server of our own


def completion(content: str, finish_reason: str = "stop", **extra) -> dict:
    message = {"role": "assistant", "content": content, **extra}
    return {"object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


@contextmanager
def scripted_server(answer, delay_s: float = 0.0, together: int = 1):
    """An HTTP server on loopback: `answer(n, body)` -> (status, headers, json) for the n-th request. Yields
    (base_url, seen): seen["requests"] lists (time, headers, body) per request, seen["in_flight"].most the most
    requests it held at once (`together`: see InFlight)."""
    seen, lock = {"requests": [], "in_flight": InFlight(together)}, threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                n = len(seen["requests"])
                seen["requests"].append((time.monotonic(), dict(self.headers), body))
            with seen["in_flight"].held():
                time.sleep(delay_s)
                status, headers, payload = answer(n, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            for key, value in {**headers, "Content-Type": "application/json", "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    with loopback_server(Handler) as url:
        yield f"{url}/v1", seen


def one_turn(n: int = 1) -> list[dict]:
    return [{"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": "old"}]} for i in range(n)]


def test_429_with_retry_after_then_500_are_retried_with_backoff(tmp_path, monkeypatch):
    script = [(429, {"Retry-After": "1"}, {"error": {"message": "rate limited"}}),
              (500, {}, {"error": {"message": "engine hiccup"}}),
              (200, {}, completion("the answer", reasoning_content="step one"))]
    monkeypatch.setenv("EAGLE3OPS_TEST_KEY", "sk-test-123")
    with scripted_server(lambda n, body: script[n]) as (url, seen):
        settings = OpenAIEndpointConfig(base_url=url, model="target", api_key_env="EAGLE3OPS_TEST_KEY", max_retries=3,
                                        extra_body={"top_p": 0.5})
        records, stats = regenerate_openai(one_turn(), settings, 9, 0.7, 0, tmp_path / "log.jsonl", backoff_s=0.05)
    (t0, headers, body), (t1, *_), (t2, *_) = seen["requests"]
    assert t1 - t0 >= 1.0  # waited as long as Retry-After asked
    assert t2 - t1 < 0.5  # then the (short, in this test) exponential backoff
    assert stats.requests == 3 and stats.retries == 2
    assert headers["Authorization"] == "Bearer sk-test-123"
    assert body["model"] == "target" and body["max_tokens"] == 9 and body["temperature"] == 0.7 and body["top_p"] == 0.5
    assert body["messages"] == [{"role": "user", "content": "question 0"}]
    assert records[0]["messages"][1]["content"] == "<think>\nstep one\n</think>\nthe answer"
    assert records[0]["generation"] == [{"turn": 1, "finish_reason": "stop", "prompt_tokens": 7,
                                         "completion_tokens": 3}]


def test_a_client_error_fails_fast_with_the_servers_message(tmp_path):
    error = {"error": {"message": "This model's maximum context length is 8 tokens", "type": "BadRequestError"}}
    with scripted_server(lambda n, body: (400, {}, error)) as (url, seen):
        settings = OpenAIEndpointConfig(base_url=url, model="target", max_retries=5)
        with pytest.raises(EngineError, match="conversation 'q0', turn 1: .*HTTP 400: .*maximum context length is 8"):
            regenerate_openai(one_turn(), settings, 8, 0.0, 0, tmp_path / "log.jsonl")
    assert len(seen["requests"]) == 1


def test_retries_run_out_on_a_server_that_keeps_failing(tmp_path):
    with scripted_server(lambda n, body: (503, {}, {"message": "overloaded"})) as (url, seen):
        settings = OpenAIEndpointConfig(base_url=url, model="target", max_retries=2)
        with pytest.raises(EngineUnavailable, match="gave up after 3 attempts; last: HTTP 503: overloaded"):
            regenerate_openai(one_turn(), settings, 8, 0.0, 0, tmp_path / "log.jsonl", backoff_s=0.01)
    assert len(seen["requests"]) == 3


def test_connection_errors_are_retried_then_reported(tmp_path):
    settings = OpenAIEndpointConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", model="target", max_retries=1)
    with pytest.raises(EngineUnavailable, match="gave up after 2 attempts; last: ConnectError"):
        regenerate_openai(one_turn(), settings, 8, 0.0, 0, tmp_path / "log.jsonl", backoff_s=0.01)


def test_requests_in_flight_are_bounded_by_concurrency(tmp_path):
    def echo(n, body):
        return 200, {}, completion("re: " + body["messages"][-1]["content"])

    with scripted_server(echo, delay_s=0.05, together=3) as (url, seen):
        settings = OpenAIEndpointConfig(base_url=url, model="target", concurrency=3)
        records, stats = regenerate_openai(one_turn(9), settings, 8, 0.0, 0, tmp_path / "log.jsonl")
    assert seen["in_flight"].most == 3
    assert [r["messages"][1]["content"] for r in records] == [f"re: question {i}" for i in range(9)]
    assert stats.generated == 9 and stats.conversations_per_s > 0


# ---------------------------------------------------------------- pieces


def test_reasoning_returned_apart_is_written_back_inline():
    assert with_reasoning({"content": "42", "reasoning_content": "\n6 x 7\n"}) == "<think>\n6 x 7\n</think>\n42"
    assert with_reasoning({"content": "\n42", "reasoning": "6 x 7"}) == "<think>\n6 x 7\n</think>\n42"  # newer vLLM
    assert with_reasoning({"content": "<think>x</think>42", "reasoning_content": None}) == "<think>x</think>42"
    assert with_reasoning({"content": None, "reasoning": ""}) == ""


def test_a_torn_last_line_is_dropped_and_appending_continues(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"id": "a", "n": 1}) + "\n" + json.dumps({"id": "b", "n": 2}) + "\n" + '{"id": "c", "n"')
    log = ResumeLog(path)
    assert list(log.read()) == ["a", "b"]
    with log.appending() as append:
        append({"id": "c", "n": 3})
    assert log.read() == {"a": {"id": "a", "n": 1}, "b": {"id": "b", "n": 2}, "c": {"id": "c", "n": 3}}


def test_the_key_is_named_never_given(tmp_path, monkeypatch):
    params = tmp_path / "params.yaml"
    OmegaConf.save({"generate": {"backend": "openai", "openai": {"api_key_env": "sk-live-abc123"}}}, params)
    with pytest.raises(ConfigError, match="generate.openai.api_key_env.*never the key itself"):
        load_config(params)
    monkeypatch.delenv("EAGLE3OPS_UNSET_KEY", raising=False)
    settings = OpenAIEndpointConfig(model="target", api_key_env="EAGLE3OPS_UNSET_KEY")
    with pytest.raises(InputError, match="EAGLE3OPS_UNSET_KEY is not set"):
        regenerate_openai(one_turn(), settings, 8, 0.0, 0, tmp_path / "log.jsonl")


def test_one_rule_for_the_served_model_everywhere() -> None:
    """Generation's endpoint and the stages' own requests (serving/http.served_model) pick the model alike: the one
    a server lists; several or none is an error (with generation's key to pick one), never the first taken blind."""
    from eagle3ops.serving.http import the_one_model

    assert the_one_model({"object": "list", "data": [{"id": "target"}]}, "http://h/v1") == "target"
    with pytest.raises(EngineError, match=r"lists \['target', 'adapter'\]; set generate.openai.model to the one"):
        the_one_model({"data": [{"id": "target"}, {"id": "adapter"}]}, "http://h/v1", setting="generate.openai.model")
    with pytest.raises(EngineError, match="lists no models: one model a server"):
        the_one_model({"data": []}, "http://h/v1")
    with pytest.raises(EngineError, match="not a model list: .*is generate.openai.base_url the API root"):
        the_one_model("<html>", "http://h", root_setting="generate.openai.base_url")
