"""Hardware profiles for `eagle3ops project`: per-GPU capacities, the machine's disk, host floor, compile times
and price, from YAML files (the shipped ones in `profiles/` beside this module, or a path to your own)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from eagle3ops.errors import InputError

PROFILE_NUMBERS = ("bf16_tflops", "hbm_tb_s", "interconnect_gb_s", "disk_gb_s", "layer_pass_ms", "price_per_hour")
PROFILE_KEYS = ("name", "gpu", "gpu_count", *PROFILE_NUMBERS, "compile_s", "compile_cached_s", "labels", "notes")


class ProjectionError(InputError):
    """A profile, run or request `project` cannot work from."""


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


def distinct(profiles: list[Profile]) -> list[Profile]:
    """One profile per name (the last given), in the order the names first appear."""
    return list({p.name: p for p in profiles}.values())
