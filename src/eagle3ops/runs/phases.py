"""The pipeline's phases as its stage runs time them: the one list that `compare` and `project` read."""
from __future__ import annotations

from dataclasses import dataclass

from eagle3ops.config import EvalDrafter, TrainInit
from eagle3ops.runs.records import PipelineRecord, StageRecord


@dataclass(frozen=True)
class Phase:
    name: str
    stage: str  # the dvc stage that times it
    time_metric: str
    rate_metric: str | None = None  # tokens per second
    all_gpus: bool = True  # False: one GPU, whatever the machine has
    grows_with_samples: bool = True  # False: a one-off cost, or a fixed amount of work

    def seconds(self, record: PipelineRecord) -> float | None:
        return record.metric(self.stage, self.time_metric)

    def rate(self, record: PipelineRecord) -> float | None:
        return record.metric(self.stage, self.rate_metric) if self.rate_metric else None


PHASES = (
    # Loading the target, as the extract stage times it: that stage loads the target and nothing else.
    Phase("load", "extract", "time/load_s", grows_with_samples=False),
    Phase("generate", "generate", "time/generate_s", "tokens_per_s"),
    Phase("extract", "extract", "time/extract_s", "tokens_per_s"),
    # The pipeline trains and evaluates a drafter on one device; eval runs the fixed held-out prompt set.
    *(Phase(f"train@{init}", f"train@{init}", "time/train_s", "tokens_per_s", all_gpus=False) for init in TrainInit),
    # Each eval then measures tau again at eval.sampled_temperature: the same prompts decoded speculatively only (no
    # target-alone reference); runs without it (sampled_temperature null, or older runs) have no decode_sampled_s.
    *(phase for drafter in EvalDrafter for phase in (
        Phase(f"eval@{drafter}", f"eval@{drafter}", "time/decode_s", "spec_tokens_per_s", all_gpus=False,
              grows_with_samples=False),
        Phase(f"eval@{drafter} sampled", f"eval@{drafter}", "time/decode_sampled_s", "sampled/spec_tokens_per_s",
              all_gpus=False, grows_with_samples=False))),
)


def timed_phases(record: PipelineRecord) -> list[tuple[Phase, StageRecord]]:
    """The phases `record` timed, in pipeline order, each with the stage run that timed it."""
    return [(phase, record.stages[phase.stage]) for phase in PHASES
            if phase.stage in record.stages and phase.time_metric in record.stages[phase.stage].metrics]
