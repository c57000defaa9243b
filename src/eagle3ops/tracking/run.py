"""One MLflow run per DVC stage run, grouped under one parent run per pipeline run.

Every stage is its own process, so the parent cannot be held open across stages: each stage finds the parent by its
`eagle3ops.pipeline_key` tag (or creates it), hangs its own run under it with `parent_run_id`, and leaves the parent
FINISHED again, so the UI never shows a pipeline spinning after the last stage ended.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import Protocol

import mlflow
import psutil
import yaml
from mlflow import MlflowClient
from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.entities import DatasetInput, InputTag, Metric

from eagle3ops.config import Config
from eagle3ops.errors import InputError
from eagle3ops.tracking import hardware, stage_view
from eagle3ops.tracking.lineage import (
    changed_inputs,
    git_state,
    input_md5s,
    link_cached_stages,
    load_yaml,
    lock_stages,
    stamp_finished_stages,
    tag_experiment_commits,
)
from eagle3ops.tracking.outbox import Outbox
from eagle3ops.tracking.registry import Measurement, log_drafter_model, register_drafter
from eagle3ops.tracking.store import (
    PIPELINE_KEY_TAG,
    ROLE_TAG,
    UNREACHABLE,
    TrackingUnanswered,
    credentials_refused,
    default_uri,
    find_or_create_experiment,
    find_or_create_parent_run,
    log_pipeline_run,
    note_unanswered,
    project_root,
    scrub,
    shown_uri,
    store_root,
    tracking_uri,
    unanswered,
)

# MLflow 3.17 accepts 6000 characters, older tracking servers 500; the config's values are far shorter anyway.
MAX_PARAM_CHARS = 500
# The hardware facts a runs table filters and groups by, and those that decide a CPU run's bits (`reproduce` reads
# them: runs/reproduce.py, expectation); every fact is in the run's hardware.json
HARDWARE_TAGS = ("accelerator", "gpu_count", "gpu_models", "cpu_usable_cores", "cpu_model", "torch", "torch_threads",
                 "cpu_capability", "cpu_kernels_pinned", "gpu_deterministic")
LOAD_METRIC = "machine/load_per_core"  # 1-minute load average per usable core as the stage ended
# Why a stage run is a one-off (`--set train.lr=1e-3`, `--params other.yaml`), set by the CLI; None: the pipeline's
# run. A one-off run is recorded, tagged eagle3ops.one_off, but leaves the pipeline's metrics and the champion alone.
ONE_OFF: ContextVar[str | None] = ContextVar("one_off", default=None)
# MLflow announces every start and stop of its system-metrics thread at INFO, twice per stage run
logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)


def _param_text(value) -> str:
    """A param value as MLflow shows it: lists and mappings as JSON, passwords in URIs masked."""
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return scrub(text)[:MAX_PARAM_CHARS]


REPORT_STAGE = "report"  # dvc.yaml's last stage: it reads every other stage's metrics


def _dvc_process() -> psutil.Process | None:
    """The `dvc repro` / `dvc exp run` process above us (DVC runs each stage command through a shell); None when
    the stage was started by hand."""
    try:
        process = psutil.Process().parent()
        while process is not None:
            command = " ".join(process.cmdline()[:2])
            if re.search(r"(^|/)dvc(\s|$)|-m dvc\b|/dvc/__main__", command) or process.name() == "dvc":
                return process
            process = process.parent()
    except psutil.Error:
        return None
    return None


def _invocation_key() -> str | None:
    """One key per `dvc repro` / `dvc exp run` invocation: the pid and start time of the dvc process."""
    process = _dvc_process()
    return None if process is None else f"dvc-{process.pid}-{int(process.create_time())}"


def _runs_on_to_the_report(stage: str, root: Path) -> bool:
    """Whether the DVC invocation running `stage` goes on to the report stage, the pipeline's last (it reads
    every stage's metrics): a `dvc repro` or `dvc exp run` of the whole pipeline does; one given stages to run
    (`dvc repro train@scratch`, `-s`), or no DVC at all, may stop anywhere."""
    process = _dvc_process()
    if stage == REPORT_STAGE or process is None:
        return False
    try:
        arguments = process.cmdline()
        names = set((load_yaml((root / "dvc.yaml").read_text()) or {}).get("stages", {}))
    except (psutil.Error, OSError, yaml.YAMLError):
        return False
    targeted = any(arg.rpartition(":")[2].partition("@")[0] in names for arg in arguments)
    return not targeted and not {"-s", "--single-item"} & set(arguments)


def _cores(fp: dict) -> int:
    cores = fp["cpu_usable_cores"]
    return cores if isinstance(cores, int) and cores > 0 else os.cpu_count() or 1


def _tag_key(text: str) -> str:
    return re.sub(r"[^\w./\- ]", "_", text)  # the characters MLflow allows in tag names


def _log_inputs(client: MlflowClient, run_id: str, md5s: dict[str, str]) -> None:
    """Datasets and shard directories as MLflow inputs, with the DVC md5 as digest."""
    datasets = [MetaDataset(LocalArtifactDatasetSource(path), name=path, digest=md5)._to_mlflow_entity()
                for path, md5 in md5s.items()]
    if datasets:
        client.log_inputs(run_id, [DatasetInput(d, tags=[InputTag("mlflow.data.context", "input")]) for d in datasets])


class Tracker(Protocol):
    """What a stage's work calls on its tracking wherever it runs: the stage's MLflow run (StageRun) in the process
    that records, Untracked in the others (the ranks other than 0 of a torchrun launch: training/distributed.py)."""
    one_off: str | None  # why the run is a one-off (ONE_OFF), None for the pipeline's

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Time the block as the phase `name`."""

    def log_metrics(self, metrics: Mapping[str, float | None], step: int | None = None) -> None:
        """Record the values at `step`."""


class Untracked(Tracker):
    """The tracking of a process that records nothing (a rank other than 0)."""
    one_off = None

    def phase(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()

    def log_metrics(self, metrics: Mapping[str, float | None], step: int | None = None) -> None:
        pass


class StageRun(Tracker):
    """Handle on the stage's MLflow run, for the stage to log timings, metrics and artifacts.

    When the tracking server cannot be reached (from the start, or from some call on), the handle records what
    it could not send in an outbox (tracking/outbox.py) and the stage goes on; `eagle3ops sync` uploads it later.
    """

    def __init__(self, client: MlflowClient | None, run_id: str | None, started: float, experiment_id: str | None,
                 parent_id: str | None, root: Path, record: dict) -> None:
        self._client = client
        self._started = started
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.parent_id = parent_id
        self.root = root
        self.input_md5s: dict[str, str] = {}  # dvc.lock md5 of each input the stage named
        self.timings: dict[str, float] = {}
        self.logged: set[str] = set()  # the metric keys logged so far
        self._record = record  # what the outbox needs to recreate the run
        self.outbox: Outbox | None = None
        self.one_off = ONE_OFF.get()

    def go_offline(self, error: BaseException) -> None:
        if self.outbox is None:
            # the repository's outbox: a --temp or queued experiment's copy is deleted once it ends
            self.outbox = Outbox(store_root(self.root), {**self._record, "run_id": self.run_id,
                                                         "parent_id": self.parent_id})
            what = ("MLflow refused the credentials (check MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD)"
                    if credentials_refused(error) else "MLflow unreachable")
            print(f"eagle3ops: {what} ({type(error).__name__}: {str(error)[:200]}); recording this run "
                  f"in {self.outbox.dir}; `eagle3ops sync` uploads it later", file=sys.stderr, flush=True)

    def _send(self, action) -> bool:
        """Run an MLflow call; False (and offline from now on) when the server cannot take it."""
        if self.outbox is not None:
            return False
        try:
            action()
            return True
        except UNREACHABLE as err:
            self.go_offline(err)
            return False

    def elapsed(self) -> float:
        """Seconds since the stage run began (perf_counter clock)."""
        return time.perf_counter() - self._started

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `time/<name>_s` (also when it raises); a phase entered again adds up."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
            self.log_metrics({f"time/{name}_s": self.timings[name]})

    def log_metrics(self, metrics: Mapping[str, float | None], step: int | None = None) -> None:
        """Log the finite values; None, NaN and inf are skipped rather than polluting the charts."""
        now = int(time.time() * 1000)
        self.logged.update(key for key, value in metrics.items() if value is not None)
        batch = [
            Metric(key, float(value), now, step or 0)
            for key, value in metrics.items()
            if value is not None and math.isfinite(float(value))
        ]
        if batch and not self._send(lambda: self._client.log_batch(self.run_id, metrics=batch)):
            self.outbox.metrics(batch)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Tags learnt during the stage (a warm start's source digest, the target's identity)."""
        tags = {key: str(value) for key, value in tags.items()}
        if not self._send(lambda: [self._client.set_tag(self.run_id, k, v) for k, v in tags.items()]):
            self.outbox.tags(tags)

    def log_drafter_model(self, directory: Path, name: str, tags: Mapping[str, str]) -> None:
        """The trained drafter as this run's logged model (tracking/registry.py), with the run's params."""
        params = self._record["params"]
        if not self._send(lambda: log_drafter_model(self._client, self._client.get_run(self.run_id), directory, name,
                                                    tags, params)):
            self.outbox.model(directory, name, tags, params)

    def register_drafter(self, name: str, sha256: str, tau: float,
                         linked_metrics: Mapping[str, tuple[float, str | None, str | None]],
                         measurement: Measurement) -> None:
        """Link the metrics to the drafter's logged model and register it (see `register_drafter`)."""
        def register():
            version = register_drafter(self._client, self._client.get_run(self.run_id), name, sha256, tau,
                                       linked_metrics, measurement)
            if version is None:
                print(f"eagle3ops: no logged model in this experiment has the evaluated weights (sha256 {sha256[:12]}); "
                      f"not registered in {name} (was the train run recorded offline? `eagle3ops sync`, then run "
                      f"this eval again)", file=sys.stderr, flush=True)
            else:
                self.logged.update(linked_metrics)  # logged with the model: not again on their own

        if not self._send(register):
            self.outbox.register(name, sha256, tau, linked_metrics, measurement)

    def log_pipeline(self, metrics: Mapping[str, float], params: Mapping[str, object], description: str) -> None:
        """What describes the whole pipeline run goes on its parent run: its headline numbers, the params that
        define it, and its report as the description the run page shows."""
        metrics = {key: float(value) for key, value in metrics.items() if value is not None}
        params = {key: _param_text(value) for key, value in params.items()}
        tags = {"mlflow.note.content": description}
        if not self._send(lambda: log_pipeline_run(self._client, self.parent_id, metrics, params, tags)):
            self.outbox.pipeline(metrics, params, tags)

    def log_pipeline_artifact(self, path: str | Path, artifact_path: str) -> None:
        """A file or directory that describes the whole pipeline run (dvc.lock, the report) goes on the parent."""
        path = Path(path)

        def send():
            log = self._client.log_artifacts if path.is_dir() else self._client.log_artifact
            log(self.parent_id, str(path), artifact_path)

        if not self._send(send):
            self.outbox.artifact(path, artifact_path, on_parent=True)

    def link_cached_stages(self) -> list[str]:
        """At the end of a pipeline: link the runs of the stages DVC skipped (see `link_cached_stages`).
        Needs the server: offline, nothing is linked."""
        linked: list[str] = []
        self._send(lambda: linked.extend(link_cached_stages(self._client, self.experiment_id, self.parent_id,
                                                            self.root)))
        return linked

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Log a file, or a directory as a folder of its own name (unless `artifact_path` names one)."""
        path = Path(path)

        def send():
            if path.is_dir():
                self._client.log_artifacts(self.run_id, str(path), artifact_path or path.name)
            else:
                self._client.log_artifact(self.run_id, str(path), artifact_path)

        if not self._send(send):
            self.outbox.artifact(path, artifact_path or (path.name if path.is_dir() else None))


def unrecorded_inputs(dvc_stage: str, changed: list[str], root: Path) -> str:
    """What to say of inputs whose bytes dvc.lock does not record (lineage.changed_inputs)."""
    producers = sorted({name for name, entry in lock_stages(root / "dvc.lock").items()
                        for out in entry.get("outs") or []
                        if any(item.startswith(f"{out.get('path')}/") or item.startswith(f"{out.get('path')}:")
                               for item in changed)})
    rerun = " ".join(f"-s {name}" for name in producers) or "-s <the stage that writes it>"
    return (f"inputs of {dvc_stage} are not the bytes dvc.lock records:\n  " + "\n  ".join(changed[:8])
            + (f"\n  ... and {len(changed) - 8} more" if len(changed) > 8 else "")
            + f"\nAn output edited in place changes DVC's cached copy too (the workspace file is a hardlink of it, "
              f"docs/team.md). Make it again with `dvc repro --force {rerun}`")


@contextmanager
def stage_run(
    cfg: Config, stage: str, variant: str | None = None, inputs: Sequence[str | Path] = (),
    extra_params: Mapping[str, str] | None = None,
) -> Iterator[StageRun]:
    """Record one stage run as a child of its pipeline's parent run; FAILED if the block raises. A tracking
    server that cannot be reached never stops the stage: see StageRun. `extra_params` are logged beside the
    config's (the target's identity, tracking/identity.py)."""
    start = time.perf_counter()
    root = project_root()
    uri = tracking_uri(cfg)
    commit, dirty = git_state(root)
    dvc_stage = os.environ.get("DVC_STAGE") or (f"{stage}@{variant}" if variant else stage)
    digest = stage_view.digest(cfg)
    exp_name = os.environ.get("DVC_EXP_NAME")
    key = exp_name or _invocation_key() or hashlib.sha256(f"{commit}{digest}".encode()).hexdigest()[:12]
    shared = {PIPELINE_KEY_TAG: key, "eagle3ops.git_commit": commit, "eagle3ops.params_digest": digest}
    if os.environ.get("EAGLE3OPS_REPRODUCES"):  # set by `eagle3ops reproduce` for the re-run it starts
        shared["eagle3ops.reproduces"] = os.environ["EAGLE3OPS_REPRODUCES"]
    if ONE_OFF.get():  # under a parent of its own, role one_off: `compare` and the pipeline views leave it out
        shared.update({ROLE_TAG: "one_off", "eagle3ops.one_off": ONE_OFF.get()})
    # used only when the parent is created
    name = exp_name or f"{'one-off' if ONE_OFF.get() else 'pipeline'} {time.strftime('%Y-%m-%d %H:%M:%S')}"
    md5s = input_md5s(inputs, root)
    changed = changed_inputs(md5s, root)
    if changed and not ONE_OFF.get():
        raise InputError(f"{unrecorded_inputs(dvc_stage, changed, root)}; nothing was measured or recorded")
    fp = hardware.fingerprint()
    tags = {
        **shared,
        ROLE_TAG: "stage",
        "eagle3ops.stage": stage,
        "eagle3ops.variant": variant or "",
        "eagle3ops.dvc_stage": dvc_stage,
        "eagle3ops.git_dirty": str(dirty).lower(),
        "hardware.label": hardware.label(fp, cfg.hardware.label),
        **{f"hardware.{name}": str(fp[name]) for name in HARDWARE_TAGS},  # the rest: hardware.json
        **{_tag_key(f"dvc.input.{path}"): md5 for path, md5 in md5s.items()},
        **({"eagle3ops.inputs_unrecorded": "; ".join(changed)[:5000]} if changed else {}),
    }
    if changed:  # a one-off: measured, and marked as made from bytes the lineage did not make
        print(f"eagle3ops {dvc_stage}: warning: {unrecorded_inputs(dvc_stage, changed, root)}; this one-off run is "
              f"tagged eagle3ops.inputs_unrecorded", file=sys.stderr, flush=True)
    # What the stage's results depend on: the params it declares (not where it ran), and the target's identity
    params = {**{key: _param_text(value) for key, value in stage_view.stage_params(cfg).items()
                 if not stage_view.covered(key, stage_view.NOT_LINEAGE)},
              **{key: _param_text(str(value)) for key, value in (extra_params or {}).items()}}
    record = {"experiment": cfg.mlflow.experiment, "pipeline_key": key, "parent_name": name, "parent_tags": shared,
              "run_name": f"{dvc_stage} · {name}", "tags": tags, "params": params,
              "start_time": int(time.time() * 1000)}  # synced later, the run keeps its own times

    handle = StageRun(None, None, start, None, None, root, record)
    hardware_logged = False
    earlier = unanswered(store_root(root), uri, key)
    try:
        mlflow.set_tracking_uri(uri)
        if earlier:
            raise TrackingUnanswered(f"{shown_uri(uri, root)} did not answer an earlier stage of this pipeline run "
                                     f"({earlier}): not asked again")
        client = MlflowClient(uri)
        # Our own default store keeps artifacts beside mlflow.db, whatever directory the stage happens to run in.
        artifacts = (store_root(root) / "mlruns").as_uri() if uri == default_uri(root) else None
        experiment_id = find_or_create_experiment(client, cfg.mlflow.experiment, artifacts)
        parent_id = find_or_create_parent_run(client, experiment_id, key, name, shared, running=True)
        stamp_finished_stages(client, experiment_id, root)
        tag_experiment_commits(client, experiment_id, root)
        # named after its pipeline run too: charts over several pipeline runs tell their stage runs apart
        run_name = f"{dvc_stage} · {client.get_run(parent_id).info.run_name}"
        active = mlflow.start_run(experiment_id=experiment_id, run_name=run_name, parent_run_id=parent_id, tags=tags,
                                  log_system_metrics=cfg.mlflow.system_metrics)
        handle = StageRun(client, active.info.run_id, start, experiment_id, parent_id, root, record)
        mlflow.log_params(params)
        mlflow.log_dict(fp, "hardware.json")
        hardware_logged = True
        _log_inputs(client, active.info.run_id, md5s)
    except (*UNREACHABLE, TrackingUnanswered) as err:
        if not earlier and not credentials_refused(err):
            note_unanswered(store_root(root), uri, key, err)
        handle.go_offline(err)
        if not hardware_logged:
            handle.outbox.document("hardware.json", fp)
    handle.input_md5s = md5s
    status = "FAILED"
    try:
        yield handle
        status = "FINISHED"
    finally:
        # the stage's own threads included: what `compare` shows when runs on one hardware label differ in speed
        handle.log_metrics({"time/stage_wall_s": time.perf_counter() - start,
                            LOAD_METRIC: os.getloadavg()[0] / _cores(fp)})
        if handle.run_id is not None:
            try:
                mlflow.end_run(status)
            except UNREACHABLE:
                pass  # the outbox keeps the status
        # The pipeline run is RUNNING while its stages run, FAILED when one fails, FINISHED after the last
        if handle.outbox is None and (status == "FAILED" or not _runs_on_to_the_report(stage, root)):
            handle._send(lambda: handle._client.set_terminated(handle.parent_id, status))
        if handle.outbox is not None:
            handle.outbox.finish(status)  # moves the parent's end time to this stage's end, once synced
