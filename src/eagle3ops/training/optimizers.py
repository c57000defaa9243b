"""The optimizers of drafter training (`train.optimizer`), each with the learning rate's linear warmup then cosine
decay, stepped as one.

    adamw   AdamW over every trainable weight.
    muon    torch.optim.Muon over the weight matrices (fc and the decoder layer's projections), AdamW over the rest
            (norms, lm_head), as speculators trains. Muon's rate is `train.muon_lr`, by default `train.lr`: its
            update is scaled per matrix to AdamW's size ("match_rms_adamw"), so the two share a scale (speculators
            defaults to 10 x its lr of 1e-4; on the embedded default 10 x lr trains worse, docs/training.md). Its
            momentum and Newton-Schulz steps are PyTorch's defaults (0.95, 5).

The state saved with a drafter and in a resume point holds each optimizer's and each schedule's state by name
({"adamw": ..., "muon": ...}), so a run resumes exactly and a warm start can continue the moments it was trained
with.
"""
from __future__ import annotations

import math

import torch

from eagle3ops.config import DrafterTrainConfig
from eagle3ops.errors import InputError


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def is_muon_weight(name: str, weight: torch.Tensor) -> bool:
    """A matrix Muon updates: 2-D, and not the head, whose rows are one token's each (speculators' rule)."""
    return weight.dim() == 2 and min(weight.shape) > 1 and not name.startswith("lm_head.")


class Optimizers:
    """Named optimizers over disjoint weights, each with its schedule: `step` steps them all, then the schedules."""

    def __init__(self, named_weights: list[tuple[str, torch.Tensor]], optim: DrafterTrainConfig, total_steps: int,
                 fused: bool):
        adamw = [weight for name, weight in named_weights
                 if optim.optimizer != "muon" or not is_muon_weight(name, weight)]
        self.parts: dict[str, torch.optim.Optimizer] = {
            "adamw": torch.optim.AdamW(adamw, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                                       fused=fused)}
        if optim.optimizer == "muon":
            matrices = [weight for name, weight in named_weights if is_muon_weight(name, weight)]
            lr = optim.muon_lr if optim.muon_lr is not None else optim.lr
            self.parts["muon"] = torch.optim.Muon(matrices, lr=lr, weight_decay=optim.weight_decay,
                                                  adjust_lr_fn="match_rms_adamw")
        self.schedules = {name: warmup_cosine(part, total_steps, optim.warmup_ratio)
                          for name, part in self.parts.items()}

    def step(self) -> None:
        for part in self.parts.values():
            part.step()
        for schedule in self.schedules.values():
            schedule.step()

    @property
    def lr(self) -> float:
        """AdamW's current rate: the schedule every part follows, times its base."""
        return self.schedules["adamw"].get_last_lr()[0]

    def state_dict(self) -> tuple[dict, dict]:
        """(the optimizers' states, the schedules' states), by name."""
        return ({name: part.state_dict() for name, part in self.parts.items()},
                {name: schedule.state_dict() for name, schedule in self.schedules.items()})

    def load_state_dict(self, optimizers: dict, schedules: dict) -> None:
        self._check_names(optimizers, "the resume point's")
        for name, part in self.parts.items():
            part.load_state_dict(optimizers[name])
            self.schedules[name].load_state_dict(schedules[name])

    def continue_moments(self, saved: dict) -> None:
        """Load another run's optimizer moments but keep this run's hyper-parameters (lr, betas, weight decay)."""
        self._check_names(saved, "the warm start's")
        for name, part in self.parts.items():
            _continue_moments(part, saved[name], name)

    def _check_names(self, saved: dict, whose: str) -> None:
        if not isinstance(saved, dict) or set(saved) != set(self.parts):
            held = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise InputError(f"{whose} optimizer state holds {held}, this run uses {sorted(self.parts)} "
                             f"(train.optimizer): train it with the same optimizer, or leave its moments")


def _continue_moments(optimizer: torch.optim.Optimizer, saved: dict, name: str) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_state = saved.get("state", {})
    mismatched = [f"parameter {i}: saved {tuple(tensor.shape)} vs {tuple(params[i].shape) if i < len(params) else '-'}"
                  for i, state in saved_state.items() for tensor in state.values()
                  if torch.is_tensor(tensor) and tensor.dim() and (i >= len(params) or tensor.shape != params[i].shape)]
    if len(params) != sum(len(g["params"]) for g in saved.get("param_groups", [])) or mismatched:
        raise InputError(f"the warm start's {name} state does not fit the drafter's parameters"
                         + (":\n  " + "\n  ".join(mismatched[:10]) if mismatched else ""))
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, own in zip(optimizer.param_groups, settings):  # own: this run's lr, its schedule's initial_lr, ...
        group.update(own)
