"""The reproducible CPU mode (cpu_reproducible, src/eagle3ops/reproducible.py): a drafter's training steps give the
same bits whatever kernels the host would choose and however many cores the process may use; without the mode
they do not (where this CPU has more than AVX2). And what `reproduce` expects of a run recorded elsewhere.

The two process tests start six Python processes of a few seconds each (torch's import, ten TTT steps of a tiny
drafter); the compile-cache test two that compile the step loss (about 40 s, heavy)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

# Ten AdamW steps of the TTT loss on a tiny drafter, from a seed; prints the kernels torch ran and a digest of the
# weights. With PIN set, the mode pins the kernels first, as `eagle3ops <stage>` does before the stage computes.
PROBE = """
import hashlib, os, sys
import torch
if os.environ.get("PIN"):
    from eagle3ops.reproducible import pin_cpu_kernels
    pin_cpu_kernels(None)
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft, ttt_loss
torch.manual_seed(0)
cfg = DraftConfig(hidden_size=64, intermediate_size=192, num_attention_heads=2, num_key_value_heads=2, vocab_size=512,
                  draft_vocab_size=256, target_hidden_size=64, aux_layers=[2, 4, 5], max_position_embeddings=1024)
draft = Eagle3Draft(cfg)
draft.t2d[:256] = True
draft.d2t.zero_()
optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
ids, aux, final = torch.randint(0, 512, (2, 384)), torch.randn(2, 384, 192), torch.randn(2, 384, 64)
mask, positions, head = torch.ones(2, 384, dtype=torch.long), torch.arange(384).expand(2, 384), torch.randn(512, 64) * 0.05
for _ in range(10):
    optimizer.zero_grad()
    ttt_loss(draft, ids, aux, final, mask, positions, head, 7).loss.backward()
    optimizer.step()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in draft.parameters())).hexdigest()
print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), digest)
"""

CLEAN = {key: value for key, value in os.environ.items()
         if key not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")}


def probe(env: dict[str, str], cores: int | None = None) -> tuple[str, int, str]:
    """(kernels, threads, digest) of PROBE in a fresh process with `env` over the clean environment, allowed
    `cores` of this machine's."""
    command = [sys.executable, "-c", PROBE]
    if cores is not None:
        command = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:cores])), *command]
    done = subprocess.run(command, env={**CLEAN, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels, threads, digest = done.stdout.split()
    return kernels, int(threads), digest


# The step loss compiled by Inductor's CPU backend, forward and backward; prints the kernels torch ran.
COMPILED_PROBE = """
import os
import torch
if os.environ.get("PIN"):
    from eagle3ops.reproducible import pin_cpu_kernels
    pin_cpu_kernels(None)
from eagle3ops.modeling.draft import step_loss
generator = torch.Generator().manual_seed(0)
logits = torch.randn(2, 12, 16, generator=generator, requires_grad=True)
target = torch.softmax(torch.randn(2, 12, 16, generator=generator), -1)
mass, counted = torch.rand(2, 12, generator=generator), torch.rand(2, 12, generator=generator) > 0.3
summed, _, _ = torch.compile(step_loss, dynamic=False)(logits, target, mass, target.argmax(-1), counted)
summed.backward()
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on a CPU needs a C compiler")
@pytest.mark.heavy
def test_a_pinned_process_never_loads_a_graph_compiled_for_the_cpus_own_kernels(tmp_path):
    """Inductor keys its cache without the vector ISA ATEN_CPU_CAPABILITY chose: a pinned process that found the
    step loss compiled for this CPU's AVX-512 lanes built it for AVX2's and crashed (a segfault). The mode keeps its
    own compile cache, so the same cache directory serves both. Starts two Python processes that each compile the
    step loss with Inductor's CPU backend (40-60 s on 2 cores); no fixture builds this."""
    env = {**CLEAN, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    own = subprocess.run([sys.executable, "-c", COMPILED_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr[-3000:]
    if own.stdout.split()[-1] == "AVX2":
        pytest.skip("this CPU's own kernels are AVX2: the pinned ones are the same")
    pinned = subprocess.run([sys.executable, "-c", COMPILED_PROBE], env={**env, "PIN": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert pinned.returncode == 0, pinned.stderr[-3000:]
    assert pinned.stdout.split()[-1] == "AVX2" and (tmp_path / "inductor" / "cpu-reproducible").is_dir()


@pytest.mark.processes
def test_the_mode_gives_the_same_bits_whatever_the_host_would_choose():
    """The mode's bits with other choices preset in the environment (ATen's AVX-512 kernels, MKL's most
    compatible path, which rounds otherwise, one core) equal those on two cores with nothing preset: the mode pins
    the kernels and the threads."""
    pinned = probe({"PIN": "1", "ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "2"},
                   cores=1)
    again = probe({"PIN": "1", "OMP_NUM_THREADS": "2"}, cores=min(2, len(os.sched_getaffinity(0))))
    assert pinned == again and pinned[:2] == ("AVX2", 2)


@pytest.mark.processes
def test_without_the_mode_the_bits_follow_the_cpu_and_the_threads():
    """What the mode is for, shown on this CPU: its own kernels and the AVX2 ones round differently, and so do
    one and two threads of the same kernels (the check above would pass for nothing otherwise)."""
    native = probe({"OMP_NUM_THREADS": "1"})
    if native[0] == "AVX2":
        pytest.skip("this CPU's own kernels are AVX2: nothing for the mode to pin here")
    avx2 = probe({"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"})
    assert native[0] != "AVX2" and avx2[0] == "AVX2" and native[2] != avx2[2]
    two_threads = probe({"OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}, cores=1)
    assert two_threads[1] == 2 and two_threads[2] != avx2[2]


def test_reproduce_expects_bytes_only_where_they_can_come_back():
    """The same bytes: the same torch and threads, CPUs only or a GPU of the same model with gpu_deterministic on
    both sides, and the kernels pinned on both sides (any Intel CPU model) or the same CPU model; else the figures,
    with the reason named."""
    from eagle3ops.runs.records import PipelineRecord, StageRecord
    from eagle3ops.runs.reproduce import expectation

    def recorded(**facts: str) -> PipelineRecord:
        tags = {f"hardware.{key}": value for key, value in {
            "gpu_count": "0", "torch": "2.13.0+cpu", "torch_threads": "2", "cpu_model": "AMD EPYC 7B13",
            "cpu_kernels_pinned": "True", **facts}.items()}
        stages = {name: StageRecord(name, name.partition("@")[0], name.partition("@")[2], f"run-{name}", False, {},
                                    {}, tags) for name in ("zoo", "train@scratch")}
        return PipelineRecord("p", "run", {}, stages=stages)

    here = {"torch": "2.13.0+cpu", "cpu_model": "Intel Xeon Platinum 8481C"}
    xeon = dict(cpu_model="Intel(R) Xeon(R) CPU @ 2.20GHz")
    assert expectation(recorded(**xeon), here, 2, pinned_here=True).same_bytes  # another Intel CPU, both pinned
    assert "AVX2" in expectation(recorded(**xeon), here, 2, pinned_here=True).why
    assert not expectation(recorded(**xeon), here, 2, pinned_here=False).same_bytes
    # MKL ignores MKL_CBWR=AVX2 on an AMD CPU (MKL_VERBOSE: CNR:AUTO): pinned, an AMD run and an Intel one differ
    # (the embedded default: scratch tau 3.591 on an AMD EPYC, 3.570 on a Xeon); the same AMD model does not
    amd = expectation(recorded(), here, 2, pinned_here=True)
    assert not amd.same_bytes and "MKL" in amd.why
    assert expectation(recorded(), {**here, "cpu_model": "AMD EPYC 7B13"}, 2, pinned_here=True).same_bytes
    assert not expectation(recorded(cpu_kernels_pinned="False"), here, 2, pinned_here=True).same_bytes
    assert expectation(recorded(cpu_kernels_pinned="False", cpu_model=here["cpu_model"]), here, 2, False).same_bytes
    assert "threads" in expectation(recorded(), here, 1, pinned_here=True).why
    assert "torch" in expectation(recorded(torch="2.11.0"), here, 2, pinned_here=True).why
    assert "GPU" in expectation(recorded(gpu_count="1"), here, 2, pinned_here=True).why
    # on a GPU: bytes only with gpu_deterministic on both sides, on the same GPU model
    h100 = {**here, "gpu_models": "NVIDIA H100 80GB HBM3"}
    on_gpu = dict(gpu_count="1", gpu_models=h100["gpu_models"], **xeon)
    assert expectation(recorded(**on_gpu, gpu_deterministic="True"), h100, 2, True, deterministic_here=True).same_bytes
    assert "gpu_deterministic" in expectation(recorded(**on_gpu, gpu_deterministic="True"), h100, 2, True).why
    assert "gpu_deterministic" in expectation(recorded(**on_gpu, gpu_deterministic="False"), h100, 2, True, True).why
    other_card = expectation(recorded(**on_gpu, gpu_deterministic="True"), {**h100, "gpu_models": "NVIDIA H200"}, 2,
                             True, True)
    assert not other_card.same_bytes and "H200" in other_card.why
    assert not expectation(recorded(torch_threads="unknown"), here, 2, pinned_here=True).same_bytes  # older runs


def test_gpu_deterministic_sets_what_cublas_and_inductor_read(monkeypatch):
    """The stage's GPU settings: cuBLAS's workspace variable, Inductor's deterministic mode in this process (its
    config read the variable when imported) and for the processes it starts, all recorded in the fingerprint."""
    import torch._inductor.config as inductor_config

    from eagle3ops.reproducible import DETERMINISTIC_GPU, make_gpu_deterministic
    from eagle3ops.tracking.hardware import fingerprint

    for name in DETERMINISTIC_GPU:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(inductor_config, "deterministic", False)
    assert fingerprint()["gpu_deterministic"] == "False"
    make_gpu_deterministic()
    assert inductor_config.deterministic and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert fingerprint()["gpu_deterministic"] == "True"
