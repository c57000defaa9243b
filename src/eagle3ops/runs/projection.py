"""`eagle3ops project`: from a measured pilot pipeline run, the wall time and cost of a larger run on other hardware.

The model, phase by phase
-------------------------
A pilot run (say 1,000 samples) measured each phase's wall time. Each phase also left counters from which its
demand on five resources follows:

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
host           decoder-layer passes run one after another: each sequential forward of an L-layer model
               is L passes, and each costs the host a floor of Python, kernel launches and syncs
               (the profile's layer_pass_ms) that no FLOP or byte count sees. It is what bounds a small
               model, or a small batch, on a GPU: the GPU-sized zoo's 22M-parameter target decodes at
               ~28 ms a step on an H200 whose HBM would allow 0.01 ms. Read from the target's config.json
               (the layer count), like interconnect.
=============  =========================================================================================

Phases and their counters (the stage that measured them, the timer):

- load (extract's `time/load_s`): disk reads target_bytes. Uses all GPUs (the weights are spread over them).
  Does not grow with the number of samples.
- generate (`time/generate_s`): compute over new_tokens; memory target_bytes * decode_steps (each batch decodes
  until its longest answer ends; runs without the counter: new_tokens / generate.batch_size, full batches);
  interconnect over new_tokens; host decode_steps * L. Prompt prefill is not counted (no counter for prompt
  tokens). All GPUs.
- extract (`time/extract_s`): compute over `tokens`; memory target_bytes * ceil(samples / extract.batch_size)
  forward passes; interconnect over `tokens`; disk writes `bytes`; host passes * L. All GPUs.
- train@<init> compile (`first_step_s` + the held-out evaluation after the loop: `time/train_s` - train_tokens /
  tokens_per_s): the loop's one-off part, compilation on a GPU. Not split over resources, not scaled: the time
  described below (a cold cache costs 51 s on the H200, a warm one 11 s).
- train@<init> (`time/train_s` less the above): compute (the training step above); host (steps - 1) *
  ttt_steps * 3 (the drafter's one layer forward and backward in each TTT step). One GPU: this pipeline trains
  the drafter on one device, whatever the machine has.
- eval@<drafter> (`time/decode_s`): the phase runs speculative decoding (verify_steps target forwards of k + 1
  tokens) and then the target's plain greedy decoding as the losslessness reference (about emitted_tokens
  forwards of one token). Compute 2 * target_params * (verify_steps * (k + 1) + emitted_tokens); memory
  target_bytes * (verify_steps + emitted_tokens); host (verify_steps + emitted_tokens) * L + verify_steps * k
  (the drafter's k one-layer passes a step). One GPU. It does not grow with the number of samples: it runs
  the fixed held-out prompt set (`data.eval_prompts`), not a share of the training data.

The target's size comes from the phase's own stage, else from extract's (every stage runs the same target.path).
Dense models are assumed: for a mixture-of-experts target, target_params counts every expert while a token uses
only a few, so compute demand is overstated and the split below leans toward compute.

From measured time to projected time: the ideal time of a resource on a profile is demand / capacity, with
capacity = per-GPU figure * GPUs used for compute and memory, the per-GPU link rate for interconnect, the
machine's rate for disk, 1 / layer_pass_ms for host (one process drives the passes). The host figure is an
achieved time, measured, so it is taken as it is; the others are peak capacities, which a phase reaches only in
part. The measured time less the pilot's host time is what the peak resources took, split in proportion to their
ideal times on the pilot's profile (no overlap between resources is assumed); each part is scaled by ideal(target)
/ ideal(pilot), which is capacity(pilot) / capacity(target) when the demand does not depend on the GPU count, and
by the work ratio N / pilot samples (not for load and eval, see above). Written out:

    slowdown  = (measured_s - host_s(pilot)) / sum(peak ideal_s(pilot profile))   # the pilot's distance from ideal
    projected = (slowdown * sum(peak ideal_s(target profile)) + host_s(target)) * work_ratio

(where a phase measured less than its host time, host_s(target) is scaled down by measured / host_s(pilot)), so
a resource the pilot did not use (all-reduce when the pilot had one GPU) enters at the pilot's slowdown. The
dominant resource ("bound") is the largest of those parts on the target profile. The compile phases are not
scaled: on a profile that compiles (compile_s > 0) they take its compile_s (the run's first train stage, a cold
cache) and compile_cached_s (the next: the graphs are in the cache); on one that runs eager, the pilot's own
measured time on its own profile. Cost = projected hours * the profile's price per hour (the whole machine, also
while a phase uses one of its GPUs).

Pilot samples: prepare's `conversations` (the pipeline's input dataset), else generate's, else extract's
`samples`. Pilot profile: `--from`, else for each stage the profile whose `labels` contain that stage's
`hardware.label` tag (a stage DVC skipped carries the label of the machine that produced its outputs). Profiles are
YAML files: the shipped ones in `eagle3ops/runs/profiles/`, or a path to your own.
"""
from __future__ import annotations

import dataclasses
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

RESOURCES = ("compute", "memory", "interconnect", "disk", "host")
ALLREDUCES_PER_LAYER = 2  # tensor parallelism: one after attention, one after the MLP
ACTIVATION_BYTES = 2  # bf16
TRAIN_PASSES_PER_TTT_STEP = 3  # the drafter's one decoder layer: a forward and a backward (about two forwards' work)
PROFILE_NUMBERS = ("bf16_tflops", "hbm_tb_s", "interconnect_gb_s", "disk_gb_s", "layer_pass_ms", "price_per_hour")
PROFILE_KEYS = ("name", "gpu", "gpu_count", *PROFILE_NUMBERS, "compile_s", "compile_cached_s", "labels", "notes")
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
    layer_pass_ms: float  # host time of one decoder layer in a sequential forward: Python, launches, syncs
    price_per_hour: float  # USD, the whole machine
    compile_s: float  # the training loop's compilation there, from a cold cache (0: it runs eager, as on a CPU)
    compile_cached_s: float  # the same with the graphs in the cache: the second train stage of a run
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
        if resource == "host":  # one process drives the passes in turn, however many GPUs it spreads them over
            return 1e3 / self.layer_pass_ms
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
    for key in ("compile_s", "compile_cached_s"):
        value = data[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise fail(key, f"must be a number >= 0, got {value!r}")
    labels = data["labels"]
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) and x for x in labels):
        raise fail("labels", f"must be a non-empty list of hardware labels, got {labels!r}")
    numbers = {key: None if data[key] is None else float(data[key]) for key in PROFILE_NUMBERS}
    return Profile(name=data["name"], gpu=data["gpu"], gpu_count=count, **numbers, compile_s=float(data["compile_s"]),
                   compile_cached_s=float(data["compile_cached_s"]), labels=tuple(labels), notes=data["notes"],
                   source=source)


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
class Phase:
    name: str  # "load", "generate", "extract", "train@scratch", "eval@baseline"
    stage: StageRecord  # the stage run that measured it
    measured_s: float
    all_gpus: bool  # False: one GPU, whatever the machine has
    scales: bool  # grows with the number of samples
    demand: Demand
    fixed: str | None = None  # a one-off cost: "cold" (the run's first compilation) or "cached" (a later one)


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
    steps = counter("verify_steps")  # eval@<drafter>
    # Runs recorded before the emitted_tokens counter: tau = emitted / steps = 1 + accepted / steps.
    emitted = counter("emitted_tokens") if "emitted_tokens" in stage.metrics else steps + counter("accepted_tokens")
    k = _param(record, stage, "eval.k")
    # the target verifies (steps) and decodes the reference (emitted); the one-layer drafter drafts k a step
    return Demand(2 * counter("target_params") * (steps * (k + 1) + emitted),
                  counter("target_bytes") * (steps + emitted), layer_passes=(steps + emitted) * layers + steps * k)


def _train_fixed_s(stage: StageRecord) -> float | None:
    """A train phase's one-off part: its first step (the compilation, on a GPU) and the held-out evaluation after
    the loop (compiled again, without gradients); None for runs recorded before the first_step_s counter."""
    m = stage.metrics
    if "first_step_s" not in m or not m.get("tokens_per_s"):
        return None
    loop_s = m["train_tokens"] / m["tokens_per_s"]  # the loop alone (tokens_per_s: to 0.1 tok/s)
    return m["first_step_s"] + max(m["time/train_s"] - loop_s, 0.0)


def _measured(record: PipelineRecord) -> list[tuple[str, StageRecord, float, str | None]]:
    """(phase, stage run, seconds, one-off kind) for every phase the run measured, in pipeline order: a train
    stage's time split into its compilation (the run's first "cold", the next ones "cached": the same shapes) and
    the rest."""
    measured, compiled = [], False
    for name, stage, timer in _timed_stages(record):
        seconds = stage.metrics[timer]
        fixed = _train_fixed_s(stage) if name.startswith("train@") else None
        if fixed is not None:
            measured.append((f"{name} compile", stage, fixed, "cached" if compiled else "cold"))
            seconds, compiled = seconds - fixed, True
        measured.append((name, stage, seconds, None))
    return measured


def phases(record: PipelineRecord, shape: TargetShape | None) -> list[Phase]:
    """The run's measured phases with their resource demands (see the module docstring)."""
    return [Phase(name, stage, seconds, all_gpus=name in ("load", "generate", "extract"),
                  scales=not fixed and name != "load" and not name.startswith("eval@"),
                  demand=Demand() if fixed else _demand(record, name, stage, shape), fixed=fixed)
            for name, stage, seconds, fixed in _measured(record)]


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
              "disk": phase.demand.disk_bytes, "host": phase.demand.layer_passes}
    return {r: demand[r] / profile.capacity(r, gpus) if demand[r] else 0.0 for r in RESOURCES}


@dataclass(frozen=True)
class Estimate:
    seconds: float
    dominant: str  # the resource with the largest ideal time on the target profile
    gpus: int


def estimate(phase: Phase, pilot: Profile, target: Profile, work_ratio: float, work: Demand | None = None) -> Estimate:
    """The phase's projected wall time on `target`, `work_ratio` times the pilot's work, or `work` itself (see the
    docstring)."""
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
    if shape is None:
        notes.append("The host's floor a decoder-layer pass is not modelled: without the target's config.json the "
                     "layer count is unknown (it bounds small targets and small batches: docs/runs.md).")
    return Projection(record, samples, pilot_count, targets, rows, shape, notes)


def check_against(projection: Projection, measured: PipelineRecord, known: list[Profile]) -> Check:
    """Project the pilot to the measured run's hardware (its stages' hardware labels) and sample count, and pair
    each phase with the time the measured run took."""
    samples = pilot_samples(measured)
    ratio = samples / projection.pilot_samples
    candidates = _unique(known + projection.targets)
    ran_on = pilot_profiles(measured, candidates, None)
    times = {phase: (stage, seconds) for phase, stage, seconds, _ in _measured(measured)}
    try:
        work = {phase.name: phase.demand for phase in phases(measured, projection.shape)}
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


def _unique(profiles: list[Profile]) -> list[Profile]:
    return list({p.name: p for p in profiles}.values())


# ----------------------------------------------------------------------------------------------------------- report

RESOURCE_NAMES = {"compute": "compute", "memory": "HBM", "interconnect": "interconnect", "disk": "disk",
                  "host": "host", "fixed": "fixed"}


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
    def ratio(measured: float, projected: float | None) -> str:
        return f"{measured / projected:.2f}" if projected else "-"

    table = [[phase, target.name, _num(projected), _num(measured), ratio(measured, projected),
              _num(at_work) if at_work is not None else "-", ratio(measured, at_work)]
             for phase, target, projected, measured, at_work in check.rows]
    totals = [sum(r[i] for r in check.rows) for i in (2, 3)]
    at_work = None if any(r[4] is None for r in check.rows) else sum(r[4] for r in check.rows)
    table.append(["**total**", "", _num(totals[0]), _num(totals[1]), ratio(totals[1], totals[0]),
                  _num(at_work) if at_work is not None else "-", ratio(totals[1], at_work)])
    return [f"## Projection vs measured run {check.run.name} ({check.run.run_id}), {check.samples:,} samples", "",
            tabulate(table, ["phase", "ran on", "projected s", "measured s", "measured / projected",
                             "at its work s", "measured / at its work"], tablefmt="github", disable_numparse=True),
            "", "at its work = projected with the measured run's own counters instead of the pilot's times the "
            "work ratio (eval's verification steps follow the drafter's tau; tokens and decode steps a sample, the "
            "data): where the two ratios differ, the work was mispredicted, not the speed."]


def plot_check(projection: Projection, path: str | Path) -> None:
    """The check as bars: projected, projected at the run's own work, and measured seconds per phase (log scale)."""
    import matplotlib.pyplot as plt

    check = projection.check
    assert check is not None, "a projection checked against a measured run (check_against)"
    names = [row[0] for row in check.rows]
    series = {"projected": [row[2] for row in check.rows],
              "at its work": [row[4] if row[4] is not None else float("nan") for row in check.rows],
              "measured": [row[3] for row in check.rows]}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.2))
    width = 0.8 / len(series)
    for i, (label, seconds) in enumerate(series.items()):
        ax.bar([j + (i - 1) * width for j in range(len(names))], seconds, width, label=label, edgecolor="white")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(yscale="log", ylabel="seconds",
           title=f"Pilot {projection.run.name} projected to run {check.run.name} ({check.samples:,} samples), "
                 "and measured")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
