"""`eagle3ops reproduce RUN_ID`: re-run a recorded pipeline run from scratch and say what came back the same.

The pipeline run's parent carries its git commit (tag) and, under `lineage/`, the dvc.yaml, params.yaml and
dvc.lock it ran with (logged by the report stage). A detached git worktree of that commit gets those three
files and an empty DVC cache, so `dvc repro` recomputes every stage; then each output's md5 is compared with
the recorded lock, and each stage metric with the recorded run.
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
from eagle3ops.runs.records import load_pipeline
from eagle3ops.tracking.lineage import load_yaml, lock_outputs
from eagle3ops.tracking.metrics import HEADLINE, METRICS_DIR, read_all

LINEAGE_FILES = ("dvc.yaml", "params.yaml", "dvc.lock")


@dataclass
class Reproduction:
    outputs: list[dict]  # path, kind, recorded md5, reproduced md5, identical
    metrics: list[dict]  # stage, metric, recorded, reproduced, delta
    worktree: Path

    @property
    def identical(self) -> bool:
        """Every data and model output came back byte for byte (metrics and reports hold wall times)."""
        return all(row["identical"] for row in self.outputs if row["kind"] == "result")


def _kind(path: str, params: dict) -> str:
    """timing: holds wall times; checkout: names the checkout's own paths (the serving guide); else result."""
    report_dir = (params.get("report") or {}).get("out_dir", "reports")
    if path == str(HEADLINE) or path.startswith((f"{METRICS_DIR}/", f"{report_dir.rstrip('/')}")):
        return "timing"
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
        outputs = [{"path": path, "kind": _kind(path, params), "recorded": md5, "reproduced": again.get(path),
                    "identical": again.get(path) == md5} for path, md5 in sorted(recorded.items())]
        metrics = _metric_moves(record, read_all(worktree / "metrics"))
    finally:
        if not keep:
            _run(["git", "worktree", "remove", "--force", str(worktree)], repo)
    return Reproduction(outputs, metrics, worktree)


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


def summary(result: Reproduction) -> str:
    outputs = pd.DataFrame(result.outputs)
    metrics = pd.DataFrame(result.metrics)
    results = outputs[outputs["kind"] == "result"] if len(outputs) else outputs
    same = int(results["identical"].sum()) if len(results) else 0
    lines = [f"data and model outputs identical: {same}/{len(results)} (metrics and reports carry wall times)", "", outputs.to_markdown(index=False) if len(outputs) else "",
             "", "metric moves (timings always move; model and data metrics should not):", "",
             metrics.to_markdown(index=False, floatfmt=".4g") if len(metrics) else "(none)"]
    return "\n".join(lines)


def as_json(result: Reproduction) -> str:
    return json.dumps({"outputs": result.outputs, "metrics": result.metrics}, indent=2)
