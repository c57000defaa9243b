"""Sampled speculative decoding emits exactly the target's distribution: chi-square tests with fixed seeds.

Every test compares counts of emitted tokens with the exact probabilities (computed by plain forwards of the
target) at significance level ALPHA, and shows the same test rejects a deliberately wrong sampler, so a pass
means something. Cells expected fewer than 5 times are pooled into one, as the chi-square approximation needs.
"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3ops.decoding.drafting import DraftState, propose
from eagle3ops.decoding.sampling import draft_probs, rejection_sample, sample, target_probs, top_p_filter
from eagle3ops.decoding.speculative import AcceptanceStats, speculative_generate
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.modeling.target import capture
from eagle3ops.spec_settings import SpecSettings

ALPHA = 1e-3  # a correct sampler fails a test with this probability; seeds are fixed, so results are stable
V, H = 16, 32  # a tiny vocabulary: the joint law of three tokens has only 16^3 cells
PROMPT = [3, 1, 4, 1, 5]




def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities (same shape); cells expected < 5 times pooled into one."""
    counts, probs = counts.flatten().double(), expected_probs.flatten().double()
    assert counts.sum() > 0 and abs(float(probs.sum()) - 1) < 1e-4
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if expected[-1] == 0:  # only impossible cells were pooled
        if observed[-1] > 0:
            return 0.0  # an outcome of probability 0 occurred
        observed, expected = observed[:-1], expected[:-1]
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))


# --- the rejection-sampling math alone, on fixed distributions ------------------------------------------------

# A "target" whose next-token law at position i is P[i] whatever came before, a "drafter" proposing from Q[i]:
# Q puts mass where P has none (token 5) and little where P has much, so both accept and reject paths are frequent.
P = torch.tensor([[0.45, 0.25, 0.15, 0.10, 0.05, 0.00],
                  [0.05, 0.05, 0.30, 0.10, 0.40, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
                  [0.10, 0.30, 0.10, 0.30, 0.10, 0.10]])  # rows 2, 3: after the drafts of a round from position 1
Q = torch.tensor([[0.05, 0.10, 0.10, 0.05, 0.30, 0.40],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
                  [0.10, 0.10, 0.10, 0.10, 0.30, 0.30]])


def emit_two(verify, generator: torch.Generator) -> tuple[int, int]:
    """Rounds of k = 2 sampled drafts from the current position until two tokens are emitted."""
    out: list[int] = []
    while len(out) < 2:
        at = len(out)
        q = Q[at : at + 2]
        drafts = [sample(row, generator) for row in q]
        accepted, token = verify(P[at : at + 3], q, drafts, generator)
        out += drafts[:accepted] + [token]
    return out[0], out[1]


def always_accept(p, q, drafts, generator):
    """Wrong: the drafter's distribution, as if every draft were accepted."""
    return len(drafts), sample(p[len(drafts)], generator)


def resample_from_p(p, q, drafts, generator):
    """Wrong: on rejection draw from p instead of norm(max(0, p - q)) (over-weights tokens the draft likes)."""
    for i, token in enumerate(drafts):
        if torch.rand((), generator=generator) * q[i, token] >= p[i, token]:
            return i, sample(p[i], generator)
    return len(drafts), sample(p[len(drafts)], generator)


@pytest.mark.parametrize("verify, correct", [(rejection_sample, True), (always_accept, False),
                                              (resample_from_p, False)])
def test_rejection_sampling_emits_the_target_law(verify, correct):
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(6, 6)
    for _ in range(4000):
        first, second = emit_two(verify, generator)
        counts[first, second] += 1
    p_value = chi_square_p_value(counts, P[0][:, None] * P[1][None, :])
    assert (p_value > ALPHA) == correct, p_value


def test_top_p_keeps_the_nucleus_and_renormalises():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    torch.testing.assert_close(top_p_filter(probs, 0.8), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(top_p_filter(probs, 0.81), torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    torch.testing.assert_close(top_p_filter(probs, 0.01), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert top_p_filter(probs, 1.0) is probs


def test_draft_distribution_lives_on_target_ids():
    d2t = torch.tensor([1, 2, 4])  # draft ids 0, 1, 2 are target ids 1, 3, 6
    q = draft_probs(torch.tensor([0.0, 0.0, 2.0]), 2.0, d2t, vocab_size=8)
    expected = torch.zeros(8)
    expected[[1, 3, 6]] = torch.tensor([0.0, 0.0, 1.0]).softmax(-1)
    torch.testing.assert_close(q, expected)


# --- end to end: a tiny target and drafter whose distributions clearly differ ---------------------------------


@pytest.fixture(scope="module")
def models():
    """A target whose logits are a fixed vector times one context-dependent scalar (a normed hidden unit), and a
    drafter that copies the target's last hidden state through `fc` (its layer's updates zeroed) into the same
    head restricted to even ids. Its q is p one position late and without odd tokens: close enough that drafts
    are often accepted, different enough that they are often rejected; odd tokens come only from corrections."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    head = torch.linspace(-2.5, 2.5, V)[torch.tensor([15, 3, 0, 5, 1, 7, 2, 9, 4, 11, 6, 13, 8, 10, 12, 14])]
    target.lm_head.weight.data.zero_()
    target.lm_head.weight.data[:, 0] = head  # extremes at even ids: the drafter can propose them
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=V, draft_vocab_size=8, target_hidden_size=H, aux_layers=[1, 2, 4])
    draft = Eagle3Draft(cfg)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    chosen = torch.arange(8) * 2
    draft.d2t.copy_(chosen - torch.arange(8))
    draft.t2d[chosen] = True
    draft.fc.weight.data.zero_()
    draft.fc.weight.data[:, 2 * H:] = torch.eye(H)  # feature = the last decoder layer's output
    draft.midlayer.self_attn.o_proj.weight.data.zero_()
    draft.midlayer.mlp.down_proj.weight.data.zero_()
    draft.lm_head.weight.data.zero_()
    draft.lm_head.weight.data[:, 0] = head[chosen]
    return target, draft.eval()


def exact_law(target, temperature: float, top_p: float) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] of the target sampling three tokens after PROMPT, from plain forwards."""
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V^2, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        p = target_probs(target(input_ids=ids).logits[:, -3:].double(), temperature, top_p)  # [V^2, 3, V]
    first = p[0, 0]  # [V]
    second = p[::V, 1]  # [V, V]: rows t1 (pairs with t2 = 0 hold t1's continuation)
    third = p[:, 2].reshape(V, V, V)
    return first[:, None, None] * second[:, :, None] * third


def law_counts(sequences: list[list[int]]) -> torch.Tensor:
    counts = torch.zeros(V, V, V)
    for t1, t2, t3 in sequences:
        counts[t1, t2, t3] += 1
    return counts


SAMPLED = {
    "chain-probabilistic-top-p": SpecSettings(k=2, temperature=1.0, top_p=0.8, draft_sample_method="probabilistic"),
    "chain-greedy-drafts": SpecSettings(k=2, temperature=1.0),
    "tree": SpecSettings(k=2, topk=2, num_draft_tokens=5, temperature=0.7),
}


@pytest.mark.parametrize("name", SAMPLED)
def test_speculative_sampling_follows_the_target(models, name):
    target, draft = models
    settings = SAMPLED[name]
    generations = speculative_generate(target, draft, [PROMPT] * 1500, settings, max_new_tokens=3,
                                       eos_ids=set(), seed=1)
    p_value = chi_square_p_value(law_counts([g.tokens for g in generations]),
                                 exact_law(target, settings.temperature, settings.top_p))
    assert p_value > ALPHA, p_value
    first_draft = AcceptanceStats.merged(settings.k, [g.stats for g in generations]).per_position[0]
    assert 0.1 < first_draft < 0.9  # both the accepting and the rejecting path ran often


def test_the_same_test_rejects_the_drafters_own_law(models):
    """Power check: sequences whose t2, t3 are the drafter's own samples, accepted unconditionally (the first
    token from the target), fail the test the speculative samples pass."""
    target, draft = models
    settings = SAMPLED["chain-probabilistic-top-p"]
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad(), capture(target, draft.cfg.aux_layers) as hooks:
        p_first = target_probs(target(input_ids=torch.tensor([PROMPT])).logits[0, -1], settings.temperature,
                               settings.top_p)
        features = draft.fuse(hooks.aux())
    sequences = []
    for _ in range(1500):
        first = sample(p_first, generator)
        state = DraftState(PROMPT[1:] + [first], features, first_pos=0)
        sequences.append([first, *propose(draft, state, settings, generator).tokens])
    p_value = chi_square_p_value(law_counts(sequences), exact_law(target, settings.temperature, settings.top_p))
    assert p_value < ALPHA, p_value
