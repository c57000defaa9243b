"""Drafter checkpoints in the vllm-project/speculators EAGLE-3 layout, which `vllm serve <dir>` loads directly.

    <dir>/config.json          architectures ["Eagle3Speculator"], speculators_model_type "eagle3",
                               transformer_layer_config (the 1-layer Llama config: sizes, vocab_size, positions,
                               rope), draft_vocab_size, target_hidden_size, norm_before_residual,
                               fc_norm and norm_output (EAGLE-3.1), eagle3ops (the record, specforge.py),
                               eagle_aux_hidden_state_layer_ids (vLLM's convention: HF hidden-state indices),
                               speculators_config {algorithm, proposal_methods, default_proposal_method,
                               verifier {name_or_path, architectures}}
    <dir>/model.safetensors    fc, fc_norm.{0,1,2} (EAGLE-3.1), layers.0.* (our midlayer.*), norm, lm_head, d2t,
                               t2d; no embed_tokens: vLLM shares the target's (the speculators library itself
                               needs it copied in: docs/serving.md)

vLLM builds the drafter's config from transformer_layer_config plus the top-level EAGLE-3 fields, and reads a
missing norm_before_residual as true; our drafter keeps the un-normed feature as its residual, so the export
writes false. The verifier is the target `vllm serve <dir>` loads.
"""
from __future__ import annotations

import torch

from eagle3ops.formats.conventions import from_hf, rope_settings, to_hf
from eagle3ops.formats.specforge import CheckpointError, eagle31_fields, llama_layer_config, provenance_field
from eagle3ops.modeling.draft import DraftConfig

ARCHITECTURE = "Eagle3Speculator"
MODEL_TYPE = "eagle3"
LAYER_PREFIX, OUR_PREFIX = "layers.0.", "midlayer."


def to_speculators_config(cfg: DraftConfig, torch_dtype: str, rope_scaling: dict | None, verifier: str,
                          verifier_architectures: list[str], speculative_tokens: int,
                          provenance: dict | None = None) -> dict:
    layer = {**llama_layer_config(cfg, torch_dtype, rope_scaling), "attention_bias": False, "mlp_bias": False}
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        **eagle31_fields(cfg),
        "eagle_aux_hidden_state_layer_ids": from_hf(cfg.aux_layers, "vllm"),
        "torch_dtype": torch_dtype,
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        **provenance_field(provenance),
    }


def from_speculators_config(config: dict, where: str) -> tuple[DraftConfig, dict | None]:
    """(DraftConfig, the drafter's rope scaling) of a speculators config; variants our drafter cannot run are
    refused by name."""
    if config.get("speculators_model_type") != MODEL_TYPE:
        raise CheckpointError(f"{where}: speculators_model_type {config.get('speculators_model_type')!r}; "
                              f"only EAGLE-3 ({MODEL_TYPE!r}) drafters are supported")
    for flag, meaning in (("norm_before_residual", "the residual is the normed feature"),
                          ("norm_before_fc", "an RMSNorm over the fused features before fc")):
        if config.get(flag):  # the speculators library's default for both is false
            raise CheckpointError(f"{where}: {flag} is true ({meaning}); eagle3ops' drafter does not have that variant")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{where}: no transformer_layer_config; not a speculators EAGLE-3 config")
    if layer.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{where}: transformer_layer_config.num_hidden_layers is {layer['num_hidden_layers']}; "
                              f"eagle3ops' drafter has one decoder layer")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    theta, scaling = rope_settings(layer)
    try:
        cfg = DraftConfig(
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
            head_dim=layer.get("head_dim"),
            vocab_size=layer["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            aux_layers=to_hf(ids, "vllm") if ids else [],
            max_position_embeddings=layer.get("max_position_embeddings", 4096),
            rope_theta=theta,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            fc_norm=bool(config.get("fc_norm", False)),
            norm_output=bool(config.get("norm_output", False)),
        )
    except KeyError as err:
        raise CheckpointError(f"{where}: transformer_layer_config lacks {err.args[0]!r}") from None
    return cfg, scaling


def to_speculators_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {(LAYER_PREFIX + name[len(OUR_PREFIX):] if name.startswith(OUR_PREFIX) else name): t
            for name, t in tensors.items()}


def from_speculators_names(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    deeper = sorted(name for name in tensors if name.startswith("layers.") and not name.startswith(LAYER_PREFIX))
    if deeper:
        raise CheckpointError(f"{where}: weights of more than one decoder layer ({deeper[:3]}...); eagle3ops' drafter "
                              f"has one")
    return {(OUR_PREFIX + name[len(LAYER_PREFIX):] if name.startswith(LAYER_PREFIX) else name): t
            for name, t in tensors.items()}
