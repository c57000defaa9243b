"""A tracking server that is down, or goes down mid-run, costs a stage nothing: `eagle3ops sync` uploads later.

Uses a real `mlflow server` on loopback, stopped and started again by the tests.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from eagle3ops.cli import main
from eagle3ops.config import Config
from eagle3ops.serving.server import free_port
from eagle3ops.tracking.outbox import pending
from eagle3ops.tracking.run import stage_run
from helpers import isolate, wait_for_http


class Server:
    def __init__(self, root: Path, port: int):
        self.root, self.port, self.process = root, port, None
        self.uri = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_http(f"{self.uri}/health", self.process)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def quiet_config() -> Config:
    """The defaults without system metrics or model registration: what these tests upload stays small."""
    cfg = Config()
    cfg.mlflow.system_metrics, cfg.mlflow.registered_model = False, None
    return cfg


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    server = Server(tmp_path, free_port())
    isolate(monkeypatch, tmp_path, server.uri)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    yield tmp_path, server, quiet_config()
    if server.process and server.process.poll() is None:
        server.stop()


def runs_with_role(client: MlflowClient, role: str) -> list:
    """The runs of the eagle3ops experiment in one role: stage, or pipeline (their parents)."""
    return client.search_runs([client.get_experiment_by_name("eagle3ops").experiment_id],
                              f"tags.`eagle3ops.role` = '{role}'")


@pytest.mark.service
def test_server_down_from_the_start(workspace, capsys):
    root, server, cfg = workspace
    with stage_run(cfg, "eval", variant="scratch") as run:  # nobody listens on the port yet
        run.log_metrics({"tau": 3.25})
        run.log_artifact(root / "drafter", "drafter")
    assert "MLflow unreachable" in capsys.readouterr().err
    (entry,) = pending(root)

    server.start()
    assert main(["sync", "--tracking-uri", server.uri]) == 0
    assert not pending(root)
    client = MlflowClient(server.uri)
    (run,) = runs_with_role(client, "stage")
    assert run.data.metrics["tau"] == 3.25 and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == str(cfg.train.lr)
    assert run.data.tags["mlflow.parentRunId"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "drafter")] == ["drafter/config.json"]
    assert "hardware.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.service
def test_a_temp_experiments_runs_wait_in_the_repositorys_outbox(workspace, monkeypatch):
    """`dvc exp run --temp` runs the stages in a copy under <repo>/.dvc/tmp/exps/ that DVC deletes once it ends: a
    run the server could not take waits in the repository's outbox, its files there still after the copy is gone."""
    root, server, cfg = workspace
    copy = root / ".dvc" / "tmp" / "exps" / "tmpq8k2"
    (copy / "drafter").mkdir(parents=True)
    (copy / "drafter" / "config.json").write_text('{"copy": true}')
    (copy / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(copy)
    monkeypatch.setenv("DVC_ROOT", str(root))
    with stage_run(cfg, "train", variant="scratch") as run:
        run.log_metrics({"train/loss": 1.5})
        run.log_artifact(copy / "drafter", "drafter")
    assert not (copy / ".eagle3ops").exists()
    shutil.rmtree(copy)

    monkeypatch.chdir(root)
    (entry,) = pending(root)
    server.start()
    assert main(["sync", "--tracking-uri", server.uri]) == 0
    assert not pending(root)
    client = MlflowClient(server.uri)
    (run,) = runs_with_role(client, "stage")
    assert run.data.metrics["train/loss"] == 1.5
    local = client.download_artifacts(run.info.run_id, "drafter/config.json", str(root))
    assert json.loads(Path(local).read_text()) == {"copy": True}


@pytest.mark.service
def test_a_pipeline_run_on_past_a_failed_stage_ends_finished_once_synced(workspace, monkeypatch):
    """As online: a stage that fails marks the pipeline run FAILED, and the pipeline run on past it (the failed
    stage fixed and run again, on to the report) ends FINISHED; a failed stage synced after the report (a record
    from an earlier attempt, carried late) does not mark it FAILED again."""
    root, server, cfg = workspace
    monkeypatch.setenv("DVC_EXP_NAME", "again")
    with pytest.raises(RuntimeError), stage_run(cfg, "generate"):
        raise RuntimeError("pad token")
    (failed,) = pending(root)
    late = root / "late-entry"
    shutil.copytree(failed, late)
    server.start()
    client = MlflowClient(server.uri)

    def pipeline_status() -> str:
        (parent,) = runs_with_role(client, "pipeline")
        return parent.info.status

    assert main(["sync", "--tracking-uri", server.uri]) == 0
    assert pipeline_status() == "FAILED"
    server.stop()
    for stage in ("generate", "report"):
        with stage_run(cfg, stage):
            pass
    server.start()
    assert main(["sync", "--tracking-uri", server.uri]) == 0
    assert pipeline_status() == "FINISHED"
    shutil.move(late, pending_dir := root / ".eagle3ops" / "outbox" / late.name)
    record = json.loads((pending_dir / "run.json").read_text())
    record["run_id"] = None  # an earlier attempt's record, never uploaded
    (pending_dir / "run.json").write_text(json.dumps(record))
    assert main(["sync", "--tracking-uri", server.uri]) == 0
    assert pipeline_status() == "FINISHED"


RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def synced_records(results: Path, tmp_path: Path, monkeypatch) -> tuple[MlflowClient, object]:
    """A packed GPU run's outbox (results/outbox) loaded as its README says, into a fresh store: every record
    uploads; (the store's client, the pipeline run)."""
    uri = isolate(monkeypatch, tmp_path)
    shutil.copytree(results / "outbox", tmp_path / ".eagle3ops" / "outbox")
    assert main(["sync"]) == 0
    assert not pending(tmp_path)
    client = MlflowClient(uri)
    (parent,) = runs_with_role(client, "pipeline")
    return client, parent


def test_the_committed_h200_records_load_with_sync(tmp_path, monkeypatch):
    """The SmolLM2 run on the H200 (bench/results/smollm2-h200/), loaded as its README says: every record
    uploads, and the pipeline run carries the report's tau; the failed first generate stays a FAILED stage run."""
    results = RESULTS / "smollm2-h200" / "smollm2-h200"
    client, parent = synced_records(results, tmp_path, monkeypatch)
    reported = json.loads((results / "metrics.json").read_text())
    assert parent.info.run_name == "smollm2-h200" and parent.info.status == "FINISHED"
    assert {init: parent.data.metrics[f"tau/{init}"] for init in reported["tau"]} == reported["tau"]
    statuses = sorted(run.info.status for run in runs_with_role(client, "stage"))
    assert statuses == ["FAILED"] + ["FINISHED"] * 11


def test_the_committed_h100_records_load_with_sync(tmp_path, monkeypatch):
    """The H100 run to the train stages (bench/results/smollm2-h100/): seven stage runs upload, train@scratch twice
    (the first finished as the call's limit came), and the pipeline run ends as its last stage did; the drafters'
    held-out acc_0 is the metrics files'."""
    results = RESULTS / "smollm2-h100" / "smollm2-h200-2"
    client, parent = synced_records(results, tmp_path, monkeypatch)
    assert parent.info.run_name == "smollm2-h200-2" and parent.info.status == "FINISHED"
    stages = runs_with_role(client, "stage")
    assert sorted(run.info.run_name.split(" ")[0] for run in stages) == [
        "extract@offline", "generate", "prepare", "train@scratch", "train@scratch", "train@warm_start", "zoo"]
    assert {run.data.tags["hardware.gpu_models"] for run in stages} == {"NVIDIA H100 80GB HBM3"}
    for init in ("scratch", "warm_start"):
        recorded = json.loads((results / "metrics" / f"train-{init}.json").read_text())
        latest = max((run for run in stages if run.info.run_name.startswith(f"train@{init} ")),
                     key=lambda run: run.info.start_time)
        assert latest.data.metrics["eval/acc_0"] == pytest.approx(recorded["eval/acc_0"], abs=5e-5)  # the file rounds


def free_port_naming_401() -> int:
    for port in range(40100, 40200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port in 40100-40199")


def test_a_refused_connection_is_unreachable_even_when_its_port_names_401(tmp_path, monkeypatch, capsys):
    # The refused connection's message names the port: "401" in it must not read as refused credentials.
    isolate(monkeypatch, tmp_path, f"http://127.0.0.1:{free_port_naming_401()}")
    with stage_run(quiet_config(), "eval", variant="scratch") as run:
        run.log_metrics({"tau": 3.25})
    err = capsys.readouterr().err
    assert "MLflow unreachable" in err and "refused the credentials" not in err
    assert len(pending(tmp_path)) == 1


@pytest.mark.service
def test_server_goes_down_mid_run(workspace):
    root, server, cfg = workspace
    server.start()
    with stage_run(cfg, "train", variant="scratch") as run:
        run.log_metrics({"train/loss": 2.0}, step=1)
        server.stop()
        run.log_metrics({"train/loss": 1.0}, step=2)  # the stage goes on
        run.log_artifact(root / "drafter", "drafter")
        run_id = run.run_id
    assert len(pending(root)) == 1

    server.start()
    assert main(["sync", "--tracking-uri", server.uri]) == 0
    client = MlflowClient(server.uri)
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 2.0), (2, 1.0)]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.list_artifacts(run_id, "drafter")


@pytest.mark.service
def test_a_drafter_trained_and_evaluated_offline_is_logged_and_registered_by_sync(workspace):
    from test_registry import MEASURED, NAME, evaluated, trained

    root, server, cfg = workspace
    sha = trained(root, cfg, "scratch", 0)  # nobody listens yet: both runs go to the outbox
    evaluated(cfg, sha, 2.5)
    assert len(pending(root)) == 2

    server.start()
    assert main(["sync", "--tracking-uri", server.uri]) == 0
    client = MlflowClient(server.uri)
    (model,) = client.search_logged_models([client.get_experiment_by_name("eagle3ops").experiment_id])
    assert {f.path for f in client.list_logged_model_artifacts(model.model_id)} == {"config.json", "model.safetensors"}
    assert {m.key: m.value for m in model.metrics} == {"tau": 2.5, "tau/gsm8k": 2.6}
    version = client.get_model_version_by_alias(NAME, "champion")
    assert version.source == f"models:/{model.model_id}" and MEASURED.target in version.description


@pytest.mark.service
def test_records_carried_without_the_drafter_weights_upload_all_but_the_model(workspace, capsys):
    """Records brought from a machine that kept the weights to itself (bench/gpu_pipeline.sh packs them so): every
    run, metric and artifact is uploaded; the model is not logged, nor registered, and sync says why."""
    import shutil

    from test_registry import evaluated, trained

    root, server, cfg = workspace
    sha = trained(root, cfg, "scratch", 0)
    evaluated(cfg, sha, 2.5)
    train_entry, eval_entry = pending(root)
    shutil.rmtree(train_entry / "files" / "model")
    train_record = json.loads((train_entry / "run.json").read_text())
    eval_record = json.loads((eval_entry / "run.json").read_text())
    for key in ("start_time", "end_time"):  # as an older eagle3ops wrote it: the times come from its metrics
        del eval_record[key]
    (eval_entry / "run.json").write_text(json.dumps(eval_record))
    time.sleep(1.1)  # a sync a moment later must not move the runs' times to its own

    server.start()
    assert main(["sync", "--tracking-uri", server.uri]) == 0
    err = capsys.readouterr().err
    assert f"{train_entry.name}: the drafter's weights did not come with the record" in err
    assert "its drafter is not registered" in err
    assert not pending(root)
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("eagle3ops").experiment_id
    runs = client.search_runs([experiment], "tags.`eagle3ops.role` = 'stage'")
    assert sorted(r.data.tags["eagle3ops.dvc_stage"] for r in runs) == ["eval@scratch", "train@scratch"]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags["eagle3ops.dvc_stage"]: r.data.metrics.get("tau") for r in runs}["eval@scratch"] == 2.5
    assert not client.search_logged_models([experiment])
    by_stage = {r.data.tags["eagle3ops.dvc_stage"]: r.info for r in runs}
    assert (by_stage["train@scratch"].start_time, by_stage["train@scratch"].end_time) == (
        train_record["start_time"], train_record["end_time"])
    wall = next(value for key, value, _, _ in eval_record["metrics"] if key == "time/stage_wall_s")
    last = max(stamp for _, _, stamp, _ in eval_record["metrics"])
    assert (by_stage["eval@scratch"].start_time, by_stage["eval@scratch"].end_time) == (int(last - wall * 1000), last)
    parent = client.get_run(runs[0].data.tags["mlflow.parentRunId"]).info
    assert parent.start_time == train_record["start_time"] and parent.end_time == last  # its first and last stage


# ----------------------------------------------------------------------------------- damaged entries (sqlite store)
# Entries written by the Outbox itself, as a stage that never reached its server leaves them, then synced into a
# local sqlite store: no server needed.

def offline_entry(root: Path, name: str, tau: float, finished: bool = True, model: Path | None = None) -> Path:
    """An outbox entry of a stage run recorded offline from the start, renamed `name` (entries sync in name order),
    with a metric, a directory artifact, hardware.json and, given its directory, a drafter to log."""
    from eagle3ops.tracking.outbox import Outbox

    box = Outbox(root, {"experiment": "eagle3ops", "pipeline_key": "k1", "parent_name": "pipeline t",
                        "parent_tags": {"eagle3ops.pipeline_key": "k1"}, "run_name": f"eval@scratch · {name}",
                        "tags": {"eagle3ops.stage": "eval", "eagle3ops.role": "stage"}, "params": {"eval.k": "3"},
                        "start_time": int(time.time() * 1000), "run_id": None, "parent_id": None})
    box.metrics([Metric("tau", tau, int(time.time() * 1000), 0)])
    box.artifact(root / "drafter", "drafter")
    box.document("hardware.json", {"accelerator": "cpu"})
    if model is not None:
        box.model(model, "scratch", {"target": "t"}, {"eval.k": "3"})
    if finished:
        box.finish("FINISHED")
    return box.dir.rename(box.dir.parent / name)


def uploaded_taus(uri: str) -> list[float]:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("eagle3ops")
    runs = client.search_runs([experiment.experiment_id], "tags.`eagle3ops.role` = 'stage'") if experiment else []
    return sorted(run.data.metrics["tau"] for run in runs)


def contents(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


@pytest.fixture
def local(tmp_path, monkeypatch):
    uri = isolate(monkeypatch, tmp_path)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    return tmp_path, uri


def test_a_cut_short_record_is_set_aside_and_the_entries_around_it_upload(local, capsys):
    root, uri = local
    first, bad, last = (offline_entry(root, f"20260101-00000{i}-entry{i}", tau) for i, tau in enumerate((1.0, 2.0, 3.0)))
    text = (bad / "run.json").read_bytes()
    (bad / "run.json").write_bytes(text[: len(text) // 2])  # a disk that filled, a copy cut short
    before = contents(bad)

    assert main(["sync", "--tracking-uri", uri]) == 1
    out, err = capsys.readouterr()
    assert uploaded_taus(uri) == [1.0, 3.0]
    aside = root / ".eagle3ops" / "outbox-rejected" / bad.name
    assert contents(aside) == before and not bad.exists()  # moved whole, nothing rewritten
    (line,) = [line for line in err.splitlines() if "skipped" in line]
    assert line.startswith(f"eagle3ops sync: skipped .eagle3ops/outbox/{bad.name}/run.json: not valid JSON, cut short")
    assert line.endswith(f"set aside, whole, in .eagle3ops/outbox-rejected/{bad.name}/")
    assert out.strip().endswith("0 left in the outbox; 1 damaged entry skipped, set aside whole in "
                                ".eagle3ops/outbox-rejected/ (each named above): once fixed, `mv "
                                ".eagle3ops/outbox-rejected/ENTRY .eagle3ops/outbox/` and run `eagle3ops sync` again")
    assert not pending(root)

    assert main(["sync", "--tracking-uri", uri]) == 0  # not tried again, nothing uploaded twice
    out, err = capsys.readouterr()
    assert "skipped" not in err and out.startswith("uploaded 0 run(s)")
    assert uploaded_taus(uri) == [1.0, 3.0] and contents(aside) == before

    (aside / "run.json").write_bytes(text)  # fixed, and moved back as the summary says
    aside.rename(root / ".eagle3ops" / "outbox" / bad.name)
    assert main(["sync", "--tracking-uri", uri]) == 0
    assert uploaded_taus(uri) == [1.0, 2.0, 3.0]


def _no_record(entry: Path) -> None:
    (entry / "run.json").unlink()
    os.utime(entry, (time.time() - 3600, time.time() - 3600))  # not one a stage is creating now


def _artifact_gone(entry: Path) -> None:
    shutil.rmtree(entry / "files" / "0")


def _document_cut(entry: Path) -> None:
    (entry / "files" / "1" / "hardware.json").write_text('{"accelerator": "c')


def _weights_cut(entry: Path) -> None:
    weights = entry / "files" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])


def _metric_garbled(entry: Path) -> None:
    record = json.loads((entry / "run.json").read_text())
    record["metrics"][0][1] = "high"
    (entry / "run.json").write_text(json.dumps(record))


@pytest.mark.parametrize("damage, file, what", [
    (_no_record, "run.json", "missing: the entry holds no record of its run"),
    (_artifact_gone, "files/0/drafter", "missing (artifact 0 in run.json)"),
    (_document_cut, "files/1/hardware.json", "not valid JSON, cut short or garbled"),
    (_weights_cut, "files/model/model.safetensors", "cut short or padded: its header says"),
    (_metric_garbled, "run.json", 'metric 0 is ["tau", "high", '),
])
def test_each_kind_of_damage_is_named_and_set_aside(local, capsys, damage, file, what):
    from safetensors.numpy import save_file

    root, uri = local
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(model / "model.safetensors"))
    good = offline_entry(root, "20260101-000000-good", 1.0)
    bad = offline_entry(root, "20260101-000001-bad", 2.0, model=model)
    damage(bad)

    assert main(["sync", "--tracking-uri", uri]) == 1
    err = capsys.readouterr().err
    assert f"eagle3ops sync: skipped .eagle3ops/outbox/{bad.name}/{file}: {what}" in err
    assert (root / ".eagle3ops" / "outbox-rejected" / bad.name).is_dir() and not good.exists()
    assert uploaded_taus(uri) == [1.0]


def test_an_entry_its_stage_is_still_writing_is_left_alone(local, capsys):
    root, uri = local
    offline_entry(root, "20260101-000000-done", 1.0)
    running = offline_entry(root, "20260101-000001-running", 2.0, finished=False)
    shutil.rmtree(running / "files" / "0")  # what it names may not all be there yet: still not damaged
    creating = root / ".eagle3ops" / "outbox" / "20260101-000002-new"
    creating.mkdir()  # a stage between making its entry and writing its record

    assert main(["sync", "--tracking-uri", uri]) == 0
    out, err = capsys.readouterr()
    assert "skipped" not in err and out.strip().endswith("2 left in the outbox")
    assert pending(root) == [running, creating]
    assert json.loads((running / "run.json").read_text())["status"] == "RUNNING"
    assert not (root / ".eagle3ops" / "outbox-rejected").exists()
    assert uploaded_taus(uri) == [1.0]


def test_a_full_disk_while_an_artifact_is_copied_into_the_outbox_is_one_line(tmp_path, monkeypatch):
    """The copy (hard links where it can) runs out of space: one line naming the entry's file, the partial copy
    removed, the record still readable."""
    import errno

    from eagle3ops import fs
    from eagle3ops.tracking import outbox as outbox_module

    def full(source, destination):
        Path(destination).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outbox_module, "link_or_copy", full)
    box = outbox_module.Outbox(tmp_path, {"params": {}, "tags": {}})
    (tmp_path / "hardware.json").write_text("{}")
    with pytest.raises(fs.DiskFullError, match=r"disk full writing .*hardware\.json into the outbox \(\d+ MiB free\); "
                                               r"the stage's own outputs are written"):
        box.artifact(tmp_path / "hardware.json", None)
    assert not [p for p in box.dir.rglob("hardware.json")]  # the partial copy removed
    assert json.loads((box.dir / "run.json").read_text())["artifacts"] == []


def test_a_server_that_did_not_answer_is_not_asked_again_in_the_same_pipeline_run(tmp_path, monkeypatch, capsys):
    """A server that accepts and never answers cost each stage a minute of timeouts before the outbox took over:
    the first stage of a pipeline run notes it, the later ones go straight to the outbox; another pipeline run
    (other params) asks again."""
    isolate(monkeypatch, tmp_path, f"http://127.0.0.1:{free_port()}")  # nobody listens
    cfg = quiet_config()
    with stage_run(cfg, "prepare"):
        pass
    assert "MLflow unreachable" in capsys.readouterr().err
    def asked(*args, **kwargs):
        raise AssertionError("the server was asked again")

    with monkeypatch.context() as patch:
        patch.setattr("eagle3ops.tracking.run.find_or_create_experiment", asked)
        with stage_run(cfg, "eval", variant="scratch") as later:
            later.log_metrics({"tau": 3.25})
    err = capsys.readouterr().err
    assert "did not answer an earlier stage of this pipeline run" in err and later.outbox is not None
    cfg.seed = 1  # another pipeline run
    with stage_run(cfg, "prepare"):
        pass
    assert "did not answer an earlier stage" not in capsys.readouterr().err
    assert len(pending(tmp_path)) == 3
    from eagle3ops.reporting.summary import markdown

    summary = markdown({}, "http://tracking.example:5000", offline=True)
    assert "http://tracking.example:5000 did not answer this pipeline run" in summary and "open http" not in summary
