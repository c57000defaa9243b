"""params.yaml and the schema are one source of every default; a stage reads only the keys it declares."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml

from eagle3ops.config import Config, ConfigError, load_config
from eagle3ops.tracking.stage_view import (
    NOT_LINEAGE,
    UndeclaredParamError,
    for_stage,
    stage_digest,
    stage_params,
)

ROOT = Path(__file__).resolve().parents[1]


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not prefix.endswith(("device_map.", "max_memory.", "extra_body.")):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def disagreements(params: dict) -> list[str]:
    """Where a params tree and the schema's defaults differ: a key only one has, or another value."""
    written, schema = flatten(params), stage_params(Config())
    return ([f"{key}: in params.yaml, not in the schema" for key in sorted(written.keys() - schema.keys())]
            + [f"{key}: in the schema, missing from params.yaml" for key in sorted(schema.keys() - written.keys())]
            + [f"{key}: params.yaml {written[key]!r}, schema {schema[key]!r}" for key in sorted(written.keys() & schema.keys())
               if not same(written[key], schema[key])])


def test_params_yaml_spells_out_every_default_of_the_schema():
    assert disagreements(yaml.safe_load((ROOT / "params.yaml").read_text())) == []


def test_a_disagreement_between_params_yaml_and_the_schema_is_found():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    changed = copy.deepcopy(params)
    changed["train"]["lr"] = 1e-4
    del changed["train"]["betas"]
    changed["eval"]["sets"][0]["limit"] = 5
    found = disagreements(changed)
    assert [line.split(":")[0] for line in found] == ["train.betas", "eval.sets", "train.lr"], found
    assert found[2] == "train.lr: params.yaml 0.0001, schema 0.003"


def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("seed: 0\ntrain:\n  lr: [0.1\n  epochs: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message == f"{path}:4:9: not valid YAML: expected ',' or ']', but got ':'", message


def test_a_stage_reads_only_what_it_declares():
    view = for_stage(Config(), "train@scratch", ["seed", "train", "target.id", "extract.out_dir"])
    assert view.train.lr == 0.003 and view.target.id and view.extract.out_dir == "data/features"
    assert view.target.device == "auto" and view.mlflow.experiment == "eagle3ops"  # NOT_LINEAGE: where it runs
    for read, key in ((lambda: view.eval.k, "eval"), (lambda: view.target.path, "target.path"),
                      (lambda: view.extract.dtype, "extract.dtype")):
        with pytest.raises(UndeclaredParamError, match=rf"train@scratch reads params key '{key}', which its entry in "
                                                       rf"dvc.yaml does not declare"):
            read()
    assert set(stage_params(view)) == {key for key in stage_params(Config())
                                         if key.split(".")[0] in ("seed", "train", "vllm", "hardware", "mlflow", "threads")
                                         or key in ("target.id", "extract.out_dir", *NOT_LINEAGE)}


def test_resume_key_ignores_keys_the_stage_does_not_read(tmp_path):
    declared = ["seed", "train", "pipeline.hidden_states_dep"]
    digest = stage_digest(for_stage(load_config(ROOT / "params.yaml"), "train@scratch", declared))
    for unrelated in ("eval.k=5", "report.out_dir=elsewhere", "target.device=cpu", "mlflow.experiment=other"):
        assert stage_digest(for_stage(load_config(ROOT / "params.yaml", [unrelated]), "train@scratch", declared)) == digest
    moved = ["extract.out_dir=data/other", "pipeline.hidden_states_dep=data/other"]
    for related in (["train.lr=0.1"], ["seed=3"], moved):
        assert stage_digest(for_stage(load_config(ROOT / "params.yaml", related), "train@scratch", declared)) != digest


def test_a_stage_run_by_the_cli_is_held_to_its_dvc_yaml_entry(tmp_path, monkeypatch, capsys):
    """`eagle3ops report` in a project whose dvc.yaml writes the report's directory literally instead of through
    ${report.out_dir} and declares none of the report's own params: the stage's first read of report.out_dir stops
    it, naming the key."""
    from eagle3ops import cli
    from helpers import isolate

    isolate(monkeypatch, tmp_path)
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    stages["stages"]["report"]["outs"] = [{"reports": {"cache": False}}]
    stages["stages"]["report"]["params"] = ["pipeline.extract"]  # report's own section left out
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(stages))
    assert cli.main(["report"]) == 1
    assert "eagle3ops report: error: report reads params key 'report', which its entry in dvc.yaml does not declare" \
        in capsys.readouterr().err
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("line, key", [("  optimizer: sgd\n", "train.optimizer"),
                                       ("  optimizer: adamw\n  muon_lr: 0.01\n", "train.muon_lr"),
                                       ("  ttt_positions: shifted\n", "train.ttt_positions"),
                                       ("  warm_start_vocab: guess\n", "train.warm_start_vocab"),
                                       ("  loss: ce\n", "train.loss"), ("  lk_kl_scale: 2.0\n", "train.lk_kl_scale"),
                                       ("  lk_kl_decay: -1.0\n", "train.lk_kl_decay")])
def test_the_training_variants_keys_are_checked_by_name(tmp_path, line, key):
    """A choice outside the list, or Muon's rate with AdamW (it would be silently unused), names the key."""
    path = tmp_path / "params.yaml"
    path.write_text("train:\n" + line)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(path)


@pytest.mark.parametrize("args", ['["--port", "8001"]', '["--host=0.0.0.0"]', '["--max-num-seqs", "8", "--model", "x"]'])
def test_vllm_arguments_the_stage_manages_are_refused_in_extra_args(tmp_path, args):
    """A port of its own made vLLM ready on it while the stage polled another until vllm.ready_timeout_s."""
    path = tmp_path / "params.yaml"
    path.write_text(f"vllm:\n  extra_args: {args}\n")
    with pytest.raises(ConfigError, match=r"vllm\.extra_args.*set by .*not here"):
        load_config(path)


def test_scratch_declares_no_warm_start_key_and_warm_start_every_train_key():
    """What dvc.yaml has each train variant depend on: scratch reads every train key but the warm start's (so a
    warm-start experiment leaves it alone; tests/test_pipeline_e2e.py checks it with `dvc status`), warm_start all."""
    from eagle3ops.tracking.lineage import declared_params

    train_keys = {key for key in stage_params(Config()) if key.startswith("train.")}
    warm_start_keys = {key for key in train_keys if key.startswith("train.warm_start")}
    scratch = stage_params(for_stage(Config(), "train@scratch", declared_params(ROOT, "train@scratch")))
    warm = stage_params(for_stage(Config(), "train@warm_start", declared_params(ROOT, "train@warm_start")))
    assert train_keys - warm_start_keys <= set(scratch) and not warm_start_keys & set(scratch)
    assert train_keys <= set(warm)
