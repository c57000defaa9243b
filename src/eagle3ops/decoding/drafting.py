"""The drafter's side of one sequence: its cache, the positions still to feed it, and one round of drafting.

Alignment: draft position t holds (g_t, x_{t+1}), the target's fused feature at t and the token after it, and
predicts x_{t+2}. After a verification the features of the accepted path (from that same target forward) and the
tokens after them are `pending`: fed on the next round, they replace the speculative entries of the last one.

Each sequence drafts on its own: the draft layer's cached attention is causal over its whole cache with no
padding mask, so rows of different lengths cannot share one draft forward. Inside a sequence the beams of a tree
are rows of the draft cache (reordered after each step like beam search), so each beam sees only its own path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle3ops.decoding.sampling import draft_probs, sample
from eagle3ops.decoding.tree import Candidates, DraftTree
from eagle3ops.modeling.draft import Eagle3Draft, KVCache
from eagle3ops.spec_settings import SpecSettings


@dataclass
class DraftState:
    pending_ids: list[int]  # the token after each pending feature
    pending_features: torch.Tensor  # [1, n, H] fused target features
    first_pos: int  # position of the first pending feature
    cache: KVCache = field(default_factory=KVCache)

    def accept(self, ids: list[int], features: torch.Tensor, first_pos: int) -> None:
        self.pending_ids, self.pending_features, self.first_pos = ids, features, first_pos


def _select_beams(cache: KVCache, beams: torch.Tensor) -> None:
    """Reorder / repeat the rows of the draft cache: row b becomes old row beams[b]."""
    cache.keys, cache.values = cache.keys[beams], cache.values[beams]


@torch.no_grad()
def propose(draft: Eagle3Draft, state: DraftState, settings: SpecSettings,
            generator: torch.Generator) -> DraftTree:
    """One drafting round of k steps from the pending positions; the draft cache ends as it began plus them."""
    device = state.pending_features.device
    n = len(state.pending_ids)
    positions = torch.arange(state.first_pos, state.first_pos + n, device=device)[None]
    hidden, logits = draft.step(torch.tensor([state.pending_ids], device=device), state.pending_features,
                                positions, kv_cache=state.cache)
    committed = state.cache.length
    root_pos = state.first_pos + n - 1  # the last pending feature's position: depth-d drafts sit at root_pos + d
    if settings.rejection_sampling:
        tree = _sampled_chain(draft, state, settings, generator, hidden[:, -1:], logits[:, -1], root_pos)
    else:
        tree = _top_k_tree(draft, state, settings, hidden[:, -1:], logits[:, -1], root_pos)
    state.cache.crop(committed)
    _select_beams(state.cache, torch.zeros(1, dtype=torch.long, device=device))
    return tree


def _sampled_chain(draft, state, settings, generator, hidden, logits, root_pos) -> DraftTree:
    """k drafts, each sampled from q (the drafter at the target's temperature). hidden [1, 1, H], logits [1, Vd]."""
    tokens, qs = [], []
    for depth in range(1, settings.k + 1):
        q = draft_probs(logits[0], settings.temperature, draft.d2t, draft.cfg.vocab_size)  # [V]
        tokens.append(sample(q, generator))
        qs.append(q)
        if depth < settings.k:
            hidden, logits = draft.step(torch.tensor([[tokens[-1]]], device=q.device), hidden,
                                        torch.tensor([[root_pos + depth]], device=q.device), kv_cache=state.cache)
            logits = logits[:, -1]
    return DraftTree.chain(tokens, torch.stack(qs))  # a chain's tree_size is k


def _top_k_tree(draft, state, settings, hidden, logits, root_pos) -> DraftTree:
    """SGLang's beam expansion (see tree.py). hidden [beams, 1, H], logits [beams, Vd]; beams = 1 at first."""
    device, topk = hidden.device, settings.topk
    found = Candidates([], [], [])
    beam_scores = torch.ones(1, device=device)  # [beams]
    beam_ids = [-1]  # candidate index of each beam (-1 = the root)
    for depth in range(1, settings.k + 1):
        probs, order = logits.float().softmax(-1).sort(dim=-1, descending=True, stable=True)  # ties: lowest id
        child_p, child_ids = probs[:, :topk], order[:, :topk]  # [beams, topk], as the argmax for topk 1
        scores = beam_scores[:, None] * child_p  # [beams, topk]
        tokens = draft.to_target_ids(child_ids)  # [beams, topk]
        first = len(found.tokens)
        found.tokens += tokens.flatten().tolist()
        found.scores += scores.flatten().tolist()
        found.parents += [beam_ids[b] for b in range(len(beam_ids)) for _ in range(topk)]
        if depth == settings.k:
            break
        beam_scores, best = scores.flatten().sort(descending=True, stable=True)  # next beams: the best topk
        beam_scores, best = beam_scores[:topk], best[:topk]
        parent_beams = best // topk  # [topk]
        beam_ids = (first + best).tolist()
        _select_beams(state.cache, parent_beams)
        hidden, logits = draft.step(tokens.flatten()[best][:, None], hidden[parent_beams],
                                    torch.full((topk, 1), root_pos + depth, device=device), kv_cache=state.cache)
        logits = logits[:, -1]
    return found.best(settings.tree_size)
