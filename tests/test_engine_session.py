"""Engine sessions (serving/session.py) on real vLLM servers of the CPU build: a later stage finds the engine an
earlier one started and swaps its drafter in, drafting exactly as a server started with that drafter does; a
record that lies about its server and an engine killed while a stage uses it are replaced, never used (the stage's
request fails); an idle engine stops by itself; an engine started when vllm.engines_kept are running makes room;
a port taken while an engine starts is refused; an idle engine stops for a target loaded on a GPU that lacks the
room; `eagle3ops engine ls` and `stop`.

Starts five vLLM servers of the tiny target (about 30 s each on 2 cores, alone): the session's engine, a
stage-local one with the second drafter (the reference), the engine again after it was killed, and two of the
target alone; and a sixth that fails at its bind. The whole pipeline's use of sessions is checked in tests/test_pipeline_e2e.py and
tests/test_pipeline_experiments.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx2
import psutil
import pytest
import torch

from eagle3ops.cli import main
from eagle3ops.config import VllmConfig
from eagle3ops.decoding.engines import SpecCounters, settled_counters
from eagle3ops.formats.export import export_drafter
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.serving import session
from eagle3ops.serving.http import EngineError, EngineUnavailable, Retries, fetch_json, send, served_model
from eagle3ops.serving.registry import running, stop
from eagle3ops.serving.session import EngineSpec, engine
from helpers import loopback_server

pytestmark = pytest.mark.service

PROMPTS = [[5 + i, 17, 33, 8, 91, 40, 12, 7] * 4 for i in range(6)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """This module's own engine directory: what it starts, it counts and stops."""
    directory = tmp_path_factory.mktemp("engines")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EAGLE3OPS_ENGINE_DIR", str(directory))
        yield directory
        for record in running():
            stop(record["key"])


@pytest.fixture(scope="module")
def exports(tiny_target_dir, tmp_path_factory) -> list[Path]:
    """Two random drafters of one shape for the tiny target, as eval serves them (speculators exports)."""
    root, vocab = tmp_path_factory.mktemp("drafters"), json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    paths = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        draft = Eagle3Draft(DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=1,
                                        num_key_value_heads=1, vocab_size=vocab, draft_vocab_size=vocab,
                                        target_hidden_size=32, aux_layers=[1, 2, 3], max_position_embeddings=512))
        draft.t2d.fill_(True)
        save_drafter(draft, root / f"trained-{seed}")
        export_drafter(root / f"trained-{seed}", root / f"export-{seed}", "speculators", tiny_target_dir)
        paths.append(root / f"export-{seed}")
    return paths


def drafted(url: str) -> tuple[SpecCounters, list[str]]:
    """PROMPTS one after another, greedy: what the spec-decode counters moved by, and the texts."""
    before = settled_counters(f"{url}/metrics")
    model = httpx2.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    texts = [httpx2.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 24,
                                                          "temperature": 0}, timeout=120).json()["choices"][0]["text"]
             for prompt in PROMPTS]
    return settled_counters(f"{url}/metrics") - before, texts


def spec(target: Path, export: Path | None = None) -> EngineSpec:
    return EngineSpec(str(target), "float32", 0, drafter=str(export) if export else None)


class OtherModel(BaseHTTPRequestHandler):
    """Another server on a port an engine's record names: healthy, serving another model."""
    def do_GET(self):
        body = json.dumps({"data": [{"id": "other", "root": "/models/other"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_lying_record_is_replaced_and_a_later_stage_finds_the_engine(engines, exports, tiny_target_dir, capsys):
    """A record of this engine's key whose port answers as another model (a port taken over by another server) is
    stopped and replaced, never used; the next stage then finds the engine started in its place."""
    settings = VllmConfig()
    key = spec(tiny_target_dir, exports[0]).key(settings)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with loopback_server(OtherModel) as url:
        (engines / f"{key}.json").write_text(json.dumps({
            "key": key, "model": str(tiny_target_dir.resolve()), "url": url, "supervisor_pid": stand_in.pid,
            "lock": str(engines / f"{key}.lock"), "started_at": 0, "started_by": "nobody", "log": "-",
            "start_s": 1.0, "drafter": True}))
        with engine(spec(tiny_target_dir, exports[0]), settings, "first") as first:
            assert first.started and first.url != url
    stand_in.wait(timeout=30)  # what the lying record named was stopped (and reaped by the stop)
    assert not psutil.pid_exists(stand_in.pid)
    out = capsys.readouterr().out
    assert f"engine {key} at {url} does not answer as its target: stopping it" in out
    with engine(spec(tiny_target_dir, exports[1]), settings, "second") as second:
        assert not second.started and second.url == first.url and second.key == key
    assert f"vllm: engine {key} found at {first.url} (started by first" in capsys.readouterr().out
    assert [record["key"] for record in running()] == [key]


def test_a_swapped_drafter_drafts_as_a_server_started_with_it(engines, exports, tiny_target_dir):
    """The second drafter's weights loaded into the engine started with the first: vLLM's counters and outputs are
    those of a server of the stage's own started with the second (vllm.engine_idle_s 0); the first drafts
    differently, so a swap that did not happen would show."""
    settings = VllmConfig()
    with engine(spec(tiny_target_dir, exports[0]), settings, "first again") as served:
        assert not served.started and not served.use_drafter(exports[0])  # its weights already
        first = drafted(served.url)
        assert served.use_drafter(exports[1])
        swapped = drafted(served.url)
        assert not served.use_drafter(exports[1])
    with engine(spec(tiny_target_dir, exports[1]), VllmConfig(engine_idle_s=0), "reference") as own:
        assert own.started and not own.key
        reference = drafted(own.url)
    assert swapped == reference and reference[0].drafts > 0
    assert first[0] != reference[0]
    assert first[1] == reference[1]  # greedy: the target's output whatever drafts


def test_a_killed_engine_is_replaced(engines, exports, tiny_target_dir):
    """The engine's server killed while a stage measures on it: its supervisor sees the death, stops what is left
    of the engine (its engine-core process, orphaned before) and forgets it; the stage's next request fails at
    once, saying the engine is gone (no retries of a dead engine, no figure from it); the next stage starts
    another."""
    with engine(spec(tiny_target_dir, exports[0]), VllmConfig(), "killed mid-eval") as served:
        (record,) = running()
        assert not served.started and record["url"] == served.url
        supervisor = psutil.Process(record["supervisor_pid"])
        (server,) = [p for p in supervisor.children() if "vllm.entrypoints" in " ".join(p.cmdline())]
        fetch_json(f"{served.url}/v1/completions", {"model": served_model(served.url), "prompt": PROMPTS[0],
                                                    "max_tokens": 4, "temperature": 0})
        engine_core = server.children(recursive=True)
        assert engine_core
        server.send_signal(signal.SIGKILL)
        supervisor.wait(timeout=60)
        retries = Retries()  # a stage's own: they waited about a minute for a dead engine
        with pytest.raises(EngineUnavailable, match=re.escape(f"its vLLM engine {record['key']} is gone")):
            send("POST", f"{served.url}/v1/completions", {"model": "any", "prompt": PROMPTS[0], "max_tokens": 4},
                 retries)
        assert retries.retries == 0
    assert running() == []
    assert not [p for p in engine_core if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    with engine(spec(tiny_target_dir, exports[0]), VllmConfig(), "after the kill") as again:
        assert again.started and again.url != record["url"]


def test_room_is_made_for_an_engine_beyond_engines_kept_and_an_idle_one_stops(engines, exports, tiny_target_dir,
                                                                             capsys):
    """With vllm.engines_kept 1, starting the target alone stops the idle engine with a drafter first; `eagle3ops
    engine ls` shows the one left, which, started with vllm.engine_idle_s 5, stops by itself once unused,
    processes and all."""
    (with_drafter,) = running()
    capsys.readouterr()
    with engine(spec(tiny_target_dir), VllmConfig(engines_kept=1, engine_idle_s=5), "target alone") as alone:
        assert alone.started
    assert f"vllm: stopping engine {with_drafter['key']}" in capsys.readouterr().out
    assert not psutil.pid_exists(with_drafter["supervisor_pid"])
    (record,) = running()
    assert main(["engine", "ls"]) == 0
    shown = capsys.readouterr().out
    assert record["key"] in shown and record["url"] in shown and "target alone" in shown and not record["drafter"]
    supervisor = psutil.Process(record["supervisor_pid"])
    processes = [supervisor, *supervisor.children(recursive=True)]
    deadline = time.monotonic() + 60
    while running() and time.monotonic() < deadline:
        time.sleep(1)
    assert running() == [] and not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert main(["engine", "stop", "--all"]) == 0 and "stopped 0 engine(s)" in capsys.readouterr().out
    assert main(["engine", "stop", "nosuchkey"]) == 2
    assert "no engine nosuchkey on this machine" in capsys.readouterr().err
    assert os.environ["EAGLE3OPS_ENGINE_DIR"] == str(engines)


def test_a_port_taken_while_the_engine_starts_is_refused(engines, tiny_target_dir, monkeypatch):
    """Another server takes the port between the pick and vLLM's bind, and answers /health: the start fails with a
    message naming the port, vLLM is stopped and no record is left, rather than a stage measuring another server.
    Costs a vLLM process that fails at its bind (its imports, about 15 s on 2 cores)."""
    with loopback_server(OtherModel) as url:
        port = int(url.rsplit(":", 1)[1])
        monkeypatch.setattr(session, "free_port", lambda: port)
        with pytest.raises(EngineError, match=f"port {port} answers as another server, not "), \
                engine(spec(tiny_target_dir), VllmConfig(), "port taken"):
            pass
    assert running() == []


def test_an_idle_engine_stops_for_a_target_loaded_on_a_gpu_without_room(engines, tiny_target_dir, monkeypatch,
                                                                         capsys):
    """An idle engine holds vllm.gpu_memory_utilization of its GPU: loading the target into a stage's process
    there stops it first where the free memory is short of the weights, and only then. The GPU's free memory is
    the one thing pretended here (CI has no GPU); the engine and its stop are real. Costs an engine start."""
    from eagle3ops.config import TargetConfig
    from eagle3ops.modeling.target import make_gpu_room

    with engine(spec(tiny_target_dir), VllmConfig(), "idle on the GPU"):
        pass
    (record,) = running()
    weights = sum(f.stat().st_size for f in tiny_target_dir.glob("*.safetensors"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = TargetConfig(path=str(tiny_target_dir), device="cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * weights, 80 * 2**30))
    make_gpu_room(tiny_target_dir, on_gpu)
    assert [r["key"] for r in running()] == [record["key"]]  # room enough: the session stays
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (weights, 80 * 2**30))
    make_gpu_room(tiny_target_dir, on_gpu)
    assert running() == [] and not psutil.pid_exists(record["supervisor_pid"])
    assert f"vllm: stopping engine {record['key']} (last used " in capsys.readouterr().out
