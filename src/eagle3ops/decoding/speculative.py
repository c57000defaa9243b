"""Speculative decoding with an EAGLE-3 drafter on a Hugging Face target: chain drafting, greedy verification.

Each step: the drafter proposes k tokens one after another, the target scores [last token, d_1..d_k] in one
cached forward, the longest prefix of drafts that equals the target's own greedy choice is accepted, and the
target's next token after it (the bonus) is emitted too. Counted as the serving engines count:
tau = 1 + accepted / steps (vLLM: 1 + num_accepted_tokens / num_drafts; SGLang: completion tokens / verify
steps), per-position acceptance a_i = share of steps whose i-th draft was accepted.

Draft alignment: the draft position t holds (g_t, x_{t+1}), the target's fused feature at t and the token
after it; its output predicts x_{t+2}. After a verification, the accepted positions' features (from that same
target forward) replace the draft's speculative cache entries.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from eagle3ops.modeling.draft import Eagle3Draft, KVCache
from eagle3ops.modeling.target import capture


@dataclass
class AcceptanceStats:
    k: int
    steps: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # steps whose i-th draft was accepted, i = 1..k

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.k

    def record(self, accepted: int) -> None:
        self.steps += 1
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.steps += other.steps
        self.accepted += other.accepted
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_at]


def _stop(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> list[int]:
    """Cut at the first end-of-sequence token (kept) or at max_new_tokens."""
    for index, token in enumerate(tokens[:max_new_tokens]):
        if token in eos_ids:
            return tokens[: index + 1]
    return tokens[:max_new_tokens]


def _cache_kwarg(target: PreTrainedModel) -> str:
    """transformers 5 renamed the forward's `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _forward(target: PreTrainedModel, token_ids: list[int], cache: DynamicCache) -> torch.Tensor:
    """Cached forward of new tokens [1, n] -> logits [n, V]."""
    ids = torch.tensor([token_ids], device=target.device)
    return target(input_ids=ids, use_cache=True, **{_cache_kwarg(target): cache}).logits[0]


def _truncate(cache: DynamicCache, length: int) -> None:
    """Drop cached positions from `length` on (a negative crop means the same in transformers 4 and 5)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@torch.no_grad()
def target_greedy(target: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The target's own greedy continuation, one cached token at a time: the reference for losslessness."""
    cache = DynamicCache()
    logits = _forward(target, prompt_ids, cache)
    out: list[int] = []
    while True:
        token = int(logits[-1].argmax())
        out.append(token)
        if token in eos_ids or len(out) >= max_new_tokens:
            return out
        logits = _forward(target, [token], cache)


@torch.no_grad()
def speculative_greedy(target: PreTrainedModel, draft: Eagle3Draft, prompt_ids: list[int], k: int,
                       max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], AcceptanceStats]:
    """Greedy chain speculative decoding of one prompt. Returns (new tokens, acceptance counts)."""
    device = target.device
    stats = AcceptanceStats(k)
    cache, draft_cache = DynamicCache(), KVCache()
    with capture(target, draft.cfg.aux_layers) as hooks:
        last = int(_forward(target, prompt_ids, cache)[-1].argmax())
        out = [last]
        # Pending draft positions: features of the tokens the target has processed, paired with the next token.
        pending_ids = prompt_ids[1:] + [last]
        pending_features = draft.fuse(hooks.aux().to(draft.fc.weight.dtype))
        first_pos = 0
        while last not in eos_ids and len(out) < max_new_tokens:
            n = len(pending_ids)
            positions = torch.arange(first_pos, first_pos + n, device=device)[None]
            hidden, draft_logits = draft.step(torch.tensor([pending_ids], device=device), pending_features,
                                              positions, kv_cache=draft_cache)
            committed = draft_cache.length
            drafts: list[int] = []
            position = first_pos + n - 1
            for i in range(k):
                token = int(draft.to_target_ids(draft_logits[0, -1].argmax()))
                drafts.append(token)
                if i + 1 < k:
                    position += 1
                    hidden, draft_logits = draft.step(torch.tensor([[token]], device=device), hidden[:, -1:],
                                                      torch.tensor([[position]], device=device), kv_cache=draft_cache)
            draft_cache.crop(committed)

            processed = cache.get_seq_length()
            verify = _forward(target, [last, *drafts], cache).argmax(-1).tolist()
            accepted = 0
            while accepted < k and drafts[accepted] == verify[accepted]:
                accepted += 1
            stats.record(accepted)
            new_tokens = drafts[:accepted] + [verify[accepted]]
            _truncate(cache, processed + accepted + 1)
            pending_features = draft.fuse(hooks.aux()[:, : accepted + 1].to(draft.fc.weight.dtype))
            pending_ids = new_tokens
            first_pos = processed
            out.extend(new_tokens)
            last = out[-1]
            if any(t in eos_ids for t in new_tokens):
                break
    return _stop(out, eos_ids, max_new_tokens), stats
