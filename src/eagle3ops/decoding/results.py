"""The eval stage's results, typed: what it writes to metrics/eval-<drafter>.json and logs to its MLflow run, and
what the report, the export's champion and `compare` read back.

    EvalResult                      metrics/eval-<drafter>.json
      primary: Decoded              the top level: tau at eval.temperature (checked against the target, compared
                                    with vLLM, registered)
      sampled: Decoded              "sampled": the same prompts again at eval.sampled_temperature
      vllm: ServedOnVllm            "vllm": the drafter served on vLLM beside the project's decoder (eval.engine)
      target_alone, output_check    the hf backend's: the target decoding alone, its greedy output checked

Each measurement is an Acceptance: tau, the acceptance per draft position and per prompt set, and their counts.
decoding/evaluation.py builds them. The JSON layout is the DVC metrics' and the names to_mlflow gives are
the MLflow runs': `dvc metrics diff`, `dvc exp show` and recorded runs compare across versions only while they stay.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Self, TypeVar

from eagle3ops.errors import InputError


@dataclass(frozen=True, kw_only=True)
class Acceptance:
    """tau = 1 + accepted drafts / verification steps; a_i (per_position) = the share of steps whose i-th draft was
    accepted, None where an engine gave no counts per position; the counts; tau per prompt set; and, where each
    prompt's counts are known (the hf backend), tau's 95% bootstrap interval over the prompts."""
    tau: float
    per_position: tuple[float | None, ...]
    verify_steps: int
    accepted_tokens: int
    tau_by_set: Mapping[str, float]
    interval: tuple[float, float] | None = None

    def to_json(self) -> dict:
        interval = {"tau_ci_low": self.interval[0], "tau_ci_high": self.interval[1]} if self.interval else {}
        return {"tau": self.tau, **interval, **{f"accept_{i}": a for i, a in enumerate(self.per_position, 1)},
                "verify_steps": self.verify_steps, "accepted_tokens": self.accepted_tokens,
                "tau_by_set": dict(self.tau_by_set)}

    @classmethod
    def from_json(cls, block: Mapping) -> Self:
        return cls(**cls._arguments(block))

    @classmethod
    def _arguments(cls, block: Mapping) -> dict:
        """The constructor's arguments from a JSON block; a subclass adds its own fields'."""
        k = sum(key.startswith("accept_") for key in block)
        return {"tau": block["tau"], "per_position": tuple(block[f"accept_{i}"] for i in range(1, k + 1)),
                # MLflow holds every metric as a float
                "verify_steps": int(block["verify_steps"]), "accepted_tokens": int(block["accepted_tokens"]),
                "tau_by_set": block["tau_by_set"],
                "interval": (block["tau_ci_low"], block["tau_ci_high"]) if "tau_ci_low" in block else None}

    @staticmethod
    def from_mlflow(metrics: Mapping[str, float]) -> Acceptance | None:
        """An eval stage run's acceptance from the metrics EvalResult.to_mlflow logged; None where it logged no tau
        (the stage failed before it measured)."""
        if "tau" not in metrics:
            return None
        by_set = {key.removeprefix("tau/"): tau for key, tau in metrics.items() if key.startswith("tau/")}
        return Acceptance.from_json({**metrics, "tau_by_set": by_set})


@dataclass(frozen=True, kw_only=True)
class Decoded(Acceptance):
    """The drafter's acceptance decoding the prompts at one temperature, by the project's decoder or a server, with
    the tokens it emitted and their rate."""
    temperature: float
    emitted_tokens: int
    spec_tokens_per_s: float

    def to_json(self) -> dict:
        return {"temperature": self.temperature, **super().to_json(), "emitted_tokens": self.emitted_tokens,
                "spec_tokens_per_s": self.spec_tokens_per_s}

    @classmethod
    def _arguments(cls, block: Mapping) -> dict:
        # the temperature: 0 in files written before the eval recorded it
        return {**super()._arguments(block), "temperature": block.get("temperature", 0.0),
                "emitted_tokens": block["emitted_tokens"], "spec_tokens_per_s": block["spec_tokens_per_s"]}


@dataclass(frozen=True, kw_only=True)
class ServedOnVllm(Acceptance):
    """The drafter served on vLLM with the target as the export serves it, at eval.temperature: acceptance from
    vLLM's counters, the served speed with `concurrency` requests in flight on `hardware` (the report divides it by
    the target alone's, stage target_speed), whether the engine had to be started, and, greedy, the prompts whose
    output is token for token the target's."""
    version: str
    tokens_per_s: float
    concurrency: int
    hardware: str
    engine_starts: int | None = None  # None: in files from before engine sessions
    engine_start_s: float | None = None
    greedy_equal_prompts: int | None = None

    def to_json(self) -> dict:
        optional = {name: getattr(self, name) for name in ("engine_starts", "engine_start_s", "greedy_equal_prompts")
                    if getattr(self, name) is not None}
        return {"version": self.version, **super().to_json(), "tokens_per_s": self.tokens_per_s,
                "concurrency": self.concurrency, "hardware": self.hardware, **optional}

    @classmethod
    def _arguments(cls, block: Mapping) -> dict:
        return {**super()._arguments(block), "version": block["version"], "tokens_per_s": block["tokens_per_s"],
                "concurrency": block["concurrency"], "hardware": block["hardware"],
                "engine_starts": block.get("engine_starts"), "engine_start_s": block.get("engine_start_s"),
                "greedy_equal_prompts": block.get("greedy_equal_prompts")}


@dataclass(frozen=True)
class TargetAlone:
    """The hf backend decodes each prompt with the target alone too: the target's size (what `project` scales
    compute by), that decoding's speed, and the share of its tokens the draft vocabulary holds."""
    target_params: int
    target_bytes: int
    target_tokens_per_s: float
    draft_vocab_coverage: float


@dataclass(frozen=True)
class OutputCheck:
    """Greedy on the hf backend: the prompts whose output parts from the target's own, and of them those that part
    at a near-tie of its logits (rounding, not the drafter: decoding/evaluation.py, Parting)."""
    lossless: bool
    mismatched_prompts: int
    near_tie_prompts: int = 0  # absent in files from before near-ties were told apart

    @property
    def changed_prompts(self) -> int:
        """The prompts whose output parts from the target's beyond a near-tie."""
        return self.mismatched_prompts - self.near_tie_prompts


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """One drafter's eval, as the module's docstring lays it out."""
    primary: Decoded
    prompts_by_set: Mapping[str, int]
    sampled: Decoded | None = None
    vllm: ServedOnVllm | None = None
    target_alone: TargetAlone | None = None
    output_check: OutputCheck | None = None

    @property
    def prompts(self) -> int:
        return sum(self.prompts_by_set.values())

    def to_json(self) -> dict:
        blocks = {name: block.to_json() for name, block in (("sampled", self.sampled), ("vllm", self.vllm)) if block}
        return {**self.primary.to_json(), "prompts": self.prompts, "prompts_by_set": dict(self.prompts_by_set),
                **blocks, **(asdict(self.target_alone) if self.target_alone else {}),
                **(asdict(self.output_check) if self.output_check else {})}

    @classmethod
    def from_json(cls, file: Mapping) -> EvalResult:
        """A metrics/eval-<drafter>.json as read; its "time" is the stage's phases (tracking/metrics.py)."""
        return cls(primary=Decoded.from_json(file), prompts_by_set=file["prompts_by_set"],
                   sampled=Decoded.from_json(file["sampled"]) if "sampled" in file else None,
                   vllm=ServedOnVllm.from_json(file["vllm"]) if "vllm" in file else None,
                   target_alone=_extra(TargetAlone, file) if "target_params" in file else None,
                   output_check=_extra(OutputCheck, file) if "lossless" in file else None)

    @classmethod
    def read(cls, file: Mapping, where: str) -> EvalResult:
        """from_json with a damaged or foreign file named (`where`: its path and the stage that writes it) instead
        of a bare KeyError."""
        try:
            return cls.from_json(file)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise InputError(f"{where}: not an eval's results as this version writes them ({type(err).__name__}: "
                             f"{err}); edited by hand or written by another version: run the eval stage again") from None

    def to_mlflow(self) -> dict[str, float]:
        """The eval stage run's MLflow metrics: each number of the file under its key (a true/false as 1/0), tau per
        set as tau/<set>, and the blocks' numbers alike under sampled/ and vllm/."""
        file = self.to_json()
        metrics = _numbers(file)
        for block in ("sampled", "vllm"):
            if block in file:
                metrics.update(_numbers(file[block], f"{block}/"))
        return metrics


Extra = TypeVar("Extra", TargetAlone, OutputCheck)


def _extra(kind: type[Extra], file: Mapping) -> Extra:
    """A TargetAlone or OutputCheck from the top-level keys named as its fields (a field with a default may be
    absent)."""
    return kind(**{field.name: file[field.name] for field in fields(kind) if field.name in file})


def _numbers(block: Mapping, prefix: str = "") -> dict[str, float]:
    """A JSON block's numbers as MLflow metrics `prefix` + key, and its tau per set as `prefix` + tau/<set>."""
    return {**{prefix + key: float(value) for key, value in block.items() if isinstance(value, (int, float))},
            **{f"{prefix}tau/{name}": float(tau) for name, tau in block["tau_by_set"].items()}}
