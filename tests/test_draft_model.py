"""The draft model: TTT attention against a dense masked reference, the loss, and the checkpoint layout."""
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from eagle3ops.formats.specforge import load_drafter, read_weights, save_drafter
from eagle3ops.modeling.draft import (
    DraftConfig,
    Eagle3Draft,
    KVCache,
    rotary,
    shift_left,
    target_distribution,
    ttt_loss,
)

V, VD, H = 40, 16, 32


def make_draft(seed=0, heads=4, kv_heads=2) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, aux_layers=[1, 2, 3])
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():  # weights large enough that a mask error changes the outputs visibly
        torch.nn.init.normal_(p, std=0.3)
    chosen = torch.arange(0, 2 * VD, 2)  # every other target id is in the draft vocabulary
    draft.d2t.copy_(chosen - torch.arange(VD))
    draft.t2d.zero_()
    draft.t2d[chosen] = True
    return draft.eval()


def ttt_mask(T: int, k: int) -> torch.Tensor:
    """Dense mask over keys [step 0 (T) | step 1 (T) | ... | step k (T)] for step-k queries:
    causal on step 0, same position only on steps 1..k."""
    blocks = [torch.ones(T, T, dtype=torch.bool).tril()] + [torch.eye(T, dtype=torch.bool)] * k
    return torch.cat(blocks, dim=1)


def test_ttt_attention_matches_dense_masked_attention():
    draft = make_draft()
    attn = draft.midlayer.self_attn
    B, T, K = 2, 6, 4
    xs = [torch.randn(B, T, 2 * H) for _ in range(K)]
    cos, sin = rotary(torch.arange(T).expand(B, T), attn.hd, 10000.0)
    cache = []
    with torch.no_grad():
        outs = [attn.forward_ttt(x, cos, sin, cache) for x in xs]
        for k in range(K):
            q, _, _ = attn._qkv(xs[k], cos, sin)
            keys = torch.cat([attn._expand(cache[j][0]) for j in range(k + 1)], dim=2)  # [B, nh, (k+1)T, hd]
            values = torch.cat([attn._expand(cache[j][1]) for j in range(k + 1)], dim=2)
            dense = F.scaled_dot_product_attention(q, keys, values, attn_mask=ttt_mask(T, k))
            expected = attn.o_proj(dense.transpose(1, 2).reshape(B, T, -1))
            torch.testing.assert_close(outs[k], expected, rtol=1e-5, atol=1e-5)


def test_ttt_step_sees_no_future_position():
    """Changing the input at position t must not change any earlier position's output, at any TTT step."""
    draft = make_draft()
    B, T = 1, 8
    ids = torch.randint(0, V, (B, T))
    aux = torch.randn(B, T, 3 * H)
    positions = torch.arange(T).expand(B, T)

    def run(ids, aux):
        hidden, cache, outs = draft.fuse(aux), [], []
        for _ in range(3):
            hidden, logits = draft(ids, hidden, positions, cache)
            outs.append(logits)
        return outs

    with torch.no_grad():
        base = run(ids, aux)
        aux2 = aux.clone()
        aux2[:, 5] += 1.0
        changed = run(ids, aux2)
    for a, b in zip(base, changed):
        torch.testing.assert_close(a[:, :5], b[:, :5])
        assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_serving_cache_matches_uncached_forward():
    """The KV-cached serving path over a prefix equals one causal pass (step 0 of TTT)."""
    draft = make_draft()
    B, T = 1, 7
    ids, aux = torch.randint(0, V, (B, T)), torch.randn(B, T, 3 * H)
    positions = torch.arange(T).expand(B, T)
    with torch.no_grad():
        _, full = draft(ids, draft.fuse(aux), positions, [])
        cache = KVCache()
        _, first = draft.step(ids[:, :4], draft.fuse(aux[:, :4]), positions[:, :4], kv_cache=cache)
        _, rest = draft.step(ids[:, 4:], draft.fuse(aux[:, 4:]), positions[:, 4:], kv_cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-5)
    cache.crop(3)
    assert cache.length == 3


def test_target_distribution_restricts_to_draft_vocab():
    draft = make_draft()
    final = torch.randn(1, 5, H)
    head = torch.randn(V, H)
    probs, in_draft = target_distribution(final, head, draft.t2d)
    logits = final @ head.T
    torch.testing.assert_close(probs, logits[..., draft.t2d].softmax(-1))
    assert torch.equal(in_draft, draft.t2d[logits.argmax(-1)])
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 5))


def test_ttt_loss_alignment_and_value():
    """Step 0 predicts x_{t+2} from (g_t, x_{t+1}) against the target at t+1, where loss_mask[t+2] is 1."""
    draft = make_draft()
    B, T = 1, 9
    ids = torch.randint(0, V, (B, T))
    aux, final = torch.randn(B, T, 3 * H), torch.randn(B, T, H)
    head = torch.randn(V, H)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[0, 4:] = 1
    with torch.no_grad():
        result = ttt_loss(draft, ids, aux, final, mask, head, ttt_steps=2, decay=0.8)
        # Manual step 0.
        _, logits = draft(shift_left(ids), draft.fuse(aux), torch.arange(T)[None], [])
        probs, in_draft = target_distribution(final, head, draft.t2d)
        rows = [t for t in range(T - 2) if mask[0, t + 2] and in_draft[0, t + 1]]
        expected = -sum((probs[0, t + 1] * logits[0, t].log_softmax(-1)).sum() for t in rows) / len(rows)
        correct = sum(int(logits[0, t].argmax() == probs[0, t + 1].argmax()) for t in rows)
    assert result.counted[0] == len(rows)
    assert result.masked[0] == int(mask[0, 2:].sum())
    assert math.isclose(result.losses[0], float(expected), rel_tol=1e-5)
    assert math.isclose(result.accs[0], correct / len(rows), rel_tol=1e-6)
    assert math.isclose(float(result.loss), result.losses[0] + 0.8 * result.losses[1], rel_tol=1e-5)
    assert result.masked[1] == int(mask[0, 3:].sum())  # step 1 shifts the mask one more position


def test_ttt_loss_trains_down():
    draft = make_draft(heads=2, kv_heads=2)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.02)
    torch.manual_seed(1)
    ids = torch.randint(0, V, (4, 12))
    aux, final, head = torch.randn(4, 12, 3 * H), torch.randn(4, 12, H), torch.randn(V, H)
    mask = torch.ones(4, 12, dtype=torch.long)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    draft.train()
    first = None
    for _ in range(100):
        result = ttt_loss(draft, ids, aux, final, mask, head, ttt_steps=3)
        opt.zero_grad()
        result.loss.backward()
        opt.step()
        first = first if first is not None else result.losses[0]
    # Soft cross-entropy is bounded below by the target's entropy: the KL part must mostly vanish.
    probs, _ = target_distribution(shift_left(final), head, draft.t2d)
    entropy = float(-(probs * probs.clamp_min(1e-12).log()).sum(-1)[:, : 12 - 2].mean())
    assert result.losses[0] - entropy < 0.3 * (first - entropy)
    assert draft.embed_tokens.weight.grad is None  # the target's embedding stays frozen


def test_specforge_layout_round_trip(tmp_path):
    draft = make_draft()
    save_drafter(draft, tmp_path / "d", training_state={"step": 3})
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == VD
    # SGLang convention on disk (output of layer i), HF hidden-state indices in memory.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    names = set(read_weights(tmp_path / "d"))
    assert "embed_tokens.weight" not in names
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names
    loaded = load_drafter(tmp_path / "d", draft.embed_tokens.weight.detach())
    assert loaded.cfg.aux_layers == [1, 2, 3]
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_load_drafter_rejects_foreign_embedding(tmp_path):
    save_drafter(make_draft(), tmp_path / "d")
    with pytest.raises(ValueError, match="target embedding"):
        load_drafter(tmp_path / "d", torch.zeros(V + 1, H))


@pytest.mark.parametrize("heads,kv_heads,T", [(4, 4, 16), (4, 2, 37)])
def test_flex_ttt_attention_equals_the_reference(heads, kv_heads, T):
    """The GPU kernel's block mask and key layout, run unfused on the CPU, against the explicit TTT attention."""
    from eagle3ops.modeling.draft import Attention, ttt_attention_flex

    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      vocab_size=50, draft_vocab_size=20, target_hidden_size=32, head_dim=8)
    attention = Attention(cfg)
    B, hd = 2, cfg.head_dim
    cache = []
    for step in range(4):
        q = torch.randn(B, heads, T, hd)
        cache.append((torch.randn(B, kv_heads, T, hd), torch.randn(B, kv_heads, T, hd)))
        expected = attention.ttt_attention_reference(q, cache)
        assert torch.allclose(ttt_attention_flex(q, cache), expected, atol=1e-5), step


def reference_ttt_loss(draft, ids, aux, final, mask, head, steps, decay):
    """The TTT loss written plainly: full logits, shifted copies, log-softmax, one step after another."""
    logits_target = final @ head.T  # [B, T, V]
    probs = logits_target[..., draft.t2d].softmax(-1)
    in_draft = draft.t2d[logits_target.argmax(-1)]
    B, T = ids.shape
    hidden, cache, total = draft.fuse(aux), [], 0.0
    inputs = shift_left(ids)
    for k in range(steps):
        hidden, logits = draft(inputs, hidden, torch.arange(T).expand(B, T), cache)
        loss, count = 0.0, 0
        for b in range(B):
            for t in range(T - k - 2):
                if mask[b, t + k + 2] and in_draft[b, t + k + 1]:
                    loss = loss - (probs[b, t + k + 1] * F.log_softmax(logits[b, t], -1)).sum()
                    count += 1
        total = total + decay**k * loss / max(count, 1)
        inputs = shift_left(inputs)
    return total


def test_ttt_loss_and_gradients_equal_the_plain_reference():
    draft = make_draft(heads=2, kv_heads=1)
    torch.manual_seed(3)
    B, T = 2, 10
    ids = torch.randint(0, V, (B, T))
    aux, final, head = torch.randn(B, T, 3 * H), torch.randn(B, T, H), torch.randn(V, H)
    mask = (torch.rand(B, T) > 0.3).long()
    params = [p for p in draft.parameters() if p.requires_grad]
    fast = ttt_loss(draft, ids, aux, final, mask, head, ttt_steps=4, decay=0.8).loss
    fast_grads = torch.autograd.grad(fast, params)
    plain = reference_ttt_loss(draft, ids, aux, final, mask, head, 4, 0.8)
    plain_grads = torch.autograd.grad(plain, params)
    assert math.isclose(float(fast), float(plain), rel_tol=1e-5)
    for p, a, b in zip(params, fast_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_soft_cross_entropy_value_and_gradient():
    from eagle3ops.modeling.draft import soft_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    target = torch.randn(3, 5, 7, dtype=torch.float64).softmax(-1)
    counted = torch.rand(3, 5) > 0.4
    top = target.argmax(-1)
    summed, correct = soft_cross_entropy(logits, target, top, counted)
    expected = -(target * logits.log_softmax(-1)).sum(-1)[counted].sum()
    torch.testing.assert_close(summed, expected)
    assert int(correct) == int(((logits.argmax(-1) == top) & counted).sum())
    assert torch.autograd.gradcheck(lambda z: soft_cross_entropy(z, target, top, counted)[0], (logits,))


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on a CPU needs a C compiler")
def test_the_compiled_step_and_loss_give_the_eager_loss_and_gradients():
    """What the training loop compiles on a GPU (the drafter's forward, one TTT step, and the step loss), compiled
    here by the CPU backend: the same TTT loss and gradients as eager. Guards the rewrites the fusion relies on
    (the TTT cache a list the compiled step appends to, the loss written as lse * sum(p) - p . z)."""
    import copy

    from eagle3ops.modeling.draft import soft_cross_entropy

    eager = make_draft(heads=2, kv_heads=1)
    compiled = copy.deepcopy(eager)
    compiled.compile(dynamic=False)
    torch.manual_seed(4)
    B, T = 2, 12
    ids = torch.randint(0, V, (B, T))
    aux, final, head = torch.randn(B, T, 3 * H), torch.randn(B, T, H), torch.randn(V, H)
    mask = (torch.rand(B, T) > 0.3).long()
    results = []
    for draft, cross_entropy in ((eager, soft_cross_entropy), (compiled, torch.compile(soft_cross_entropy))):
        params = [p for p in draft.parameters() if p.requires_grad]
        result = ttt_loss(draft, ids, aux, final, mask, head, ttt_steps=3, decay=0.8, cross_entropy=cross_entropy)
        results.append((result, torch.autograd.grad(result.loss, params)))
    (plain, plain_grads), (fused, fused_grads) = results
    assert plain.losses == pytest.approx(fused.losses, rel=1e-5) and plain.accs == fused.accs
    for a, b in zip(plain_grads, fused_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_drafter_compiled_for_training_decodes_eager_at_any_shape():
    """The training loop's acceptance probe decodes with the drafter it trains: serving shapes (prompt lengths,
    tree widths) change call to call and must not compile a graph each, whatever its forward was compiled for."""
    import copy

    from torch._dynamo.utils import counters

    eager = make_draft(heads=2, kv_heads=1)
    compiled = copy.deepcopy(eager)
    compiled.compile(dynamic=False)
    torch.manual_seed(5)
    compiles_before = counters["stats"]["unique_graphs"]
    caches = KVCache(), KVCache()
    position = 0
    with torch.no_grad():
        for n in (7, 1, 3, 2):  # a prompt, then draft steps of changing width
            ids, hidden = torch.randint(0, V, (1, n)), torch.randn(1, n, H)
            positions = torch.arange(position, position + n)[None]
            (h_eager, l_eager), (h_compiled, l_compiled) = (
                draft.step(ids, hidden, positions, kv_cache=cache) for draft, cache in zip((eager, compiled), caches))
            assert torch.equal(h_eager, h_compiled) and torch.equal(l_eager, l_compiled)
            position += n
    assert counters["stats"]["unique_graphs"] == compiles_before
