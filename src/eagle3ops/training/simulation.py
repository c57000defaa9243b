"""The acceptance simulator: while the drafter trains, its acceptance length measured every N steps by the
same speculative decoder the eval stage runs, on a few held-out prompts.

Training accuracy (acc_k) and served acceptance disagree: acc_k leaves out tokens outside the draft vocabulary
and scores each TTT step on the target's own context, while serving chains the drafter's guesses. tau is what
the engines count, so this is what to watch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from eagle3ops.decoding.speculative import AcceptanceStats, speculative_generate
from eagle3ops.modeling.draft import Eagle3Draft
from eagle3ops.spec_settings import SpecSettings


def held_out_prompts(samples: list[dict], count: int) -> list[list[int]]:
    """The first `count` prepared samples ({"input_ids", "loss_mask"}) cut before their first assistant token:
    the prompt the target answered, assistant header included."""
    prompts = []
    for sample in samples:
        mask = list(sample["loss_mask"])
        if 1 in mask and mask.index(1) > 0:
            prompts.append(list(sample["input_ids"][: mask.index(1)]))
        if len(prompts) == count:
            break
    return prompts


@dataclass
class AcceptanceSimulator:
    target: PreTrainedModel
    prompts: list[list[int]]
    settings: SpecSettings
    max_new_tokens: int
    eos_ids: set[int]
    seed: int = 0

    @torch.no_grad()
    def __call__(self, draft: Eagle3Draft) -> dict[str, float]:
        """tau and per-position acceptance of `draft` as it is now, as metrics `sim/...`."""
        training = draft.training
        draft.eval()
        try:
            generations = speculative_generate(self.target, draft, self.prompts, self.settings, self.max_new_tokens,
                                               self.eos_ids, self.seed)
        finally:
            draft.train(training)
        stats = AcceptanceStats.merged(self.settings.k, [g.stats for g in generations])
        return {"sim/tau": stats.tau, **{f"sim/accept_{i + 1}": a for i, a in enumerate(stats.per_position)}}
