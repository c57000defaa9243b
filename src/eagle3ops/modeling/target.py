"""The target model: loading, which layers feed the drafter, and capturing them with hooks.

Layer ids here are indices into Hugging Face's `output_hidden_states` tuple: 0 is the embedding output and
i is the output of decoder layer i-1, i.e. the input of decoder layer i (vLLM's meaning of an id). SGLang and
SpecForge write the output of layer i as id i, which is HF index i+1; `formats/` converts at the boundary.
Hooks capture only those layers and the final normed hidden state, instead of all N+1 hidden states.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from eagle3ops.config import TargetConfig
from eagle3ops.errors import InputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetError(InputError):
    """A target that cannot be used as configured."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise TargetError(f"{path}: not a model directory (no config.json); check target.path in params.yaml")
    return path


def text_config(path: str | Path) -> dict:
    """The language model's settings from config.json (under `text_config` for multimodal wrappers)."""
    config = json.loads((check_model_dir(path) / "config.json").read_text())
    return config.get("text_config") or config


def load_tokenizer(target: TargetConfig):
    """The target's tokenizer; it must have a chat template and no ids beyond the target's embedding."""
    tokenizer = AutoTokenizer.from_pretrained(str(check_model_dir(target.path)),
                                              trust_remote_code=target.trust_remote_code)
    if not tokenizer.chat_template:
        raise TargetError(f"{target.path}: the tokenizer has no chat template")
    vocab_size = text_config(target.path).get("vocab_size")
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise TargetError(f"{target.path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                          f"{vocab_size}; they do not belong together")
    return tokenizer


def load_target(target: TargetConfig) -> PreTrainedModel:
    """`from_pretrained` with no remote code unless target.trust_remote_code says so."""
    model = AutoModelForCausalLM.from_pretrained(str(check_model_dir(target.path)), dtype=DTYPES[target.dtype],
                                                 trust_remote_code=target.trust_remote_code)
    return model.to(resolve_device(target.device)).eval().requires_grad_(False)


def model_size(model: nn.Module) -> dict[str, int]:
    """Parameter count and weight bytes: the counters `project` scales compute- and memory-bound time by."""
    return {"target_params": sum(p.numel() for p in model.parameters()),
            "target_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base.layers


def final_norm(model: PreTrainedModel) -> nn.Module:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base.norm


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layers(aux_layers: list[int] | None, num_layers: int) -> list[int]:
    """Configured ids (or the default), checked against the target's depth."""
    ids = list(aux_layers) if aux_layers is not None else default_aux_layers(num_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise TargetError(f"target.aux_layers: {bad} out of range; the target has {num_layers} decoder layers, "
                          f"so hidden-state indices run 0..{num_layers - 1}")
    if len(set(ids)) != len(ids):
        raise TargetError(f"target.aux_layers: {ids} repeats a layer; EAGLE-3 fuses three different layers"
                          + (" (the default [2, N//2, N-3] needs N >= 8)" if aux_layers is None else ""))
    return ids


class HiddenCapture:
    """Forward hooks collecting the aux layers ([B, T, H] each) and the final normed state of one forward."""

    def __init__(self, model: PreTrainedModel, aux_layers: list[int]):
        self.aux_layers = aux_layers
        self.captured: dict[int | str, torch.Tensor] = {}
        layers = decoder_layers(model)
        self._handles = []
        for index in sorted(set(aux_layers)):
            module = model.get_input_embeddings() if index == 0 else layers[index - 1]
            self._handles.append(module.register_forward_hook(self._keep(index)))
        self._handles.append(final_norm(model).register_forward_hook(self._keep("final")))

    def _keep(self, key):
        def hook(_module, _inputs, output):
            self.captured[key] = output[0] if isinstance(output, tuple) else output
        return hook

    def aux(self) -> torch.Tensor:
        """[B, T, 3H], low to high as configured."""
        return torch.cat([self.captured[i] for i in self.aux_layers], dim=-1)

    def final(self) -> torch.Tensor:
        return self.captured["final"]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@contextmanager
def capture(model: PreTrainedModel, aux_layers: list[int]):
    hooks = HiddenCapture(model, aux_layers)
    try:
        yield hooks
    finally:
        hooks.remove()


def _weight_locations(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = path / "model.safetensors"
    if not single.is_file():
        raise TargetError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as handle:
        return {name: single.name for name in handle.keys()}


def load_embedding_and_head(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and lm_head [V, H], read straight from its safetensors files.

    Training needs only these two matrices, so a 1 TB target is never loaded for it.
    """
    path = check_model_dir(path)
    locations = _weight_locations(path)
    config = json.loads((path / "config.json").read_text())

    def find(suffix: str) -> str | None:
        matches = sorted(name for name in locations if name.endswith(suffix))
        return matches[0] if matches else None

    embed_name, head_name = find("embed_tokens.weight"), find("lm_head.weight")
    if embed_name is None:
        raise TargetError(f"{path}: no '*embed_tokens.weight' tensor in the checkpoint")
    if head_name is None:
        if not config.get("tie_word_embeddings", False):
            raise TargetError(f"{path}: no 'lm_head.weight' tensor and tie_word_embeddings is false")
        head_name = embed_name

    def read(name: str) -> torch.Tensor:
        with safe_open(str(path / locations[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    return read(embed_name), read(head_name)
