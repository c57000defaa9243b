"""The cost model of `eagle3ops project`: what each measured phase of a pipeline run asks of compute, HBM,
interconnect, disk and the host, and its projected wall time on another hardware profile. The model, with what it
leaves out, is written out in docs/runs.md ("The model, phase by phase")."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from eagle3ops.runs.hardware_profiles import Profile, ProjectionError
from eagle3ops.runs.phases import Phase, timed_phases
from eagle3ops.runs.records import PipelineRecord, StageRecord

RESOURCES = ("compute", "memory", "interconnect", "disk", "host")
ALLREDUCES_PER_LAYER = 2  # tensor parallelism: one after attention, one after the MLP
ACTIVATION_BYTES = 2  # bf16
TRAIN_PASSES_PER_TTT_STEP = 3  # the drafter's one decoder layer: a forward and a backward (about two forwards' work)


@dataclass(frozen=True)
class TargetShape:
    layers: int
    hidden: int
    source: str  # the config.json it was read from


def read_target_shape(record: PipelineRecord, root: str | Path = ".") -> TargetShape | None:
    """Layers and hidden size of the run's target from `<root>/<target.path>/config.json`; None if unreadable."""
    stages = sorted(record.stages.values(), key=lambda stage: stage.dvc_stage != "extract")  # extract's first
    target = next((stage.params["target.path"] for stage in stages if "target.path" in stage.params), None)
    if not target:
        return None
    path = Path(root) / target / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        text = config.get("text_config", config)
        return TargetShape(int(text["num_hidden_layers"]), int(text["hidden_size"]), str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class Demand:
    flops: float = 0.0
    hbm_bytes: float = 0.0
    allreduce_bytes: float = 0.0  # the all-reduced buffers' total size; each GPU sends 2 * (g-1)/g of it
    disk_bytes: float = 0.0
    layer_passes: float = 0.0  # decoder layers run one after another, summed over the sequential forwards


@dataclass(frozen=True)
class MeasuredPhase:
    name: str  # "load", "generate", "extract", "train@scratch compile", "train@scratch", "eval@baseline"
    stage: StageRecord  # the stage run that measured it
    measured_s: float
    all_gpus: bool  # False: one GPU, whatever the machine has
    scales: bool  # grows with the number of samples
    demand: Demand
    fixed: str | None = None  # a one-off cost: "cold" (the run's first compilation) or "cached" (a later one)


def _counter(record: PipelineRecord, stage: StageRecord, name: str) -> float:
    if name in stage.metrics:
        return stage.metrics[name]
    extract = record.stages.get("extract")
    if name.startswith("target_") and extract is not None and name in extract.metrics:
        return extract.metrics[name]
    raise ProjectionError(f"run {record.run_id}, stage {stage.dvc_stage}: no metric {name!r}, which the projection needs")


def _param(record: PipelineRecord, stage: StageRecord, name: str) -> float:
    try:
        return float(stage.params[name])
    except (KeyError, ValueError):
        raise ProjectionError(f"run {record.run_id}, stage {stage.dvc_stage}: no numeric param {name!r}") from None


def _allreduce_bytes(shape: TargetShape | None, tokens: float) -> float:
    if shape is None:
        return 0.0
    return ALLREDUCES_PER_LAYER * shape.layers * tokens * shape.hidden * ACTIVATION_BYTES


def _demand(record: PipelineRecord, phase: str, stage: StageRecord, shape: TargetShape | None) -> Demand:
    def counter(name: str) -> float:
        return _counter(record, stage, name)

    layers = shape.layers if shape else 0  # unknown depth: no host demand (the report says so)
    if phase == "load":
        return Demand(disk_bytes=counter("target_bytes"))
    if phase == "generate":
        tokens = counter("new_tokens")
        # runs recorded before the decode_steps counter: full batches assumed
        steps = counter("decode_steps") if "decode_steps" in stage.metrics else (
            tokens / _param(record, stage, "generate.batch_size"))
        return Demand(2 * counter("target_params") * tokens, counter("target_bytes") * steps,
                      _allreduce_bytes(shape, tokens), layer_passes=steps * layers)
    if phase == "extract":
        tokens = counter("tokens")
        passes = math.ceil(counter("samples") / _param(record, stage, "extract.batch_size"))
        return Demand(2 * counter("target_params") * tokens, counter("target_bytes") * passes,
                      _allreduce_bytes(shape, tokens), counter("bytes"), passes * layers)
    if phase.startswith("train@"):
        # runs recorded before the TTT depth was a param only logged it as a metric
        ttt_steps = counter("ttt_steps") if "ttt_steps" in stage.metrics else _param(record, stage, "train.ttt_steps")
        steps = counter("steps") - ("first_step_s" in stage.metrics)  # the first is the fixed phase's
        return Demand(flops=6 * counter("draft_params") * counter("train_tokens") * ttt_steps,
                      layer_passes=steps * ttt_steps * TRAIN_PASSES_PER_TTT_STEP)
    k = _param(record, stage, "eval.k")
    # eval.batch_size prompts decode together: one forward, one read of the weights, one host pass of each layer
    # for all of them (the counters sum over the prompts); runs recorded before the param decoded one at a time
    batch = _param(record, stage, "eval.batch_size") if "eval.batch_size" in stage.params else 1.0
    if phase.endswith(" sampled"):  # eval@<drafter> at eval.sampled_temperature: speculative decoding alone
        steps = counter("sampled/verify_steps")
        return Demand(2 * counter("target_params") * steps * (k + 1), counter("target_bytes") * steps / batch,
                      layer_passes=steps * (layers + k) / batch)
    steps = counter("verify_steps")  # eval@<drafter>
    # Runs recorded before the emitted_tokens counter: tau = emitted / steps = 1 + accepted / steps.
    emitted = counter("emitted_tokens") if "emitted_tokens" in stage.metrics else steps + counter("accepted_tokens")
    # the target verifies (steps) and decodes the reference (emitted); the one-layer drafter drafts k a step
    return Demand(2 * counter("target_params") * (steps * (k + 1) + emitted),
                  counter("target_bytes") * (steps + emitted) / batch,
                  layer_passes=((steps + emitted) * layers + steps * k) / batch)


def _train_fixed_s(stage: StageRecord) -> float | None:
    """A train phase's one-off part: its first step (the compilation, on a GPU) and the held-out evaluation after
    the loop (compiled again, without gradients); None for runs recorded before the first_step_s counter."""
    m = stage.metrics
    if "first_step_s" not in m or not m.get("tokens_per_s"):
        return None
    loop_s = m["train_tokens"] / m["tokens_per_s"]  # the loop alone (tokens_per_s: to 0.1 tok/s)
    return m["first_step_s"] + max(m["time/train_s"] - loop_s, 0.0)


def measured_times(record: PipelineRecord) -> list[tuple[str, Phase, StageRecord, float, str | None]]:
    """(name, phase, stage run, seconds, one-off kind) for every phase the run measured, in pipeline order: a train
    stage's time split into its compilation (the run's first "cold", the next ones "cached": the same shapes) and
    the rest."""
    measured, compiled = [], False
    for phase, stage in timed_phases(record):
        seconds = stage.metrics[phase.time_metric]
        fixed = _train_fixed_s(stage) if phase.name.startswith("train@") else None
        if fixed is not None:
            measured.append((f"{phase.name} compile", phase, stage, fixed, "cached" if compiled else "cold"))
            seconds, compiled = seconds - fixed, True
        measured.append((phase.name, phase, stage, seconds, None))
    return measured


def measured_phases(record: PipelineRecord, shape: TargetShape | None) -> list[MeasuredPhase]:
    """The run's measured phases with their resource demands (docs/runs.md)."""
    return [MeasuredPhase(name, stage, seconds, all_gpus=phase.all_gpus,
                          scales=not fixed and phase.grows_with_samples,
                          demand=Demand() if fixed else _demand(record, name, stage, shape), fixed=fixed)
            for name, phase, stage, seconds, fixed in measured_times(record)]


def gpus_used(phase: MeasuredPhase, profile: Profile) -> int:
    return profile.gpu_count if phase.all_gpus else 1


def ideal_seconds(phase: MeasuredPhase, profile: Profile) -> dict[str, float]:
    """Each resource's time if the phase ran at the profile's full capacity of it."""
    gpus = gpus_used(phase, profile)
    traffic = phase.demand.allreduce_bytes * 2 * (gpus - 1) / gpus  # per GPU, ring all-reduce
    demand = {"compute": phase.demand.flops, "memory": phase.demand.hbm_bytes, "interconnect": traffic,
              "disk": phase.demand.disk_bytes, "host": phase.demand.layer_passes}
    return {r: demand[r] / profile.capacity(r, gpus) if demand[r] else 0.0 for r in RESOURCES}


@dataclass(frozen=True)
class Estimate:
    seconds: float
    dominant: str  # the resource with the largest ideal time on the target profile
    gpus: int


def estimate(phase: MeasuredPhase, pilot: Profile, target: Profile, work_ratio: float,
             work: Demand | None = None) -> Estimate:
    """The phase's projected wall time on `target`, `work_ratio` times the pilot's work, or `work` itself
    (docs/runs.md)."""
    if phase.fixed:
        if target.compile_s > 0:
            return Estimate(target.compile_s if phase.fixed == "cold" else target.compile_cached_s, "fixed", 1)
        return Estimate(phase.measured_s if target.name == pilot.name else 0.0, "fixed", 1)  # eager: no compiling
    pilot_ideal = ideal_seconds(phase, pilot)
    target_ideal = ideal_seconds(phase if work is None else dataclasses.replace(phase, demand=work), target)
    pilot_rest = sum(seconds for resource, seconds in pilot_ideal.items() if resource != "host")
    if pilot_rest + pilot_ideal["host"] <= 0:
        raise ProjectionError(f"stage {phase.stage.dvc_stage}: its counters give phase {phase.name} no resource demand")
    # host: an achieved floor, taken as it is (scaled down where the phase measured less than it); the resources
    # with peak capacities share what is left, at the pilot's distance from their ideal
    host_share = min(1.0, phase.measured_s / pilot_ideal["host"]) if pilot_ideal["host"] else 0.0
    slowdown = max(phase.measured_s - pilot_ideal["host"], 0.0) / pilot_rest if pilot_rest else 0.0
    parts = {resource: (host_share if resource == "host" else slowdown) * seconds
             for resource, seconds in target_ideal.items()}
    ratio = work_ratio if phase.scales else 1.0
    return Estimate(sum(parts.values()) * ratio, max(RESOURCES, key=parts.__getitem__), gpus_used(phase, target))

