"""`eagle3ops <stage>`: the commands dvc.yaml runs, one per pipeline stage.

Settings come from params.yaml (one typed schema, see config.py); `--set key=value` overrides a key for a
one-off run outside DVC (under DVC, change params.yaml or use `dvc exp run -S key=value` instead, so the
lineage records it).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from eagle3ops.config import EVAL_DRAFTERS, TRAIN_INITS, Config, ConfigError, TrainConfig, load_config
from eagle3ops.errors import InputError

STAGES = {
    "zoo": "build the embedded default: tokenizer, tiny predecessor/successor targets, predecessor drafter, datasets",
    "generate": "regenerate assistant turns with the target (generate.backend: hf | none)",
    "prepare": "tokenize with the chat template, mask assistant tokens, split, build the draft vocabulary",
    "extract": "capture the target's auxiliary and final hidden states into safetensors shards",
    "train": "train an EAGLE-3 drafter with training-time test (--init scratch | warm_start)",
    "eval": "speculative decoding on held-out prompts: acceptance length tau, losslessness (--drafter ...)",
    "report": "compare the variants: markdown table, CSV, PNG",
}


def _store_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--params", default="params.yaml", help="where the tracking settings come from")
    command.add_argument("--tracking-uri", help="MLflow store (default: as the stages resolve it from --params)")


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="eagle3ops", description="EAGLE-3 drafter pipeline stages (run by dvc repro).")
    commands = main.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, help_text in STAGES.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
        sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                         help="override one key, e.g. --set train.lr=3e-4 (repeatable)")
        if name == "train":
            sub.add_argument("--init", choices=TRAIN_INITS, required=True, help="start from random weights or a drafter")
        if name == "eval":
            sub.add_argument("--drafter", choices=EVAL_DRAFTERS, required=True,
                             help="baseline = train.warm_start used as-is; scratch / warm_start = our trained drafters")
    sync = commands.add_parser(
        "sync", help="upload the runs recorded while the MLflow server was unreachable (.eagle3ops/outbox/)",
        description="Stages never stop for a tracking server that is down: what they could not log is kept under "
                    ".eagle3ops/outbox/. This uploads it, into the runs the stages had started or into new ones.")
    _store_options(sync)
    reproduce = commands.add_parser(
        "reproduce", help="re-run a recorded pipeline run in a clean worktree and compare hashes and metrics",
        description="Check out the run's git commit with its recorded dvc.yaml, params.yaml and dvc.lock in a "
                    "separate worktree, run `dvc repro` with an empty cache, and report which outputs came back "
                    "with identical hashes and how far each metric moved.")
    reproduce.add_argument("run_id", help="the pipeline (parent) run id, as `eagle3ops compare` or the MLflow UI show")
    _store_options(reproduce)
    reproduce.add_argument("--keep", action="store_true", help="keep the worktree for inspection")
    reproduce.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    compare = commands.add_parser(
        "compare", help="recorded pipeline runs side by side: tau, acceptance, phase times and throughput",
        description="Select pipeline runs from MLflow (newest first, or --runs in the order given; the first is the "
                    "reference) and write compare.md, compare.csv and compare.png.")
    compare.add_argument("--experiment", help="MLflow experiment (default: mlflow.experiment in params.yaml)")
    source = compare.add_mutually_exclusive_group()
    source.add_argument("--runs", nargs="+", default=[], metavar="RUN_ID", help="pipeline (parent) run ids")
    source.add_argument("--filter", default="", metavar="MLFLOW_FILTER",
                        help="MLflow search over the pipeline runs, e.g. \"tags.`eagle3ops.pipeline_key` = 'lr-sweep'\"")
    compare.add_argument("--variant", nargs="+", action="extend", default=[], choices=EVAL_DRAFTERS, metavar="V",
                         help=f"only runs with these drafters ({', '.join(EVAL_DRAFTERS)}), and only their rows")
    compare.add_argument("--hardware", nargs="+", action="extend", default=[], metavar="LABEL",
                         help="only runs on these hardware labels")
    compare.add_argument("--last", type=int, metavar="N", help="the N newest matching runs (default: 5; all of --runs)")
    compare.add_argument("--out", default="comparisons", help="output directory (default: %(default)s)")
    _store_options(compare)
    project = commands.add_parser(
        "project", help="project a pilot pipeline run's phase times and cost to N samples on other hardware",
        description="From a measured pilot pipeline run and hardware profiles (YAML, see eagle3ops/profiles/), "
                    "project each phase's wall time and the cost of a run of N samples on each target profile. "
                    "The model is documented in eagle3ops.projection.")
    project.add_argument("--run", required=True, metavar="RUN_ID", help="the measured pilot pipeline (parent) run id")
    project.add_argument("--samples", required=True, type=int, metavar="N", help="samples of the projected run")
    project.add_argument("--from", dest="from_profile", metavar="PROFILE",
                         help="the pilot's profile (default: the profile listing the stages' hardware label)")
    project.add_argument("--to", action="append", required=True, metavar="PROFILE",
                         help="target profile: a shipped name or a YAML path (repeatable)")
    project.add_argument("--measured", metavar="RUN_ID", help="a real run on target hardware: print projected vs measured")
    _store_options(project)
    project.add_argument("--out", metavar="FILE.md", help="also write the report to this file")
    compat = commands.add_parser(
        "check-compat", help="can this drafter be warm-started on (or served with) this target? a verdict with reasons",
        description="Compare a drafter (SpecForge/SGLang layout) with a target model directory: vocabulary, hidden "
                    "size, layer ids and their convention, attention shapes, positions, and, given data, how much of "
                    "its loss-masked tokens the drafter's draft vocabulary covers. Verdict and exit code: compatible "
                    "(0), needs_new_head (4), incompatible (5). `train@warm_start` runs the same check.")
    compat.add_argument("target", help="target model directory (config.json)")
    compat.add_argument("drafter", help="drafter directory (config.json + model.safetensors)")
    compat.add_argument("--data", metavar="PATH",
                        help="new data: a prepared split directory (data/prepared/train) or a conversations JSONL "
                             "(tokenized with the target's tokenizer and chat template)")
    compat.add_argument("--aux-layers", type=int, nargs=3, metavar="I",
                        help="HF hidden-state indices the features are extracted at (default: [2, N//2, N-3])")
    compat.add_argument("--min-coverage", type=float, default=TrainConfig.warm_start_min_coverage,
                        help="draft-vocab coverage below which the drafter needs a new head (default: %(default)s)")
    compat.add_argument("--max-len", type=int, default=4096, help="truncation when tokenizing a JSONL (default: %(default)s)")
    compat.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    return main


def _store_uri(args) -> str:
    """--tracking-uri, else the store the stages use ($MLFLOW_TRACKING_URI, the params' mlflow.tracking_uri,
    mlflow.db in the repository)."""
    from eagle3ops.tracking import tracking_uri

    if args.tracking_uri:
        return args.tracking_uri
    params = Path(getattr(args, "params", "params.yaml"))
    return tracking_uri(load_config(params) if params.is_file() else Config())


def _sync(args) -> int:
    from eagle3ops.outbox import pending, sync

    uri = _store_uri(args)
    uploaded = sync(uri, Path.cwd())
    print(f"uploaded {len(uploaded)} run(s) to {uri}; {len(pending(Path.cwd()))} left in the outbox")
    return 0


def _reproduce(args) -> int:
    from mlflow import MlflowClient

    from eagle3ops.reproduce import as_json, reproduce, summary

    uri = _store_uri(args)
    result = reproduce(MlflowClient(uri), args.run_id, Path.cwd(), uri, keep=args.keep)
    print(summary(result))
    if args.json:
        Path(args.json).write_text(as_json(result))
    return 0 if result.identical else 3


def _compare(args) -> int:  # reads MLflow only; pandas and matplotlib load only here
    from eagle3ops.compare import command

    return command(args)


def _project(args) -> int:
    from mlflow import MlflowClient

    from eagle3ops.projection import project_runs, render

    text = render(project_runs(MlflowClient(_store_uri(args)), args.run, args.samples, args.to, args.from_profile,
                               args.measured))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


def _check_compat(args) -> int:
    from eagle3ops.compat import EXIT_CODES, check_compat
    from eagle3ops.data.prepare import masked_token_counts

    counts = None
    if args.data and Path(args.data).is_dir():
        counts = masked_token_counts(args.data)
    elif args.data:
        from eagle3ops.config import TargetConfig
        from eagle3ops.data.conversations import load_conversations
        from eagle3ops.data.prepare import tokenize_dataset
        from eagle3ops.data.vocab import count_masked_tokens
        from eagle3ops.modeling.target import load_tokenizer

        tokenizer = load_tokenizer(TargetConfig(path=args.target))
        samples, _ = tokenize_dataset(tokenizer, load_conversations(args.data), args.max_len, args.data)
        counts = count_masked_tokens((s["input_ids"], s["loss_mask"]) for s in samples)
    report = check_compat(args.target, args.drafter, args.aux_layers, counts, args.min_coverage)
    print(report.render())
    if args.json:
        from eagle3ops.fs import write_json_atomic

        write_json_atomic(args.json, report.to_dict())
    return EXIT_CODES[report.verdict]


TOOLS = {"check-compat": _check_compat, "sync": _sync, "reproduce": _reproduce, "compare": _compare, "project": _project}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.stage in TOOLS:
        try:
            return TOOLS[args.stage](args)
        except InputError as err:
            print(f"eagle3ops {args.stage}: error: {err}", file=sys.stderr)
            return 1
    try:
        cfg = load_config(args.params, args.overrides)
    except ConfigError as err:
        print(f"eagle3ops: {err}", file=sys.stderr)
        return 2
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    from importlib import import_module

    stage = import_module(f"eagle3ops.stages.{args.stage}")
    variant = {"train": getattr(args, "init", None), "eval": getattr(args, "drafter", None)}.get(args.stage)
    try:
        stage.run(cfg, variant) if variant else stage.run(cfg)
    except InputError as err:  # bad input: a clear message, no traceback
        print(f"eagle3ops {args.stage}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
