"""A drafter measured on vLLM servers the eval stage starts itself, beside the project's own decoder.

The drafter is exported to the speculators layout first (vLLM's layer-id convention; the same export the
export stage writes), then served with the target exactly as users serve it: acceptance from vLLM's own
counters, each prompt's generated ids, and tokens/s. The server is the run's engine session
(serving/session.py): found where an earlier stage left one of this target and drafter shape, the drafter's
weights swapped in; started otherwise. The target alone answers the same requests in the stage target_speed
(`measure_target_alone`): what the drafters' speed on this hardware is divided by; its engine is the session the
generate stage's vLLM backend uses, where it ran.

Agreement. In greedy decoding both sides verify with the same target, so each prompt's output is the target's
greedy output and the drafts accepted are the same, up to float rounding between the two implementations: in
float32 a rounding difference (about 1e-6 of a logit) changes a choice only at a near-tie, which moves tau by a
step in a few thousand; on the zoo none of the 40 prompts differs. A drafter the engine reads differently from
the decoder moves it by far more: its d2t rotated by one takes the zoo's scratch drafter from 3.59 to 1.00.
`eval.engine_tolerance` (default 0.02 on tau and on each a_i) sits between the two; in bf16 the gap between two
implementations is wider, and the tolerance with it.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3ops.config import VllmConfig
from eagle3ops.decoding.engines import (
    EngineError,
    SetMeasurement,
    complete,
    measure,
    measure_plain,
    served_model,
    settled_counters,
)
from eagle3ops.decoding.speculative import AcceptanceStats
from eagle3ops.errors import InputError
from eagle3ops.formats.checkpoint import read_json
from eagle3ops.formats.export import export_drafter
from eagle3ops.formats.validate import verifier_path
from eagle3ops.fs import WORK_DIR
from eagle3ops.modeling.target import text_config
from eagle3ops.serving.session import Engine, EngineSpec, engine
from eagle3ops.serving.vllm import cpu_head_size_problems, installed_version, vllm_server


class EngineDisagreement(EngineError):
    """vLLM's acceptance differs from the project's decoder's beyond the tolerance: a format or convention bug."""


@dataclass
class Served:
    with_drafter: dict[str, SetMeasurement]
    version: str
    engine: Engine  # the engine it was measured on, found or started

    def overall(self, k: int) -> AcceptanceStats:
        return AcceptanceStats.merged(k, [m.stats for m in self.with_drafter.values()])

    @staticmethod
    def tokens_per_s(measured: dict[str, SetMeasurement]) -> float:
        seconds = sum(m.seconds for m in measured.values())
        return sum(m.completion_tokens for m in measured.values()) / max(seconds, 1e-9)

    def outputs(self) -> dict[str, list[int]]:
        return {pid: ids for m in self.with_drafter.values() for pid, ids in m.outputs.items()}


def check_servable(target_dir: str | Path, drafter_head_dim: int) -> None:
    """Before anything runs: InputError when vLLM cannot serve the target with the drafter on this machine."""
    problems = cpu_head_size_problems(text_config(target_dir), drafter_head_dim)
    if problems:
        raise InputError(f"eval.engine vllm: {'; '.join(problems)}; or set eval.engine: null to measure with the "
                         f"project's decoder alone")


def measure_target_alone(target_dir: str | Path, dtype: str, settings: VllmConfig, sets: dict[str, list[dict]],
                         encode: Callable[[list[dict]], list[int]], max_new_tokens: int, temperature: float,
                         concurrency: int, seed: int, chat_template: str | None) -> tuple[dict[str, SetMeasurement],
                                                                                          Engine]:
    """The target served without a drafter (rendering chats with `chat_template`, as generation's engine does, so
    that the two share it), the same requests as the drafters' evals send; and the engine it ran on."""
    with engine(EngineSpec(str(target_dir), dtype, seed, chat_template=chat_template), settings,
                "target_speed") as served:
        return measure_plain(served.url, sets, max_new_tokens, temperature, concurrency, "target alone on vLLM",
                             encode), served


def measure_on_vllm(target_dir: str | Path, drafter_dir: str | Path, dtype: str, settings: VllmConfig,
                    sets: dict[str, list[dict]], encode: Callable[[list[dict]], list[int]], k: int,
                    max_new_tokens: int, temperature: float, concurrency: int, seed: int, name: str) -> Served:
    """`drafter_dir` served with the target on vLLM, its weights swapped into the run's engine session."""
    WORK_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"vllm-{name}-", dir=WORK_DIR) as work:
        export = Path(work) / "speculators"
        export_drafter(drafter_dir, export, "speculators", target_dir, speculative_tokens=k)
        with engine(EngineSpec(str(target_dir), dtype, seed, drafter=str(export), k=k), settings,
                    f"eval@{name}") as served:
            served.use_drafter(export)
            with_drafter = measure("vllm", served.url, sets, k, max_new_tokens, temperature, concurrency,
                                   f"eval@{name} on vLLM", encode)
    return Served(with_drafter, installed_version(), served)


def side_by_side(decoder: AcceptanceStats, engine: AcceptanceStats, decoder_sets: dict[str, AcceptanceStats],
                 engine_sets: dict[str, AcceptanceStats]) -> list[tuple[str, float, float]]:
    """(figure, decoder, vLLM) for tau, each a_i, and tau per set."""
    rows = [("tau", decoder.tau, engine.tau)]
    rows += [(f"a{i + 1}", d, e) for i, (d, e) in enumerate(zip(decoder.per_position, engine.per_position))]
    rows += [(f"tau {name}", stats.tau, engine_sets[name].tau) for name, stats in decoder_sets.items()]
    return rows


def check_agreement(rows: list[tuple[str, float, float]], tolerance: float, drafter: str) -> None:
    """EngineDisagreement, with every figure side by side, when tau or an a_i differs by more than `tolerance`."""
    overall = [row for row in rows if not row[0].startswith("tau ")]
    if all(abs(engine - decoder) <= tolerance for _, decoder, engine in overall):
        return
    table = "\n".join(f"  {name:<16} {decoder:>8.4f} {engine:>8.4f} {engine - decoder:>+9.4f}"
                      for name, decoder, engine in rows)
    raise EngineDisagreement(
        f"vLLM's acceptance of the {drafter} drafter differs from the project's decoder's by more than "
        f"eval.engine_tolerance = {tolerance} in greedy decoding, where both verify with the same target: the "
        f"drafter is read differently by the engine (layer ids, d2t, norms, rope) or the decoder counts "
        f"differently\n  {'figure':<16} {'decoder':>8} {'vLLM':>8} {'vLLM-dec':>9}\n{table}")


SMOKE_PROMPTS = ("The capital of France is", "def add(a, b):", "1, 2, 3, 4,")


def serve_export(export_dir: str | Path, dtype: str, settings: VllmConfig, log_name: str = "export",
                 max_new_tokens: int = 32) -> dict:
    """Serve a speculators export as SERVING.md's second command does (`--model EXPORT`: vLLM reads the target
    from its verifier), from another directory (from this one where the verifier's path is relative, as the
    command changes to it), send a few prompts, and check that vLLM drafted with it. Returns its counters;
    EngineError when it drafted nothing."""
    export_dir = Path(export_dir).resolve()
    relative = not verifier_path(read_json(export_dir / "config.json")).is_absolute()
    with tempfile.TemporaryDirectory() as elsewhere, \
            vllm_server(export_dir, dtype, settings, log_name, cwd=Path.cwd() if relative else elsewhere) as url:
        return _drafts_on(url, export_dir, max_new_tokens)


def drafts_in_session(export_dir: str | Path, target_dir: str | Path, dtype: str, seed: int, settings: VllmConfig,
                      max_new_tokens: int = 32) -> dict:
    """The export stage's check: the speculators export's weights in the run's engine session of this target and
    drafter shape (the one eval measured on, found, or started with this export), a few prompts, and vLLM's
    counters must show drafts. Returns the counters of those prompts; EngineError when it drafted nothing."""
    k = read_json(Path(export_dir) / "config.json")["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    with engine(EngineSpec(str(target_dir), dtype, seed, drafter=str(export_dir), k=k), settings, "export") as served:
        served.use_drafter(export_dir)
        return {**_drafts_on(served.url, export_dir, max_new_tokens), "engine_started": int(served.started),
                "engine_start_s": round(served.start_s, 1) if served.started else 0.0}


def _drafts_on(url: str, export_dir: str | Path, max_new_tokens: int) -> dict:
    """SMOKE_PROMPTS on the server at `url`, greedy; what its spec-decode counters moved by."""
    model, metrics = served_model(url), f"{url}/metrics"
    before = settled_counters(metrics)
    tokens = sum(complete(url, model, f"smoke-{i}", prompt, max_new_tokens, 0.0)[0]
                 for i, prompt in enumerate(SMOKE_PROMPTS))
    counters = settled_counters(metrics) - before
    if counters.drafts == 0:
        raise EngineError(f"{export_dir}: vLLM served it and generated {tokens} tokens but drafted nothing: the "
                          f"speculative decoding did not run")
    return {"served_drafts": counters.drafts, "served_accepted_tokens": counters.accepted,
            "served_tau": round(1 + counters.accepted / counters.drafts, 4), "served_tokens": tokens}
