"""`eagle3ops reproduce RUN_ID`: re-run a recorded pipeline run from scratch and say what came back the same.

The pipeline run's parent carries its git commit (tag) and, under `lineage/`, the dvc.yaml, params.yaml and
dvc.lock it ran with (logged by the report stage). A detached git worktree of that commit gets those three
files and an empty DVC cache, so `dvc repro` recomputes every stage; then each output's md5 is compared with
the recorded lock, and each stage metric with the recorded run.

What to expect (`expectation`): the same bytes where they can come back, i.e. the same torch and thread count, on
CPUs only or with gpu_deterministic on both sides and the same GPU model, and either both sides pinned the CPU
kernels on Intel CPUs (cpu_reproducible: any Intel x86-64 CPU with AVX2 computes the same bits; MKL ignores the pin
on AMD's) or both ran on the same CPU model;
otherwise (another torch or GPU, a GPU's kernels chosen by timing, unpinned kernels on another CPU) only the
figures, each eval's τ inside the recorded 95% interval.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from mlflow import MlflowClient

from eagle3ops.errors import InputError
from eagle3ops.reproducible import mode_threads
from eagle3ops.runs.records import PipelineRecord, load_pipeline
from eagle3ops.tracking import hardware
from eagle3ops.tracking.lineage import load_yaml, lock_outputs
from eagle3ops.tracking.metrics import HEADLINE, METRICS_DIR, read_all
from eagle3ops.training.compile_cache import OUTPUT_ROOT

LINEAGE_FILES = ("dvc.yaml", "params.yaml", "dvc.lock")


@dataclass(frozen=True)
class Expectation:
    same_bytes: bool  # False: only the figures, within their intervals
    why: str


@dataclass
class Reproduction:
    outputs: list[dict]  # path, kind, recorded md5, reproduced md5, identical
    metrics: list[dict]  # stage, metric, recorded, reproduced, delta
    worktree: Path
    expected: Expectation
    taus: list[dict]  # per eval: recorded tau, its interval, reproduced tau, inside

    @property
    def identical(self) -> bool:
        """Every data and model output came back byte for byte (metrics and reports hold wall times)."""
        return all(row["identical"] for row in self.outputs if row["kind"] == "result")

    @property
    def as_expected(self) -> bool:
        """The bytes where they should come back, else every eval's tau inside its recorded interval."""
        return self.identical if self.expected.same_bytes else all(row["inside"] for row in self.taus)


def expectation(record: PipelineRecord, here: dict, threads_here: int, pinned_here: bool,
                deterministic_here: bool = False) -> Expectation:
    """Whether a reproduction on this machine (its fingerprint `here`, the thread count, kernel pinning and GPU
    settings its stages will run with) should give the recorded run's bytes, from the hardware facts its stage runs
    recorded."""
    facts = {key: {stage.tags.get(f"hardware.{key}", "unknown") for stage in record.stages.values()}
             for key in ("gpu_count", "gpu_models", "gpu_deterministic", "torch", "torch_threads", "cpu_model",
                         "cpu_kernels_pinned")}
    if facts["torch"] != {str(here["torch"])}:
        return Expectation(False, f"torch {sorted(facts['torch'])} then, {here['torch']} here: other kernels")
    if facts["torch_threads"] != {str(threads_here)}:
        return Expectation(False, f"{sorted(facts['torch_threads'])} CPU threads then, {threads_here} here: a "
                                  f"reduction split otherwise rounds otherwise")
    gpu = ""
    if facts["gpu_count"] - {"0"}:
        if facts["gpu_deterministic"] != {"True"} or not deterministic_here:
            return Expectation(False, "stages of the run used a GPU without gpu_deterministic on both sides: "
                                      "Inductor chooses GPU kernels by timing them, so only the figures can come back")
        if facts["gpu_models"] != {str(here["gpu_models"])}:
            return Expectation(False, f"GPUs {sorted(facts['gpu_models'])} then, {here['gpu_models']} here: other "
                                      f"kernels")
        gpu = f"gpu_deterministic on both sides on {here['gpu_models']}; "
    pinned = facts["cpu_kernels_pinned"] == {"True"} and pinned_here
    if pinned and all("Intel" in model for model in facts["cpu_model"] | {str(here["cpu_model"])}):
        return Expectation(True, f"{gpu}CPU kernels pinned to AVX2 (cpu_reproducible) on both sides, {threads_here} "
                                 f"threads, torch {here['torch']}: any Intel x86-64 CPU with AVX2 computes the same "
                                 f"bits")
    if facts["cpu_model"] == {str(here["cpu_model"])}:
        return Expectation(True, f"{gpu}the same CPU model ({here['cpu_model']}), torch and threads")
    if pinned:
        return Expectation(False, f"{sorted(facts['cpu_model'])} then, {here['cpu_model']} here: MKL takes the "
                                  f"pinned AVX2 branch on Intel CPUs alone (on an AMD CPU it keeps its own, "
                                  f"CNR:AUTO), so their matrix products round otherwise")
    return Expectation(False, f"this CPU's own kernels (cpu_reproducible off) on {sorted(facts['cpu_model'])} "
                              f"then, {here['cpu_model']} here: they round otherwise")


def output_kind(path: str, params: dict) -> str:
    """timing: holds wall times; checkout: names the checkout's own paths (the serving guide); cache: the compiled
    graphs (training/compile_cache.py); else result."""
    report_dir = (params.get("report") or {}).get("out_dir", "reports")
    if path == str(HEADLINE) or path.startswith((f"{METRICS_DIR}/", f"{report_dir.rstrip('/')}")):
        return "timing"
    if path.startswith(f"{OUTPUT_ROOT.as_posix()}/"):
        return "cache"
    return "checkout" if path == (params.get("export") or {}).get("guide", "models/SERVING.md") else "result"


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed in {cwd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def reproduce(client: MlflowClient, run_id: str, repo: Path, tracking_uri: str, keep: bool = False) -> Reproduction:
    record = load_pipeline(client, run_id)
    commit = record.tags.get("eagle3ops.git_commit")
    if not commit or commit == "nogit":
        raise InputError(f"run {run_id}: no git commit recorded; it cannot be checked out")
    staging = Path(tempfile.mkdtemp(prefix="eagle3ops-reproduce-"))
    client.download_artifacts(run_id, "lineage", str(staging))
    missing = [name for name in LINEAGE_FILES if not (staging / "lineage" / name).is_file()]
    if missing:
        raise InputError(f"run {run_id}: no lineage/{missing} artifacts; only runs whose report stage ran have them")
    worktree = staging / "worktree"
    _run(["git", "worktree", "add", "--detach", str(worktree), commit], repo)
    try:
        for name in LINEAGE_FILES:
            shutil.copy(staging / "lineage" / name, worktree / name)
        env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "EAGLE3OPS_REPRODUCES": run_id}
        env.pop("DVC_EXP_NAME", None)
        # An empty cache of its own (never the original's run-cache): every stage really runs again.
        _run(["dvc", "config", "--local", "cache.dir", str(staging / "cache")], worktree, env)
        _run(["dvc", "repro", "--force"], worktree, env)
        recorded = lock_outputs(staging / "lineage" / "dvc.lock")
        again = lock_outputs(worktree / "dvc.lock")
        params = load_yaml((worktree / "params.yaml").read_text())
        pinned = bool(params.get("cpu_reproducible", False))  # the keys' default where the run predates them
        expected = expectation(record, hardware.fingerprint(), mode_threads(params.get("threads")) if pinned
                               else _threads_unpinned(params.get("threads")), pinned,
                               bool(params.get("gpu_deterministic", False)))
        outputs = [{"path": path, "kind": output_kind(path, params), "recorded": md5, "reproduced": again.get(path),
                    "identical": again.get(path) == md5} for path, md5 in sorted(recorded.items())]
        reproduced = read_all(worktree / "metrics")
        metrics, taus = _metric_moves(record, reproduced), _taus(record, reproduced)
    finally:
        if not keep:
            _run(["git", "worktree", "remove", "--force", str(worktree)], repo)
    return Reproduction(outputs, metrics, worktree, expected, taus)


def _metric_moves(record, reproduced: dict[str, dict]) -> list[dict]:
    """Every numeric stage metric recorded in MLflow next to its value in the reproduction."""
    rows = []
    for stage, entry in sorted(record.stages.items()):
        fresh = reproduced.get(stage.replace("@", "-"), {})
        for name, value in sorted(entry.metrics.items()):
            new = fresh.get(name)
            if isinstance(new, (int, float)) and not isinstance(new, bool):
                rows.append({"stage": stage, "metric": name, "recorded": value, "reproduced": float(new),
                             "delta": float(new) - value})
    return rows


def _threads_unpinned(threads: int | None) -> int:
    """The thread count a stage without the reproducible mode runs with: `threads`, else torch's default."""
    import torch

    return threads or torch.get_num_threads()


def _taus(record, reproduced: dict[str, dict]) -> list[dict]:
    """Each eval's recorded tau and 95% interval beside the reproduced tau."""
    rows = []
    for name, stage in sorted(record.stages.items()):
        low, high = stage.metrics.get("tau_ci_low"), stage.metrics.get("tau_ci_high")
        again = reproduced.get(name.replace("@", "-"), {}).get("tau")
        if stage.stage == "eval" and low is not None and high is not None and again is not None:
            rows.append({"stage": name, "recorded": stage.metrics.get("tau"), "interval": f"{low:.3f}-{high:.3f}",
                         "reproduced": again, "inside": low <= again <= high})
    return rows


def summary(result: Reproduction) -> str:
    outputs = pd.DataFrame(result.outputs)
    metrics = pd.DataFrame(result.metrics)
    results = outputs[outputs["kind"] == "result"] if len(outputs) else outputs
    same = int(results["identical"].sum()) if len(results) else 0
    expected = ("the same bytes" if result.expected.same_bytes else "the figures only, each eval's tau inside its "
                "recorded 95% interval")
    verdict = "as expected" if result.as_expected else "NOT as expected"
    lines = [f"expected: {expected}: {result.expected.why}; {verdict}", "",
             f"data and model outputs identical: {same}/{len(results)} (metrics and reports carry wall times)", "",
             outputs.to_markdown(index=False) if len(outputs) else "",
             "", "metric moves (timings always move; model and data metrics should not):", "",
             metrics.to_markdown(index=False, floatfmt=".4g") if len(metrics) else "(none)", "",
             "tau against the recorded 95% interval:", "",
             pd.DataFrame(result.taus).to_markdown(index=False, floatfmt=".4f") if result.taus else "(no eval)"]
    return "\n".join(lines)


def as_json(result: Reproduction) -> str:
    return json.dumps({"expected": {"same_bytes": result.expected.same_bytes, "why": result.expected.why},
                       "as_expected": result.as_expected, "outputs": result.outputs, "metrics": result.metrics,
                       "taus": result.taus}, indent=2)
