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
    repeat_kv,
    rotary,
    shift_left,
    target_distribution,
    ttt_loss,
)
from helpers import ttt_logits

V, VD, H = 40, 16, 32


def make_draft(seed=0, heads=4, kv_heads=2, eagle31=False, attention_kernel="auto") -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, aux_layers=[1, 2, 3],
                      fc_norm=eagle31, norm_output=eagle31)
    draft = Eagle3Draft(cfg, attention_kernel)
    for p in draft.parameters():  # weights large enough that a mask error changes the outputs visibly
        torch.nn.init.normal_(p, std=0.3)
    chosen = torch.arange(0, 2 * VD, 2)  # every other target id is in the draft vocabulary
    draft.d2t.copy_(chosen - torch.arange(VD))
    draft.t2d.zero_()
    draft.t2d[chosen] = True
    return draft.eval()


def positions_of(*lengths: int) -> torch.Tensor:
    """A packed row's positions [1, sum(lengths)]: each document's own, from 0."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


def run_steps(draft, ids, hidden, positions, steps: int) -> list[torch.Tensor]:
    """The drafter's logits at each of `steps` TTT steps, each step's hidden state fed to the next."""
    context, outs = draft.ttt_context(positions, steps), []
    for _ in range(steps):
        hidden, logits, keys, values = draft(ids, hidden, positions, context)
        context = context.after(keys, values)
        outs.append(logits)
    return outs


def ttt_mask(positions: torch.Tensor, k: int) -> torch.Tensor:
    """Dense mask [B, 1, T, (k+1)T] over keys [step 0 | step 1 | ... | step k] for step-k queries: causal within
    the query's document on step 0, its own position only on steps 1..k."""
    T = positions.shape[1]
    documents = (positions == 0).cumsum(-1)
    step0 = torch.ones(T, T, dtype=torch.bool).tril() & (documents[:, :, None] == documents[:, None])
    own = torch.eye(T, dtype=torch.bool).expand_as(step0)
    return torch.cat([step0] + [own] * k, dim=-1)[:, None]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_ttt_attention_matches_dense_masked_attention(heads, kv_heads):
    """Step 0 within each document, the log-sum-exp merge of the later steps' own-position keys: one softmax over
    all the keys the TTT picture shows, on packed rows."""
    draft = make_draft(heads=heads, kv_heads=kv_heads)
    attn = draft.midlayer.self_attn
    K = 4
    positions = torch.cat([positions_of(4, 3, 2), positions_of(9)])  # two rows of 9: three documents, and one
    B, T = positions.shape
    xs = [torch.randn(B, T, 2 * H) for _ in range(K)]
    cos, sin = rotary(positions, attn.hd, 10000.0)
    context, kvs = draft.ttt_context(positions, K), []
    with torch.no_grad():
        for k in range(K):
            out, keys, values = attn.forward_ttt(xs[k], cos, sin, context)
            context, kvs = context.after(keys, values), kvs + [(keys, values)]
            q, _, _ = attn._qkv(xs[k], cos, sin)
            group = heads // kv_heads
            all_keys = torch.cat([repeat_kv(kv[0], group) for kv in kvs], dim=2)  # [B, nh, (k+1)T, hd]
            all_values = torch.cat([repeat_kv(kv[1], group) for kv in kvs], dim=2)
            dense = F.scaled_dot_product_attention(q, all_keys, all_values, attn_mask=ttt_mask(positions, k))
            expected = attn.o_proj(dense.transpose(1, 2).reshape(B, T, -1))
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_ttt_step_sees_no_future_position_nor_another_document():
    """Changing position t changes no earlier position of its document and nothing of the documents before or
    after it in the row, at any TTT step."""
    draft = make_draft()
    positions = positions_of(4, 5, 3)  # documents at 0..3, 4..8, 9..11
    T = positions.shape[1]
    ids, aux = torch.randint(0, V, (1, T)), torch.randn(1, T, 3 * H)
    with torch.no_grad():
        base = run_steps(draft, ids, draft.fuse(aux), positions, 3)
        aux2 = aux.clone()
        aux2[:, 6] += 1.0
        changed = run_steps(draft, ids, draft.fuse(aux2), positions, 3)
    for a, b in zip(base, changed):
        torch.testing.assert_close(a[:, :6], b[:, :6])
        torch.testing.assert_close(a[:, 9:], b[:, 9:])
        assert not torch.allclose(a[:, 6:9], b[:, 6:9])


def test_serving_cache_matches_uncached_forward():
    """The KV-cached serving path over a prefix equals one causal pass (step 0 of TTT)."""
    draft = make_draft()
    B, T = 1, 7
    ids, aux = torch.randint(0, V, (B, T)), torch.randn(B, T, 3 * H)
    positions = torch.arange(T).expand(B, T)
    with torch.no_grad():
        _, full, _, _ = draft(ids, draft.fuse(aux), positions, draft.ttt_context(positions, 1))
        cache = KVCache()
        _, first = draft.step(ids[:, :4], draft.fuse(aux[:, :4]), positions[:, :4], kv_cache=cache)
        _, rest = draft.step(ids[:, 4:], draft.fuse(aux[:, 4:]), positions[:, 4:], kv_cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-5)
    cache.crop(3)
    assert cache.length == 3


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("kernel", ["reference", "flex"])
def test_raised_ttt_positions_give_exactly_what_serving_drafts(eagle31, kernel):
    """With raised positions TTT step k at t is the drafter serving t's k-th draft (decoding/drafting.py): the
    prefix 0..t in the cache, then k steps at t + 1, ..., t + k, each fed the previous step's state. With fixed
    positions step 0 still is, the later steps are not. Both TTT attention paths (the flex kernel on this CPU)."""
    draft = make_draft(eagle31=eagle31, attention_kernel=kernel)
    T, K = 10, 4
    generator = torch.Generator().manual_seed(3)
    ids, aux = torch.randint(0, V, (1, T + K), generator=generator), torch.randn(1, T, 3 * H, generator=generator)
    positions = torch.arange(T)[None]
    with torch.no_grad():
        raised = ttt_logits(draft, ids[:, :T], aux, positions, K, raise_positions=True)
        fixed = ttt_logits(draft, ids[:, :T], aux, positions, K, raise_positions=False)
        for t in (2, 5):
            cache = KVCache()
            hidden, logits = draft.step(ids[:, : t + 1], draft.fuse(aux[:, : t + 1]), positions[:, : t + 1], cache)
            hidden, served = hidden[:, -1:], [logits[:, -1]]
            for k in range(1, K):
                hidden, logits = draft.step(ids[:, t + k : t + k + 1], hidden, torch.tensor([[t + k]]), cache)
                served.append(logits[:, -1])
            for k in range(K):
                torch.testing.assert_close(raised[k][:, t], served[k], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(fixed[0][:, t], served[0], rtol=1e-4, atol=1e-4)
            assert not torch.allclose(fixed[2][:, t], served[2], rtol=1e-3, atol=1e-3)


def test_eagle31_normalises_each_target_layer_and_carries_the_post_norm_state():
    draft = make_draft(eagle31=True)
    for norm in draft.fc_norm:  # distinct gains, so that a norm applied to the wrong slice shows
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    aux = torch.randn(2, 5, 3 * H)
    scaled = aux.clone()
    scaled[..., H : 2 * H] *= 1000.0  # a mid layer a thousand times louder: its own RMSNorm takes it out
    with torch.no_grad():
        torch.testing.assert_close(draft.fuse(scaled), draft.fuse(aux), rtol=1e-4, atol=1e-4)
        layers = aux.chunk(3, dim=-1)
        normed = [F.rms_norm(x, (H,), norm.weight, 1e-6) for x, norm in zip(layers, draft.fc_norm)]
        expected = draft.fc(torch.cat(normed, dim=-1))
        torch.testing.assert_close(draft.fuse(aux), expected, rtol=1e-5, atol=1e-5)
        positions, ids, fused = torch.arange(5).expand(2, 5), torch.randint(0, V, (2, 5)), draft.fuse(aux)
        cos, sin = rotary(positions, draft.cfg.head_dim, draft.cfg.rope_theta)
        layer_out, _, _ = draft.midlayer.forward_ttt(draft.embed_tokens(ids), fused, cos, sin,
                                                     draft.ttt_context(positions, 1))
        carried, logits, _, _ = draft(ids, fused, positions, draft.ttt_context(positions, 1))
        torch.testing.assert_close(carried, draft.norm(layer_out))  # the next step's feature: the post-norm state
        torch.testing.assert_close(logits, draft.lm_head(carried))  # which the head reads without a second norm


def test_target_distribution_restricts_to_draft_vocab():
    draft = make_draft()
    final = torch.randn(1, 5, H)
    head = torch.randn(V, H)
    probs, in_draft, draft_mass = target_distribution(final, head, draft.t2d)
    logits = final @ head.T
    torch.testing.assert_close(probs, logits[..., draft.t2d].softmax(-1))
    assert torch.equal(in_draft, draft.t2d[logits.argmax(-1)])
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 5))
    # the target's own probabilities of the draft tokens, out of its whole vocabulary
    torch.testing.assert_close(probs * draft_mass[..., None], logits.softmax(-1)[..., draft.t2d])
    assert bool((draft_mass < 1).all())  # the draft vocabulary is a strict subset


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
        positions = torch.arange(T)[None]
        result = ttt_loss(draft, ids, aux, final, mask, positions, head, ttt_steps=2, decay=0.8)
        # Manual step 0.
        _, logits, _, _ = draft(shift_left(ids), draft.fuse(aux), positions, draft.ttt_context(positions, 2))
        probs, in_draft, _ = target_distribution(final, head, draft.t2d)
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
        result = ttt_loss(draft, ids, aux, final, mask, torch.arange(12).expand(4, 12), head, ttt_steps=3)
        opt.zero_grad()
        result.loss.backward()
        opt.step()
        first = first if first is not None else result.losses[0]
    # Soft cross-entropy is bounded below by the target's entropy: the KL part must mostly vanish.
    probs, _, _ = target_distribution(shift_left(final), head, draft.t2d)
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


def random_positions(T: int, documents: int, generator: torch.Generator) -> torch.Tensor:
    """Positions [1, T] of a row packed with `documents` documents of random lengths."""
    cuts = (torch.randperm(T - 1, generator=generator)[: documents - 1] + 1).sort().values.tolist()
    return positions_of(*(b - a for a, b in zip([0, *cuts], [*cuts, T])))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_the_fused_ttt_attention_equals_the_reference_at_every_step(heads, kv_heads):
    """The GPU's path (flex within documents, grouped heads, later steps merged through the log-sum-exp), run
    unfused on the CPU, against the explicit softmax over every key, at steps 0 to 5 of rows packed across tiles."""
    from eagle3ops.modeling.draft import document_block_mask, document_ids

    generator = torch.Generator().manual_seed(0)
    draft = make_draft(heads=heads, kv_heads=kv_heads)
    attn = draft.midlayer.self_attn
    positions = torch.cat([random_positions(300, 5, generator), random_positions(300, 2, generator)])
    B, T = positions.shape
    cos, sin = rotary(positions, attn.hd, 10000.0)
    fused = draft.ttt_context(positions, 6)
    fused.block_mask = document_block_mask(document_ids(positions))
    reference = draft.ttt_context(positions, 6)
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(B, T, 2 * H, generator=generator)
            (out, keys, values), (expected, _, _) = (attn.forward_ttt(x, cos, sin, c) for c in (fused, reference))
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, msg=f"step {step}")
            fused, reference = fused.after(keys, values), reference.after(keys, values)


def test_document_block_mask_reads_every_visible_pair_and_skips_the_rest():
    """The tiles the flex kernel reads: every pair a query sees lies in a listed tile, a tile read whole holds only
    visible pairs, and a tile with none is skipped (long documents over several tiles, short ones within one, and
    a last tile the row fills only in part)."""
    from eagle3ops.modeling.draft import BLOCK, document_block_mask, document_ids

    positions = torch.cat([positions_of(300, 5, 40, 255), positions_of(130, 2, 2, 466)])  # rows of 600: 4.7 tiles
    documents = document_ids(positions)
    mask = document_block_mask(documents)
    T = positions.shape[1]
    tiles = -(-T // BLOCK)
    visible = F.pad(torch.ones(T, T, dtype=torch.bool).tril() & (documents[:, :, None] == documents[:, None]),
                    (0, tiles * BLOCK - T, 0, tiles * BLOCK - T))  # nothing past the row's end is seen
    pairs = visible.view(2, tiles, BLOCK, tiles, BLOCK).transpose(2, 3)  # [B, q tile, kv tile, BLOCK, BLOCK]

    def listed(counts, indices):  # [B, q tile, kv tile] bool
        dense = torch.zeros(2, tiles, tiles, dtype=torch.bool)
        for b in range(2):
            for q in range(tiles):
                dense[b, q, indices[b, 0, q, : counts[b, 0, q]].long()] = True
        return dense

    partial, whole = listed(mask.kv_num_blocks, mask.kv_indices), listed(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & whole).any()
    assert torch.equal(partial | whole, pairs.any(-1).any(-1))
    assert torch.equal(whole, pairs.all(-1).all(-1))
    assert whole.any() and (~(partial | whole)).any()  # the rows exercise all three kinds


def document_loss_alone(draft, ids, aux, final, mask, head, steps) -> list[tuple[torch.Tensor, int]]:
    """One document in a row of its own, the TTT loss written plainly: full target logits, log-softmax, one position
    after another. -> (summed loss, counted positions) per step."""
    logits_target = final @ head.T  # [1, L, V]
    probs = logits_target[..., draft.t2d].softmax(-1)
    in_draft = draft.t2d[logits_target.argmax(-1)]
    L = ids.shape[1]
    positions = torch.arange(L)[None]
    hidden, context, inputs, per_step = draft.fuse(aux), draft.ttt_context(positions, steps), shift_left(ids), []
    for k in range(steps):
        hidden, logits, keys, values = draft(inputs, hidden, positions, context)
        context = context.after(keys, values)
        counted = [t for t in range(L - k - 2) if mask[0, t + k + 2] and in_draft[0, t + k + 1]]
        summed = sum((-(probs[0, t + k + 1] * F.log_softmax(logits[0, t], -1)).sum() for t in counted),
                     torch.zeros(()))
        per_step.append((summed, len(counted)))
        inputs = shift_left(inputs)
    return per_step


def packed_batch(lengths_by_row: list[list[int]], T: int, seed: int):
    """Random documents packed into rows of T (tails padded): ids, aux, final, mask, positions, and each document's
    (row, start, length)."""
    generator = torch.Generator().manual_seed(seed)
    B = len(lengths_by_row)
    ids = torch.randint(0, V, (B, T), generator=generator)
    aux, final = torch.randn(B, T, 3 * H, generator=generator), torch.randn(B, T, H, generator=generator)
    mask = (torch.rand(B, T, generator=generator) > 0.3).long()
    positions = torch.cat([positions_of(*lengths, T - sum(lengths)) for lengths in lengths_by_row])
    documents = [(row, sum(lengths[:i]), n) for row, lengths in enumerate(lengths_by_row) for i, n in enumerate(lengths)]
    mask[torch.arange(T)[None] >= torch.tensor([sum(lengths) for lengths in lengths_by_row])[:, None]] = 0  # tails
    return ids, aux, final, mask, positions, documents


def test_ttt_loss_and_gradients_of_packed_rows_equal_the_documents_trained_alone():
    """Rows packed with several documents (and padded tails): the TTT loss and its gradients are those of the
    documents each trained alone in a row of its own, with every step's loss over all their counted positions."""
    draft = make_draft(heads=2, kv_heads=1)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(9))
    steps, decay = 4, 0.8
    ids, aux, final, mask, positions, documents = packed_batch([[7, 5, 2, 6], [11, 9]], T=22, seed=3)
    params = [p for p in draft.parameters() if p.requires_grad]
    packed = ttt_loss(draft, ids, aux, final, mask, positions, head, ttt_steps=steps, decay=decay)
    packed_grads = torch.autograd.grad(packed.loss, params)
    alone = [document_loss_alone(draft, *(x[row : row + 1, start : start + n] for x in (ids, aux, final, mask)), head,
                                 steps) for row, start, n in documents]
    counts = [sum(doc[k][1] for doc in alone) for k in range(steps)]
    plain = sum(decay**k * sum(doc[k][0] for doc in alone) / counts[k] for k in range(steps))
    plain_grads = torch.autograd.grad(plain, params)
    assert packed.counted == counts and min(counts) > 0
    assert math.isclose(float(packed.loss), float(plain), rel_tol=1e-5)
    for a, b in zip(packed_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_each_document_of_a_packed_row_has_the_loss_and_gradients_it_has_alone():
    """Counting one document of a packed row at a time (its loss mask alone): that document's per-step losses and
    gradients, TTT steps 1 and later included, are those it has in a row of its own, to float32 rounding; and every
    step feeds it the tokens it sees alone (zeros past its end, never the next document's)."""
    draft = make_draft(heads=4, kv_heads=2)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    ids, aux, final, mask, positions, documents = packed_batch([[6, 9, 5]], T=24, seed=5)
    params = [p for p in draft.parameters() if p.requires_grad]
    fed = []  # the tokens each TTT step is given
    forward = draft.forward
    draft.forward = lambda input_ids, *args: fed.append(input_ids) or forward(input_ids, *args)
    counted_at_step_1 = 0
    for row, start, n in documents:
        only = torch.zeros_like(mask)
        only[row, start : start + n] = mask[row, start : start + n]
        packed = ttt_loss(draft, ids, aux, final, only, positions, head, ttt_steps=4, decay=0.8)
        piece = [x[row : row + 1, start : start + n] for x in (ids, aux, final, mask)]
        alone = ttt_loss(draft, *piece, torch.arange(n)[None], head, ttt_steps=4, decay=0.8)
        fed_packed, fed_alone, fed[:] = fed[:4], fed[4:], []
        assert all(torch.equal(a[row : row + 1, start : start + n], b) for a, b in zip(fed_packed, fed_alone))
        assert packed.counted == alone.counted and packed.masked == alone.masked
        assert packed.losses == pytest.approx(alone.losses, rel=1e-5, abs=1e-6)
        for a, b in zip(torch.autograd.grad(packed.loss, params), torch.autograd.grad(alone.loss, params)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        counted_at_step_1 += packed.counted[1]
    assert counted_at_step_1 > 0


def _step_inputs(seed: int = 0):
    """logits [3, 5, 7] (float64, requiring grad), the target's distribution over a vocabulary of 10 of which the
    draft vocabulary holds the first 7, renormalised over it, its mass there, the argmax and the counted positions."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 7, dtype=torch.float64, generator=generator).requires_grad_()
    full = (2 * torch.randn(3, 5, 10, dtype=torch.float64, generator=generator)).softmax(-1)
    target, mass = full[..., :7] / full[..., :7].sum(-1, keepdim=True), full[..., :7].sum(-1)
    counted = torch.rand(3, 5, generator=generator) > 0.4
    return logits, full, target, mass, target.argmax(-1), counted


def test_the_kl_step_loss_value_and_gradient():
    from eagle3ops.modeling.draft import step_loss

    logits, _, target, mass, top, counted = _step_inputs()
    summed, correct, _ = step_loss(logits, target, mass, top, counted)
    expected = -(target * logits.log_softmax(-1)).sum(-1)[counted].sum()
    torch.testing.assert_close(summed, expected)
    assert int(correct) == int(((logits.argmax(-1) == top) & counted).sum())
    assert torch.autograd.gradcheck(lambda z: step_loss(z, target, mass, top, counted)[0], (logits,))


def _alpha_by_hand(logits, full, counted) -> list[float]:
    """alpha per counted position as an explicit sum over the whole vocabulary of 10: min(p(v), q(v)), where the
    drafter puts no probability on the 3 tokens outside its vocabulary."""
    q = logits.detach().softmax(-1)
    values = []
    for b, t in counted.nonzero().tolist():
        values.append(sum(min(float(full[b, t, v]), float(q[b, t, v]) if v < 7 else 0.0) for v in range(10)))
    return values


@pytest.mark.parametrize("kind", ["kl", "lk_alpha", "lk_lambda"])
def test_alpha_is_the_acceptance_probability_over_the_whole_vocabulary(kind):
    from eagle3ops.modeling.draft import step_loss

    logits, full, target, mass, top, counted = _step_inputs(1)
    _, _, alpha_sum = step_loss(logits, target, mass, top, counted, kind=kind)
    by_hand = _alpha_by_hand(logits, full, counted)
    assert float(alpha_sum) == pytest.approx(sum(by_hand), rel=1e-9)
    assert all(0 < a < 1 for a in by_hand)  # mass outside the draft vocabulary is never accepted
    assert not alpha_sum.requires_grad  # reported, not backpropagated: each loss says what it trains


def test_the_lk_losses_value_and_gradient():
    """lk_alpha sums -log alpha; lk_lambda mixes the KL and 1 - alpha with w = scale * exp(-decay * mean alpha), w
    taken as a constant. Values from the explicit sums; gradients checked numerically (gradcheck differentiates
    through min(p, q) where no q(v) equals p(v), so almost everywhere) and lk_lambda's against its two terms."""
    from eagle3ops.modeling.draft import step_loss

    logits, full, target, mass, top, counted = _step_inputs(2)
    by_hand = _alpha_by_hand(logits, full, counted)
    summed, _, _ = step_loss(logits, target, mass, top, counted, kind="lk_alpha")
    assert float(summed) == pytest.approx(-sum(math.log(a) for a in by_hand), rel=1e-9)
    assert torch.autograd.gradcheck(lambda z: step_loss(z, target, mass, top, counted, kind="lk_alpha")[0], (logits,))

    scale, decay = 0.9, 2.0
    summed, _, _ = step_loss(logits, target, mass, top, counted, kind="lk_lambda", kl_scale=scale, kl_decay=decay)
    kl = -(target * logits.log_softmax(-1)).sum(-1)[counted]
    w = scale * math.exp(-decay * sum(by_hand) / len(by_hand))
    expected = sum(w * float(k) + (1 - w) * (1 - a) for k, a in zip(kl, by_hand))
    assert float(summed) == pytest.approx(expected, rel=1e-9)
    (grad,) = torch.autograd.grad(summed, logits)
    kl_sum, _, _ = step_loss(logits, target, mass, top, counted)
    alpha = torch.minimum(logits.softmax(-1), target * mass[..., None]).sum(-1)
    (expected_grad,) = torch.autograd.grad(w * kl_sum + (1 - w) * ((1 - alpha) * counted).sum(), logits)
    torch.testing.assert_close(grad, expected_grad)


def test_the_lk_alpha_loss_raises_acceptance():
    """A few steps of gradient descent on -log alpha alone raise alpha towards the target's mass inside the draft
    vocabulary, its ceiling."""
    from eagle3ops.modeling.draft import step_loss

    logits, _, target, mass, top, counted = _step_inputs(3)
    logits = logits.detach().clone().requires_grad_()
    before = float(step_loss(logits, target, mass, top, counted)[2])
    optimizer = torch.optim.SGD([logits], lr=1.0)
    for _ in range(200):
        optimizer.zero_grad()
        step_loss(logits, target, mass, top, counted, kind="lk_alpha")[0].backward()
        optimizer.step()
    after = float(step_loss(logits, target, mass, top, counted)[2])
    ceiling = float((mass * counted).sum())
    assert before < after <= ceiling + 1e-9
    assert after > before + 0.8 * (ceiling - before)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on a CPU needs a C compiler")
@pytest.mark.heavy
def test_the_compiled_step_and_loss_give_the_eager_loss_and_gradients_and_compile_once():
    """What the training loop compiles on a GPU (the drafter's forward, one TTT step, and the step loss), compiled
    here by the CPU backend: the same TTT loss and gradients as eager, and a fixed number of graphs, two of the
    step (step 0, every later step) and one of the loss, whatever the batches' documents and the TTT depth."""
    import copy

    from torch._dynamo.utils import counters

    from eagle3ops.modeling.draft import step_loss

    eager = make_draft(heads=2, kv_heads=1)
    compiled = copy.deepcopy(eager)
    compiled.compile(dynamic=False)
    compiled_loss = torch.compile(step_loss, dynamic=False)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(4))
    graphs_before = counters["stats"]["unique_graphs"]
    for seed, rows in ((5, [[7, 5], [12]]), (6, [[3, 3, 3, 3], [2, 10]])):
        ids, aux, final, mask, positions, _ = packed_batch(rows, T=12, seed=seed)
        results = []
        for draft, loss in ((eager, step_loss), (compiled, compiled_loss)):
            params = [p for p in draft.parameters() if p.requires_grad]
            result = ttt_loss(draft, ids, aux, final, mask, positions, head, ttt_steps=5, decay=0.8, loss=loss)
            results.append((result, torch.autograd.grad(result.loss, params)))
        (plain, plain_grads), (fused, fused_grads) = results
        assert plain.losses == pytest.approx(fused.losses, rel=1e-5) and plain.accs == fused.accs
        for a, b in zip(plain_grads, fused_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs_before == 3


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on a CPU needs a C compiler")
@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["lk_alpha", "lk_lambda"])
def test_the_compiled_lk_losses_give_the_eager_values_and_gradients(kind):
    """The step loss as the training loop compiles it on a GPU (here the CPU backend), for each LK loss: the same
    summed loss, acceptance and gradient as eager (the KL's is checked with the drafter above)."""
    import functools

    from eagle3ops.modeling.draft import step_loss

    logits, _, target, mass, top, counted = _step_inputs(4)
    logits = logits.float().detach().requires_grad_()
    loss = functools.partial(step_loss, kind=kind, kl_scale=0.9, kl_decay=2.0)
    results = []
    for fn in (loss, torch.compile(loss, dynamic=False)):
        summed, correct, alpha = fn(logits, target.float(), mass.float(), top, counted)
        results.append((summed, correct, alpha, torch.autograd.grad(summed, logits)[0]))
    (summed, correct, alpha, grad), (fused_summed, fused_correct, fused_alpha, fused_grad) = results
    torch.testing.assert_close(fused_summed, summed)
    torch.testing.assert_close(fused_alpha, alpha)
    assert int(fused_correct) == int(correct)
    torch.testing.assert_close(fused_grad, grad)


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
