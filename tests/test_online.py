"""Online training (train.hidden_states: online): the target beside the drafter gives each step the hidden states the
extract stage would have stored, so the run is the offline run; dvc.yaml then has no extract stage and train
depends on the prepared data and the target."""
import subprocess
import sys

import pandas as pd
import pytest
import torch
import yaml

from conftest import micro_pipeline_repo, run
from eagle3ops.config import ConfigError, TargetConfig, load_config
from eagle3ops.data.prepare import read_tokenized
from eagle3ops.errors import InputError
from eagle3ops.extraction.hf import extract_features
from eagle3ops.modeling.target import load_target
from eagle3ops.training.data import assemble, load_feature_samples, pack
from eagle3ops.training.online import TargetStates, document_ids, token_samples
from test_resume import ROOT, train_workspace

AUX = [1, 2, 3]


def test_online_training_runs_the_offline_run(tmp_path, tiny_target_dir):
    """The train stage on the tiny target, offline after the extract stage and online: the same loss curve, step
    for step, and the same held-out metrics (float32, to 1e-6)."""
    results = {}
    for mode in ("offline", "online"):
        root = tmp_path / mode
        env = train_workspace(root, tiny_target_dir, online=mode == "online")
        done = subprocess.run([sys.executable, "-m", "eagle3ops.cli", "train", "--init", "scratch"], cwd=root,
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert (root / "data" / "features").exists() == (mode == "offline")
        results[mode] = (pd.read_csv(root / "plots" / "train-scratch.csv"),
                         yaml.safe_load((root / "metrics" / "train-scratch.json").read_text()))
    (offline, offline_metrics), (online, online_metrics) = results["offline"], results["online"]
    assert len(offline) == len(online) >= 10 and list(offline["step"]) == list(online["step"])
    for column in [c for c in offline.columns if c.startswith("train/loss")]:
        assert online[column].tolist() == pytest.approx(offline[column].tolist(), rel=1e-6, abs=1e-7), column
    assert online_metrics["train_tokens"] == offline_metrics["train_tokens"]
    assert online_metrics["eval/loss"] == pytest.approx(offline_metrics["eval/loss"], rel=1e-6)
    assert online_metrics["skipped_nonfinite"] == 0


@pytest.fixture(scope="module")
def samples(tiny_target_dir, tmp_path_factory):
    """The tiny target, and a prepared split as online training takes it and as the extract stage stores it."""
    root = tmp_path_factory.mktemp("ws")
    train_workspace(root, tiny_target_dir, online=True)
    model = load_target(TargetConfig(path=str(tiny_target_dir), aux_layers=AUX, device="cpu"))
    extract_features(model, read_tokenized(root / "data" / "prepared" / "eval"), AUX, root / "features",
                     batch_size=4, samples_per_shard=8)
    return model, token_samples(root / "data" / "prepared" / "eval"), load_feature_samples(root / "features")


def packed_batch(samples, length=600):
    rows = [[samples[i] for i in row] for row in pack([len(s["input_ids"]) for s in samples], length,
                                                     list(range(len(samples))))][:2]
    return rows, assemble(rows, length, 2)


def test_the_target_on_packed_rows_gives_each_sample_its_stored_states(samples):
    model, tokens, stored = samples
    assert [s["input_ids"].tolist() for s in tokens] == [s["input_ids"].tolist() for s in stored]  # same order
    rows, batch = packed_batch(tokens)
    assert max(len(row) for row in rows) > 1
    states = TargetStates(model, AUX, torch.device("cpu"), len(tokens), 0.0)
    out = states(rows, batch)
    index = {id(sample): i for i, sample in enumerate(tokens)}
    reference = assemble([[stored[index[id(s)]] for s in row] for row in rows], 600, 2)
    for name in ("aux_hidden", "final_hidden"):
        real = batch["loss_mask"].bool()  # the padded tails are no sample's
        torch.testing.assert_close(out[name][real], reference[name][real], rtol=1e-5, atol=1e-5)


def test_a_sample_with_nan_states_is_dropped_from_the_loss_and_counted(samples):
    model, tokens, _ = samples
    rows, batch = packed_batch(tokens)
    row, document = next((r, d) for r, row in enumerate(rows) for d in range(len(row)) if d > 0)
    states = TargetStates(model, AUX, torch.device("cpu"), len(tokens), 0.5)
    states.checked = True
    forward = states.forward

    def poisoned(input_ids, positions):
        aux, final = forward(input_ids, positions)
        hit = (document_ids(positions) == document)
        hit[torch.arange(len(hit)) != row] = False
        return aux.masked_fill(hit[..., None], float("nan")), final
    states.forward = poisoned
    out = states(rows, batch)
    hit = document_ids(batch["positions"]) == document
    hit[torch.arange(len(hit)) != row] = False
    assert not out["loss_mask"][hit].any() and torch.equal(out["loss_mask"][~hit], batch["loss_mask"][~hit])
    assert torch.isfinite(out["aux_hidden"]).all() and not out["aux_hidden"][hit].any()
    assert len(states.nonfinite) == 1
    states.fraction = 0.0
    with pytest.raises(InputError, match="1 of .* samples gave NaN/inf hidden states.*max_nonfinite_fraction=0.0"):
        states(rows, batch)


def test_a_target_that_lets_packed_documents_see_each_other_is_refused(samples, monkeypatch):
    """With the packed-sequence detection of Hugging Face's masks switched off, the target attends across documents:
    the first batch stops online training, before any step."""
    import transformers.masking_utils as masking

    model, tokens, _ = samples
    rows, batch = packed_batch(tokens)
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(InputError, match="does not keep packed documents apart"):
        TargetStates(model, AUX, torch.device("cpu"), len(tokens), 0.0)(rows, batch)


def test_the_pipeline_keys_must_agree_with_the_mode(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    with pytest.raises(ConfigError, match=r"key 'pipeline': train.hidden_states is online: set pipeline.extract to "
                                          r"\[\] and pipeline.hidden_states_dep to 'data/prepared'"):
        load_config(params, ["train.hidden_states=online"])
    cfg = load_config(params, ["train.hidden_states=online", "pipeline.extract=[]",
                               "pipeline.hidden_states_dep=data/prepared"])
    assert cfg.train.hidden_states == "online"


def test_dvc_yaml_online_has_no_extract_stage_and_train_needs_no_features(tmp_path):
    """What DVC resolves from the project's dvc.yaml, offline and online: the stages and train's dependencies."""
    from omegaconf import OmegaConf

    repo = micro_pipeline_repo(tmp_path / "repo")

    def resolved() -> tuple[list[str], list[str]]:
        stages = run(["dvc", "stage", "list", "--all", "--name-only"], repo).split()
        out = run([sys.executable, "-c", "from dvc.repo import Repo; s = Repo('.').stage.collect('train@scratch')[0]; "
                                         "print(' '.join(d.def_path for d in s.deps))"], repo)
        return stages, out.split()

    stages, deps = resolved()
    assert "extract@offline" in stages and "data/features" in deps
    params = OmegaConf.load(repo / "params.yaml")
    params.train.hidden_states, params.pipeline.extract, params.pipeline.hidden_states_dep = "online", [], "data/prepared"
    OmegaConf.save(params, repo / "params.yaml")
    stages, deps = resolved()
    assert not [s for s in stages if s.startswith("extract")] and "data/features" not in deps
    assert {"data/prepared", "models/zoo/successor"} <= set(deps)  # the prepared data and the target
