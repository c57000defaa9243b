"""Stage `report`: compare the variants (tau, per-position acceptance, stage timings) in markdown and PNG."""
from pathlib import Path

import pandas as pd

from eagle3ops.config import TRAIN_INITS, Config
from eagle3ops.fs import atomic_dir
from eagle3ops.metrics import PLOTS_DIR, read_all
from eagle3ops.reporting import acceptance_curve, markdown, plot
from eagle3ops.tracking import stage_run, tracking_uri


def run(cfg: Config) -> None:
    with stage_run(cfg, "report") as tracked:
        metrics = read_all()
        histories = {init: pd.read_csv(PLOTS_DIR / f"train-{init}.csv") for init in TRAIN_INITS
                     if (PLOTS_DIR / f"train-{init}.csv").is_file()}
        text = markdown(metrics, tracking_uri(cfg))
        with atomic_dir(cfg.report.out_dir) as out:
            (out / "summary.md").write_text(text)
            acceptance_curve(metrics).to_csv(out / "acceptance.csv", index=False)
            plot(metrics, histories, out / "comparison.png")
        tracked.log_artifact(Path(cfg.report.out_dir), "report")
        tracked.link_cached_stages()  # stages DVC skipped this time still show under this pipeline run
        for name in ("dvc.yaml", "params.yaml", "dvc.lock"):  # what `eagle3ops reproduce` needs
            if Path(name).is_file():
                tracked.log_pipeline_artifact(name, "lineage")
        print(text)
