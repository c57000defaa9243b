"""One MLflow run per DVC stage run, grouped under one parent run per pipeline run.

Every stage is its own process, so the parent cannot be held open across stages: each stage finds the parent by its
`eagle3ops.pipeline_key` tag (or creates it), hangs its own run under it with `parent_run_id`, and leaves the parent
FINISHED again, so the UI never shows a pipeline spinning after the last stage ended.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import psutil
import requests
import yaml
from mlflow import MlflowClient
from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.entities import DatasetInput, InputTag, Metric, Param
from mlflow.exceptions import MlflowException
from omegaconf import OmegaConf

from eagle3ops import hardware
from eagle3ops.config import Config
from eagle3ops.outbox import Outbox

# A tracking server that is down must cost a stage seconds, not the minutes of MLflow's default retries.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
# Keep stdout for the stages' own output: no "View run ... at" line per run (an environment setting, so a user who
# wants the links can still set it to false).
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

UNREACHABLE = (MlflowException, requests.exceptions.RequestException)  # what a down tracking server raises
# MLflow's error codes for HTTP 401 and 403, whether the server sent them in JSON or as a bare status
REFUSED_ERROR_CODES = frozenset({"UNAUTHENTICATED", "CUSTOMER_UNAUTHORIZED", "PERMISSION_DENIED"})
PIPELINE_KEY_TAG = "eagle3ops.pipeline_key"
ROLE_TAG = "eagle3ops.role"  # "pipeline" on the parent, "stage" on children: both carry the pipeline key
# MLflow 3.17 accepts 6000 characters, older tracking servers 500; the config's values are far shorter anyway.
MAX_PARAM_CHARS = 500


def _root() -> Path:
    """The repository root: DVC's when a stage runs under it, else the working directory."""
    return Path(os.environ.get("DVC_ROOT") or os.getcwd()).absolute()


def _store_root(root: Path) -> Path:
    """Queued and --temp experiments run in a copy under <repo>/.dvc/tmp/exps/: their runs belong in the
    repository's own store, not in a copy that DVC deletes afterwards."""
    parts = root.parts
    if ".dvc" in parts:
        at = parts.index(".dvc")
        if parts[at + 1 : at + 3] == ("tmp", "exps"):
            return Path(*parts[:at])
    return root


def _default_uri(root: Path) -> str:
    return f"sqlite:///{_store_root(root) / 'mlflow.db'}"


def tracking_uri(cfg: Config) -> str:
    """Where runs are recorded: $MLFLOW_TRACKING_URI (it overrides, as in MLflow itself), else the config's
    mlflow.tracking_uri, else mlflow.db at the repository root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.mlflow.tracking_uri or _default_uri(_root())


def params_digest(cfg: Config) -> str:
    """Short hash of the resolved config: equal digests mean the stages ran with the same parameters."""
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:12]


def scrub(text: str) -> str:
    """Hide the password of a URI (postgresql://user:secret@host -> postgresql://user:***@host)."""
    return re.sub(r"(?<=://)([^/:@\s]+):[^@/\s]+@", r"\1:***@", text)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            text = json.dumps(value) if isinstance(value, list) else str(value)
            flat[name] = scrub(text)[:MAX_PARAM_CHARS]
    return flat


def _git(root: Path, *args: str) -> str | None:
    """Output of a git command in `root`, or None where there is no git or no repository."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git_state(root: Path) -> tuple[str, bool]:
    """(HEAD commit or "nogit", whether the work tree differs from it)."""
    commit = _git(root, "rev-parse", "HEAD") or "nogit"
    # dvc.lock is rewritten after every stage of a `dvc repro`; counting it would mark all later stages dirty.
    status = _git(root, "status", "--porcelain", "--", ":(exclude,glob)**/dvc.lock")
    return commit, bool(status)


def _normalise(path: str | Path, root: Path) -> str:
    return Path(os.path.relpath(os.path.abspath(path), root)).as_posix()


def lock_stages(lock: Path) -> dict[str, dict]:
    """{stage name: its dvc.lock entry}; empty when there is no lock yet."""
    if not lock.is_file():
        return {}
    return (yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages") or {}


def lock_outputs(lock: Path) -> dict[str, str]:
    """{output path: md5} over every stage of a dvc.lock."""
    return {out["path"]: str(out["md5"]) for entry in lock_stages(lock).values()
            for out in entry.get("outs") or [] if "path" in out and "md5" in out}


def _input_md5s(inputs: Sequence[str | Path], root: Path) -> dict[str, str]:
    """md5 that dvc.lock records for each input as some stage's output; inputs it does not list are left out."""
    recorded = {_normalise(root / path, root): md5 for path, md5 in lock_outputs(root / "dvc.lock").items()}
    wanted = (_normalise(path, root) for path in inputs)
    return {path: recorded[path] for path in wanted if path in recorded}


def _invocation_key() -> str | None:
    """One key per `dvc repro` / `dvc exp run` invocation: the pid and start time of the dvc process above us
    (DVC runs each stage command through a shell). None when the stage was started by hand."""
    try:
        process = psutil.Process().parent()
        while process is not None:
            command = " ".join(process.cmdline()[:2])
            if re.search(r"(^|/)dvc(\s|$)|-m dvc\b|/dvc/__main__", command) or process.name() == "dvc":
                return f"dvc-{process.pid}-{int(process.create_time())}"
            process = process.parent()
    except psutil.Error:
        return None
    return None


def _tag_key(text: str) -> str:
    return re.sub(r"[^\w./\- ]", "_", text)  # the characters MLflow allows in tag names


def _experiment_id(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":  # another stage process created it just now
            raise
        return client.get_experiment_by_name(name).experiment_id


def _parent_run_id(client: MlflowClient, experiment_id: str, key: str, name: str, tags: dict[str, str]) -> str:
    """The pipeline's parent run, created FINISHED on first use."""
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}' and tags.`{ROLE_TAG}` = 'pipeline'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    if found:
        run_id = found[0].info.run_id
        for tag, value in tags.items():
            client.set_tag(run_id, tag, value)
        return run_id
    run = client.create_run(experiment_id, run_name=name, tags={ROLE_TAG: "pipeline", **tags})
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


LOCK_HASH_TAG = "eagle3ops.lock_hash"
CACHED_FROM_TAG = "eagle3ops.cached_from"


def lock_hashes(root: Path) -> dict[str, str]:
    """{dvc stage name: hash of its dvc.lock entry}. Equal hashes mean the same command, deps, params and outs:
    the run that wrote the entry produced exactly those outputs."""
    return {name: hashlib.sha256(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for name, entry in lock_stages(root / "dvc.lock").items()}


def _stage_runs(client: MlflowClient, experiment_id: str, extra: str = "") -> list:
    query = f"tags.`{ROLE_TAG}` = 'stage'" + (f" and {extra}" if extra else "")
    return client.search_runs([experiment_id], filter_string=query, order_by=["attributes.start_time DESC"],
                              max_results=5000)


def stamp_finished_stages(client: MlflowClient, experiment_id: str, root: Path) -> None:
    """Tag the newest finished, unstamped run of each stage with the dvc.lock hash DVC wrote after it ran.

    DVC writes a stage's lock entry only once the stage has succeeded, so the next stage to start (or the
    report at the end) is the first process that can tie the run to the outputs it produced.
    """
    hashes = lock_hashes(root)
    if not hashes:
        return
    stamped = {r.data.tags.get(LOCK_HASH_TAG) for r in _stage_runs(client, experiment_id, f"tags.`{LOCK_HASH_TAG}` != ''")}
    for run in _stage_runs(client, experiment_id, "attributes.status = 'FINISHED'"):
        tags = run.data.tags
        stage = tags.get("eagle3ops.dvc_stage")
        if stage in hashes and LOCK_HASH_TAG not in tags and hashes[stage] not in stamped:
            client.set_tag(run.info.run_id, LOCK_HASH_TAG, hashes[stage])
            stamped.add(hashes[stage])


RESULT_COMMIT_TAG = "eagle3ops.result_commit"


def tag_experiment_commits(client: MlflowClient, experiment_id: str, root: Path) -> None:
    """`dvc exp run` commits its results only after the last stage: tag each experiment's parent run with that
    commit as soon as a later process (the next stage run, or `compare`) can see it under refs/exps."""
    refs = _git(root, "for-each-ref", "refs/exps", "--format=%(refname) %(objectname)")
    if not refs:
        return
    commits = {ref.rsplit("/", 1)[-1]: sha for ref, sha in (line.split() for line in refs.splitlines())}
    parents = client.search_runs([experiment_id], f"tags.`{ROLE_TAG}` = 'pipeline'", max_results=5000)
    for parent in parents:
        name = parent.data.tags.get(PIPELINE_KEY_TAG)
        if name in commits and RESULT_COMMIT_TAG not in parent.data.tags:
            client.set_tag(parent.info.run_id, RESULT_COMMIT_TAG, commits[name])


def link_cached_stages(client: MlflowClient, experiment_id: str, parent_id: str, root: Path) -> list[str]:
    """Give the pipeline run a child for every stage DVC skipped: a FINISHED link run that names the run which
    produced the cached outputs (found by dvc.lock hash) and carries its params and final metrics, so every
    parent shows the whole chain. Returns the linked stage names."""
    stamp_finished_stages(client, experiment_id, root)
    present = {r.data.tags.get("eagle3ops.dvc_stage")
               for r in _stage_runs(client, experiment_id, f"tags.`mlflow.parentRunId` = '{parent_id}'")}
    linked = []
    for stage, lock_hash in lock_hashes(root).items():
        if stage in present:
            continue
        producers = _stage_runs(client, experiment_id, f"tags.`{LOCK_HASH_TAG}` = '{lock_hash}'")
        original = next((r for r in producers if CACHED_FROM_TAG not in r.data.tags), None)
        if original is None:
            continue
        tags = {k: v for k, v in original.data.tags.items() if not k.startswith("mlflow.")}
        tags.update({CACHED_FROM_TAG: original.info.run_id, "mlflow.parentRunId": parent_id})
        link = client.create_run(original.info.experiment_id, run_name=f"{original.info.run_name} (cached)", tags=tags)
        client.log_batch(link.info.run_id,
                         metrics=[Metric(k, v, int(time.time() * 1000), 0) for k, v in original.data.metrics.items()],
                         params=[Param(k, v) for k, v in original.data.params.items()])
        client.set_terminated(link.info.run_id, "FINISHED")
        linked.append(stage)
    return linked


def _log_inputs(client: MlflowClient, run_id: str, md5s: dict[str, str]) -> None:
    """Datasets and shard directories as MLflow inputs, with the DVC md5 as digest."""
    datasets = [MetaDataset(LocalArtifactDatasetSource(path), name=path, digest=md5)._to_mlflow_entity()
                for path, md5 in md5s.items()]
    if datasets:
        client.log_inputs(run_id, [DatasetInput(d, tags=[InputTag("mlflow.data.context", "input")]) for d in datasets])


CHAMPION = "champion"


def register_drafter(client: MlflowClient, run, name: str, source: str, tau: float) -> str:
    """A new version of registered model `name` from the drafter at `source`, tagged with its tau and lineage;
    the alias `champion` moves to it when its tau beats the current champion's. Returns the version."""
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="EAGLE-3 drafters, SpecForge/SGLang layout, with their tau")
    lineage = {k: v for k, v in run.data.tags.items() if k.startswith(("eagle3ops.", "dvc.input.", "hardware.label"))}
    version = client.create_model_version(name, source, run_id=run.info.run_id, tags={**lineage, "tau": f"{tau:.4f}"})
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
        best = float(champion.tags.get("tau", "-inf"))
    except MlflowException:
        best = float("-inf")
    if tau > best:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    return version.version


def credentials_refused(error: BaseException) -> bool:
    """Whether the server answered 401/403, read from MLflow's error code: the message text is no guide, since a
    refused connection names the port (which may well contain "401")."""
    return isinstance(error, MlflowException) and error.error_code in REFUSED_ERROR_CODES


class StageRun:
    """Handle on the stage's MLflow run, for the stage to log timings, metrics and artifacts.

    When the tracking server cannot be reached (from the start, or from some call on), the handle records what
    it could not send in an outbox (outbox.py) and the stage goes on; `eagle3ops sync` uploads it later.
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
        self._record = record  # what the outbox needs to recreate the run
        self.outbox: Outbox | None = None

    def go_offline(self, error: BaseException) -> None:
        if self.outbox is None:
            self.outbox = Outbox(self.root, {**self._record, "run_id": self.run_id, "parent_id": self.parent_id})
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

    def register_drafter(self, name: str, artifact_path: str, tau: float) -> None:
        """Register this run's logged drafter artifact (see `register_drafter`)."""
        def register():
            run = self._client.get_run(self.run_id)
            register_drafter(self._client, run, name, f"{run.info.artifact_uri}/{artifact_path}", tau)

        if not self._send(register):
            self.outbox.register(name, artifact_path, tau)

    def log_pipeline_artifact(self, path: str | Path, artifact_path: str) -> None:
        """A file that describes the whole pipeline run (dvc.lock, params.yaml) goes on the parent run."""
        if not self._send(lambda: self._client.log_artifact(self.parent_id, str(path), artifact_path)):
            self.outbox.artifact(Path(path), artifact_path, on_parent=True)

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


@contextmanager
def stage_run(
    cfg: Config, stage: str, variant: str | None = None, inputs: Sequence[str | Path] = (),
    extra_params: Mapping[str, str] | None = None,
) -> Iterator[StageRun]:
    """Record one stage run as a child of its pipeline's parent run; FAILED if the block raises. A tracking
    server that cannot be reached never stops the stage: see StageRun. `extra_params` are logged beside the
    config's (the target's identity, modeling/identity.py)."""
    start = time.perf_counter()
    root = _root()
    uri = tracking_uri(cfg)
    commit, dirty = _git_state(root)
    digest = params_digest(cfg)
    exp_name = os.environ.get("DVC_EXP_NAME")
    key = exp_name or _invocation_key() or hashlib.sha256(f"{commit}{digest}".encode()).hexdigest()[:12]
    shared = {PIPELINE_KEY_TAG: key, "eagle3ops.git_commit": commit, "eagle3ops.params_digest": digest}
    if os.environ.get("EAGLE3OPS_REPRODUCES"):  # set by `eagle3ops reproduce` for the re-run it starts
        shared["eagle3ops.reproduces"] = os.environ["EAGLE3OPS_REPRODUCES"]
    name = exp_name or f"pipeline {time.strftime('%Y-%m-%d %H:%M:%S')}"  # used only when the parent is created
    input_md5s = _input_md5s(inputs, root)
    fp = hardware.fingerprint()
    tags = {
        **shared,
        ROLE_TAG: "stage",
        "eagle3ops.stage": stage,
        "eagle3ops.variant": variant or "",
        "eagle3ops.dvc_stage": os.environ.get("DVC_STAGE", ""),
        "eagle3ops.git_dirty": str(dirty).lower(),
        "hardware.label": hardware.label(fp, cfg.hardware.label),
        **{f"hardware.{name}": str(value) for name, value in fp.items()},
        **{_tag_key(f"dvc.input.{path}"): md5 for path, md5 in input_md5s.items()},
    }
    run_name = f"{stage}@{variant}" if variant else stage
    params = {**_flatten(OmegaConf.to_container(OmegaConf.structured(cfg))),
              **{key: scrub(str(value))[:MAX_PARAM_CHARS] for key, value in (extra_params or {}).items()}}
    record = {"experiment": cfg.mlflow.experiment, "pipeline_key": key, "parent_name": name, "parent_tags": shared,
              "run_name": run_name, "tags": tags, "params": params}

    handle = StageRun(None, None, start, None, None, root, record)
    try:
        mlflow.set_tracking_uri(uri)
        client = MlflowClient(uri)
        # Our own default store keeps artifacts beside mlflow.db, whatever directory the stage happens to run in.
        artifacts = (_store_root(root) / "mlruns").as_uri() if uri == _default_uri(root) else None
        experiment_id = _experiment_id(client, cfg.mlflow.experiment, artifacts)
        parent_id = _parent_run_id(client, experiment_id, key, name, shared)
        stamp_finished_stages(client, experiment_id, root)
        tag_experiment_commits(client, experiment_id, root)
        active = mlflow.start_run(experiment_id=experiment_id, run_name=run_name, parent_run_id=parent_id, tags=tags,
                                  log_system_metrics=cfg.mlflow.system_metrics)
        handle = StageRun(client, active.info.run_id, start, experiment_id, parent_id, root, record)
        mlflow.log_params(params)
        _log_inputs(client, active.info.run_id, input_md5s)
    except UNREACHABLE as err:
        handle.go_offline(err)
    handle.input_md5s = input_md5s
    status = "FAILED"
    try:
        yield handle
        status = "FINISHED"
    finally:
        handle.log_metrics({"time/stage_wall_s": time.perf_counter() - start})
        if handle.run_id is not None:
            try:
                mlflow.end_run(status)
            except UNREACHABLE:
                pass  # the outbox keeps the status
        if not handle._send(lambda: handle._client.set_terminated(handle.parent_id, "FINISHED")):
            handle.outbox.finish(status)  # moves the parent's end time to this stage's end, once synced
