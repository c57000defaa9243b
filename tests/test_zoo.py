"""The zoo's targets: stored in zoo.dtype as real checkpoints are, trained on in float32."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from eagle3ops.config import TinyLlamaConfig
from eagle3ops.zoo.targets import build_llama, save_target


def test_targets_are_stored_in_the_zoo_dtype_and_train_on_in_float32(tiny_tokenizer, tmp_path):
    shape = TinyLlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=32)
    model = build_llama(shape, tiny_tokenizer, seed=0)
    save_target(model, tiny_tokenizer, tmp_path / "bf16", torch.bfloat16)
    save_target(model, tiny_tokenizer, tmp_path / "fp32")

    stored = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    weights = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for p in weights.values())  # the successor goes on training from these
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(stored[name], weights[name].detach().to(torch.bfloat16))
    assert torch.equal(load_file(tmp_path / "fp32" / "model.safetensors")[name], weights[name].detach())
