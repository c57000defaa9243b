"""`extract.backend: vllm`, and online training fed by the engine: the target's hidden states captured by the engine
that serves it, under its own tensor parallelism, instead of forward hooks on a model loaded here.

A vLLM server started with a `Capture` (serving/vllm.py) runs each request's prompt, stores the requested layers'
states of every prompt position, and writes them when the request finishes (one max_tokens=1 completion per
sample). The layer ids are vLLM's: id i is the input of decoder layer i, which is Hugging Face's hidden_states index
i, and id N (the number of layers) is the last layer's output before the final norm, which is applied here
(tests/test_vllm_extract.py pins both against the hooks). Per request (serving/hidden_states_connector.py):

    <capture directory>/<request id>.safetensors   token_ids [T], hidden_states [T, 4, H] (aux low to high, id N)
    <same path>.lock                                held exclusively until the file is written

The file is read once its lock is free and then deleted: disk holds only the requests in flight, and the shards
(extraction/hf.py, `write_features`) are those the hooks' backend writes, in the same order, resumable the same way.
A server at a URL (train.online_url) must write to a directory this process reads at the same path (one machine,
or a shared filesystem).
"""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3ops.config import TargetConfig, VllmConfig
from eagle3ops.extraction.hf import ExtractResult, write_features
from eagle3ops.extraction.imported import final_norm_weight, from_engine_slots
from eagle3ops.modeling.target import TargetLayout, target_layout
from eagle3ops.serving.http import EngineError, fetch_json, served_model
from eagle3ops.serving.vllm import Capture, vllm_server


def capture_layer_ids(layout: TargetLayout) -> list[int]:
    """The vLLM layer ids to capture: the aux layers low to high (HF index i = vLLM id i), then the last layer."""
    return [*sorted(layout.aux_layers), layout.num_layers]


class EngineStates:
    """One token sequence's states from a capturing vLLM server at `url`: (aux [T, 3H] in the configured layer
    order, final [T, H] after the final norm), in the engine's dtype. Thread-safe: the engine batches the requests
    that callers send at once."""

    def __init__(self, url: str, layout: TargetLayout):
        self.url, self.layout = url.rstrip("/"), layout
        self.model = served_model(self.url)
        self.norm = final_norm_weight(layout.path)

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        completions = f"{self.url}/v1/completions"
        answer = fetch_json(completions, {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0})
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not isinstance(path, str):
            raise EngineError(f"{completions}: no kv_transfer_params.hidden_states_path in the answer: the server does "
                              f"not capture hidden states (start it with serving/vllm.py's Capture: the "
                              f"extract_hidden_states method and the hidden-states connector)")
        data = read_captured(Path(path))
        hidden, captured = data["hidden_states"], data["token_ids"]  # [T, 4, H], [T]
        if captured.tolist() != list(ids):
            raise EngineError(f"{path}: the captured token ids differ from the request's ({len(captured)} vs "
                              f"{len(ids)} tokens): another client's file?")
        if tuple(hidden.shape[1:]) != (4, self.layout.hidden_size):
            raise EngineError(f"{path}: hidden_states is {list(hidden.shape)}, expected [T, 4, "
                              f"{self.layout.hidden_size}] (layer ids {capture_layer_ids(self.layout)} of "
                              f"{self.layout.path})")
        aux, final = from_engine_slots(hidden, self.layout, self.norm)
        return aux, final.to(hidden.dtype)

    def many(self, sequences: list[list[int]], pool: ThreadPoolExecutor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each sequence's states, sent at once so that the engine batches them; in order."""
        return list(pool.map(self, sequences))


@contextmanager
def capturing_server(target: TargetConfig, settings: VllmConfig, log_name: str, directory: Path
                     ) -> Iterator[EngineStates]:
    """A vLLM server of `target` (in its own dtype, the `vllm` settings) that captures into `directory`, until the
    block ends; yields the EngineStates that reads it."""
    layout = target_layout(target)
    with vllm_server(target.path, target.dtype, settings, log_name,
                     capture=Capture(capture_layer_ids(layout), directory)) as url:
        yield EngineStates(url, layout)


def read_captured(path: Path) -> dict[str, torch.Tensor]:
    """The connector holds `<path>.lock` exclusively until the file is written: a shared lock waits for that.
    (vLLM's own load_hidden_states does the same, but would make the train process import vLLM.)"""
    lock = Path(f"{path}.lock")
    try:
        with open(lock) as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            data = load_file(str(path), device="cpu")
    except FileNotFoundError as err:
        raise EngineError(f"{err.filename}: not found here; the server writes its captured states to its own "
                          f"filesystem, which this process must see at the same path") from None
    finally:
        for written in (path, lock):
            if os.path.exists(written):
                os.remove(written)
    return data


def extract_features_vllm(states: EngineStates, samples: list[dict], out_dir: str | Path, batch_size: int,
                          samples_per_shard: int, dtype: str = "float32", meta: dict | None = None,
                          desc: str = "extract", resumable: bool = False,
                          max_nonfinite_fraction: float = 0.01) -> ExtractResult:
    """Shards as extraction/hf.py's extract_features writes them, the states from the engine: a batch's samples
    are sent at once (the engine schedules them together), each sample on its own, so nothing is padded."""
    with ThreadPoolExecutor(max_workers=batch_size, thread_name_prefix="vllm-capture") as pool:
        def forward(ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            per_sample = states.many([row[:n].tolist() for row, n in zip(ids, lengths)], pool)
            return torch.cat([aux for aux, _ in per_sample]), torch.cat([final for _, final in per_sample])

        return write_features(forward, samples, states.layout.aux_layers, states.layout.hidden_size, out_dir,
                              batch_size, samples_per_shard, dtype, meta, desc, resumable, max_nonfinite_fraction)
