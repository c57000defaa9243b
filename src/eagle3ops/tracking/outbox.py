"""What a stage run could not send to MLflow, kept on disk until `eagle3ops sync` uploads it.

A tracking server that is down, or goes down mid-run, must not cost a stage its results: the stage goes on,
and from the first failed call everything it would have logged (params, tags, metrics, artifacts, a drafter
to log as a model or register, its final status) lands in `.eagle3ops/outbox/<id>/` instead, artifacts copied (hard-linked
where the disk allows). `sync` replays each entry into the run the stage had started, or into a new run
under the pipeline's parent when the server was down from the start, then removes the entry.

An entry that cannot be uploaded as it lies (its run.json cut short or missing, a file it names gone or cut short:
records carried between machines, a disk that filled) is checked before anything of it is sent, named with what is
wrong, and moved whole into `.eagle3ops/outbox-rejected/<id>/`, never deleted: the others still upload, and once
fixed it goes back into the outbox for the next sync. An entry whose stage is still running is left alone.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import sys
import time
import uuid
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus

from eagle3ops.fs import WORK_DIR, disk_full, is_disk_full, link_or_copy, write_json_atomic
from eagle3ops.tracking.registry import MODEL_FILES, Measurement, log_drafter_model, register_drafter

OUTBOX_DIR = WORK_DIR / "outbox"
REJECTED_DIR = WORK_DIR / "outbox-rejected"  # damaged entries, set aside whole by sync
RECORD = "run.json"
# An entry without its run.json that is younger than this may be one a stage is creating right now
FRESH_S = 60.0


def _copy(source: Path, destination: Path) -> None:
    """`source` into the entry (hard links where the disk allows); a full disk is one line naming the entry, the
    partial copy removed."""
    try:
        if source.is_dir():
            shutil.copytree(source, destination, copy_function=link_or_copy)
        else:
            destination.parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(source, destination)
    except OSError as err:
        if not is_disk_full(err):
            raise
        shutil.rmtree(destination, ignore_errors=True) if destination.is_dir() else destination.unlink(missing_ok=True)
        raise disk_full(destination, f"{source} into the outbox", "the stage's own outputs are written; free space "
                        "and run the stage again to record it") from None


class Outbox:
    def __init__(self, root: Path, record: dict):
        # named in the order the runs began, to the microsecond: sync uploads a drafter's train run before its eval
        # (which logs to the train run's model), even where both went to the outbox within one second
        now = time.time()
        self.dir = (root / OUTBOX_DIR /
                    f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}.{int(now % 1 * 1e6):06d}-{uuid.uuid4().hex[:8]}")
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
    """The outbox's entries, oldest first: each directory under it, with its run.json or not."""
    outbox = root / OUTBOX_DIR
    return sorted(p for p in outbox.iterdir() if p.is_dir()) if outbox.is_dir() else []


class Damaged(Exception):
    """An outbox entry that cannot be uploaded as it lies: the file at fault and what is wrong with it."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


@dataclasses.dataclass
class Rejected:
    """A damaged entry, set aside: where it lay, where it lies now, and why."""

    entry: Path
    moved_to: Path
    why: Damaged


@dataclasses.dataclass
class Synced:
    uploaded: list[str]  # the run ids written
    rejected: list[Rejected]


TERMINAL = frozenset(RunStatus.to_string(s) for s in (RunStatus.FINISHED, RunStatus.FAILED, RunStatus.KILLED))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _strings(value, scalars: bool = False) -> bool:
    """A mapping of names to strings (to scalars, with `scalars`), as tags and params are kept."""
    kinds = (str, int, float, bool) if scalars else (str,)
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, kinds) for k, v in value.items())


def _stored(entry: Path, name) -> Path:
    """A path the record names inside its entry; Damaged when it is not one (absolute, or leaving the entry)."""
    relative = Path(name) if isinstance(name, str) and name else None
    if relative is None or relative.is_absolute() or ".." in relative.parts:
        raise Damaged(entry / RECORD, f"names {name!r} as one of its files, which is no path inside the entry")
    return entry / relative


def _check_file(path: Path) -> None:
    """What can be told of a file without uploading it: JSON parses, a safetensors file is as long as its header
    says (the two kinds the stages log); every file can be read."""
    try:
        if path.suffix == ".json":
            try:
                json.loads(path.read_bytes())
            except ValueError as err:
                raise Damaged(path, f"not valid JSON, cut short or garbled ({err}; the file has "
                                    f"{path.stat().st_size} bytes)") from None
        elif path.suffix == ".safetensors":
            size = path.stat().st_size
            with path.open("rb") as handle:
                head = handle.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                header = handle.read(length) if length is not None and length <= size - 8 else b""
            try:
                tensors = json.loads(header) if header else None
                end = max((t["data_offsets"][1] for name, t in tensors.items() if name != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                raise Damaged(path, f"not a safetensors file, or cut short inside its header (the file has {size} "
                                    f"bytes)") from None
            if size != 8 + length + end:
                raise Damaged(path, f"cut short or padded: its header says {8 + length + end} bytes, the file has "
                                    f"{size}")
        elif not os.access(path, os.R_OK):
            raise Damaged(path, "cannot be read (permissions)")
    except OSError as err:
        raise Damaged(path, f"cannot be read ({err.strerror or err})") from None


def _check_files(path: Path, what: str) -> None:
    if not path.exists():
        raise Damaged(path, f"missing ({what} in {RECORD})")
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if file.is_file():
            _check_file(file)


def _read(entry: Path) -> dict | None:
    """The entry's record, checked against what sync will read of it and of its files; None while its stage is
    still writing it. Damaged when it cannot be uploaded as it lies."""
    path = entry / RECORD
    if not path.is_file():
        try:
            fresh = time.time() - entry.stat().st_mtime < FRESH_S
        except OSError:
            return None  # gone meanwhile
        if fresh:
            return None  # a stage may be creating it right now
        raise Damaged(path, "missing: the entry holds no record of its run")
    try:
        record = json.loads(path.read_bytes())
    except ValueError as err:
        raise Damaged(path, f"not valid JSON, cut short or garbled ({err}; the file has {path.stat().st_size} "
                            f"bytes)") from None
    except OSError as err:
        raise Damaged(path, f"cannot be read ({err.strerror or err})") from None

    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise Damaged(path, what)

    expect(isinstance(record, dict), f"holds a JSON {type(record).__name__}, not a run's record")
    if record.get("status") == "RUNNING":
        return None  # its stage is still going (or was killed: it will be re-run anyway)
    expect(record.get("status") in TERMINAL, f"status {record.get('status')!r} is none of {sorted(TERMINAL)}")
    expect(isinstance(record.get("experiment"), str) and record["experiment"] != "", "names no experiment")
    if record.get("run_id") is None:  # the run is created by sync: everything that makes it must be there
        for key in ("pipeline_key", "parent_name", "run_name"):
            expect(isinstance(record.get(key), str), f"{key!r} is missing or not a string")
        for key in ("parent_tags", "tags", "params"):
            expect(_strings(record.get(key)), f"{key!r} is missing or not a mapping of names to strings")
    else:
        expect(isinstance(record["run_id"], str), "'run_id' is not a string")
        expect(isinstance(record.get("parent_id"), str), "has a run id but no 'parent_id'")
    expect(_strings(record.get("late_tags", {})), "'late_tags' is not a mapping of names to strings")
    metrics = record.get("metrics")
    expect(isinstance(metrics, list), "'metrics' is missing or not a list")
    for at, metric in enumerate(metrics):
        expect(isinstance(metric, list) and len(metric) == 4 and isinstance(metric[0], str) and _number(metric[1])
               and all(isinstance(n, int) and not isinstance(n, bool) for n in metric[2:]),
               f"metric {at} is {json.dumps(metric)[:80]}, not [key, value, timestamp, step]")
    for key in ("start_time", "end_time"):
        expect(record.get(key) is None or isinstance(record[key], int), f"{key!r} is not a time in ms")
    artifacts = record.get("artifacts")
    expect(isinstance(artifacts, list), "'artifacts' is missing or not a list")
    for at, artifact in enumerate(artifacts):
        expect(isinstance(artifact, dict) and isinstance(artifact.get("artifact_path"), (str, type(None)))
               and isinstance(artifact.get("on_parent", False), bool), f"artifact {at} is not a file to log")
        _check_files(_stored(entry, artifact.get("file")), f"artifact {at}")
    pipeline = record.get("pipeline")
    expect(pipeline is None or (isinstance(pipeline, dict) and set(pipeline) == {"metrics", "params", "tags"}
                                and _strings(pipeline.get("params"))
                                and _strings(pipeline.get("tags")) and isinstance(pipeline.get("metrics"), dict)
                                and all(_number(v) for v in pipeline["metrics"].values())),
           "'pipeline' is not the pipeline run's metrics, params and tags")
    model = record.get("model")
    if model is not None:
        expect(isinstance(model, dict) and isinstance(model.get("name"), str) and _strings(model.get("tags"), True)
               and _strings(model.get("params"), True), "'model' is not a drafter to log")
        directory = _stored(entry, model.get("dir"))
        if directory.is_dir():  # absent altogether: records carried without the weights, uploaded without them
            for file in MODEL_FILES:
                _check_files(directory / file, "the drafter's weights")
    register = record.get("register")
    if isinstance(register, dict) and "sha256" in register:  # without: an older record, uploaded unregistered
        try:
            Measurement(**{key: tuple(value) if isinstance(value, list) else value
                           for key, value in register["measurement"].items()})
            ok = (isinstance(register["name"], str) and isinstance(register["sha256"], str)
                  and _number(register["tau"]) and isinstance(register["linked_metrics"], dict)
                  and all(isinstance(v, list) for v in register["linked_metrics"].values()))
        except (KeyError, TypeError, AttributeError):
            ok = False
        expect(ok, "'register' is not a drafter's registration")
    else:
        expect(register is None or isinstance(register, dict), "'register' is not a drafter's registration")
    return record


def _set_aside(entry: Path, root: Path, why: Damaged) -> Rejected:
    """Move a damaged entry whole into REJECTED_DIR, under its own name (a number after it if that is taken)."""
    rejected = root / REJECTED_DIR
    rejected.mkdir(parents=True, exist_ok=True)
    target, n = rejected / entry.name, 1
    while target.exists():
        n += 1
        target = rejected / f"{entry.name}-{n}"
    shutil.move(str(entry), str(target))
    return Rejected(entry, target, why)


def sync(uri: str, root: Path) -> Synced:
    """Upload every outbox entry to the tracking server at `uri`, oldest first. A damaged entry is named on stderr
    (the file at fault, what is wrong, where the entry went) and set aside into REJECTED_DIR; the others still go."""
    from eagle3ops.tracking.store import find_or_create_experiment, find_or_create_parent_run, log_pipeline_run

    mlflow.set_tracking_uri(uri)  # the registry resolves models:/ sources through the global store
    client = MlflowClient(uri)
    done, rejected = [], []
    for entry in pending(root):
        try:
            record = _read(entry)
        except Damaged as why:
            rejected.append(_set_aside(entry, root, why))
            _report_rejected(rejected[-1], root)
            continue
        if record is None:
            continue  # its stage is still writing it
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
            target = record["parent_id"] if artifact.get("on_parent") else run_id
            path = entry / artifact["file"]
            if path.is_dir():
                client.log_artifacts(target, str(path), artifact.get("artifact_path") or path.name)
            else:
                client.log_artifact(target, str(path), artifact.get("artifact_path"))
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
        if record.get("register") and "sha256" not in record["register"]:
            print(f"eagle3ops sync: {entry.name}: a registration recorded by an older eagle3ops (no weights digest); "
                  f"its run is uploaded, its drafter not registered", file=sys.stderr)
        elif record.get("register"):
            wanted = record["register"]
            version = register_drafter(client, client.get_run(run_id), wanted["name"], wanted["sha256"], wanted["tau"],
                             {key: tuple(value) for key, value in wanted["linked_metrics"].items()},
                             Measurement(**{key: tuple(value) if isinstance(value, list) else value
                                            for key, value in wanted["measurement"].items()}))
            if version is None:
                print(f"eagle3ops sync: {entry.name}: no logged model has the weights its eval measured (sha256 "
                      f"{wanted['sha256'][:12]}); its drafter is not registered", file=sys.stderr)
        client.set_terminated(run_id, record["status"], end_time)
        # The pipeline run ends as its latest stage did, as it does online: FAILED with a failed stage, FINISHED
        # again once the pipeline is run on past it; a stage that went offline midway left it RUNNING, which, synced
        # after the fact, it no longer is. A stage older than the parent's end (synced late) changes nothing.
        parent = client.get_run(record["parent_id"]).info
        latest = not end_time or not parent.end_time or end_time >= parent.end_time
        if latest and (record["status"] != parent.status or end_time != parent.end_time):
            client.set_terminated(record["parent_id"], record["status"], max(end_time or 0, parent.end_time or 0) or None)
        shutil.rmtree(entry)
        done.append(run_id)
    return Synced(done, rejected)


def _relative(path: Path, root: Path) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


def _report_rejected(rejected: Rejected, root: Path) -> None:
    print(f"eagle3ops sync: skipped {_relative(rejected.why.path, root)}: {rejected.why.what}; the entry is set "
          f"aside, whole, in {_relative(rejected.moved_to, root)}/", file=sys.stderr, flush=True)
