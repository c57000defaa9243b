"""Acceptance measured on a running serving engine (eval.backend: vllm | sglang), in the HF backend's terms.

The server runs the target with the drafter under test (launch commands: `eagle3ops validate-export`) and must
serve nothing else while the eval runs: vLLM's counters are server-wide. The prompt sets run one after another,
each with `concurrency` requests in flight.

vLLM: prompts go to /v1/completions as token ids, rendered here with the target's chat template as the hf backend
  renders them (the server's own template, or a different BOS handling, cannot change what is measured), after
  one warm-up request; the generated ids come back too (`return_token_ids`). Acceptance comes from the
  spec-decode counters of its Prometheus /metrics, read before and after each set: vllm:spec_decode_num_drafts,
  vllm:spec_decode_num_accepted_tokens and vllm:spec_decode_num_accepted_tokens_per_pos (label position = 0..k-1),
  exposed with the counter suffix `_total` and labelled model_name and engine (summed over engines).
  tau = 1 + accepted / drafts; a_i = accepted at position i-1 / drafts.
SGLang: its OpenAI endpoints return no speculative counts; its native /generate does, per request, in meta_info.
  The prompt is rendered here with the target's chat template (as the HF backend renders it) and sent as
  input_ids. tau = sum of completion_tokens / sum of spec_verify_ct, as SGLang reports it; a_i from
  spec_accept_histogram (how many verify steps accepted j drafts) where the server returns it.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from eagle3ops.decoding.speculative import AcceptanceStats
from eagle3ops.progress import progress
from eagle3ops.serving.http import EngineError, fetch, fetch_json, served_model

# vLLM's frontend may count a step's drafts a moment after it sends the step's tokens: read /metrics until it
# stops moving (SETTLE_READS reads, SETTLE_INTERVAL_S apart at most).
SETTLE_INTERVAL_S = 0.2
SETTLE_READS = 25
VLLM_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_accepted_tokens_per_pos")

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_ESCAPE = re.compile(r"\\(.)")


@dataclass
class SetMeasurement:
    stats: AcceptanceStats
    completion_tokens: int
    seconds: float
    per_position: bool  # False: the server reported totals only (SGLang without its acceptance histogram)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # vLLM: each prompt's generated token ids


# ---- Prometheus text exposition format -------------------------------------------------------------------------

def _labels(text: str) -> dict[str, str] | None:
    labels, position = {}, 0
    while position < len(text):
        match = _LABEL.match(text, position)
        if match is None:
            return None
        labels[match.group(1)] = _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), match.group(2))
        position = match.end()
    return labels


def parse_exposition(text: str, source: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a /metrics page by name: {name: [(labels, value), ...]}; comments and blank lines skipped."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        labels = _labels(match.group(2) or "") if match else None
        try:
            value = float(match.group(3)) if labels is not None else None
        except ValueError:
            value = None
        if value is None:
            raise EngineError(f"{source}:{lineno}: not a Prometheus sample: {line[:160]!r}")
        samples[match.group(1)].append((labels, value))
    return dict(samples)


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over its engines (data-parallel ranks)."""
    drafts: int
    accepted: int
    accepted_per_pos: tuple[int, ...]

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafts - before.drafts, self.accepted - before.accepted,
                            tuple(a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)))


def vllm_counters(text: str, source: str) -> SpecCounters:
    samples = parse_exposition(text, source)
    # prometheus_client exposes a counter `x` as the sample `x_total` (beside `x_created`); take the bare name too
    found = {name: samples.get(f"{name}_total") or samples.get(name) for name in VLLM_COUNTERS}
    missing = [name for name, values in found.items() if not values]
    if missing:
        raise EngineError(f"{source}: no {', '.join(missing)} counter: is the server running with a drafter "
                          f"(vllm serve ... --speculative-config '{{\"method\": \"eagle3\", ...}}')?")
    per_pos: dict[int, float] = defaultdict(float)
    for labels, value in found["vllm:spec_decode_num_accepted_tokens_per_pos"]:
        if not labels.get("position", "").isdigit():
            raise EngineError(f"{source}: vllm:spec_decode_num_accepted_tokens_per_pos sample without a numeric "
                              f"position label: {labels}")
        per_pos[int(labels["position"])] += value
    if sorted(per_pos) != list(range(len(per_pos))):
        raise EngineError(f"{source}: draft positions {sorted(per_pos)} are not 0..k-1")
    total = {name: round(sum(value for _, value in values)) for name, values in found.items()}
    return SpecCounters(total["vllm:spec_decode_num_drafts"], total["vllm:spec_decode_num_accepted_tokens"],
                        tuple(round(per_pos[i]) for i in range(len(per_pos))))


# ---- HTTP ------------------------------------------------------------------------------------------------------

def _in_parallel(prompts: list[dict], send: Callable[[dict], object], concurrency: int, bar) -> list:
    """send(prompt) for every prompt, `concurrency` at a time; the first failure cancels what has not started."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(send, prompt) for prompt in prompts]
        results = []
        try:
            for future in as_completed(futures):
                results.append(future.result())
                bar.update(1)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return results


# ---- engines ---------------------------------------------------------------------------------------------------

def settled_counters(metrics_url: str) -> SpecCounters:
    current = vllm_counters(fetch(metrics_url).decode("utf-8", "replace"), metrics_url)
    for _ in range(SETTLE_READS):
        time.sleep(SETTLE_INTERVAL_S)
        following = vllm_counters(fetch(metrics_url).decode("utf-8", "replace"), metrics_url)
        if following == current:
            return current
        current = following
    raise EngineError(f"{metrics_url}: the spec-decode counters keep moving with no request of ours in flight: "
                      f"another client is using the server")


def complete(url: str, model: str, prompt_id: str, prompt: list[int] | str, max_new_tokens: int,
             temperature: float) -> tuple[int, list[int]]:
    """One /v1/completions request on the prompt's token ids (or text); (completion tokens, the generated ids)."""
    completions_url = f"{url}/v1/completions"
    answer = fetch_json(completions_url, {"model": model, "prompt": prompt, "max_tokens": max_new_tokens,
                                           "temperature": temperature, "return_token_ids": True})
    tokens = (answer.get("usage") or {}).get("completion_tokens")
    if not isinstance(tokens, int):
        raise EngineError(f"{completions_url}: no usage.completion_tokens in the answer to {prompt_id}")
    generated = ((answer.get("choices") or [{}])[0]).get("token_ids")
    return tokens, generated if isinstance(generated, list) else []


def _warm_up(url: str, model: str, sets: dict[str, list[dict]], encode: Callable[[list[dict]], list[int]]) -> None:
    """One short request before anything is timed or counted: the engine's first request pays for its warm-up."""
    first = next(prompt for prompts in sets.values() for prompt in prompts)
    complete(url, model, first["id"], encode(first["messages"]), 8, 0.0)


def _send_set(url: str, model: str, prompts: list[dict], encode: Callable[[list[dict]], list[int]],
              max_new_tokens: int, temperature: float, concurrency: int, bar) -> SetMeasurement:
    """The set's prompts, `concurrency` in flight, timed; acceptance left to the caller."""
    encoded = {prompt["id"]: encode(prompt["messages"]) for prompt in prompts}

    def send(prompt: dict) -> tuple[str, int, list[int]]:
        return prompt["id"], *complete(url, model, prompt["id"], encoded[prompt["id"]], max_new_tokens, temperature)

    start = time.perf_counter()
    answers = _in_parallel(prompts, send, concurrency, bar)
    seconds = time.perf_counter() - start
    return SetMeasurement(AcceptanceStats(1), sum(tokens for _, tokens, _ in answers), seconds, per_position=True,
                          outputs={prompt_id: generated for prompt_id, _, generated in answers})


def _measure_vllm(url: str, sets: dict[str, list[dict]], k: int, max_new_tokens: int, temperature: float,
                  concurrency: int, bar, encode: Callable[[list[dict]], list[int]]) -> dict[str, SetMeasurement]:
    model, metrics_url = served_model(url), f"{url}/metrics"
    _warm_up(url, model, sets, encode)
    before = settled_counters(metrics_url)
    if len(before.accepted_per_pos) != k:
        raise EngineError(f"{metrics_url}: the server drafts {len(before.accepted_per_pos)} tokens per step but "
                          f"eval.k is {k}: set eval.k to its num_speculative_tokens")
    results = {}
    for name, prompts in sets.items():
        measured = _send_set(url, model, prompts, encode, max_new_tokens, temperature, concurrency, bar)
        after = settled_counters(metrics_url)
        delta = after - before
        measured.stats = AcceptanceStats(k, steps=delta.drafts, accepted=delta.accepted,
                                         accepted_at=list(delta.accepted_per_pos))
        results[name], before = measured, after
    return results


def measure_plain(url: str, sets: dict[str, list[dict]], max_new_tokens: int, temperature: float, concurrency: int,
                  desc: str, encode: Callable[[list[dict]], list[int]]) -> dict[str, SetMeasurement]:
    """The same requests on a vLLM server without a drafter: what the drafter's speed-up is measured against."""
    url = url.rstrip("/")
    with progress(sum(len(prompts) for prompts in sets.values()), desc, "prompt") as bar:
        model = served_model(url)
        _warm_up(url, model, sets, encode)
        return {name: _send_set(url, model, prompts, encode, max_new_tokens, temperature, concurrency, bar)
                for name, prompts in sets.items()}


def _measure_sglang(url: str, sets: dict[str, list[dict]], k: int, max_new_tokens: int, temperature: float,
                    concurrency: int, bar, encode: Callable[[list[dict]], list[int]]) -> dict[str, SetMeasurement]:
    generate_url = f"{url}/generate"

    def send(prompt: dict) -> tuple[int, int, list[int] | None]:
        answer = fetch_json(generate_url, {"input_ids": encode(prompt["messages"]),
                                            "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                "temperature": temperature}})
        meta = answer.get("meta_info") or {}
        if not isinstance(meta.get("completion_tokens"), int) or not isinstance(meta.get("spec_verify_ct"), int):
            raise EngineError(f"{generate_url}: no meta_info.spec_verify_ct in the answer to {prompt['id']}: is the "
                              f"server running with --speculative-algorithm EAGLE3?")
        histogram = meta.get("spec_accept_histogram")
        if histogram is not None and not (isinstance(histogram, list) and all(isinstance(n, int) for n in histogram)):
            raise EngineError(f"{generate_url}: meta_info.spec_accept_histogram is not a list of counts: {histogram!r}")
        if histogram is not None and any(histogram[k + 1:]):
            raise EngineError(f"{generate_url}: the server accepted more than eval.k = {k} drafts in a step "
                              f"(histogram {histogram}): set eval.k to its --speculative-num-steps")
        return meta["completion_tokens"], meta["spec_verify_ct"], histogram

    results = {}
    for name, prompts in sets.items():
        start = time.perf_counter()
        answers = _in_parallel(prompts, send, concurrency, bar)
        seconds = time.perf_counter() - start
        tokens, steps = sum(a[0] for a in answers), sum(a[1] for a in answers)
        histograms = [a[2] for a in answers if a[2] is not None]
        accepted_at = [sum(sum(h[i:]) for h in histograms) for i in range(1, k + 1)]  # steps accepting >= i drafts
        stats = AcceptanceStats(k, steps=steps, accepted=tokens - steps, accepted_at=accepted_at)
        results[name] = SetMeasurement(stats, tokens, seconds, per_position=len(histograms) == len(answers))
    return results


def measure(backend: str, url: str, sets: dict[str, list[dict]], k: int, max_new_tokens: int, temperature: float,
            concurrency: int, desc: str, encode: Callable[[list[dict]], list[int]]) -> dict[str, SetMeasurement]:
    """Acceptance per prompt set on the server at `url` (vllm | sglang); `encode`: messages -> the prompt's token
    ids, as the hf backend renders them."""
    url = url.rstrip("/")
    with progress(sum(len(prompts) for prompts in sets.values()), desc, "prompt") as bar:
        if backend == "vllm":
            return _measure_vllm(url, sets, k, max_new_tokens, temperature, concurrency, bar, encode)
        return _measure_sglang(url, sets, k, max_new_tokens, temperature, concurrency, bar, encode)
