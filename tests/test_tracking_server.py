"""The team tracking server for real: a PostgreSQL cluster (initdb'd in a temporary directory, run as an unprivileged
user, password authentication on), `eagle3ops tracking-server` (mlflow server with basic auth) against it, and the
micro pipeline's `dvc repro` logging to it with a user's credentials. The runs are read back through the REST API;
wrong credentials are refused; no password lands in a run, a file, or a command line.

Skipped only when PostgreSQL's binaries are absent (Debian: `apt-get install postgresql`, which the README's test
command runs).
"""
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import psutil
import psycopg2
import pytest
import requests
import yaml

from eagle3ops.cli import main
from eagle3ops.config import Config
from eagle3ops.serving.server import free_port
from eagle3ops.tracking.outbox import pending
from eagle3ops.tracking.run import stage_run
from eagle3ops.tracking.server import ServerOptions, server_command
from helpers import WITHOUT_ENGINE, commit, isolate, micro_pipeline_repo, ran_stages, run, wait_for_http, write_params

DB_ROLE, DB_NAME = "eagle3ops", "mlflow"
USER = "alice"
# Below the micro pipeline: what reaches the server (runs, params, curves, tau, drafters) needs no trained model.
FEWER_STEPS = ["zoo.predecessor_training.steps=10", "zoo.successor_training.steps=5",
               "zoo.drafter_training.max_steps=4", "train.max_steps=4", "train.log_every=1", "train.simulate.every=0",
               "generate.max_new_tokens=16", "eval.max_new_tokens=8", *WITHOUT_ENGINE]


def postgres_bin() -> Path | None:
    """The directory holding initdb, pg_ctl and createdb: on PATH, else Debian's /usr/lib/postgresql/<version>/bin
    (the package puts none of them on PATH), the newest version first."""
    on_path = shutil.which("pg_ctl")
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True,
                    key=lambda p: [int(part) for part in p.parent.name.split(".") if part.isdigit()])
    candidates = ([Path(on_path).parent] if on_path else []) + debian
    return next((d for d in candidates if all((d / tool).exists() for tool in ("initdb", "pg_ctl", "createdb"))), None)


def unprivileged(cmd: list) -> list[str]:
    """PostgreSQL refuses to run as root: under root, run it as the `postgres` user Debian's package creates."""
    cmd = [str(part) for part in cmd]
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@dataclass
class Postgres:
    port: int
    password: str

    @property
    def uri(self) -> str:
        return f"postgresql://{DB_ROLE}:{self.password}@127.0.0.1:{self.port}/{DB_NAME}"

    def query(self, sql: str) -> list[tuple]:
        with closing(psycopg2.connect(host="127.0.0.1", port=self.port, user=DB_ROLE, password=self.password,
                                      dbname=DB_NAME)) as connection, connection.cursor() as cursor:
            cursor.execute(sql)
            return cursor.fetchall()


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    tools = postgres_bin()
    if tools is None:
        pytest.skip("PostgreSQL is not installed (no initdb/pg_ctl on PATH or in /usr/lib/postgresql/*/bin); "
                    "Debian: apt-get install postgresql")
    # Not under pytest's tmp_path: its root-owned 0700 parents would lock the postgres user out.
    home = Path(tempfile.mkdtemp(prefix="eagle3ops-pg-"))
    db = Postgres(free_port(), secrets.token_urlsafe(16))
    (home / "pwfile").write_text(db.password)
    if os.geteuid() == 0:
        for path in (home, home / "pwfile"):
            shutil.chown(path, "postgres")
    data = home / "data"
    try:
        run(unprivileged([tools / "initdb", "-D", data, "-U", DB_ROLE, "--auth=scram-sha-256",
                          f"--pwfile={home / 'pwfile'}", "--no-locale", "-E", "UTF8", "--no-sync"]), home)
        (home / "pwfile").unlink()
        run(unprivileged([tools / "pg_ctl", "-D", data, "-l", home / "postgres.log", "-w", "-t", "60", "start",
                          "-o", f"-p {db.port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off"]), home)
        run([str(tools / "createdb"), "-h", "127.0.0.1", "-p", str(db.port), "-U", DB_ROLE, DB_NAME], home,
            {"PGPASSWORD": db.password})
        yield db
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(unprivileged([tools / "pg_ctl", "-D", data, "-m", "fast", "-w", "stop"]), check=False,
                           capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


@dataclass
class TeamServer:
    url: str
    state: Path
    admin_password: str
    process: subprocess.Popen

    def post(self, endpoint: str, body: dict, auth: tuple[str, str] | None) -> requests.Response:
        return requests.post(f"{self.url}/api/2.0/mlflow/{endpoint}", json=body, auth=auth, timeout=60)

    def get(self, endpoint: str, params: dict, auth: tuple[str, str] | None) -> requests.Response:
        return requests.get(f"{self.url}/api/2.0/mlflow/{endpoint}", params=params, auth=auth, timeout=60)

    @property
    def admin(self) -> tuple[str, str]:
        return ("admin", self.admin_password)


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory) -> Iterator[TeamServer]:
    """`eagle3ops tracking-server` as the README starts it: everything it needs from the environment."""
    state = tmp_path_factory.mktemp("tracking-server")
    port, admin_password = free_port(), secrets.token_urlsafe(16)
    env = {**os.environ, "EAGLE3OPS_DB_URI": postgres.uri, "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
           "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # GenAI job runners: 8 idle processes on 2 cores
    with open(state / "server.log", "wb") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "eagle3ops"), "tracking-server", "--port", str(port),
             "--workers", "1", "--state-dir", str(state)],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        try:
            wait_for_http(f"http://127.0.0.1:{port}/health", process, timeout_s=180)
        except RuntimeError as err:
            raise RuntimeError(f"{err}\n{(state / 'server.log').read_text()[-4000:]}") from None
        yield TeamServer(f"http://127.0.0.1:{port}", state, admin_password, process)
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # its own session: the server and its workers
        try:
            process.wait(timeout=60)
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # whatever of that session outlived the server
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def alice(server) -> tuple[str, str]:
    """A team member's account, created by the admin (the default permission lets her log to shared experiments)."""
    credentials = (USER, secrets.token_urlsafe(16))
    created = server.post("users/create", {"username": USER, "password": credentials[1]}, server.admin)
    assert created.status_code == 200, created.text
    return credentials


@pytest.fixture(scope="module")
def pipeline(server, alice, tmp_path_factory) -> tuple[Path, str]:
    """The micro pipeline run once, logging to the team server as alice: (repository, dvc's output)."""
    repo = micro_pipeline_repo(tmp_path_factory.mktemp("team-server") / "repo")
    write_params(repo, FEWER_STEPS)
    commit(repo, "fewer steps")
    output = run(["dvc", "repro"], repo, {"MLFLOW_TRACKING_URI": server.url, "MLFLOW_TRACKING_USERNAME": alice[0],
                                          "MLFLOW_TRACKING_PASSWORD": alice[1]})
    return repo, output


def search_runs(server: TeamServer, auth, experiment_id: str, query: str = "") -> list[dict]:
    found = server.post("runs/search", {"experiment_ids": [experiment_id], "filter": query, "max_results": 1000},
                        auth)
    assert found.status_code == 200, found.text
    return found.json().get("runs", [])


def values(run: dict, kind: str) -> dict[str, str]:
    return {item["key"]: item["value"] for item in run["data"].get(kind, [])}


@pytest.mark.service
@pytest.mark.pipeline
def test_the_pipeline_logs_to_the_team_server(pipeline, server, alice, postgres):
    repo, output = pipeline
    assert not pending(repo) and "MLflow unreachable" not in output  # nothing fell back to the outbox
    experiment = server.get("experiments/get-by-name", {"experiment_name": "eagle3ops"}, alice)
    assert experiment.status_code == 200, experiment.text
    experiment_id = experiment.json()["experiment"]["experiment_id"]

    (parent,) = search_runs(server, alice, experiment_id, "tags.`eagle3ops.role` = 'pipeline'")
    stages = {values(r, "tags")["eagle3ops.dvc_stage"]: r
              for r in search_runs(server, alice, experiment_id, "tags.`eagle3ops.role` = 'stage'")}
    assert sorted(stages) == sorted(ran_stages(output)) and "train@scratch" in stages
    for run_ in stages.values():
        assert run_["info"]["status"] == "FINISHED"
        assert values(run_, "tags")["mlflow.parentRunId"] == parent["info"]["run_id"]

    train = stages["train@scratch"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert float(values(train, "params")["train.lr"]) == params["train"]["lr"]
    assert values(train, "params")["train.max_steps"] == str(params["train"]["max_steps"])
    history = server.get("metrics/get-history", {"run_id": train["info"]["run_id"], "metric_key": "train/loss"}, alice)
    assert len(history.json()["metrics"]) >= 3
    for drafter in ("baseline", "scratch", "warm_start"):
        recorded = json.loads((repo / "metrics" / f"eval-{drafter}.json").read_text())["tau"]
        assert float(values(stages[f"eval@{drafter}"], "metrics")["tau"]) == pytest.approx(recorded)

    # Artifacts go through the server into its artifacts destination; runs and users are rows in PostgreSQL.
    models = server.post("logged-models/search", {"experiment_ids": [experiment_id]}, alice).json()["models"]
    assert sorted(m["info"]["name"] for m in models) == ["scratch", "warm_start"]  # the trained drafters
    assert {m["info"]["source_run_id"] for m in models} == {stages[f"train@{init}"]["info"]["run_id"]
                                                          for init in ("scratch", "warm_start")}
    assert sorted(p.name for p in (server.state / "artifacts").rglob("models/*/artifacts/*")) == [
        "config.json", "config.json", "model.safetensors", "model.safetensors"]  # no training state
    versions = server.get("model-versions/search", {"filter": "name = 'eagle3-drafter'"}, alice)
    assert len(versions.json()["model_versions"]) == 2
    assert postgres.query("select count(*) from runs")[0][0] == 1 + len(stages)
    assert postgres.query(f"select username from users where username = '{USER}'") == [(USER,)]


@pytest.mark.service
@pytest.mark.parametrize("who", ["nobody", "wrong password", "unknown user"])
def test_wrong_credentials_are_refused(server, alice, who):
    auth = {"nobody": None, "wrong password": (alice[0], alice[1] + "x"), "unknown user": ("mallory", alice[1])}[who]
    refused = server.get("experiments/get-by-name", {"experiment_name": "Default"}, auth)
    assert refused.status_code == 401
    assert server.get("experiments/get-by-name", {"experiment_name": "Default"}, alice).status_code == 200


@pytest.mark.service
@pytest.mark.pipeline
def test_no_password_is_recorded_anywhere(pipeline, server, alice, postgres):
    repo, _ = pipeline
    passwords = [alice[1], server.admin_password, postgres.password]
    experiments = server.post("experiments/search", {"max_results": 1000}, server.admin).json()["experiments"]
    runs = [r for e in experiments for r in search_runs(server, server.admin, e["experiment_id"])]
    assert len(runs) >= 12
    for run_ in runs:
        recorded = " ".join([*values(run_, "params").values(), *values(run_, "tags").values()])
        assert not any(password in recorded for password in passwords), run_["info"]["run_name"]
    # Files: the repository (params, metrics, reports, lineage), the server's state (auth config, log, artifacts).
    for path in [*repo.rglob("*"), *server.state.rglob("*")]:
        if path.is_file() and ".git" not in path.parts:
            data = path.read_bytes()
            assert not any(password.encode() in data for password in passwords), path
    # Command lines, which every user of the machine sees in `ps`: the database password went by PGPASSWORD.
    server_process = psutil.Process(server.process.pid)
    for process in [server_process, *server_process.children(recursive=True)]:
        assert postgres.password not in " ".join(process.cmdline()), process.cmdline()


@pytest.mark.service
def test_a_stage_refused_by_the_server_is_kept_for_sync(server, alice, tmp_path, monkeypatch, capsys):
    isolate(monkeypatch, tmp_path, server.url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", alice[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-her-password")
    cfg = Config()
    cfg.mlflow.system_metrics, cfg.mlflow.registered_model, cfg.mlflow.experiment = False, None, "refused"
    with stage_run(cfg, "eval", variant="scratch") as run_:
        run_.log_metrics({"tau": 2.5})
    err = capsys.readouterr().err
    assert "401" in err and "MLflow refused the credentials" in err and len(pending(tmp_path)) == 1

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", alice[1])
    assert main(["sync", "--tracking-uri", server.url]) == 0
    experiment = server.get("experiments/get-by-name", {"experiment_name": "refused"}, alice).json()["experiment"]
    (synced,) = search_runs(server, alice, experiment["experiment_id"], "tags.`eagle3ops.role` = 'stage'")
    assert values(synced, "metrics")["tau"] == 2.5 and not pending(tmp_path)


# The command's composition, without servers.

def test_the_database_password_goes_by_environment_only(tmp_path):
    options = ServerOptions(state_dir=tmp_path, port=5055, mlflow_args=("--allowed-hosts", "mlflow.example.com"))
    environ = {"EAGLE3OPS_DB_URI": "postgresql://team:p%40ss-word@db.internal:5433/mlflow",
               "MLFLOW_FLASK_SERVER_SECRET_KEY": "k", "PATH": "/usr/bin"}
    launch = server_command(options, environ)
    argv = launch.argv
    assert argv[argv.index("--backend-store-uri") + 1] == "postgresql+psycopg2://team@db.internal:5433/mlflow"
    assert argv[argv.index("--app-name") + 1] == "basic-auth"
    assert argv[argv.index("--artifacts-destination") + 1] == str(tmp_path / "artifacts")
    assert argv[-2:] == ["--allowed-hosts", "mlflow.example.com"]
    assert launch.env["PGPASSWORD"] == "p@ss-word" and "EAGLE3OPS_DB_URI" not in launch.env
    assert launch.env["MLFLOW_AUTH_CONFIG_PATH"] == str(tmp_path / "basic_auth.ini")
    assert "database_uri = postgresql+psycopg2://team@db.internal:5433/mlflow" in launch.auth_config_text
    assert "default_permission = EDIT" in launch.auth_config_text
    assert not any("p%40ss" in part or "p@ss" in part for part in [*argv, launch.auth_config_text])


@pytest.mark.parametrize("environ, named", [
    ({"MLFLOW_FLASK_SERVER_SECRET_KEY": "k"}, "EAGLE3OPS_DB_URI"),
    ({"MLFLOW_FLASK_SERVER_SECRET_KEY": "k", "EAGLE3OPS_DB_URI": "sqlite:///mlflow.db"}, "EAGLE3OPS_DB_URI"),
    ({"EAGLE3OPS_DB_URI": "postgresql://team@db/mlflow"}, "MLFLOW_FLASK_SERVER_SECRET_KEY"),
])
def test_refuses_to_start_without_what_it_needs(environ, named, monkeypatch, tmp_path, capsys):
    for name in ("EAGLE3OPS_DB_URI", "PGDATABASE", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(["tracking-server", "--state-dir", str(tmp_path)]) == 1
    assert named in capsys.readouterr().err
    assert not (tmp_path / "basic_auth.ini").exists()


def test_libpq_variables_name_the_database(tmp_path):
    launch = server_command(ServerOptions(state_dir=tmp_path),
                            {"PGDATABASE": "mlflow", "MLFLOW_FLASK_SERVER_SECRET_KEY": "k"})
    assert launch.db_uri == "postgresql+psycopg2:///mlflow" and launch.db_uri in launch.argv
