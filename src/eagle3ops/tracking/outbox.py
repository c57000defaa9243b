"""What a stage run could not send to MLflow, kept on disk until `eagle3ops sync` uploads it.

A tracking server that is down, or goes down mid-run, must not cost a stage its results: the stage goes on,
and from the first failed call everything it would have logged (params, tags, metrics, artifacts, a drafter
to log as a model or register, its final status) lands in `.eagle3ops/outbox/<id>/` instead, artifacts copied (hard-linked
where the disk allows). `sync` replays each entry into the run the stage had started, or into a new run
under the pipeline's parent when the server was down from the start, then removes the entry.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
import uuid
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from eagle3ops.fs import link_or_copy, write_json_atomic
from eagle3ops.tracking.registry import MODEL_FILES, Measurement, log_drafter_model, register_drafter

OUTBOX_DIR = Path(".eagle3ops") / "outbox"
RECORD = "run.json"


def _copy(source: Path, destination: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, destination, copy_function=link_or_copy)
    else:
        destination.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(source, destination)


class Outbox:
    def __init__(self, root: Path, record: dict):
        self.dir = root / OUTBOX_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(parents=True)
        self.record = {**record, "metrics": [], "artifacts": [], "model": None, "register": None, "status": "RUNNING", "late_tags": {},
                       "pipeline": None}
        self._save()

    def _save(self) -> None:
        write_json_atomic(self.dir / RECORD, self.record)

    def metrics(self, batch: list[Metric]) -> None:
        self.record["metrics"] += [[m.key, m.value, m.timestamp, m.step] for m in batch]
        self._save()

    def artifact(self, path: Path, artifact_path: str | None, on_parent: bool = False) -> None:
        stored = Path("files") / str(len(self.record["artifacts"])) / Path(path).name
        _copy(Path(path), self.dir / stored)
        self.record["artifacts"].append({"file": str(stored), "artifact_path": artifact_path, "on_parent": on_parent})
        self._save()

    def document(self, name: str, data: dict) -> None:
        """A JSON artifact of the run written here directly (hardware.json)."""
        stored = Path("files") / str(len(self.record["artifacts"])) / name
        write_json_atomic(self.dir / stored, data)
        self.record["artifacts"].append({"file": str(stored), "artifact_path": None, "on_parent": False})
        self._save()

    def tags(self, tags: dict[str, str]) -> None:
        self.record["late_tags"].update(tags)
        self._save()

    def model(self, directory: Path, name: str, tags: dict[str, str], params: dict[str, str]) -> None:
        stored = Path("files") / "model"
        for file in MODEL_FILES:  # the weights, not the training state
            _copy(Path(directory) / file, self.dir / stored / file)
        self.record["model"] = {"dir": str(stored), "name": name, "tags": dict(tags), "params": dict(params)}
        self._save()

    def register(self, name: str, sha256: str, tau: float, linked_metrics: dict, measurement: Measurement) -> None:
        self.record["register"] = {"name": name, "sha256": sha256, "tau": tau, "linked_metrics": dict(linked_metrics),
                                   "measurement": dataclasses.asdict(measurement)}
        self._save()

    def pipeline(self, metrics: dict[str, float], params: dict[str, str], tags: dict[str, str]) -> None:
        self.record["pipeline"] = {"metrics": metrics, "params": params, "tags": tags}
        self._save()

    def finish(self, status: str) -> None:
        self.record["status"], self.record["end_time"] = status, int(time.time() * 1000)
        self._save()


def _times(record: dict) -> tuple[int | None, int | None]:
    """The stage run's start and end (ms since the epoch). Records written before they were kept: the end is the
    last metric's time, the start that less the stage's wall time."""
    if "start_time" in record:
        return record["start_time"], record.get("end_time")
    stamps = [stamp for _, _, stamp, _ in record["metrics"]]
    walls = [value for key, value, _, _ in record["metrics"] if key == "time/stage_wall_s"]
    end = max(stamps) if stamps else None
    return (int(end - walls[-1] * 1000) if end and walls else None), end


def pending(root: Path) -> list[Path]:
    return sorted(p.parent for p in (root / OUTBOX_DIR).glob(f"*/{RECORD}"))


def sync(uri: str, root: Path) -> list[str]:
    """Upload every outbox entry to the tracking server at `uri`; returns the run ids written."""
    from eagle3ops.tracking.store import find_or_create_experiment, find_or_create_parent_run, log_pipeline_run

    mlflow.set_tracking_uri(uri)  # the registry resolves models:/ sources through the global store
    client = MlflowClient(uri)
    done = []
    for entry in pending(root):
        record = json.loads((entry / RECORD).read_text())
        if record["status"] == "RUNNING":
            continue  # its stage is still going (or was killed: it will be re-run anyway)
        experiment_id = find_or_create_experiment(client, record["experiment"], None)
        run_id, (start_time, end_time) = record.get("run_id"), _times(record)
        if run_id is None:  # the server was down from the start: create what the stage could not
            parent_id = find_or_create_parent_run(client, experiment_id, record["pipeline_key"], record["parent_name"],
                                                  record["parent_tags"], start_time)
            run = client.create_run(experiment_id, start_time=start_time, run_name=record["run_name"],
                                    tags={**record["tags"], "mlflow.parentRunId": parent_id})
            run_id, record["parent_id"] = run.info.run_id, parent_id
            params = [Param(k, v) for k, v in record["params"].items()]
            for first in range(0, len(params), 100):
                client.log_batch(run_id, params=params[first : first + 100])
        for key, value in record.get("late_tags", {}).items():
            client.set_tag(run_id, key, value)
        metrics = [Metric(k, v, ts, step) for k, v, ts, step in record["metrics"]]
        for first in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[first : first + 1000])
        for artifact in record["artifacts"]:
            target = record["parent_id"] if artifact["on_parent"] else run_id
            path = entry / artifact["file"]
            if path.is_dir():
                client.log_artifacts(target, str(path), artifact["artifact_path"] or path.name)
            else:
                client.log_artifact(target, str(path), artifact["artifact_path"])
        if record.get("pipeline"):
            log_pipeline_run(client, record["parent_id"], **record["pipeline"])
        if record.get("model") and not (entry / record["model"]["dir"]).is_dir():
            print(f"eagle3ops sync: {entry.name}: the drafter's weights did not come with the record (records "
                  f"carried from another machine without them); its run is uploaded, its model not logged",
                  file=sys.stderr)
        elif record.get("model"):  # entries sync oldest first: a train run's model before its eval registers it
            wanted = record["model"]
            log_drafter_model(client, client.get_run(run_id), entry / wanted["dir"], wanted["name"], wanted["tags"],
                              wanted["params"])
        if record["register"] and "sha256" not in record["register"]:
            print(f"eagle3ops sync: {entry.name}: a registration recorded by an older eagle3ops (no weights digest); "
                  f"its run is uploaded, its drafter not registered", file=sys.stderr)
        elif record["register"]:
            wanted = record["register"]
            version = register_drafter(client, client.get_run(run_id), wanted["name"], wanted["sha256"], wanted["tau"],
                             {key: tuple(value) for key, value in wanted["linked_metrics"].items()},
                             Measurement(**{key: tuple(value) if isinstance(value, list) else value
                                            for key, value in wanted["measurement"].items()}))
            if version is None:
                print(f"eagle3ops sync: {entry.name}: no logged model has the weights its eval measured (sha256 "
                      f"{wanted['sha256'][:12]}); its drafter is not registered", file=sys.stderr)
        client.set_terminated(run_id, record["status"], end_time)
        parent = client.get_run(record["parent_id"]).info
        if end_time and (parent.end_time or 0) < end_time:  # the pipeline run ends with its last stage
            client.set_terminated(record["parent_id"], parent.status, end_time)
        shutil.rmtree(entry)
        done.append(run_id)
    return done
