"""Stage `zoo`: build the embedded default (tokenizer, two tiny targets, the predecessor's drafter, datasets)."""
from eagle3ops.config import Config
from eagle3ops.tracking.metrics import record
from eagle3ops.tracking.run import stage_run
from eagle3ops.zoo.build import build_zoo


def run(cfg: Config) -> None:
    with stage_run(cfg, "zoo") as tracked:
        metrics = build_zoo(cfg, tracked)
        record(tracked, "zoo", metrics)
