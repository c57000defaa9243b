"""`eagle3ops compare`: recorded pipeline runs side by side, read back from MLflow.

Answers "which drafter reaches what tau" (scratch vs warm start vs the baseline used as-is) and "what does each phase
cost on which hardware" (stay local or rent). Everything works on `PipelineRecord`s (runs/records.py); `command` is the CLI.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from eagle3ops.config import EvalDrafter
from eagle3ops.decoding.results import Acceptance
from eagle3ops.errors import InputError, UsageError
from eagle3ops.fs import COMPARISON, atomic_dir, check_output
from eagle3ops.reporting.summary import markdown_table
from eagle3ops.runs.phases import PHASES, Phase
from eagle3ops.runs.records import FINISHED, PipelineRecord, find_pipelines, load_pipeline, unfinished_pipelines
from eagle3ops.tracking.run import LOAD_METRIC
from eagle3ops.tracking.store import ROLE_TAG

DEFAULT_LAST = 5
DRAFTER_STAGES = ("train", "eval")  # the stages run once per drafter; the others are shared by all drafters


def header(record: PipelineRecord) -> str:
    return f"{record.name} ({record.hardware_label})"


def _keep_variants(record: PipelineRecord, variants: Sequence[str]) -> PipelineRecord:
    """The record without the train/eval stages of the drafters not in `variants`."""
    stages = {name: stage for name, stage in record.stages.items()
              if stage.stage not in DRAFTER_STAGES or stage.variant in variants}
    return dataclasses.replace(record, stages=stages)


def _on_hardware(record: PipelineRecord, labels: Sequence[str]) -> bool:
    """A stage the run did itself ran on one of `labels`. (Not `hardware_label`: it joins several labels with "+",
    and a label of mixed GPUs has a "+" of its own.)"""
    return any(s.tags.get("hardware.label") in labels for s in record.stages.values() if not s.cached)


def _pipeline(client: MlflowClient, run_id: str) -> PipelineRecord:
    record = load_pipeline(client, run_id)
    if record.tags.get(ROLE_TAG) != "pipeline":
        raise InputError(f"run {run_id} is not a pipeline run (tag {ROLE_TAG} = pipeline); pass the parent run's id")
    return record


def select_pipelines(client: MlflowClient, experiment: str = "eagle3ops", filter_string: str = "",
                     run_ids: Sequence[str] = (), hardware: Sequence[str] = (), variants: Sequence[str] = (),
                     last: int | None = DEFAULT_LAST) -> list[PipelineRecord]:
    """`run_ids` in the order given (the first is the reference), else the experiment's pipeline runs matching
    `filter_string`, newest first; then only runs on one of the `hardware` labels and runs that recorded one of
    the `variants` (drafters), showing only those drafters; at most `last` runs (None: all)."""
    if run_ids:
        records = [_pipeline(client, run_id) for run_id in run_ids]
    else:  # finished runs only: a running one has no report yet, a failed one stopped midway
        # Hardware and variants are only known once a run's stages are loaded: then read more than `last`.
        limit = 1000 if hardware or variants or last is None else last
        finished = f"{filter_string} and {FINISHED}" if filter_string else FINISHED
        records = find_pipelines(client, experiment, finished, max_results=limit)
    if hardware:
        records = [r for r in records if _on_hardware(r, hardware)]
    if variants:
        records = [_keep_variants(r, variants) for r in records
                   if any(s.stage in DRAFTER_STAGES and s.variant in variants for s in r.stages.values())]
    return records[:last]


def _params(record: PipelineRecord) -> dict[str, str]:
    """The pipeline's params as its report logged them; for a pipeline without them (no report yet), those of
    its stages."""
    if record.params:
        return record.params
    merged: dict[str, str] = {}
    for stage in record.stages.values():
        merged.update({k: v for k, v in stage.params.items() if not k.startswith("target_identity.")})
    return merged


def differing_params(records: Sequence[PipelineRecord]) -> pd.DataFrame:
    """One row per param whose value is not the same in every run (missing counts as different), one column
    per run: what explains the differences below it."""
    params = [_params(r) for r in records]
    keys = sorted({key for p in params for key in p} - {"overrides"})
    rows = {key: [p.get(key, "-") for p in params] for key in keys if len({p.get(key) for p in params}) > 1}
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=[header(r) for r in records], dtype=object)
    frame.index.name = "param"
    return frame


def _acceptance(record: PipelineRecord, drafter: str) -> Acceptance | None:
    """The drafter's acceptance as the run's eval of it logged it; None where it has none."""
    stage = record.stages.get(f"eval@{drafter}")
    return None if stage is None else Acceptance.from_mlflow(stage.metrics)


def _interval(measured: Acceptance | None) -> tuple[float | None, float | None]:
    return measured.interval if measured and measured.interval else (None, None)


def side_by_side(records: Sequence[PipelineRecord]) -> pd.DataFrame:
    """One column per run: tau and per-position acceptance per drafter, then seconds and tokens/s per phase.
    Rows no run recorded are left out."""
    rows: dict[str, list[float | None]] = {}
    for drafter in EvalDrafter:
        measured = [_acceptance(r, drafter) for r in records]
        rows[f"{drafter} tau"] = [m.tau if m else None for m in measured]
        intervals = [_interval(m) for m in measured]
        rows[f"{drafter} tau 95% low"] = [low for low, _ in intervals]
        rows[f"{drafter} tau 95% high"] = [high for _, high in intervals]
        shares = [m.per_position if m else () for m in measured]
        for i in range(max(map(len, shares), default=0)):
            rows[f"{drafter} a{i + 1}"] = [s[i] if i < len(s) else None for s in shares]
    for phase in PHASES:
        rows[f"{phase.name} s"] = [phase.seconds(r) for r in records]
        if phase.rate_metric:
            rows[f"{phase.name} tok/s"] = [phase.rate(r) for r in records]
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=[header(r) for r in records], dtype=float)
    frame.index.name = "metric"
    return frame.dropna(how="all")


def _same_run(stage: str, a: PipelineRecord, b: PipelineRecord) -> bool:
    """Both pipelines show one stage run (DVC skipped the stage in one of them): one measurement, not two."""
    first, second = a.stages.get(stage), b.stages.get(stage)
    return first is not None and second is not None and first.run_id == second.run_id


def _speedup(phase: Phase, reference: PipelineRecord, other: PipelineRecord) -> float | None:
    if _same_run(phase.stage, reference, other):
        return None
    # Throughput where the phase has one, so runs over different amounts of data still compare fairly.
    if phase.rate_metric:
        ref, run = phase.rate(reference), phase.rate(other)
        return run / ref if ref and run else None
    ref, run = phase.seconds(reference), phase.seconds(other)
    return ref / run if ref and run else None


def speedups(records: Sequence[PipelineRecord]) -> pd.DataFrame:
    """How many times faster than the first run (the reference) each other run is, per phase (> 1 = faster)."""
    reference, others = records[0], records[1:]
    rows = {phase.name: [_speedup(phase, reference, other) for other in others] for phase in PHASES}
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=[header(r) for r in others], dtype=float)
    return frame.dropna(how="all")


LOAD_WARNING_RATIO = 1.5  # runs on one hardware label this far apart in speed: the machine, not the change?


def _load(record: PipelineRecord, stage: str) -> str:
    load = record.metric(stage, LOAD_METRIC)
    return "not recorded" if load is None else f"{load:.2f}"


def load_warnings(records: Sequence[PipelineRecord]) -> list[str]:
    """Phases whose speed differs by more than LOAD_WARNING_RATIO between the reference and a run on the same
    hardware label, with the machine's load per core as each stage ended: on the same hardware such a gap is
    more often a busy machine than the change made."""
    reference, ratios, warnings = records[0], speedups(records), []
    for other in records[1:]:
        if other.hardware_label != reference.hardware_label or header(other) not in ratios:
            continue
        for phase in PHASES:
            ratio = ratios[header(other)].get(phase.name)
            if ratio is None or pd.isna(ratio) or 1 / LOAD_WARNING_RATIO <= ratio <= LOAD_WARNING_RATIO:
                continue
            warnings.append(f"{phase.name}: {header(other)} is {max(ratio, 1 / ratio):.1f}x "
                            f"{'faster' if ratio > 1 else 'slower'} than {header(reference)} on the same hardware "
                            f"label; machine load per core {_load(other, phase.stage)} vs "
                            f"{_load(reference, phase.stage)}. Re-run on an idle machine before reading it as a "
                            f"speed-up.")
    return warnings


def _tau_deltas(reference: PipelineRecord, other: PipelineRecord) -> list[str]:
    deltas = []
    for drafter in EvalDrafter:
        ref, run = _acceptance(reference, drafter), _acceptance(other, drafter)
        if ref and run and not _same_run(f"eval@{drafter}", reference, other):
            deltas.append(f"{drafter} {run.tau - ref.tau:+.2f} tau{_overlap(ref, run)}")
    return deltas


def _overlap(reference: Acceptance, other: Acceptance) -> str:
    """Whether the two runs' 95% intervals of tau overlap: then the change is not clearly more than noise."""
    if not (reference.interval and other.interval):
        return ""
    (low_a, high_a), (low_b, high_b) = reference.interval, other.interval
    return " (95% intervals overlap: within noise)" if low_a <= high_b and low_b <= high_a else ""


def against_reference(records: Sequence[PipelineRecord]) -> list[str]:
    """One line per run after the first: its speed-up per phase and its tau change per drafter."""
    ratios = speedups(records)
    lines = []
    for other in records[1:]:
        times = [f"{phase} {r:.1f}x faster" if r >= 1 else f"{phase} {1 / r:.1f}x slower"
                 for phase, r in ratios[header(other)].dropna().items()]
        parts = [", ".join(part) for part in (times, _tau_deltas(records[0], other)) if part]
        lines.append(f"{header(other)}: {'; '.join(parts) or 'nothing measured in both runs'}")
    return lines


def within_runs(records: Sequence[PipelineRecord]) -> list[str]:
    """warm_start against scratch inside each run, with the optimizer steps each took to get there."""
    lines = []
    for record in records:
        warm, scratch = _acceptance(record, "warm_start"), _acceptance(record, "scratch")
        if warm is None or scratch is None:
            continue
        warm_steps, scratch_steps = record.metric("train@warm_start", "steps"), record.metric("train@scratch", "steps")
        line = f"{header(record)}: warm_start {warm.tau - scratch.tau:+.2f} tau vs scratch"
        if warm_steps is not None and scratch_steps is not None:
            line += (f" at the same steps ({warm_steps:,.0f})" if warm_steps == scratch_steps
                     else f" at {warm_steps:,.0f} vs {scratch_steps:,.0f} steps")
        lines.append(line)
    return lines


def _rounded(table: pd.DataFrame) -> pd.DataFrame:
    """Each row to its unit's precision (tau and acceptance 3 decimals, seconds 2, tokens/s whole): one floatfmt
    for the whole table cannot fit them all."""
    def decimals(label: str) -> int:
        return 0 if label.endswith("/s") else 2 if label.endswith(" s") else 3

    return table.apply(lambda row: row.round(decimals(row.name)), axis=1)


def markdown(records: Sequence[PipelineRecord]) -> str:
    table = _rounded(side_by_side(records)).reset_index()
    cached = [f"{header(r)}: {', '.join(s.dvc_stage for s in r.stages.values() if s.cached)}"
              for r in records if any(s.cached for s in r.stages.values())]
    lines = ["# eagle3ops compare", ""]
    if len(records) > 1:
        differing = differing_params(records)
        lines += ["## What differs", "", markdown_table(differing.reset_index(), "") if not differing.empty
                  else "The runs have the same params.", ""]
    warnings = load_warnings(records)
    if warnings:
        lines += ["## Warnings", "", *(f"- {line}" for line in warnings), ""]
    lines += ["## Side by side", "", markdown_table(table, ",.10g"), "",
             "tau = tokens per target verification step (bonus token included); tau 95% low/high = its bootstrap "
             "interval over the prompts; a_i = share of steps whose i-th "
             "draft was accepted; s = seconds of the phase; tok/s = its tokens per second (eval: speculative "
             "decoding); load = loading the target, as the extract stage times it.", ""]
    if cached:
        lines += ["Stages DVC skipped (their values are those of the run that produced the outputs): "
                  + "; ".join(cached) + ".", ""]
    lines += [f"## Against {header(records[0])}", "", "Speed-ups use tokens/s where the phase has it (load: time).",
              "", *(f"- {line}" for line in against_reference(records) or ["(one run selected)"]), ""]
    within = within_runs(records)
    if within:
        lines += ["## Within each run", "", *(f"- {line}" for line in within), ""]
    lines += [f"Again: `eagle3ops compare --runs {' '.join(r.run_id for r in records)}`", ""]
    return "\n".join(lines)


# A drafter's line style in the per-position panel; colour is the run's, in every panel
DRAFTER_STYLES = {"baseline": ":", "scratch": "--", "warm_start": "-"}


def draw(records: Sequence[PipelineRecord]) -> plt.Figure:
    """Three panels, one colour per run throughout (the legend of the first names them): tau per drafter as
    grouped bars with their 95% intervals; acceptance at each draft position, a line per run and drafter (the
    drafter by line style); seconds per phase, a bar per run (log scale)."""
    fig, (taus, positions, phases_axis) = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [5, 4, 6]})
    colours = {header(r): plt.cm.tab10(i % 10) for i, r in enumerate(records)}
    width = 0.8 / len(records)

    def offset(i: int) -> float:  # run i's bar within its group
        return (i - (len(records) - 1) / 2) * width

    drafters = [d for d in EvalDrafter if any(_acceptance(r, d) for r in records)]
    for i, run in enumerate(records):
        measured = [_acceptance(run, d) for d in drafters]
        values = [m.tau if m else None for m in measured]
        intervals = [_interval(m) for m in measured]
        lows, highs = [low for low, _ in intervals], [high for _, high in intervals]
        xs = [j + offset(i) for j in range(len(drafters))]
        heights = [v if v is not None else float("nan") for v in values]
        errors = [[v - lo if None not in (v, lo) else 0 for v, lo in zip(values, lows)],
                  [hi - v if None not in (v, hi) else 0 for v, hi in zip(values, highs)]]
        taus.bar(xs, heights, width, yerr=errors, capsize=3, color=colours[header(run)], edgecolor="white",
                 label=header(run))
        for x, value, high in zip(xs, values, highs):
            if value is not None:  # above the interval, where the error bar does not cross it
                taus.annotate(f"{value:.2f}", (x, max(value, high or value)), textcoords="offset points",
                              xytext=(0, 2), ha="center", va="bottom", fontsize=7,
                              rotation=90 if len(records) > 3 else 0)
    taus.set_xticks(range(len(drafters)), drafters)
    taus.set(title="tau per drafter (95% interval)", ylabel="tau (tokens per verification)")
    taus.set_ylim(bottom=1.0)  # tau is at least 1 (the target's own token): the bars show what the drafts add
    taus.legend(fontsize=8, title="run (hardware label)", title_fontsize=8)

    for run in records:
        for drafter in drafters:
            measured = _acceptance(run, drafter)
            if measured is None:
                continue
            rates = list(measured.per_position)
            positions.plot(range(1, len(rates) + 1), rates, DRAFTER_STYLES[drafter], marker="o",
                           color=colours[header(run)])
    for drafter in drafters:  # the styles' legend, in no run's colour
        positions.plot([], [], DRAFTER_STYLES[drafter], color="grey", label=drafter)
    positions.set(title="acceptance by draft position", xlabel="draft position", ylabel="acceptance rate a_i",
                  ylim=(0, 1))
    positions.xaxis.get_major_locator().set_params(integer=True)
    positions.legend(fontsize=8)

    phases = [p for p in PHASES if any(p.seconds(r) for r in records)]
    for i, run in enumerate(records):
        heights = [p.seconds(run) or float("nan") for p in phases]
        phases_axis.bar([j + offset(i) for j in range(len(phases))], heights, width, color=colours[header(run)],
                        edgecolor="white", label=header(run))
    phases_axis.set_xticks(range(len(phases)), [p.name for p in phases], rotation=30, ha="right")
    phases_axis.set(title="phase time", ylabel="seconds", yscale="log")
    fig.tight_layout()
    return fig


def plot(records: Sequence[PipelineRecord], path: Path) -> None:
    fig = draw(records)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records: Sequence[PipelineRecord], out_dir: Path) -> str:
    """compare.md, compare.csv (the side-by-side table, full precision), params.csv (the params that differ) and
    compare.png, in `out_dir` as a whole: it replaces a previous comparison, and refuses a directory holding
    anything else (fs.COMPARISON); returns the markdown."""
    text = markdown(records)
    with atomic_dir(out_dir, COMPARISON) as out:
        (out / "compare.md").write_text(text)
        side_by_side(records).to_csv(out / "compare.csv")
        differing_params(records).to_csv(out / "params.csv")
        plot(records, out / "compare.png")
    return text


def command(store: str, experiment: str, filter_string: str, run_ids: Sequence[str], hardware: Sequence[str],
            variants: Sequence[str], last: int | None, out: Path) -> int:
    """`eagle3ops compare`: select from the tracking store `store` as select_pipelines does (`last` None: all of
    `run_ids`, else DEFAULT_LAST), write the report into `out` and print it. Raises UsageError for a filter or run
    id that selects nothing it can read, InputError when no run matches, fs.NotOursError (before reading a run)
    when `out` holds anything but a comparison."""
    check_output(out, COMPARISON)
    client = MlflowClient(store)
    try:
        records = select_pipelines(client, experiment, filter_string, run_ids, hardware, variants,
                                   last or (None if run_ids else DEFAULT_LAST))
    except (InputError, MlflowException) as err:  # a bad filter or run id
        raise UsageError(str(err)) from None
    skipped = [] if run_ids else unfinished_pipelines(
        client, experiment, filter_string, min((r.start_time for r in records), default=0))
    if skipped:
        print(f"eagle3ops compare: left out {len(skipped)} pipeline run(s) not finished (compare them by id with "
              f"--runs): {'; '.join(skipped)}", file=sys.stderr)
    if not records:
        raise InputError("no finished pipeline runs match")
    print(write_report(records, out))
    return 0
