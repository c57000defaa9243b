"""What one speculative-decoding run does: drafting shape and sampling, checked once (no torch import here, so
config.py can check params.yaml with the same rules before any stage starts).

Names and meanings follow the serving engines, so a measured tau transfers:
- k: draft steps per verification (SGLang --speculative-num-steps, vLLM num_speculative_tokens); the tree depth.
- topk: children expanded per draft node (SGLang --speculative-eagle-topk); 1 = a chain.
- num_draft_tokens: tokens per verification, the last emitted token (the root) included (SGLang
  --speculative-num-draft-tokens); the tree keeps the num_draft_tokens - 1 drafted nodes of highest cumulative
  draft probability. null = k + 1 for a chain, 1 + k * topk for a tree.
- temperature, top_p: the target's sampling; temperature 0 = greedy (top_p unused).
- draft_sample_method (vLLM's name): greedy = the drafter proposes its argmax / top-k (vLLM's default, and what
  SGLang always does), verified by sampling the target and following the tree while the sample is a drafted
  child; probabilistic = a chain whose drafts are sampled from the drafter at the same temperature, verified by
  rejection sampling (vLLM's draft_sample_method=probabilistic). Both emit exactly the target's distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from eagle3ops.errors import InputError

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


class DecodingError(InputError):
    """Speculative-decoding settings that cannot work; `key` names the setting."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class SpecSettings:
    k: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    draft_sample_method: str = "greedy"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise DecodingError("k", "must be at least 1")
        if self.topk < 1:
            raise DecodingError("topk", "must be at least 1")
        if self.temperature < 0:
            raise DecodingError("temperature", "must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise DecodingError("top_p", "must be in (0, 1]")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise DecodingError("draft_sample_method", f"{self.draft_sample_method!r} is not one of "
                                                       f"{DRAFT_SAMPLE_METHODS}")
        if self.draft_sample_method == "probabilistic" and self.topk > 1 and self.temperature > 0:
            raise DecodingError("draft_sample_method", "probabilistic drafting is a chain (topk 1): sampled drafts in "
                                "a tree need multi-draft rejection sampling, which is not implemented; use greedy "
                                "drafting for trees (SGLang's way, lossless at any temperature)")
        if self.num_draft_tokens is not None:
            most = 1 + self.topk + (self.k - 1) * self.topk ** 2  # every node the k draft steps produce
            if self.topk == 1 and self.num_draft_tokens != self.k + 1:
                raise DecodingError("num_draft_tokens", f"a chain (topk 1) verifies k + 1 = {self.k + 1} tokens, got "
                                                        f"{self.num_draft_tokens} (or leave it null)")
            if not 2 <= self.num_draft_tokens <= most:
                raise DecodingError("num_draft_tokens", f"must be in [2, {most}] for k {self.k} and topk {self.topk}: "
                                                        f"the root plus at most the {most - 1} drafted nodes")

    @property
    def tree_size(self) -> int:
        """Drafted nodes per verification (the root not counted)."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens - 1
        return self.k * self.topk

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def rejection_sampling(self) -> bool:
        """Sampled chain drafts verified by p/q rejection (otherwise: deterministic drafts, target-only sampling)."""
        return self.draft_sample_method == "probabilistic" and not self.greedy

    @classmethod
    def from_config(cls, config) -> SpecSettings:
        """From any object with these attribute names (config.EvalConfig)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


def sampled_temperature(primary: float, sampled: float | None) -> float | None:
    """eval.sampled_temperature where it asks for a second measurement: not null, not the primary temperature."""
    return None if sampled is None or sampled == primary else sampled


def sampled_settings(settings: SpecSettings, temperature: float | None) -> SpecSettings | None:
    """`settings` at eval.sampled_temperature (same k, topk, top_p, drafting); None where there is no second
    measurement (sampled_temperature). DecodingError (key sampled_temperature) where the settings cannot sample:
    a tree of probabilistic drafts."""
    temperature = sampled_temperature(settings.temperature, temperature)
    if temperature is None:
        return None
    try:
        return replace(settings, temperature=temperature)
    except DecodingError as err:
        raise DecodingError("sampled_temperature", f"at {temperature}: {err.key}: {err.reason} (or set "
                                                   f"eval.sampled_temperature: null to measure at eval.temperature "
                                                   f"alone)") from None
