"""The bench's table (markdown, with the reference figures beside ours), its plots and its JSON."""
from __future__ import annotations

from pathlib import Path

from eagle3ops.fs import BENCH_RESULT, BENCH_TABLE, PLOT, Output, check_output, write_json_atomic, write_text_atomic

# SpecForge v0.2's own trainer on one H200 (LlamaForCausalLMEagle3 + OnlineEagle3Model, flex attention, TTT 7, bf16
# with fp32 master weights, the Llama-3.1-8B drafter config, offline random features), each in a fresh process:
# (batch, length) -> (tokens/s, peak GiB), from the measurement at commit 73e6f808 where it has the shape (1 x 2048,
# 4 x 2048, 1 x 8192), from the earlier one otherwise.
REFERENCE = {
    "specforge_train": {(1, 2048): (20_298, 13.6), (2, 2048): (24_500, 17.6), (4, 2048): (27_913, 26.1),
                        (1, 4096): (24_400, 17.4), (1, 8192): (24_847, 25.4), (1, 16384): (22_700, 43.2)},
    # 40 samples of log-normal length (median ~1,000, 128..8,192): one epoch at batch 1 from process start, the
    # compilation in it (dynamic shapes), and the same 40 again in the same process
    "specforge_varlen": {"tokens": 54_900, "epoch_s": 91.0, "compile_s": 66.0, "again_tokens_per_s": 13_920},
    "naive_extract_tokens_per_s": (12_300, 14_100),
}


def render(result: dict) -> str:


    lines = [f"# eagle3ops bench: {result['size']} on {result['device']} (torch {result['torch']})", ""]
    if "data_parallel" in result:
        return "\n".join(lines + render_data_parallel(result["data_parallel"], result["backend"]))
    ceilings = result["ceilings"]
    lines += [f"Ceilings: matmul {ceilings['matmul_tflops']:.0f} TFLOP/s ({ceilings['matmul_dtype']}), device copy "
              f"{ceilings['copy_gbps']:.0f} GB/s, disk write+fsync {ceilings['disk_write_gbps']:.2f} GB/s", ""]
    if "extract" in result:
        lines += render_extraction(result["extract"], ceilings)
    if "extract_split" in result:
        lines += render_split_extraction(result["extract_split"])
    if "train" in result:
        lines += render_training(result["train"], result["size"] == "8b")
    if "train_variants" in result:
        lines += render_variants(result["train_variants"])
    if "fused_vs_reference" in result:
        check = result["fused_vs_reference"]
        lines += [f"Fused step (compiled, flex attention) against the reference math on the same device, {check['dtype']}, "
                  f"{check['tokens']} tokens in {check['documents']} documents, TTT 7, each train.loss "
                  f"({', '.join(check.get('losses', {'kl': None}))}): losses differ by at most "
                  f"{check['loss_max_rel_diff']:.1e}, acceptance probabilities by at most "
                  f"{check.get('alpha_max_rel_diff', float('nan')):.1e}, gradients by at most "
                  f"{check['grad_max_rel_diff']:.1e} (relative)", ""]
    if "train_varlen" in result:
        lines += render_varlen(result["train_varlen"], result["size"] == "8b")
    if "online" in result:
        lines += render_online(result["online"])
    return "\n".join(lines)


def render_training(runs: list[dict], with_reference: bool) -> list[str]:
    """The fixed-shape rows: a document a row (batch x length), beside SpecForge's figures at that shape, or a row
    packed with several, beside SpecForge's memory at the same tokens a step (SpecForge packs nothing)."""
    import pandas as pd

    from eagle3ops.reporting.summary import markdown_table

    rows = []
    for row in runs:
        tokens = row["batch"] * row["length"]
        same_shape = (REFERENCE["specforge_train"].get((row["batch"], row["length"]))
                      if with_reference and row.get("documents", 1) == 1 else None)
        same_tokens = same_shape or (REFERENCE["specforge_train"].get((1, tokens)) if with_reference else None)
        rows.append({"kernel": row["kernel"], "batch": row["batch"], "length": row["length"],
                     "documents a row": row.get("documents", 1), "first step s": row["first_step_s"],
                     "step ms": row["step_ms"], "tok/s": f"{row['tokens_per_s']:,.0f}", "MFU": f"{row['mfu']:.0%}",
                     "peak GiB": row["peak_gib"] or "-", "steady peak GiB": row.get("steady_peak_gib") or "-",
                     "SpecForge tok/s": f"{same_shape[0]:,}" if same_shape else "-",
                     "vs SpecForge": f"{row['tokens_per_s'] / same_shape[0]:.2f}x" if same_shape else "-",
                     "SpecForge GiB, same tokens a step": same_tokens[1] if same_tokens else "-"})
    return ["## Drafter training (TTT 7, one optimizer step)", "", markdown_table(pd.DataFrame(rows), "g"), ""]


def render_variants(runs: list[dict]) -> list[str]:
    """One step of each training variant on the same packed row, against the first."""
    import pandas as pd

    from eagle3ops.reporting.summary import markdown_table

    first = runs[0]["step_ms"]
    rows = [{"variant": row["variant"], "step ms": row["step_ms"], "vs first": f"{row['step_ms'] / first:.2f}x",
             "tok/s": f"{row['tokens_per_s']:,.0f}", "first step s": row["first_step_s"],
             "steady peak GiB": row["steady_peak_gib"] or "-"} for row in runs]
    return [f"## Training variants: one step on a row of {runs[0]['length']:,} tokens packed with "
            f"{runs[0]['documents']} documents, {runs[0]['kernel']} kernel", "",
            markdown_table(pd.DataFrame(rows), "g"), ""]


def render_varlen(varlen: dict, with_reference: bool) -> list[str]:
    """The train stage's loop on data of varying length from process start: cold, travelling (a fresh machine with
    the stage's compile-cache entry) and warm compile cache."""
    import pandas as pd

    from eagle3ops.reporting.summary import markdown_table

    reference = REFERENCE["specforge_varlen"] if with_reference else None
    rows = [{"compile cache": run["compile_cache"], "epoch 1 from process start s": run["epoch1_from_start_s"],
             "setup s": run["setup_s"], "first step s": run["first_step_s"], "compiling s": run["compile_s"],
             "graphs": run["graphs"], "epoch 2 tok/s": f"{run['epoch2_tokens_per_s']:,.0f}",
             "padding": f"{run['padding_share']:.1%}", "peak GiB": run["peak_gib"] or "-"} for run in varlen["runs"]]
    if reference:
        rows.append({"compile cache": "SpecForge (reference)", "epoch 1 from process start s": reference["epoch_s"],
                     "setup s": "-", "first step s": "-", "compiling s": reference["compile_s"], "graphs": "-",
                     "epoch 2 tok/s": f"{reference['again_tokens_per_s']:,}", "padding": "-", "peak GiB": "-"})
    first = varlen["runs"][0]
    lines = [f"## Training on data of varying length from process start ({varlen['samples']} samples, "
             f"{varlen['tokens']:,} tokens, median {varlen['median_length']}, {varlen['shortest']}..{varlen['longest']}; "
             f"rows of {first['packed_length']:,} tokens, {first['steps_per_epoch']} steps an epoch, two epochs)", "",
             markdown_table(pd.DataFrame(rows), "g"), ""]
    if reference:
        starts = "; ".join(f"{run['compile_cache']} {run['epoch1_from_start_s']:.1f} s, "
                           f"{reference['epoch_s'] / run['epoch1_from_start_s']:.2f}x" for run in varlen["runs"])
        lines += [f"SpecForge's {reference['epoch_s']:.0f} s covers a set of {reference['tokens']:,} tokens, "
                  f"{reference['compile_s']:.0f} s of it compiling; eagle3ops on this set's {varlen['tokens']:,}, "
                  f"from each start, and its speed against SpecForge's: {starts}.", ""]
    return lines


def render_online(online: dict) -> list[str]:
    """Extraction in bf16 and FP8, then offline and online training epoch by epoch, the totals and the break-even."""
    import pandas as pd

    from eagle3ops.reporting.summary import markdown_table

    lines = [f"## Online training against extraction + offline training: {online['samples']} samples, "
             f"{online['tokens']:,} tokens, rows of {online['packed_length']}, target and drafter on one device", ""]
    extract = pd.DataFrame([{"extraction": dtype, "tokens/s": f"{run['tokens_per_s']:,.0f}",
                             "bytes/token": f"{run['bytes_per_token']:,}", "GB written": f"{run['bytes'] / 1e9:.2f}",
                             "disk GB/s": f"{run['disk_gbps']:.2f}", "read back, s": run["read_s"]}
                            for dtype, run in online["extract"].items()])
    lines += [markdown_table(extract, "g"), ""]
    modes = pd.DataFrame([{"training": mode, **{f"epoch {e + 1} s": f"{s:.1f}" for e, s in enumerate(run["epoch_s"])},
                           "steady tok/s": f"{run['steady_tokens_per_s']:,}", "peak GiB": run["peak_gib"]}
                          for mode, run in (("offline (shards in memory)", online["offline"]),
                                            ("online (target beside)", online["online"]))])
    lines += [markdown_table(modes, "g"), "",
              f"The first epoch holds the compilation: {online['offline']['compile_s']} s offline (run first, cold "
              f"cache), {online['online']['compile_s']} s online (the cache the offline run left); either mode pays "
              f"it once, so the totals below leave it out. Both peaks hold the target ({online['target_gib']} GiB), "
              f"which offline training would not. The losses of the two runs differ by at most "
              f"{online['loss_max_rel_diff']:.1e} (relative), step for step.", ""]
    totals = pd.DataFrame([{"epochs": e, **{f"offline from {dtype}, s": by_epochs[e]["offline"]
                                            for dtype, by_epochs in online["totals_s"].items()},
                            "online, s": online["totals_s"]["bfloat16"][e]["online"]}
                           for e in online["totals_s"]["bfloat16"]])
    lines += ["Totals (offline: extraction, the read-back, training):", "", markdown_table(totals, "g"), "",
              "Break-even: online is faster below " + ", ".join(
                  f"{epochs} epochs against {dtype} shards" for dtype, epochs in online["break_even_epochs"].items())
              + "; offline above.", ""]
    return lines


def render_extraction(extract: dict, ceilings: dict) -> list[str]:
    import pandas as pd

    from eagle3ops.reporting.summary import markdown_table

    disk_limit = ceilings["disk_write_gbps"] * 1e9 / extract["bytes_per_token"]
    rows = [{"pipeline": run["pipeline"], "batch": run["batch"], "length": run["length"],
             "tok/s": f"{run['tokens_per_s']:,.0f}", "MFU": f"{run['mfu']:.0%}", "disk GB/s": f"{run['disk_gbps']:.2f}",
             "drain s": f"{run['drain_s']:.2f}" if "drain_s" in run else "-",
             "steady tok/s": f"{run['steady_tokens_per_s']:,.0f}" if "steady_tokens_per_s" in run else "-",
             "forward alone tok/s": f"{run['forward_only_tokens_per_s']:,.0f}",
             "of forward": f"{run['tokens_per_s'] / run['forward_only_tokens_per_s']:.0%}",
             "of disk limit": f"{run['tokens_per_s'] / disk_limit:.0%}"} for run in extract["runs"]]
    base = extract["base"]
    at_base = {run["pipeline"]: run["tokens_per_s"] for run in extract["runs"]
               if (run["batch"], run["length"]) == (base["batch"], base["length"])}
    return [f"## Extraction ({extract['target_params'] / 1e9:.1f}B target, {extract['tokens_per_point']:,} tokens per "
            f"row, shards of {extract['shard_tokens']:,} tokens; the disk allows {disk_limit:,.0f} tok/s at "
            f"{extract['bytes_per_token']:,} bytes/token)", "", markdown_table(pd.DataFrame(rows), "g"), "",
            f"ours / naive at batch {base['batch']} x {base['length']}: {at_base['ours'] / at_base['naive']:.2f}x", ""]


def render_split_extraction(split: dict) -> list[str]:
    import pandas as pd

    from eagle3ops.reporting.summary import markdown_table

    rows = [{"placement": run["placement"], "modules per device": ", ".join(f"{d}: {n}" for d, n in
                                                                            run["modules_per_device"].items()),
             "tok/s": f"{run['tokens_per_s']:,.0f}",
             "peak GiB per GPU": " / ".join(str(g) for g in run["peak_gib_per_gpu"]) or "-"} for run in split["runs"]]
    difference = split["max_abs_difference"]
    return [f"## Extraction with the target split over {split['gpus']} GPUs ({split['sequences']} x {split['seq_len']} "
            f"tokens, batch {split['batch_size']})", "", markdown_table(pd.DataFrame(rows), "g"), "",
            f"Largest difference between the stored hidden states of the two placements: aux "
            f"{difference['aux_hidden']:.3g}, final {difference['final_hidden']:.3g}", ""]


def render_data_parallel(bench: dict, backend: str) -> list[str]:
    import pandas as pd

    from eagle3ops.reporting.summary import markdown_table

    alone, together = bench["runs"]
    runs = [{"ranks": run["ranks"], "batch per rank": run["batch_per_rank"], "first step s": run["first_step_s"],
             "step ms": run["step_ms"], "tok/s": f"{run['tokens_per_s']:,.0f}", "peak GiB": run["peak_gib"] or "-"}
            for run in bench["runs"]]
    losses = [{"step": step, "1 rank": a, f"{together['ranks']} ranks": b, "relative difference": abs(a - b) / abs(a)}
              for step, (a, b) in enumerate(zip(alone["losses"], together["losses"]), start=1)]
    return [f"## Data-parallel drafter training ({backend}; TTT 7, global batch {bench['global_batch']} x "
            f"{bench['length']} tokens, {bench['steps']} steps)", "",
            markdown_table(pd.DataFrame(runs), "g"), "",
            f"{together['ranks']} ranks / 1: {bench['speedup']:.2f}x tokens/s "
            f"({bench['speedup'] / together['ranks']:.0%} scaling efficiency); loss curves differ by at most "
            f"{bench['max_loss_rel_diff']:.1e} (relative)", "", "Loss of each optimizer step:", "",
            markdown_table(pd.DataFrame(losses), ("d", ".6f", ".6f", ".1e")), ""]


def batch_sweep_length(rows: list[dict]) -> int:
    """The length measured at the most batch sizes (the shortest of equals): the batch panel's length."""
    batches_at = {n: len({r["batch"] for r in rows if r["length"] == n}) for n in sorted({r["length"] for r in rows})}
    return max(batches_at, key=batches_at.get, default=0)


def plot(results: list[dict], path: Path) -> None:
    """Training tokens/s as the length grows (batch 1) and as the batch grows (at the length measured at the most
    batch sizes), one line per kernel (and per kernel on packed rows), with SpecForge's reference figures where the
    size is 8b."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for result in results for row in result.get("train", [])]
    figure, (by_length, by_batch) = plt.subplots(1, 2, figsize=(10, 4))
    series = {kernel: [r for r in rows if r["kernel"] == kernel and r.get("documents", 1) == 1]
              for kernel in sorted({r["kernel"] for r in rows})}
    series.update({f"{kernel}, packed documents": [r for r in rows if r["kernel"] == kernel and r.get("documents", 1) > 1]
                   for kernel in sorted({r["kernel"] for r in rows if r.get("documents", 1) > 1})})
    if any(result["size"] == "8b" for result in results):
        series["SpecForge (reference)"] = [{"batch": b, "length": n, "tokens_per_s": v[0]}
                                           for (b, n), v in REFERENCE["specforge_train"].items()]
    base = batch_sweep_length(rows)
    for colour, (name, points) in enumerate(series.items()):
        longs = sorted((r["length"], r["tokens_per_s"]) for r in points if r["batch"] == 1)
        batches = sorted((r["batch"], r["tokens_per_s"]) for r in points if r["length"] == base)
        by_length.plot(*zip(*longs), marker="o", label=name, color=f"C{colour}") if longs else None
        by_batch.plot(*zip(*batches), marker="o", label=name, color=f"C{colour}") if batches else None
    lengths = sorted({r["length"] for points in series.values() for r in points if r["batch"] == 1})
    by_length.set(xscale="log", xlabel="sequence length (batch 1)", ylabel="training tokens/s", ylim=(0, None))
    by_length.set_xticks(lengths, [str(n) for n in lengths])
    by_length.minorticks_off()
    by_batch.set(xlabel=f"batch size (length {base})", ylabel="training tokens/s", ylim=(0, None))
    by_length.legend()
    figure.suptitle(f"Drafter training speed on {results[0]['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_varlen(result: dict, path: Path) -> None:
    """Seconds from process start to the end of the first epoch on data of varying length, by compile cache (cold,
    travelling, warm), split into setup, the first step (compiling) and the other steps; SpecForge's reference beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    varlen = result["train_varlen"]
    bars = [(f"eagle3ops, {run['compile_cache']} compile cache", run["setup_s"], run["first_step_s"],
             run["epoch1_from_start_s"] - run["setup_s"] - run["first_step_s"]) for run in varlen["runs"]]
    reference = REFERENCE["specforge_varlen"] if result["size"] == "8b" else None
    figure, axis = plt.subplots(figsize=(9, 1.6 + 0.6 * (len(bars) + bool(reference))))
    names = [name for name, *_ in bars]
    for name, *parts in bars:
        left = 0.0
        for part, (label, colour) in zip(parts, (("setup", "C7"), ("first step (compiling)", "C1"), ("other steps", "C0"))):
            axis.barh(name, part, left=left, color=colour, label=label if name == names[0] else None)
            left += part
        axis.text(left + 0.5, name, f"{left:.0f} s", va="center")
    if reference:
        name = "SpecForge (reference)"
        axis.barh(name, reference["compile_s"], color="C3", label="compiling (SpecForge)")
        axis.barh(name, reference["epoch_s"] - reference["compile_s"], left=reference["compile_s"], color="C2",
                  label="the rest (SpecForge)")
        axis.text(reference["epoch_s"] + 0.5, name, f"{reference['epoch_s']:.0f} s", va="center")
    axis.invert_yaxis()
    longest = max([sum(parts) for _, *parts in bars] + ([reference["epoch_s"]] if reference else []))
    axis.set_xlim(0, longest * 1.1)
    axis.set_xlabel(f"seconds from process start to the end of epoch 1 ({varlen['samples']} samples, "
                    f"{varlen['tokens']:,} tokens of varying length)")
    axis.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_extraction(result: dict, path: Path) -> None:
    """Extraction tokens/s as the length grows (fixed tokens per batch) and as the batch grows (at the base
    length): ours, the forward alone at each shape (the compute limit) and the disk limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extract = result["extract"]
    ours = [run for run in extract["runs"] if run["pipeline"] == "ours"]
    base, batch_tokens = extract["base"], extract["base"]["batch"] * extract["base"]["length"]
    disk_limit = result["ceilings"]["disk_write_gbps"] * 1e9 / extract["bytes_per_token"]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key, keep, label in (
            (axes[0], "length", lambda r: r["batch"] * r["length"] == batch_tokens, f"sequence length ({batch_tokens:,} tokens per batch)"),
            (axes[1], "batch", lambda r: r["length"] == base["length"], f"batch size (length {base['length']})")):
        points = sorted((r for r in ours if keep(r)), key=lambda r: r[key])
        xs = [r[key] for r in points]
        axis.plot(xs, [r["forward_only_tokens_per_s"] for r in points], marker="s", linestyle="--", label="forward alone")
        axis.plot(xs, [r["tokens_per_s"] for r in points], marker="o", label="eagle3ops extraction, end to end (on disk)")
        axis.plot(xs, [r["steady_tokens_per_s"] for r in points], marker="o", linestyle=":", color="C1",
                  label="eagle3ops, before the last shard's write")
        axis.axhline(disk_limit, color="grey", linestyle=":", label="disk write limit")
        naive = [r for r in extract["runs"] if r["pipeline"] == "naive"]
        axis.plot([r[key] for r in naive], [r["tokens_per_s"] for r in naive], marker="x", linestyle="", color="red",
                  label="naive pipeline")
        axis.set(xscale="log", xlabel=label, ylabel="extraction tokens/s", ylim=(0, None))
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.minorticks_off()
    axes[0].legend(fontsize=8, loc="lower right")
    figure.suptitle(f"Hidden-state extraction speed on {result['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def outputs(out: Path, parts) -> list[tuple[Path, Output]]:
    """What `bench --out FILE.json` writes for these parts (or a result's keys), each with the kind of output it
    may replace: the JSON, the table beside it (FILE.md) and the plots (FILE.png, FILE-extract.png,
    FILE-start.png)."""
    keys = {part.replace("-", "_") for part in parts}
    plots = {"train": out.with_suffix(".png"), "extract": out.with_name(out.stem + "-extract.png"),
             "train_varlen": out.with_name(out.stem + "-start.png")}
    return [(out, BENCH_RESULT), (out.with_suffix(".md"), BENCH_TABLE),
            *((path, PLOT) for key, path in plots.items() if key in keys)]


def write_result(result: dict, out: Path) -> None:
    """The JSON, its table and plots; each replaces only what an earlier bench wrote there, all checked first."""
    for path, kind in outputs(out, [key for key, value in result.items() if value]):
        check_output(path, kind)
    write_json_atomic(out, result, BENCH_RESULT)
    write_text_atomic(out.with_suffix(".md"), render(result) + "\n", BENCH_TABLE)
    if result.get("train"):
        plot([result], out.with_suffix(".png"))
    if result.get("extract"):
        plot_extraction(result, out.with_name(out.stem + "-extract.png"))
    if result.get("train_varlen"):
        plot_varlen(result, out.with_name(out.stem + "-start.png"))
