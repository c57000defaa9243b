"""The report of `eagle3ops project`: the projection as markdown tables (per phase, totals, cost, the check
against a measured run) and the check as a bar chart."""
from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from eagle3ops.fs import PLOT, PROJECTION, check_output, write_text_atomic
from eagle3ops.runs.hardware_profiles import distinct
from eagle3ops.runs.projection import Check, Projection
from eagle3ops.runs.target_loads import target_loads

RESOURCE_NAMES = {"compute": "compute", "memory": "HBM", "interconnect": "interconnect", "disk": "disk",
                  "host": "host", "fixed": "fixed"}


def _num(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def render(projection: Projection) -> str:
    """The projection as markdown: a table per phase, totals and cost, then notes."""
    run, targets = projection.run, projection.targets
    headers = ["phase", "GPUs", "measured on", "pilot s"]
    for t in targets:
        headers += [f"{t.name} ({t.gpu_count} GPU) s", f"{t.name} bound"]
    table = []
    for row in projection.rows:
        line = [row.phase.name, "all" if row.phase.all_gpus else "1", row.pilot.name, _num(row.phase.measured_s)]
        for t in targets:
            e = row.estimates[t.name]
            line += [_num(e.seconds), RESOURCE_NAMES[e.dominant]]
        table.append(line)
    pilot_total = sum(row.phase.measured_s for row in projection.rows)
    table.append(["**total s**", "", "", _num(pilot_total), *(x for t in targets for x in (_num(projection.total_s(t)), ""))])
    table.append(["**total h**", "", "", _num(pilot_total / 3600),
                  *(x for t in targets for x in (_num(projection.total_s(t) / 3600), ""))])
    table.append(["**cost USD**", "", "", "", *(x for t in targets
                                                 for x in (f"${_num(projection.cost(t))}", f"at ${t.price_per_hour:g}/h"))])
    shape = (f"{projection.shape.layers} layers, hidden {projection.shape.hidden} ({projection.shape.source})"
             if projection.shape else "unknown")
    lines = [
        f"# Projection of pipeline run {run.name} ({run.run_id}) to {projection.samples:,} samples",
        "",
        f"Pilot: {projection.pilot_samples:,} samples; work ratio x{projection.work_ratio:.4g} for generate, extract "
        f"and train (load: x1; eval: x1, a fixed prompt set). Target shape: {shape}.",
        "",
        tabulate(table, headers, tablefmt="github", disable_numparse=True),
        "",
        "Model (docs/runs.md, \"The model, phase by phase\"): each phase's measured time is split over compute, HBM, "
        "interconnect, disk and the host's per-layer floor in proportion to their ideal times on the pilot's profile "
        "(demand from the run's counters / capacity), and each part is scaled by the capacity ratio and the work "
        "ratio; compiling is timed apart. \"bound\" = the resource with the largest ideal time on that profile. "
        "Cost = projected hours x the whole machine's price per hour.",
    ]
    profiles = distinct([row.pilot for row in projection.rows] + targets)
    lines += ["", "Profiles (figures and sources in their notes):"]
    lines += [f"- {p.name}: {p.gpu_count} x {p.gpu}; {p.bf16_tflops:g} TFLOP/s, {p.hbm_tb_s:g} TB/s HBM"
              + (f", {p.interconnect_gb_s:g} GB/s link" if p.interconnect_gb_s else "")
              + f" per GPU; disk {p.disk_gb_s:g} GB/s; ${p.price_per_hour:g}/h ({p.source})" for p in profiles]
    lines += _render_loads(projection)
    if projection.notes:
        lines += ["", *(f"Note: {note}" for note in projection.notes)]
    if projection.check is not None:
        lines += ["", *_render_check(projection.check)]
    return "\n".join(lines)


def _render_loads(projection: Projection) -> list[str]:
    """The target loads of a run as the pilot made them, and with a vLLM server per stage, at each profile's
    projected load time (the table counts one load: extract's)."""
    loads = target_loads(projection.run)
    if not loads.in_run:
        return []
    by_stage = ", ".join(f"{stage} {n}" for stage, n in loads.in_run.items() if n)
    lines = ["", f"Target loads a run: {loads.total} ({by_stage}); with a vLLM server of each stage's own "
                 f"(vllm.engine_idle_s 0): {loads.per_stage_total}. The table above counts one (extract's)."]
    load = next((row for row in projection.rows if row.phase.name == "load"), None)
    if load is not None:
        for t in projection.targets:
            each = load.estimates[t.name].seconds
            lines.append(f"- {t.name}: {_num(each)} s a load; loading a run: {_num(loads.total * each / 60)} min, "
                         f"{_num(loads.per_stage_total * each / 60)} min with a server per stage")
    return lines


def _render_check(check: Check) -> list[str]:
    def ratio(measured: float, projected: float | None) -> str:
        return f"{measured / projected:.2f}" if projected else "-"

    table = [[phase, target.name, _num(projected), _num(measured), ratio(measured, projected),
              _num(at_work) if at_work is not None else "-", ratio(measured, at_work)]
             for phase, target, projected, measured, at_work in check.rows]
    totals = [sum(r[i] for r in check.rows) for i in (2, 3)]
    at_work = None if any(r[4] is None for r in check.rows) else sum(r[4] for r in check.rows)
    table.append(["**total**", "", _num(totals[0]), _num(totals[1]), ratio(totals[1], totals[0]),
                  _num(at_work) if at_work is not None else "-", ratio(totals[1], at_work)])
    return [f"## Projection vs measured run {check.run.name} ({check.run.run_id}), {check.samples:,} samples", "",
            tabulate(table, ["phase", "ran on", "projected s", "measured s", "measured / projected",
                             "at its work s", "measured / at its work"], tablefmt="github", disable_numparse=True),
            "", "at its work = projected with the measured run's own counters instead of the pilot's times the "
            "work ratio (eval's verification steps follow the drafter's tau; tokens and decode steps a sample, the "
            "data): where the two ratios differ, the work was mispredicted, not the speed."]


def plot_check(projection: Projection, path: str | Path) -> None:
    """The check as bars: projected, projected at the run's own work, and measured seconds per phase (log scale)."""
    import matplotlib.pyplot as plt

    check = projection.check
    assert check is not None, "a projection checked against a measured run (check_against)"
    names = [row[0] for row in check.rows]
    series = {"projected": [row[2] for row in check.rows],
              "at its work": [row[4] if row[4] is not None else float("nan") for row in check.rows],
              "measured": [row[3] for row in check.rows]}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.2))
    width = 0.8 / len(series)
    for i, (label, seconds) in enumerate(series.items()):
        ax.bar([j + (i - 1) * width for j in range(len(names))], seconds, width, label=label, edgecolor="white")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(yscale="log", ylabel="seconds",
           title=f"Pilot {projection.run.name} projected to run {check.run.name} ({check.samples:,} samples), "
                 "and measured")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(projection: Projection, text: str, out: str | Path) -> None:
    """`project --out FILE.md`: the report and, checked against a measured run, the plot as FILE.png. Each
    replaces only what an earlier `project --out` wrote there (fs.PROJECTION, fs.PLOT); both are checked before
    either is written."""
    out = Path(out)
    plot = out.with_suffix(".png") if projection.check is not None else None
    check_output(out, PROJECTION)
    if plot:
        check_output(plot, PLOT)
    write_text_atomic(out, text + "\n", PROJECTION)
    if plot:
        plot_check(projection, plot)
