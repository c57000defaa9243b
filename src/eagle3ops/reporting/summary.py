"""Comparison of the pipeline's variants: a markdown table, a CSV for `dvc plots`, and a PNG."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt
import pandas as pd

from eagle3ops.config import EvalDrafter, TrainInit

# The pipeline's stages whose metrics the report reads (the zoo stands in for models a user already has)
STAGES = ("generate", "prepare", "extract", *(f"train-{i}" for i in TrainInit),
          *(f"eval-{d}" for d in EvalDrafter))
COLORS = dict(zip(EvalDrafter, ("#999999", "#1f77b4", "#ff7f0e")))


def draft_positions(eval_metrics: dict) -> int:
    """k, the draft tokens per verification, as the eval's accept_1..accept_k say."""
    return sum(1 for key in eval_metrics if key.startswith("accept_"))


def acceptance_table(metrics: dict[str, dict]) -> pd.DataFrame:
    rows = []
    for drafter in EvalDrafter:
        m = metrics.get(f"eval-{drafter}")
        if m is None:
            continue
        train = metrics.get(f"train-{drafter}", {})
        interval = (f"{m['tau_ci_low']:.2f}-{m['tau_ci_high']:.2f}" if "tau_ci_low" in m else "not measured")
        rows.append({"drafter": drafter, "tau": m["tau"], "tau 95% CI": interval,
                     **({"tau on vLLM": m["vllm"]["tau"]} if "vllm" in m else {}),
                     **{f"a{i}": m[f"accept_{i}"] for i in range(1, draft_positions(m) + 1)},
                     "lossless": ("yes" if m["lossless"] else f"NO ({m['mismatched_prompts']} prompts)")
                     if "lossless" in m else "not checked",  # sampled, or measured on an engine: no reference
                     "vocab coverage": m.get("draft_vocab_coverage"),
                     "ttt acc_0 (held-out)": train.get("eval/acc_0")})
    return pd.DataFrame(rows)


def target_alone_tokens_per_s(metrics: dict[str, dict]) -> float | None:
    """The target served alone on vLLM, as the baseline's eval measured it (once a pipeline: a server loads the
    whole target)."""
    return (metrics.get("eval-baseline", {}).get("vllm") or {}).get("target_alone_tokens_per_s")


def served_speedups(metrics: dict[str, dict]) -> dict[str, float]:
    """Per drafter served on vLLM: its tokens/s over the target's alone, on the same hardware."""
    alone = target_alone_tokens_per_s(metrics)
    return {drafter: round(m["vllm"]["tokens_per_s"] / alone, 3) for drafter in EvalDrafter
            if "vllm" in (m := metrics.get(f"eval-{drafter}", {})) and alone}


def served_table(metrics: dict[str, dict]) -> pd.DataFrame:
    """Per drafter measured on vLLM (eval.engine): its acceptance from vLLM's counters beside the decoder's, whether
    its greedy output is the target's, and the served speed with it against the target alone on this hardware."""
    rows, speedups, alone = [], served_speedups(metrics), target_alone_tokens_per_s(metrics)
    for drafter in EvalDrafter:
        m = metrics.get(f"eval-{drafter}", {})
        served = m.get("vllm")
        if served is None:
            continue
        equal = served.get("greedy_equal_prompts")
        rows.append({"drafter": drafter, "tau decoder": m["tau"], "tau vLLM": served["tau"],
                     **{f"a{i} vLLM": served[f"accept_{i}"] for i in range(1, draft_positions(served) + 1)},
                     "output = target's": f"{equal}/{m['prompts']}" if equal is not None else "not checked",
                     "tok/s": served["tokens_per_s"], "tok/s target alone": alone,
                     "speed-up": speedups.get(drafter),
                     "hardware": f"{served['hardware']}, {served['concurrency']} in flight"})
    return pd.DataFrame(rows)


def tau_by_set_table(metrics: dict[str, dict]) -> pd.DataFrame:
    """One row per benchmark set (its prompts, each drafter's tau), then the overall row."""
    evals = {d: metrics[f"eval-{d}"] for d in EvalDrafter if f"eval-{d}" in metrics}
    names = list(dict.fromkeys(name for m in evals.values() for name in m.get("tau_by_set", {})))
    rows = [{"set": name,
             "prompts": next((m["prompts_by_set"][name] for m in evals.values() if name in m.get("prompts_by_set", {})),
                             None),
             **{d: m.get("tau_by_set", {}).get(name) for d, m in evals.items()}} for name in names]
    if evals:
        rows.append({"set": "overall", "prompts": next(iter(evals.values()))["prompts"],
                     **{d: m["tau"] for d, m in evals.items()}})
    return pd.DataFrame(rows, columns=["set", "prompts", *evals])


def plot_tau_by_set(metrics: dict[str, dict], path: Path) -> None:
    """Grouped bars: tau of every drafter on every benchmark set, and overall."""
    table = tau_by_set_table(metrics)
    drafters = [column for column in table.columns if column in list(EvalDrafter)]
    width = 0.8 / max(1, len(drafters))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(table) + 2), 4.2))
    for j, drafter in enumerate(drafters):
        taus = table[drafter].astype(float)
        bars = ax.bar([i + (j - (len(drafters) - 1) / 2) * width for i in range(len(table))], taus, width,
                      label=drafter, color=COLORS[drafter])
        ax.bar_label(bars, labels=["" if pd.isna(t) else f"{t:.2f}" for t in taus], fontsize=8)
    ax.set_xticks(range(len(table)), table["set"])
    ax.set(title="Acceptance length tau per benchmark set", ylabel="tokens per verification step")
    if drafters:
        top = table[drafters].astype(float).max().max()
        ax.set_ylim(0, 1.25 * top if top > 0 else 1)  # room for the legend above the bars
        ax.legend(loc="upper left", ncol=len(drafters))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(metrics: dict[str, dict]) -> dict:
    """The pipeline run in a few numbers, for `metrics.json` (what `dvc exp show` puts first): tau per drafter,
    tau and the served speed-up measured on vLLM, the simulator's last tau per trained drafter, each stage's wall
    time and their sum."""
    times = {stage: metrics[stage]["time"]["stage_s"] for stage in STAGES if stage in metrics}
    evals = {drafter: metrics[f"eval-{drafter}"] for drafter in EvalDrafter if f"eval-{drafter}" in metrics}
    served = {drafter: m["vllm"] for drafter, m in evals.items() if "vllm" in m}
    return {"tau": {drafter: m["tau"] for drafter, m in evals.items()},
            **({"tau_vllm": {drafter: m["tau"] for drafter, m in served.items()},
                "speedup_vllm": served_speedups(metrics)} if served else {}),
            "sim_tau": {init: metrics[f"train-{init}"]["sim/tau"] for init in TrainInit
                        if "sim/tau" in metrics.get(f"train-{init}", {})},
            "time_s": {**times, "total": round(sum(times.values()), 3)}}


def pipeline_metrics(metrics: dict[str, dict]) -> dict[str, float]:
    """The MLflow metrics of the pipeline run itself (its parent run): the headline (tau per drafter from the
    decoder and, where measured, from vLLM, with vLLM's speed-up), and per drafter tau on each benchmark set, acceptance by draft position and losslessness (1 or 0; left out where it was not checked)."""
    top = headline(metrics)
    flat = {f"tau/{drafter}": tau for drafter, tau in top["tau"].items()}
    flat.update({f"tau_vllm/{drafter}": tau for drafter, tau in top.get("tau_vllm", {}).items()})
    flat.update({f"speedup_vllm/{drafter}": ratio for drafter, ratio in top.get("speedup_vllm", {}).items()})
    flat.update({f"sim_tau/{init}": tau for init, tau in top["sim_tau"].items()})
    flat.update({f"time/{stage}_s": seconds for stage, seconds in top["time_s"].items()})
    for drafter in top["tau"]:
        m = metrics[f"eval-{drafter}"]
        flat.update({f"tau/{drafter}/{name}": tau for name, tau in m.get("tau_by_set", {}).items()})
        flat.update({f"a{i}/{drafter}": m[f"accept_{i}"] for i in range(1, draft_positions(m) + 1)
                     if m[f"accept_{i}"] is not None})
        if "lossless" in m:
            flat[f"lossless/{drafter}"] = float(m["lossless"])
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
                     "throughput": throughput})
    return pd.DataFrame(rows)


def acceptance_by_position(metrics: dict[str, dict]) -> pd.DataFrame:
    """position, then one column per drafter: what `dvc plots` draws as one line per drafter."""
    curve = acceptance_curve(metrics)
    return curve.pivot(index="position", columns="drafter", values="acceptance").reset_index().rename_axis(None, axis=1)


def acceptance_curve(metrics: dict[str, dict]) -> pd.DataFrame:
    """Long form (drafter, position, acceptance), for the PNG."""
    rows = [{"drafter": d, "position": i, "acceptance": metrics[f"eval-{d}"][f"accept_{i}"]}
            for d in EvalDrafter if f"eval-{d}" in metrics for i in range(1, draft_positions(metrics[f"eval-{d}"]) + 1)]
    return pd.DataFrame(rows, columns=["drafter", "position", "acceptance"])


def plot(metrics: dict[str, dict], train_histories: dict[str, pd.DataFrame], path: Path) -> None:
    curve = acceptance_curve(metrics)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    taus = [(d, metrics[f"eval-{d}"]["tau"]) for d in EvalDrafter if f"eval-{d}" in metrics]
    bars = axes[0].bar([d for d, _ in taus], [t for _, t in taus], color=[COLORS[d] for d, _ in taus])
    axes[0].bar_label(bars, fmt="%.2f")
    axes[0].set(title="Acceptance length tau (greedy, chain)", ylabel="tokens per verification step")
    for drafter, group in curve.groupby("drafter", sort=False):
        axes[1].plot(group["position"], group["acceptance"], marker="o", label=drafter)
    axes[1].set(title="Per-position acceptance", xlabel="draft position", ylabel="accepted share", ylim=(0, 1.05))
    axes[1].legend()
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


def mlflow_ui_hint(tracking_uri: str, experiment_id: str | None = None) -> str:
    """Where to look at the runs: a tracking server is already a UI; a local store needs `mlflow ui`. The link
    asks for the experiment's runs table in the model-training view: MLflow 3's UI opens experiments on its
    GenAI (traces) pages unless the link or the user's last choice says otherwise."""
    page = f"/#/experiments/{experiment_id}/runs?workflowType=machine_learning" if experiment_id else ""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri.rstrip('/')}{page}"
    return f"`mlflow ui --backend-store-uri {tracking_uri}` then open http://127.0.0.1:5000{page}"


def _served_section(metrics: dict[str, dict]) -> list[str]:
    served = served_table(metrics)
    if served.empty:
        return []
    return ["## Served on vLLM", "", markdown_table(served, ".3f"), "",
            "tau vLLM and a_i from vLLM's own spec-decode counters, the drafter served with the target as the export "
            "serves it; output = target's: prompts whose greedy output is token for token the target's own; tok/s: "
            "generated tokens per second over all prompts, the requests in flight together, with the drafter and "
            "(measured once, by the baseline's eval, on a server of its own) the target alone; speed-up = their "
            "ratio, on this hardware.", ""]


def markdown(metrics: dict[str, dict], tracking_uri: str, experiment_id: str | None = None) -> str:
    acceptance = acceptance_table(metrics)
    timings = timing_table(metrics)
    lines = ["# eagle3ops report", "", "## Acceptance on held-out prompts (successor target)", "",
             markdown_table(acceptance, ".3f"), "",
             "tau = 1 + accepted drafts / verification steps (k drafts per step, bonus token included); 95% CI = "
             "its bootstrap interval over the prompts (two drafters whose intervals overlap are not clearly "
             "apart); a_i = share of steps whose i-th draft was accepted; vocab coverage = share of the target's "
             "tokens inside the drafter's vocabulary (a warm start keeps its own unless it is re-headed).", "",
             "## Acceptance length tau per benchmark set", "", markdown_table(tau_by_set_table(metrics), ".3f"), "",
             "![tau by set](tau_by_set.png)", "",
             *_served_section(metrics),
             "## Stage timings", "", markdown_table(timings, ".1f"), "",
             f"MLflow runs: {mlflow_ui_hint(tracking_uri, experiment_id)}", ""]
    return "\n".join(lines)
