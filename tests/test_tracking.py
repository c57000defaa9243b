"""Stage runs against a real sqlite MLflow store in a temporary directory."""
from __future__ import annotations

import inspect
import json
import math
import subprocess
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.entities import Run

from eagle3ops.config import Config
from eagle3ops.reporting.summary import mlflow_ui_hint
from eagle3ops.tracking.run import StageRun, Tracker, Untracked, stage_run
from eagle3ops.tracking.store import default_uri, shown_uri, tracking_uri
from helpers import FakeDvc, isolate

ENV = ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", "MLFLOW_RUN_ID")


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets its own cwd and store; MLflow writes the tracking URI into os.environ, monkeypatch undoes it."""
    monkeypatch.chdir(tmp_path)
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def client(cfg: Config) -> MlflowClient:
    return MlflowClient(tracking_uri(cfg))


def get_run(cfg: Config, run_id: str) -> Run:
    return client(cfg).get_run(run_id)


def parent_of(cfg: Config, run_id: str) -> Run:
    return get_run(cfg, get_run(cfg, run_id).data.tags["mlflow.parentRunId"])


def test_default_uri_is_sqlite_at_root(tmp_path: Path) -> None:
    assert tracking_uri(Config()) == f"sqlite:///{tmp_path}/mlflow.db"


def test_same_pipeline_shares_one_finished_parent(tmp_path: Path) -> None:
    cfg = Config()
    with stage_run(cfg, "prepare") as first:
        pass
    with stage_run(cfg, "train", "scratch") as second:
        pass
    parent = parent_of(cfg, first.run_id)
    assert parent_of(cfg, second.run_id).info.run_id == parent.info.run_id
    assert parent.info.status == "FINISHED"
    key = parent.data.tags["eagle3ops.pipeline_key"]
    assert parent.info.run_name.startswith("pipeline 20") and key
    assert parent.data.tags["eagle3ops.params_digest"] == get_run(cfg, first.run_id).data.tags["eagle3ops.params_digest"]
    assert mlflow.active_run() is None
    assert (tmp_path / "mlflow.db").is_file()


def test_other_params_get_another_parent() -> None:
    with stage_run(Config(seed=0), "prepare") as a:
        pass
    with stage_run(Config(seed=1), "prepare") as b:
        pass
    cfg = Config()
    assert parent_of(cfg, a.run_id).info.run_id != parent_of(cfg, b.run_id).info.run_id
    assert get_run(cfg, a.run_id).data.tags["eagle3ops.params_digest"] != get_run(cfg, b.run_id).data.tags[
        "eagle3ops.params_digest"
    ]


def test_dvc_experiment_groups_and_names_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVC_EXP_NAME", "cheery-lamb")
    with stage_run(Config(seed=0), "extract") as a:
        pass
    with stage_run(Config(seed=1), "train", "warm_start") as b:  # the experiment, not the digest, decides
        pass
    cfg = Config()
    parent = parent_of(cfg, a.run_id)
    assert parent_of(cfg, b.run_id).info.run_id == parent.info.run_id
    assert parent.info.run_name == "cheery-lamb"
    assert parent.data.tags["eagle3ops.pipeline_key"] == "cheery-lamb"


def test_run_names_and_tags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVC_STAGE", "train@scratch")
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\n"
        "stages:\n"
        "  extract:\n"
        "    cmd: eagle3ops extract\n"
        "    outs:\n"
        "    - path: data/features\n"
        "      hash: md5\n"
        "      md5: 0123456789abcdef0123456789abcdef.dir\n"
        "      size: 10\n"
        "      nfiles: 2\n"
    )
    cfg = Config()
    cfg.seed = 7
    cfg.target.aux_layers = [2, 4, 5]
    with stage_run(cfg, "train", "scratch", inputs=["./data/features/", "data/missing"]) as run:
        pass
    data = get_run(cfg, run.run_id).data
    parent = parent_of(cfg, run.run_id)
    assert get_run(cfg, run.run_id).info.run_name == f"train@scratch · {parent.info.run_name}"  # its pipeline too
    assert data.tags["eagle3ops.stage"] == "train"
    assert data.tags["eagle3ops.variant"] == "scratch"
    assert data.tags["eagle3ops.dvc_stage"] == "train@scratch"
    assert data.tags["eagle3ops.git_commit"] == "nogit"  # tmp_path is no git repository
    assert data.tags["eagle3ops.git_dirty"] == "false"
    assert len(data.tags["eagle3ops.params_digest"]) == 12
    assert data.tags["eagle3ops.pipeline_key"] == parent_of(cfg, run.run_id).data.tags["eagle3ops.pipeline_key"]
    assert data.tags["hardware.label"].startswith("cpu-")
    assert data.tags["hardware.gpu_count"] == "0"
    assert data.tags["dvc.input.data/features"] == "0123456789abcdef0123456789abcdef.dir"
    assert not any(tag.startswith("dvc.input.data/missing") for tag in data.tags)
    assert data.params["seed"] == "7"
    assert data.params["target.aux_layers"] == "[2, 4, 5]"
    assert "threads" not in data.params and "mlflow.experiment" not in data.params  # where it ran: not lineage
    hardware = json.loads(Path(mlflow.artifacts.download_artifacts(run_id=run.run_id, artifact_path="hardware.json",
                                                                   tracking_uri=tracking_uri(cfg))).read_text())
    assert hardware["cpu_logical_cores"] and hardware["torch"]


def test_hardware_label_override() -> None:
    cfg = Config()
    cfg.hardware.label = "8xRTXPRO6000"
    with stage_run(cfg, "prepare") as run:
        pass
    assert get_run(cfg, run.run_id).data.tags["hardware.label"] == "8xRTXPRO6000"


def test_phases_and_metrics_are_logged() -> None:
    cfg = Config()
    with stage_run(cfg, "eval", "baseline") as run:
        with run.phase("load"):
            pass
        run.log_metrics({"acceptance_length": 2.5, "skipped_none": None, "skipped_nan": math.nan}, step=3)
    assert set(run.timings) == {"load"}
    metrics = get_run(cfg, run.run_id).data.metrics
    assert metrics["time/load_s"] == pytest.approx(run.timings["load"])
    assert metrics["time/stage_wall_s"] >= run.timings["load"]
    assert metrics["acceptance_length"] == 2.5
    assert "skipped_none" not in metrics and "skipped_nan" not in metrics
    assert client(cfg).get_metric_history(run.run_id, "acceptance_length")[0].step == 3


def test_the_recording_run_and_the_silent_stand_in_keep_one_contract() -> None:
    """The stage's code calls the same methods on rank 0's run and on the other ranks' stand-in: each method of
    the contract exists on both with the contract's own signature, and the stand-in records nothing."""
    for member in ("phase", "log_metrics"):
        contract = inspect.signature(getattr(Tracker, member))
        for implementation in (StageRun, Untracked):
            assert inspect.signature(getattr(implementation, member)).parameters.keys() == contract.parameters.keys()
    silent = Untracked()
    with silent.phase("train"):
        silent.log_metrics({"train/loss": 1.0}, step=1)
    assert silent.one_off is None and vars(silent) == {}


def test_exception_marks_run_failed_and_propagates() -> None:
    cfg = Config()
    boom = RuntimeError("boom")
    with pytest.raises(RuntimeError) as raised:
        with stage_run(cfg, "train", "scratch") as run:
            with run.phase("train"):
                raise boom
    assert raised.value is boom
    failed = get_run(cfg, run.run_id)
    assert failed.info.status == "FAILED"
    assert "time/train_s" in failed.data.metrics and "time/stage_wall_s" in failed.data.metrics
    assert parent_of(cfg, run.run_id).info.status == "FAILED"  # the pipeline run failed with its stage
    assert mlflow.active_run() is None


def test_artifacts_are_logged(tmp_path: Path) -> None:
    (tmp_path / "report.md").write_text("# report\n")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "tau.csv").write_text("k,tau\n3,2.5\n")
    cfg = Config()
    with stage_run(cfg, "report") as run:
        run.log_artifact(tmp_path / "report.md")
        run.log_artifact("plots")
    store = client(cfg)
    assert {a.path for a in store.list_artifacts(run.run_id)} == {"report.md", "plots", "hardware.json"}
    assert [a.path for a in store.list_artifacts(run.run_id, "plots")] == ["plots/tau.csv"]
    assert (tmp_path / "mlruns").is_dir()  # artifacts sit beside mlflow.db


@pytest.mark.parametrize("git_program", [True, False], ids=["git", "dulwich"])
def test_git_commit_and_dirty_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, git_program: bool) -> None:
    """The same answer from the git program and, on a machine without it (a lent GPU machine), from dulwich."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                              capture_output=True, text=True)
        return done.stdout.strip()

    git("init", "-q")
    Path(".gitignore").write_text("/mlflow.db\n/mlruns/\n")  # as the project ignores its store
    Path("dvc.lock").write_text("schema: '2.0'\n")
    git("add", ".gitignore", "dvc.lock")
    git("commit", "-qm", "init")
    cfg = Config()
    if not git_program:
        monkeypatch.setattr("eagle3ops.tracking.lineage.git", lambda root, *args: None)
    Path("dvc.lock").write_text("schema: '2.0'\nstages: {}\n")  # what every `dvc repro` stage does
    Path("models").mkdir()
    Path("models/.gitignore").write_text("/zoo\n")  # and the .gitignore DVC writes beside each new output
    with stage_run(cfg, "prepare") as clean:
        pass
    Path("train.py").write_text("")
    with stage_run(cfg, "train") as dirty:
        pass
    tags = get_run(cfg, clean.run_id).data.tags
    assert tags["eagle3ops.git_commit"] == git("rev-parse", "HEAD")
    assert tags["eagle3ops.git_dirty"] == "false"
    assert get_run(cfg, dirty.run_id).data.tags["eagle3ops.git_dirty"] == "true"


def test_queued_experiments_record_into_the_repository_store(monkeypatch) -> None:
    """`dvc exp run --queue` runs stages in a copy under <repo>/.dvc/tmp/exps/; the default store stays the repo's."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", "/srv/project/.dvc/tmp/exps/tmpq8k2/")
    assert tracking_uri(Config()) == "sqlite:////srv/project/mlflow.db"
    monkeypatch.setenv("DVC_ROOT", "/srv/project")
    assert tracking_uri(Config()) == "sqlite:////srv/project/mlflow.db"


def test_a_temp_experiment_is_its_own_project_and_records_into_the_repositorys_store(tmp_path) -> None:
    """`dvc exp run --temp` runs the stages in a copy under <repo>/.dvc/tmp/exps/ with DVC_ROOT the original's:
    a stage there reads the copy's params.yaml (it is no one-off run) and records into the repository's store."""
    import sys

    from helpers import run

    script = ("import json, sys\nfrom pathlib import Path\nfrom eagle3ops.config import Config\n"
              "from eagle3ops.tracking.store import project_root, tracking_uri\n"
              "root = project_root()\njson.dump({'root': str(root), 'cwd': str(Path.cwd()), 'uri': tracking_uri(Config()),"
              " 'own_params': Path('params.yaml').resolve() == (root / 'params.yaml').resolve()}, open('where.json', 'w'))\n")
    (tmp_path / "where.py").write_text(script)
    (tmp_path / "params.yaml").write_text("a: 1\n")
    (tmp_path / "dvc.yaml").write_text(f"stages:\n  where:\n    cmd: {sys.executable} where.py\n    deps: [where.py]\n"
                                       "    params: [a]\n    metrics: [{where.json: {cache: false}}]\n")
    for command in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "repro", "-q"], ["git", "add", "-A"],
                    ["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "base"],
                    ["dvc", "exp", "run", "-q", "--temp", "-n", "copy", "-S", "a=2"]):
        run(command, tmp_path)
    assert json.loads((tmp_path / "where.json").read_text())["root"] == str(tmp_path)  # the workspace untouched
    ref = run(["git", "for-each-ref", "refs/exps", "--format=%(refname)"], tmp_path).split()[0]
    where = json.loads(run(["git", "show", f"{ref}:where.json"], tmp_path))
    assert where["root"] == where["cwd"] and where["root"].startswith(f"{tmp_path}/.dvc/tmp/exps/")
    assert where["own_params"] and where["uri"] == f"sqlite:///{tmp_path}/mlflow.db"


def test_report_points_at_the_right_ui():
    """A tracking server is its own UI; a local store needs `mlflow ui` started on it."""
    assert mlflow_ui_hint("http://mlflow.team:5000") == "open http://mlflow.team:5000"
    assert mlflow_ui_hint("sqlite:///mlflow.db").startswith("`mlflow ui --backend-store-uri sqlite:///mlflow.db`")
    assert mlflow_ui_hint("http://mlflow.team:5000/", "7") == (
        "open http://mlflow.team:5000/#/experiments/7/runs?viewStateShareKey=eagle3ops&workflowType=machine_learning")


def test_the_experiment_keeps_the_view_the_link_opens(tmp_path):
    """The saved view (an experiment tag MLflow's runs page reads for ?viewStateShareKey=eagle3ops) lists tau per
    drafter and the overrides as columns, over the pipeline runs; an experiment made before it, or with an older
    view, gets the current one."""
    from mlflow import MlflowClient

    from eagle3ops.tracking.store import RUNS_VIEW_STATE, RUNS_VIEW_TAG, find_or_create_experiment

    client = MlflowClient(default_uri(tmp_path))
    experiment_id = find_or_create_experiment(client, "eagle3ops", None)
    view = json.loads(client.get_experiment(experiment_id).tags[RUNS_VIEW_TAG])
    assert isinstance(view["name"], str) and isinstance(view["createdAt"], int)
    state = json.loads(view["state"])
    assert state["selectedColumns"][:3] == ["metrics.`tau/baseline`", "metrics.`tau/scratch`", "metrics.`tau/warm_start`"]
    assert "params.`overrides`" in state["selectedColumns"]
    assert state["searchFilter"] == "tags.`eagle3ops.role` = 'pipeline'"
    client.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, json.dumps({**view, "state": "{}"}))
    find_or_create_experiment(client, "eagle3ops", None)
    assert json.loads(json.loads(client.get_experiment(experiment_id).tags[RUNS_VIEW_TAG])["state"]) == RUNS_VIEW_STATE


def test_report_names_the_default_store_as_any_clone_has_it(tmp_path):
    """The committed report names the repository's own store relatively: a clone's absolute path would send
    another checkout's `mlflow ui` to this one's runs."""
    assert shown_uri(default_uri(tmp_path), tmp_path) == "sqlite:///mlflow.db"
    assert shown_uri(f"sqlite:///{tmp_path}/other.db", tmp_path) == f"sqlite:///{tmp_path}/other.db"
    assert shown_uri("http://alice:secret@mlflow.team:5000", tmp_path) == "http://alice:***@mlflow.team:5000"


SUPPORTED = ("http(s)://HOST[:PORT] (a tracking server), sqlite:///PATH.db, postgresql://, mysql:// or mssql:// (a "
             "database; +DRIVER allowed), file:///DIR or a directory path, databricks")


@pytest.mark.parametrize("uri", ["ftp://x", "localhost:5000", "http://", "sqlite://mlflow.db"])
def test_a_malformed_uri_names_its_variable_and_the_stores_supported(monkeypatch, capsys, uri) -> None:
    """Refused in one line before any stage work, not reported as a server that is down in a message cut short."""
    from eagle3ops.cli import main
    from eagle3ops.errors import InputError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(InputError) as refused:
        tracking_uri(Config())
    assert str(refused.value).startswith(f"MLFLOW_TRACKING_URI {uri!r}: ")
    assert str(refused.value).endswith(f"; supported: {SUPPORTED}")
    with pytest.raises(InputError), stage_run(Config(), "eval", variant="scratch"):
        pass
    assert not Path(".eagle3ops").exists()  # nothing recorded offline for a store that can never be reached

    assert main(["sync"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"eagle3ops sync: error: {refused.value}"


def test_a_malformed_uri_in_the_params_or_on_the_command_line_is_named_so(monkeypatch, capsys) -> None:
    from eagle3ops.cli import main
    from eagle3ops.errors import InputError

    cfg = Config()
    cfg.mlflow.tracking_uri = "ftp://x"
    with pytest.raises(InputError, match=r"^params mlflow\.tracking_uri 'ftp://x': ftp:// is not a store MLflow records "
                                         r"runs in; supported: http\(s\)://"):
        tracking_uri(cfg)
    Path("params.yaml").write_text("mlflow:\n  tracking_uri: ftp://x\n")
    assert main(["sync"]) == 1
    assert capsys.readouterr().err == (f"eagle3ops sync: error: params mlflow.tracking_uri 'ftp://x': ftp:// is not a "
                                       f"store MLflow records runs in; supported: {SUPPORTED}\n")
    for command in (["sync"], ["compare", "--runs", "a", "b"], ["project", "--run", "a", "--samples", "10", "--to", "h200"]):
        assert main([*command[:1], "--tracking-uri", "ftp://u:secret@x", *command[1:]]) == 1, command
        assert capsys.readouterr().err == (f"eagle3ops {command[0]}: error: --tracking-uri 'ftp://u:***@x': ftp:// is "
                                           f"not a store MLflow records runs in; supported: {SUPPORTED}\n")


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "sqlite:////srv/mlflow.db", "http://127.0.0.1:5000",
                                 "https://mlflow.example.com/", "postgresql+psycopg://mlflow:pw@db:5432/mlflow",
                                 "mysql://db/mlflow", "file:///srv/mlruns", "mlruns", "/srv/runs:v2", "databricks"])
def test_the_stores_mlflow_records_in_are_taken_as_given(monkeypatch, uri) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert tracking_uri(Config()) == uri


def test_a_copied_store_is_refused_before_it_writes_into_the_original(tmp_path):
    """A repository copied with its mlflow.db: the experiment's artifact location is still the original's mlruns/,
    where the copy's runs would silently write. The copy's first stage refuses, naming both and the way out."""
    import shutil

    from mlflow import MlflowClient

    from eagle3ops.errors import InputError
    from eagle3ops.tracking.store import find_or_create_experiment

    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    first = find_or_create_experiment(MlflowClient(default_uri(original)), "eagle3ops",
                                      (original / "mlruns").as_uri())
    assert find_or_create_experiment(MlflowClient(default_uri(original)), "eagle3ops",
                                     (original / "mlruns").as_uri()) == first  # its own checkout: found as it is
    shutil.copytree(original, copy)
    with pytest.raises(InputError) as refused:
        find_or_create_experiment(MlflowClient(default_uri(copy)), "eagle3ops", (copy / "mlruns").as_uri())
    message = str(refused.value)
    assert message.startswith(f"{copy}/mlflow.db: experiment 'eagle3ops' keeps its artifacts in "
                              f"{(original / 'mlruns').as_uri()}, not in this repository's")
    assert "mv mlflow.db mlflow.db.copied" in message


@pytest.mark.parametrize("arguments, goes_on", [
    (("repro",), True), (("exp", "run", "-n", "lr", "-S", "train.lr=1e-3"), True), (("exp", "exec-run"), True),
    (("repro", "train@scratch"), False), (("repro", "dvc.yaml:eval"), False), (("repro", "-s", "x"), False),
    (("repro", "--single-item", "export"), False)])
def test_a_whole_pipeline_invocation_runs_on_to_the_report(arguments, goes_on, monkeypatch):
    from eagle3ops.tracking import run

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(run, "_dvc_process", lambda: FakeDvc(*arguments))
    assert run._runs_on_to_the_report("train", root) is goes_on
    assert run._runs_on_to_the_report("report", root) is False  # the last stage
    monkeypatch.setattr(run, "_dvc_process", lambda: None)
    assert run._runs_on_to_the_report("train", root) is False  # started by hand


def test_the_pipeline_run_is_running_until_its_report_and_failed_when_a_stage_fails(tmp_path, monkeypatch):
    """Under `dvc exp run`: RUNNING while a stage runs and between stages, FINISHED after the report; a stage
    that fails marks the pipeline run FAILED."""
    import shutil

    from eagle3ops.tracking import run

    shutil.copy(Path(__file__).resolve().parents[1] / "dvc.yaml", tmp_path / "dvc.yaml")
    store = MlflowClient(isolate(monkeypatch, tmp_path))
    monkeypatch.setattr(run, "_dvc_process", lambda: FakeDvc("exp", "run", "-n", "whole"))
    cfg = Config()
    cfg.mlflow.system_metrics = False

    def status(key: str) -> str:
        (parent,) = store.search_runs([store.get_experiment_by_name("eagle3ops").experiment_id],
                                      f"tags.`eagle3ops.role` = 'pipeline' and tags.`eagle3ops.pipeline_key` = '{key}'")
        return parent.info.status

    monkeypatch.setenv("DVC_EXP_NAME", "whole")
    with stage_run(cfg, "train", "scratch"):
        assert status("whole") == "RUNNING"
    assert status("whole") == "RUNNING"  # the report is still to come
    with stage_run(cfg, "report"):
        assert status("whole") == "RUNNING"
    assert status("whole") == "FINISHED"

    monkeypatch.setenv("DVC_EXP_NAME", "broken")
    with pytest.raises(RuntimeError), stage_run(cfg, "train", "scratch"):
        raise RuntimeError("out of memory")
    assert status("broken") == "FAILED"


def test_the_description_fetches_the_figure_from_the_runs_artifacts():
    from eagle3ops.reporting.summary import described_in_mlflow

    report = "## tau per set\n\n![tau by set](tau_by_set.png)\n\n## Stage timings\n"
    assert described_in_mlflow(report, "abc123") == (
        "## tau per set\n\n![tau by set](get-artifact?path=report/tau_by_set.png&run_uuid=abc123)\n\n## Stage timings\n")
    assert described_in_mlflow(report, None) == "## tau per set\n\n\n## Stage timings\n"  # recorded offline


def test_the_descriptions_table_cells_are_padded():
    from eagle3ops.reporting.summary import described_in_mlflow

    table = "text | with a bar\n| drafter   |   tau |\n|:----------|------:|\n| baseline  | 1.107 |\n"
    assert described_in_mlflow(table, "abc123") == (
        "text | with a bar\n|&nbsp;drafter&nbsp;|&nbsp;tau&nbsp;|\n|:----------|------:|\n"
        "|&nbsp;baseline&nbsp;|&nbsp;1.107&nbsp;|\n")
    long = table + "| warm_start | 1.107 |\n" * 300  # padded, past MLflow's 8,000 characters: as it is
    assert described_in_mlflow(long, "abc123") == long


@pytest.mark.processes
def test_a_drafter_edited_through_its_cache_link_is_refused_before_anything_is_recorded(tmp_path: Path) -> None:
    """With the project's cache.type a tracked output is a hardlink of DVC's cache object: flipping bytes in it
    changed the only cached copy, and `eagle3ops eval` measured and recorded the edited weights as the drafter's.
    A stage holds what it reads to the md5s dvc.lock and DVC's listing record; a one-off run is marked instead.
    Starts `git init`, `dvc init` and `dvc add` (a few seconds)."""
    from eagle3ops.errors import InputError
    from eagle3ops.tracking.lineage import changed_inputs, input_md5s
    from eagle3ops.tracking.run import ONE_OFF

    drafter = tmp_path / "models" / "drafters" / "scratch"
    drafter.mkdir(parents=True)
    (drafter / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (drafter / "config.json").write_text("{}")
    for command in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "config", "cache.type", "hardlink,symlink,copy"],
                    ["dvc", "add", "-q", "models/drafters/scratch"]):
        subprocess.run(command, cwd=tmp_path, check=True, capture_output=True)
    md5 = (tmp_path / "models" / "drafters" / "scratch.dvc").read_text().split("md5: ")[1].split()[0]
    (tmp_path / "dvc.lock").write_text(f"schema: '2.0'\nstages:\n  train@scratch:\n    cmd: eagle3ops train scratch\n"
                                       f"    outs:\n    - path: models/drafters/scratch\n      md5: {md5}\n")
    inputs = ["models/drafters/scratch"]
    assert changed_inputs(input_md5s(inputs, tmp_path), tmp_path) == []
    weights = drafter / "model.safetensors"
    weights.chmod(0o644)  # what root never needed
    with weights.open("r+b") as handle:  # in place: through the hardlink into the cache
        handle.seek(100)
        handle.write(b"\xff" * 16)
    assert changed_inputs(input_md5s(inputs, tmp_path), tmp_path) == [
        "models/drafters/scratch/model.safetensors: its bytes are not the ones dvc.lock records "
        f"(md5 {json.loads((tmp_path / '.dvc' / 'cache' / 'files' / 'md5' / md5[:2] / md5[2:]).read_text())[1]['md5']})"]
    cfg = Config()
    with pytest.raises(InputError, match=r"(?s)inputs of eval@scratch are not the bytes dvc.lock records:.*"
                                         r"model\.safetensors.*dvc repro --force -s train@scratch.*nothing was measured"):
        with stage_run(cfg, "eval", "scratch", inputs=inputs):
            pytest.fail("the stage ran")
    assert not (tmp_path / "mlflow.db").exists() or not client(cfg).search_runs(
        [e.experiment_id for e in client(cfg).search_experiments()])
    token = ONE_OFF.set("--set eval.k=2")
    try:
        with stage_run(cfg, "eval", "scratch", inputs=inputs) as one_off:
            pass
    finally:
        ONE_OFF.reset(token)
    assert "model.safetensors" in get_run(cfg, one_off.run_id).data.tags["eagle3ops.inputs_unrecorded"]
