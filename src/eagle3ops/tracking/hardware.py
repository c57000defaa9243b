"""What machine a stage ran on, so runs on different hardware can be told apart and compared.

`fingerprint()` gathers the facts that explain a stage's speed (accelerators, the link between them, CPU, memory,
disk, library versions); `label()` turns them into a short name such as "cpu-2c", "1xH200" or "8xB300-nvlink".
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

from eagle3ops.cpu_share import usable_cores
from eagle3ops.reproducible import DETERMINISTIC_GPU, PINNED_KERNELS

UNKNOWN = "unknown"
NOT_APPLICABLE = "n/a"
_GIB = 1024**3

Value = str | int | float
T = TypeVar("T")

# Words in CUDA device names that say nothing about the chip ("NVIDIA RTX PRO 6000 Blackwell Server Edition",
# "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"), dropped so labels stay short: RTXPRO6000, A100, H100.
_NAME_NOISE = re.compile(
    r"^(nvidia|geforce|tesla|quadro|blackwell|hopper|generation|server|workstation|edition|\d+gb|hbm\d\w*|sxm\d*|pcie)$",
    re.IGNORECASE,
)


def _safe(probe: Callable[[], T]) -> T | str:
    """One probe's answer, or "unknown": a fingerprint must never stop a stage."""
    try:
        return probe()
    except Exception:
        return UNKNOWN


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or UNKNOWN


def _ram_gib() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / _GIB, 1)


def _gpu_link(gpu_count: int) -> str:
    """"nvlink" when any GPU pair in `nvidia-smi topo -m` is joined by NV<n> links, else "pcie"."""
    if gpu_count == 0 or shutil.which("nvidia-smi") is None:
        return NOT_APPLICABLE
    out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30, check=True).stdout
    # Only the GPU rows of the matrix: the legend below it also mentions "NV#".
    cells = [cell for line in out.splitlines() if re.match(r"^\s*GPU\d+\s", line) for cell in line.split()[1:]]
    return "nvlink" if any(re.fullmatch(r"NV\d+", cell) for cell in cells) else "pcie"


def _driver_version() -> str:
    import pynvml  # nvidia-ml-py; it fails cleanly where there is no NVIDIA driver

    pynvml.nvmlInit()
    try:
        return str(pynvml.nvmlSystemGetDriverVersion())
    finally:
        pynvml.nvmlShutdown()


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return NOT_APPLICABLE


def _gpus() -> dict[str, Value]:
    if not torch.cuda.is_available():
        return {"accelerator": "cpu", "gpu_count": 0, "gpu_models": NOT_APPLICABLE, "gpu_memory_gib": 0.0}
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {
        "accelerator": "cuda",
        "gpu_count": len(props),
        "gpu_models": ", ".join(dict.fromkeys(p.name for p in props)),  # distinct names, in device order
        "gpu_memory_gib": round(min(p.total_memory for p in props) / _GIB, 1),  # per GPU
    }


def fingerprint() -> dict[str, Value]:
    """Facts about this machine and software stack; any fact that cannot be read is "unknown"."""
    gpus = _safe(_gpus)
    if not isinstance(gpus, dict):
        gpus = dict.fromkeys(("accelerator", "gpu_count", "gpu_models", "gpu_memory_gib"), UNKNOWN)
    gpu_count = gpus["gpu_count"] if isinstance(gpus["gpu_count"], int) else 0
    return {
        **gpus,
        "gpu_link": _safe(lambda: _gpu_link(gpu_count)),
        "cpu_model": _safe(_cpu_model),
        "cpu_logical_cores": _safe(lambda: os.cpu_count() or UNKNOWN),
        # Cores this process may run on (a container or taskset can allow fewer than the machine has).
        "cpu_usable_cores": _safe(usable_cores),
        "torch_threads": _safe(torch.get_num_threads),
        # the CPU kernels torch runs, and whether the reproducible mode pinned them (reproducible.py)
        "cpu_capability": _safe(torch.backends.cpu.get_cpu_capability),
        "cpu_kernels_pinned": _safe(lambda: str(all(os.environ.get(k) == v for k, v in PINNED_KERNELS.items()))),
        "gpu_deterministic": _safe(lambda: str(all(os.environ.get(k) == v for k, v in DETERMINISTIC_GPU.items()))),
        "ram_gib": _safe(_ram_gib),
        "disk_free_gib": _safe(lambda: round(shutil.disk_usage(os.getcwd()).free / _GIB, 1)),
        "os": _safe(lambda: f"{platform.system()} {platform.release()}"),
        "python": _safe(lambda: sys.version.split()[0]),
        "torch": _safe(lambda: torch.__version__),
        "cuda": _safe(lambda: torch.version.cuda or NOT_APPLICABLE),
        "driver": _safe(_driver_version) if gpu_count else NOT_APPLICABLE,
        "disk_total_gib": _safe(lambda: round(shutil.disk_usage(os.getcwd()).total / _GIB, 1)),
        "transformers": _safe(lambda: _package_version("transformers")),
        "dvc": _safe(lambda: _package_version("dvc")),
        "mlflow": _safe(lambda: _package_version("mlflow")),
    }


def _compact_gpu_name(name: str) -> str:
    words = [w for w in re.split(r"[\s\-_]+", name) if w and not _NAME_NOISE.match(w)]
    return "".join(words) or "GPU"


def label(fp: dict[str, Value], override: str | None = None) -> str:
    """`override` if given, else "<n>x<model>[-nvlink|-pcie]" for GPUs or "cpu-<cores>c"."""
    if override:
        return override
    count = fp.get("gpu_count")
    if isinstance(count, int) and count > 0:
        models = [m.strip() for m in str(fp.get("gpu_models", "")).split(",") if m.strip()]
        name = "+".join(_compact_gpu_name(m) for m in models) or "GPU"
        link = fp.get("gpu_link") if count > 1 and fp.get("gpu_link") in ("nvlink", "pcie") else None
        return f"{count}x{name}{'-' + link if link else ''}"  # how GPUs talk decides multi-GPU phase times
    cores = fp.get("cpu_usable_cores", UNKNOWN)
    if not isinstance(cores, int):
        cores = fp.get("cpu_logical_cores", UNKNOWN)
    return f"cpu-{cores}c" if isinstance(cores, int) else "cpu"
