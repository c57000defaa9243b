"""Stage `export`: train's drafter written in the layouts SGLang and vLLM load, each validated against the target
before it is written, with the launch commands in SERVING.md."""
from pathlib import Path

from eagle3ops.config import Config
from eagle3ops.formats.export import export_drafter, serving_guide
from eagle3ops.fs import atomic_dir
from eagle3ops.tracking.metrics import record
from eagle3ops.tracking.run import stage_run


def run(cfg: Config) -> None:
    drafter, out_dir = Path(cfg.train.out_dir) / cfg.export.drafter, Path(cfg.export.out_dir)
    with stage_run(cfg, "export", inputs=[drafter, cfg.target.lineage_dep]) as tracked:
        with tracked.phase("export"), atomic_dir(out_dir) as out:
            reports = {fmt: export_drafter(drafter, out / fmt, fmt, cfg.target.path, served_as=out_dir / fmt)
                       for fmt in cfg.export.formats}
            (out / "SERVING.md").write_text(serving_guide(reports, drafter, cfg.target.path), encoding="utf-8")
        for report in reports.values():
            print(report.render(), flush=True)
        tracked.log_artifact(out_dir / "SERVING.md", "export")
        sizes = {f"{fmt}_mb": round(sum(f.stat().st_size for f in (out_dir / fmt).iterdir()) / 2**20, 3)
                 for fmt in reports}
        record(tracked, "export", {"warnings": sum(len(r.warnings) for r in reports.values()), **sizes})
