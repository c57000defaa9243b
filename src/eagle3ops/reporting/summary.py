"""Comparison of the pipeline's variants: a markdown table, a CSV for `dvc plots`, and a PNG."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt
import pandas as pd

from eagle3ops.config import EvalDrafter, TrainInit
from eagle3ops.decoding.results import Acceptance, Decoded, EvalResult, OutputCheck
from eagle3ops.tracking.metrics import METRICS_DIR

# The pipeline's stages whose metrics the report reads (the zoo stands in for models a user already has)
STAGES = ("generate", "prepare", "extract", *(f"train-{i}" for i in TrainInit), "target_speed",
          *(f"eval-{d}" for d in EvalDrafter))
COLORS = dict(zip(EvalDrafter, ("#999999", "#1f77b4", "#ff7f0e")))


def temperature_label(temperature: float) -> str:
    """T=0, T=1, T=0.7: how the report names the temperature a figure was measured at."""
    return f"T={temperature:g}"


def _evals(metrics: dict[str, dict]) -> dict[str, EvalResult]:
    return {d: EvalResult.read(metrics[f"eval-{d}"], f"{METRICS_DIR}/eval-{d}.json (stage eval@{d})")
            for d in EvalDrafter if f"eval-{d}" in metrics}


def _measurements(result: EvalResult) -> list[Decoded]:
    """An eval's measurements: the primary one, then the one at eval.sampled_temperature."""
    return [result.primary, result.sampled] if result.sampled else [result.primary]


def _at(measured: Decoded) -> str:
    return temperature_label(measured.temperature)


def _label(measurements: list[Decoded]) -> str | None:
    """The temperature label of these measurements, several joined by "/" where they differ; None for none."""
    labels = list(dict.fromkeys(_at(m) for m in measurements))
    return "/".join(labels) if labels else None


def _lossless(check: OutputCheck) -> str:
    """yes; yes with the prompts that part from the target's output at a near-tie of its logits (rounding, not the
    drafter: decoding/evaluation.py, Parting); or NO with the prompts that part beyond it."""
    if not check.lossless:
        return f"NO ({check.changed_prompts} prompts)"
    near_ties = check.near_tie_prompts
    return f"yes ({near_ties} near-tie{'s' * (near_ties != 1)})" if near_ties else "yes"


def _interval(m: Acceptance) -> str:
    return f"{m.interval[0]:.2f}-{m.interval[1]:.2f}" if m.interval else "not measured"


def acceptance_table(metrics: dict[str, dict]) -> pd.DataFrame:
    """Per drafter: tau with its 95% interval at eval.temperature (the primary measurement) and, where the eval
    measured it, at eval.sampled_temperature; tau on vLLM (at the primary temperature), losslessness (greedy)
    and draft-vocabulary coverage."""
    evals = _evals(metrics)
    primary = _label([r.primary for r in evals.values()])
    sampled = _label([r.sampled for r in evals.values() if r.sampled])
    rows = []
    for drafter, r in evals.items():
        row = {"drafter": drafter, f"tau {primary}": r.primary.tau, f"{primary} 95% CI": _interval(r.primary)}
        if sampled:
            row.update({f"tau {sampled}": r.sampled.tau if r.sampled else None,
                        f"{sampled} 95% CI": _interval(r.sampled) if r.sampled else "not measured"})
        rows.append({**row, **({f"tau vLLM {primary}": r.vllm.tau} if r.vllm else {}),
                     # not checked: sampled, or on an engine
                     "lossless": _lossless(r.output_check) if r.output_check else "not checked",
                     "vocab coverage": r.target_alone.draft_vocab_coverage if r.target_alone else None})
    return pd.DataFrame(rows)


def position_table(metrics: dict[str, dict]) -> pd.DataFrame:
    """Per drafter and temperature (the primary, then the sampled one): acceptance by draft position, beside the
    trained drafter's step-0 accuracy on held-out data (a temperature-free figure: on the primary row)."""
    rows = []
    for drafter, r in _evals(metrics).items():
        acc_0 = metrics.get(f"train-{drafter}", {}).get("eval/acc_0")
        for measured in _measurements(r):
            rows.append({"drafter": drafter, "temperature": _at(measured),
                         **{f"a{i}": share for i, share in enumerate(measured.per_position, 1)},
                         "ttt acc_0 (held-out)": acc_0 if measured is r.primary else None})
    return pd.DataFrame(rows)


def target_alone_tokens_per_s(metrics: dict[str, dict]) -> float | None:
    """The target served alone on vLLM, as the stage target_speed measured it."""
    return metrics.get("target_speed", {}).get("tokens_per_s")


def _target_alone_hardware(metrics: dict[str, dict]) -> str | None:
    return metrics.get("target_speed", {}).get("vllm", {}).get("hardware")


def served_speedups(metrics: dict[str, dict]) -> dict[str, float]:
    """Per drafter served on vLLM: its tokens/s over the target's alone, where both ran on the same hardware (by
    its label)."""
    alone, where = target_alone_tokens_per_s(metrics), _target_alone_hardware(metrics)
    return {drafter: round(r.vllm.tokens_per_s / alone, 3) for drafter, r in _evals(metrics).items()
            if r.vllm and alone and r.vllm.hardware == where}


def served_table(metrics: dict[str, dict]) -> pd.DataFrame:
    """Per drafter measured on vLLM (eval.engine): its acceptance from vLLM's counters beside the decoder's, whether
    its greedy output is the target's, and the served speed with it against the target alone on this hardware."""
    rows, speedups, alone = [], served_speedups(metrics), target_alone_tokens_per_s(metrics)
    for drafter, r in _evals(metrics).items():
        served = r.vllm
        if served is None:
            continue
        equal = served.greedy_equal_prompts
        rows.append({"drafter": drafter, "tau decoder": r.primary.tau, "tau vLLM": served.tau,
                     **{f"a{i} vLLM": share for i, share in enumerate(served.per_position, 1)},
                     "output = target's": f"{equal}/{r.prompts}" if equal is not None else "not checked",
                     "tok/s": served.tokens_per_s, "tok/s target alone": alone,
                     "speed-up": speedups.get(drafter),
                     "hardware": f"{served.hardware}, {served.concurrency} in flight"})
    return pd.DataFrame(rows)


def tau_by_set_table(metrics: dict[str, dict]) -> pd.DataFrame:
    """One row per benchmark set and temperature measured (the primary, then the sampled one), with its prompts
    and each drafter's tau; then the overall rows."""
    evals = _evals(metrics)
    at = {d: {_at(measured): measured for measured in _measurements(r)} for d, r in evals.items()}
    temperatures = list(dict.fromkeys(label for by_t in at.values() for label in by_t))
    names = list(dict.fromkeys(name for r in evals.values() for name in r.primary.tau_by_set))
    rows = [{"set": name, "temperature": t,
             "prompts": next((r.prompts_by_set[name] for r in evals.values() if name in r.prompts_by_set), None),
             **{d: by_t[t].tau_by_set.get(name) if t in by_t else None for d, by_t in at.items()}}
            for name in names for t in temperatures]
    if evals:
        rows += [{"set": "overall", "temperature": t, "prompts": next(iter(evals.values())).prompts,
                  **{d: by_t[t].tau if t in by_t else None for d, by_t in at.items()}} for t in temperatures]
    return pd.DataFrame(rows, columns=["set", "temperature", "prompts", *evals])


def plot_tau_by_set(metrics: dict[str, dict], path: Path) -> None:
    """Grouped bars: tau of every drafter on every benchmark set, and overall; at the sampled temperature hatched,
    beside the primary."""
    table = tau_by_set_table(metrics)
    drafters = [column for column in table.columns if column in list(EvalDrafter)]
    sets = list(dict.fromkeys(table["set"]))
    temperatures = list(dict.fromkeys(table["temperature"]))
    bars = [(drafter, t) for drafter in drafters for t in temperatures]
    width = 0.8 / max(1, len(bars))
    fig, ax = plt.subplots(figsize=(max(6.0, (0.9 + 0.2 * len(bars)) * len(sets) + 2), 4.2))
    for j, (drafter, t) in enumerate(bars):
        taus = table[table["temperature"] == t].set_index("set")[drafter].reindex(sets).astype(float)
        sampled = t != temperatures[0]
        drawn = ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in range(len(sets))], taus, width,
                       label=f"{drafter} {t}", color=COLORS[drafter], alpha=0.55 if sampled else 1.0,
                       hatch="//" if sampled else None)
        ax.bar_label(drawn, labels=["" if pd.isna(tau) else f"{tau:.2f}" for tau in taus], fontsize=7)
    ax.set_xticks(range(len(sets)), sets)
    ax.set(title="Acceptance length tau per benchmark set", ylabel="tokens per verification step")
    if bars:
        top = table[drafters].astype(float).max().max()
        ax.set_ylim(0, 1.3 * top if top > 0 else 1)  # room for the legend above the bars
        ax.legend(loc="upper left", ncol=min(len(bars), 3), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(metrics: dict[str, dict]) -> dict:
    """The pipeline run in a few numbers, for `metrics.json` (what `dvc exp show` puts first): tau per drafter (at
    eval.temperature, and at eval.sampled_temperature as tau_sampled), tau and the served speed-up measured on
    vLLM, the simulator's last tau per trained drafter, each stage's wall time and their sum."""
    times = {stage: metrics[stage]["time"]["stage_s"] for stage in STAGES if stage in metrics}
    evals = _evals(metrics)
    served = {drafter: r.vllm for drafter, r in evals.items() if r.vllm}
    sampled = {drafter: r.sampled.tau for drafter, r in evals.items() if r.sampled}
    return {"tau": {drafter: r.primary.tau for drafter, r in evals.items()},
            **({"tau_sampled": sampled} if sampled else {}),
            **({"tau_vllm": {drafter: s.tau for drafter, s in served.items()},
                "speedup_vllm": served_speedups(metrics)} if served else {}),
            "sim_tau": {init: metrics[f"train-{init}"]["sim/tau"] for init in TrainInit
                        if "sim/tau" in metrics.get(f"train-{init}", {})},
            "time_s": {**times, "total": round(sum(times.values()), 3)}}


def pipeline_metrics(metrics: dict[str, dict]) -> dict[str, float]:
    """The MLflow metrics of the pipeline run itself (its parent run): the headline (tau per drafter from the
    decoder, tau_sampled at eval.sampled_temperature, and, where measured, from vLLM, with vLLM's speed-up), and per
    drafter tau on each benchmark set, acceptance by draft position and losslessness (1 or 0; left out where it was
    not checked); the vLLM engines started behind these results (engine_starts)."""
    top = headline(metrics)
    flat = {f"tau/{drafter}": tau for drafter, tau in top["tau"].items()}
    flat.update({f"tau_sampled/{drafter}": tau for drafter, tau in top.get("tau_sampled", {}).items()})
    flat.update({f"tau_vllm/{drafter}": tau for drafter, tau in top.get("tau_vllm", {}).items()})
    flat.update({f"speedup_vllm/{drafter}": ratio for drafter, ratio in top.get("speedup_vllm", {}).items()})
    flat.update({f"sim_tau/{init}": tau for init, tau in top["sim_tau"].items()})
    flat.update({f"time/{stage}_s": seconds for stage, seconds in top["time_s"].items()})
    for drafter, r in _evals(metrics).items():
        flat.update({f"tau/{drafter}/{name}": tau for name, tau in r.primary.tau_by_set.items()})
        flat.update({f"a{i}/{drafter}": share for i, share in enumerate(r.primary.per_position, 1)
                     if share is not None})
        if r.output_check:
            flat[f"lossless/{drafter}"] = float(r.output_check.lossless)
    if starts := engine_starts(metrics):
        flat["vllm/engine_starts"] = float(sum(n for n, _ in starts.values()))
    return flat


def timing_table(metrics: dict[str, dict]) -> pd.DataFrame:
    rows = []
    for stage in STAGES:
        m = metrics.get(stage)
        if m is None:
            continue
        time = m.get("time", {})
        throughput = next((f"{m[key]:,.0f} {unit}" for key, unit in
                           (("tokens_per_s", "tok/s"), ("spec_tokens_per_s", "tok/s (speculative)")) if key in m), "")
        rows.append({"stage": stage, "wall s": time.get("stage_s"), "load s": time.get("load_s"),
                     # an eval's second decoding, at eval.sampled_temperature (part of its wall time)
                     "sampled s": time.get("decode_sampled_s"), "throughput": throughput})
    frame = pd.DataFrame(rows, columns=["stage", "wall s", "load s", "sampled s", "throughput"])
    return frame.drop(columns="sampled s") if frame["sampled s"].isna().all() else frame


def acceptance_by_position(metrics: dict[str, dict]) -> pd.DataFrame:
    """position, then one column per drafter: what `dvc plots` draws as one line per drafter."""
    curve = acceptance_curve(metrics)
    return curve.pivot(index="position", columns="drafter", values="acceptance").reset_index().rename_axis(None, axis=1)


def acceptance_curve(metrics: dict[str, dict]) -> pd.DataFrame:
    """Long form (drafter, position, acceptance), for the PNG."""
    rows = [{"drafter": d, "position": i, "acceptance": share} for d, r in _evals(metrics).items()
            for i, share in enumerate(r.primary.per_position, 1)]
    return pd.DataFrame(rows, columns=["drafter", "position", "acceptance"])


def plot(metrics: dict[str, dict], train_histories: dict[str, pd.DataFrame], path: Path) -> None:
    """tau per drafter at each temperature measured (the sampled one hatched) with its 95% interval, acceptance by
    draft position (the sampled one dashed), and the trained drafters' step-0 accuracy while training."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    evals = _evals(metrics)
    for offset, sampled in ((-0.2, False), (0.2, True)):
        shown = [(i, d, r.sampled if sampled else r.primary) for i, (d, r) in enumerate(evals.items())
                 if not sampled or r.sampled]
        if not shown:
            continue
        intervals = [m.interval or (m.tau, m.tau) for _, _, m in shown]
        errors = [[m.tau - low for (_, _, m), (low, _) in zip(shown, intervals)],
                  [high - m.tau for (_, _, m), (_, high) in zip(shown, intervals)]]
        bars = axes[0].bar([i + offset for i, _, _ in shown], [m.tau for _, _, m in shown], 0.4, yerr=errors,
                           capsize=3, color=[COLORS[d] for _, d, _ in shown], alpha=0.55 if sampled else 1.0,
                           hatch="//" if sampled else None)
        axes[0].bar_label(bars, fmt="%.2f", fontsize=8)
        axes[0].bar(0, 0, 0, color="white", edgecolor="black", hatch="//" if sampled else None,
                    label=_label([m for _, _, m in shown]))  # the legend's entry, in no drafter's colour
    axes[0].set_xticks(range(len(evals)), list(evals))
    axes[0].set(title="Acceptance length tau (95% CI)", ylabel="tokens per verification step")
    if evals:
        axes[0].legend(title="temperature")
    for drafter, r in evals.items():
        for measured in _measurements(r):
            shares = list(measured.per_position)
            if shares and None not in shares:  # an engine that gave no counts per position
                axes[1].plot(range(1, len(shares) + 1), shares, marker="o", color=COLORS[drafter],
                             label=f"{drafter} {_at(measured)}", linestyle="-" if measured is r.primary else "--")
    axes[1].set(title="Per-position acceptance", xlabel="draft position", ylabel="accepted share", ylim=(0, 1.05))
    axes[1].xaxis.get_major_locator().set_params(integer=True)
    if axes[1].lines:
        axes[1].legend(fontsize=8)
    for init, history in train_histories.items():
        if "train/acc_0" in history:
            axes[2].plot(history["step"], history["train/acc_0"], label=f"{init} acc_0")
    axes[2].set(title="Training: step-0 accuracy", xlabel="optimizer step", ylim=(0, 1.05))
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(frame: pd.DataFrame, floatfmt: str) -> str:
    """`frame` as a markdown table without its index; missing values show as "-"."""
    if frame.empty:
        return "(no results yet)"
    frame = frame.astype(object).where(frame.notna(), None)  # tabulate prints None as missingval, NaN as "nan"
    return frame.to_markdown(index=False, floatfmt=floatfmt, missingval="-")


TAU_BY_SET_PNG = "tau_by_set.png"  # beside summary.md in report.out_dir, and under report/ on the pipeline run


def described_in_mlflow(report: str, run_id: str | None) -> str:
    """The report as the pipeline run's description: its figure fetched from the run's own artifacts (a path
    relative to summary.md means nothing on the MLflow page), or left out where the run is not known yet; its
    tables' cells padded with non-breaking spaces (MLflow draws tables with no cell padding and lets no style
    through, so "0.107" and "0.000" of neighbouring cells ran together) where the padded report still fits
    MLflow's tag limit, which would cut it short."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH  # here: the bench renders its tables without MLflow

    image = f"![tau by set]({TAU_BY_SET_PNG})"
    if run_id is None:
        report = report.replace(image + "\n", "")
    else:
        report = report.replace(image, f"![tau by set](get-artifact?path=report/{TAU_BY_SET_PNG}&run_uuid={run_id})")
    padded = "\n".join(_padded_cells(line) for line in report.split("\n"))
    return padded if len(padded) <= MAX_TAG_VAL_LENGTH else report


def _padded_cells(line: str) -> str:
    """A markdown table row with each cell between non-breaking spaces; other lines (the |---| rule too) as they
    are."""
    if not line.startswith("|") or set(line) <= set("|:- "):
        return line
    cells = line.strip().strip("|").split("|")
    return "|" + "|".join(f"&nbsp;{cell.strip()}&nbsp;" for cell in cells) + "|"


def mlflow_ui_hint(tracking_uri: str, experiment_id: str | None = None) -> str:
    """Where to look at the runs: a tracking server is already a UI; a local store needs `mlflow ui`. The link
    opens the experiment's runs table in the model-training view (MLflow 3's UI opens experiments on its GenAI
    pages unless the link or the user's last choice says otherwise) through the saved view the pipeline keeps on
    the experiment: pipeline runs with tau per drafter as columns (tracking/store.py, RUNS_VIEW_STATE)."""
    from eagle3ops.tracking.store import RUNS_VIEW_KEY  # here: the bench renders its tables without MLflow

    page = (f"/#/experiments/{experiment_id}/runs?viewStateShareKey={RUNS_VIEW_KEY}&workflowType=machine_learning"
            if experiment_id else "")
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri.rstrip('/')}{page}"
    where = " in the repository" if tracking_uri == "sqlite:///mlflow.db" else ""
    return f"`mlflow ui --backend-store-uri {tracking_uri}`{where} then open http://127.0.0.1:5000{page}"


def engine_starts(metrics: dict[str, dict]) -> dict[str, tuple[int, float]]:
    """Per stage that served on vLLM in an engine session (the target alone, the evals, the export's check): the
    engines it started
    (0 where it found one running) and the seconds their starts took. A stage DVC did not re-run counts as it did
    when it ran."""
    starts = {}
    if "engine_starts" in (alone := metrics.get("target_speed", {})):
        starts["target_speed"] = (alone["engine_starts"], alone.get("engine_start_s", 0.0))
    starts.update({f"eval@{drafter}": (r.vllm.engine_starts, r.vllm.engine_start_s or 0.0)
                   for drafter, r in _evals(metrics).items() if r.vllm and r.vllm.engine_starts is not None})
    if "engine_started" in (export := metrics.get("export", {})):
        starts["export"] = (export["engine_started"], export.get("engine_start_s", 0.0))
    return starts


def engine_starts_line(metrics: dict[str, dict]) -> str | None:
    """The target loads behind these results, in a sentence: how many, by which stage, how long they took."""
    starts = engine_starts(metrics)
    if not starts:
        return None
    started = ", ".join(f"{stage} {n} in {s:.1f} s" for stage, (n, s) in starts.items() if n)
    found = ", ".join(stage for stage, (n, _) in starts.items() if not n) or "none"
    return (f"vLLM engines started for these results: {sum(n for n, _ in starts.values())}"
            f"{f' (by {started})' if started else ''}; found running (engine sessions): {found}.")


def _served_section(metrics: dict[str, dict]) -> list[str]:
    served = served_table(metrics)
    if served.empty:
        return []
    starts = engine_starts_line(metrics)
    return ["## Served on vLLM", "", markdown_table(served, ".3f"), "",
            "tau vLLM and a_i from vLLM's own spec-decode counters, the drafter served with the target as the export "
            "serves it, at eval.temperature only (the primary measurement; tau at eval.sampled_temperature is the "
            "decoder's); output = target's: prompts whose greedy output is token for token the target's own; tok/s: "
            "generated tokens per second over all prompts, the requests in flight together, with the drafter and "
            "the target alone (stage target_speed: once per target, prompts and engine settings); speed-up = their "
            "ratio, on this hardware.", "", *([note, ""] if (note := _elsewhere(metrics)) else []),
            *([starts, ""] if starts else [])]


def _elsewhere(metrics: dict[str, dict]) -> str | None:
    """Why a speed-up is missing: the target alone measured on other hardware than a drafter."""
    where = _target_alone_hardware(metrics)
    other = sorted({r.vllm.hardware for r in _evals(metrics).values() if r.vllm} - {where})
    if where is None or not other:
        return None
    return (f"No speed-up where the drafter was served on {', '.join(other)}: the target alone was measured on "
            f"{where} (set hardware.label to the same label, or `dvc repro -f -s target_speed` here).")


def markdown(metrics: dict[str, dict], tracking_uri: str, experiment_id: str | None = None,
             offline: bool = False) -> str:
    acceptance = acceptance_table(metrics)
    timings = timing_table(metrics)
    lines = ["# eagle3ops report", "", "## Acceptance on held-out prompts", "",
             markdown_table(acceptance, ".3f"), "",
             "tau = 1 + accepted drafts / verification steps (k drafts per step, bonus token included), at each "
             "sampling temperature T measured: eval.temperature (the primary measurement: the greedy output checked "
             "token for token against the target's, compared with vLLM, registered) and eval.sampled_temperature "
             "(the same prompts and seeds sampled, as users serve; lossless in distribution, not checked run by run); "
             "95% CI = its bootstrap interval over the prompts (two drafters whose intervals overlap are not "
             "clearly apart); vocab coverage = share of the target's tokens inside the drafter's vocabulary (a "
             "warm start keeps its own unless it is re-headed).", "",
             "### Acceptance by draft position", "", markdown_table(position_table(metrics), ".3f"), "",
             "a_i = share of verification steps whose i-th draft was accepted; ttt acc_0 = the "
             "trained drafter's step-0 accuracy on held-out training data.", "",
             "## Acceptance length tau per benchmark set", "", markdown_table(tau_by_set_table(metrics), ".3f"), "",
             f"![tau by set]({TAU_BY_SET_PNG})", "",
             *_served_section(metrics),
             "## Stage timings", "", markdown_table(timings, ".1f"), "",
             f"MLflow runs: {mlflow_ui_hint(tracking_uri, experiment_id)}" if not offline else
             f"MLflow runs: {tracking_uri} did not answer this pipeline run; its records wait in the outbox "
             f"(`eagle3ops sync` uploads them once it answers)", ""]
    return "\n".join(lines)
