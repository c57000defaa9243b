"""Recorded pipeline runs, read back from MLflow: what `compare`, `project` and `reproduce` work from.

A pipeline run is a parent run (tag eagle3ops.role = pipeline) whose children are stage runs, one per DVC
stage (`train@scratch`, ...); a child tagged eagle3ops.cached_from stands for a stage DVC skipped and carries
the metrics of the run that produced the cached outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mlflow import MlflowClient

from eagle3ops.tracking.lineage import CACHED_FROM_TAG
from eagle3ops.tracking.store import PIPELINE_KEY_TAG, ROLE_TAG


@dataclass
class StageRecord:
    dvc_stage: str  # "train@scratch"
    stage: str  # "train"
    variant: str  # "scratch", or "" for stages without a matrix
    run_id: str  # the run that did the work (the original one when `cached`)
    cached: bool
    metrics: dict[str, float]  # final values: "tau", "time/train_s", "tokens_per_s", ...
    params: dict[str, str]  # the resolved config, flattened ("train.lr": "0.003")
    tags: dict[str, str]

    @property
    def name(self) -> str:
        """"train@scratch", "extract": DVC's name for a stage with variants, the stage's own for one without, whatever
        dvc.yaml calls it (the extract stage is the one-item foreach extract@offline there)."""
        return self.stage if self.stage and not self.variant else self.dvc_stage


@dataclass
class PipelineRecord:
    run_id: str
    name: str
    tags: dict[str, str]
    params: dict[str, str] = field(default_factory=dict)  # what defines the pipeline (the report stage logs them)
    stages: dict[str, StageRecord] = field(default_factory=dict)  # by `name`: "extract", "train@scratch"
    start_time: int = 0  # ms since the epoch

    @property
    def hardware_label(self) -> str:
        labels = {s.tags.get("hardware.label", "") for s in self.stages.values() if not s.cached}
        labels.discard("")
        return "+".join(sorted(labels)) or "unknown"

    def metric(self, dvc_stage: str, name: str) -> float | None:
        record = self.stages.get(dvc_stage)
        return None if record is None else record.metrics.get(name)


def _stage_record(run) -> StageRecord:
    tags = run.data.tags
    return StageRecord(
        dvc_stage=tags.get("eagle3ops.dvc_stage") or run.info.run_name,
        stage=tags.get("eagle3ops.stage", ""),
        variant=tags.get("eagle3ops.variant", ""),
        run_id=tags.get(CACHED_FROM_TAG, run.info.run_id),
        cached=CACHED_FROM_TAG in tags,
        metrics=dict(run.data.metrics),
        params=dict(run.data.params),
        tags=dict(tags),
    )


def load_pipeline(client: MlflowClient, run_id: str) -> PipelineRecord:
    parent = client.get_run(run_id)
    record = PipelineRecord(run_id, parent.info.run_name, dict(parent.data.tags), dict(parent.data.params),
                            start_time=parent.info.start_time)
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'",
                                  order_by=["attributes.start_time ASC"], max_results=5000)
    for child in children:  # a stage run twice in one pipeline run: the later run wins
        stage = _stage_record(child)
        record.stages[stage.name] = stage
    return record


def find_pipelines(client: MlflowClient, experiment: str = "eagle3ops", filter_string: str = "",
                   max_results: int = 100) -> list[PipelineRecord]:
    """Pipeline runs of an experiment, newest first; `filter_string` is MLflow search syntax over the parent
    runs (e.g. "tags.`eagle3ops.pipeline_key` = 'lr-sweep-1'")."""
    return [load_pipeline(client, p.info.run_id) for p in _pipeline_runs(client, experiment, filter_string, max_results)]


def _pipeline_runs(client: MlflowClient, experiment: str, filter_string: str, max_results: int) -> list:
    """The parent runs of an experiment's pipelines matching `filter_string`, newest first."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    query = f"tags.`{ROLE_TAG}` = 'pipeline'" + (f" and {filter_string}" if filter_string else "")
    return client.search_runs([found.experiment_id], query, order_by=["attributes.start_time DESC"],
                              max_results=max_results)


FINISHED = "attributes.status = 'FINISHED'"
# why a pipeline run is not finished, by its MLflow status
UNFINISHED_WHY = {"RUNNING": "a stage is running, or the run stopped before its report",
                  "FAILED": "a stage failed", "KILLED": "killed", "SCHEDULED": "not started"}


def unfinished_pipelines(client: MlflowClient, experiment: str, filter_string: str, since_ms: int) -> list[str]:
    """'NAME (STATUS: why)' for each pipeline run started at or after `since_ms` that is not FINISHED, newest
    first: what a selection of the newest finished runs left out."""
    query = f"attributes.status != 'FINISHED' and attributes.start_time >= {since_ms}"
    runs = _pipeline_runs(client, experiment, f"{query} and {filter_string}" if filter_string else query, 20)
    return [f"{run.info.run_name} ({run.info.status}: {UNFINISHED_WHY.get(run.info.status, 'not finished')})"
            for run in runs]


def pipeline_key(record: PipelineRecord) -> str:
    return record.tags.get(PIPELINE_KEY_TAG, record.run_id)
