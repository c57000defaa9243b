"""Fixtures (a tiny BPE tokenizer with the Kimi-style chat template, a tiny random Llama target, a vLLM server of
it) and the two tiers.

The fast tier is the default: `pytest` leaves out every test marked with one of SLOW_TIER (it starts a service,
runs the pipeline or a stage as subprocesses, starts several processes, or takes tens of seconds) and says so at the end.
`pytest --all` runs everything, as CI does (`.ci/run`); `-m` picks tests by marker as usual.

The budget, on the 2-core CI machine (tests/suite_clock.py prints where a run's time went, against it): the fast
tier under 3 minutes; the whole suite (`.ci/run`, the setup included) under 45 minutes; no test file over 15
minutes alone, so that both xdist workers stay busy to the end. A slow test says in its docstring what it starts
(a pipeline, a vLLM server, a tracking server) and what it costs; before adding one, reuse the fixture that
already builds what it needs."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import TEXTS
from suite_clock import SuiteClock

SLOW_TIER = {
    "service": "starts a real server (vLLM, mlflow server, PostgreSQL, sshd, S3, transformers serve)",
    "pipeline": "runs the DVC pipeline or a stage as subprocesses (minutes)",
    "processes": "starts several processes (torchrun ranks, a stage SIGKILLed and resumed, fresh-process timings)",
    "heavy": "compiles with torch.compile, runs a benchmark end to end or works through a 10 MB input (tens of "
             "seconds each)",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true",
                     help="run every test, the slow tier too (" + ", ".join(SLOW_TIER) + " markers): what CI runs")


def pytest_configure(config: pytest.Config) -> None:
    # Tiny models on a 2-core machine, two test workers: one thread a process, in the tests and in every stage,
    # server and script they start. A second thread costs more in waiting than it computes, and OpenMP's spinning
    # waits multiply that when processes share the cores (a stage beside the other worker ran 3 to 8 times slower).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The reproducible CPU mode (cpu_reproducible, the default) in the test processes too, before any computation
    # chooses this CPU's kernels: a stage run in-process finds them already chosen, as it checks
    from eagle3ops.reproducible import pin_environment

    pin_environment()
    for marker, what in SLOW_TIER.items():
        config.addinivalue_line("markers", f"{marker}: {what}; left out of the default run, `pytest --all` runs it")
    if not hasattr(config, "workerinput"):  # the process that reports: xdist's controller, or pytest without -n
        # the engine sessions the stages leave running (serving/session.py): this run's own, found again by its
        # later tests (the workers inherit the variable), and stopped at its end
        os.environ["EAGLE3OPS_ENGINE_DIR"] = tempfile.mkdtemp(prefix="eagle3ops-test-engines-")
        config.pluginmanager.register(SuiteClock(slow_tier=bool(config.getoption("--all") or config.getoption("markexpr")),
                                                 whole=not config.option.file_or_dir), "suite-clock")


# The files that take longest, longest first: `--all` starts with them, so that with `-n 2 --dist loadfile
# --no-loadscope-reorder` (pytest-xdist, as CI runs) neither worker is left with a long file at the end while the
# other idles (xdist hands a worker its next file when two tests or fewer of its current one are left).
# test_pipeline_e2e.py builds the shared micro pipeline (built_pipeline) on the first worker while the second runs
# test_smollm2.py; the other files that copy the pipeline come after it.
LONGEST_FIRST = ["test_pipeline_e2e.py",
                 "test_smollm2.py",
                 "test_pipeline_experiments.py",
                 "test_pipeline_reproduce.py",
                 "test_resume.py",
                 "test_vllm_extract.py",
                 "test_tracking_server.py",
                 "test_dvc_remotes.py",
                 "test_outbox.py",
                 "test_engine_session.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--all"):
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: in-file order kept
    if config.getoption("--all") or config.getoption("markexpr"):
        return
    slow = [item for item in items if any(item.get_closest_marker(marker) for marker in SLOW_TIER)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        left_out = set(slow)
        items[:] = [item for item in items if item not in left_out]
        config.stash[_LEFT_OUT] = len(slow)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and "EAGLE3OPS_ENGINE_DIR" in os.environ:
        from eagle3ops.serving.registry import running, stop

        for record in running():
            stop(record["key"])
        shutil.rmtree(os.environ.pop("EAGLE3OPS_ENGINE_DIR"), ignore_errors=True)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"fast tier: {left_out} slower tests left out (markers {', '.join(SLOW_TIER)}); "
            "`pytest --all` runs everything, as CI does", yellow=True)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from eagle3ops.zoo.tokenizer import train_tokenizer

    return train_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> Path:
    """A random 4-layer Llama (hidden 32, one head of 32: a head size vLLM's CPU kernels serve) with the tiny
    tokenizer, saved as a Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def built_pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The micro pipeline as the README's first command leaves it: `dvc repro` (vLLM in eval and export, through
    the run's engine sessions), its results committed. Built once a run by the first test process that asks (about
    6 minutes on 2 cores beside the other worker; the other waits for it), read by the modules that check a built
    pipeline through copies of it (helpers.copy_workspace). Returns (repository, `dvc repro`'s output)."""
    from helpers import built_once, commit, micro_pipeline_repo, run, session_dir

    def build(repo: Path) -> str:
        output = run(["dvc", "repro"], micro_pipeline_repo(repo))
        commit(repo, "Results of the embedded default")
        return output

    return built_once(session_dir(tmp_path_factory) / "micro-pipeline", build)


@pytest.fixture(scope="module")
def vllm_tiny_target(tiny_target_dir) -> Iterator[str]:
    """A real vLLM server (the CPU build, as the stages start it) serving the tiny target; its base URL."""
    from eagle3ops.config import VllmConfig
    from eagle3ops.serving.vllm import vllm_server

    with vllm_server(tiny_target_dir, "float32", VllmConfig(), f"tests-{os.getpid()}") as url:
        yield url
