"""FP8 feature shards (extract.dtype float8_e4m3): a scale per token and layer, written by extraction and import,
read back and dequantised for training; NaN/inf samples still skipped."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3ops.config import DrafterTrainConfig, TargetConfig
from eagle3ops.data.hidden_states import FP8, bytes_per_token, decode, encode, finite_positions
from eagle3ops.data.prepare import read_tokenized
from eagle3ops.data.shards import read_manifest
from eagle3ops.errors import InputError
from eagle3ops.extraction.hf import extract_features
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.modeling.target import load_target
from eagle3ops.training.data import load_feature_samples
from eagle3ops.training.loop import Recipe, train_drafter
from test_extract_import import prepared  # noqa: F401  (the fixture: a few prepared samples of the tiny target)

AUX = [1, 2, 3]
STEP = 2.0 ** -4  # e4m3 keeps 3 bits of mantissa: a value is off by at most 1/16 of itself, so of its slice's amax


def test_fp8_keeps_every_token_and_layer_to_its_own_scale():
    """A layer of huge values next to one of tiny values, and a token of each: each slice decodes to within 1/16 of
    its own largest magnitude, the tiny ones too, which one scale per tensor or per token would flush to zero."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(5, 3, 64, generator=generator)
    states[:, 0] *= 1e4
    states[:, 2] *= 1e-3
    states[3] *= 1e-5
    states[4, 1] = 0.0  # an all-zero slice
    encoded = encode("aux_hidden", states.flatten(1), 3, FP8)
    assert encoded["aux_hidden"].dtype == torch.float8_e4m3fn and encoded["aux_hidden"].shape == (5, 192)
    assert encoded["aux_hidden_scale"].shape == (5, 3) and encoded["aux_hidden_scale"].dtype == torch.float32
    decoded = decode(encoded, "aux_hidden", torch.float32).unflatten(-1, (3, 64))
    amax = states.abs().amax(-1, keepdim=True)
    assert ((decoded - states).abs() <= STEP * amax).all()
    assert torch.equal(decoded[4, 1], torch.zeros(64))
    assert (decoded[3, 2] != 0).any()  # 1e-8 of the first token's top layer, still there
    # full precision stays as it was, without scales
    assert encode("final_hidden", states[:, 0], 1, "bfloat16").keys() == {"final_hidden"}


def test_nonfinite_states_show_in_their_scales_and_nothing_overflows():
    states = torch.full((4, 2, 8), 300.0)
    states[1, 0, 3] = float("nan")
    states[2, 1, 0] = float("inf")
    states[3] = 6e4  # far past e4m3's 448: scaled, not saturated or NaN
    encoded = encode("aux_hidden", states.flatten(1), 2, FP8)
    assert finite_positions(encoded).tolist() == [True, False, False, True]
    assert torch.equal(decode(encoded, "aux_hidden", torch.float32)[3], torch.full((16,), 6e4))
    assert finite_positions(encode("x", torch.tensor([[7e4]]), 1, "float16")).tolist() == [False]  # overflow


def test_bytes_per_token():
    assert bytes_per_token("bfloat16", 7168) == 4 * 7168 * 2  # Kimi-K2.5: 56 KiB
    assert bytes_per_token(FP8, 7168) == 4 * 7168 + 4 * 4


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_target_dir, prepared) -> dict[str, Path]:  # noqa: F811 (the fixture)
    model = load_target(TargetConfig(path=str(tiny_target_dir), aux_layers=AUX, device="cpu"))
    root = tmp_path_factory.mktemp("features")
    for dtype in ("float32", FP8):
        extract_features(model, read_tokenized(prepared / "train"), AUX, root / dtype, batch_size=2,
                         samples_per_shard=2, dtype=dtype)
    return {dtype: root / dtype for dtype in ("float32", FP8)}


def test_fp8_shards_hold_e4m3_states_and_scales_and_decode_close_to_full_precision(extracted):
    manifest = read_manifest(extracted[FP8])
    assert manifest["dtype"] == FP8
    with safe_open(str(extracted[FP8] / manifest["shards"][0]["file"]), "pt") as shard:
        assert shard.get_slice("aux_hidden").get_dtype() == "F8_E4M3"
        assert shard.get_slice("aux_hidden_scale").get_shape()[1] == 3
    full = load_feature_samples(extracted["float32"], hidden_size=32)
    quantised = load_feature_samples(extracted[FP8], hidden_size=32)
    assert len(full) == len(quantised)
    for exact, stored in zip(full, quantised):
        assert torch.equal(exact["input_ids"], stored["input_ids"])
        for name, layers in (("aux_hidden", 3), ("final_hidden", 1)):
            decoded = decode(stored, name, torch.float32).unflatten(-1, (layers, -1))
            reference = exact[name].unflatten(-1, (layers, -1))
            assert ((decoded - reference).abs() <= STEP * reference.abs().amax(-1, keepdim=True)).all()
    tokens = manifest["tokens"]
    stored = sum(t.nbytes for s in quantised for name, t in s.items() if "hidden" in name)
    assert stored == tokens * bytes_per_token(FP8, 32) == tokens * (128 + 16)  # float32: 512


def test_a_manifest_misstating_the_dtype_is_refused_naming_the_sample(extracted, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in extracted[FP8].iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    manifest = (broken / "manifest.json").read_text()
    (broken / "manifest.json").write_text(manifest.replace('"float8_e4m3"', '"bfloat16"'))
    with pytest.raises(InputError, match=r"broken: sample 's\d': aux_hidden is .+float8_e4m3fn, "
                                         r"the manifest says .+bfloat16"):
        load_feature_samples(broken)
    unscaled = tmp_path / "unscaled"  # float32 states under a manifest that says FP8: no scales
    shutil.copytree(extracted["float32"], unscaled)
    manifest = json.loads((unscaled / "manifest.json").read_text())
    (unscaled / "manifest.json").write_text(json.dumps({**manifest, "dtype": FP8}))
    with pytest.raises(InputError, match=r"unscaled: sample 's\d' has no aux_hidden_scale, final_hidden_scale, "
                                         r"which a shard of float8_e4m3 hidden states holds"):
        load_feature_samples(unscaled)


def test_training_on_fp8_shards_is_training_on_their_dequantised_states(extracted):
    """The loop dequantises on the training device: its losses are those of the decoded float32 states."""
    quantised = load_feature_samples(extracted[FP8], hidden_size=32)
    decoded = [{"input_ids": s["input_ids"], "loss_mask": s["loss_mask"],
                "aux_hidden": decode(s, "aux_hidden", torch.float32),
                "final_hidden": decode(s, "final_hidden", torch.float32)} for s in quantised]
    head = torch.randn(300, 32, generator=torch.Generator().manual_seed(1))
    optim = DrafterTrainConfig(epochs=2, batch_size=1, packed_length=64, lr=1e-4, optimizer="adamw", ttt_steps=3,
                               log_every=1, checkpoint_every=0)

    def losses(samples):
        torch.manual_seed(0)
        draft = Eagle3Draft(DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=2, vocab_size=300, draft_vocab_size=300,
                                        target_hidden_size=32, aux_layers=AUX))
        draft.embed_tokens.weight.data.normal_()
        draft.t2d.fill_(True)
        result, _ = train_drafter(Recipe(draft, samples, [], head, optim, 0, torch.device("cpu")))
        return [row["train/loss"] for row in result.history]

    assert losses(quantised) == pytest.approx(losses(decoded), rel=1e-6)
