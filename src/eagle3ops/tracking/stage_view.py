"""The config as one stage may read it, and the params a stage run records.

A stage reads params.yaml through `for_stage`: the keys its dvc.yaml entry declares (and those its paths
interpolate, tracking/lineage.py `declared_params`), plus NOT_LINEAGE. Reading any other key raises
UndeclaredParamError naming it, so a stage never depends on a value whose change would not re-run it. The view
is the config itself, each section's class swapped for a subclass that guards the undeclared keys: code that
takes a TrainConfig still gets one.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Iterable
from enum import StrEnum
from functools import cache
from typing import Any

from eagle3ops.config import Config, Section
from eagle3ops.errors import InputError

# Where and how the stages run, not what they compute: no stage declares these, and changing one re-runs nothing
# (`dvc repro --force` or `dvc exp run --force` measures the same pipeline on other hardware).
NOT_LINEAGE = ("threads", "cpu_reproducible", "gpu_deterministic", "target.device", "target.device_map", "target.max_memory", "vllm",
               "hardware", "mlflow")

_FULL = "_stage_view_full"  # on a view: (the whole config, the keys it may read)
_HIDDEN = "_stage_view_hidden"  # on a guarded section: (stage, {field: dotted key})


class UndeclaredParamError(InputError):
    """A stage read a params key that its dvc.yaml entry does not declare."""


def for_stage(cfg: Config, stage: str, readable: Iterable[str]) -> Config:
    """`cfg` as `stage` may read it: the keys of `readable` (dotted; a section stands for all its keys) and of
    NOT_LINEAGE; reading any other raises UndeclaredParamError."""
    readable = {*readable, *NOT_LINEAGE}
    view = _restricted(cfg, "", stage, readable)
    object.__setattr__(view, _FULL, (cfg, readable))
    return view


def stage_params(cfg: Config) -> dict[str, Any]:
    """{dotted key: value} of every key the stage may read (all of them outside a stage's view); sections are
    spelled out, other values kept whole (a list, a mapping)."""
    full, readable = _whole(cfg)
    flat = _flatten(full, "")
    return flat if readable is None else {key: value for key, value in flat.items() if covered(key, readable)}


def pipeline_params(cfg: Config, keys: Iterable[str]) -> dict[str, Any]:
    """{dotted key: value} of `keys`, less NOT_LINEAGE, from the whole config, also in a stage's view: what a
    pipeline run records about itself (on its MLflow parent run), never an input of a stage's own work."""
    full, _ = _whole(cfg)
    keys = set(keys)
    return {key: value for key, value in _flatten(full, "").items()
            if covered(key, keys) and not covered(key, NOT_LINEAGE)}


def digest(cfg: Config) -> str:
    """Short hash of the whole resolved config: equal digests mean the same parameters everywhere."""
    return _digest(_flatten(_whole(cfg)[0], ""))


def stage_digest(cfg: Config, ignore: Iterable[str] = ()) -> str:
    """Short hash of the keys the stage may read, less NOT_LINEAGE and `ignore`: what its results depend on (the
    key of its resume point)."""
    left_out = (*NOT_LINEAGE, *ignore)
    return _digest({key: value for key, value in stage_params(cfg).items() if not covered(key, left_out)})


def covered(key: str, readable: Iterable[str]) -> bool:
    """Whether `key` is one of `readable` or inside a section of it."""
    return any(key == name or key.startswith(f"{name}.") for name in readable)


def _whole(cfg: Config) -> tuple[Config, set[str] | None]:
    return cfg.__dict__.get(_FULL, (cfg, None))


def _digest(values: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


def _plain(value: Any) -> Any:
    """A value as params.yaml spells it: enums as their strings, sections in lists as mappings."""
    if isinstance(value, Section):
        return {item.name: _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value) if isinstance(value, StrEnum) else value


def _flatten(section: Section, prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        if isinstance(value, Section):
            flat.update(_flatten(value, f"{prefix}{item.name}."))
        else:
            flat[f"{prefix}{item.name}"] = _plain(value)
    return flat


@cache
def _guarded(section_type: type[Section]) -> type[Section]:
    """`section_type` with its undeclared keys guarded: the same fields, methods and checks."""

    def __getattribute__(self, name: str) -> Any:
        hidden = object.__getattribute__(self, "__dict__").get(_HIDDEN)
        if hidden is not None and name in hidden[1]:
            raise UndeclaredParamError(f"{hidden[0]} reads params key '{hidden[1][name]}', which its entry in "
                                       f"dvc.yaml does not declare: add it to the stage's params, or a change to it "
                                       f"would not re-run the stage")
        return object.__getattribute__(self, name)

    return type(section_type.__name__, (section_type,), {"__getattribute__": __getattribute__,
                                                         "__module__": section_type.__module__})


def _restricted(section: Section, prefix: str, stage: str, readable: set[str]) -> Section:
    view = copy.copy(section)
    hidden = {}
    for item in dataclasses.fields(section):
        key = f"{prefix}{item.name}"
        if covered(key, readable):
            continue
        value = getattr(section, item.name)
        if isinstance(value, Section) and any(name.startswith(f"{key}.") for name in readable):
            object.__setattr__(view, item.name, _restricted(value, f"{key}.", stage, readable))
        else:
            hidden[item.name] = key
    if hidden:
        view.__class__ = _guarded(type(section))
        object.__setattr__(view, _HIDDEN, (stage, hidden))
    return view
