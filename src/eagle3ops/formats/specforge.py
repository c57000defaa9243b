"""Drafter checkpoints in the SpecForge / SGLang "LlamaForCausalLMEagle3" layout.

    <dir>/config.json          architectures ["LlamaForCausalLMEagle3"], eagle_config {...}, fc_norm and
                               norm_output (EAGLE-3.1, top level as SpecForge writes them; absent = false),
                               eagle3ops {...} (what eagle3ops knows of how it was trained: PROVENANCE below)
    <dir>/model.safetensors    fc, fc_norm.{0,1,2} (EAGLE-3.1), midlayer.*, norm, lm_head, d2t, t2d (no embedding:
                               it is the target's)
    <dir>/training_state.pt    optional: optimizer, scheduler, step, RNG states, for resuming

`eagle_aux_hidden_state_layer_ids` is written in SGLang's convention (id i = output of decoder layer i), which
is HF hidden_states index i + 1; in memory we keep HF indices (see formats/conventions.py). Other layouts are
read by formats/checkpoint.py and written by formats/export.py.

The `eagle3ops` record. norm_output true means, to vLLM, SGLang, speculators and eagle3ops, that the post-norm state
is carried to the next draft step; SpecForge before sgl-project/SpecForge#879 (merged 2026-09-15) wrote the same
field but trained the pre-norm recurrence, and records no version of its own (only `transformers_version`), so a
config alone cannot say which a drafter learned. A drafter eagle3ops trained says it: {"carried_state":
"post_norm" | "pre_norm"}. A copy eagle3ops writes of another checkpoint (import-drafter, export) keeps that
checkpoint's record, or, where it had none, names the layout it came from ({"source_layout": "sglang"}), so that a
copy never passes for ours. vLLM, SGLang and speculators ignore the key (transformers keeps an unknown key as an
attribute; vLLM's speculators reader takes only the fields it names; speculators' config allows extra fields).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3ops.errors import InputError
from eagle3ops.formats.conventions import from_hf, rope_settings, to_hf
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
TRAINING_STATE = "training_state.pt"
PROVENANCE = "eagle3ops"  # config.json key of the record (module docstring)


class CheckpointError(InputError):
    """A drafter checkpoint that cannot be read or does not fit."""


def to_hf_config(cfg: DraftConfig, torch_dtype: str = "float32", rope_scaling: dict | None = None,
                 provenance: dict | None = None) -> dict:
    """config.json of the layout. `rope_scaling`: the drafter's own, kept as it was trained (DraftConfig has none:
    our drafter applies plain rope, but an imported one may have been trained with scaling). `provenance`: the
    eagle3ops record (module docstring); None writes none."""
    return {
        "architectures": [ARCHITECTURE],
        **llama_layer_config(cfg, torch_dtype, rope_scaling),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **eagle31_fields(cfg),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": from_hf(cfg.aux_layers, "sglang"),
            "use_aux_hidden_state": True,
        },
        **provenance_field(provenance),
    }


def trained_provenance(cfg: DraftConfig) -> dict:
    """The record of a drafter eagle3ops trained: the state its training carried to the next draft step, the
    post-norm one with norm_output (modeling/draft.py, as vLLM and SGLang serve EAGLE-3.1), the pre-norm one
    without (EAGLE-3)."""
    return {"carried_state": "post_norm" if cfg.norm_output else "pre_norm"}


def provenance_field(provenance: dict | None) -> dict:
    return {PROVENANCE: dict(provenance)} if provenance else {}


def eagle31_fields(cfg: DraftConfig) -> dict:
    """The EAGLE-3.1 switches, named and placed (top level) as speculators, SpecForge, vLLM and SGLang read them."""
    return {"fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}


def llama_layer_config(cfg: DraftConfig, torch_dtype: str, rope_scaling: dict | None) -> dict:
    """The drafter's one decoder layer as a Llama config: what both serving layouts describe it with."""
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        **({"rope_scaling": rope_scaling} if rope_scaling else {}),
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
    }


def from_hf_config(config: dict, where: str) -> DraftConfig:
    try:
        eagle = config.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return DraftConfig(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim"),
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size", config["vocab_size"]),
            target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
            aux_layers=to_hf(ids, "sglang") if ids is not None else [],
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rope_theta=rope_settings(config)[0],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            fc_norm=bool(config.get("fc_norm", False)),
            norm_output=bool(config.get("norm_output", False)),
        )
    except KeyError as err:
        raise CheckpointError(f"{where}: config.json lacks {err.args[0]!r}") from None


def read_config(directory: str | Path) -> DraftConfig:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json; not a drafter checkpoint")
    return from_hf_config(json.loads(path.read_text()), str(path))


def save_drafter(draft: Eagle3Draft, directory: str | Path, training_state: dict | None = None) -> None:
    """A drafter eagle3ops trained (its config carries trained_provenance), with its training state if given."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in draft.state_dict().items()
               if not name.startswith("embed_tokens.")}
    write_checkpoint(draft.cfg, tensors, directory, provenance=trained_provenance(draft.cfg))
    if training_state is not None:
        torch.save(training_state, Path(directory) / TRAINING_STATE)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_checkpoint(cfg: DraftConfig, tensors: dict[str, torch.Tensor], directory: str | Path,
                     rope_scaling: dict | None = None, provenance: dict | None = None) -> None:
    """config.json + model.safetensors from a config and the drafter's tensors (our names, no embedding).
    `provenance`: the eagle3ops record to write (trained_provenance for a drafter trained here, the source's for a
    copy); None writes none."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = to_hf_config(cfg, dtype_name(tensors["fc.weight"].dtype), rope_scaling, provenance)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {WEIGHTS}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as err:  # safetensors raises its own error types for truncated or foreign files
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None


def load_into(draft: Eagle3Draft, directory: str | Path) -> None:
    """Copy a checkpoint's weights (and its d2t/t2d) into `draft`; any key or shape that does not fit is named."""
    weights = read_weights(directory)
    expected = {name: t.shape for name, t in draft.state_dict().items() if not name.startswith("embed_tokens.")}
    problems = [f"{name}: checkpoint {tuple(weights[name].shape)} vs drafter {tuple(shape)}"
                for name, shape in expected.items() if name in weights and weights[name].shape != shape]
    buffers = {"d2t": torch.int64, "t2d": torch.bool}  # indices and a mask: no cast can repair another dtype
    problems += [f"{name}: checkpoint dtype {weights[name].dtype} vs {dtype}"
                 for name, dtype in buffers.items() if name in weights and weights[name].dtype != dtype]
    problems += [f"{name}: missing from the checkpoint" for name in expected if name not in weights]
    problems += [f"{name}: not a drafter parameter" for name in weights if name not in expected]
    if problems:
        raise CheckpointError(f"{directory}: the checkpoint does not fit the drafter:\n  " + "\n  ".join(problems))
    draft.load_state_dict(weights, strict=False)


def load_drafter(directory: str | Path, embedding: torch.Tensor) -> Eagle3Draft:
    """A drafter from `directory`, with the target's embedding [V, H] put in."""
    cfg = read_config(directory)
    draft = new_with_embedding(cfg, embedding, directory)
    load_into(draft, directory)
    return draft


def new_with_embedding(cfg: DraftConfig, embedding: torch.Tensor, directory: str | Path) -> Eagle3Draft:
    """An Eagle3Draft of `cfg` holding the target's embedding [V, H], which must have the drafter's shape, its other
    tensors uninitialised host memory for a checkpoint to fill (load_into and read_drafter refuse a checkpoint that
    lacks any tensor but the embedding): built on the meta device, so no random initialisation runs for nothing."""
    if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{directory}: drafter expects a target embedding of {(cfg.vocab_size, cfg.hidden_size)}, "
                              f"the target has {tuple(embedding.shape)}")
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    draft.to_empty(device="cpu")
    use_embedding(draft, embedding)
    return draft


def use_embedding(draft: Eagle3Draft, embedding: torch.Tensor) -> None:
    """The target's embedding [V, H] as the drafter's frozen one, in place of the placeholder it was built with: the
    tensor itself where it has the drafter's dtype (frozen, it is only read), else converted into the placeholder.
    Moved to the drafter's device first, so that a GPU converts it, not the host."""
    weight = draft.embed_tokens.weight
    moved = embedding.detach().to(weight.device)
    if moved.dtype == weight.dtype:
        draft.embed_tokens.weight = torch.nn.Parameter(moved, requires_grad=False)
    else:  # into the placeholder: a new tensor on the host would fault its pages in, on top of the placeholder's
        weight.data.copy_(moved)
