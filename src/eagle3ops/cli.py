"""`eagle3ops <stage>`: the commands dvc.yaml runs, one per pipeline stage.

Settings come from params.yaml (one typed schema, see config.py); `--set key=value` overrides a key for a
one-off run outside DVC (under DVC, change params.yaml or use `dvc exp run -S key=value` instead, so the
lineage records it).
"""
from __future__ import annotations

import argparse
import logging
import sys

from eagle3ops.config import EVAL_DRAFTERS, TRAIN_INITS, ConfigError, load_config
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
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
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
