"""Stage `eval@<drafter>`: speculative decoding on the benchmark prompt sets; acceptance length per set and
overall, and losslessness. eval.backend hf decodes here and, with eval.engine vllm, measures the drafter on vLLM
too, side by side (decoding/served.py); vllm | sglang measure on a server only (decoding/engines.py).

eval.temperature is the primary measurement (checked against the target, compared with vLLM, registered); with
eval.sampled_temperature, tau is measured a second time at that temperature, as users serve, by the same backend
(metrics block `sampled`, MLflow `sampled/...`, phase `decode_sampled`). The side-by-side on vLLM (eval.engine)
stays at the primary temperature only."""
import hashlib
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from eagle3ops.config import Config
from eagle3ops.data.chat import prompt_ids
from eagle3ops.data.prompt_sets import load_sets
from eagle3ops.decoding.engines import measure
from eagle3ops.decoding.evaluation import Compared, decode_and_compare, decoded_on_engine, served_on_vllm
from eagle3ops.decoding.results import Decoded, EvalResult
from eagle3ops.decoding.served import Served, check_agreement, check_servable, measure_on_vllm, side_by_side
from eagle3ops.formats.checkpoint import load_any_drafter
from eagle3ops.modeling.target import default_aux_layers, load_target, load_tokenizer, model_size, model_text_config
from eagle3ops.serving.session import ENGINES_TAG
from eagle3ops.spec_settings import SpecSettings, sampled_settings, sampled_temperature
from eagle3ops.tracking import hardware
from eagle3ops.tracking.identity import identity_params
from eagle3ops.tracking.metrics import record
from eagle3ops.tracking.registry import Measurement, weights_sha256
from eagle3ops.tracking.run import stage_run


def drafter_path(cfg: Config, drafter: str) -> Path:
    """baseline = the existing drafter used as-is on the new target; otherwise our trained one."""
    return Path(cfg.train.warm_start) if drafter == "baseline" else Path(cfg.train.out_dir) / drafter


def run(cfg: Config, drafter: str) -> None:
    path, identity = drafter_path(cfg, drafter), identity_params(cfg.target)
    evaluate = {"hf": _decode_here, "vllm": _on_engine, "sglang": _on_engine}[str(cfg.eval.backend)]
    with stage_run(cfg, "eval", variant=drafter, inputs=[path, cfg.target.path, *(s.path for s in cfg.eval.sets)],
                   extra_params=identity) as tracked:
        result = evaluate(cfg, drafter, path, tracked)
        _register(cfg, tracked, drafter, path, result, identity)
        # what registering the drafter logged with its model is not logged again
        tracked.log_metrics({key: value for key, value in result.to_mlflow().items() if key not in tracked.logged})
        record(tracked, f"eval-{drafter}", result.to_json())


def _decode_here(cfg: Config, drafter: str, path: Path, tracked) -> EvalResult:
    """eval.backend hf: the project's decoder against the target alone, and, with eval.engine, the drafter on vLLM
    beside it."""
    ev = cfg.eval
    with tracked.phase("load"):
        tokenizer = load_tokenizer(cfg.target)
        target = load_target(cfg.target)
        draft = load_any_drafter(path, target.get_input_embeddings().weight.detach().cpu()).to(target.device).eval()
        draft.cfg.aux_layers = draft.cfg.aux_layers or default_aux_layers(model_text_config(target).num_hidden_layers)
        if ev.engine:  # before any decoding: can vLLM serve these here at all
            check_servable(cfg.target.path, draft.cfg.head_dim)
        sets = load_sets(ev.sets, ev.max_prompts)
        prompts = [prompt for set_prompts in sets.values() for prompt in set_prompts]
    settings = SpecSettings.from_config(ev)
    sampled = sampled_settings(settings, ev.sampled_temperature)
    with tracked.phase("decode"):
        measured = decode_and_compare(target, draft, tokenizer, prompts, settings, ev.max_new_tokens, ev.batch_size,
                                      cfg.seed, f"eval@{drafter}")
    _tell_partings(tracked, drafter, measured)
    result = EvalResult(primary=measured.decoded(settings.temperature, cfg.seed), prompts_by_set=_prompts_by_set(sets),
                        target_alone=measured.target_alone(model_size(target)),
                        # sampled output is checked statistically (tests/test_decoding_sampling.py), not against one run
                        output_check=measured.output_check() if settings.greedy else None)
    # the same prompts and seeds, speculatively only: lossless in distribution, not checked token for token
    if sampled is not None:
        with tracked.phase("decode_sampled"):
            again = decode_and_compare(target, draft, tokenizer, prompts, sampled, ev.max_new_tokens, ev.batch_size,
                                       cfg.seed, f"eval@{drafter} T={sampled.temperature}", reference=False)
        result = replace(result, sampled=again.decoded(sampled.temperature, cfg.seed))
    if not ev.engine:
        return result
    # at eval.temperature only: the sampled measurement is the decoder's
    del target, draft  # vLLM loads the target again, in its own process: leave it the device's memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with tracked.phase("serve"):
        served = measure_on_vllm(cfg.target.path, path, cfg.target.dtype, cfg.vllm, sets,
                                 partial(prompt_ids, tokenizer), ev.k, ev.max_new_tokens, settings.temperature,
                                 ev.concurrency, cfg.seed, drafter)
    _tag_engines(tracked, served)
    if settings.greedy:
        check_agreement(side_by_side(measured.overall, served.overall(ev.k), measured.per_set,
                                     {name: m.stats for name, m in served.with_drafter.items()}),
                        ev.engine_tolerance, drafter)
    where = hardware.label(hardware.fingerprint(), cfg.hardware.label)  # the served speed is this hardware's
    return replace(result, vllm=served_on_vllm(served, ev.k, ev.concurrency, where,
                                               measured.target_outputs if settings.greedy else None))


def _on_engine(cfg: Config, drafter: str, path: Path, tracked) -> EvalResult:
    """eval.backend vllm | sglang: the same metrics, measured on the server at eval.server_url, which must be
    serving the target with this drafter, or (vllm without a URL) on a server the stage starts. Losslessness is
    not checked (the target's own output is not at hand)."""
    ev = cfg.eval
    with tracked.phase("load"):
        sets = load_sets(ev.sets, ev.max_prompts)
        # the engines are sent token ids, rendered with the target's chat template as the hf backend renders them
        encode = partial(prompt_ids, load_tokenizer(cfg.target))

    def measure_at(temperature: float, desc: str) -> Decoded:
        if ev.server_url:
            per_set = measure(ev.backend, ev.server_url, sets, ev.k, ev.max_new_tokens, temperature, ev.concurrency,
                              desc, encode)
        else:
            served = measure_on_vllm(cfg.target.path, path, cfg.target.dtype, cfg.vllm, sets, encode, ev.k,
                                     ev.max_new_tokens, temperature, ev.concurrency, cfg.seed, drafter)
            _tag_engines(tracked, served)
            per_set = served.with_drafter
        return decoded_on_engine(ev.k, temperature, per_set)

    with tracked.phase("decode"):
        result = EvalResult(primary=measure_at(ev.temperature, f"eval@{drafter}"), prompts_by_set=_prompts_by_set(sets))
    if (sampled := sampled_temperature(ev.temperature, ev.sampled_temperature)) is not None:
        with tracked.phase("decode_sampled"):  # the same requests again (without a URL: a server of its own)
            result = replace(result, sampled=measure_at(sampled, f"eval@{drafter} T={sampled}"))
    tracked.set_tags({"eagle3ops.eval.backend": str(ev.backend)})  # metrics files hold numbers
    return result


def _prompts_by_set(sets: dict[str, list[dict]]) -> dict[str, int]:
    return {name: len(set_prompts) for name, set_prompts in sets.items()}


def _tell_partings(tracked, drafter: str, measured: Compared) -> None:
    """Greedy: where each prompt's output parts from the target's own, and why, in the log and the run's tags."""
    if not measured.partings:
        return
    tracked.set_tags({"eagle3ops.mismatched_prompts": ",".join(measured.mismatched[:20]),
                      "eagle3ops.partings": " ".join(parting.tag() for parting in measured.partings[:20])})
    for parting in measured.partings:
        print(f"eval@{drafter}: {parting.explained()}", flush=True)


def _tag_engines(tracked, served: Served) -> None:
    """Whether the engine was started by this stage (and its start's seconds) or found running."""
    tracked.set_tags({ENGINES_TAG: served.engine.summary()})


def _register(cfg: Config, tracked, drafter: str, path: Path, result: EvalResult, identity: dict[str, str]) -> None:
    """A trained drafter measured by the pipeline: its tau linked to its logged model, registered, the champion
    moved among the versions measured alike (tracking/registry.py). Not the baseline (not ours), not a one-off
    run (`--set`, `--params`), not when mlflow.registered_model is null."""
    if drafter == "baseline" or not cfg.mlflow.registered_model or tracked.one_off:
        return
    ev, check = cfg.eval, result.output_check
    digests = {s.name: hashlib.md5(Path(s.path).read_bytes()).hexdigest() for s in ev.sets}  # DVC's md5 of a file
    measurement = Measurement(
        target=cfg.target.id + (f"@{cfg.target.revision}" if cfg.target.revision else ""),
        target_digest=identity["target_identity.digest"],
        sets=tuple(f"{name}:{digests[name]}:{count}" for name, count in result.prompts_by_set.items()),
        k=ev.k,
        decoding=(f"{ev.backend} backend, temperature {ev.temperature}, top_p {ev.top_p}, topk {ev.topk}, "
                  f"{ev.num_draft_tokens or 'default'} draft tokens, {ev.draft_sample_method} drafts, "
                  f"{ev.max_new_tokens} new tokens"),
        lossless="not checked" if check is None else "yes" if check.lossless else "no")
    paths = {s.name: s.path for s in ev.sets}
    tau = result.primary.tau
    linked = {"tau": (tau, None, None),
              **{f"tau/{name}": (set_tau, paths[name], digests[name])
                 for name, set_tau in result.primary.tau_by_set.items()}}
    for block, measured in (("vllm", result.vllm), ("sampled", result.sampled)):  # the version shows them too
        if measured is not None:
            linked[f"{block}/tau"] = (measured.tau, None, None)
    tracked.register_drafter(cfg.mlflow.registered_model, weights_sha256(path), tau, linked, measurement)
