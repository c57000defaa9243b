"""What the tests share besides fixtures: tiny texts to train a tokenizer on, an isolated working directory, HTTP
waits and a loopback server, and the micro pipeline (the whole DVC lineage in minutes) in a temporary git
repository. Test modules import it by name (`from helpers import ...`); fixtures live in conftest.py."""
from __future__ import annotations

import fcntl
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from omegaconf import OmegaConf

# A few dozen short strings: enough for BPE to learn some merges, small enough to train in well under a second.
TEXTS = [
    f"{subject} {verb} the {thing} number {i}. Hello world, how are you today? The answer is {i * 7}."
    for i, (subject, verb, thing) in enumerate(
        (s, v, t)
        for s in ("The fox", "A user", "The assistant")
        for v in ("jumps over", "thinks about", "writes")
        for t in ("lazy dog", "question", "code")
    )
] + [
    "<think>Let me think step by step.</think> The result is 42.",
    "def add(a, b):\n    return a + b\n",
    "You are a helpful assistant. Answer briefly.",
    "system user assistant",
]


# What a stage reads from its environment: tests start without any of it from the outside.
OUTSIDE_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_RUN_ID",
               "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME")


def isolate(monkeypatch: pytest.MonkeyPatch, root: Path, tracking_uri: str | None = None) -> str:
    """Work in `root` with no DVC/MLflow variables from outside and a tracking store of its own
    (sqlite in `root`, as a fresh one, unless `tracking_uri` names one); returns the store's URI."""
    monkeypatch.chdir(root)
    for name in OUTSIDE_ENV:
        monkeypatch.delenv(name, raising=False)
    if tracking_uri is None:
        fresh_store(root / "mlflow.db")
    uri = tracking_uri or f"sqlite:///{root}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@functools.cache
def _empty_store() -> bytes:
    """An MLflow sqlite store as MLflow creates it, made once a process: creating one runs every schema migration
    (over a second each, in a suite that makes dozens)."""
    import sqlite3

    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory() as directory:
        MlflowClient(f"sqlite:///{directory}/mlflow.db").search_experiments()
        with sqlite3.connect(f"{directory}/mlflow.db") as db:
            db.execute("UPDATE experiments SET artifact_location = 'DEFAULT' WHERE experiment_id = 0")
        return Path(directory, "mlflow.db").read_bytes()


def fresh_store(path: Path) -> None:
    """A new, empty MLflow sqlite store at `path`, as MLflow would create it with `path`'s directory as the working
    directory (its Default experiment's artifacts under mlruns/0 there)."""
    import sqlite3

    if path.exists():
        return
    path.write_bytes(_empty_store())
    with sqlite3.connect(path) as db:
        db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                   (str(path.parent / "mlruns" / "0"),))



class FakeDvc:
    """The `dvc` process above a stage, as psutil shows it: its command line."""

    def __init__(self, *arguments: str) -> None:
        self.arguments = ["/venv/bin/python3.11", "/venv/bin/dvc", *arguments]

    def cmdline(self) -> list[str]:
        return self.arguments


def wait_for_http(url: str, server: subprocess.Popen | None = None, timeout_s: float = 120.0) -> None:
    """Poll `url` until it answers (any HTTP status); fail at once if `server`, the process meant to serve it,
    has exited, and after `timeout_s` otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {server.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


class InFlight:
    """The requests a test server holds at once (`most`). With `together=n` each request after the first `alone`
    waits until n have been held at once: a fixed sleep lets a loaded machine serve concurrent requests one after
    the other, and a test of bounded concurrency then fails by chance. A client that never sends n at once costs
    one `patience_s`, then the gate stays open."""

    def __init__(self, together: int = 1, alone: int = 0, patience_s: float = 10.0):
        self.together, self.alone, self.patience_s = together, alone, patience_s
        self.now = self.most = self.seen = 0
        self._changed = threading.Condition()

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._changed:
            self.seen += 1
            self.now += 1
            self.most = max(self.most, self.now)
            self._changed.notify_all()
            if self.seen > self.alone and not self._changed.wait_for(lambda: self.most >= self.together,
                                                                     timeout=self.patience_s):
                self.together = 0
                self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self.now -= 1


@contextmanager
def loopback_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 (a free port) answering with `handler`; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# The micro pipeline: the project's dvc.yaml on params small enough for the whole lineage to run in a few minutes
# on 2 cores (the built_pipeline fixture, tests/test_tracking_server.py).
ROOT = Path(__file__).resolve().parents[1]
MICRO = [
    "zoo.pretrain_conversations=400", "zoo.conversations=96", "zoo.eval_prompts_per_family=2",
    "zoo.drafter_conversations=64", "zoo.predecessor_training.steps=40", "zoo.successor_training.steps=20",
    "zoo.drafter_training.epochs=1", "zoo.drafter_training.max_steps=8", "generate.max_new_tokens=48",
    "train.epochs=1", "train.max_steps=12", "train.log_every=2", "eval.max_new_tokens=24",
    # AdamW: the online run is held to the offline one to 1e-6, and Muon orthogonalises each step in bf16, which
    # turns the two paths' float32 rounding into bf16's
    "train.optimizer=adamw",
    # 8 prompts of 24 tokens: about 150 verification steps, so one near-tie that vLLM's batching (8 requests in
    # flight, batched differently run to run) rounds the other way moves an a_i by 0.007
    "eval.engine_tolerance=0.1",
    # the engine sessions of two test workers' pipelines at once (each the target alone and with a drafter)
    "vllm.engines_kept=4",
]


def command_env(env: dict[str, str | None] | None = None) -> dict[str, str]:
    """The environment `run` gives a command: this venv first on PATH, no tracking URI from outside, then `env`
    (None removes a variable)."""
    full = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    full.pop("MLFLOW_TRACKING_URI", None)
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    return full


def run(cmd: list[str], cwd: Path, env: dict[str, str | None] | None = None, fail: bool = False,
        timeout_s: float = 1200) -> str:
    """Run `cmd` with this venv's `dvc` and `eagle3ops` first on PATH and no tracking URI from outside; `env`
    sets variables (None removes one). Returns stdout + stderr; the test fails unless it exits 0 (with `fail`:
    unless it fails), or with what it printed last when it runs past `timeout_s`."""
    try:
        done = subprocess.run(cmd, cwd=cwd, env=command_env(env), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as late:  # its streams are bytes here, whatever `text` says
        out, err = ((s.decode(errors="replace") if isinstance(s, bytes) else s or "") for s in (late.stdout, late.stderr))
        pytest.fail(f"{' '.join(cmd)} was still running after {timeout_s:.0f} s and was killed; the end of its "
                    f"stdout:\n{out[-4000:]}\nand of its stderr:\n{err[-4000:]}", pytrace=False)
    output = done.stdout + done.stderr
    assert (done.returncode != 0) == fail, f"{' '.join(cmd)} exited {done.returncode}:\n{output[-8000:]}"
    return output


def ran_stages(output: str) -> list[str]:
    """The stages a `dvc repro` / `dvc exp run` output says it ran, in order."""
    return re.findall(r"Running stage '([^']+)'", output)


# For suites about the lineage's tracking, not the engine (tests/test_tracking_server.py): no vLLM server in eval
# or export.
WITHOUT_ENGINE = ["eval.engine=null", "export.serve=false"]


def write_params(repo: Path, overrides: list[str]) -> None:
    params = OmegaConf.merge(OmegaConf.load(ROOT / "params.yaml"), OmegaConf.from_dotlist(MICRO + overrides))
    OmegaConf.save(params, repo / "params.yaml")


def commit(repo: Path, message: str) -> None:
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-q", "-m", message], repo)


def micro_pipeline_repo(repo: Path) -> Path:
    """A git + DVC repository at `repo` as a fresh clone of the project would be (src/, dvc.yaml, .gitignore and
    the tracked .dvc/config: default remote, cache link type, plots page; .dvc/plots/: the plots' template and
    page), with the micro params, committed; nothing run."""
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("dvc.yaml", ".gitignore"):
        shutil.copy(ROOT / name, repo / name)
    write_params(repo, [])
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    commit(repo, "micro pipeline")
    return repo


def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every test process of this run shares: the xdist workers' common parent, or pytest's own base
    directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(directory: Path, build: Callable[[Path], str]) -> tuple[Path, str]:
    """`build(directory / "repo")`, run by the first test process of the run that asks; the others wait for it
    under a file lock and read its output. A failed build fails each that asks, with its error, and is not
    retried. Returns (the repository, what `build` returned); nobody writes into it: tests work on copies
    (copy_workspace)."""
    directory.mkdir(parents=True, exist_ok=True)
    output, failed = directory / "output.txt", directory / "failed.txt"
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not output.exists() and not failed.exists():
            try:
                output.write_text(build(directory / "repo"))
            except BaseException as error:  # pytest.fail's exception too
                failed.write_text(str(error) or repr(error))
                raise
    if failed.exists():
        pytest.fail(f"building {directory / 'repo'} failed in another test process:\n{failed.read_text()}",
                    pytrace=False)
    return directory / "repo", output.read_text()


def copy_workspace(built: Path, repo: Path) -> Path:
    """A copy at `repo` of the project directory `built` (a pipeline's repository, a stage's workspace), as if it
    had run there: git, DVC's cache and its hardlinks into the workspace (`cp -a`), and the MLflow store
    (mlflow.db), whose paths (artifact locations, tags) are rewritten to the copy's. Outputs that quote where the
    pipeline ran (models/SERVING.md) keep `built`'s path, as DVC hashed them."""
    import sqlite3

    subprocess.run(["cp", "-a", str(built), str(repo)], check=True)
    old, new = str(built), str(repo)
    if not (repo / "mlflow.db").exists():
        return repo
    with sqlite3.connect(repo / "mlflow.db") as store:
        tables = [name for (name,) in store.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for _, column, kind, *_ in store.execute(f'PRAGMA table_info("{table}")').fetchall():
                if kind.upper().startswith(("VARCHAR", "TEXT")):
                    store.execute(f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) '
                                  f'WHERE instr("{column}", ?)', (old, new, old))
    return repo


# The micro pipeline's stages, as DVC names them and as the MLflow records name them
ALL_STAGES = ["zoo", "generate", "target_speed", "prepare", "extract@offline", "train@scratch", "train@warm_start",
              "eval@baseline",
              "eval@scratch", "eval@warm_start", "export", "report"]
RECORDED = sorted(stage.removesuffix("@offline") for stage in ALL_STAGES)


def lock_md5(repo: Path, stage: str, path: str) -> str:
    """The md5 dvc.lock records for `stage`'s output `path`."""
    import yaml

    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][stage]
    return next(out["md5"] for out in lock["outs"] if out["path"] == path)


def pipeline_store(repo: Path):
    """The MLflow client of a pipeline repository's own store (sqlite:///mlflow.db in it)."""
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")


def pipelines(repo: Path) -> list:
    """The pipeline runs recorded in `repo`'s store, newest first."""
    from eagle3ops.runs.records import find_pipelines

    return find_pipelines(pipeline_store(repo))


def ttt_logits(draft, ids, aux, positions, steps: int, raise_positions: bool) -> list:
    """The drafter's logits at each TTT step as ttt_loss runs them: step k reads x_{t+k+1} (ids holds x_{t+1} at
    t), at the positions `positions`, or, raised, `positions` + k."""
    from eagle3ops.modeling.draft import shift_left

    hidden, context, outs = draft.fuse(aux), draft.ttt_context(positions, steps), []
    for k in range(steps):
        step_positions = positions + k if raise_positions else positions
        hidden, logits, keys, values = draft(shift_left(ids, k), hidden, step_positions, context)
        context = context.after(keys, values)
        outs.append(logits)
    return outs
