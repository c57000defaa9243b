"""Drafters as MLflow models (tracking/registry.py): logged once by train, registered once by eval, the champion
chosen among versions measured alike."""
import dataclasses

import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus

from eagle3ops.config import Config
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.tracking.metrics import record
from eagle3ops.tracking.registry import CHAMPION, Measurement, weights_sha256
from eagle3ops.tracking.run import ONE_OFF, stage_run
from helpers import isolate

NAME = "eagle3-drafter"
MEASURED = Measurement(target="org/target@abc123", target_digest="d1", sets=("gsm8k:0a1b:20", "mt-bench:2c3d:10"),
                       k=3, decoding="hf backend, temperature 0.0", lossless="yes")


@pytest.fixture
def store(tmp_path, monkeypatch):
    isolate(monkeypatch, tmp_path)
    cfg = Config()
    cfg.mlflow.system_metrics = False
    return tmp_path, cfg, MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")


def trained(root, cfg, init: str, seed: int) -> str:
    """A train@<init> stage run that logs its drafter (with a training state beside the weights)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    vocab_size=40, draft_vocab_size=20, target_hidden_size=16, aux_layers=[0, 1, 2]))
    save_drafter(draft, root / "drafters" / f"{init}-{seed}", {"step": 10, "optimizer": {"state": {}}})
    with stage_run(cfg, "train", variant=init) as run:
        run.log_drafter_model(root / "drafters" / f"{init}-{seed}", init, {"target": MEASURED.target})
    return weights_sha256(root / "drafters" / f"{init}-{seed}")


def evaluated(cfg, sha: str, tau: float, measurement: Measurement = MEASURED) -> str:
    """An eval@scratch stage run that registers the drafter with these weights and records its tau, as eval does."""
    with stage_run(cfg, "eval", variant="scratch") as run:
        run.register_drafter(NAME, sha, tau, {"tau": (tau, None, None),
                                              "tau/gsm8k": (tau + 0.1, "bench/gsm8k.jsonl", "0a1b")}, measurement)
        record(run, "eval-scratch", {"tau": tau, "prompts": 30})
    return run.run_id


def champion(client) -> str:
    return str(client.get_model_version_by_alias(NAME, CHAMPION).version)


def test_a_trained_drafter_is_a_logged_model_without_its_training_state(store):
    root, cfg, client = store
    sha = trained(root, cfg, "scratch", 0)
    (model,) = client.search_logged_models([client.get_experiment_by_name("eagle3ops").experiment_id])
    assert model.name == "scratch" and model.model_type == "eagle3-drafter" and str(model.status) == "READY"
    assert model.tags["eagle3ops.weights_sha256"] == sha and model.params["train.lr"] == str(cfg.train.lr)
    assert {f.path for f in client.list_logged_model_artifacts(model.model_id)} == {"config.json",
                                                                                  "model.safetensors"}
    train_run = client.get_run(model.source_run_id)
    assert [o.model_id for o in train_run.outputs.model_outputs] == [model.model_id]  # the run's Models column
    pipeline_run = client.get_run(train_run.data.tags["mlflow.parentRunId"])
    assert [o.model_id for o in pipeline_run.outputs.model_outputs] == [model.model_id]

    eval_run = evaluated(cfg, sha, 2.5)
    assert len(client.get_metric_history(eval_run, "tau")) == 1  # logged with the model, not again by record()
    model = client.get_logged_model(model.model_id)
    assert {(m.key, m.dataset_name, m.dataset_digest): m.value for m in model.metrics} == {
        ("tau", None, None): 2.5, ("tau/gsm8k", "bench/gsm8k.jsonl", "0a1b"): 2.6}
    (version,) = client.search_model_versions(f"name = '{NAME}'")
    version = client.get_model_version(NAME, version.version)
    assert version.source == f"models:/{model.model_id}" and version.tags["tau"] == "2.5000"
    assert version.description == ("EAGLE-3 drafter `scratch`, tau 2.500: target org/target@abc123; prompt sets "
                                   "gsm8k, mt-bench; k=3; hf backend, temperature 0.0; lossless yes.")
    evaluated(cfg, sha, 2.5)  # measured again the same way (dvc repro --force): still one version
    assert len(client.search_model_versions(f"name = '{NAME}'")) == 1 and champion(client) == str(version.version)


def test_the_champion_is_the_best_among_versions_measured_like_the_newest(store):
    root, cfg, client = store
    evaluated(cfg, trained(root, cfg, "scratch", 0), 2.0)
    evaluated(cfg, trained(root, cfg, "warm_start", 1), 2.5)
    assert champion(client) == "2"
    broken = dataclasses.replace(MEASURED, lossless="no")  # changed the target's output: never the champion
    evaluated(cfg, trained(root, cfg, "scratch", 2), 3.5, broken)
    assert champion(client) == "2"
    more_drafts = dataclasses.replace(MEASURED, k=5)  # a tau at another k does not compare with those at k=3
    evaluated(cfg, trained(root, cfg, "scratch", 3), 1.5, more_drafts)
    assert champion(client) == "4"
    evaluated(cfg, trained(root, cfg, "scratch", 4), 2.2)  # back to k=3: the best at k=3, not the newest
    assert champion(client) == "2"
    assert len(client.search_model_versions(f"name = '{NAME}'")) == 5


def test_evaluated_weights_nobody_logged_are_not_registered(store, capsys):
    root, cfg, client = store
    trained(root, cfg, "scratch", 0)
    evaluated(cfg, "0" * 64, 2.0)
    assert "no logged model in this experiment has the evaluated weights" in capsys.readouterr().err
    assert client.search_model_versions(f"name = '{NAME}'") == []


def test_a_logged_model_whose_upload_failed_is_not_registered(store, capsys):
    root, cfg, client = store
    sha = trained(root, cfg, "scratch", 0)
    (model,) = client.search_logged_models([client.get_experiment_by_name("eagle3ops").experiment_id])
    client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)  # as when its upload raised
    evaluated(cfg, sha, 2.0)
    assert "no logged model in this experiment has the evaluated weights" in capsys.readouterr().err
    assert client.search_model_versions(f"name = '{NAME}'") == []


def test_a_one_off_run_is_tagged_and_writes_its_metrics_apart(store):
    root, cfg, client = store
    token = ONE_OFF.set("--set eval.max_prompts=2")
    try:
        with stage_run(cfg, "eval", variant="scratch") as run:
            record(run, "eval-scratch", {"tau": 9.0})
    finally:
        ONE_OFF.reset(token)
    assert not (root / "metrics" / "eval-scratch.json").exists()
    assert (root / ".eagle3ops" / "one-off" / "metrics" / "eval-scratch.json").is_file()
    (recorded,) = client.search_runs([client.get_experiment_by_name("eagle3ops").experiment_id],
                                     "tags.`eagle3ops.role` = 'stage'")
    assert recorded.data.tags["eagle3ops.one_off"] == "--set eval.max_prompts=2"
    parent = client.get_run(recorded.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["eagle3ops.role"] == "one_off"  # not a pipeline run: compare leaves it out
