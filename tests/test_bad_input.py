"""Bad input through the real CLI: a non-zero exit, one clear line naming the file / line / key, and no output.

Each test runs `eagle3ops <stage>` in-process in its own directory, with its own sqlite MLflow store.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from eagle3ops.cli import main
from eagle3ops.formats.specforge import CheckpointError, load_into, save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from helpers import isolate

CONVERSATIONS = "data/generated/conversations.jsonl"


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An initialised (migrated) sqlite store, copied per test: creating one costs about a second."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_mlflow_db: Path) -> Path:
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    isolate(monkeypatch, tmp_path)
    return tmp_path


def write_params(workdir: Path, params: dict | str) -> Path:
    path = workdir / "params.yaml"
    path.write_text(params if isinstance(params, str) else yaml.safe_dump(params))
    return path


def write_jsonl(path: Path, lines: list[dict | str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def conversation(i: int, user: str = "Hello world, how are you?", assistant: str = "The fox jumps.") -> dict:
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"{user} {i}"},
                                        {"role": "assistant", "content": f"{assistant} {i}"}]}


def run_cli(stage: str, params: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([stage, "--params", str(params)])
    return rc, capsys.readouterr().err


def leftovers(directory: Path) -> list[str]:
    """Temporary siblings a crashed write could leave behind."""
    return [str(p) for p in directory.rglob("*") if p.name.endswith((".partial", ".tmp"))]


# ----------------------------------------------------------------------------------------------------------- params

def test_unknown_params_key(workdir, capsys):
    params = write_params(workdir, "train:\n  lrr: 1\n")
    rc, err = run_cli("prepare", params, capsys)
    assert rc == 2
    assert "train.lrr" in err
    assert str(params) in err
    assert err.startswith("eagle3ops prepare: error: ")
    assert "Traceback" not in err
    assert not (workdir / "data").exists() and not (workdir / "metrics").exists()


def test_wrong_type_params_value(workdir, capsys):
    params = write_params(workdir, {"train": {"lr": "fast"}})
    rc, err = run_cli("prepare", params, capsys)
    assert rc == 2
    assert "train.lr" in err and "fast" in err
    assert str(params) in err
    assert not (workdir / "data").exists()


def test_missing_params_file(workdir, capsys):
    rc, err = run_cli("prepare", workdir / "nope.yaml", capsys)
    assert rc == 2
    assert f"{workdir / 'nope.yaml'}: params file not found" in err


# ---------------------------------------------------------------------------------------------------------- prepare

def test_prepare_malformed_jsonl_line(workdir, capsys, tiny_target_dir):
    write_jsonl(workdir / CONVERSATIONS, [conversation(1), conversation(2), '{"id": "c3", "messages": [{"role"',
                                          conversation(4)])
    params = write_params(workdir, {"target": {"path": str(tiny_target_dir)}})
    rc, err = run_cli("prepare", params, capsys)
    assert rc == 1
    assert f"{CONVERSATIONS}:3:" in err
    assert "Traceback" not in err
    assert not (workdir / "data" / "prepared").exists()
    assert not (workdir / "metrics" / "prepare.json").exists()
    assert leftovers(workdir) == []


def test_prepare_everything_filtered_out(workdir, capsys, tiny_target_dir):
    long_prompt = "The fox jumps over the lazy dog. " * 10
    write_jsonl(workdir / CONVERSATIONS, [conversation(i, user=long_prompt) for i in range(4)])
    params = write_params(workdir, {"target": {"path": str(tiny_target_dir)}, "data": {"max_len": 16}})
    rc, err = run_cli("prepare", params, capsys)
    assert rc == 1
    assert "max_len=16" in err
    assert CONVERSATIONS in err
    assert not (workdir / "data" / "prepared").exists()
    assert leftovers(workdir) == []


# ------------------------------------------------------------------------------------------------- missing target

@pytest.mark.parametrize("stage, output", [("extract", "data/features"), ("generate", CONVERSATIONS)])
def test_missing_target_directory(workdir, capsys, stage, output):
    missing = workdir / "models" / "no-such-target"
    write_jsonl(workdir / "data" / "zoo" / "conversations.jsonl", [conversation(1)])
    params = write_params(workdir, {"target": {"path": str(missing)}, "data": {"conversations": "data/zoo/conversations.jsonl"}})
    rc, err = run_cli(stage, params, capsys)
    assert rc == 1
    assert f"eagle3ops {stage}: error: {missing}" in err
    assert "target.path" in err
    assert not (workdir / output).exists()
    assert leftovers(workdir) == []


# ------------------------------------------------------------------------------------------------------- aux layers

def test_extract_aux_layers_out_of_range(workdir, capsys, tiny_target_dir):
    write_jsonl(workdir / CONVERSATIONS, [conversation(i) for i in range(6)])
    good = write_params(workdir, {"target": {"path": str(tiny_target_dir)}, "data": {"draft_vocab_size": 32}})
    rc, err = run_cli("prepare", good, capsys)
    assert rc == 0, err
    assert (workdir / "data" / "prepared" / "train" / "manifest.json").is_file()

    params = write_params(workdir, {"target": {"path": str(tiny_target_dir), "aux_layers": [2, 2, 99]},
                                    "data": {"draft_vocab_size": 32}})
    rc, err = run_cli("extract", params, capsys)
    assert rc == 1
    assert "target.aux_layers" in err
    assert "99" in err
    assert "4 decoder layers" in err and "0..3" in err  # the valid range for the 4-layer tiny target
    assert not (workdir / "data" / "features").exists()
    assert leftovers(workdir) == []


def test_aux_layers_wrong_count_rejected_before_work(workdir, capsys, tiny_target_dir):
    params = write_params(workdir, {"target": {"path": str(tiny_target_dir), "aux_layers": [1, 2]}})
    rc, err = run_cli("extract", params, capsys)
    assert rc == 2
    assert "target.aux_layers" in err and "three" in err
    assert not (workdir / "data").exists()


# ------------------------------------------------------------------------------------------------------- warm start

def draft(intermediate: int = 64, draft_vocab: int = 16, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=32, intermediate_size=intermediate, num_attention_heads=2, num_key_value_heads=2,
                      vocab_size=302, draft_vocab_size=draft_vocab, target_hidden_size=32, aux_layers=[1, 2, 3])
    return Eagle3Draft(cfg)


def test_warm_start_shape_mismatch_names_keys_and_shapes(tmp_path):
    save_drafter(draft(intermediate=64, draft_vocab=16), tmp_path / "ckpt")
    other = draft(intermediate=96, draft_vocab=24, seed=1)
    before = {name: t.clone() for name, t in other.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_into(other, tmp_path / "ckpt")
    message = str(err.value)
    assert str(tmp_path / "ckpt") in message
    assert "midlayer.mlp.gate_proj.weight: checkpoint (64, 32) vs drafter (96, 32)" in message
    assert "midlayer.mlp.up_proj.weight: checkpoint (64, 32) vs drafter (96, 32)" in message
    assert "midlayer.mlp.down_proj.weight: checkpoint (32, 64) vs drafter (32, 96)" in message
    assert "lm_head.weight: checkpoint (16, 32) vs drafter (24, 32)" in message
    assert "d2t: checkpoint (16,) vs drafter (24,)" in message
    assert "fc.weight" not in message  # same shape: not reported
    # Nothing was loaded into the drafter.
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_warm_start_missing_and_extra_keys(tmp_path):
    save_drafter(draft(), tmp_path / "ckpt")
    weights = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    del weights["norm.weight"]
    weights["midlayer.extra.weight"] = torch.zeros(2)
    save_file(weights, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_into(draft(seed=1), tmp_path / "ckpt")
    assert "norm.weight: missing from the checkpoint" in str(err.value)
    assert "midlayer.extra.weight: not a drafter parameter" in str(err.value)


def test_warm_start_same_shape_loads_weights_and_vocab_map(tmp_path):
    source = draft(seed=0)
    source.d2t.copy_(torch.arange(16) * 3)
    source.t2d[torch.arange(16) * 4] = True
    save_drafter(source, tmp_path / "ckpt")
    target = draft(seed=1)
    embedding = target.embed_tokens.weight.clone()
    load_into(target, tmp_path / "ckpt")
    for name, tensor in source.state_dict().items():
        if name.startswith("embed_tokens."):
            continue
        assert torch.equal(target.state_dict()[name], tensor), name
    assert torch.equal(target.embed_tokens.weight, embedding)  # the embedding is the target's, never loaded


def test_warm_start_directory_without_weights(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_into(draft(), tmp_path / "ckpt")


# ------------------------------------------------------------------------------------------- more bad input

def prepared_workdir(workdir: Path, capsys, tiny_target_dir: Path, extra: dict | None = None) -> Path:
    """A workdir whose prepare stage has run on a few good conversations."""
    write_jsonl(workdir / CONVERSATIONS, [conversation(i) for i in range(12)])
    params = write_params(workdir, {"target": {"path": str(tiny_target_dir)}, "data": {"draft_vocab_size": 32},
                                    "mlflow": {"system_metrics": False, "registered_model": None}, **(extra or {})})
    assert run_cli("prepare", params, capsys)[0] == 0
    return params


def test_repeated_layer_ids(workdir, capsys, tiny_target_dir):
    prepared_workdir(workdir, capsys, tiny_target_dir)
    params = write_params(workdir, {"target": {"path": str(tiny_target_dir), "aux_layers": [1, 2, 2]}})
    rc, err = run_cli("extract", params, capsys)
    assert rc == 1 and "target.aux_layers" in err and "repeats" in err
    assert not (workdir / "data" / "features").exists()


def test_non_utf8_bytes_name_the_line(workdir, capsys, tiny_target_dir):
    path = workdir / CONVERSATIONS
    write_jsonl(path, [conversation(0), conversation(1)])
    with path.open("ab") as handle:
        handle.write(b'{"id": "c2", "messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    params = write_params(workdir, {"target": {"path": str(tiny_target_dir)}})
    rc, err = run_cli("prepare", params, capsys)
    assert rc == 1 and f"{CONVERSATIONS}:3: not UTF-8" in err and "0xe9" in err
    assert not (workdir / "data" / "prepared").exists()


@pytest.mark.heavy
def test_ten_megabyte_line_is_truncated_and_counted(workdir, capsys, tiny_target_dir):
    huge = conversation(0, assistant="word " * 2_000_000)  # a 10 MB line
    write_jsonl(workdir / CONVERSATIONS, [huge, conversation(1), conversation(2)])
    params = write_params(workdir, {"target": {"path": str(tiny_target_dir)}, "data": {"draft_vocab_size": 32},
                                    "mlflow": {"system_metrics": False, "registered_model": None}})
    assert run_cli("prepare", params, capsys)[0] == 0
    metrics = json.loads((workdir / "metrics" / "prepare.json").read_text())
    assert metrics["truncated"] == 1 and metrics["kept"] == 3


def test_tokenizer_that_does_not_belong_to_the_target(workdir, capsys, tiny_target_dir):
    target = workdir / "target"
    shutil.copytree(tiny_target_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["vocab_size"] = 100  # smaller than the tokenizer
    (target / "config.json").write_text(json.dumps(config))
    write_jsonl(workdir / CONVERSATIONS, [conversation(0)])
    params = write_params(workdir, {"target": {"path": str(target)}})
    rc, err = run_cli("prepare", params, capsys)
    assert rc == 1 and "vocab_size is 100" in err and str(target) in err


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3"])
def test_nan_hidden_states_are_skipped_then_fatal(workdir, capsys, tiny_target_dir, dtype):
    """A poisoned embedding row gives NaN states to the samples that use that token, stored in full precision or
    in FP8 (where the NaN shows in the token's scale)."""
    target = workdir / "target"
    shutil.copytree(tiny_target_dir, target)
    weights = load_file(str(target / "model.safetensors"))
    from transformers import AutoTokenizer

    poisoned = AutoTokenizer.from_pretrained(str(target)).convert_tokens_to_ids("<|im_system|>")
    weights["model.embed_tokens.weight"][poisoned] = float("nan")
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    system = {"role": "system", "content": "Be brief."}
    chats = [conversation(i) for i in range(10)]
    chats[3]["messages"].insert(0, system)
    write_jsonl(workdir / CONVERSATIONS, chats)
    base = {"target": {"path": str(target), "aux_layers": [1, 2, 3]}, "data": {"draft_vocab_size": 32, "eval_fraction": 0.0},
            "mlflow": {"system_metrics": False, "registered_model": None}}
    params = write_params(workdir, {**base, "extract": {"max_nonfinite_fraction": 0.2, "dtype": dtype}})
    assert run_cli("prepare", params, capsys)[0] == 0
    rc, err = run_cli("extract", params, capsys)
    assert rc == 0, err
    metrics = json.loads((workdir / "metrics" / "extract.json").read_text())
    assert metrics["skipped_nonfinite"] == 1 and metrics["samples"] == 9

    shutil.rmtree(workdir / "data" / "features")
    params = write_params(workdir, {**base, "extract": {"max_nonfinite_fraction": 0.0, "dtype": dtype}})
    rc, err = run_cli("extract", params, capsys)
    assert rc == 1 and "NaN/inf" in err and "c3" in err and "max_nonfinite_fraction" in err
    assert not (workdir / "data" / "features").exists()


def test_truncated_drafter_weights(tmp_path):
    save_drafter(draft(), tmp_path / "d")
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_into(draft(), tmp_path / "d")


def test_pickle_with_code_is_never_run(tmp_path, capsys):
    """A resume file that would run code when unpickled is ignored, and its code never runs."""
    import os
    import pickle

    from eagle3ops.resume import ResumePoint

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "state.pt"
    path.write_bytes(pickle.dumps(Exploit()))
    assert ResumePoint(path).load() is None
    assert not marker.exists()
    assert "ignoring unreadable resume state" in capsys.readouterr().out


def test_credentials_stay_out_of_mlflow_params():
    from eagle3ops.tracking.store import scrub

    assert scrub("postgresql://eagle:s3cret@db.local:5432/mlflow") == "postgresql://eagle:***@db.local:5432/mlflow"
    assert scrub("sqlite:////srv/mlflow.db") == "sqlite:////srv/mlflow.db"


@pytest.mark.parametrize("value", ["../elsewhere", "/tmp/features", "data/../../x"])
def test_outputs_stay_inside_the_project(workdir, capsys, value):
    params = write_params(workdir, {"extract": {"out_dir": value}})
    rc, err = run_cli("extract", params, capsys)
    assert rc == 2 and "extract.out_dir" in err and "inside the project" in err


def test_vocab_map_of_the_wrong_dtype(tmp_path):
    save_drafter(draft(), tmp_path / "d")
    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    weights["d2t"] = weights["d2t"].float()
    save_file(weights, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t: checkpoint dtype torch.float32 vs torch.int64"):
        load_into(draft(), tmp_path / "d")


def test_hidden_states_that_do_not_fit_are_refused_before_training(tmp_path):
    from eagle3ops.data.shards import ShardWriter
    from eagle3ops.errors import InputError
    from eagle3ops.training.data import load_feature_samples

    writer = ShardWriter(tmp_path / "f", 1, meta={"aux_layers": [1, 2, 3], "hidden_size": 32, "dtype": "float32"})
    writer.add("ok", {"input_ids": torch.zeros(5, dtype=torch.int32), "loss_mask": torch.ones(5, dtype=torch.uint8),
                      "aux_hidden": torch.zeros(5, 96), "final_hidden": torch.zeros(5, 32)})
    writer.add("bad", {"input_ids": torch.zeros(5, dtype=torch.int32), "loss_mask": torch.ones(5, dtype=torch.uint8),
                       "aux_hidden": torch.zeros(5, 64), "final_hidden": torch.zeros(5, 32)})
    writer.close()
    with pytest.raises(InputError, match=r"sample 'bad': aux_hidden is \(5, 64\)"):
        load_feature_samples(tmp_path / "f")
    with pytest.raises(InputError, match="the target's hidden size is 48"):
        load_feature_samples(tmp_path / "f", hidden_size=48)


# ---------------------------------------------------------------------------------------- as a new user tries them

def test_jsonl_with_a_byte_order_mark_and_crlf_is_read(workdir, capsys, tiny_target_dir):
    path = write_jsonl(workdir / CONVERSATIONS, [conversation(i) for i in range(3)])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))
    params = write_params(workdir, {"target": {"path": str(tiny_target_dir)}, "data": {"eval_fraction": 0.0}})
    rc, err = run_cli("prepare", params, capsys)
    assert rc == 0, err
    assert json.loads((workdir / "metrics" / "prepare.json").read_text())["train_samples"] == 3


def eval_workspace(workdir: Path, target_dir: Path, records: list[dict], extra_t2d: bool = False) -> Path:
    """A drafter for the tiny target as `train.warm_start` (what eval@baseline measures) and one prompt set."""
    from transformers import AutoConfig

    from eagle3ops.config import DraftShapeConfig
    from eagle3ops.modeling.target import load_embedding_and_head
    from eagle3ops.training.init import new_drafter

    embedding, _ = load_embedding_and_head(target_dir)
    vocab = embedding.shape[0]
    d2t, t2d = torch.zeros(16, dtype=torch.int64), torch.zeros(vocab, dtype=torch.bool)
    t2d[:16] = True
    drafter = new_drafter(AutoConfig.from_pretrained(target_dir), DraftShapeConfig(), [1, 2, 3], embedding, d2t, t2d, 0)
    if extra_t2d:
        drafter.t2d[100] = True  # t2d marks 17 tokens, the draft vocabulary (d2t, lm_head) has 16
    save_drafter(drafter, workdir / "models" / "drafter")
    write_jsonl(workdir / "bench" / "set.jsonl", records)
    return write_params(workdir, {"target": {"path": str(target_dir), "lineage_dep": str(target_dir)},
                                  "train": {"warm_start": "models/drafter"},
                                  "eval": {"sets_dir": "bench", "sets": [{"name": "set", "path": "bench/set.jsonl"}],
                                           "max_new_tokens": 4},
                                  "mlflow": {"registered_model": None, "system_metrics": False}})


def run_eval(params: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["eval", "--drafter", "baseline", "--params", str(params)])
    return rc, capsys.readouterr().err


def test_eval_refuses_a_drafter_whose_vocabulary_map_disagrees_with_its_head(workdir, capsys, tiny_target_dir):
    params = eval_workspace(workdir, tiny_target_dir, [{"prompt": "Hello world"}], extra_t2d=True)
    rc, err = run_eval(params, capsys)
    weights = Path("models") / "drafter" / "model.safetensors"
    assert rc == 1 and f"{weights}: inconsistent vocabulary map" in err, err
    assert "t2d marks 17 target tokens, the draft vocabulary has 16" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("eagle3ops eval@baseline: error: ")
    assert not (workdir / "metrics").exists()


def test_eval_refuses_a_chat_record_with_an_empty_user_turn(workdir, capsys, tiny_target_dir):
    chats = [{"messages": [{"role": "user", "content": "Hello world"}]},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  "}]}]
    rc, err = run_eval(eval_workspace(workdir, tiny_target_dir, chats), capsys)
    assert rc == 1 and "bench/set.jsonl:2: turn 1 is a user turn with no text" in err, err
    assert not (workdir / "metrics").exists()


def test_export_into_a_read_only_place(workdir, capsys, tiny_target_dir):
    import subprocess

    from transformers import AutoConfig

    from eagle3ops.config import DraftShapeConfig
    from eagle3ops.modeling.target import load_embedding_and_head
    from eagle3ops.training.init import new_drafter

    embedding, _ = load_embedding_and_head(tiny_target_dir)
    t2d = torch.zeros(embedding.shape[0], dtype=torch.bool)
    t2d[:16] = True
    drafter = new_drafter(AutoConfig.from_pretrained(tiny_target_dir), DraftShapeConfig(), [1, 2, 3], embedding,
                          torch.zeros(16, dtype=torch.int64), t2d, 0)
    save_drafter(drafter, workdir / "drafter")
    shelf = workdir / "shelf"
    shelf.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(shelf)], capture_output=True).returncode:
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        capsys.readouterr()
        rc = main(["export", str(workdir / "drafter"), str(shelf / "spec"), "--format", "speculators", "--target",
                   str(tiny_target_dir)])
        err = capsys.readouterr().err
        assert rc == 1 and f"{shelf / 'spec'}: cannot write there (Read-only file system" in err, err
        assert len(err.strip().splitlines()) == 1 and not list(shelf.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(shelf)], capture_output=True)


# ------------------------------------------------------------------------------------------------- a pilot's share

def test_generate_takes_the_first_max_conversations(workdir, capsys, tiny_target_dir):
    write_jsonl(workdir / "data" / "zoo" / "conversations.jsonl", [conversation(i) for i in range(6)])
    base = {"target": {"path": str(tiny_target_dir)}, "data": {"conversations": "data/zoo/conversations.jsonl"}}
    rc, err = run_cli("generate", write_params(workdir, {**base, "generate": {"backend": "none",
                                                                              "max_conversations": 0}}), capsys)
    assert rc == 2 and "generate.max_conversations" in err and "at least 1" in err
    assert not (workdir / CONVERSATIONS).exists()

    rc, err = run_cli("generate", write_params(workdir, {**base, "generate": {"backend": "none",
                                                                              "max_conversations": 4}}), capsys)
    assert rc == 0, err
    kept = [json.loads(line) for line in (workdir / CONVERSATIONS).read_text().splitlines()]
    assert [c["id"] for c in kept] == [json.loads(line)["id"] for line in
                                       (workdir / "data/zoo/conversations.jsonl").read_text().splitlines()[:4]]
    metrics = json.loads((workdir / "metrics" / "generate.json").read_text())
    assert metrics["conversations"] == 4 and metrics["dataset_conversations"] == 6
