"""Speculative decoding with an EAGLE-3 drafter on a Hugging Face target: chains and trees, greedy and sampled,
any batch size.

Each step, per sequence: the drafter proposes a chain or a tree (drafting.py, tree.py); the target scores
[last emitted token, drafted nodes] of every sequence in ONE cached forward with a tree attention mask
(batching.py); the longest path the target agrees with is accepted and the target's next token after it (the
correction, or the bonus at a leaf) is emitted too (sampling.py for T > 0). Greedy output equals the target's
greedy output token for token; sampled output follows the target's distribution exactly.

Counted as the serving engines count, per sequence and merged: tau = 1 + accepted / steps (vLLM:
1 + num_accepted_tokens / num_drafts; SGLang: completion tokens / verify steps), per-position acceptance a_i =
share of steps whose path reached depth i (for a chain: whose i-th draft was accepted). The token sampled from
the prefill is not a verification step, as in both engines.

Public API:
    speculative_generate(target, draft, prompts, settings, max_new_tokens, eos_ids, seed=0) -> list[Generation]
    target_generate(target, prompts, max_new_tokens, eos_ids, temperature=0.0, top_p=1.0, seed=0) -> list[list[int]]
    target_greedy(target, prompt_ids, max_new_tokens, eos_ids) -> list[int]      (the unbatched greedy reference)
    speculative_greedy(target, draft, prompt_ids, k, max_new_tokens, eos_ids) -> (tokens, AcceptanceStats)
    SpecSettings (settings.py), AcceptanceStats, tau_interval(per_prompt stats) -> (low, high)
Row i of a batch samples with its own generator seeded seed + i, so a row's output does not depend on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from eagle3ops.decoding.batching import TargetBatch, cache_kwarg
from eagle3ops.decoding.drafting import DraftState, propose
from eagle3ops.decoding.sampling import rejection_sample, sample, target_probs
from eagle3ops.decoding.tree import DraftTree
from eagle3ops.modeling.draft import Eagle3Draft
from eagle3ops.modeling.target import capture
from eagle3ops.spec_settings import DecodingError, SpecSettings


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

    @classmethod
    def merged(cls, k: int, stats: list[AcceptanceStats]) -> AcceptanceStats:
        total = cls(k)
        for one in stats:
            total.merge(one)
        return total

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_at]


def tau_interval(per_prompt: list[AcceptanceStats], confidence: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of tau over prompts: the prompts drawn again with replacement, tau of each
    draw pooled as the engines pool it (1 + accepted / steps over the drawn prompts). Prompts, not steps, are the
    unit: a prompt's steps are not independent of each other. Deterministic for a seed."""
    steps = torch.tensor([float(one.steps) for one in per_prompt], dtype=torch.float64)
    accepted = torch.tensor([float(one.accepted) for one in per_prompt], dtype=torch.float64)
    if len(per_prompt) < 2 or not steps.sum():
        tau = AcceptanceStats.merged(0, per_prompt).tau
        return tau, tau
    draws = torch.randint(len(per_prompt), (resamples, len(per_prompt)),
                          generator=torch.Generator().manual_seed(seed))  # [resamples, prompts]
    taus = 1.0 + accepted[draws].sum(-1) / steps[draws].sum(-1).clamp(min=1)
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(taus, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return low, high


@dataclass
class Generation:
    tokens: list[int]  # new tokens, cut after the first end-of-sequence token or at max_new_tokens
    stats: AcceptanceStats


def _stop(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> list[int]:
    """Cut at the first end-of-sequence token (kept) or at max_new_tokens."""
    for index, token in enumerate(tokens[:max_new_tokens]):
        if token in eos_ids:
            return tokens[: index + 1]
    return tokens[:max_new_tokens]


def _finished(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> bool:
    return len(tokens) >= max_new_tokens or any(t in eos_ids for t in tokens)


def _check(prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts or any(not p for p in prompts):
        raise DecodingError("prompts", "need at least one prompt, each of at least one token")
    if max_new_tokens < 1:
        raise DecodingError("max_new_tokens", "must be at least 1")


def _choose(logits: torch.Tensor, settings: SpecSettings, generator: torch.Generator) -> int:
    """The target's next token from logits [V]: argmax at T = 0, else a sample of p."""
    if settings.greedy:
        return int(logits.argmax())
    return sample(target_probs(logits, settings.temperature, settings.top_p), generator)


def _verify(tree: DraftTree, logits: torch.Tensor, settings: SpecSettings,
            generator: torch.Generator) -> tuple[list[int], int]:
    """logits [N+1, V] of [root, nodes] -> (accepted path of block indices from the root, next token)."""
    if settings.rejection_sampling:
        p = target_probs(logits, settings.temperature, settings.top_p)  # [k+1, V]
        accepted, token = rejection_sample(p, tree.q, tree.tokens, generator)
        return list(range(accepted + 1)), token
    return tree.walk(lambda block: _choose(logits[block], settings, generator))


def _generators(device: torch.device, seed: int, count: int) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(seed + row) for row in range(count)]


@torch.no_grad()
def speculative_generate(target: PreTrainedModel, draft: Eagle3Draft, prompts: list[list[int]],
                         settings: SpecSettings, max_new_tokens: int, eos_ids: set[int],
                         seed: int = 0) -> list[Generation]:
    """Speculative decoding of a batch of prompts (token ids). Returns one Generation per prompt, in order."""
    _check(prompts, max_new_tokens)
    if settings.topk > draft.cfg.draft_vocab_size:
        raise DecodingError("topk", f"{settings.topk} exceeds the drafter's vocabulary ({draft.cfg.draft_vocab_size})")
    generators = _generators(target.device, seed, len(prompts))
    results = [Generation([], AcceptanceStats(settings.k)) for _ in prompts]
    batch = TargetBatch(target, len(prompts))
    states: list[DraftState] = []
    dtype = draft.fc.weight.dtype
    with capture(target, draft.cfg.aux_layers) as hooks:
        last = batch.prefill(prompts)  # [B, V]
        aux = hooks.aux()  # [B, P, 3Ht], prompts right-aligned
        for row, prompt in enumerate(prompts):
            results[row].tokens.append(_choose(last[row], settings, generators[row]))
            features = draft.fuse(aux[row : row + 1, aux.shape[1] - len(prompt):].to(dtype))  # [1, len, H]
            states.append(DraftState(prompt[1:] + results[row].tokens, features, first_pos=0))
        live = list(range(len(prompts)))  # the prompt each batch row decodes
        outputs = [result.tokens for result in results]
        while live := _drop_finished(batch, live, outputs, eos_ids, max_new_tokens):
            trees = [propose(draft, states[i], settings, generators[i]) for i in live]
            ids = torch.tensor([[results[i].tokens[-1], *tree.tokens] for i, tree in zip(live, trees)],
                               device=target.device)  # [b, N+1]
            depths = torch.tensor([tree.depths() for tree in trees], device=target.device)  # [b, N+1]
            masks = torch.stack([tree.ancestor_mask() for tree in trees]).to(target.device)  # [b, N+1, N+1]
            logits = batch.forward(ids, depths, masks)  # [b, N+1, V]
            aux = hooks.aux()  # [b, N+1, 3Ht]
            keep = torch.zeros(ids.shape, dtype=torch.bool, device=target.device)
            for row, (i, tree) in enumerate(zip(live, trees)):
                path, token = _verify(tree, logits[row], settings, generators[i])
                new_tokens = [tree.tokens[block - 1] for block in path[1:]] + [token]
                keep[row, path] = True
                results[i].stats.record(len(path) - 1)
                results[i].tokens.extend(new_tokens)
                states[i].accept(new_tokens, draft.fuse(aux[row : row + 1, path].to(dtype)),
                                 first_pos=int(batch.lengths[row]))  # the root's position
            batch.commit(keep)
    for result in results:
        result.tokens = _stop(result.tokens, eos_ids, max_new_tokens)
    return results


def _drop_finished(batch: TargetBatch, live: list[int], outputs: list[list[int]], eos_ids: set[int],
                   max_new_tokens: int) -> list[int]:
    """Rows whose sequence is done leave the batch; returns the prompts still decoding."""
    rows = [row for row, i in enumerate(live) if not _finished(outputs[i], eos_ids, max_new_tokens)]
    if len(rows) < len(live):
        batch.select_rows(torch.tensor(rows, dtype=torch.long, device=batch.valid.device))
    return [live[row] for row in rows]


@torch.no_grad()
def target_generate(target: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
    """The target alone, batched, one token per forward: the baseline speculative decoding is timed against.
    Row i samples with the generator seeded seed + i, as in speculative_generate."""
    _check(prompts, max_new_tokens)
    settings = SpecSettings(temperature=temperature, top_p=top_p)
    generators = _generators(target.device, seed, len(prompts))
    outputs: list[list[int]] = [[] for _ in prompts]
    batch = TargetBatch(target, len(prompts))
    logits = batch.prefill(prompts)  # [B, V]
    live = list(range(len(prompts)))
    while True:
        for row, i in enumerate(live):
            outputs[i].append(_choose(logits[row], settings, generators[i]))
        if not (live := _drop_finished(batch, live, outputs, eos_ids, max_new_tokens)):
            break
        b = len(live)
        ids = torch.tensor([[outputs[i][-1]] for i in live], device=target.device)  # [b, 1]
        ones = torch.ones(b, 1, 1, dtype=torch.bool, device=target.device)
        logits = batch.forward(ids, torch.zeros(b, 1, dtype=torch.long, device=target.device), ones)[:, -1]
        batch.commit(ones[:, 0])
    return [_stop(tokens, eos_ids, max_new_tokens) for tokens in outputs]


@torch.no_grad()
def target_greedy(target: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The target's own greedy continuation of one prompt, one cached token at a time, no masks or positions
    given: the independent reference for losslessness."""
    cache = DynamicCache()

    def forward(token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], device=target.device)
        return target(input_ids=ids, use_cache=True, **{cache_kwarg(target): cache}).logits[0]

    logits = forward(prompt_ids)
    out: list[int] = []
    while True:
        token = int(logits[-1].argmax())
        out.append(token)
        if token in eos_ids or len(out) >= max_new_tokens:
            return out
        logits = forward([token])


def speculative_greedy(target: PreTrainedModel, draft: Eagle3Draft, prompt_ids: list[int], k: int,
                       max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], AcceptanceStats]:
    """Greedy chain speculative decoding of one prompt (k drafts per step). Returns (new tokens, counts)."""
    [result] = speculative_generate(target, draft, [prompt_ids], SpecSettings(k=k), max_new_tokens, eos_ids)
    return result.tokens, result.stats
