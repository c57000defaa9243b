"""The eval stage's measurement on the hf backend: each prompt decoded speculatively and by the target alone, in
batches, with the same seed and sampling; acceptance overall, per prompt set and per prompt, losslessness
(greedy: the two outputs token for token, a parting at a near-tie of the target's own logits told apart) and the
speed of each. The measurement again at a sampling temperature (eval.sampled_temperature) decodes speculatively
only: one sampled run has no reference to be checked against. The results are results.py's types:

    measured = decode_and_compare(target, draft, tokenizer, prompts, settings, max_new_tokens, batch_size, seed, desc)
    primary = measured.decoded(settings.temperature, seed)
    again = decode_and_compare(..., sampled_settings(settings, 1.0), ..., reference=False)
    sampled = again.decoded(1.0, seed)
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from eagle3ops.data.chat import prompt_ids
from eagle3ops.decoding.engines import SetMeasurement
from eagle3ops.decoding.results import Acceptance, Decoded, OutputCheck, ServedOnVllm, TargetAlone
from eagle3ops.decoding.served import Served
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

    def tag(self) -> str:
        """prompt@token:gap/tolerance, "stops" for the gap where one output stops early."""
        gap = "stops" if self.gap is None else f"{self.gap:.3g}"
        return f"{self.prompt}@{self.position}:{gap}/{self.tolerance:.3g}"

    def explained(self) -> str:
        """The log's line: where the output parts, why, and whether that is a near-tie."""
        why = ("one output stops early" if self.gap is None else
               f"the target's logit gap {self.gap:.3g} is {'within' if self.near_tie else 'beyond'} its rounding, "
               f"{self.tolerance:.3g}")
        return (f"{self.prompt} parts from the target's own output at token {self.position}: {why}: "
                f"{'a near-tie' if self.near_tie else 'NOT lossless'}")


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

    def decoded(self, temperature: float, seed: int) -> Decoded:
        """The speculative decoding's results, with tau's interval over the prompts."""
        speed = tokens_per_s(self.spec_tokens, self.spec_s)
        return from_counts(Decoded, self.overall, self.per_set, self.per_prompt, seed, temperature=temperature,
                           emitted_tokens=self.spec_tokens, spec_tokens_per_s=speed)

    def target_alone(self, size: dict[str, int]) -> TargetAlone:
        """The target decoding alone (`size`: modeling.target.model_size)."""
        return TargetAlone(**size, target_tokens_per_s=tokens_per_s(self.plain_tokens, self.plain_s),
                           draft_vocab_coverage=round(self.in_draft_vocab / max(1, self.plain_tokens), 4))

    def output_check(self) -> OutputCheck:
        """Greedy: the outputs against the target's."""
        return OutputCheck(self.lossless, len(self.mismatched), len(self.near_ties))


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


Result = TypeVar("Result", bound=Acceptance)


def from_counts(kind: type[Result], overall: AcceptanceStats, per_set: Mapping[str, AcceptanceStats],
                per_prompt: list[AcceptanceStats] | None = None, seed: int = 0, **rest) -> Result:
    """A result of `kind` (results.py: Decoded, ServedOnVllm) from these counts, rounded as the metrics files
    keep them: tau, a_i and counts, overall and per prompt set; where each prompt's counts are known (the hf
    backend), tau's 95% bootstrap interval over the prompts; `rest`: the kind's other fields."""
    interval = None
    if per_prompt:
        low, high = tau_interval(per_prompt, seed=seed)
        interval = (round(low, 4), round(high, 4))
    return kind(tau=round(overall.tau, 4), per_position=tuple(round(a, 4) for a in overall.per_position),
                verify_steps=overall.steps, accepted_tokens=overall.accepted,
                tau_by_set={name: round(stats.tau, 4) for name, stats in per_set.items()}, interval=interval, **rest)


def tokens_per_s(tokens: int, seconds: float) -> float:
    return round(tokens / max(seconds, 1e-9), 1)


def decoded_on_engine(k: int, temperature: float, per_set: dict[str, SetMeasurement]) -> Decoded:
    """A measurement on a server (decoding/engines.py), a_i None where the engine gave no counts per position."""
    overall = AcceptanceStats.merged(k, [result.stats for result in per_set.values()])
    tokens = sum(result.completion_tokens for result in per_set.values())
    seconds = sum(result.seconds for result in per_set.values())
    decoded = from_counts(Decoded, overall, {name: result.stats for name, result in per_set.items()},
                          temperature=temperature, emitted_tokens=tokens,
                          spec_tokens_per_s=tokens_per_s(tokens, seconds))
    if not all(result.per_position for result in per_set.values()):
        decoded = replace(decoded, per_position=(None,) * k)
    return decoded


def served_on_vllm(served: Served, k: int, concurrency: int, hardware: str,
                   references: dict[str, list[int]] | None) -> ServedOnVllm:
    """What vLLM measured, in the decoder's terms; greedy (`references`: each prompt's output by the target alone),
    how many prompts' output is token for token the target's."""
    outputs = served.outputs()
    return from_counts(ServedOnVllm, served.overall(k), {name: m.stats for name, m in served.with_drafter.items()},
                       version=served.version, tokens_per_s=round(served.tokens_per_s(served.with_drafter), 1),
                       concurrency=concurrency, hardware=hardware, engine_starts=int(served.engine.started),
                       engine_start_s=round(served.engine.start_s, 1) if served.engine.started else 0.0,
                       greedy_equal_prompts=None if references is None else
                       sum(outputs.get(pid) == ids for pid, ids in references.items()))
