"""Draft vocabulary: which target ids the drafter predicts, and the d2t / t2d buffers serving engines read."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from eagle3ops.data.vocab import build_vocab_map, count_masked_tokens, coverage, draft_to_target_ids
from eagle3ops.errors import InputError


def test_count_masked_tokens_counts_only_mask_one():
    samples = [
        ([5, 6, 7, 5, 9], [0, 1, 1, 1, 0]),
        ([9, 9, 6], [1, 1, 0]),
        ([1, 2], [0, 0]),
    ]
    assert count_masked_tokens(samples) == Counter({5: 1, 6: 1, 7: 1, 9: 2})
    assert count_masked_tokens([]) == Counter()


def test_most_frequent_ids_chosen_ties_by_lower_id_sorted():
    # 7 most frequent, then a three-way tie at 5 between ids 2, 40, 11: the lower ids (2, 11) win; 30 and 3 rarer.
    counts = Counter({7: 50, 40: 5, 11: 5, 2: 5, 30: 3, 3: 1})
    d2t, t2d = build_vocab_map(counts, target_vocab_size=64, draft_vocab_size=3)
    target_ids = draft_to_target_ids(d2t)
    assert target_ids.tolist() == [2, 7, 11]
    assert d2t.tolist() == [2 - 0, 7 - 1, 11 - 2]
    for draft_id in range(3):
        assert int(target_ids[draft_id]) == draft_id + int(d2t[draft_id])
    assert t2d.nonzero().flatten().tolist() == [2, 7, 11]


def test_buffers_dtypes_shapes_and_consistency():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (5000,), generator=generator).tolist()
    counts = Counter(ids)
    d2t, t2d = build_vocab_map(counts, target_vocab_size=512, draft_vocab_size=100)
    assert d2t.dtype == torch.int64 and d2t.shape == (100,)
    assert t2d.dtype == torch.bool and t2d.shape == (512,)
    target_ids = draft_to_target_ids(d2t)
    assert target_ids.tolist() == sorted(set(target_ids.tolist()))  # strictly increasing
    assert int(t2d.sum()) == 100
    assert t2d[target_ids].all()
    assert (d2t >= 0).all()  # sorted ascending ids: target_id >= draft_id
    # Chosen = the 100 best by (count desc, id asc), recomputed independently.
    best = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:100]
    assert target_ids.tolist() == sorted(token for token, _ in best)
    # Every chosen id is at least as frequent as every id left out.
    left_out = [counts[t] for t in counts if not t2d[t]]
    assert min(counts[t] for t in target_ids.tolist()) >= max(left_out)


def test_fill_up_with_lowest_unseen_ids():
    counts = Counter({10: 4, 3: 2, 0: 1})
    d2t, t2d = build_vocab_map(counts, target_vocab_size=20, draft_vocab_size=6)
    # Seen: 0, 3, 10; the three remaining slots take the lowest unseen ids 1, 2, 4.
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 3, 4, 10]
    assert d2t.tolist() == [0, 0, 0, 0, 0, 5]
    assert t2d.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 10]


def test_empty_counts_give_identity_prefix():
    d2t, t2d = build_vocab_map(Counter(), target_vocab_size=10, draft_vocab_size=4)
    assert d2t.tolist() == [0, 0, 0, 0]
    assert t2d.tolist() == [True] * 4 + [False] * 6


def test_full_vocab_is_identity():
    d2t, t2d = build_vocab_map(Counter({3: 1, 1: 9}), target_vocab_size=5, draft_vocab_size=5)
    assert d2t.tolist() == [0] * 5 and bool(t2d.all())


def test_draft_vocab_larger_than_target_is_input_error():
    with pytest.raises(InputError, match=r"draft_vocab_size 11 exceeds the target vocabulary \(10\)"):
        build_vocab_map(Counter({1: 1}), target_vocab_size=10, draft_vocab_size=11)


@pytest.mark.parametrize("bad_id", [10, 99, -1])
def test_out_of_range_ids_are_input_error(bad_id):
    with pytest.raises(InputError, match=r"outside the target vocabulary \(size 10\)"):
        build_vocab_map(Counter({1: 3, bad_id: 1}), target_vocab_size=10, draft_vocab_size=2)


def test_coverage_small_example():
    counts = Counter({1: 6, 2: 3, 5: 1})  # 10 masked tokens
    d2t, t2d = build_vocab_map(counts, target_vocab_size=8, draft_vocab_size=2)
    assert draft_to_target_ids(d2t).tolist() == [1, 2]
    assert coverage(counts, t2d) == pytest.approx(0.9)
    only_top = torch.zeros(8, dtype=torch.bool)
    only_top[1] = True
    assert coverage(counts, only_top) == pytest.approx(0.6)
    assert coverage(Counter(), t2d) == 0.0
