"""check-compat verdicts, and the warm start built on them: refusal, re-heading, optimizer moments, digest."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle3ops.cli import main
from eagle3ops.config import DrafterTrainConfig
from eagle3ops.data.vocab import build_vocab_map, coverage, draft_to_target_ids
from eagle3ops.formats.checkpoint import import_drafter, read_drafter
from eagle3ops.formats.export import export_drafter
from eagle3ops.formats.specforge import CheckpointError, load_drafter, read_weights, save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.modeling.target import load_embedding_and_head
from eagle3ops.training.compat import IncompatibleDrafter, check_compat
from eagle3ops.training.init import drafter_sha256, load_warm_start, rehead
from eagle3ops.training.optimizers import Optimizers

VOCAB, HIDDEN, LAYERS = 302, 32, [1, 2, 3]  # the tiny target of conftest.py: 4 layers, hidden 32
DATA = Counter({token: 100 - token % 50 for token in range(40, 140)})  # loss-masked token counts of "new data"


def make_drafter(path: Path, vocab: int = VOCAB, hidden: int = HIDDEN, layers: list[int] = LAYERS,
                 tokens: range = range(40, 140), draft_vocab: int = 100, max_positions: int = 512,
                 heads: int = 1, fc_norm: bool = False, norm_output: bool = False) -> Path:
    """A drafter whose draft vocabulary is `tokens` (padded with the lowest other ids), saved at `path` (as
    eagle3ops saves what it trained: with its record)."""
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=64, num_attention_heads=heads, num_key_value_heads=heads,
                      vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=hidden, aux_layers=layers,
                      max_position_embeddings=max_positions, fc_norm=fc_norm, norm_output=norm_output)
    draft = Eagle3Draft(cfg)
    d2t, t2d = build_vocab_map(Counter({t: 1 for t in tokens}), vocab, draft_vocab)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    save_drafter(draft, path)
    return path


def as_specforge_wrote_it(path: Path) -> Path:
    """The drafter at `path` as SpecForge's save_pretrained writes one: the same layout and fields, its
    transformers_version, and no eagle3ops record (SpecForge records no version or trainer of its own)."""
    config = json.loads((path / "config.json").read_text())
    config.pop("eagle3ops")
    (path / "config.json").write_text(json.dumps({**config, "transformers_version": "4.57.1"}, indent=2))
    return path


def levels(report) -> dict[str, str]:
    return {f.check: f.level for f in report.findings}


def message(report, check: str) -> str:
    return next(f.message for f in report.findings if f.check == check)


def test_same_family_drafter_is_compatible(tmp_path, tiny_target_dir):
    report = check_compat(tiny_target_dir, make_drafter(tmp_path / "d"), LAYERS, DATA)
    assert report.verdict == "compatible"
    assert report.draft_vocab_coverage == 1.0 and report.best_coverage == 1.0
    assert set(levels(report).values()) == {"ok"}


def test_other_vocabulary_size_is_incompatible(tmp_path, tiny_target_dir):
    report = check_compat(tiny_target_dir, make_drafter(tmp_path / "d", vocab=400), LAYERS)
    assert report.verdict == "incompatible"
    message = next(f.message for f in report.findings if f.check == "vocabulary")
    assert "400" in message and "302" in message


def test_other_hidden_size_is_incompatible(tmp_path, tiny_target_dir):
    report = check_compat(tiny_target_dir, make_drafter(tmp_path / "d", hidden=64), LAYERS)
    assert levels(report)["hidden_size"] == "incompatible" and report.verdict == "incompatible"


def test_other_layer_ids_warn_and_say_what_they_mean(tmp_path, tiny_target_dir):
    report = check_compat(tiny_target_dir, make_drafter(tmp_path / "d", layers=[1, 2, 3]), [0, 2, 3], DATA)
    assert report.verdict == "compatible" and levels(report)["layers"] == "warning"
    message = next(f.message for f in report.findings if f.check == "layers")
    # the ids as trained (HF indices), as written in the config (SGLang ids), what vLLM would feed, the fix
    assert "[1, 2, 3]" in message and "SGLang ids [0, 1, 2]" in message and "[0, 2, 3]" in message
    assert "set target.aux_layers to [1, 2, 3]" in message and "vLLM" in message


def test_layer_ids_beyond_the_target_are_incompatible(tmp_path, tiny_target_dir):
    report = check_compat(tiny_target_dir, make_drafter(tmp_path / "d", layers=[1, 2, 9]), LAYERS)
    assert levels(report)["layers"] == "incompatible"


def test_low_draft_vocab_coverage_needs_a_new_head(tmp_path, tiny_target_dir):
    drafter = make_drafter(tmp_path / "d", tokens=range(150, 250))  # knows none of the data's tokens 40..139
    report = check_compat(tiny_target_dir, drafter, LAYERS, DATA)
    assert report.verdict == "needs_new_head"
    assert report.draft_vocab_coverage < 0.1 and report.best_coverage == 1.0
    assert "remap" in next(f.message for f in report.findings if f.check == "draft_vocab")


def test_short_max_positions_warns(tmp_path, tiny_target_dir):
    report = check_compat(tiny_target_dir, make_drafter(tmp_path / "d", max_positions=128), LAYERS)
    assert levels(report)["positions"] == "warning" and report.verdict == "compatible"


def test_cli_says_when_vllm_cannot_serve_a_head_size_on_this_cpu(tmp_path, tiny_target_dir, capsys):
    assert main(["check-compat", str(tiny_target_dir), str(make_drafter(tmp_path / "d"))]) == 0
    assert ("[  ok] serving: vLLM serves its head size (32), the target's and its length on this machine"
            in capsys.readouterr().out)
    assert main(["check-compat", str(tiny_target_dir), str(make_drafter(tmp_path / "d2", heads=2))]) == 0  # a GPU does
    assert (f"[WARN] serving: {tmp_path / 'd2'}: the drafter's head size is 16: vLLM cannot serve it on this machine "
            f"(no GPU" in capsys.readouterr().out)


def test_cli_fails_a_drafter_too_short_to_serve_as_validate_export_does(tmp_path, tiny_target_dir, capsys):
    """check-compat said "compatible" (exit 0) for a drafter whose max_position_embeddings is below the serving
    length, which validate-export fails: vLLM stops drafting past it. The same rule, the same finding."""
    assert main(["check-compat", str(tiny_target_dir), str(make_drafter(tmp_path / "d", max_positions=128))]) == 5
    out = capsys.readouterr().out
    assert "[FAIL] serving:" in out and "max_position_embeddings 128 is below the serving length" in out, out
    assert "verdict: incompatible" in out


def test_cli_exit_codes_and_json(tmp_path, tiny_target_dir, capsys):
    good, bad = make_drafter(tmp_path / "good"), make_drafter(tmp_path / "bad", vocab=400)
    out = tmp_path / "report.json"
    assert main(["check-compat", str(tiny_target_dir), str(good), "--aux-layers", "1", "2", "3",
                 "--json", str(out)]) == 0
    assert "verdict: compatible" in capsys.readouterr().out
    assert json.loads(out.read_text())["verdict"] == "compatible"
    assert main(["check-compat", str(tiny_target_dir), str(bad), "--aux-layers", "1", "2", "3"]) == 5
    assert "[FAIL] vocabulary" in capsys.readouterr().out
    assert main(["check-compat", str(tiny_target_dir), str(tmp_path / "missing")]) == 1
    assert "no config.json" in capsys.readouterr().err


def test_cli_measures_coverage_on_a_conversations_file(tmp_path, tiny_target_dir, tiny_tokenizer, capsys):
    conversations = tmp_path / "chats.jsonl"
    conversations.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "Hello world"},
                                                                 {"role": "assistant", "content": f"The answer is {i}."}]})
                                       for i in range(5)) + "\n")
    drafter = make_drafter(tmp_path / "d", tokens=range(250, 300))
    code = main(["check-compat", str(tiny_target_dir), str(drafter), "--aux-layers", "1", "2", "3",
                 "--data", str(conversations)])
    assert code == 4 and "[HEAD] draft_vocab" in capsys.readouterr().out


# --- EAGLE-3.1's norm_output: the recurrence the drafter learned against the one the engines run ----------------

def test_an_eagle3_drafter_is_not_flagged_whoever_wrote_it(tmp_path, tiny_target_dir):
    for name, fc_norm in (("eagle3", False), ("fc_norm_only", True)):  # norm_output false: pre-norm state everywhere
        drafter = as_specforge_wrote_it(make_drafter(tmp_path / name, fc_norm=fc_norm))
        report = check_compat(tiny_target_dir, drafter, LAYERS, DATA)
        assert levels(report)["variant"] == "ok" and report.verdict == "compatible", name
        assert "norm_output" not in message(report, "variant") and "#879" not in message(report, "variant")


def test_an_eagle31_drafter_from_specforge_without_a_record_is_flagged_with_what_to_do(tmp_path, tiny_target_dir):
    drafter = as_specforge_wrote_it(make_drafter(tmp_path / "sf", fc_norm=True, norm_output=True))
    report = check_compat(tiny_target_dir, drafter, LAYERS, DATA)
    assert levels(report)["variant"] == "warning" and report.verdict == "compatible"  # a warning, not a refusal
    text = message(report, "variant")
    # the trap: what the engines run, what SpecForge before the fix trained, and that nothing on disk tells them apart
    assert "EAGLE-3.1" in text and "SpecForge / SGLang" in text and "sgl-project/SpecForge#879" in text
    assert "post-norm state feeds the next draft step" in text and "PRE-norm state to the next step" in text
    assert "writes no version" in text and "acceptance from the second draft on drops, silently" in text
    # what to do: which setting is right for which trainer, and how to measure it
    assert "before #879: set norm_output false and keep fc_norm" in text
    assert "after #879, TorchSpec or speculators: norm_output true is right" in text
    assert f"dvc exp run eval@baseline -S train.warm_start={drafter}" in text
    assert f"dvc exp run eval@baseline -S train.warm_start={drafter}-norm-output-false" in text
    assert '"eagle3ops": {"carried_state": "post_norm"}' in text


def test_the_advised_copy_with_norm_output_false_is_what_it_says(tmp_path, tiny_target_dir):
    drafter = as_specforge_wrote_it(make_drafter(tmp_path / "sf", fc_norm=True, norm_output=True))
    text = message(check_compat(tiny_target_dir, drafter, LAYERS), "variant")
    command = shlex.split(re.search(r"\(python -c (.+?)\), then", text).group(1))
    subprocess.run([sys.executable, "-c", *command], check=True)
    copy = tmp_path / "sf-norm-output-false"
    assert read_drafter(copy).cfg.fc_norm and not read_drafter(copy).cfg.norm_output
    assert torch.equal(read_weights(copy)["fc_norm.0.weight"], read_weights(drafter)["fc_norm.0.weight"])
    assert levels(check_compat(tiny_target_dir, copy, LAYERS))["variant"] == "ok"


def test_an_eagle31_drafter_eagle3ops_trained_or_recorded_by_hand_is_not_flagged(tmp_path, tiny_target_dir):
    ours = make_drafter(tmp_path / "ours", fc_norm=True, norm_output=True)
    assert json.loads((ours / "config.json").read_text())["eagle3ops"] == {"carried_state": "post_norm"}
    report = check_compat(tiny_target_dir, ours, LAYERS, DATA)
    assert levels(report)["variant"] == "ok" and "eagle3ops record" in message(report, "variant")
    measured = as_specforge_wrote_it(make_drafter(tmp_path / "sf", fc_norm=True, norm_output=True))
    config = json.loads((measured / "config.json").read_text())
    (measured / "config.json").write_text(json.dumps({**config, "eagle3ops": {"carried_state": "post_norm"}}))
    assert levels(check_compat(tiny_target_dir, measured, LAYERS))["variant"] == "ok"  # as the message says


def test_a_record_of_the_pre_norm_recurrence_under_norm_output_true_is_flagged(tmp_path, tiny_target_dir):
    drafter = make_drafter(tmp_path / "d", fc_norm=True, norm_output=True)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "eagle3ops": {"carried_state": "pre_norm"}}))
    report = check_compat(tiny_target_dir, drafter, LAYERS)
    assert levels(report)["variant"] == "warning" and "Set norm_output false" in message(report, "variant")


def test_a_copy_eagle3ops_makes_of_a_specforge_drafter_stays_flagged(tmp_path, tiny_target_dir):
    """import-drafter and the export keep the source's provenance: converting it is no evidence of the fix."""
    source = as_specforge_wrote_it(make_drafter(tmp_path / "sf", fc_norm=True, norm_output=True))
    import_drafter(source, tmp_path / "imported")
    assert read_drafter(tmp_path / "imported").provenance == {"source_layout": "sglang"}
    assert export_drafter(source, tmp_path / "spec", "speculators", tiny_target_dir).ok
    for copy in (tmp_path / "imported", tmp_path / "spec"):
        report = check_compat(tiny_target_dir, copy, LAYERS)
        assert levels(report)["variant"] == "warning" and "SpecForge / SGLang" in message(report, "variant"), copy


def test_cli_prints_the_norm_output_warning_and_keeps_the_verdict(tmp_path, tiny_target_dir, capsys):
    drafter = as_specforge_wrote_it(make_drafter(tmp_path / "sf", fc_norm=True, norm_output=True))
    out = tmp_path / "report.json"
    assert main(["check-compat", str(tiny_target_dir), str(drafter), "--aux-layers", "1", "2", "3",
                 "--json", str(out)]) == 0  # warnings leave the verdict compatible (exit 0)
    printed = capsys.readouterr().out
    assert "[WARN] variant: EAGLE-3.1 (" in printed and "set norm_output false" in printed
    assert "verdict: compatible" in printed
    finding = next(f for f in json.loads(out.read_text())["findings"] if f["check"] == "variant")
    assert finding["level"] == "warning"
    ours = make_drafter(tmp_path / "ours", fc_norm=True, norm_output=True)
    assert main(["check-compat", str(tiny_target_dir), str(ours), "--aux-layers", "1", "2", "3"]) == 0
    assert "[  ok] variant: EAGLE-3.1 (" in capsys.readouterr().out


def warm_start(tmp_path, target_dir, drafter, counts=DATA, **options):
    embedding, lm_head = load_embedding_and_head(target_dir)
    new_vocab = build_vocab_map(counts, VOCAB, 100)
    return load_warm_start(drafter, target_dir, embedding, lm_head, LAYERS, counts, new_vocab, **options), lm_head


def test_warm_start_reports_the_norm_output_warning(tmp_path, tiny_target_dir):
    """The warm start runs the same check; train@warm_start prints its report and logs it (compat.json)."""
    drafter = as_specforge_wrote_it(make_drafter(tmp_path / "sf", fc_norm=True, norm_output=True))
    warm, _ = warm_start(tmp_path, tiny_target_dir, drafter)
    assert warm.compat.verdict == "compatible" and levels(warm.compat)["variant"] == "warning"
    assert "[WARN] variant:" in warm.compat.render() and warm.draft.cfg.norm_output


def test_warm_start_refuses_an_incompatible_drafter(tmp_path, tiny_target_dir):
    with pytest.raises(IncompatibleDrafter, match="vocabulary"):
        warm_start(tmp_path, tiny_target_dir, make_drafter(tmp_path / "d", vocab=400))


def test_warm_start_refuses_features_from_other_layers(tmp_path, tiny_target_dir):
    with pytest.raises(CheckpointError, match="set target.aux_layers to"):
        warm_start(tmp_path, tiny_target_dir, make_drafter(tmp_path / "d", layers=[0, 1, 2]))


def test_warm_start_keeps_the_source_vocabulary_and_records_its_digest(tmp_path, tiny_target_dir):
    source = make_drafter(tmp_path / "d", tokens=range(150, 250))
    warm, _ = warm_start(tmp_path, tiny_target_dir, source, vocab="keep")
    assert warm.compat.verdict == "needs_new_head" and warm.remapped_rows is None and warm.vocab == "keep"
    assert torch.equal(draft_to_target_ids(warm.draft.d2t), torch.arange(150, 250))
    assert warm.sha256 == drafter_sha256(source)
    (source / "config.json").write_text((source / "config.json").read_text() + " ")
    assert drafter_sha256(source) != warm.sha256


def test_auto_reheads_exactly_when_the_check_says_needs_new_head(tmp_path, tiny_target_dir):
    covering = warm_start(tmp_path, tiny_target_dir, make_drafter(tmp_path / "a"))[0]
    assert covering.compat.verdict == "compatible" and covering.vocab == "keep" and covering.remapped_rows is None
    short = warm_start(tmp_path, tiny_target_dir, make_drafter(tmp_path / "b", tokens=range(90, 190)))[0]
    assert short.compat.verdict == "needs_new_head" and short.vocab == "remap" and short.remapped_rows == 50
    assert torch.equal(draft_to_target_ids(short.draft.d2t), torch.arange(40, 140))
    source = make_drafter(tmp_path / "c", tokens=range(90, 190))
    torch.save({"optimizer": {"adamw": {"state": {}, "param_groups": []}}}, source / "training_state.pt")
    with pytest.raises(Exception, match="auto, and check-compat says needs_new_head"):
        warm_start(tmp_path, tiny_target_dir, source, resume_optimizer=True)


def test_remap_reheads_with_old_rows_for_shared_tokens_and_target_rows_for_new_ones(tmp_path, tiny_target_dir):
    source = make_drafter(tmp_path / "d", tokens=range(90, 190))  # shares tokens 90..139 with the data
    weights = read_weights(source)
    old_head = {int(t): row for t, row in zip(draft_to_target_ids(weights["d2t"]), weights["lm_head.weight"])}
    warm, lm_head = warm_start(tmp_path, tiny_target_dir, source, vocab="remap")
    ids = draft_to_target_ids(warm.draft.d2t)
    assert torch.equal(ids, torch.arange(40, 140)) and warm.draft.t2d.sum() == 100
    assert coverage(DATA, warm.draft.t2d) == 1.0
    assert warm.remapped_rows == 50
    for row, token in enumerate(ids.tolist()):
        expected = old_head[token] if token in old_head else lm_head[token]
        assert torch.equal(warm.draft.lm_head.weight[row].detach(), expected), token
    assert warm.draft.cfg.draft_vocab_size == 100
    feature = warm.draft.fuse(torch.zeros(1, 5, 3 * HIDDEN))
    positions = torch.arange(5)[None]
    _, logits, _, _ = warm.draft(torch.zeros(1, 5, dtype=torch.long), feature, positions,
                                 warm.draft.ttt_context(positions, 1))
    assert logits.shape == (1, 5, 100)


def test_rehead_to_a_larger_draft_vocabulary(tmp_path, tiny_target_dir):
    embedding, lm_head = load_embedding_and_head(tiny_target_dir)
    draft = load_drafter(make_drafter(tmp_path / "d"), embedding)
    d2t, t2d = build_vocab_map(Counter({t: 1 for t in range(20, 180)}), VOCAB, 160)
    assert rehead(draft, d2t, t2d, lm_head) == 60
    assert draft.lm_head.weight.shape == (160, HIDDEN) and draft.cfg.draft_vocab_size == 160


def trainable(draft) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in draft.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_moments_continue_with_this_runs_settings(tmp_path, tiny_target_dir, optimizer):
    source = make_drafter(tmp_path / "d")
    warm, _ = warm_start(tmp_path, tiny_target_dir, source)
    theirs = DrafterTrainConfig(lr=5e-2, betas=[0.8, 0.9], optimizer=optimizer)
    old = Optimizers(trainable(warm.draft), theirs, total_steps=10, fused=False)
    for _, p in trainable(warm.draft):
        p.grad = torch.randn_like(p)
    old.step()
    torch.save({"optimizer": old.state_dict()[0], "step": 1}, source / "training_state.pt")
    warm, _ = warm_start(tmp_path, tiny_target_dir, source, resume_optimizer=True)
    ours = DrafterTrainConfig(lr=1e-4, optimizer=optimizer)
    new = Optimizers(trainable(warm.draft), ours, total_steps=10, fused=False)
    new.continue_moments(warm.optimizer_state)
    assert new.parts["adamw"].param_groups[0]["lr"] == 1e-4 and new.parts["adamw"].param_groups[0]["initial_lr"] == 1e-4
    assert new.parts["adamw"].param_groups[0]["betas"] == (0.9, 0.95)
    assert set(new.parts) == ({"adamw", "muon"} if optimizer == "muon" else {"adamw"})
    moment = {"adamw": "exp_avg", "muon": "momentum_buffer"}
    for name, part in new.parts.items():
        before = [p for group in old.parts[name].param_groups for p in group["params"]]
        for index, p in enumerate(p for group in part.param_groups for p in group["params"]):
            assert torch.equal(part.state[p][moment[name]], old.parts[name].state[before[index]][moment[name]])
    other = Optimizers(trainable(warm.draft), DrafterTrainConfig(optimizer="adamw" if optimizer == "muon" else "muon"),
                       total_steps=10, fused=False)
    with pytest.raises(Exception, match="train.optimizer"):
        other.continue_moments(warm.optimizer_state)


def test_optimizer_state_must_fit_and_needs_keep(tmp_path, tiny_target_dir):
    source = make_drafter(tmp_path / "d")
    with pytest.raises(CheckpointError, match="no training_state.pt"):
        warm_start(tmp_path, tiny_target_dir, source, resume_optimizer=True)
    torch.save({"optimizer": {"adamw": {"state": {}, "param_groups": [{"params": [0]}]}}},
               source / "training_state.pt")
    with pytest.raises(Exception, match="remap"):
        warm_start(tmp_path, tiny_target_dir, source, vocab="remap", resume_optimizer=True)
    warm, _ = warm_start(tmp_path, tiny_target_dir, source, resume_optimizer=True)
    optimizers = Optimizers(trainable(warm.draft), DrafterTrainConfig(optimizer="adamw"), total_steps=10,
                            fused=False)
    with pytest.raises(Exception, match="does not fit"):
        optimizers.continue_moments(warm.optimizer_state)


class NeedsCode:
    """Unpickling this would run this module's code: weights_only refuses it."""


def test_training_state_that_needs_code_is_refused(tmp_path, tiny_target_dir):
    source = make_drafter(tmp_path / "d")
    torch.save({"optimizer": NeedsCode()}, source / "training_state.pt")
    with pytest.raises(CheckpointError, match="cannot read safely|can read safely"):
        warm_start(tmp_path, tiny_target_dir, source, resume_optimizer=True)
