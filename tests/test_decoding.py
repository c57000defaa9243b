"""Capture hooks, extraction, acceptance counting and lossless greedy speculative decoding on tiny models."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3ops.data.shards import iter_samples
from eagle3ops.decoding.speculative import AcceptanceStats, speculative_greedy, target_greedy
from eagle3ops.extraction import extract_features
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.modeling.target import TargetError, capture, resolve_aux_layers

V, H, LAYERS = 64, 32, 6


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def drafter(target, seed=0, draft_vocab=32) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=V, draft_vocab_size=draft_vocab, target_hidden_size=H, aux_layers=[2, 3, 4])
    draft = Eagle3Draft(cfg)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    chosen = torch.arange(draft_vocab) * (V // draft_vocab)
    draft.d2t.copy_(chosen - torch.arange(draft_vocab))
    draft.t2d[chosen] = True
    return draft.eval()


def test_hooks_capture_hf_hidden_state_indices(target):
    ids = torch.randint(0, V, (2, 10))
    with torch.no_grad(), capture(target, [0, 2, 5]) as hooks:
        out = target(input_ids=ids, output_hidden_states=True)
    states = out.hidden_states  # index 0 = embeddings, i = output of layer i-1
    torch.testing.assert_close(hooks.aux(), torch.cat([states[0], states[2], states[5]], dim=-1))
    torch.testing.assert_close(hooks.final(), states[-1])  # after the final norm


def test_aux_layer_range_is_checked():
    assert resolve_aux_layers(None, 61) == [2, 30, 58]
    with pytest.raises(TargetError, match=r"target.aux_layers.*\[99\].*0..5"):
        resolve_aux_layers([2, 3, 99], LAYERS)


def test_extraction_does_not_depend_on_batch_composition(target, tmp_path):
    torch.manual_seed(1)
    samples = [{"id": f"s{i}", "input_ids": torch.randint(0, V, (n,)).tolist(), "loss_mask": [1] * n}
               for i, n in enumerate([5, 13, 9])]
    extract_features(target, samples, [2, 3, 4], tmp_path / "f", batch_size=3, samples_per_shard=2)
    stored = dict(iter_samples(tmp_path / "f"))
    assert set(stored) == {"s0", "s1", "s2"}
    for sample in samples:
        with torch.no_grad(), capture(target, [2, 3, 4]) as hooks:
            target(input_ids=torch.tensor([sample["input_ids"]]))
        got = stored[sample["id"]]
        assert got["input_ids"].tolist() == sample["input_ids"]
        torch.testing.assert_close(got["aux_hidden"], hooks.aux()[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["final_hidden"], hooks.final()[0], rtol=1e-4, atol=1e-5)


def test_acceptance_stats_count_like_the_engines():
    stats = AcceptanceStats(k=3)
    for accepted in (3, 0, 1, 2):
        stats.record(accepted)
    assert stats.tau == pytest.approx(1 + 6 / 4)
    assert stats.per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    other = AcceptanceStats(k=3)
    other.record(3)
    stats.merge(other)
    assert (stats.steps, stats.accepted, stats.accepted_at) == (5, 9, [4, 3, 2])
    assert AcceptanceStats(k=3).tau == 0.0


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_greedy_equals_target_greedy(target, k, seed):
    torch.manual_seed(100 + seed)
    prompt = torch.randint(0, V, (7,)).tolist()
    eos = {V - 1}
    tokens, stats = speculative_greedy(target, drafter(target, seed), prompt, k, max_new_tokens=40, eos_ids=eos)
    assert tokens == target_greedy(target, prompt, 40, eos)
    assert stats.steps >= 1 and 0 <= stats.accepted <= k * stats.steps


def test_full_acceptance_when_the_drafter_agrees(target):
    """A target and a drafter whose final norms are zeroed both always pick id 0: every draft is accepted."""
    constant = copy.deepcopy(target)
    constant.model.norm.weight.data.zero_()
    draft = drafter(constant)
    draft.norm.weight.data.zero_()
    prompt = [5, 6, 7, 8]
    tokens, stats = speculative_greedy(constant, draft, prompt, k=3, max_new_tokens=17, eos_ids={V - 1})
    assert tokens == target_greedy(constant, prompt, 17, {V - 1}) == [0] * 17
    assert stats.tau == 4.0 and stats.per_position == [1.0, 1.0, 1.0]
