"""Engine sessions: a vLLM server of the target that outlives the stage which started it and serves every later
stage, of this run or a later one, that needs an interchangeable engine; drafters are swapped into it, not
restarted.

Why. Loading the target is the pipeline's fixed tax (22.5 minutes for Kimi-K2.5's 540 GB): with a server per
stage, one `dvc repro` paid it five times (the baseline's eval twice, each drafter's eval, the export's check).
With sessions it pays it twice, the target alone and the target with a drafter, and an experiment that changes
only training pays it not at all.

Interchangeable (`EngineSpec.key`): the same target, by content (its files, the weights hashed when they are
small, by name, size and modification time when they are not), dtype, seed, vLLM
version, the `vllm` settings that shape the engine and the CPU kernels pinned or not (cpu_reproducible); for an engine with a drafter, the drafter's served config
(everything but its provenance record and the verifier's path: layer shapes, draft vocabulary, aux layer ids,
norms, rope) and k; the chat template it renders with. A drafter with another config gets another engine; one
with the same config has its weights loaded into the running one (serving/drafter_swap.py, through vLLM's
/collective_rpc) and its prefix cache emptied, so that no block drafted by the previous weights is reused.
Sessions are infrastructure, not lineage: the key decides only which server answers, never what it computes.

Where: the machine's engine directory (serving/registry.py). A stage holds the engine's lock for its whole use:
two experiments in parallel take turns, never swap a drafter under each other, and vLLM's server-wide counters
stay theirs alone.

Lifetime (serving/supervisor.py): each engine has a supervisor that stops it once unused for
vllm.engine_idle_s, or when asked (`eagle3ops engine stop`); an engine that died, or a stale record, is noticed
by the next stage, which starts another. Starting an engine first stops the least recently used idle ones beyond
vllm.engines_kept (on a GPU, one: an engine takes vllm.gpu_memory_utilization of it; there any server a stage
starts for itself makes the same room first, serving/vllm.py). vllm.engine_idle_s: 0 is the stage-per-process
mode: a server started and stopped inside the stage, as before sessions.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx2

from eagle3ops.config import VllmConfig
from eagle3ops.reproducible import MODE_ENVIRONMENT
from eagle3ops.serving.http import EngineError, watched
from eagle3ops.serving.registry import (
    ago,
    alive,
    engine_dir,
    make_room,
    read_record,
    record_path,
    stop_supervised,
    write_record,
)
from eagle3ops.serving.server import failure_text, free_port, wait_ready
from eagle3ops.serving.vllm import (
    LOG_DIR,
    engines_kept,
    installed_version,
    serve_argv,
    serve_env,
    setting_behind,
    vllm_server,
)

SMALL_WEIGHTS_BYTES = 8 * 2**30  # weights up to this are hashed for the key; larger ones by name, size and mtime
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_SWAP_EXTENSION = "eagle3ops.serving.drafter_swap.DrafterSwap"


def target_fingerprint(target: str | Path) -> str:
    """The target's content for the key: every file of its directory by name and content, the weights' content
    too while they are at most SMALL_WEIGHTS_BYTES in all (beyond that their sizes and modification times: a
    re-download is another engine, and a byte-identical copy elsewhere is the same engine only when hashed)."""
    files = sorted(p for p in Path(target).iterdir() if p.is_file())
    weights = {p for p in files if any(p.match(pattern) for pattern in _WEIGHTS)}
    hashed = sum(p.stat().st_size for p in weights) <= SMALL_WEIGHTS_BYTES
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(file.name.encode() + b"\0")
        digest.update(hashlib.sha256(file.read_bytes()).digest() if hashed or file not in weights
                      else f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def served_config(export_dir: str | Path) -> str:
    """What of a speculators export shapes the engine that serves it: its config without the provenance record and
    the verifier's path (the target is keyed by content), as canonical JSON."""
    config = json.loads((Path(export_dir) / "config.json").read_text(encoding="utf-8"))
    config.pop("eagle3ops", None)
    config.get("speculators_config", {}).get("verifier", {}).pop("name_or_path", None)
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class EngineSpec:
    """An engine to find or start: the target alone (drafter None) or with a drafter's speculators export, which
    it starts with when it must start (a found engine takes its weights by `Engine.use_drafter`)."""
    target: str
    dtype: str
    seed: int = 0
    drafter: str | None = None
    k: int = 3
    chat_template: str | None = None

    def key(self, settings: VllmConfig) -> str:
        shaping = {name: getattr(settings, name) for name in ("enforce_eager", "kv_cache_gib", "gpu_memory_utilization",
                                                              "tensor_parallel_size", "max_model_len")}
        identity = {"vllm": installed_version(), "target": target_fingerprint(self.target), "dtype": self.dtype,
                    "seed": self.seed, "settings": shaping, "extra_args": list(settings.extra_args),
                    "drafter": served_config(self.drafter) if self.drafter else None,
                    "k": self.k if self.drafter else None, "chat_template": self.chat_template,
                    # the kernels it computes with (the reproducible modes', inherited from the stage, or not)
                    "kernels": {name: os.environ.get(name) for name in MODE_ENVIRONMENT}}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


# The MLflow tag of a stage run that names the engines it used, each as Engine.summary() writes it, ", "-joined
# (runs/target_loads.py counts the loads from it)
ENGINES_TAG = "eagle3ops.engines"


@dataclass
class Engine:
    """A server to send requests to while the `engine` block lasts."""
    url: str
    key: str
    started: bool  # False: found running, started by an earlier stage
    start_s: float  # how long its start took (this stage's, or the earlier one's)
    log: Path
    drafter_sha256: str | None  # the weights the drafter has now

    def summary(self) -> str:
        """For the stage's MLflow run: whether it started the engine or found it, and what the start took."""
        return f"{'started' if self.started else 'found'} {self.key or 'stage-local'} ({self.start_s} s start)"

    def use_drafter(self, export_dir: str | Path) -> bool:
        """Make the engine draft with the speculators export at `export_dir` (its config must be the engine's: the
        key says so); returns whether the weights had to be swapped in."""
        weights = Path(export_dir) / "model.safetensors"
        wanted = hashlib.sha256(weights.read_bytes()).hexdigest()
        if wanted == self.drafter_sha256:
            return False
        answer = _post(f"{self.url}/collective_rpc", {"method": "eagle3ops_load_drafter",
                                                      "args": [str(Path(export_dir).resolve())]})
        loaded = set(answer.get("results") or [])
        if loaded != {wanted}:
            raise EngineError(f"{self.url}: the engine did not take the drafter {export_dir} (its workers report "
                              f"the weights {sorted(loaded)}, the file is {wanted}); its log: {self.log}")
        _post(f"{self.url}/reset_prefix_cache", None)  # no block drafted by the previous weights is reused
        self.drafter_sha256 = wanted
        record = read_record(record_path(self.key))
        if record is not None:
            write_record(record_path(self.key), {**record, "drafter_sha256": wanted})
        return True


def _post(url: str, body: dict | None) -> dict:
    try:
        response = httpx2.post(url, json=body, timeout=300.0)
    except httpx2.TransportError as err:
        raise EngineError(f"{url}: {type(err).__name__}: {err}") from None
    if response.status_code != 200:
        raise EngineError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
    return response.json() if response.content else {}


@contextmanager
def engine(spec: EngineSpec, settings: VllmConfig, log_name: str) -> Iterator[Engine]:
    """The engine for `spec`, found or started, held for this block (no other stage uses it meanwhile). With
    vllm.engine_idle_s 0, a server of this stage's own, stopped at the end of the block."""
    if settings.engine_idle_s == 0:
        began = time.perf_counter()
        with vllm_server(spec.target, spec.dtype, settings, log_name, spec.seed, drafter=spec.drafter, k=spec.k,
                         chat_template=spec.chat_template) as url:
            weights = Path(spec.drafter) / "model.safetensors" if spec.drafter else None
            yield Engine(url, "", True, round(time.perf_counter() - began, 1), LOG_DIR,
                         hashlib.sha256(weights.read_bytes()).hexdigest() if weights else None)
        return
    key = spec.key(settings)
    directory = engine_dir()
    directory.mkdir(parents=True, exist_ok=True)
    lock_path = directory / f"{key}.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # while another stage uses this engine, wait for it
        try:
            os.utime(lock_path)
            record = _live(key)
            if record is None:
                make_room(engines_kept(settings), keep_key=key)
                record = _start(spec, settings, key, log_name)
                found = False
            else:
                found = True
                print(f"vllm: engine {key} found at {record['url']} (started by {record['started_by']} "
                      f"{ago(record['started_at'])}, log {record['log']})", flush=True)
            with watched(record["url"], lambda: _gone(record)):
                yield Engine(record["url"], key, not found, record["start_s"], Path(record["log"]),
                             record.get("drafter_sha256"))
        finally:
            os.utime(lock_path)
            fcntl.flock(lock, fcntl.LOCK_UN)


def _gone(record: dict) -> str | None:
    """Why the engine of `record` is gone (its supervisor ends when its server does), None while it runs."""
    pid = record.get("supervisor_pid")
    try:
        os.waitpid(pid, os.WNOHANG)  # reaped here where this process started it: a zombie would look alive
    except ChildProcessError:
        pass
    if alive(pid):
        return None
    return f"its vLLM engine {record['key']} is gone; {failure_text('vLLM', Path(record['log']), setting_behind)}"


def _live(key: str) -> dict | None:
    """The engine's record when its supervisor runs and its server answers as the target it was started with;
    otherwise whatever is left of it is stopped and removed, and None."""
    path = record_path(key)
    record = read_record(path)
    if record is None:
        return None
    if alive(record.get("supervisor_pid")):
        if _answers_as_its_target(record):
            return record
        print(f"vllm: engine {key} at {record['url']} does not answer as its target: stopping it", flush=True)
    stop_supervised(record)
    path.unlink(missing_ok=True)
    return None


def _answers_as_its_target(record: dict) -> bool:
    """Whether the server at the record's URL serves the record's target (not another model on a reused port)."""
    try:
        models = httpx2.get(f"{record['url']}/v1/models", timeout=10.0).json()["data"]
        return [m.get("root") for m in models] == [record["model"]]
    except (httpx2.HTTPError, ValueError, KeyError, TypeError):
        return False


def _start(spec: EngineSpec, settings: VllmConfig, key: str, log_name: str) -> dict:
    """Start the engine under a supervisor of its own and wait until it answers; its record, written."""
    home = engine_dir() / key
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    drafter = None
    if spec.drafter:  # the session's own copy: the stage's export may be a temporary directory
        drafter = home / "drafter"
        shutil.copytree(spec.drafter, drafter)
    model, port = str(Path(spec.target).resolve()), free_port()
    argv = serve_argv(model, spec.dtype, settings, port, spec.seed, drafter=drafter, k=spec.k)
    env = serve_env(settings)
    if spec.chat_template is not None:
        (home / "chat_template.jinja").write_text(spec.chat_template, encoding="utf-8")
        argv += ["--chat-template", str(home / "chat_template.jinja")]
    if drafter is not None:
        argv += ["--worker-extension-cls", _SWAP_EXTENSION]
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache, on loopback only
    log = home / "vllm.log"
    record = {"key": key, "model": model, "dtype": spec.dtype, "drafter": spec.drafter is not None,
              "k": spec.k if spec.drafter else None, "url": f"http://127.0.0.1:{port}", "log": str(log),
              "lock": str(engine_dir() / f"{key}.lock"), "idle_s": settings.engine_idle_s, "started_at": time.time(),
              "started_by": log_name, "argv": argv, "env": env, "cwd": str(home), "start_s": None,
              "drafter_sha256": hashlib.sha256((drafter / "model.safetensors").read_bytes()).hexdigest()
              if drafter else None}
    path = record_path(key)
    write_record(path, record)
    print(f"vllm: starting engine {key}, vLLM {installed_version()} for {spec.target}"
          + (f" with the drafter {spec.drafter}" if spec.drafter else "") + f" (log {log})", flush=True)
    began = time.perf_counter()
    supervisor = subprocess.Popen([sys.executable, "-m", "eagle3ops.serving.supervisor", str(path)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
    record["supervisor_pid"] = supervisor.pid
    write_record(path, record)
    try:
        wait_ready("vLLM", supervisor, f"{record['url']}/health", log, settings.ready_timeout_s, setting_behind)
        if not _answers_as_its_target(record):  # another server took the port between our pick and vLLM's bind
            raise EngineError(f"vllm: engine {key}: port {port} answers as another server, not {model}: it was "
                              f"taken while the engine started (log {log}); run the stage again")
    except BaseException:
        stop_supervised(record)
        path.unlink(missing_ok=True)
        raise
    record["start_s"] = round(time.perf_counter() - began, 1)
    write_record(path, record)
    return record
