"""Where stage runs are recorded and how a pipeline's runs are found again: the tracking URI, the experiment, the
parent run of a pipeline run, the tags that tie them together, and what a tracking server that cannot be
reached raises.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import requests
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from eagle3ops.config import Config
from eagle3ops.fs import WORK_DIR

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


def project_root() -> Path:
    """The repository root: DVC's when a stage runs under it, else the working directory. A `dvc exp run --temp`
    experiment runs its stages in a copy under <DVC_ROOT>/.dvc/tmp/exps/ with DVC_ROOT still the original's: there
    the root is the copy's (its params.yaml, dvc.yaml and outputs are the experiment's)."""
    root, cwd = Path(os.environ.get("DVC_ROOT") or os.getcwd()).absolute(), Path.cwd().absolute()
    copies = root / ".dvc" / "tmp" / "exps"
    if cwd.is_relative_to(copies):
        return next((d for d in (cwd, *cwd.parents) if d.is_relative_to(copies) and (d / "dvc.yaml").is_file()), root)
    return root


def store_root(root: Path) -> Path:
    """Queued and --temp experiments run in a copy under <repo>/.dvc/tmp/exps/: their runs belong in the
    repository's own store, not in a copy that DVC deletes afterwards."""
    parts = root.parts
    if ".dvc" in parts:
        at = parts.index(".dvc")
        if parts[at + 1 : at + 3] == ("tmp", "exps"):
            return Path(*parts[:at])
    return root


def default_uri(root: Path) -> str:
    return f"sqlite:///{store_root(root) / 'mlflow.db'}"


def shown_uri(uri: str, root: Path) -> str:
    """`uri` as a committed file may show it: the default store relative to the repository (`sqlite:///mlflow.db`,
    which MLflow reads from the directory it runs in), not one clone's absolute path; any other store scrubbed."""
    return "sqlite:///mlflow.db" if uri == default_uri(root) else scrub(uri)


def tracking_uri(cfg: Config) -> str:
    """Where runs are recorded: $MLFLOW_TRACKING_URI (it overrides, as in MLflow itself), else the config's
    mlflow.tracking_uri, else mlflow.db at the repository root. One that names no store MLflow can record in is
    an InputError naming the setting it came from (see check_uri)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return check_uri(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI")
    if cfg.mlflow.tracking_uri:
        return check_uri(cfg.mlflow.tracking_uri, "params mlflow.tracking_uri")
    return default_uri(project_root())


# The stores MLflow 3 records runs in, as its tracking URI names them; a database may name its driver
# (postgresql+psycopg://). A bare path (no scheme) is a directory of MLflow's file store, as file:// is.
SERVER_SCHEMES = frozenset({"http", "https"})
DATABASE_SCHEMES = frozenset({"sqlite", "postgresql", "mysql", "mssql"})
OTHER_SCHEMES = frozenset({"file", "databricks"})
SUPPORTED_STORES = ("http(s)://HOST[:PORT] (a tracking server), sqlite:///PATH.db, postgresql://, mysql:// or "
                    "mssql:// (a database; +DRIVER allowed), file:///DIR or a directory path, databricks")


def check_uri(uri: str, source: str) -> str:
    """`uri` if MLflow can record runs there, else an InputError in one line that names `source` (the variable,
    params key or option it came from), what is wrong, and the stores supported. Caught here, before any stage
    work: MLflow would fail only on first use, in an error cut short that reads as a server being down."""
    from eagle3ops.errors import InputError

    def refuse(what: str) -> InputError:
        return InputError(f"{source} {scrub(uri)!r}: {what}; supported: {SUPPORTED_STORES}")

    if not uri.strip() or uri.strip() != uri:
        raise refuse("empty, or blanks around it")
    if re.fullmatch(r"[\w.-]+:\d+/?", uri):  # localhost:5000: no scheme (MLflow would make a directory of it)
        raise refuse(f"no scheme: a tracking server there is http://{uri}")
    parsed = urlparse(uri)  # as MLflow reads it: no scheme is a directory of its file store
    scheme = parsed.scheme.lower()
    kind = scheme.partition("+")[0]  # a database's driver: postgresql+psycopg://
    if scheme in SERVER_SCHEMES and not parsed.netloc:
        raise refuse("no host")
    if scheme == "sqlite" and (parsed.netloc or parsed.path in ("", "/")):
        raise refuse("a SQLite file is sqlite:///RELATIVE/PATH.db or sqlite:////ABSOLUTE/PATH.db (three slashes, "
                     "no host; an in-memory database keeps nothing)")
    if scheme and not (scheme in SERVER_SCHEMES | OTHER_SCHEMES or kind in DATABASE_SCHEMES):
        raise refuse(f"{parsed.scheme}:// is not a store MLflow records runs in")
    return uri


def scrub(text: str) -> str:
    """Hide the password of a URI (postgresql://user:secret@host -> postgresql://user:***@host)."""
    return re.sub(r"(?<=://)([^/:@\s]+):[^@/\s]+@", r"\1:***@", text)


# The experiment opens on its runs table (MLflow's kind for model training, not its GenAI traces page).
EXPERIMENT_TAGS = {
    "mlflow.experimentKind": "custom_model_development",
    "mlflow.note.content": "EAGLE-3 drafters trained by the eagle3ops pipeline. One parent run per `dvc repro` or "
                           "`dvc exp run`, with tau per drafter, the params that define it and its report; under it "
                           "one run per DVC stage (train@scratch, eval@warm_start, ...).",
}


# The runs table the report's link opens: a saved view of MLflow 3 (an experiment tag
# mlflow.sharedViewState.KEY, opened by ?viewStateShareKey=KEY; no URL parameter picks columns). The pipeline runs
# alone, newest first, with tau per drafter (the decoder's and vLLM's) and the overrides as columns beside
# the name, creation time and duration MLflow always shows.
RUNS_VIEW_KEY = "eagle3ops"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW_STATE = {
    "selectedColumns": [f"metrics.`{kind}/{drafter}`" for kind in ("tau", "tau_vllm")
                        for drafter in ("baseline", "scratch", "warm_start")] + ["params.`overrides`"],
    "searchFilter": f"tags.`{ROLE_TAG}` = 'pipeline'",
    "orderByKey": "attributes.start_time",
    "orderByAsc": False,
}


def _runs_view() -> str:
    now = int(time.time() * 1000)
    return json.dumps({"name": "Pipeline runs: tau per drafter", "createdAt": now, "updatedAt": now,
                       "state": json.dumps(RUNS_VIEW_STATE)})


def find_or_create_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """The experiment's id, created with `artifact_location` (our default store's mlruns/) where it is new. An
    experiment of our default store whose artifacts live elsewhere came with a copied (or moved) mlflow.db: its runs'
    artifacts would go into the other checkout's mlruns/, so it is refused."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None and artifact_location and experiment.artifact_location != artifact_location:
        from eagle3ops.errors import InputError

        store = urlparse(artifact_location).path.removesuffix("/mlruns")
        raise InputError(
            f"{store}/mlflow.db: experiment {name!r} keeps its artifacts in {experiment.artifact_location}, not in "
            f"this repository's {artifact_location}: the store was copied or moved from another checkout, and its "
            f"runs would write there. Give this checkout a store of its own (`mv mlflow.db mlflow.db.copied` in "
            f"{store}), or record elsewhere (params mlflow.experiment, mlflow.tracking_uri)")
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location,
                                            tags={**EXPERIMENT_TAGS, RUNS_VIEW_TAG: _runs_view()})
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":  # another stage process created it just now
                raise
            experiment = client.get_experiment_by_name(name)
    for tag, value in EXPERIMENT_TAGS.items():
        if tag not in experiment.tags:  # one made before these tags, or by hand
            client.set_experiment_tag(experiment.experiment_id, tag, value)
    view = json.loads(experiment.tags.get(RUNS_VIEW_TAG) or "{}")
    if view.get("state") != json.dumps(RUNS_VIEW_STATE):  # none yet, or an older eagle3ops's
        client.set_experiment_tag(experiment.experiment_id, RUNS_VIEW_TAG, _runs_view())
    return experiment.experiment_id


def find_or_create_parent_run(client: MlflowClient, experiment_id: str, key: str, name: str, tags: dict[str, str],
                              start_time: int | None = None, running: bool = False) -> str:
    """The pipeline's parent run (a one-off run's, when `tags` give the role one_off), created on first use at
    `start_time` (ms; a stage recorded elsewhere and synced later) or now; RUNNING with `running` (a stage of it
    starts), else FINISHED."""
    role = tags.get(ROLE_TAG, "pipeline")
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}' and tags.`{ROLE_TAG}` = '{role}'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    if found:
        run_id = found[0].info.run_id
        for tag, value in tags.items():
            client.set_tag(run_id, tag, value)
        if running and found[0].info.status != "RUNNING":
            client.update_run(run_id, "RUNNING")
        return run_id
    run = client.create_run(experiment_id, start_time=start_time, run_name=name, tags={ROLE_TAG: role, **tags})
    if not running:
        client.set_terminated(run.info.run_id, "FINISHED", start_time)
    return run.info.run_id


def log_pipeline_run(client: MlflowClient, parent_id: str, metrics: dict[str, float], params: dict[str, str],
                     tags: dict[str, str]) -> None:
    """The pipeline run's own numbers, params and tags (its description among them) on its parent run."""
    now = int(time.time() * 1000)
    entries = [Metric(key, float(value), now, 0) for key, value in metrics.items()]
    logged = client.get_run(parent_id).data.params  # params are immutable: a report run again keeps the first
    given = [Param(key, value) for key, value in params.items() if key not in logged]
    for first in range(0, max(len(entries), len(given)), 100):
        client.log_batch(parent_id, metrics=entries[first : first + 100], params=given[first : first + 100])
    for tag, value in tags.items():
        client.set_tag(parent_id, tag, value)


# A tracking server that did not answer a stage of a pipeline run, so that its later stages go straight to the outbox
# (each would spend a minute of timeouts) and the report says so: {"uri", "pipeline_key", "error"}, in the store root
UNANSWERED = WORK_DIR / "tracking-unanswered.json"


class TrackingUnanswered(Exception):
    """The tracking server did not answer an earlier stage of this pipeline run."""


def unanswered(root: Path, uri: str, pipeline_key: str) -> str | None:
    """What the server `uri` answered an earlier stage of the pipeline run `pipeline_key` (None if it did)."""
    try:
        noted = json.loads((root / UNANSWERED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if noted.get("uri") == uri and noted.get("pipeline_key") == pipeline_key:
        return str(noted.get("error"))
    return None


def note_unanswered(root: Path, uri: str, pipeline_key: str, error: BaseException) -> None:
    path = root / UNANSWERED
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"uri": uri, "pipeline_key": pipeline_key,
                                "error": f"{type(error).__name__}: {str(error)[:300]}"}), encoding="utf-8")


def credentials_refused(error: BaseException) -> bool:
    """Whether the server answered 401/403, read from MLflow's error code: the message text is no guide, since a
    refused connection names the port (which may well contain "401")."""
    return isinstance(error, MlflowException) and error.error_code in REFUSED_ERROR_CODES
