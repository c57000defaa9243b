"""Stage metrics: one JSON file per stage run under metrics/ (DVC metrics, not cached), mirrored to MLflow.

A stage's metrics are measurements: counts, rates, acceptance, times. Its settings are params (params.yaml,
dvc.lock, the MLflow run's params) and never repeated here."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from eagle3ops.fs import WORK_DIR, write_json_atomic

METRICS_DIR = Path("metrics")
PLOTS_DIR = Path("plots")
HEADLINE = Path("metrics.json")  # the report's few numbers: short column names in `dvc exp show` (tau.scratch)
ONE_OFF_DIR = WORK_DIR / "one-off"


def destination(run, path: Path) -> Path:
    """Where `run` writes one of the pipeline's files (metrics/, plots/, metrics.json): in place for a pipeline
    run, under .eagle3ops/one-off/ for a one-off run (`--set`, `--params`), which must not overwrite them."""
    if not run.one_off:
        return path
    return ONE_OFF_DIR / (path.absolute().relative_to(Path.cwd()) if path.is_absolute() else path)


def record(run, name: str, metrics: dict) -> dict:
    """Write metrics/<name>.json with the stage's phase timings, and log to the run the numbers it has not logged
    already (a true/false as 1/0)."""
    result = {**metrics, "time": {f"{phase}_s": round(seconds, 3) for phase, seconds in run.timings.items()}}
    result["time"]["stage_s"] = round(run.elapsed(), 3)
    write_json_atomic(destination(run, METRICS_DIR / f"{name}.json"), result)
    run.log_metrics({key: float(value) for key, value in metrics.items()
                     if isinstance(value, (int, float)) and key not in run.logged})
    return result


def read_all(directory: str | Path = METRICS_DIR) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(Path(directory).glob("*.json"))}


def read_metrics(names: Iterable[str], directory: str | Path = METRICS_DIR) -> dict[str, dict]:
    """{name: metrics/<name>.json} for the names whose file exists."""
    paths = {name: Path(directory) / f"{name}.json" for name in names}
    return {name: json.loads(path.read_text()) for name, path in paths.items() if path.is_file()}
