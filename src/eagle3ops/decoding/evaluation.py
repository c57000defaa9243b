"""The eval stage's measurement on the hf backend: each prompt decoded speculatively and by the target alone, in
batches, with the same seed and sampling; acceptance overall, per prompt set and per prompt, losslessness
(greedy: the two outputs token for token, a parting at a near-tie of the target's own logits told apart) and the
speed of each. The measurement again at a sampling temperature (eval.sampled_temperature) decodes speculatively
only: one sampled run has no reference to be checked against.

    measured = decode_and_compare(target, draft, tokenizer, prompts, settings, max_new_tokens, batch_size, seed, desc)
    fields = acceptance_fields(measured.overall, measured.per_set, prompts_by_set, measured.per_prompt, seed)
    again = decode_and_compare(..., sampled_settings(settings, 1.0), ..., reference=False)
    fields["sampled"] = sampled_fields(1.0, acceptance_fields(again.overall, again.per_set, {}, again.per_prompt, seed))
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from eagle3ops.data.chat import prompt_ids
from eagle3ops.decoding.speculative import AcceptanceStats, speculative_generate, target_generate, tau_interval
from eagle3ops.progress import progress
from eagle3ops.spec_settings import SpecSettings


@dataclass(frozen=True)
class Parting:
    """Where a greedy speculative output first parts from the target's own: the target's logits there, from one
    forward over the shared prefix, separate its own token from the speculative one by `gap`. Within `tolerance`
    (rounding of the target's dtype at the logits' scale) the two decodings' numerics decide, not the drafter:
    verifying k+1 tokens in one forward and decoding one at a time round differently, and either may pick either
    of two nearly tied tokens. Beyond it, the speculative decoding chose a token the target does not."""
    prompt: str
    position: int
    target_token: int
    spec_token: int
    gap: float | None
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return self.gap is not None and self.gap <= self.tolerance


@torch.no_grad()
def find_parting(target, prompt: str, ids: list[int], own: list[int], spec: list[int]) -> Parting:
    """The first token where `spec` parts from the target's own greedy output `own`, both continuing `ids`, and the
    target's logit gap there against 2 eps(dtype) max|logit|: bfloat16's eps 2^-7 at logits of about 20 allows a
    gap of 0.3, float32's a few 1e-6. Where one output is a prefix of the other (one stopped early), gap is None:
    not a near-tie."""
    position = next((i for i, (a, b) in enumerate(zip(own, spec)) if a != b), None)
    if position is None:
        return Parting(prompt, min(len(own), len(spec)), -1, -1, None, 0.0)
    logits = target(input_ids=torch.tensor([ids + own[:position]], device=target.device)).logits[0, -1].float()
    gap = abs(float(logits[own[position]] - logits[spec[position]]))
    tolerance = 2 * torch.finfo(target.dtype).eps * float(logits.abs().max())
    return Parting(prompt, position, own[position], spec[position], gap, tolerance)


@dataclass
class Compared:
    overall: AcceptanceStats
    per_set: dict[str, AcceptanceStats]
    per_prompt: list[AcceptanceStats] = field(default_factory=list)
    target_outputs: dict[str, list[int]] = field(default_factory=dict)  # prompt id -> the target's own tokens
    mismatched: list[str] = field(default_factory=list)  # greedy: prompts whose output is not the target's
    partings: list[Parting] = field(default_factory=list)  # greedy: where each of them first parts, and why
    spec_s: float = 0.0
    plain_s: float = 0.0
    spec_tokens: int = 0
    plain_tokens: int = 0
    in_draft_vocab: int = 0  # the target's tokens the draft vocabulary holds

    @property
    def near_ties(self) -> list[Parting]:
        return [parting for parting in self.partings if parting.near_tie]

    @property
    def lossless(self) -> bool:
        """Greedy: every prompt's output is the target's, but where the two part at a near-tie of its logits."""
        return all(parting.near_tie for parting in self.partings)

    @property
    def draft_vocab_coverage(self) -> float:
        return self.in_draft_vocab / max(1, self.plain_tokens)


def decode_and_compare(target, draft, tokenizer, prompts: list[dict], settings: SpecSettings, max_new_tokens: int,
                       batch_size: int, seed: int, desc: str, reference: bool = True) -> Compared:
    """Prompt i (of `prompts`, each {id, set, messages}) samples with seed + i, whatever the batch size.
    reference=False: the speculative decoding alone, without the target-alone run; so no losslessness check, no
    vocabulary coverage and no plain speed (target_outputs, mismatched, plain_* stay empty)."""
    eos = {tokenizer.eos_token_id}
    compared = Compared(AcceptanceStats(settings.k), defaultdict(lambda: AcceptanceStats(settings.k)))
    with progress(len(prompts), desc, "prompt") as bar:
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first : first + batch_size]
            ids = [prompt_ids(tokenizer, prompt["messages"]) for prompt in chunk]
            start = time.perf_counter()
            generations = speculative_generate(target, draft, ids, settings, max_new_tokens, eos, seed + first)
            compared.spec_s += time.perf_counter() - start
            references = [None] * len(chunk)
            if reference:
                start = time.perf_counter()  # the baseline: the target alone, same batch and sampling
                references = target_generate(target, ids, max_new_tokens, eos, settings.temperature, settings.top_p,
                                             seed + first)
                compared.plain_s += time.perf_counter() - start
            for prompt, prompt_tokens, generation, own in zip(chunk, ids, generations, references):
                compared.spec_tokens += len(generation.tokens)
                if own is not None:
                    compared.target_outputs[prompt["id"]] = own
                    compared.plain_tokens += len(own)
                    compared.in_draft_vocab += int(draft.t2d[torch.tensor(own)].sum())
                    if settings.greedy and generation.tokens != own:  # sampled runs differ by design
                        compared.mismatched.append(prompt["id"])
                        compared.partings.append(find_parting(target, prompt["id"], prompt_tokens, own,
                                                              generation.tokens))
                compared.overall.merge(generation.stats)
                compared.per_set[prompt["set"]].merge(generation.stats)
                compared.per_prompt.append(generation.stats)
            bar.update(len(chunk))
    return compared


def acceptance_fields(overall: AcceptanceStats, per_set: dict[str, AcceptanceStats], prompts_by_set: dict[str, int],
                      per_prompt: list[AcceptanceStats] | None = None, seed: int = 0) -> dict:
    """tau, per-position acceptance and counts, overall and per prompt set: what every backend reports; and, where
    each prompt's counts are known (the hf backend), tau's 95% bootstrap interval over the prompts."""
    interval = {}
    if per_prompt:
        low, high = tau_interval(per_prompt, seed=seed)
        interval = {"tau_ci_low": round(low, 4), "tau_ci_high": round(high, 4)}
    return {"tau": round(overall.tau, 4), **interval,
            **{f"accept_{i + 1}": round(a, 4) for i, a in enumerate(overall.per_position)},
            "verify_steps": overall.steps, "accepted_tokens": overall.accepted,
            "tau_by_set": {name: round(stats.tau, 4) for name, stats in per_set.items()},
            "prompts_by_set": prompts_by_set}


def sampled_fields(temperature: float, fields: dict) -> dict:
    """The metrics block of the measurement at eval.sampled_temperature: its temperature, then its acceptance_fields
    (tau, its interval where each prompt's counts are known, a_i, counts, tau per set) without prompts_by_set,
    the primary measurement's."""
    return {"temperature": temperature, **{key: value for key, value in fields.items() if key != "prompts_by_set"}}


def engine_fields(k: int, measured: dict, prompts_by_set: dict[str, int]) -> dict:
    """acceptance_fields of a measurement on a server (decoding/engines.py, {set: SetMeasurement}); a_i None where
    the engine gave no counts per position; its emitted tokens and their rate."""
    overall = AcceptanceStats.merged(k, [result.stats for result in measured.values()])
    fields = acceptance_fields(overall, {name: result.stats for name, result in measured.items()}, prompts_by_set)
    if not all(result.per_position for result in measured.values()):
        fields.update({f"accept_{i}": None for i in range(1, k + 1)})
    tokens = sum(result.completion_tokens for result in measured.values())
    seconds = sum(result.seconds for result in measured.values())
    return {**fields, "emitted_tokens": tokens, "spec_tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}
