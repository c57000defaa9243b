"""Drafters as MLflow 3 models: each trained drafter a logged model, each measured one a registered version.

- `train@<init>` logs its drafter as a *logged model* (config.json and model.safetensors, no optimizer state),
  tagged with the sha256 of its weights: the train run's Models column and the model's page show it.
- `eval@<init>` finds that model by the weights it evaluated, links its tau (overall, and per prompt set with
  the set as dataset) to it, and registers it once as a version of `mlflow.registered_model`, described with the
  target, the prompt sets and k. The baseline is measured, never registered: it is not ours.
- The alias `champion` goes to the best tau among the versions *measured the same way* as the newest one (same
  target, prompt sets, decoding settings, backend, losslessness): a tau on other prompts or another k is not
  comparable. Load it back with `mlflow.artifacts.download_artifacts("models:/eagle3-drafter@champion")`, or
  `eagle3ops export models:/eagle3-drafter@champion OUT`.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric
from mlflow.exceptions import MlflowException

from eagle3ops.data.shards import sha256_file
from eagle3ops.formats.specforge import WEIGHTS
from eagle3ops.fs import link_or_copy

CHAMPION = "champion"
MODEL_TYPE = "eagle3-drafter"
MODEL_FILES = ("config.json", WEIGHTS)  # what serving needs: the training state stays in the DVC output
WEIGHTS_TAG = "eagle3ops.weights_sha256"
MEASURED_AS_TAG = "eagle3ops.measured_as"  # digest of `Measurement`: versions with equal tags compare


def weights_sha256(directory: str | Path) -> str:
    return sha256_file(Path(directory) / WEIGHTS)


def log_drafter_model(client: MlflowClient, run, directory: str | Path, name: str, tags: Mapping[str, str],
                      params: Mapping[str, str]) -> str:
    """A logged model of the drafter in `directory`, produced by `run`, an output of it and of its pipeline run
    (the runs table's Models column and both run pages show it); returns its id. Its files are hard-linked into
    a staging directory where the disk allows: a 2 GB drafter is read once."""
    model = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run.info.run_id,
                                       tags={**tags, WEIGHTS_TAG: weights_sha256(directory)}, params=dict(params),
                                       model_type=MODEL_TYPE)
    try:
        # beside the drafter, on its disk: hard links, not a copy
        with tempfile.TemporaryDirectory(prefix=".staging-", dir=Path(directory).parent) as staging:
            for file in MODEL_FILES:
                link_or_copy(Path(directory) / file, Path(staging) / file)
            client.log_model_artifacts(model.model_id, staging)
    except BaseException:
        client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    for run_id in (run.info.run_id, run.data.tags.get("mlflow.parentRunId")):
        if run_id:
            client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    return model.model_id


def find_drafter_model(client: MlflowClient, experiment_id: str, sha256: str):
    """The newest complete logged model with these weights, or None (trained elsewhere, its train run not synced
    yet, or its upload failed)."""
    found = client.search_logged_models([experiment_id], f"tags.`{WEIGHTS_TAG}` = '{sha256}'", max_results=20,
                                        order_by=[{"field_name": "creation_time", "ascending": False}])
    return next((model for model in found if model.status == LoggedModelStatus.READY), None)


@dataclass(frozen=True)
class Measurement:
    """How a tau was measured. Two taus compare only when all of it is equal."""
    target: str  # id@revision
    target_digest: str  # of the files that define it (tracking/identity.py)
    sets: tuple[str, ...]  # name:md5:prompts of each prompt set
    k: int
    decoding: str  # the sampling and tree settings, and the backend
    lossless: str  # yes | no | not checked

    @property
    def set_names(self) -> list[str]:
        return [entry.split(":")[0] for entry in self.sets]

    def describe(self) -> str:
        return (f"target {self.target}; prompt sets {', '.join(self.set_names)}; k={self.k}; {self.decoding}; "
                f"lossless {self.lossless}")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True, default=list).encode()).hexdigest()[:16]


def register_drafter(client: MlflowClient, eval_run, name: str, sha256: str, tau: float,
                     linked_metrics: Mapping[str, tuple[float, str | None, str | None]], measurement: Measurement,
                     ) -> str | None:
    """Link `linked_metrics` ({key: (value, dataset name, dataset digest)}) of the eval run to the drafter's
    logged model, register the model (once per way of measuring it) and move the champion; returns the version,
    or None when no logged model has these weights."""
    model = find_drafter_model(client, eval_run.info.experiment_id, sha256)
    if model is None:
        return None
    now = int(time.time() * 1000)
    client.log_batch(eval_run.info.run_id, metrics=[
        Metric(key, value, now, 0, model_id=model.model_id, dataset_name=dataset, dataset_digest=digest)
        for key, (value, dataset, digest) in linked_metrics.items()])
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="EAGLE-3 drafters trained by eagle3ops (SpecForge/SGLang "
                                       "layout). The alias champion: the best tau among versions measured alike.")
    measured_as = measurement.digest()
    versions = client.search_model_versions(f"name = '{name}'")
    same = [v for v in versions if v.tags.get(MEASURED_AS_TAG) == measured_as]
    version = next((v for v in same if v.tags.get(WEIGHTS_TAG) == sha256), None)
    if version is None:
        description = f"EAGLE-3 drafter `{model.name}`, tau {tau:.3f}: {measurement.describe()}."
        version = client.create_model_version(
            name, f"models:/{model.model_id}", run_id=model.source_run_id, model_id=model.model_id,
            description=description,
            tags={"tau": f"{tau:.4f}", "target": measurement.target, "k": str(measurement.k),
                  "sets": ",".join(measurement.set_names), "lossless": measurement.lossless,
                  WEIGHTS_TAG: sha256, MEASURED_AS_TAG: measured_as})
        same.append(version)
    if measurement.lossless != "no":  # a drafter that changed the target's output is a bug, never the champion
        best = max((v for v in same if v.tags.get("lossless") != "no"), key=lambda v: float(v.tags["tau"]))
        client.set_registered_model_alias(name, CHAMPION, best.version)
    return version.version
