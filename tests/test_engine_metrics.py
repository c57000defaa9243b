"""Engine eval backends: vLLM's Prometheus counters parsed from its exposition format, and both backends end to
end against a stand-in server on loopback (real sockets) whose counters move as requests arrive: for SGLang,
which does not run here, and for what a healthy vLLM never shows (counters that lag the answers, two engines,
an HTTP 500, a server that drafts another k). vLLM itself is measured in tests/test_vllm.py."""
import json
import re
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest
from transformers import AutoTokenizer

from eagle3ops.config import Config, EvalConfig, PromptSetConfig, TargetConfig
from eagle3ops.data.chat import prompt_ids
from eagle3ops.decoding.engines import EngineError, measure, parse_exposition, vllm_counters
from eagle3ops.serving import http as engine_http
from eagle3ops.stages import eval as eval_stage
from helpers import InFlight, isolate, loopback_server

K = 3
STEPS_PER_REQUEST = 4

# What vLLM's /metrics looks like (prometheus_client's text format 0.0.4): counters carry `_total`, with a
# `_created` series beside; labels model_name and engine (one per data-parallel rank), position for per-pos.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Kimi-K2.5"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="Kimi-K2.5"} 120.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="Kimi-K2.5"} 80.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="Kimi-K2.5"} 1.7339e+09
vllm:spec_decode_num_drafts_created{engine="1",model_name="Kimi-K2.5"} 1.7339e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="Kimi-K2.5"} 360.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="Kimi-K2.5"} 240.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Kimi-K2.5"} 250.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="Kimi-K2.5"} 130.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Kimi-K2.5",position="0"} 110.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Kimi-K2.5",position="1"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Kimi-K2.5",position="2"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Kimi-K2.5",position="0"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Kimi-K2.5",position="1"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="Kimi-K2.5",position="2"} 20.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="Kimi-K2.5"} 3.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="Kimi-K2.5"} 9.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="Kimi-K2.5"} NaN
"""


def test_vllm_counters_are_summed_over_engines():
    counters = vllm_counters(VLLM_METRICS, "http://h/metrics")
    assert (counters.drafts, counters.accepted, counters.accepted_per_pos) == (200, 380, (180, 120, 80))


def test_exposition_details_are_parsed():
    text = ('# a comment\n\nhttp_requests_total{method="post",path="/v1/chat/completions",note="say \\"hi\\"\\\\n"} '
            '1027 1395066363000\nvllm:cache_config_info{block_size="16",} 1.0\nlatency_sum +Inf\n')
    samples = parse_exposition(text, "m")
    assert samples["http_requests_total"] == [({"method": "post", "path": "/v1/chat/completions",
                                                "note": 'say "hi"\\n'}, 1027.0)]
    assert samples["vllm:cache_config_info"] == [({"block_size": "16"}, 1.0)]
    assert samples["latency_sum"] == [({}, float("inf"))]


def test_counters_without_the_total_suffix_are_read():
    bare = re.sub(r"_total\{", "{", VLLM_METRICS)
    assert vllm_counters(bare, "m") == vllm_counters(VLLM_METRICS, "m")


@pytest.mark.parametrize("text, message", [
    ("\n".join(line for line in VLLM_METRICS.splitlines() if "per_pos" not in line),
     r"http://h/metrics: no vllm:spec_decode_num_accepted_tokens_per_pos counter: is the server running with a drafter"),
    ("vllm:num_requests_running 0\n", r"no vllm:spec_decode_num_drafts, vllm:spec_decode_num_accepted_tokens, "),
    (VLLM_METRICS + "vllm:broken{engine=0} 1\n", r"http://h/metrics:33: not a Prometheus sample"),
    (VLLM_METRICS + "vllm:spec_decode_num_drafts_total 1 two\n", r"http://h/metrics:33: not a Prometheus sample"),
    (VLLM_METRICS.replace('position="2"', 'position="5"'), r"draft positions \[0, 1, 5\] are not 0..k-1"),
])
def test_bad_metrics_are_named(text, message):
    with pytest.raises(EngineError, match=message):
        vllm_counters(text, "http://h/metrics")


class FakeEngine(BaseHTTPRequestHandler):
    """A vLLM / SGLang stand-in: every request takes STEPS_PER_REQUEST verification steps, each accepting the
    number of drafts its prompt asks for ("accept N"). vLLM's counters move a moment after the answer is sent,
    as vLLM's frontend may count them."""
    state: dict

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "Kimi-K2.5", "object": "model"}]}).encode())
        elif self.path == "/metrics":
            self._send(200, self._metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.state
        with state["lock"]:
            state["requests"].append(request)
        with state["in_flight"].held():
            threading.Event().wait(0.03)  # a client over its bound shows as more requests held at once
        if state.get("fail"):
            return self._send(500, b'{"object": "error", "message": "CUDA out of memory"}')
        if self.path == "/v1/completions":
            # the test's encoder puts the acceptance last; a prompt rendered by a real chat template is looked up
            accepted = state.get("accepts", {}).get(tuple(request["prompt"]), request["prompt"][-1])
            if request["temperature"] > 0:  # a drafter that does worse sampled, as real ones do
                accepted = min(accepted, state.get("sampled_cap", accepted))
            tokens = STEPS_PER_REQUEST * (1 + accepted)
            self._send(200, json.dumps({"object": "text_completion", "choices": [
                {"index": 0, "text": "x" * tokens, "token_ids": [5] * tokens, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens}}).encode())
            engine = len(state["requests"]) % 2
            threading.Timer(0.05, self._count, (engine, accepted)).start()
        elif self.path == "/generate":
            accepted = request["input_ids"][-1]  # the test's encoder puts the acceptance last
            histogram = [0] * (K + 1)
            histogram[accepted] = STEPS_PER_REQUEST
            meta = {"id": "r", "prompt_tokens": len(request["input_ids"]),
                    "completion_tokens": STEPS_PER_REQUEST * (1 + accepted), "spec_verify_ct": STEPS_PER_REQUEST}
            if state.get("histogram", True):
                meta["spec_accept_histogram"] = histogram
            self._send(200, json.dumps({"text": "x", "output_ids": [1], "meta_info": meta}).encode())
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def _count(self, engine: int, accepted: int) -> None:
        with self.state["lock"]:
            counters = self.state["counters"][engine]
            counters["drafts"] += STEPS_PER_REQUEST
            counters["accepted"] += STEPS_PER_REQUEST * accepted
            for position in range(min(accepted, len(counters["per_pos"]))):  # an engine drafting fewer than asked
                counters["per_pos"][position] += STEPS_PER_REQUEST

    def _metrics(self) -> str:
        lines = []
        with self.state["lock"]:
            for name, key in (("drafts", "drafts"), ("accepted_tokens", "accepted")):
                lines += [f"# HELP vllm:spec_decode_num_{name}_total Counter.",
                          f"# TYPE vllm:spec_decode_num_{name}_total counter"]
                lines += [f'vllm:spec_decode_num_{name}_total{{engine="{e}",model_name="Kimi-K2.5"}} {float(c[key])}'
                          for e, c in enumerate(self.state["counters"])]
            lines += ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="Kimi-K2.5",'
                      f'position="{p}"}} {float(n)}' for e, c in enumerate(self.state["counters"])
                      for p, n in enumerate(c["per_pos"])]
        return "\n".join(lines) + "\n"


@contextmanager
def fake_engine(k: int = K, together: int = 1, **options):
    """`together`: the concurrency a test expects to see, after the one warm-up request (see InFlight)."""
    state = {"lock": threading.Lock(), "in_flight": InFlight(together, alone=1), "requests": [],
             "counters": [{"drafts": 7, "accepted": 5, "per_pos": [3, 2] + [0] * (k - 2)} for _ in range(2)], **options}
    handler = type("Handler", (FakeEngine,), {"state": state})
    with loopback_server(handler) as url:
        yield f"{url}/", state


def encode(messages):  # stands in for the chat template: the acceptance the fake server should report, last
    return [101, 7, int(re.search(r"accept (\d)", messages[-1]["content"]).group(1))]


def prompt_sets() -> dict[str, list[dict]]:
    """'easy': every draft accepted (tau 4); 'mixed': 2 or 0 of 3 (tau 2); 'hard': none (tau 1)."""
    def prompts(name, accepts):
        return [{"id": f"{name}/{i}", "set": name, "messages": [{"role": "user", "content": f"q{i}: accept {a}"}]}
                for i, a in enumerate(accepts)]
    return {"easy": prompts("easy", [3] * 5), "mixed": prompts("mixed", [2, 0, 2, 0]), "hard": prompts("hard", [0] * 3)}


def test_vllm_backend_end_to_end_per_set():
    with fake_engine(together=2) as (url, state):
        results = measure("vllm", url, prompt_sets(), K, max_new_tokens=64, temperature=0.0, concurrency=2,
                          desc="eval@test", encode=encode)
    assert state["in_flight"].most == 2  # bounded concurrency, and the requests did run in parallel
    warm_up, *measured = state["requests"]  # one short request first, counted before the measurement starts
    assert {r["model"] for r in state["requests"]} == {"Kimi-K2.5"} and warm_up["max_tokens"] < 64
    assert {(r["max_tokens"], r["temperature"], r["return_token_ids"]) for r in measured} == {(64, 0.0, True)}
    assert sorted(r["prompt"] for r in measured) == sorted(encode(p["messages"]) for ps in prompt_sets().values()
                                                           for p in ps)  # token ids, rendered here
    taus = {name: round(result.stats.tau, 6) for name, result in results.items()}
    assert taus == {"easy": 4.0, "mixed": 2.0, "hard": 1.0}  # deltas per set, despite the counters' lag
    assert results["easy"].stats.per_position == [1.0, 1.0, 1.0]
    assert results["mixed"].stats.per_position == [0.5, 0.5, 0.0]
    assert results["hard"].stats.steps == 3 * STEPS_PER_REQUEST and results["hard"].stats.accepted == 0
    assert results["mixed"].completion_tokens == 2 * STEPS_PER_REQUEST * 3 + 2 * STEPS_PER_REQUEST
    assert all(result.per_position and result.seconds > 0 for result in results.values())
    assert results["easy"].outputs == {f"easy/{i}": [5] * STEPS_PER_REQUEST * 4 for i in range(5)}


def test_sglang_backend_end_to_end_per_set():
    with fake_engine(together=3) as (url, state):
        results = measure("sglang", url, prompt_sets(), K, max_new_tokens=32, temperature=0.7, concurrency=3,
                          desc="eval@test", encode=encode)
    assert state["in_flight"].most == 3
    assert {json.dumps(r["sampling_params"], sort_keys=True) for r in state["requests"]} == {
        '{"max_new_tokens": 32, "temperature": 0.7}'}
    assert {name: round(r.stats.tau, 6) for name, r in results.items()} == {"easy": 4.0, "mixed": 2.0, "hard": 1.0}
    assert results["mixed"].stats.per_position == [0.5, 0.5, 0.0] and results["mixed"].per_position
    with fake_engine(histogram=False) as (url, _):  # an SGLang that reports totals only
        totals = measure("sglang", url, prompt_sets(), K, 32, 0.0, 2, "eval@test", encode)
    assert round(totals["easy"].stats.tau, 6) == 4.0 and not totals["easy"].per_position


def test_engine_failures_are_named(monkeypatch):
    monkeypatch.setattr(engine_http, "BACKOFF_S", 0.001)  # every request is retried with backoff, briefly here
    with fake_engine(k=2) as (url, _):
        with pytest.raises(EngineError, match=r"/metrics: the server drafts 2 tokens per step but eval.k is 3"):
            measure("vllm", url, prompt_sets(), K, 64, 0.0, 2, "eval@test", encode)
    with fake_engine(fail=True) as (url, state):
        with pytest.raises(EngineError, match=r"/v1/completions: gave up after 7 attempts; last: HTTP 500: .*CUDA out "
                                              r"of memory"):
            measure("vllm", url, prompt_sets(), K, 64, 0.0, 2, "eval@test", encode)
    assert len(state["requests"]) == 1 + engine_http.MAX_RETRIES  # the warm-up request, retried
    with fake_engine() as (url, _):
        stopped = url
    with pytest.raises(EngineError, match=r"/v1/models: cannot reach the server .*eval.server_url"):
        measure("vllm", stopped, prompt_sets(), K, 64, 0.0, 2, "eval@test", encode)


def test_eval_stage_with_vllm_backend_writes_the_hf_schema(tmp_path, monkeypatch, tiny_target_dir):
    isolate(monkeypatch, tmp_path)
    bench = tmp_path / "data" / "bench"
    bench.mkdir(parents=True)
    for name, prompts in prompt_sets().items():
        (bench / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p["messages"][0]["content"]}) + "\n"
                                                     for p in prompts))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    accepts = {tuple(prompt_ids(tokenizer, p["messages"])): encode(p["messages"])[-1]
               for ps in prompt_sets().values() for p in ps}
    def evaluate(sampled_temperature) -> tuple[dict, list[float]]:
        with fake_engine(accepts=accepts, sampled_cap=1) as (url, state):
            sets = [PromptSetConfig(n, f"data/bench/{n}.jsonl") for n in prompt_sets()]
            cfg = Config(target=TargetConfig(path=str(tiny_target_dir), lineage_dep=str(tiny_target_dir)),
                         eval=EvalConfig(k=K, sets=sets, sets_dir="data/bench", backend="vllm", server_url=url,
                                         concurrency=4, sampled_temperature=sampled_temperature))
            cfg.train.warm_start = str(drafter)
            cfg.mlflow.registered_model, cfg.mlflow.system_metrics = None, False
            eval_stage.run(cfg, "baseline")
        measured = [r["temperature"] for r in state["requests"] if r["max_tokens"] == cfg.eval.max_new_tokens]
        return json.loads((tmp_path / "metrics" / "eval-baseline.json").read_text()), measured

    metrics, temperatures = evaluate(1.0)
    assert metrics["temperature"] == 0.0 and metrics["tau_by_set"] == {"easy": 4.0, "mixed": 2.0, "hard": 1.0}
    assert metrics["prompts_by_set"] == {"easy": 5, "mixed": 4, "hard": 3} and metrics["prompts"] == 12
    steps = 12 * STEPS_PER_REQUEST
    accepted = STEPS_PER_REQUEST * (5 * 3 + 2 * 2)
    assert (metrics["verify_steps"], metrics["accepted_tokens"], metrics["tau"]) == (steps, accepted,
                                                                                      round(1 + accepted / steps, 4))
    assert [metrics[f"accept_{i}"] for i in (1, 2, 3)] == [round(n * STEPS_PER_REQUEST / steps, 4) for n in (7, 7, 5)]
    assert sum(key.startswith("accept_") for key in metrics) == K and "lossless" not in metrics
    assert metrics["emitted_tokens"] == steps + accepted and metrics["spec_tokens_per_s"] > 0
    # measured again at eval.sampled_temperature, the same requests: the server's acceptance at that temperature
    assert temperatures == [0.0] * 12 + [1.0] * 12
    sampled = metrics["sampled"]
    assert sampled["temperature"] == 1.0 and sampled["tau_by_set"] == {"easy": 2.0, "mixed": 1.5, "hard": 1.0}
    assert sampled["tau"] == round(1 + STEPS_PER_REQUEST * (5 + 2) / steps, 4)
    assert [sampled[f"accept_{i}"] for i in (1, 2, 3)] == [round(7 * STEPS_PER_REQUEST / steps, 4), 0.0, 0.0]
    assert "tau_ci_low" not in sampled and "prompts_by_set" not in sampled  # an engine counts per set, not per prompt
    assert metrics["time"]["decode_sampled_s"] > 0

    metrics, temperatures = evaluate(None)
    assert "sampled" not in metrics and "decode_sampled_s" not in metrics["time"] and temperatures == [0.0] * 12
