"""Targets of the four architectures users point eagle3ops at, tiny and random, through the real stages.

Llama; Qwen3 (q/k norm); DeepSeek-V3 (MLA, and MoE: a dense first layer, then four routed experts, two per
token, and a shared one); Kimi-K2.5's multimodal wrapper (transformers' Kimi_K25ForConditionalGeneration: a
DeepSeek-V3 text model under `language_model` beside a vision tower, saved sharded with the language model's
tensors under `language_model.*`, as the real checkpoint is). Each is saved with save_pretrained and the tiny
tokenizer, then generate (raw) -> prepare -> extract -> train -> eval run on it through the stage functions the
CLI calls. Checked: the stored hidden states are the model's own output_hidden_states at the configured indices
and the stored final state gives the model's logits through the lm_head read from the checkpoint; the drafter's
loss goes down and its checkpoint loads; speculative decoding is lossless; every stage run logs the target's
identity.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
)
from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

from eagle3ops.config import TargetConfig, load_config
from eagle3ops.data.prepare import read_tokenized
from eagle3ops.data.shards import iter_samples, read_manifest
from eagle3ops.formats.specforge import load_drafter
from eagle3ops.modeling.target import (
    TargetError,
    capture,
    load_embedding_and_head,
    load_target,
    model_text_config,
    text_model,
)
from eagle3ops.stages import eval as eval_stage
from eagle3ops.stages import extract, generate, prepare, train
from eagle3ops.tracking.identity import target_identity
from helpers import TEXTS, isolate

LAYERS = 4
AUX_LAYERS = [1, 2, 3]
# MLA with tiny ranks and head dims; MoE with a dense first layer, then 4 routed experts (2 per token) + 1 shared.
DEEPSEEK_V3 = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=LAYERS,
                   num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                   qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                   first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256)


def _llama(vocab: int, ids: dict):
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=256, **ids))


def _qwen3(vocab: int, ids: dict):  # head_dim 16 with 4 heads: q/k norm over heads that do not tile hidden 32
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False, **ids))


def _deepseek_v3(vocab: int, ids: dict):
    return DeepseekV3ForCausalLM(DeepseekV3Config(vocab_size=vocab, **DEEPSEEK_V3, **ids))


def _kimi_k25(vocab: int, ids: dict):
    text = {"model_type": "deepseek_v3", "vocab_size": vocab, **DEEPSEEK_V3, **ids}
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, pos_emb_height=4,
                  pos_emb_width=4)
    return Kimi_K25ForConditionalGeneration(Kimi_K25Config(text_config=text, vision_config=vision,
                                                           projection_hidden_size=32, tie_word_embeddings=False, **ids))


ARCHITECTURES = {"llama": _llama, "qwen3": _qwen3, "deepseek_v3": _deepseek_v3, "kimi_k25": _kimi_k25}
SAVE_OPTIONS = {"kimi_k25": {"max_shard_size": "100KB"}}  # sharded, with an index, like the real 64-shard release
# The K2 drafter's head_dim (128) is not hidden // heads (112): the wrapped target's drafter is shaped that way too.
DRAFT_SHAPES = {"kimi_k25": {"head_dim": 24, "rope_theta": 1.0e6}}


def save_target(name: str, tokenizer, path: Path) -> Path:
    torch.manual_seed(0)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    ARCHITECTURES[name](len(tokenizer), ids).save_pretrained(path, **SAVE_OPTIONS.get(name, {}))
    tokenizer.save_pretrained(path)
    return path




@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def target_dir(request, tmp_path_factory, tiny_tokenizer) -> Path:
    root = tmp_path_factory.mktemp("architecture") / request.param  # the work directory, named after it
    return save_target(request.param, tiny_tokenizer, root / "target")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One MLflow store for every architecture's runs: creating a sqlite store costs about a second."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def write_datasets(root: Path) -> None:
    (root / "data").mkdir(exist_ok=True)
    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": TEXTS[i % len(TEXTS)]},
                                          {"role": "assistant", "content": TEXTS[(5 * i + 3) % len(TEXTS)]}]}
             for i in range(24)]
    prompts = [{"id": f"p{i}", "family": "chat", "messages": [{"role": "user", "content": TEXTS[i]}]} for i in range(3)]
    for name, records in (("chats.jsonl", chats), ("prompts.jsonl", prompts)):
        (root / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def pipeline(target_dir, store, tiny_tokenizer) -> Path:
    """generate (raw) -> prepare -> extract -> train@scratch -> eval@scratch on the target; the work directory."""
    root = target_dir.parent
    write_datasets(root)
    name = root.name
    OmegaConf.save({
        "target": {"path": str(target_dir), "lineage_dep": str(target_dir / "config.json"), "id": f"tiny/{name}",
                   "aux_layers": AUX_LAYERS, "device": "cpu"},
        "data": {"conversations": "data/chats.jsonl", "max_len": 64, "eval_fraction": 0.2,
                 "draft_vocab_size": len(tiny_tokenizer)},
        "generate": {"backend": "none"},
        "extract": {"batch_size": 4, "samples_per_shard": 8},
        "train": {"epochs": 4, "batch_size": 2, "packed_length": 128, "lr": 3e-3, "warmup_ratio": 0.1, "ttt_steps": 3, "log_every": 1,
                  "checkpoint_every": 0, "draft": DRAFT_SHAPES.get(name, {})},
        # the decoder alone: vLLM's CPU kernels have no head size of 16 (eval names it; tests/test_vllm.py)
        "eval": {"max_new_tokens": 12, "sets": [{"name": "chat", "path": "data/prompts.jsonl"}], "sets_dir": "data",
                 "engine": None},
        "mlflow": {"system_metrics": False, "registered_model": None},
    }, root / "params.yaml")
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, root, store)
        cfg = load_config(root / "params.yaml")
        generate.run(cfg)
        prepare.run(cfg)
        extract.run(cfg)
        train.run(cfg, "scratch")
        eval_stage.run(cfg, "scratch")
    return root


@torch.no_grad()
def test_hooks_capture_output_hidden_states_at_every_index(target_dir):
    model = load_target(TargetConfig(path=str(target_dir), device="cpu"))
    embedding, head = load_embedding_and_head(target_dir)
    assert torch.equal(embedding, model.get_input_embeddings().weight)  # the language model's, also when wrapped
    assert torch.equal(head, model.get_output_embeddings().weight)
    ids = torch.randint(0, embedding.shape[0], (2, 11), generator=torch.Generator().manual_seed(1))
    layers = model_text_config(model).num_hidden_layers
    with capture(model, list(range(layers))) as hooks:
        out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == layers + 1
    for index in range(layers):
        assert torch.equal(hooks.captured[index], out.hidden_states[index]), index
    # The stored final state is what training turns into the target's logits with the checkpoint's lm_head.
    torch.testing.assert_close(hooks.final() @ head.T, out.logits, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_extracted_shards_hold_the_models_hidden_states(pipeline, target_dir):
    model = load_target(TargetConfig(path=str(target_dir), device="cpu"))
    _, head = load_embedding_and_head(target_dir)
    hidden = model_text_config(model).hidden_size
    manifest = read_manifest(pipeline / "data" / "features" / "train")
    assert manifest["aux_layers"] == AUX_LAYERS and manifest["hidden_size"] == hidden
    tokens = {sample["id"]: sample["input_ids"] for sample in read_tokenized(pipeline / "data" / "prepared" / "train")}
    checked = 0
    for sample_id, stored in iter_samples(pipeline / "data" / "features" / "train"):
        assert stored["input_ids"].tolist() == tokens[sample_id]
        out = model(input_ids=torch.tensor([tokens[sample_id]]), output_hidden_states=True)  # alone, unpadded
        expected = torch.cat([out.hidden_states[i][0] for i in AUX_LAYERS], dim=-1)
        torch.testing.assert_close(stored["aux_hidden"], expected, rtol=1e-4, atol=1e-4)  # batched with padding
        torch.testing.assert_close(stored["final_hidden"] @ head.T, out.logits[0], rtol=1e-4, atol=1e-4)
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_drafter_trains_and_loads(pipeline, target_dir):
    history = pd.read_csv(pipeline / "plots" / "train-scratch.csv")
    losses = history["train/loss"].tolist()
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])
    embedding, _ = load_embedding_and_head(target_dir)
    draft = load_drafter(pipeline / "models" / "drafters" / "scratch", embedding)
    text = json.loads((target_dir / "config.json").read_text())
    text = text.get("text_config") or text
    assert draft.cfg.hidden_size == draft.cfg.target_hidden_size == text["hidden_size"]
    assert draft.cfg.aux_layers == AUX_LAYERS
    shape = DRAFT_SHAPES.get(target_dir.parent.name, {})
    assert draft.cfg.head_dim == shape.get("head_dim", text["hidden_size"] // text["num_attention_heads"])


def test_eval_is_lossless(pipeline):
    metrics = json.loads((pipeline / "metrics" / "eval-scratch.json").read_text())
    assert metrics["lossless"] is True, metrics["mismatched_prompts"]
    assert metrics["verify_steps"] > 0 and 1.0 <= metrics["tau"] <= 4.0


def test_stage_runs_log_the_targets_identity(pipeline, target_dir, store):
    identity = target_identity(target_dir, "unused", None)
    runs = MlflowClient(store).search_runs(
        [e.experiment_id for e in MlflowClient(store).search_experiments()],
        f"params.`target.path` = '{target_dir}'")
    stages = {run.data.tags["eagle3ops.stage"]: run.data.params for run in runs}
    assert set(stages) == {"generate", "prepare", "extract", "train", "eval"}
    for params in stages.values():
        assert params["target_identity.digest"] == identity["digest"]
        assert params["target_identity.id"] == params["target.id"]
        assert int(params["target_identity.weight_files"]) == len(list(target_dir.glob("*.safetensors")))
        assert "config.json" in params["target_identity.digested_files"].split(",")


# ------------------------------------------------------------------------------------------------- failures, names

def test_model_without_decoder_layers_names_what_was_tried(tmp_path):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    with pytest.raises(TargetError) as err:
        text_model(model)
    assert "GPT2LMHeadModel" in str(err.value)
    assert "get_decoder(), model.language_model, language_model.model, language_model, model" in str(err.value)


def test_model_class_transformers_cannot_load_is_named(tmp_path):
    T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32, vocab_size=50).save_pretrained(tmp_path)
    with pytest.raises(TargetError, match=r"no AutoModelForCausalLM or AutoModelForImageTextToText .*'t5'.*"
                                          r"trust_remote_code"):
        load_target(TargetConfig(path=str(tmp_path), device="cpu"))


def _sharded(path: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict) -> None:
    path.mkdir()
    for file, tensors in shards.items():
        save_file(tensors, str(path / file))
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))


def test_embedding_and_head_are_the_language_models_in_a_wrapped_sharded_checkpoint(tmp_path):
    """Other towers' tensors (first in name order here) and copies inside a decoder layer (DeepSeek's
    multi-token-prediction layer) never stand in for them."""
    tensor = {name: torch.full((6, 4), float(i)) for i, name in enumerate(
        ["audio_tower.embed_tokens.weight", "audio_tower.lm_head.weight", "vision_tower.encoder.embed_tokens.weight",
         "language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
         "language_model.model.layers.3.embed_tokens.weight", "language_model.model.layers.3.lm_head.weight"])}
    names = list(tensor)
    _sharded(tmp_path / "kimi", {"model-00001-of-00002.safetensors": {n: tensor[n] for n in names[:4]},
                                 "model-00002-of-00002.safetensors": {n: tensor[n] for n in names[4:]}},
             {"model_type": "kimi_k25", "tie_word_embeddings": False, "text_config": {"vocab_size": 6}})
    embedding, head = load_embedding_and_head(tmp_path / "kimi")
    assert torch.equal(embedding, tensor["language_model.model.embed_tokens.weight"])
    assert torch.equal(head, tensor["language_model.lm_head.weight"])


def test_tied_head_from_the_text_config_and_missing_shard(tmp_path):
    embed = torch.randn(6, 4)
    shard = "model-00001-of-00001.safetensors"
    _sharded(tmp_path / "tied", {shard: {"model.language_model.embed_tokens.weight": embed}},
             {"model_type": "wrapper", "text_config": {"tie_word_embeddings": True}})
    embedding, head = load_embedding_and_head(tmp_path / "tied")
    assert torch.equal(embedding, embed) and torch.equal(head, embed)
    (tmp_path / "tied" / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(TargetError, match="model-00001-of-00001.safetensors, which is missing"):
        load_embedding_and_head(tmp_path / "tied")
