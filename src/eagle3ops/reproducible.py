"""The reproducible modes: on a CPU (params `cpu_reproducible`) the same bits on every Intel x86-64 CPU that has AVX2
(MKL keeps its own path on an AMD CPU: MKL_CBWR=AVX2 is not honoured there, docs/runs.md); on a
GPU (params `gpu_deterministic`) the same bits run after run on one card model.

On a CPU the kernels are chosen by the processor: ATen runs its AVX-512 kernels where the CPU has them, MKL picks a
code path per instruction set, oneDNN likewise, and each rounds float32 differently; so the same commit trained 3.506,
3.591 and 3.619 on three machines. A reduction split over threads also rounds by how many threads there are (not how
many cores: two threads on one core give the two-thread bits). This mode pins each choice, in the environment the
libraries read at their first use, before a stage computes anything:

- ATEN_CPU_CAPABILITY=avx2: ATen's AVX2 kernels;
- MKL_CBWR=AVX2: MKL's conditional numerical reproducibility, its AVX2 code path;
- ONEDNN_MAX_CPU_ISA=AVX2: oneDNN at most AVX2;
- torch's CPU threads: params `threads`, else $OMP_NUM_THREADS, else 2, never the core count.

The mode's compile caches (Inductor's, vLLM's) are kept apart from those of the CPU's own kernels: Inductor keys a
compiled graph without the vector ISA that ATEN_CPU_CAPABILITY chose, so a graph generated for AVX-512's 16 lanes
would be loaded by a pinned process and built for AVX2's 8 (or the other way round), and crash it (a segfault).

On a GPU a run's bits changed from one fresh compile cache to the next (docs/performance.md, "The same bits twice"):
Inductor chooses its kernels by timing candidates on the device, and cuBLAS picks workspaces at run time.
`gpu_deterministic` sets CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS's deterministic workspaces) and Inductor's
deterministic mode (kernels chosen without timing them); the training loop always asks torch for deterministic
algorithms where they exist.

The servers and stages a stage starts inherit the environment. What it costs in speed: docs/runs.md ("The same bits
on any machine")."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from eagle3ops.errors import InputError

PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
DETERMINISTIC_GPU = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TORCHINDUCTOR_DETERMINISTIC": "1"}
MODE_ENVIRONMENT = (*PINNED_KERNELS, *DETERMINISTIC_GPU)  # what a process's bits depend on beyond its inputs
DEFAULT_THREADS = 2
MODE_CACHE = "cpu-reproducible"  # the mode's compile caches: this folder inside each cache's own


def mode_threads(threads: int | None) -> int:
    """The CPU threads of the reproducible mode: `threads`, else $OMP_NUM_THREADS, else DEFAULT_THREADS."""
    if threads:
        return threads
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return DEFAULT_THREADS


def pin_cpu_kernels(threads: int | None) -> None:
    """The mode, in this process and those it starts (each stage run's hardware fingerprint records what it set).
    InputError where torch already chose its kernels otherwise (something computed before the stage began)."""
    pin_environment()
    count = mode_threads(threads)
    torch.set_num_threads(count)
    chosen = torch.backends.cpu.get_cpu_capability()
    if chosen not in ("AVX2", "DEFAULT"):  # DEFAULT: a CPU without AVX2 runs ATen's plain kernels, other bits
        raise InputError(f"cpu_reproducible: torch chose its {chosen} kernels before the mode could pin AVX2 (a "
                         f"computation ran before the stage began); start the process with "
                         f"ATEN_CPU_CAPABILITY=avx2, or set cpu_reproducible: false")


def pin_environment() -> None:
    """The mode's environment, read by the libraries at their first use: the kernels pinned, the compile caches
    apart."""
    os.environ.update(PINNED_KERNELS)
    separate_compile_caches()


def separate_compile_caches() -> None:
    """Inductor's and vLLM's compile caches moved into a MODE_CACHE folder of their own (module docstring: why)."""
    vllm_default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"
    for variable, default in (("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()), ("VLLM_CACHE_ROOT", vllm_default)):
        cache = Path(os.environ.get(variable) or default)
        if cache.name != MODE_CACHE:
            os.environ[variable] = str(cache / MODE_CACHE)


def make_gpu_deterministic() -> None:
    """gpu_deterministic, in this process (before cuBLAS starts: its setting is read once) and those it starts."""
    os.environ.update(DETERMINISTIC_GPU)
    import torch._inductor.config as inductor_config  # its module read the variable when imported, maybe before

    inductor_config.deterministic = True
