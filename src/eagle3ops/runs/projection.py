"""`eagle3ops project`: from a measured pilot pipeline run, the wall time and cost of a larger run on other hardware.

The model, phase by phase
-------------------------
A pilot run (say 1,000 samples) measured each phase's wall time. Each phase also left counters from which its
demand on four resources follows:

=============  =========================================================================================
resource       demand
=============  =========================================================================================
compute        FLOPs. Target forward: 2 * target_params * tokens. Drafter training: 6 * draft_params *
               train_tokens * ttt_steps (forward + backward of the drafter, once per training-time-test
               step; `train_tokens` already counts every epoch). Not counted: the frozen target lm_head
               that turns stored final hidden states into target logits during training (2 * H * V per
               token, forward only), the drafter's own forwards during eval, attention's quadratic term.
memory (HBM)   bytes read from GPU memory: the target's weights once per forward pass, target_bytes *
               passes. Activations and the KV cache are not counted.
interconnect   bytes each GPU sends in tensor-parallel all-reduces, when a phase spreads the target over
               g > 1 GPUs: ring all-reduce moves 2 * (g - 1) / g of the buffer per GPU, and there are two
               all-reduces per decoder layer (after attention, after the MLP) of tokens * hidden * 2 bytes
               (bf16 activations): 2 * (g-1)/g * 2 * layers * tokens * hidden * 2. The layer count and
               hidden size are read from the target's config.json (`text_config` when it nests one);
               without it this resource is left out and the report says so.
disk           bytes read or written: a target load reads target_bytes; extract writes `bytes`.
=============  =========================================================================================

Phases and their counters (the stage that measured them, the timer):

- load (extract's `time/load_s`): disk reads target_bytes. Uses all GPUs (the weights are spread over them).
  Does not grow with the number of samples.
- generate (`time/generate_s`): compute over new_tokens; memory target_bytes * new_tokens / generate.batch_size
  decode steps (full batches assumed); interconnect over new_tokens. Prompt prefill is not counted (no counter
  for prompt tokens). All GPUs.
- extract (`time/extract_s`): compute over `tokens`; memory target_bytes * samples / extract.batch_size forward
  passes; interconnect over `tokens`; disk writes `bytes`. All GPUs.
- train@<init> (`time/train_s`): compute only (the training step above). One GPU: this pipeline trains the
  drafter on one device, whatever the machine has.
- eval@<drafter> (`time/decode_s`): the phase runs speculative decoding (verify_steps target forwards of k + 1
  tokens) and then the target's plain greedy decoding as the losslessness reference (about emitted_tokens
  forwards of one token). Compute 2 * target_params * (verify_steps * (k + 1) + emitted_tokens); memory
  target_bytes * (verify_steps + emitted_tokens). One GPU. It does not grow with the number of samples: it runs
  the fixed held-out prompt set (`data.eval_prompts`), not a share of the training data.

The target's size comes from the phase's own stage, else from extract's (every stage runs the same target.path).
Dense models are assumed: for a mixture-of-experts target, target_params counts every expert while a token uses
only a few, so compute demand is overstated and the split below leans toward compute.

From measured time to projected time: the ideal time of a resource on a profile is demand / capacity, with
capacity = per-GPU figure * GPUs used for compute and memory, the per-GPU link rate for interconnect, the
machine's rate for disk. The measured time is split into parts in proportion to the ideal times on the pilot's
profile (no overlap between resources is assumed); each part is scaled by ideal(target) / ideal(pilot), which is
capacity(pilot) / capacity(target) when the demand does not depend on the GPU count, and by the work ratio
N / pilot samples (not for load and eval, see above). Written out:

    slowdown  = measured_s / sum(ideal_s(pilot profile))            # the pilot's distance from ideal
    projected = slowdown * sum(ideal_s(target profile)) * work_ratio

so a resource the pilot did not use (all-reduce when the pilot had one GPU) enters at the pilot's slowdown. The
dominant resource of a phase on a profile is the one with the largest ideal time there. Cost = projected hours
* the profile's price per hour (the whole machine, also while a phase uses one of its GPUs).

Pilot samples: prepare's `conversations` (the pipeline's input dataset), else generate's, else extract's
`samples`. Pilot profile: `--from`, else for each stage the profile whose `labels` contain that stage's
`hardware.label` tag (a stage DVC skipped carries the label of the machine that produced its outputs). Profiles are YAML files: the shipped ones in `eagle3ops/runs/profiles/`, or a path to your own.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from tabulate import tabulate

from eagle3ops.errors import InputError
from eagle3ops.runs.records import PipelineRecord, StageRecord, load_pipeline
from eagle3ops.tracking.store import ROLE_TAG

RESOURCES = ("compute", "memory", "interconnect", "disk")
ALLREDUCES_PER_LAYER = 2  # tensor parallelism: one after attention, one after the MLP
ACTIVATION_BYTES = 2  # bf16
PROFILE_NUMBERS = ("bf16_tflops", "hbm_tb_s", "interconnect_gb_s", "disk_gb_s", "price_per_hour")
PROFILE_KEYS = ("name", "gpu", "gpu_count", *PROFILE_NUMBERS, "labels", "notes")
SAMPLE_COUNTERS = (("prepare", "conversations"), ("generate", "conversations"), ("extract", "samples"))


class ProjectionError(InputError):
    """A profile, run or request `project` cannot work from."""


# ---------------------------------------------------------------------------------------------------------- profiles

@dataclass(frozen=True)
class Profile:
    name: str
    gpu: str
    gpu_count: int
    bf16_tflops: float  # dense, per GPU
    hbm_tb_s: float  # per GPU
    interconnect_gb_s: float | None  # per GPU, per direction; None only with one GPU
    disk_gb_s: float  # the machine's
    price_per_hour: float  # USD, the whole machine
    labels: tuple[str, ...]
    notes: str
    source: str  # the YAML file

    def capacity(self, resource: str, gpus: int) -> float:
        """Units per second of `resource` for a phase running on `gpus` of this machine's GPUs."""
        if resource == "compute":
            return gpus * self.bf16_tflops * 1e12
        if resource == "memory":
            return gpus * self.hbm_tb_s * 1e12
        if resource == "interconnect":
            assert self.interconnect_gb_s is not None, "asked only with gpus > 1, where the profile must give it"
            return self.interconnect_gb_s * 1e9
        return self.disk_gb_s * 1e9


def parse_profile(data: Any, source: str) -> Profile:
    """A profile from a YAML mapping; ProjectionError names `source` and the key at fault."""
    def fail(key: str, message: str) -> ProjectionError:
        return ProjectionError(f"{source}: key '{key}': {message}")

    if not isinstance(data, dict):
        raise ProjectionError(f"{source}: expected a mapping with keys {', '.join(PROFILE_KEYS)}")
    for key in data:
        if key not in PROFILE_KEYS:
            raise fail(str(key), f"unknown key (expected {', '.join(PROFILE_KEYS)})")
    for key in PROFILE_KEYS:
        if key not in data:
            raise fail(key, "missing")
    for key in ("name", "gpu", "notes"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise fail(key, f"must be a non-empty string, got {data[key]!r}")
    count = data["gpu_count"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise fail("gpu_count", f"must be a whole number >= 1, got {count!r}")
    for key in PROFILE_NUMBERS:
        value = data[key]
        if key == "interconnect_gb_s" and value is None and count == 1:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            allowed = " (null only with gpu_count 1)" if key == "interconnect_gb_s" else ""
            raise fail(key, f"must be a positive number{allowed}, got {value!r}")
    labels = data["labels"]
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) and x for x in labels):
        raise fail("labels", f"must be a non-empty list of hardware labels, got {labels!r}")
    numbers = {key: None if data[key] is None else float(data[key]) for key in PROFILE_NUMBERS}
    return Profile(name=data["name"], gpu=data["gpu"], gpu_count=count, **numbers, labels=tuple(labels),
                   notes=data["notes"], source=source)


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ProjectionError(f"{path}: cannot read the profile: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ProjectionError(f"{path}: not valid YAML: {err}") from None
    profile = parse_profile(data, str(path))
    if profile.name != path.stem:
        raise ProjectionError(f"{path}: key 'name': {profile.name!r} differs from the file name {path.stem!r}")
    return profile


def shipped_profiles() -> dict[str, Profile]:
    """The profiles in the package's `profiles/` folder, by name."""
    folder = resources.files("eagle3ops.runs") / "profiles"
    with resources.as_file(folder) as directory:
        return {p.name: p for p in map(load_profile, sorted(Path(directory).glob("*.yaml")))}


def resolve_profile(spec: str, known: dict[str, Profile]) -> Profile:
    """`spec` is a profile name from `known` or the path of a profile YAML."""
    if spec in known:
        return known[spec]
    if spec.endswith((".yaml", ".yml")) or Path(spec).is_file():
        return load_profile(spec)
    raise ProjectionError(f"unknown profile {spec!r}: use one of {', '.join(sorted(known))} or a path to a profile YAML")


def profile_for_label(label: str, profiles: list[Profile], where: str) -> Profile:
    """The profile whose `labels` contain the hardware label `label` (of `where`, for the message)."""
    for profile in profiles:
        if label in profile.labels:
            return profile
    listing = "; ".join(f"{p.name} [{', '.join(p.labels)}]" for p in profiles)
    raise ProjectionError(f"{where} ran on hardware labelled {label!r}, which no profile lists in its labels "
                          f"(profiles: {listing}); pass --from PROFILE or add the label to a profile's labels")


# ------------------------------------------------------------------------------------------------------------ phases

@dataclass(frozen=True)
class TargetShape:
    layers: int
    hidden: int
    source: str  # the config.json it was read from


def read_target_shape(record: PipelineRecord, root: str | Path = ".") -> TargetShape | None:
    """Layers and hidden size of the run's target from `<root>/<target.path>/config.json`; None if unreadable."""
    stage = record.stages.get("extract")
    target = stage.params.get("target.path") if stage else None
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


@dataclass(frozen=True)
class Phase:
    name: str  # "load", "generate", "extract", "train@scratch", "eval@baseline"
    stage: StageRecord  # the stage run that measured it
    measured_s: float
    all_gpus: bool  # False: one GPU, whatever the machine has
    scales: bool  # grows with the number of samples
    demand: Demand


def _timed_stages(record: PipelineRecord) -> list[tuple[str, StageRecord, str]]:
    """(phase, stage run, timer metric) for every phase the run measured, in pipeline order."""
    wanted = [("load", "extract", "time/load_s"), ("generate", "generate", "time/generate_s"),
              ("extract", "extract", "time/extract_s")]
    wanted += [(name, name, "time/train_s") for name in sorted(record.stages) if name.startswith("train@")]
    wanted += [(name, name, "time/decode_s") for name in sorted(record.stages) if name.startswith("eval@")]
    return [(phase, record.stages[stage], timer) for phase, stage, timer in wanted
            if stage in record.stages and timer in record.stages[stage].metrics]


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

    if phase == "load":
        return Demand(disk_bytes=counter("target_bytes"))
    if phase == "generate":
        tokens = counter("new_tokens")
        steps = tokens / _param(record, stage, "generate.batch_size")
        return Demand(2 * counter("target_params") * tokens, counter("target_bytes") * steps,
                      _allreduce_bytes(shape, tokens))
    if phase == "extract":
        tokens = counter("tokens")
        passes = counter("samples") / _param(record, stage, "extract.batch_size")
        return Demand(2 * counter("target_params") * tokens, counter("target_bytes") * passes,
                      _allreduce_bytes(shape, tokens), counter("bytes"))
    if phase.startswith("train@"):
        # runs recorded before the TTT depth was a param only logged it as a metric
        ttt_steps = counter("ttt_steps") if "ttt_steps" in stage.metrics else _param(record, stage, "train.ttt_steps")
        return Demand(flops=6 * counter("draft_params") * counter("train_tokens") * ttt_steps)
    steps = counter("verify_steps")  # eval@<drafter>
    # Runs recorded before the emitted_tokens counter: tau = emitted / steps = 1 + accepted / steps.
    emitted = counter("emitted_tokens") if "emitted_tokens" in stage.metrics else steps + counter("accepted_tokens")
    k = _param(record, stage, "eval.k")
    return Demand(2 * counter("target_params") * (steps * (k + 1) + emitted), counter("target_bytes") * (steps + emitted))


def phases(record: PipelineRecord, shape: TargetShape | None) -> list[Phase]:
    """The run's measured phases with their resource demands (see the module docstring)."""
    return [Phase(name, stage, stage.metrics[timer], all_gpus=name in ("load", "generate", "extract"),
                  scales=name != "load" and not name.startswith("eval@"), demand=_demand(record, name, stage, shape))
            for name, stage, timer in _timed_stages(record)]


def pilot_samples(record: PipelineRecord) -> int:
    for stage, name in SAMPLE_COUNTERS:
        value = record.metric(stage, name)
        if value:
            return int(value)
    raise ProjectionError(f"run {record.run_id}: no sample count (metric conversations of prepare or generate, "
                          f"or samples of extract)")


# -------------------------------------------------------------------------------------------------------- projection

def gpus_used(phase: Phase, profile: Profile) -> int:
    return profile.gpu_count if phase.all_gpus else 1


def ideal_seconds(phase: Phase, profile: Profile) -> dict[str, float]:
    """Each resource's time if the phase ran at the profile's full capacity of it."""
    gpus = gpus_used(phase, profile)
    traffic = phase.demand.allreduce_bytes * 2 * (gpus - 1) / gpus  # per GPU, ring all-reduce
    demand = {"compute": phase.demand.flops, "memory": phase.demand.hbm_bytes, "interconnect": traffic,
              "disk": phase.demand.disk_bytes}
    return {r: demand[r] / profile.capacity(r, gpus) if demand[r] else 0.0 for r in RESOURCES}


@dataclass(frozen=True)
class Estimate:
    seconds: float
    dominant: str  # the resource with the largest ideal time on the target profile
    gpus: int


def estimate(phase: Phase, pilot: Profile, target: Profile, work_ratio: float) -> Estimate:
    """The phase's projected wall time on `target`, `work_ratio` times the pilot's work (see the docstring)."""
    pilot_ideal = sum(ideal_seconds(phase, pilot).values())
    if pilot_ideal <= 0:
        raise ProjectionError(f"stage {phase.stage.dvc_stage}: its counters give phase {phase.name} no resource demand")
    slowdown = phase.measured_s / pilot_ideal
    target_ideal = ideal_seconds(phase, target)
    ratio = work_ratio if phase.scales else 1.0
    return Estimate(slowdown * sum(target_ideal.values()) * ratio, max(RESOURCES, key=target_ideal.__getitem__),
                    gpus_used(phase, target))


def pilot_profiles(record: PipelineRecord, known: list[Profile], override: Profile | None) -> dict[str, Profile]:
    """The profile each stage ran on, by dvc stage: `override`, else the one listing the stage's hardware label."""
    stages = {stage.dvc_stage: stage for _, stage, _ in _timed_stages(record)}
    if override is not None:
        return {name: override for name in stages}
    return {name: profile_for_label(stage.tags.get("hardware.label", "unknown"), known,
                                    f"run {record.run_id}, stage {name}")
            for name, stage in stages.items()}


@dataclass
class Row:
    phase: Phase
    pilot: Profile
    estimates: dict[str, Estimate]  # by target profile name


@dataclass
class Check:
    """Projected vs measured on the measured run's own hardware and sample count."""
    run: PipelineRecord
    samples: int
    rows: list[tuple[str, Profile, float, float]]  # phase, profile it ran on, projected s, measured s


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
    measured = phases(record, shape)
    if not measured:
        raise ProjectionError(f"run {record.run_id} ({record.name}): no timed phase to project; is it a pipeline run?")
    by_stage = pilot_profiles(record, _unique(known + targets), pilot)
    pilot_count = pilot_samples(record)
    rows = []
    for phase in measured:
        ran_on = by_stage[phase.stage.dvc_stage]
        rows.append(Row(phase, ran_on, {t.name: estimate(phase, ran_on, t, samples / pilot_count) for t in targets}))
    notes = []
    if shape is None and any(p.gpu_count > 1 for p in [*targets, *by_stage.values()]):
        notes.append("Interconnect (all-reduce) traffic is not modelled: the target's config.json (layers, hidden "
                     "size) could not be read, so multi-GPU phases count compute, memory and disk only.")
    return Projection(record, samples, pilot_count, targets, rows, shape, notes)


def check_against(projection: Projection, measured: PipelineRecord, known: list[Profile]) -> Check:
    """Project the pilot to the measured run's hardware (its stages' hardware labels) and sample count, and pair
    each phase with the time the measured run took."""
    samples = pilot_samples(measured)
    ratio = samples / projection.pilot_samples
    candidates = _unique(known + projection.targets)
    ran_on = pilot_profiles(measured, candidates, None)
    times = {phase: (stage, stage.metrics[timer]) for phase, stage, timer in _timed_stages(measured)}
    rows = []
    for row in projection.rows:
        if row.phase.name in times:
            stage, seconds = times[row.phase.name]
            target = ran_on[stage.dvc_stage]
            rows.append((row.phase.name, target, estimate(row.phase, row.pilot, target, ratio).seconds, seconds))
    if not rows:
        raise ProjectionError(f"run {measured.run_id} ({measured.name}) has none of the pilot's phases to compare with")
    return Check(measured, samples, rows)


def _unique(profiles: list[Profile]) -> list[Profile]:
    return list({p.name: p for p in profiles}.values())


# ----------------------------------------------------------------------------------------------------------- report

RESOURCE_NAMES = {"compute": "compute", "memory": "HBM", "interconnect": "interconnect", "disk": "disk"}


def _num(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def render(projection: Projection) -> str:
    """The projection as markdown: a table per phase, totals and cost, then notes."""
    run, targets = projection.run, projection.targets
    headers = ["phase", "GPUs", "measured on", "pilot s"]
    for t in targets:
        headers += [f"{t.name} ({t.gpu_count} GPU) s", f"{t.name} bound"]
    table = []
    for row in projection.rows:
        line = [row.phase.name, "all" if row.phase.all_gpus else "1", row.pilot.name, _num(row.phase.measured_s)]
        for t in targets:
            e = row.estimates[t.name]
            line += [_num(e.seconds), RESOURCE_NAMES[e.dominant]]
        table.append(line)
    pilot_total = sum(row.phase.measured_s for row in projection.rows)
    table.append(["**total s**", "", "", _num(pilot_total), *(x for t in targets for x in (_num(projection.total_s(t)), ""))])
    table.append(["**total h**", "", "", _num(pilot_total / 3600),
                  *(x for t in targets for x in (_num(projection.total_s(t) / 3600), ""))])
    table.append(["**cost USD**", "", "", "", *(x for t in targets
                                                 for x in (f"${_num(projection.cost(t))}", f"at ${t.price_per_hour:g}/h"))])
    shape = (f"{projection.shape.layers} layers, hidden {projection.shape.hidden} ({projection.shape.source})"
             if projection.shape else "unknown")
    lines = [
        f"# Projection of pipeline run {run.name} ({run.run_id}) to {projection.samples:,} samples",
        "",
        f"Pilot: {projection.pilot_samples:,} samples; work ratio x{projection.work_ratio:.4g} for generate, extract "
        f"and train (load: x1; eval: x1, a fixed prompt set). Target shape: {shape}.",
        "",
        tabulate(table, headers, tablefmt="github", disable_numparse=True),
        "",
        "Model (see eagle3ops.runs.projection): each phase's measured time is split over compute, HBM, interconnect and "
        "disk in proportion to their ideal times on the pilot's profile (demand from the run's counters / "
        "capacity), and each part is scaled by the capacity ratio and the work ratio. \"bound\" = the resource with "
        "the largest ideal time on that profile. Cost = projected hours x the whole machine's price per hour.",
    ]
    profiles = _unique([row.pilot for row in projection.rows] + targets)
    lines += ["", "Profiles (figures and sources in their notes):"]
    lines += [f"- {p.name}: {p.gpu_count} x {p.gpu}; {p.bf16_tflops:g} TFLOP/s, {p.hbm_tb_s:g} TB/s HBM"
              + (f", {p.interconnect_gb_s:g} GB/s link" if p.interconnect_gb_s else "")
              + f" per GPU; disk {p.disk_gb_s:g} GB/s; ${p.price_per_hour:g}/h ({p.source})" for p in profiles]
    if projection.notes:
        lines += ["", *(f"Note: {note}" for note in projection.notes)]
    if projection.check is not None:
        lines += ["", *_render_check(projection.check)]
    return "\n".join(lines)


def _render_check(check: Check) -> list[str]:
    table = [[phase, target.name, _num(projected), _num(measured), f"{measured / projected:.2f}" if projected else "-"]
             for phase, target, projected, measured in check.rows]
    projected_total, measured_total = sum(r[2] for r in check.rows), sum(r[3] for r in check.rows)
    table.append(["**total**", "", _num(projected_total), _num(measured_total),
                  f"{measured_total / projected_total:.2f}" if projected_total else "-"])
    return [f"## Projection vs measured run {check.run.name} ({check.run.run_id}), {check.samples:,} samples", "",
            tabulate(table, ["phase", "ran on", "projected s", "measured s", "measured / projected"],
                     tablefmt="github", disable_numparse=True)]


# ------------------------------------------------------------------------------------------------------------ runs

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
