"""`eagle3ops project`: from a measured pilot pipeline run, the wall time and cost of a larger run on other hardware.

Whole runs here (the pilot's samples and profiles, the projection of every phase, the check against a measured run);
the per-phase model in cost_model.py, written out in docs/runs.md ("The model, phase by phase").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from eagle3ops.runs.cost_model import (
    Estimate,
    MeasuredPhase,
    TargetShape,
    estimate,
    measured_phases,
    measured_times,
    read_target_shape,
)
from eagle3ops.runs.hardware_profiles import (
    Profile,
    ProjectionError,
    distinct,
    profile_for_label,
    resolve_profile,
    shipped_profiles,
)
from eagle3ops.runs.phases import timed_phases
from eagle3ops.runs.records import PipelineRecord, load_pipeline
from eagle3ops.tracking.store import ROLE_TAG

SAMPLE_COUNTERS = (("prepare", "conversations"), ("generate", "conversations"), ("extract", "samples"))


def pilot_samples(record: PipelineRecord) -> int:
    for stage, name in SAMPLE_COUNTERS:
        value = record.metric(stage, name)
        if value:
            return int(value)
    raise ProjectionError(f"run {record.run_id}: no sample count (metric conversations of prepare or generate, "
                          f"or samples of extract)")


def pilot_profiles(record: PipelineRecord, known: list[Profile], override: Profile | None) -> dict[str, Profile]:
    """The profile each stage ran on, by dvc stage: `override`, else the one listing the stage's hardware label."""
    stages = {stage.dvc_stage: stage for _, stage in timed_phases(record)}
    if override is not None:
        return {name: override for name in stages}
    return {name: profile_for_label(stage.tags.get("hardware.label", "unknown"), known,
                                    f"run {record.run_id}, stage {name}")
            for name, stage in stages.items()}


@dataclass
class Row:
    phase: MeasuredPhase
    pilot: Profile
    estimates: dict[str, Estimate]  # by target profile name


@dataclass
class Check:
    """Projected vs measured on the measured run's own hardware and sample count."""
    run: PipelineRecord
    samples: int
    # phase, profile it ran on, projected s, measured s, and projected at the measured run's own work (its
    # counters: eval's verification steps follow the drafter's tau, tokens per sample the data): the speed model
    # alone; None where the measured run has no counters for the phase
    rows: list[tuple[str, Profile, float, float, float | None]]


@dataclass
class Projection:
    run: PipelineRecord
    samples: int
    pilot_samples: int
    targets: list[Profile]
    rows: list[Row]
    shape: TargetShape | None
    notes: list[str] = field(default_factory=list)
    check: Check | None = None

    @property
    def work_ratio(self) -> float:
        return self.samples / self.pilot_samples

    def total_s(self, target: Profile) -> float:
        return sum(row.estimates[target.name].seconds for row in self.rows)

    def cost(self, target: Profile) -> float:
        return self.total_s(target) / 3600 * target.price_per_hour


def project(record: PipelineRecord, samples: int, targets: list[Profile], known: list[Profile],
            pilot: Profile | None = None, shape: TargetShape | None = None) -> Projection:
    """Project every measured phase of `record` to `samples` samples on each of `targets`. Each stage's pilot
    profile is `pilot`, else the profile in `known` (or `targets`) that lists the stage's hardware label."""
    if samples < 1:
        raise ProjectionError(f"--samples must be at least 1, got {samples}")
    if not targets:
        raise ProjectionError("no target profile: pass --to PROFILE")
    measured = measured_phases(record, shape)
    if not measured:
        raise ProjectionError(f"run {record.run_id} ({record.name}): no timed phase to project; is it a pipeline run?")
    by_stage = pilot_profiles(record, distinct(known + targets), pilot)
    pilot_count = pilot_samples(record)
    rows = []
    for phase in measured:
        ran_on = by_stage[phase.stage.dvc_stage]
        rows.append(Row(phase, ran_on, {t.name: estimate(phase, ran_on, t, samples / pilot_count) for t in targets}))
    notes = []
    if shape is None and any(p.gpu_count > 1 for p in [*targets, *by_stage.values()]):
        notes.append("Interconnect (all-reduce) traffic is not modelled: the target's config.json (layers, hidden "
                     "size) could not be read, so multi-GPU phases count compute, memory and disk only.")
    if shape is None:
        notes.append("The host's floor a decoder-layer pass is not modelled: without the target's config.json the "
                     "layer count is unknown (it bounds small targets and small batches: docs/runs.md).")
    return Projection(record, samples, pilot_count, targets, rows, shape, notes)


def check_against(projection: Projection, measured: PipelineRecord, known: list[Profile]) -> Check:
    """Project the pilot to the measured run's hardware (its stages' hardware labels) and sample count, and pair
    each phase with the time the measured run took."""
    samples = pilot_samples(measured)
    ratio = samples / projection.pilot_samples
    candidates = distinct(known + projection.targets)
    ran_on = pilot_profiles(measured, candidates, None)
    times = {name: (stage, seconds) for name, _, stage, seconds, _ in measured_times(measured)}
    try:
        work = {phase.name: phase.demand for phase in measured_phases(measured, projection.shape)}
    except ProjectionError:  # a run recorded without the counters: the timings still compare
        work = {}
    rows = []
    for row in projection.rows:
        if row.phase.name in times:
            stage, seconds = times[row.phase.name]
            target = ran_on[stage.dvc_stage]
            at_work = (estimate(row.phase, row.pilot, target, 1.0, work[row.phase.name]).seconds
                       if row.phase.name in work else None)
            rows.append((row.phase.name, target, estimate(row.phase, row.pilot, target, ratio).seconds, seconds,
                         at_work))
    if not rows:
        raise ProjectionError(f"run {measured.run_id} ({measured.name}) has none of the pilot's phases to compare with")
    return Check(measured, samples, rows)


def fetch_pipeline(client: MlflowClient, run_id: str) -> PipelineRecord:
    """The pipeline run `run_id`; a clear error for an unknown id or a stage run's id."""
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ProjectionError(f"run {run_id!r} not found in {client.tracking_uri}") from None
    if run.data.tags.get(ROLE_TAG) != "pipeline":
        parent = run.data.tags.get("mlflow.parentRunId")
        hint = f"; its pipeline run is {parent}" if parent else ""
        raise ProjectionError(f"run {run_id} is not a pipeline run (tag {ROLE_TAG} = 'pipeline'){hint}")
    return load_pipeline(client, run_id)


def project_runs(client: MlflowClient, run_id: str, samples: int, to: list[str], from_profile: str | None = None,
                 measured_id: str | None = None, root: str | Path = ".") -> Projection:
    """What `eagle3ops project` does: profiles by name or path, runs from the tracking store, the target's shape
    from its config.json under `root`."""
    shipped = shipped_profiles()
    targets = [resolve_profile(spec, shipped) for spec in to]
    pilot = resolve_profile(from_profile, shipped) if from_profile else None
    known = list(shipped.values()) + ([pilot] if pilot else [])
    record = fetch_pipeline(client, run_id)
    projection = project(record, samples, targets, known, pilot, read_target_shape(record, root))
    if measured_id:
        projection.check = check_against(projection, fetch_pipeline(client, measured_id), known)
    return projection
