"""A tracking server that is down, or goes down mid-run, costs a stage nothing: `eagle3ops sync` uploads later.

Uses a real `mlflow server` on loopback, stopped and started again by the tests.
"""
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

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
    (run,) = client.search_runs([client.get_experiment_by_name("eagle3ops").experiment_id],
                                "tags.`eagle3ops.role` = 'stage'")
    assert run.data.metrics["tau"] == 3.25 and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == str(cfg.train.lr)
    assert run.data.tags["mlflow.parentRunId"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "drafter")] == ["drafter/config.json"]
    assert "hardware.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


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
