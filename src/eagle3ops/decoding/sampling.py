"""The sampling math of speculative decoding: the target's p, the drafter's q, rejection sampling.

Choices, as the engines make them (vLLM v1 rejection_sampler / eagle proposer, SGLang eagle verify):
- p is what plain sampling from the target would draw from: softmax(logits / T), then top-p (the smallest set of
  most likely tokens whose mass reaches top_p, renormalised). Top-p applies to p only: both engines filter the
  target's probabilities and leave the draft alone.
- q is softmax(draft_logits / T) over the draft vocabulary, placed on target ids through d2t, zero elsewhere.
  vLLM's probabilistic drafting also applies only the temperature to the draft. Rejection sampling emits exactly
  p for any q; a q that differs from p (draft mass outside p's nucleus, target tokens outside the draft
  vocabulary) only lowers acceptance, which is what the engines would measure too.
- Rejection (Leviathan et al. 2023, Chen et al. 2023): accept draft x ~ q with probability min(1, p(x) / q(x));
  on rejection draw from norm(max(0, p - q)); after k acceptances draw the bonus token from p.
All probabilities are float32; one torch.Generator per sequence keeps a row's draws independent of its batch.
"""
from __future__ import annotations

import torch


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] probabilities -> the nucleus renormalised: keep a token while the mass ranked before it is < top_p."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays (mass 0 before)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Target logits [..., V] -> p [..., V] (temperature > 0)."""
    return top_p_filter((logits.float() / temperature).softmax(-1), top_p)


def draft_probs(draft_logits: torch.Tensor, temperature: float, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits [..., Vd] -> q [..., V] on target ids (draft id i is target id i + d2t[i]), zero elsewhere."""
    probs = (draft_logits.float() / temperature).softmax(-1)
    q = probs.new_zeros(*probs.shape[:-1], vocab_size)
    target_ids = torch.arange(len(d2t), device=d2t.device) + d2t
    return q.index_copy_(-1, target_ids, probs)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probabilities [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     generator: torch.Generator) -> tuple[int, int]:
    """Verify a chain of sampled drafts. p [k+1, V]: the target's distribution before each draft and after the
    last; q [k, V]: the distribution each draft was drawn from. Returns (accepted drafts, the next token)."""
    for i, token in enumerate(drafts):
        coin = torch.rand((), generator=generator, device=p.device)
        if coin * q[i, token] < p[i, token]:  # coin < p / q without dividing; p >= q always accepts
            continue
        residual = (p[i] - q[i]).clamp(min=0.0)
        # A rejection implies p(x) < q(x) somewhere, hence residual mass elsewhere; the guard is for rounding only.
        return i, sample(residual if residual.sum() > 0 else p[i], generator)
    return len(drafts), sample(p[len(drafts)], generator)
