"""Draft vocabulary: the drafter predicts over the most frequent target tokens only.

d2t (int64, [draft_vocab]): target_id = draft_id + d2t[draft_id]   (the offsets SpecForge/SGLang/vLLM read)
t2d (bool,  [target_vocab]): t2d[target_id] is True when the token is in the draft vocabulary
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3ops.errors import InputError

VOCAB_MAP = "vocab_map.safetensors"  # the file of the prepared data's draft vocabulary, beside its splits


def write_vocab_map(directory: str | Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    save_file({"d2t": d2t, "t2d": t2d}, str(Path(directory) / VOCAB_MAP))


def read_vocab_map(directory: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the prepared data in `directory`."""
    tensors = load_file(str(Path(directory) / VOCAB_MAP))
    return tensors["d2t"], tensors["t2d"]


def count_masked_tokens(samples: Iterable[tuple[list[int], list[int]]]) -> Counter:
    """Frequencies of target token ids the drafter is trained to predict (loss_mask == 1)."""
    counts: Counter = Counter()
    for ids, mask in samples:
        counts.update(token for token, keep in zip(ids, mask) if keep)
    return counts


def build_vocab_map(counts: Counter, target_vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the `draft_vocab_size` most frequent ids (ties: lower id first), sorted ascending.

    When the data has fewer distinct tokens than the draft vocabulary, the remaining slots take the lowest
    unseen ids, so the head always has exactly `draft_vocab_size` rows (the shape serving engines expect).
    """
    if draft_vocab_size > target_vocab_size:
        raise InputError(f"data.draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({target_vocab_size})")
    outside = sorted(token for token in counts if not 0 <= token < target_vocab_size)
    if outside:
        raise InputError(f"token ids {outside[:10]} are outside the target vocabulary (size {target_vocab_size})")
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:draft_vocab_size]
    chosen = set(ranked)
    filler = (token for token in range(target_vocab_size) if token not in chosen)
    while len(ranked) < draft_vocab_size:
        ranked.append(next(filler))
    draft_to_target = torch.tensor(sorted(ranked), dtype=torch.int64)
    d2t = draft_to_target - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[draft_vocab] target id of every draft id."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def coverage(counts: Counter, t2d: torch.Tensor) -> float:
    """Share of loss-masked tokens the draft vocabulary can express."""
    total = sum(counts.values())
    return sum(n for token, n in counts.items() if t2d[token]) / total if total else 0.0
