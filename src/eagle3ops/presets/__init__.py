"""Presets for real targets: the params.yaml settings a known architecture needs; and `zoo-gpu`, the embedded
default at GPU size (its `architecture` is null: the zoo stage builds the target, so there is no directory to check).

`<name>.yaml` holds a `description`, the `architecture` it is for (a JSON beside it with the facts of the real
model's config.json, which the tests check the preset against) and `params`, the keys it sets: the target's
repository id, its revision (null: the user pins it), the layers the drafter reads, dtypes, remote code, chat
template, the draft vocabulary size and the published drafter's shape, with every key of train.draft (a shape
is one unit: nothing of an earlier one may survive the merge). `eagle3ops preset NAME --target-path DIR` merges
them into params.yaml (`apply_preset`); every other key, and the file's comments, stay as they are.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap

from eagle3ops.config import ConfigError, load_config
from eagle3ops.errors import InputError
from eagle3ops.modeling.target import text_config

PRESETS_DIR = Path(__file__).parent
PRESET_KEYS = ("description", "architecture", "params")
# What must agree between a target directory and the architecture a preset was written for.
CHECKED_FACTS = ("num_hidden_layers", "hidden_size", "vocab_size")


class PresetError(InputError):
    """A preset that does not exist, does not fit the target, or does not fit the params schema."""


def _yaml() -> YAML:
    yaml = YAML()  # round trip: comments, key order and flow lists survive
    yaml.width = 120
    yaml.representer.add_representer(type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null"))
    return yaml


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def load_preset(name: str) -> CommentedMap:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise PresetError(f"no preset {name!r}; the presets are {', '.join(preset_names())}")
    preset = _yaml().load(path.read_text(encoding="utf-8"))
    if not isinstance(preset, dict) or sorted(preset) != sorted(PRESET_KEYS):
        raise PresetError(f"{path}: a preset has exactly the keys {', '.join(PRESET_KEYS)}")
    return preset


def architecture(name: str) -> dict:
    """The real config.json facts of the architecture preset `name` is for."""
    return json.loads((PRESETS_DIR / load_preset(name)["architecture"]).read_text(encoding="utf-8"))


def _merge(document: CommentedMap, settings: CommentedMap, prefix: str = "") -> list[str]:
    """Set `settings` into `document` key by key (nested maps merge); returns the dotted keys set. A preset
    key's own comment replaces the one params.yaml had for it."""
    changed = []
    for key, value in settings.items():
        if isinstance(value, dict) and isinstance(document.get(key), dict):
            changed += _merge(document[key], value, f"{prefix}{key}.")
            continue
        document[key] = value
        if key in settings.ca.items:
            document.ca.items[key] = settings.ca.items[key]
        changed.append(f"{prefix}{key}")
    return changed


def apply_preset(name: str, params_path: str | Path, target_path: str | None,
                 warm_start: str | None = None) -> list[str]:
    """Merge preset `name` into `params_path` for the target directory `target_path` (and `warm_start`, the
    drafter to fine-tune). The target must be the preset's architecture (a zoo preset takes no target: the zoo
    builds it); the result must load with the schema (config.load_config) before it replaces the file, in one
    rename. Returns the dotted keys set."""
    preset, params_path = load_preset(name), Path(params_path)
    if preset["architecture"] is None:
        if target_path is not None:
            raise PresetError(f"preset {name!r} builds its own target (the zoo stage): no --target-path")
    elif target_path is None:
        raise PresetError(f"preset {name!r} is for a real target: give --target-path DIR")
    else:
        facts, actual = architecture(name), _target_facts(target_path)
        facts = facts.get("text_config") or facts
        wrong = [f"{key} {actual.get(key)} (the preset's architecture: {facts[key]})" for key in CHECKED_FACTS
                 if actual.get(key) != facts[key]]
        if wrong:
            raise PresetError(f"{target_path}: not the architecture of preset {name!r}: {', '.join(wrong)}")
    if not params_path.is_file():
        raise PresetError(f"{params_path}: params file not found")
    settings = preset["params"]
    if target_path is not None:
        settings["target"]["path"] = target_path
        # docs/your-target.md, "The target in the lineage"
        settings["target"]["lineage_dep"] = f"{target_path.rstrip('/')}/config.json"
    if warm_start:
        settings.setdefault("train", CommentedMap())["warm_start"] = warm_start
    yaml = _yaml()
    document = yaml.load(params_path.read_text(encoding="utf-8")) or CommentedMap()
    changed = _merge(document, settings)
    fd, tmp = tempfile.mkstemp(dir=params_path.parent, prefix=f".{params_path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            yaml.dump(document, out)
        try:
            load_config(tmp)
        except ConfigError as err:
            raise PresetError(str(err).replace(tmp, f"{params_path} with preset {name!r}")) from None
        os.replace(tmp, params_path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return changed


def _target_facts(target_path: str) -> dict:
    try:
        return text_config(target_path)
    except InputError as err:
        raise PresetError(f"--target-path: {err}") from None
