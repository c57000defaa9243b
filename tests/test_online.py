"""Online training (train.hidden_states: online): the target beside the drafter gives each step the hidden states the
extract stage would have stored, so the run is the offline run; dvc.yaml then has no extract stage and train
depends on the prepared data and the target."""
import copy
import subprocess
import sys

import pandas as pd
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from eagle3ops.config import ConfigError, TargetConfig, load_config
from eagle3ops.data.prepare import read_tokenized
from eagle3ops.errors import InputError
from eagle3ops.extraction.hf import extract_features
from eagle3ops.modeling.target import load_target
from eagle3ops.training.data import assemble, load_feature_samples, pack
from eagle3ops.training.loop import HiddenStateSource
from eagle3ops.training.online import TargetStates, token_samples
from helpers import micro_pipeline_repo, run
from test_resume import ROOT, train_workspace

AUX = [1, 2, 3]


@pytest.mark.pipeline
def test_online_training_runs_the_offline_run(tmp_path, tiny_target_dir):
    """The train stage on the tiny target, offline after the extract stage and online: the same loss curve, step
    for step, and the same held-out metrics (float32, to 1e-6)."""
    results = {}
    for mode in ("offline", "online"):
        root = tmp_path / mode
        env = train_workspace(root, tiny_target_dir, online=mode == "online")
        # AdamW: Muon orthogonalises each step in bf16, which turns the two paths' float32 rounding into bf16's
        params = OmegaConf.load(root / "params.yaml")
        params.train.optimizer = "adamw"
        OmegaConf.save(params, root / "params.yaml")
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
    assert isinstance(states, HiddenStateSource)  # what the training loop asks of a source
    out = states(rows, batch)
    index = {id(sample): i for i, sample in enumerate(tokens)}
    reference = assemble([[stored[index[id(s)]] for s in row] for row in rows], 600, 2)
    for name in ("aux_hidden", "final_hidden"):
        real = batch["loss_mask"].bool()  # the padded tails are no sample's
        torch.testing.assert_close(out[name][real], reference[name][real], rtol=1e-5, atol=1e-5)


def positions_of_documents_holding(token: int, rows, batch) -> torch.Tensor:
    """[R, T]: True at every position of the packed documents that hold `token`."""
    hit = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    for r, documents in enumerate(rows):
        start = 0
        for sample in documents:
            length = sample["input_ids"].shape[0]
            hit[r, start : start + length] = token in sample["input_ids"].tolist()
            start += length
    return hit


def test_a_sample_with_nan_states_is_dropped_from_the_loss_and_counted(samples):
    """A NaN embedding row poisons the samples holding that token, and in attention it would reach every document
    of their packed row: the row is run again a document at a time, and only those samples lose their states and
    their counted positions, as offline the extract stage leaves out only them."""
    model, tokens, _ = samples
    rows, batch = packed_batch(tokens)
    row = next(r for r, documents in enumerate(rows) if len(documents) > 2)
    own = [set(sample["input_ids"].tolist()) for sample in rows[row]]
    token = next(iter(own[1] - set().union(*own[:1], *own[2:])))  # in the second document of the row alone
    poisoned_model = copy.deepcopy(model)
    poisoned_model.get_input_embeddings().weight.data[token] = float("nan")
    states = TargetStates(poisoned_model, AUX, torch.device("cpu"), len(tokens), 1.0)
    clean = TargetStates(model, AUX, torch.device("cpu"), len(tokens), 0.5)(rows, batch)
    out = states(rows, batch)
    hit = positions_of_documents_holding(token, rows, batch)
    assert hit[row].any() and not out["loss_mask"][hit].any()
    assert torch.equal(out["loss_mask"][~hit], batch["loss_mask"][~hit])
    assert torch.isfinite(out["aux_hidden"]).all() and not out["aux_hidden"][hit].any()
    real = batch["loss_mask"].bool() & ~hit  # every other sample keeps its states
    torch.testing.assert_close(out["final_hidden"][real], clean["final_hidden"][real], rtol=1e-5, atol=1e-5)
    assert len(states.nonfinite) == sum(token in s["input_ids"].tolist() for row in rows for s in row)
    states.fraction = 0.0
    with pytest.raises(InputError, match=r"\d+ of .* samples gave NaN/inf hidden states.*max_nonfinite_fraction=0.0"):
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


@pytest.mark.pipeline
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
    params.train.hidden_states = "online"
    params.pipeline.extract, params.pipeline.hidden_states_dep = [], "data/prepared"
    OmegaConf.save(params, repo / "params.yaml")
    stages, deps = resolved()
    assert not [s for s in stages if s.startswith("extract")] and "data/features" not in deps
    assert {"data/prepared", "models/zoo/successor"} <= set(deps)  # the prepared data and the target


def test_the_target_asked_ahead_by_a_thread_and_by_the_probe_in_turn(samples, monkeypatch):
    """As on a GPU: a thread asks the target for the next batches' states while the loop trains, and a probe (the
    acceptance simulator's part) runs the target with hooks of its own between steps, under the same lock. The
    losses are those of the run without the thread, and the probe sees its own states every time."""
    from eagle3ops.config import DrafterTrainConfig
    from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
    from eagle3ops.modeling.target import capture
    from eagle3ops.training import loop

    model, tokens, _ = samples
    prompt = tokens[0]["input_ids"][None].long()
    with capture(model, AUX) as hooks:
        model(input_ids=prompt, use_cache=False)
        expected = hooks.final().clone()

    def run(depth: int) -> tuple[list[float], list[bool]]:
        monkeypatch.setattr(loop, "assembly_depth", lambda device, remote_states=False: depth)
        torch.manual_seed(0)
        draft = Eagle3Draft(DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=2, vocab_size=model.config.vocab_size,
                                        draft_vocab_size=model.config.vocab_size, target_hidden_size=32,
                                        aux_layers=AUX))
        draft.embed_tokens.weight.data.normal_()
        draft.t2d.fill_(True)
        states = TargetStates(model, AUX, torch.device("cpu"), len(tokens), 0.0)
        seen = []

        def probe(_draft):
            with states.lock, capture(model, AUX) as own:
                model(input_ids=prompt, use_cache=False)
                seen.append(torch.equal(own.final(), expected))
            return {}

        optim = DrafterTrainConfig(epochs=2, batch_size=1, packed_length=600, lr=1e-4, optimizer="adamw", ttt_steps=2,
                                   log_every=1, checkpoint_every=0)
        head = torch.randn(model.config.vocab_size, 32, generator=torch.Generator().manual_seed(1))
        result, _ = loop.train_drafter(loop.Recipe(draft, tokens, [], head, optim, 0, torch.device("cpu"),
                                                   hidden_states=states), loop.Hooks(probe=probe, probe_every=1))
        return [row["train/loss"] for row in result.history if "train/loss" in row], seen

    inline, ahead = run(0), run(2)
    assert len(inline[0]) >= 4 and ahead[0] == pytest.approx(inline[0], rel=1e-6)
    assert all(ahead[1]) and len(ahead[1]) == len(inline[1])
