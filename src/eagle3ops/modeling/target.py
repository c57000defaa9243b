"""The target model's one home: its config read (text_config, text_config_checked, target_layout), loading, which
layers feed the drafter, and capturing them with hooks.

Layer ids here are indices into Hugging Face's `output_hidden_states` tuple: 0 is the embedding output and
i is the output of decoder layer i-1, i.e. the input of decoder layer i (vLLM's meaning of an id). SGLang and
SpecForge write the output of layer i as id i, which is HF index i+1; `formats/` converts at the boundary.
Hooks capture only those layers and the final normed hidden state, instead of all N+1 hidden states.

Any Hugging Face causal LM works, and so does a multimodal wrapper around one (Kimi-K2.5 keeps a DeepSeek-V3
text model under `language_model`): the text model is found by `text_model()`, and hidden size, depth and
vocabulary always come from the text config, never from the wrapper's.

transformers is imported by the functions that load with it, not with this module: its model and tokenizer classes
take seconds to import, and offline training reads only the target's embedding, head and config (the simulator off,
as the presets for real targets set it).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from eagle3ops.config import TargetConfig
from eagle3ops.data.chat import use_chat_template
from eagle3ops.errors import InputError
from eagle3ops.serving.registry import stop_idle

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

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


def text_config_checked(target_dir: str | Path) -> dict:
    """The target's language-model config, with the fields a drafter is checked against."""
    config = text_config(target_dir)
    missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers")
               if not isinstance(config.get(key), int)]
    if missing:
        raise TargetError(f"{target_dir}/config.json: no integer {', '.join(missing)} (under text_config for a "
                          f"multimodal wrapper); a drafter cannot be checked against it")
    return config


def load_tokenizer(target: TargetConfig):
    """The target's tokenizer, rendering with `target.chat_template` (null: its own template, which it must
    then have); it must have no ids beyond the target's embedding."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(check_model_dir(target.path)),
                                              trust_remote_code=target.trust_remote_code)
    use_chat_template(tokenizer, target.chat_template, str(target.path))
    vocab_size = text_config(target.path).get("vocab_size")
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise TargetError(f"{target.path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                          f"{vocab_size}; they do not belong together")
    return tokenizer


def load_text_config(target: TargetConfig) -> PretrainedConfig:
    """The language model's config (a wrapper's `text_config`), without loading any weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(check_model_dir(target.path)), trust_remote_code=target.trust_remote_code)
    return config.get_text_config()


def model_text_config(model: PreTrainedModel) -> PretrainedConfig:
    return model.config.get_text_config()


def _auto_class(config: PretrainedConfig, target: TargetConfig):
    # Causal LMs first; multimodal wrappers (Kimi-K2.5, Gemma 3, Llava...) load as image-text-to-text models and
    # run text-only forwards all the same.
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_classes = (AutoModelForCausalLM, AutoModelForImageTextToText)
    remote = (getattr(config, "auto_map", None) or {}) if target.trust_remote_code else {}
    for auto in auto_classes:
        if auto.__name__ in remote or type(config) in auto._model_mapping:
            return auto
    raise TargetError(f"{target.path}: transformers has no {' or '.join(a.__name__ for a in auto_classes)} class "
                      f"for model_type {config.model_type!r}" + ("" if target.trust_remote_code else
                      "; if the repository ships its own modeling code, set target.trust_remote_code: true"))


def load_target(target: TargetConfig) -> PreTrainedModel:
    """`from_pretrained` with no remote code unless target.trust_remote_code says so; the whole model on
    target.device, or, with target.device_map, its layers spread over the GPUs (and CPU or disk) by
    from_pretrained (accelerate), within target.max_memory. Then a forward runs the layers one GPU after the
    other; inputs go to `model.device`, the embedding's, and `capture` brings what it keeps there."""
    from transformers import AutoConfig

    path = str(check_model_dir(target.path))
    config = AutoConfig.from_pretrained(path, trust_remote_code=target.trust_remote_code)
    make_gpu_room(Path(path), target)
    placement = {"device_map": target.device_map, "max_memory": target.max_memory} if target.device_map else {}
    model = _auto_class(config, target).from_pretrained(path, config=config, dtype=DTYPES[target.dtype],
                                                        trust_remote_code=target.trust_remote_code, **placement)
    if not placement:
        model = model.to(resolve_device(target.device))
    elif model.device.type == "meta":
        raise TargetError(f"target.device_map: {getattr(model, 'hf_device_map', target.device_map)} offloads the "
                          f"input embedding (its weights stay on 'meta'); inputs and captured states need it on a "
                          f"device: place it on a GPU (or cpu on a machine without one)")
    return model.eval().requires_grad_(False)


def make_gpu_room(path: Path, target: TargetConfig) -> None:
    """An idle vLLM engine session holds vllm.gpu_memory_utilization of its GPUs (serving/session.py). Before the
    target loads into this process on a GPU with less free memory than its weights need (their files' size, a
    fifth more for what loading allocates besides), the idle engines stop; the next stage on vLLM starts one."""
    if not torch.cuda.is_available() or (not target.device_map and resolve_device(target.device).type != "cuda"):
        return
    devices = range(torch.cuda.device_count()) if target.device_map else [resolve_device(target.device)]
    free = sum(torch.cuda.mem_get_info(device)[0] for device in devices)
    need = 1.2 * sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))
    if need > free:
        stop_idle(f"to load the target into this process ({need / 2**30:.1f} GiB with what loading allocates; "
                  f"{free / 2**30:.1f} GiB of GPU memory free)")


def model_size(model: nn.Module) -> dict[str, int]:
    """Parameter count and weight bytes: the counters `project` scales compute- and memory-bound time by."""
    return {"target_params": sum(p.numel() for p in model.parameters()),
            "target_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


# Where model classes keep their text model (the module with the decoder `layers` and the final `norm`), most
# common first: causal LMs and most wrappers answer get_decoder(); older wrappers nest it by name.
TEXT_MODEL_PATHS = ("get_decoder()", "model.language_model", "language_model.model", "language_model", "model")


def text_model(model: PreTrainedModel) -> nn.Module:
    tried = []
    for path in TEXT_MODEL_PATHS:
        try:
            found = model.get_decoder() if path == "get_decoder()" else attrgetter(path)(model)
        except (AttributeError, NotImplementedError):
            found = None
        layers, norm = getattr(found, "layers", None), getattr(found, "norm", None)
        if isinstance(layers, nn.ModuleList) and isinstance(norm, nn.Module):
            return found
        tried.append(path)
    raise TargetError(f"{type(model).__name__}: found no text model with decoder `layers` and a final `norm`; "
                      f"tried {', '.join(tried)}")


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    return text_model(model).layers


def final_norm(model: PreTrainedModel) -> nn.Module:
    return text_model(model).norm


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


@dataclass(frozen=True)
class TargetLayout:
    """The target's shape and the configured layers: what vLLM's captured states and peer files are checked against."""
    path: Path
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    aux_layers: list[int]  # HF hidden_states indices, in the configured order

    @property
    def slot_order(self) -> list[int]:
        """Engines store the aux layers low to high: where each configured layer sits among them."""
        ranked = sorted(self.aux_layers)
        return [ranked.index(i) for i in self.aux_layers]


def target_layout(target: TargetConfig) -> TargetLayout:
    """From config.json alone (text_config for multimodal wrappers): the target is never loaded here."""
    config = text_config(target.path)
    layers = config["num_hidden_layers"]
    return TargetLayout(Path(target.path), config["hidden_size"], layers, config.get("rms_norm_eps", 1e-6),
                        resolve_aux_layers(target.aux_layers, layers))


class HiddenCapture:
    """Forward hooks collecting the aux layers ([B, T, H] each) and the final normed state of one forward, all
    on `model.device`, also when the layers live on several devices (target.device_map)."""

    def __init__(self, model: PreTrainedModel, aux_layers: list[int]):
        self.aux_layers = aux_layers
        self.device = model.device
        self.captured: dict[int | str, torch.Tensor] = {}
        layers = decoder_layers(model)
        self._handles = []
        for index in sorted(set(aux_layers)):
            module = model.get_input_embeddings() if index == 0 else layers[index - 1]
            self._handles.append(module.register_forward_hook(self._keep(index)))
        self._handles.append(final_norm(model).register_forward_hook(self._keep("final")))

    def _keep(self, key):
        def hook(_module, _inputs, output):
            self.captured[key] = (output[0] if isinstance(output, tuple) else output).to(self.device)
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


def weight_locations(path: Path) -> dict[str, str]:
    """{tensor name: safetensors file}, from the shard index of a sharded checkpoint or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise TargetError(f"{index}: not a safetensors index ({err})") from None
    single = path / "model.safetensors"
    if not single.is_file():
        raise TargetError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as handle:
        return {name: single.name for name in handle.keys()}


# Tensors of a multimodal wrapper's other towers never stand in for the language model's.
OTHER_TOWERS = ("vision", "visual", "audio", "mm_projector", "multi_modal_projector")


def _language_model_tensor(locations: dict[str, str], suffix: str) -> str | None:
    """The language model's own `*suffix` tensor: not another tower's, not a copy inside a decoder layer
    (DeepSeek-V3's multi-token-prediction layer has its own embed_tokens), a wrapper's `language_model.*` first."""
    names = [name for name in locations if name.endswith(suffix) and ".layers." not in name
             and not any(tower in name for tower in OTHER_TOWERS)]
    return min(names, key=lambda name: ("language_model" not in name, len(name), name), default=None)


def load_embedding_and_head(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and lm_head [V, H], read straight from its safetensors files.

    Training needs only these two matrices, so a 1 TB target is never loaded for it.
    """
    path = check_model_dir(path)
    locations = weight_locations(path)
    config = json.loads((path / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False) or text_config(path).get("tie_word_embeddings", False)

    embed_name = _language_model_tensor(locations, "embed_tokens.weight")
    head_name = _language_model_tensor(locations, "lm_head.weight")
    if embed_name is None:
        raise TargetError(f"{path}: no '*embed_tokens.weight' tensor of the language model in the checkpoint")
    if head_name is None:
        if not tied:
            raise TargetError(f"{path}: no 'lm_head.weight' tensor and tie_word_embeddings is false")
        head_name = embed_name

    def read(name: str) -> torch.Tensor:
        shard = path / locations[name]
        if not shard.is_file():
            raise TargetError(f"{path}: the index puts {name} in {locations[name]}, which is missing")
        with safe_open(str(shard), framework="pt") as handle:
            return handle.get_tensor(name)

    return read(embed_name), read(head_name)
