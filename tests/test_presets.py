"""Target presets, and the target's identity in the lineage.

Each preset fits its architecture (the real config.json's facts, read by transformers as the real file would be)
and the params schema, and gives a scratch drafter of the published drafter's shape; `eagle3ops preset` applies
one to params.yaml, keeping its comments, refusing a target of another architecture and anything the schema
rejects; dvc.yaml then makes the stages that use the target depend on its config.json and on target.id and
target.revision, not on its weights; the identity digests the small files only and checks a pinned revision
against the download's own record.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch
from dvc.dependency.param import ParamsDependency
from dvc.repo import Repo

from eagle3ops.cli import main
from eagle3ops.config import DraftShapeConfig, TargetConfig, load_config
from eagle3ops.formats.specforge import to_hf_config
from eagle3ops.modeling.target import TargetError, load_text_config, resolve_aux_layers
from eagle3ops.presets import PresetError, apply_preset, architecture, load_preset, preset_names
from eagle3ops.tracking.identity import downloaded_revision, identity_params, target_identity
from eagle3ops.training.init import new_drafter

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["deepseek-v3", "kimi-k2.5", "llama-3.1-8b-instruct", "qwen3-8b"]  # for real targets; zoo-gpu below
# The published drafters' config.json facts (TARGETS.md; SpecForge's configs; AQ-MedAI/Kimi-K2-Instruct-eagle3).
# Layer ids in their (SGLang) convention: HF index - 1.
PUBLISHED = {
    "kimi-k2.5": {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
                  "head_dim": 128, "vocab_size": 163840, "draft_vocab_size": 32000, "rope_theta": 1.0e6,
                  "max_position_embeddings": 131072, "layer_ids": [2, 30, 58]},
    "deepseek-v3": {"hidden_size": 7168, "intermediate_size": 40960, "num_attention_heads": 56,
                    "num_key_value_heads": 8, "vocab_size": 129280, "draft_vocab_size": 32000,
                    "layer_ids": [1, 29, 57]},
    "llama-3.1-8b-instruct": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                              "draft_vocab_size": 32000, "layer_ids": [1, 15, 28]},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "vocab_size": 151936, "draft_vocab_size": 32000, "layer_ids": [1, 17, 32]},
}


def real_target(name: str, directory: Path) -> Path:
    """A directory with the architecture's config.json (no weights: nothing here loads them)."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(architecture(name)))
    return directory


@pytest.fixture
def params(tmp_path) -> Path:
    path = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", path)
    return path


def test_every_preset_is_listed():
    assert preset_names() == sorted([*PRESETS, "smollm2", "zoo-gpu"])  # smollm2: tests/test_smollm2.py


@pytest.mark.parametrize("name", PRESETS)
def test_preset_fits_its_architecture_and_the_schema(name, tmp_path, params):
    target = real_target(name, tmp_path / "target")
    text = load_text_config(TargetConfig(path=str(target)))  # transformers reads the facts as the real file
    preset = load_preset(name)["params"]
    aux_layers = list(preset["target"]["aux_layers"])
    assert resolve_aux_layers(aux_layers, text.num_hidden_layers) == aux_layers

    apply_preset(name, params, str(target))
    cfg = load_config(params)
    assert cfg.target.path == str(target) and cfg.target.lineage_dep == f"{target}/config.json"
    assert cfg.target.id == preset["target"]["id"] and "/" in cfg.target.id
    assert cfg.target.revision is None  # the user pins it; no made-up commit
    assert cfg.target.aux_layers == list(preset["target"]["aux_layers"])
    assert cfg.target.dtype == cfg.extract.dtype == "bfloat16"
    assert cfg.data.draft_vocab_size == 32000
    assert cfg.target.trust_remote_code is (name == "kimi-k2.5")
    assert cfg.seed == load_config(ROOT / "params.yaml").seed  # the rest is left alone


@pytest.mark.parametrize("name", PRESETS)
def test_preset_replaces_the_whole_drafter_shape(name, tmp_path, params):
    """A shape left in params.yaml from another target (here a head_dim) must not survive the preset."""
    text = params.read_text()
    for key, value in (("head_dim", "64"), ("rope_theta", "5.0")):  # in train.draft, the last of each in the file
        at = text.rindex(f"    {key}: null")
        text = text[:at] + f"    {key}: {value}" + text[at + len(f"    {key}: null"):]
    params.write_text(text)
    assert load_config(params).train.draft.head_dim == 64
    apply_preset(name, params, str(real_target(name, tmp_path / "target")))
    shape = load_config(params).train.draft
    assert asdict(shape) == dict(load_preset(name)["params"]["train"]["draft"])
    assert set(load_preset(name)["params"]["train"]["draft"]) == {f.name for f in fields(DraftShapeConfig)}


@pytest.mark.parametrize("name", PRESETS)
def test_scratch_drafter_has_the_published_shape(name, tmp_path, params):
    """The drafter train@scratch builds from the preset, on the meta device (no memory), as config.json writes it."""
    target = real_target(name, tmp_path / "target")
    apply_preset(name, params, str(target))
    cfg = load_config(params)
    text = load_text_config(cfg.target)
    with torch.device("meta"):
        embedding = torch.empty(text.vocab_size, text.hidden_size)
        draft = new_drafter(text, cfg.train.draft, cfg.target.aux_layers, embedding,
                            torch.zeros(cfg.data.draft_vocab_size, dtype=torch.long),
                            torch.zeros(text.vocab_size, dtype=torch.bool), seed=0)
    written = to_hf_config(draft.cfg)
    published = dict(PUBLISHED[name])
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == published.pop("layer_ids")
    assert {key: written[key] for key in published} == published


def test_preset_command_sets_params_and_keeps_comments(tmp_path, params, capsys):
    target = real_target("kimi-k2.5", tmp_path / "Kimi-K2.5")
    rc = main(["preset", "kimi-k2.5", "--target-path", str(target), "--warm-start", "models/Kimi-K2-eagle3",
               "--params", str(params)])
    assert rc == 0, capsys.readouterr().err
    assert "target.aux_layers" in capsys.readouterr().out
    cfg = load_config(params)
    assert cfg.train.warm_start == "models/Kimi-K2-eagle3" and cfg.target.chat_template == "kimi-k2"
    assert cfg.target.aux_layers == [3, 31, 59]  # the K2 drafter's SGLang ids [2, 30, 58], as HF indices
    text = params.read_text()
    assert text.startswith("# eagle3ops parameters. Every key is here")  # the file's own comments stay
    assert "the K2 drafter's SGLang ids" in text  # and the preset's explain its values
    assert "revision: null" in text


def test_preset_list_names_every_preset(capsys):
    assert main(["preset", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == preset_names()


def test_preset_for_another_architecture_is_refused_and_nothing_written(tmp_path, params, capsys):
    target = real_target("llama-3.1-8b-instruct", tmp_path / "llama")
    before = params.read_bytes()
    rc = main(["preset", "kimi-k2.5", "--target-path", str(target), "--params", str(params)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "not the architecture of preset 'kimi-k2.5'" in err and "num_hidden_layers 32" in err and "61" in err
    assert params.read_bytes() == before


def test_preset_result_the_schema_rejects_is_not_written(tmp_path, params):
    target = real_target("qwen3-8b", tmp_path / "qwen")
    params.write_text(params.read_text() + "\nunknown_key: 1\n")
    before = params.read_bytes()
    with pytest.raises(PresetError, match=rf"{params} with preset 'qwen3-8b': key 'unknown_key'"):
        apply_preset("qwen3-8b", params, str(target))
    assert params.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_unknown_preset_names_the_presets(tmp_path, params):
    with pytest.raises(PresetError, match="no preset 'kimi-k3'; the presets are deepseek-v3, kimi-k2.5"):
        apply_preset("kimi-k3", params, str(tmp_path))


def test_lineage_dep_left_behind_is_warned_about(tmp_path, capsys):
    target = model_dir(tmp_path / "Qwen3-8B")
    identity_params(TargetConfig(path=str(target), lineage_dep=f"{target}/config.json"))
    assert "warning" not in capsys.readouterr().err
    params = identity_params(TargetConfig(path=str(target)))  # lineage_dep still the zoo's
    assert f"target.lineage_dep (models/zoo/successor) is not in target.path ({target})" in capsys.readouterr().err
    assert params["target_identity.weight_files"] == "2"


# --------------------------------------------------------------------------------------------------------- lineage

def stage_dependencies(root: Path) -> dict[str, tuple[list[str], list[str]]]:
    """{stage: (file dependencies, params)} as DVC resolves dvc.yaml with root's params.yaml."""
    Repo.init(str(root), no_scm=True)
    with Repo(str(root)) as repo:
        return {stage.name: ([d.def_path for d in stage.deps if not isinstance(d, ParamsDependency)],
                                   [p for d in stage.deps if isinstance(d, ParamsDependency) for p in d.params])
                for stage in repo.index.stages}


USES_TARGET = ["generate", "target_speed", "prepare", "extract@offline", "train@scratch", "train@warm_start", "eval@baseline",
               "eval@scratch"]


def test_dvc_tracks_a_real_targets_config_not_its_weights(tmp_path, params):
    target = real_target("kimi-k2.5", tmp_path / "Kimi-K2.5")
    (target / "model-00001-of-00064.safetensors").write_bytes(b"weights")
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    apply_preset("kimi-k2.5", params, str(target))
    shutil.copy(params, root / "params.yaml")
    stages = stage_dependencies(root)
    for stage in USES_TARGET:
        files, names = stages[stage]
        assert f"{target}/config.json" in files and str(target) not in files, stage
        assert {"target.id", "target.revision"} <= set(names), stage


def test_dvc_tracks_the_whole_zoo_target_by_default(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, root / name)
    stages = stage_dependencies(root)
    for stage in USES_TARGET:
        assert "models/zoo/successor" in stages[stage][0], stage


# -------------------------------------------------------------------------------------------------------- identity

def model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (path / "tokenizer.json").write_text('{"model": {}}')
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    for i in (1, 2):
        (path / f"model-0000{i}-of-00002.safetensors").write_bytes(bytes(1000 * i))
    return path


def test_identity_digests_the_small_files_and_only_sizes_the_weights(tmp_path):
    path = model_dir(tmp_path / "target")
    first = target_identity(path, "org/model", None)
    assert first["digested_files"] == ["config.json", "model.safetensors.index.json", "tokenizer.json"]
    assert (first["weight_files"], first["weight_bytes"]) == (2, 3000)
    (path / "model-00001-of-00002.safetensors").write_bytes(b"\1" * 1000)  # same size: weights are never read
    assert target_identity(path, "org/model", None)["digest"] == first["digest"]
    (path / "tokenizer.json").write_text('{"model": {"changed": 1}}')
    assert target_identity(path, "org/model", None)["digest"] != first["digest"]
    (path / "modeling_custom.py").write_text("# remote code")
    assert "modeling_custom.py" in target_identity(path, "org/model", None)["digested_files"]


def test_pinned_revision_is_checked_against_the_download(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    local = model_dir(tmp_path / "local")  # huggingface-cli download --local-dir keeps the commit here
    metadata = local / ".cache" / "huggingface" / "download" / "config.json.metadata"
    metadata.parent.mkdir(parents=True)
    metadata.write_text(f"{commit}\netag\n1700000000.0\n")
    assert target_identity(local, "org/model", commit[:10])["downloaded_revision"] == commit
    with pytest.raises(TargetError, match=f"target.revision is 'main' but {local} holds commit {commit}"):
        target_identity(local, "org/model", "main")
    cached = model_dir(tmp_path / "hub" / "models--org--model" / "snapshots" / commit)  # the hub cache's layout
    assert downloaded_revision(cached) == commit
    assert downloaded_revision(model_dir(tmp_path / "plain")) is None


def test_zoo_gpu_preset_sizes_the_zoo_and_takes_no_target(tmp_path, params, capsys):
    """The GPU-sized embedded default: targets of tens of millions of parameters, stored in bf16, the pipeline in
    bf16; the zoo's own target paths stay, and a --target-path is refused."""
    from eagle3ops.zoo.targets import build_llama

    assert main(["preset", "zoo-gpu", "--params", str(params)]) == 0, capsys.readouterr().err
    cfg = load_config(params)
    assert cfg.target.path == "models/zoo/successor" and cfg.target.lineage_dep == "models/zoo/successor"
    assert cfg.target.dtype == cfg.zoo.dtype == cfg.extract.dtype == "bfloat16"
    assert cfg.zoo.conversations == 4096 and cfg.generate.max_conversations is None
    assert cfg.data.draft_vocab_size == cfg.zoo.draft_vocab_size < cfg.zoo.tokenizer_vocab_size
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: cfg.zoo.tokenizer_vocab_size, "bos_token_id": 1,
                                       "eos_token_id": 2, "pad_token_id": 0})()
    with torch.device("meta"):
        target = build_llama(cfg.zoo.target, tokenizer, seed=0)
    assert 20e6 < sum(p.numel() for p in target.parameters()) < 30e6
    assert main(["preset", "zoo-gpu", "--target-path", str(tmp_path), "--params", str(params)]) == 1
    assert "builds its own target" in capsys.readouterr().err
    assert main(["preset", "qwen3-8b", "--params", str(params)]) == 1
    assert "give --target-path DIR" in capsys.readouterr().err
