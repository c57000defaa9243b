"""Shared fixtures: a tiny BPE tokenizer with the Kimi-style chat template and a tiny random Llama target."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# A few dozen short strings: enough for BPE to learn some merges, small enough to train in well under a second.
TEXTS = [
    f"{subject} {verb} the {thing} number {i}. Hello world, how are you today? The answer is {i * 7}."
    for i, (subject, verb, thing) in enumerate(
        (s, v, t)
        for s in ("The fox", "A user", "The assistant")
        for v in ("jumps over", "thinks about", "writes")
        for t in ("lazy dog", "question", "code")
    )
] + [
    "<think>Let me think step by step.</think> The result is 42.",
    "def add(a, b):\n    return a + b\n",
    "You are a helpful assistant. Answer briefly.",
    "system user assistant",
]


# What a stage reads from its environment: tests start without any of it from the outside.
OUTSIDE_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
               "DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME")


def isolate(monkeypatch: pytest.MonkeyPatch, root: Path, tracking_uri: str | None = None) -> str:
    """Work in `root` with no DVC/MLflow variables from outside and a tracking store of its own
    (sqlite in `root` unless `tracking_uri` names one); returns the store's URI."""
    monkeypatch.chdir(root)
    for name in OUTSIDE_ENV:
        monkeypatch.delenv(name, raising=False)
    uri = tracking_uri or f"sqlite:///{root}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine: a second thread costs more in waiting than it computes.
    A test module that runs many of them uses it for all its tests (autouse in the module)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextmanager
def loopback_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 (a free port) answering with `handler`; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from eagle3ops.zoo.tokenizer import train_tokenizer

    return train_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> Path:
    """A random 4-layer Llama (hidden 32, 2 heads) with the tiny tokenizer, saved as a Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path
