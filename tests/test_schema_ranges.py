"""Every key of the params schema range-checked and every path key held to where its stage may read or write.

The keys are found by walking the dataclasses of config.py, so a key added later is tested too: each numeric key
given 0, a negative and a string, each path key a '..' escape and an absolute path. A value is either refused in
one line naming the key's full dotted name, or accepted by design, with the reason in the tables below; a key the
tables do not know fails the walk itself.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import typing
from enum import Enum
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from eagle3ops import config as schema
from eagle3ops.config import Config, ConfigError, load_config

# Numeric keys, by the class that declares the field (the same field means the same wherever the class is used:
# zoo.drafter_training and train share DrafterTrainConfig's), for which 0 is a meaningful value.
ZERO_ACCEPTED = {
    "Config.seed": "a seed like any other",
    "TargetConfig.aux_layers": "hidden-state index 0 is the embeddings",
    "LMTrainConfig.warmup_ratio": "no warmup",
    "LMTrainConfig.weight_decay": "no weight decay (the default)",
    "DrafterTrainConfig.betas": "a beta of 0 keeps no moving average of that moment",
    "DrafterTrainConfig.weight_decay": "no weight decay (the default)",
    "DrafterTrainConfig.warmup_ratio": "no warmup",
    "DrafterTrainConfig.checkpoint_every": "no resume points",
    "DrafterTrainConfig.lk_kl_scale": "lk_lambda without the KL term",
    "DrafterTrainConfig.lk_kl_decay": "lk_lambda's KL weight kept constant",
    "DataConfig.eval_fraction": "no held-out split",
    "OpenAIEndpointConfig.max_retries": "no retry",
    "GenerateConfig.temperature": "greedy answers",
    "ExtractConfig.max_nonfinite_fraction": "any sample with NaN/inf hidden states fails the stage",
    "SimulateConfig.every": "the simulator off",
    "TrainConfig.warm_start_min_coverage": "the predecessor's head never judged too small",
    "EvalConfig.temperature": "greedy, checked token for token against the target",
    "EvalConfig.engine_tolerance": "the engine's tau must equal the decoder's",
    "VllmConfig.engine_idle_s": "no engine sessions: each stage starts and stops its own servers",
}
# ... and for which a negative one is: none. Every count, size, rate, temperature and index is refused below 0.
NEGATIVE_ACCEPTED: dict[str, str] = {}

# String keys that name paths. Outputs (a stage replaces them whole) and data read from a tracked directory are
# refused outside the project or their directory; the keys below them are DVC dependencies themselves, which DVC
# hashes wherever they are (an absolute path or one through '..' is an external dependency, tracked all the same),
# or, for the target, deliberately outside DVC.
PATHS_REFUSED_OUTSIDE = {
    "zoo.dir": "output", "zoo.data_dir": "output", "generate.out": "output", "prepare.out_dir": "output",
    "extract.out_dir": "output", "train.out_dir": "output", "report.out_dir": "output", "export.out_dir": "output",
    "export.guide": "output",
    "eval.sets[0].path": "read by eval: inside eval.sets_dir, the directory dvc.yaml tracks for it",
    "pipeline.hidden_states_dep": "train's dependency: extract.out_dir (prepare.out_dir online)",
    "target.chat_template": "a template file is read only inside the project (data/chat.py)",
    "pipeline.chat_template_dep": "the stages' dependency: target.chat_template's file (or the shipped templates)",
}
PATHS_ACCEPTED_ANYWHERE = {
    "target.path": "the target is outside DVC by design (hundreds of GB): target.lineage_dep, id and revision are "
                   "its lineage",
    "target.lineage_dep": "a DVC dependency: a real target's config.json, e.g. /models/Kimi-K2.5/config.json",
    "data.conversations": "a DVC dependency of generate: hashed wherever it is",
    "extract.import_dir": "a DVC dependency of extract: a peer engine's output directory, hashed wherever it is",
    "train.warm_start": "a DVC dependency of train@warm_start: a published drafter, e.g. /models/Kimi-K2-eagle3",
    "eval.sets_dir": "a DVC dependency of eval: hashed wherever it is, and every set must lie inside it",
}
NOT_PATHS = {
    "target.id": "a Hugging Face repo id", "target.revision": "a commit", "target.device": "a torch device",
    "generate.openai.base_url": "a URL", "generate.openai.model": "a model name",
    "generate.openai.api_key_env": "an environment variable's name", "eval.sets[0].name": "a set's name",
    "eval.sets[0].format": "a format's name", "eval.server_url": "a URL", "train.online_url": "a URL",
    "hardware.label": "a label", "mlflow.experiment": "an experiment's name", "mlflow.tracking_uri": "a URI",
    "mlflow.registered_model": "a registered model's name",
}
# A valid value for the numeric lists, so that one element at a time is changed.
LIST_BASES = {"target.aux_layers": [2, 4, 6]}


@dataclasses.dataclass(frozen=True)
class Leaf:
    key: str  # the dotted key as the error names it: eval.sets[0].limit
    where: tuple  # the path into the params tree: ("eval", "sets", 0, "limit")
    owner: str  # Class.field of the class that declares it
    kind: str  # "number", "numbers" (a list of numbers), "string", "other"


def _unwrap(hint):
    """Optional[X] -> X."""
    if typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def _owner(cls: type, name: str) -> str:
    return next(f"{c.__name__}.{name}" for c in cls.__mro__ if name in getattr(c, "__annotations__", {}))


def walk(cls: type = Config, key: str = "", where: tuple = ()) -> list[Leaf]:
    leaves = []
    hints = typing.get_type_hints(cls, vars(schema))
    for item in dataclasses.fields(cls):
        hint, name, at = _unwrap(hints[item.name]), f"{key}{item.name}", (*where, item.name)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            leaves += walk(hint, f"{name}.", at)
        elif origin is list and dataclasses.is_dataclass(args[0]):
            leaves += walk(args[0], f"{name}[0].", (*at, 0))
        elif hint in (int, float):
            leaves.append(Leaf(name, at, _owner(cls, item.name), "number"))
        elif origin is list and args[0] in (int, float):
            leaves.append(Leaf(name, at, _owner(cls, item.name), "numbers"))
        elif hint is str:
            leaves.append(Leaf(name, at, _owner(cls, item.name), "string"))
        else:  # bool, a choice (enum), a mapping, a list of strings or choices, Any
            assert hint is bool or origin in (list, dict) or hint in (dict, typing.Any) or issubclass(hint, Enum), name
            leaves.append(Leaf(name, at, _owner(cls, item.name), "other"))
    return leaves


LEAVES = walk()
NUMBERS = [leaf for leaf in LEAVES if leaf.kind in ("number", "numbers")]
STRINGS = [leaf for leaf in LEAVES if leaf.kind == "string"]
DEFAULTS = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)


def params_with(tmp_path: Path, leaf: Leaf, value, also: dict | None = None) -> Path:
    """A params file (the schema's defaults for what it leaves out) with `leaf` set to `value` (one element of a
    numeric list), and `also` (dotted key: value) besides."""
    tree: dict = {}
    if leaf.kind == "numbers":
        value = [value, *(LIST_BASES.get(leaf.key) or _get(DEFAULTS, leaf.where))[1:]]
    _set(tree, leaf.where, value)
    for key, other in (also or {}).items():
        _set(tree, tuple(key.split(".")), other)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _get(tree, where: tuple):
    for step in where:
        tree = tree[step]
    return tree


def _set(tree: dict, where: tuple, value) -> None:
    """`value` at `where`, the sections on the way made, a list on the way copied from the defaults whole."""
    node = tree
    for depth, step in enumerate(where[:-1]):
        if isinstance(node, dict) and step not in node:
            node[step] = copy.deepcopy(_get(DEFAULTS, where[: depth + 1])) if isinstance(where[depth + 1], int) else {}
        node = node[step]
    node[where[-1]] = value


def refused_naming(path: Path, leaf: Leaf) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message, message
    # a list's element may be named by its index: key 'train.betas[0]'
    assert re.search(rf"key '{re.escape(leaf.key)}(\[\d+\])?'", message), message
    return message


def test_the_walk_finds_every_key_and_the_tables_name_only_real_ones():
    keys = {leaf.key for leaf in LEAVES}
    assert {"seed", "extract.samples_per_shard", "eval.sets[0].limit", "train.betas", "train.draft.head_dim",
            "zoo.drafter_training.grad_clip", "generate.openai.timeout_s", "export.guide"} <= keys
    owners = {leaf.owner for leaf in NUMBERS}
    assert set(ZERO_ACCEPTED) <= owners and set(NEGATIVE_ACCEPTED) <= owners
    strings = {leaf.key for leaf in STRINGS}
    tables = [PATHS_REFUSED_OUTSIDE, PATHS_ACCEPTED_ANYWHERE, NOT_PATHS]
    assert sum(len(table) for table in tables) == len(strings), "a string key in two tables"
    assert set().union(*tables) == strings, f"string keys to classify: {strings - set().union(*tables)}"


@pytest.mark.parametrize("leaf", NUMBERS, ids=lambda leaf: leaf.key)
def test_a_numeric_key_at_zero_negative_and_a_string(tmp_path, leaf):
    for value, accepted in ((0, ZERO_ACCEPTED), (-1, NEGATIVE_ACCEPTED)):
        path = params_with(tmp_path, leaf, value)
        if leaf.owner in accepted:
            load_config(path)
        else:
            refused_naming(path, leaf)
    refused_naming(params_with(tmp_path, leaf, "abc"), leaf)


def escape(value: str) -> str:
    """`value` followed by enough '..' to leave the project: models/zoo/../../../outside is ../outside."""
    parts = Path(value).parts
    return "/".join([*parts, *[".."] * (len(parts) + 1), "outside" + Path(value).suffix])


def base_value(leaf: Leaf) -> str:
    return _get(DEFAULTS, leaf.where) or {"target.chat_template": "templates/mine.jinja"}[leaf.key]


@pytest.mark.parametrize("leaf", [leaf for leaf in STRINGS if leaf.key in PATHS_REFUSED_OUTSIDE], ids=lambda leaf: leaf.key)
def test_a_path_key_is_refused_outside_where_its_stage_may_go(tmp_path, leaf):
    value = base_value(leaf)
    for outside in (escape(value), str(tmp_path / "elsewhere" / Path(value).name)):
        refused_naming(params_with(tmp_path, leaf, outside), leaf)


@pytest.mark.parametrize("leaf", [leaf for leaf in STRINGS if leaf.key in PATHS_ACCEPTED_ANYWHERE], ids=lambda leaf: leaf.key)
def test_a_dependency_path_is_accepted_anywhere(tmp_path, leaf):
    value = base_value(leaf)
    for outside in (escape(value), str(tmp_path / "elsewhere" / Path(value).name)):
        also = {}
        if leaf.key == "eval.sets_dir":  # its sets move with it
            also = {"eval.sets": [{**s, "path": f"{outside}/{Path(s['path']).name}"} for s in DEFAULTS["eval"]["sets"]]}
        cfg = load_config(params_with(tmp_path, leaf, outside, also))
        assert _get(OmegaConf.to_container(OmegaConf.structured(cfg)), leaf.where) == outside


# --- the cases found, by name --------------------------------------------------------------------------------


def test_an_eval_set_outside_sets_dir_through_dotdot_is_refused(tmp_path):
    """DVC tracks eval.sets_dir for the eval stage: a set reached through '..' would be measured while a change to
    it left the eval 'up to date'."""
    params = tmp_path / "params.yaml"
    params.write_text("seed: 0\n")
    with pytest.raises(ConfigError, match=r"^[^\n]*: key 'eval\.sets\[0\]\.path': 'data/zoo/bench/\.\./\.\./outside/"
                                          r"x\.jsonl' is not inside eval\.sets_dir \('data/zoo/bench'\)"):
        load_config(params, ["eval.sets=[{name: x, path: data/zoo/bench/../../outside/x.jsonl}]"])
    # normalised, a path that stays inside is inside; and an absolute path inside it is too
    inside = load_config(params, ["eval.sets=[{name: x, path: data/zoo/bench/sub/../x.jsonl}]"])
    assert inside.eval.sets[0].path == "data/zoo/bench/sub/../x.jsonl"
    load_config(params, [f"eval.sets=[{{name: x, path: {Path.cwd()}/data/zoo/bench/x.jsonl}}]"])


def test_samples_per_shard_zero_is_refused(tmp_path):
    """0 made extract keep every sample in memory and write one shard at the end, without resume."""
    params = tmp_path / "params.yaml"
    params.write_text("extract:\n  samples_per_shard: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(params)
    assert str(err.value) == (f"{params}: key 'extract.samples_per_shard': must be at least 1, got 0: a shard is the "
                              f"unit the stage writes and resumes from (about 1-4 GB a shard at scale)")


def test_each_openai_limit_is_named_alone(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("seed: 0\n")
    for key, value in (("concurrency", 0), ("max_retries", -1), ("timeout_s", 0)):
        with pytest.raises(ConfigError, match=rf"key 'generate\.openai\.{key}': must be"):
            load_config(params, [f"generate.openai.{key}={value}"])


def test_the_pipeline_key_that_disagrees_is_named(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("seed: 0\n")
    with pytest.raises(ConfigError, match=r"key 'pipeline\.hidden_states_dep': 'data/features/\.\./prepared' is not "
                                          r"extract\.out_dir \('data/features'\)"):
        load_config(params, ["pipeline.hidden_states_dep=data/features/../prepared"])
    load_config(params, ["pipeline.hidden_states_dep=data/features/"])  # the same directory, written otherwise


def test_a_template_file_is_a_dependency_of_the_stages_that_render_conversations(tmp_path):
    """dvc.yaml has generate, prepare, train and eval depend on pipeline.chat_template_dep: it must be the template
    file where target.chat_template names one, so that editing the file re-runs them."""
    params = tmp_path / "params.yaml"
    params.write_text("seed: 0\n")
    with pytest.raises(ConfigError, match=r"key 'pipeline\.chat_template_dep': 'src/eagle3ops/data/templates' is not "
                                          r"'templates/mine\.jinja'"):
        load_config(params, ["target.chat_template=templates/mine.jinja"])
    load_config(params, ["target.chat_template=templates/mine.jinja", "pipeline.chat_template_dep=templates/mine.jinja"])
    load_config(params, ["target.chat_template=qwen3"])  # a shipped one: the shipped templates
    with pytest.raises(ConfigError, match=r"key 'pipeline\.chat_template_dep'"):
        load_config(params, ["pipeline.chat_template_dep=templates/mine.jinja"])
    stages = yaml.safe_load((Path(__file__).parents[1] / "dvc.yaml").read_text())["stages"]
    for stage in (stages["generate"], stages["prepare"], stages["train"]["do"], stages["eval"]["do"]):
        assert "${pipeline.chat_template_dep}" in stage["deps"]
