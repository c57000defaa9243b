"""`extract.backend: import`: hidden states in speculators' and SpecForge's formats become the very shards our own
extraction writes, and peer output that does not fit is refused naming the file.

The peer files are written here from the tiny target's real hidden states, laid out as each engine stores them:
speculators' last slot is the last layer's output before the final norm, SpecForge's aux layers are concatenated
low to high with a batch dimension, and one SpecForge row is padded the way its batched generator pads.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from eagle3ops.config import ConfigError, TargetConfig, load_config
from eagle3ops.data.prepare import SPLITS, read_tokenized, split, write_tokenized
from eagle3ops.data.shards import iter_samples, read_manifest
from eagle3ops.extraction.hf import NonFiniteError, extract_features
from eagle3ops.extraction.imported import (
    PeerFormatError,
    checkpoint_size,
    import_features,
    open_source,
    plan_import,
)
from eagle3ops.modeling.target import decoder_layers, load_target, model_size, target_layout
from eagle3ops.training.data import load_feature_samples
from helpers import isolate

AUX = [3, 1, 2]  # HF indices, deliberately not low to high: the engines store them low to high
TEXTS = ["The fox jumps over the lazy dog number 3.", "Hello world, how are you today? The answer is 42.",
         "def add(a, b):\n    return a + b\n", "You are a helpful assistant. Answer briefly.",
         "The assistant writes the code number 7. The answer is 49.", "<think>Let me think step by step.</think> 42."]


class Custom:
    """A class only unpickling code can rebuild."""


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    return load_target(TargetConfig(path=str(tiny_target_dir), aux_layers=AUX, device="cpu"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_tokenizer) -> Path:
    samples = []
    for i, text in enumerate(TEXTS):
        ids = tiny_tokenizer.encode(text)
        samples.append({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 3 + [1] * (len(ids) - 3)})
    root = tmp_path_factory.mktemp("prepared")
    train, held_out = split(samples, 0.2)
    assert train and held_out
    write_tokenized(train, root / "train", {"split": "train"})
    write_tokenized(held_out, root / "eval", {"split": "eval"})
    return root


def all_prepared(prepared: Path) -> list[dict]:
    return [s for split_name in SPLITS for s in read_tokenized(prepared / split_name)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model, prepared) -> Path:
    """Our own hf extraction of the prepared samples."""
    root = tmp_path_factory.mktemp("hf")
    for split_name in SPLITS:
        extract_features(model, read_tokenized(prepared / split_name), AUX, root / split_name, batch_size=2,
                         samples_per_shard=2, meta={"split": split_name})
    return root


@torch.no_grad()
def engine_states(model, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """What an engine computes for one sample: the aux layers low to high [T, H] each, the last layer's output
    before the final norm [T, H] (vLLM's layer id N), and the final normed state [T, H]."""
    captured = {}
    hook = decoder_layers(model)[-1].register_forward_hook(
        lambda _module, _inputs, output: captured.update(last=output[0] if isinstance(output, tuple) else output))
    try:
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return [hidden[i][0] for i in sorted(AUX)], captured["last"][0], hidden[-1][0]


def write_speculators(directory: Path, model, samples: list[dict]) -> Path:
    """speculators' layout: <dir>/hidden_states/hs_<i>.safetensors with token_ids [T], hidden_states [T, 4, H]."""
    (directory / "hidden_states").mkdir(parents=True)
    for index, sample in enumerate(samples):
        aux, last, _ = engine_states(model, sample["input_ids"])
        save_file({"token_ids": torch.tensor(sample["input_ids"]), "hidden_states": torch.stack([*aux, last], dim=1)},
                  str(directory / "hidden_states" / f"hs_{index}.safetensors"))
    return directory


def specforge_record(model, ids: list[int], loss_mask: list[int]) -> dict:
    aux, _, final = engine_states(model, ids)
    return {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(loss_mask),
            "hidden_state": final.unsqueeze(0), "aux_hidden_state": torch.cat(aux, dim=-1).unsqueeze(0)}


def write_specforge(directory: Path, model, samples: list[dict], padded: int | None = None) -> Path:
    """SpecForge's layout: <dir>/rows_0-2000/data_<i>.ckpt dicts; sample `padded` right-padded with 6 pad tokens
    (loss mask 0), as SpecForge's batched generator saves the shorter rows of a batch."""
    (directory / "rows_0-2000").mkdir(parents=True)
    for index, sample in enumerate(samples):
        pad = 6 if index == padded else 0
        record = specforge_record(model, sample["input_ids"] + [0] * pad, sample["loss_mask"] + [0] * pad)
        torch.save(record, directory / "rows_0-2000" / f"data_{index}.ckpt")
    return directory


def import_all(source_dir: Path, prepared: Path, out: Path, target_dir: Path, fmt: str | None = None,
               fraction: float = 0.01) -> dict:
    source = open_source(source_dir, fmt, target_layout(TargetConfig(path=str(target_dir), aux_layers=AUX)))
    plan = plan_import(source, prepared, fraction)
    return {split_name: import_features(source, plan.splits[split_name], out / split_name, samples_per_shard=2,
                                        meta={"split": split_name}, max_nonfinite_fraction=fraction)
            for split_name in SPLITS}


def by_id(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    return dict(iter_samples(directory))


def assert_same_features(got: Path, expected: Path) -> None:
    for split_name in SPLITS:
        mine, ours = by_id(got / split_name), by_id(expected / split_name)
        assert sorted(mine) == sorted(ours)
        for sample_id, tensors in ours.items():
            assert mine[sample_id].keys() == tensors.keys()
            for name in ("input_ids", "loss_mask"):
                assert torch.equal(mine[sample_id][name], tensors[name]), (sample_id, name)
            for name in ("aux_hidden", "final_hidden"):
                assert mine[sample_id][name].dtype == tensors[name].dtype
                torch.testing.assert_close(mine[sample_id][name], tensors[name], rtol=1e-5, atol=1e-5)
        manifest, reference = read_manifest(got / split_name), read_manifest(expected / split_name)
        for key in ("aux_layers", "hidden_size", "dtype", "samples", "tokens"):
            assert manifest[key] == reference[key], key


# ------------------------------------------------------------------------------------------------- same as extract

def test_speculators_import_equals_our_extraction(tmp_path, model, prepared, reference, tiny_target_dir):
    samples = all_prepared(prepared)[::-1]  # any file order: the tokens say which sample a file holds
    source = write_speculators(tmp_path / "spec", model, samples)
    results = import_all(source, prepared, tmp_path / "out", tiny_target_dir)  # format detected from the names
    assert_same_features(tmp_path / "out", reference)
    assert sum(r.samples for r in results.values()) == len(samples)
    for split_name in SPLITS:
        loaded = load_feature_samples(tmp_path / "out" / split_name, hidden_size=32)
        assert len(loaded) == read_manifest(reference / split_name)["samples"]


def test_specforge_import_equals_our_extraction_and_trims_batch_padding(tmp_path, model, prepared, reference,
                                                                        tiny_target_dir):
    source = write_specforge(tmp_path / "sf", model, all_prepared(prepared), padded=1)
    import_all(source, prepared, tmp_path / "out", tiny_target_dir, fmt="specforge")
    assert_same_features(tmp_path / "out", reference)
    for split_name in SPLITS:
        assert load_feature_samples(tmp_path / "out" / split_name, hidden_size=32)


def test_stage_imports_into_the_lineage(tmp_path, monkeypatch, model, prepared, tiny_target_dir):
    """`eagle3ops extract` with backend import writes what the same stage writes with backend hf."""
    from eagle3ops.stages import extract

    isolate(monkeypatch, tmp_path)
    shutil.copytree(prepared, tmp_path / "data" / "prepared")
    write_specforge(tmp_path / "peer", model, all_prepared(prepared))

    def run_stage(**settings) -> None:
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({
            "target": {"path": str(tiny_target_dir), "lineage_dep": str(tiny_target_dir), "aux_layers": AUX,
                       "device": "cpu"},
            "extract": {"samples_per_shard": 2, **settings},
            "pipeline": {"hidden_states_dep": settings.get("out_dir", "data/features")},  # config.py holds them equal
            "mlflow": {"system_metrics": False, "registered_model": None}}))
        extract.run(load_config(tmp_path / "params.yaml"))

    run_stage(backend="hf", out_dir="data/features-hf")
    run_stage(backend="import", import_dir="peer")

    assert_same_features(tmp_path / "data" / "features", tmp_path / "data" / "features-hf")
    manifest = read_manifest(tmp_path / "data" / "features" / "train")
    assert manifest["source"] == {"format": "specforge", "dir": "peer", "layer_ids": [0, 1, 2],  # SGLang ids
                                  "layer_id_convention": "sglang"}
    metrics = json.loads((tmp_path / "metrics" / "extract.json").read_text())
    assert metrics["missing"] == 0
    assert metrics["target_params"] == model_size(model)["target_params"]  # from the headers, never loaded
    assert metrics["samples"] == len(all_prepared(prepared)) and "import_s" in metrics["time"]
    assert "load_s" not in metrics["time"]
    assert not list(tmp_path.glob(".eagle3ops/resume/extract-*"))


def test_checkpoint_size_reads_the_headers(model, tiny_target_dir):
    assert checkpoint_size(tiny_target_dir) == model_size(model)


# ---------------------------------------------------------------------------------------- non-finite and resuming

def test_nonfinite_samples_are_skipped_counted_and_bounded(tmp_path, model, prepared, tiny_target_dir):
    samples = all_prepared(prepared)
    source = write_specforge(tmp_path / "sf", model, samples)
    train_ids = {sample["id"] for sample in read_tokenized(prepared / "train")}
    poisoned = next(i for i, sample in enumerate(samples) if sample["id"] in train_ids)
    record = torch.load(source / "rows_0-2000" / f"data_{poisoned}.ckpt", weights_only=True)
    record["aux_hidden_state"][0, 1, 5] = float("nan")
    torch.save(record, source / "rows_0-2000" / f"data_{poisoned}.ckpt")

    results = import_all(source, prepared, tmp_path / "out", tiny_target_dir, fraction=0.5)
    assert results["train"].nonfinite == [samples[poisoned]["id"]]
    assert samples[poisoned]["id"] not in by_id(tmp_path / "out" / "train")
    with pytest.raises(NonFiniteError, match="max_nonfinite_fraction=0.01"):
        import_all(source, prepared, tmp_path / "strict", tiny_target_dir)
    assert not (tmp_path / "strict" / "train").exists()


def test_interrupted_import_resumes_to_identical_shards(tmp_path, model, prepared, tiny_target_dir):
    train = read_tokenized(prepared / "train")
    source_dir = write_specforge(tmp_path / "sf", model, train)
    record = torch.load(source_dir / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    record["hidden_state"][0, 0, 0] = float("inf")  # skipped before the interruption: must stay skipped after it
    torch.save(record, source_dir / "rows_0-2000" / "data_0.ckpt")
    layout = target_layout(TargetConfig(path=str(tiny_target_dir), aux_layers=AUX))

    def run(out: Path, crash_after: int | None = None):
        source = open_source(source_dir, None, layout)
        plan = plan_import(source, prepared, 1.0).splits["train"]
        if crash_after is not None:
            read, calls = source.states, []

            def crashing(path):
                calls.append(path)
                if len(calls) > crash_after:
                    raise KeyboardInterrupt  # the process dies mid-split
                return read(path)
            source.states = crashing
        return import_features(source, plan, out, samples_per_shard=1, resumable=True, max_nonfinite_fraction=1.0)

    uninterrupted = run(tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", crash_after=3)
    assert not (tmp_path / "b").exists() and (tmp_path / ".b.partial").is_dir()
    resumed = run(tmp_path / "b")
    assert read_manifest(tmp_path / "b") == read_manifest(tmp_path / "a")
    assert resumed.nonfinite == uninterrupted.nonfinite == [train[0]["id"]]
    assert not (tmp_path / ".b.nonfinite.json").exists()


# ------------------------------------------------------------------------------------------------------- refusals

def test_wrong_hidden_size_is_refused_naming_the_file(tmp_path, prepared, tiny_target_dir):
    ids = all_prepared(prepared)[0]["input_ids"]
    (tmp_path / "spec" / "hidden_states").mkdir(parents=True)
    bad = tmp_path / "spec" / "hidden_states" / "hs_0.safetensors"
    save_file({"token_ids": torch.tensor(ids), "hidden_states": torch.zeros(len(ids), 4, 16)}, str(bad))
    with pytest.raises(PeerFormatError, match=r"hs_0\.safetensors: hidden states of size 16, the target's hidden "
                                              r"size is 32"):
        import_all(tmp_path / "spec", prepared, tmp_path / "out", tiny_target_dir)

    sample = all_prepared(prepared)[0]
    (tmp_path / "sf").mkdir()
    torch.save({"input_ids": torch.tensor(sample["input_ids"]), "loss_mask": torch.tensor(sample["loss_mask"]),
                "hidden_state": torch.zeros(1, len(ids), 48), "aux_hidden_state": torch.zeros(1, len(ids), 96)},
               tmp_path / "sf" / "data_0.ckpt")
    with pytest.raises(PeerFormatError, match=r"data_0\.ckpt: hidden_state of size 48, the target's hidden size is 32"):
        import_all(tmp_path / "sf", prepared, tmp_path / "out", tiny_target_dir)
    assert not (tmp_path / "out").exists()


def test_wrong_slot_count_is_refused_naming_the_file(tmp_path, prepared, tiny_target_dir):
    sample = all_prepared(prepared)[0]
    n = len(sample["input_ids"])
    (tmp_path / "spec").mkdir()
    save_file({"token_ids": torch.tensor(sample["input_ids"]), "hidden_states": torch.zeros(n, 3, 32)},
              str(tmp_path / "spec" / "hs_7.safetensors"))  # captured without the last layer
    with pytest.raises(PeerFormatError, match=r"hs_7\.safetensors: 3 hidden-state slots per token, expected 4.*"
                                              r"vLLM layer ids \[1, 2, 3, 4\]"):
        import_all(tmp_path / "spec", prepared, tmp_path / "out", tiny_target_dir)

    (tmp_path / "sf").mkdir()
    torch.save({"input_ids": torch.tensor(sample["input_ids"]), "loss_mask": torch.tensor(sample["loss_mask"]),
                "hidden_state": torch.zeros(1, n, 32), "aux_hidden_state": torch.zeros(1, n, 64)},
               tmp_path / "sf" / "data_3.ckpt")
    with pytest.raises(PeerFormatError, match=r"data_3\.ckpt: aux_hidden_state is 64 wide = 2 layers.*needs 3 "
                                              r"\(SGLang layer ids \[0, 1, 2\]\)"):
        import_all(tmp_path / "sf", prepared, tmp_path / "out", tiny_target_dir)


def test_pickled_custom_class_in_a_ckpt_is_refused_unexecuted(tmp_path, model, prepared, tiny_target_dir):
    sample = all_prepared(prepared)[0]
    (tmp_path / "sf").mkdir()
    torch.save({**specforge_record(model, sample["input_ids"], sample["loss_mask"]), "extra": Custom()},
               tmp_path / "sf" / "data_0.ckpt")
    with pytest.raises(PeerFormatError, match=r"data_0\.ckpt: refused: loading it would run unpickling code "
                                              r"\(test_extract_import\.Custom\)"):
        import_all(tmp_path / "sf", prepared, tmp_path / "out", tiny_target_dir)


def test_tokens_not_in_the_prepared_data_are_refused(tmp_path, model, prepared, tiny_target_dir):
    samples = all_prepared(prepared)
    stranger = {"input_ids": samples[0]["input_ids"][:-1] + [7], "loss_mask": samples[0]["loss_mask"]}
    source = write_speculators(tmp_path / "spec", model, [*samples[1:], stranger])
    with pytest.raises(PeerFormatError, match=rf"hs_{len(samples) - 1}\.safetensors: its {len(stranger['input_ids'])} "
                                              rf"token ids match no prepared sample"):
        import_all(source, prepared, tmp_path / "out", tiny_target_dir)


def test_duplicates_and_missing_samples_are_refused(tmp_path, model, prepared, tiny_target_dir):
    samples = all_prepared(prepared)
    twice = write_speculators(tmp_path / "twice", model, [*samples, samples[2]])
    with pytest.raises(PeerFormatError, match=rf"hs_{len(samples)}\.safetensors: holds the same tokens as .*hs_2"):
        import_all(twice, prepared, tmp_path / "out", tiny_target_dir)
    partial = write_speculators(tmp_path / "partial", model, samples[1:])
    with pytest.raises(PeerFormatError, match=rf"1 of \d+ prepared \w+ samples have no hidden states.*"
                                              rf"'{samples[0]['id']}'"):
        import_all(partial, prepared, tmp_path / "out", tiny_target_dir)
    with pytest.raises(PeerFormatError, match="no hs_<i>.safetensors .* nor data_<i>.ckpt"):
        import_all(prepared, prepared, tmp_path / "out", tiny_target_dir)


@pytest.mark.parametrize(("extract", "key", "message"), [
    ({"backend": "engine"}, "extract.backend", r"Invalid value 'engine', expected one of \[hf, vllm, import\]"),
    ({"backend": "import", "import_dir": None}, "extract.import_dir", "Incompatible value 'None' for field of type 'str'"),
    ({"backend": "import", "import_dir": "data/prepared"}, "extract.import_dir", "still names the prepared data"),
    ({"import_format": "eagle"}, "extract.import_format", r"Invalid value 'eagle', expected one of \[speculators"),
])
def test_import_settings_are_validated(tmp_path, extract, key, message):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"extract": extract}))
    with pytest.raises(ConfigError, match=rf"key '{key}': {message}"):
        load_config(path)
