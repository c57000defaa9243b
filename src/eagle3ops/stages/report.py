"""Stage `report`: compare the variants (tau overall and per benchmark set at eval.temperature and at
eval.sampled_temperature, per-position acceptance, stage timings) in markdown, CSV and PNG; the headline in
metrics.json; and the pipeline run's own MLflow record (its parent run): the headline, the params that define
the pipeline and those set for it, the report."""
import tempfile
from pathlib import Path

import pandas as pd

from eagle3ops.config import Config, TrainInit
from eagle3ops.fs import atomic_dir, write_json_atomic
from eagle3ops.reporting.summary import (
    STAGES,
    TAU_BY_SET_PNG,
    acceptance_by_position,
    described_in_mlflow,
    headline,
    markdown,
    pipeline_metrics,
    plot,
    plot_tau_by_set,
    tau_by_set_table,
)
from eagle3ops.tracking import stage_view
from eagle3ops.tracking.lineage import params_overrides, pipeline_params
from eagle3ops.tracking.metrics import HEADLINE, PLOTS_DIR, destination, read_metrics
from eagle3ops.tracking.run import stage_run
from eagle3ops.tracking.store import project_root, scrub, shown_uri, tracking_uri


def run(cfg: Config) -> None:
    with stage_run(cfg, "report") as tracked:
        # the metrics dvc.yaml's stages write (the report depends on the directory): extract's only when the pipeline
        # has the stage, not a file an offline run left behind; the export's for its engine start
        metrics = read_metrics([*(stage for stage in STAGES if stage != "extract" or cfg.pipeline.extract), "export"])
        histories = {init: pd.read_csv(PLOTS_DIR / f"train-{init}.csv") for init in TrainInit
                     if (PLOTS_DIR / f"train-{init}.csv").is_file()}
        text = markdown(metrics, shown_uri(tracking_uri(cfg), project_root()), tracked.experiment_id,
                        offline=tracked.outbox is not None)
        out_dir = destination(tracked, Path(cfg.report.out_dir))
        with atomic_dir(out_dir) as out:
            (out / "summary.md").write_text(text)
            acceptance_by_position(metrics).to_csv(out / "acceptance.csv", index=False)
            plot(metrics, histories, out / "comparison.png")
            tau_by_set_table(metrics).to_csv(out / "tau_by_set.csv", index=False)
            plot_tau_by_set(metrics, out / TAU_BY_SET_PNG)
        write_json_atomic(destination(tracked, HEADLINE), headline(metrics))
        tracked.log_artifact(out_dir, "report")
        if not tracked.one_off:  # a one-off report describes no pipeline run
            _describe_pipeline(cfg, tracked, metrics, text)
        print(text)


def _describe_pipeline(cfg: Config, tracked, metrics: dict[str, dict], text: str) -> None:
    """The pipeline run's headline, params, report and lineage on its parent run, and the stages DVC skipped."""
    overrides = params_overrides(tracked.root)
    tracked.log_pipeline(pipeline_metrics(metrics), {
        **stage_view.pipeline_params(cfg, pipeline_params(tracked.root)),
        "overrides": "; ".join(f"{key}={value}" for key, value in sorted(overrides.items())) or "none"},
        described_in_mlflow(text, tracked.parent_id))
    tracked.log_pipeline_artifact(Path(cfg.report.out_dir), "report")
    tracked.link_cached_stages()  # stages DVC skipped this time still show under this pipeline run
    with tempfile.TemporaryDirectory() as lineage:  # what `eagle3ops reproduce` needs, passwords masked
        for name in ("dvc.yaml", "params.yaml", "dvc.lock"):
            if Path(name).is_file():
                (Path(lineage) / name).write_text(scrub(Path(name).read_text()))
                tracked.log_pipeline_artifact(Path(lineage) / name, "lineage")
