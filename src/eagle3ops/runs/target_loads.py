"""How many times a pipeline run loaded its target, stage by stage, read from its stage runs, beside how many the
same stages load with a vLLM server of each stage's own (`vllm.engine_idle_s: 0`, the design before engine
sessions). Loading is a large target's fixed tax (22.5 minutes for Kimi-K2.5's 540 GB); `eagle3ops project`
prices both counts at the load time it projects (docs/serving.md, "Engine sessions")."""
from __future__ import annotations

from dataclasses import dataclass

from eagle3ops.runs.records import PipelineRecord, StageRecord
from eagle3ops.serving.session import ENGINES_TAG


@dataclass(frozen=True)
class TargetLoads:
    in_run: dict[str, int]  # by stage: the loads the run made (an engine found running loads nothing)
    per_stage: dict[str, int]  # the same stages, each starting every server it uses

    @property
    def total(self) -> int:
        return sum(self.in_run.values())

    @property
    def per_stage_total(self) -> int:
        return sum(self.per_stage.values())


def _unset(value: str | None) -> bool:
    return value in (None, "", "None")


def _engines(stage: StageRecord) -> tuple[int, int]:
    """(engines the stage started, engines it used) from its tag; (0, 0) for a stage that used none."""
    used = [entry for entry in stage.tags.get(ENGINES_TAG, "").split(", ") if entry]
    return sum(entry.startswith("started") for entry in used), len(used)


def stage_loads(stage: StageRecord) -> tuple[int, int]:
    """(loads in the run, loads with servers of the stage's own) of one stage run: the target in the stage's own
    process (hooks, the decoder, online training), a server it starts for itself (hidden-state capture), and the
    vLLM engines it used (in the run: those it started; per stage: each one)."""
    params, name = stage.params, stage.name
    started, used = _engines(stage)
    if name == "generate":
        backend = params.get("generate.backend", "hf")
        return (1, 1) if backend == "hf" else (started, used)  # openai: a server someone else runs
    if name == "extract":
        return (0, 0) if params.get("extract.backend") == "import" else (1, 1)  # hooks, or a capturing server
    if name.startswith("train@"):
        if params.get("train.hidden_states") != "online":
            return 0, 0
        own = params.get("train.online_engine") == "hf" or _unset(params.get("train.online_url"))
        return (1, 1) if own else (0, 0)
    if name == "target_speed":
        return started, used
    if name.startswith("eval@"):
        decoder = int(params.get("eval.backend", "hf") == "hf")
        return decoder + started, decoder + used
    if name == "export" and "engine_started" in stage.metrics:  # the export drafted on an engine session
        return int(stage.metrics["engine_started"]), 1
    return 0, 0


def target_loads(record: PipelineRecord) -> TargetLoads:
    """The run's target loads by stage (a stage DVC did not re-run counts as it did when it ran)."""
    loads = {name: stage_loads(stage) for name, stage in record.stages.items()}
    loading = {name: pair for name, pair in loads.items() if any(pair)}
    return TargetLoads({name: pair[0] for name, pair in loading.items()},
                       {name: pair[1] for name, pair in loading.items()})
