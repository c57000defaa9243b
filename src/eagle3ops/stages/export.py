"""Stage `export`: the champion among train's drafters (or the one export.drafter names) written in the layouts
SGLang and vLLM load, each validated against the target before it is written, with the launch commands in
export.guide (SERVING.md); with export.serve, the speculators export's weights then loaded into the run's vLLM
engine session (the one eval measured the drafters on; serving/session.py): the stage fails unless vLLM drafts
with them. `eagle3ops validate-export --serve` serves an export exactly as SERVING.md prints it."""
from pathlib import Path

from eagle3ops.config import Config, TrainInit
from eagle3ops.decoding.results import EvalResult
from eagle3ops.decoding.served import SMOKE_PROMPTS, drafts_in_session
from eagle3ops.errors import InputError
from eagle3ops.formats.export import export_drafter, serving_guide
from eagle3ops.fs import atomic_dir, write_text_atomic
from eagle3ops.tracking.metrics import METRICS_DIR, read_metrics, record
from eagle3ops.tracking.run import stage_run


def champion() -> tuple[str, str]:
    """The trained drafter with the best tau in this pipeline's eval, leaving out any that changed the target's
    output; and why, in words."""
    evals = {init: EvalResult.read(m, f"{METRICS_DIR}/eval-{init}.json (stage eval@{init})") for init in TrainInit
             if (m := read_metrics([f"eval-{init}"]).get(f"eval-{init}"))}
    taus = {init: r.primary.tau for init, r in evals.items() if r.output_check is None or r.output_check.lossless}
    if not taus and evals:  # each has an output check, and it failed
        changed = ", ".join(f"metrics/eval-{init}.json ({r.output_check.changed_prompts} of {r.prompts} prompts)"
                            for init, r in evals.items())
        raise InputError(f"export.drafter champion: every drafter changed the target's greedy output beyond a near-tie "
                         f"of its logits: {changed}; the eval log names each prompt and token. A drafter cannot "
                         "change what the target verifies: look for a decoder or target defect first (the baseline, "
                         "metrics/eval-baseline.json, shows whether it is the drafters); to export regardless, set "
                         "export.drafter to scratch or warm_start")
    if not taus:
        raise InputError("export.drafter champion: neither metrics/eval-scratch.json nor metrics/eval-warm_start.json "
                         "holds a tau; run the eval stages, or set export.drafter to scratch or warm_start")
    best = max(taus, key=taus.get)
    return best, "champion: " + ", ".join(f"{init} tau {tau:.3f}" for init, tau in sorted(taus.items(),
                                                                                          key=lambda item: -item[1]))


def run(cfg: Config) -> None:
    chosen, why = champion() if cfg.export.drafter == "champion" else (str(cfg.export.drafter), "export.drafter")
    drafter, out_dir = Path(cfg.train.out_dir) / chosen, Path(cfg.export.out_dir)
    print(f"export: {chosen} ({why})", flush=True)
    with stage_run(cfg, "export", inputs=[drafter, cfg.target.lineage_dep]) as tracked:
        tracked.set_tags({"eagle3ops.export.drafter": chosen})
        with tracked.phase("export"), atomic_dir(out_dir) as out:
            reports = {fmt: export_drafter(drafter, out / fmt, fmt, cfg.target.path, served_as=out_dir / fmt,
                                           vllm=cfg.vllm)
                       for fmt in cfg.export.formats}
        write_text_atomic(cfg.export.guide, serving_guide(reports, drafter, cfg.target.path))
        for report in reports.values():
            print(report.render(), flush=True)
        tracked.log_artifact(cfg.export.guide, "export")
        sizes = {f"{fmt}_mb": round(sum(f.stat().st_size for f in (out_dir / fmt).iterdir()) / 2**20, 3)
                 for fmt in reports}
        served = {}
        if cfg.export.serve and "speculators" in reports:
            with tracked.phase("serve"):
                served = drafts_in_session(out_dir / "speculators", cfg.target.path, cfg.target.dtype, cfg.seed,
                                           cfg.vllm)
            print(f"export: vLLM drafted with {out_dir / 'speculators'}: {served['served_drafts']} draft steps, "
                  f"tau {served['served_tau']:.3f} on {len(SMOKE_PROMPTS)} prompts", flush=True)
        record(tracked, "export", {"warnings": sum(len(r.warnings) for r in reports.values()), **sizes, **served})
