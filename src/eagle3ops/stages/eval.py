"""Stage `eval@<drafter>`: speculative decoding on the benchmark prompt sets; acceptance length per set and
overall, and losslessness. eval.backend hf decodes here and, with eval.engine vllm, measures the drafter on vLLM
too, side by side (decoding/served.py); vllm | sglang measure on a server only (decoding/engines.py).

eval.temperature is the primary measurement (checked against the target, compared with vLLM, registered); with
eval.sampled_temperature, tau is measured a second time at that temperature, as users serve, by the same backend
(metrics block `sampled`, MLflow `sampled/...`, phase `decode_sampled`). The side-by-side on vLLM (eval.engine)
stays at the primary temperature only."""
import hashlib
from functools import partial
from pathlib import Path

import torch

from eagle3ops.config import Config
from eagle3ops.data.chat import prompt_ids
from eagle3ops.data.prompt_sets import load_sets
from eagle3ops.decoding.engines import measure
from eagle3ops.decoding.evaluation import acceptance_fields, decode_and_compare, engine_fields, sampled_fields
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
    if cfg.eval.backend != "hf":
        return run_on_engine(cfg, drafter)
    path = drafter_path(cfg, drafter)
    identity = identity_params(cfg.target)
    with stage_run(cfg, "eval", variant=drafter, inputs=[path, cfg.target.path, *(s.path for s in cfg.eval.sets)],
                   extra_params=identity) as tracked:
        with tracked.phase("load"):
            tokenizer = load_tokenizer(cfg.target)
            target = load_target(cfg.target)
            draft = load_any_drafter(path, target.get_input_embeddings().weight.detach().cpu()).to(target.device).eval()
            depth = model_text_config(target).num_hidden_layers
            draft.cfg.aux_layers = draft.cfg.aux_layers or default_aux_layers(depth)
            if cfg.eval.engine:  # before any decoding: can vLLM serve these here at all
                check_servable(cfg.target.path, draft.cfg.head_dim)
            sets = load_sets(cfg.eval.sets, cfg.eval.max_prompts)
            prompts = [prompt for set_prompts in sets.values() for prompt in set_prompts]
        settings = SpecSettings.from_config(cfg.eval)
        sampled = sampled_settings(settings, cfg.eval.sampled_temperature)
        with tracked.phase("decode"):
            measured = decode_and_compare(target, draft, tokenizer, prompts, settings, cfg.eval.max_new_tokens,
                                          cfg.eval.batch_size, cfg.seed, f"eval@{drafter}")
        mismatched = measured.mismatched
        if mismatched:
            # prompt@token:gap/tolerance; "stops" where one output stops early (decoding/evaluation.py, Parting)
            gaps = [("stops" if p.gap is None else f"{p.gap:.3g}") for p in measured.partings]
            tracked.set_tags({"eagle3ops.mismatched_prompts": ",".join(mismatched[:20]),
                              "eagle3ops.partings": " ".join(f"{p.prompt}@{p.position}:{gap}/{p.tolerance:.3g}"
                                                             for p, gap in zip(measured.partings[:20], gaps))})
            for parting in measured.partings:
                why = ("one output stops early" if parting.gap is None else
                       f"the target's logit gap {parting.gap:.3g} is {'within' if parting.near_tie else 'beyond'} "
                       f"its rounding, {parting.tolerance:.3g}")
                print(f"eval@{drafter}: {parting.prompt} parts from the target's own output at token "
                      f"{parting.position}: {why}: {'a near-tie' if parting.near_tie else 'NOT lossless'}", flush=True)
        fields = {"temperature": settings.temperature,
                  **acceptance_fields(measured.overall, measured.per_set,
                                      {name: len(set_prompts) for name, set_prompts in sets.items()},
                                      measured.per_prompt, cfg.seed)}
        # the same prompts and seeds, speculatively only: lossless in distribution, not checked token for token
        if sampled is not None:
            with tracked.phase("decode_sampled"):
                again = decode_and_compare(target, draft, tokenizer, prompts, sampled, cfg.eval.max_new_tokens,
                                           cfg.eval.batch_size, cfg.seed, f"eval@{drafter} T={sampled.temperature}",
                                           reference=False)
            fields["sampled"] = sampled_fields(sampled.temperature, {
                **acceptance_fields(again.overall, again.per_set, {}, again.per_prompt, cfg.seed),
                "emitted_tokens": again.spec_tokens,
                "spec_tokens_per_s": round(again.spec_tokens / max(again.spec_s, 1e-9), 1)})
        size = model_size(target)
        if cfg.eval.engine:  # at eval.temperature only: the sampled measurement is the decoder's
            del target, draft  # vLLM loads the target again, in its own process: leave it the device's memory
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            with tracked.phase("serve"):
                served = measure_on_vllm(cfg.target.path, path, cfg.target.dtype, cfg.vllm, sets,
                                         partial(prompt_ids, tokenizer), cfg.eval.k, cfg.eval.max_new_tokens,
                                         settings.temperature, cfg.eval.concurrency, cfg.seed, drafter)
            fields["vllm"] = _served_fields(cfg, served, measured.target_outputs if settings.greedy else None)
            _tag_engines(tracked, served)
            if settings.greedy:
                check_agreement(side_by_side(measured.overall, served.overall(cfg.eval.k), measured.per_set,
                                             {name: m.stats for name, m in served.with_drafter.items()}),
                                cfg.eval.engine_tolerance, drafter)
        _register(cfg, tracked, drafter, path, fields, identity,
                  ("yes" if measured.lossless else "no") if settings.greedy else "not checked")
        _log_per_set(tracked, fields)
        record(tracked, f"eval-{drafter}", {
            **size, "emitted_tokens": measured.spec_tokens, "prompts": len(prompts), **fields,
            # Sampled output is checked statistically (tests/test_decoding_sampling.py), not against one run.
            # lossless where every parting is a near-tie of the target's own logits (decoding/evaluation.py, Parting)
            **({"lossless": measured.lossless, "mismatched_prompts": len(mismatched),
                "near_tie_prompts": len(measured.near_ties)} if settings.greedy else {}),
            "draft_vocab_coverage": round(measured.draft_vocab_coverage, 4),  # target tokens it can draft at all
            "spec_tokens_per_s": round(measured.spec_tokens / max(measured.spec_s, 1e-9), 1),
            "target_tokens_per_s": round(measured.plain_tokens / max(measured.plain_s, 1e-9), 1),
        })


def run_on_engine(cfg: Config, drafter: str) -> None:
    """eval.backend vllm | sglang: the same metrics, measured on the server at eval.server_url, which must be
    serving the target with this drafter, or (vllm without a URL) on a server the stage starts. Losslessness is
    not checked (the target's own output is not at hand)."""
    path, ev, identity = drafter_path(cfg, drafter), cfg.eval, identity_params(cfg.target)
    with stage_run(cfg, "eval", variant=drafter, inputs=[path, cfg.target.path, *(s.path for s in ev.sets)],
                   extra_params=identity) as tracked:
        with tracked.phase("load"):
            sets = load_sets(ev.sets, ev.max_prompts)
            # the engines are sent token ids, rendered with the target's chat template as the hf backend renders them
            encode = partial(prompt_ids, load_tokenizer(cfg.target))

        def measure_at(temperature: float, desc: str) -> dict:
            if ev.server_url:
                return measure(ev.backend, ev.server_url, sets, ev.k, ev.max_new_tokens, temperature,
                               ev.concurrency, desc, encode)
            served = measure_on_vllm(cfg.target.path, path, cfg.target.dtype, cfg.vllm, sets, encode, ev.k,
                                     ev.max_new_tokens, temperature, ev.concurrency, cfg.seed, drafter)
            _tag_engines(tracked, served)
            return served.with_drafter

        prompts_by_set = {name: len(set_prompts) for name, set_prompts in sets.items()}
        with tracked.phase("decode"):
            fields = {"temperature": ev.temperature,
                      **engine_fields(ev.k, measure_at(ev.temperature, f"eval@{drafter}"), prompts_by_set)}
        if (sampled := sampled_temperature(ev.temperature, ev.sampled_temperature)) is not None:
            with tracked.phase("decode_sampled"):  # the same requests again (without a URL: a server of its own)
                again = measure_at(sampled, f"eval@{drafter} T={sampled}")
            fields["sampled"] = sampled_fields(sampled, engine_fields(ev.k, again, prompts_by_set))
        _register(cfg, tracked, drafter, path, fields, identity, "not checked")
        _log_per_set(tracked, fields)
        tracked.set_tags({"eagle3ops.eval.backend": str(ev.backend)})  # metrics files hold numbers
        record(tracked, f"eval-{drafter}", {"prompts": sum(prompts_by_set.values()), **fields})


def _served_fields(cfg: Config, served: Served, references: dict[str, list[int]] | None) -> dict:
    """What vLLM measured, in the hf backend's terms, with the served speed with the drafter on this hardware (the
    report divides it by the target alone's, stage target_speed); greedy, how many prompts' output is token for
    token the target's."""
    k = cfg.eval.k
    fields = {"version": served.version,
              **acceptance_fields(served.overall(k), {name: m.stats for name, m in served.with_drafter.items()},
                                  {name: len(m.outputs) for name, m in served.with_drafter.items()})}
    del fields["prompts_by_set"]
    with_drafter = served.tokens_per_s(served.with_drafter)
    fields.update(tokens_per_s=round(with_drafter, 1), concurrency=cfg.eval.concurrency,
                  hardware=hardware.label(hardware.fingerprint(), cfg.hardware.label),
                  engine_starts=int(served.engine.started),
                  engine_start_s=round(served.engine.start_s, 1) if served.engine.started else 0.0)
    if references is not None:
        outputs = served.outputs()
        fields["greedy_equal_prompts"] = sum(outputs.get(pid) == ids for pid, ids in references.items())
    return fields


def _tag_engines(tracked, served: Served) -> None:
    """Whether the engine was started by this stage (and its start's seconds) or found running."""
    tracked.set_tags({ENGINES_TAG: served.engine.summary()})


def _flat_metrics(prefix: str, fields: dict) -> dict[str, float]:
    """The numbers of a metrics block as MLflow metrics `prefix/name` (per set: `prefix/tau/<set>`)."""
    flat = {f"{prefix}/{name}": value for name, value in fields.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}
    flat.update({f"{prefix}/tau/{name}": tau for name, tau in fields.get("tau_by_set", {}).items()})
    return flat


def _log_per_set(tracked, fields: dict) -> None:
    """tau per benchmark set, as MLflow metrics `tau/<set>` (the metrics file keeps them under tau_by_set), what
    vLLM measured as `vllm/...` and the measurement at eval.sampled_temperature as `sampled/...`, unless
    registering the drafter logged them with its model already."""
    metrics = {f"tau/{name}": tau for name, tau in fields["tau_by_set"].items()}
    for block in ("vllm", "sampled"):
        if block in fields:
            metrics.update(_flat_metrics(block, fields[block]))
    tracked.log_metrics({key: value for key, value in metrics.items() if key not in tracked.logged})


def _register(cfg: Config, tracked, drafter: str, path: Path, fields: dict, identity: dict[str, str],
              lossless: str) -> None:
    """A trained drafter measured by the pipeline: its tau linked to its logged model, registered, the champion
    moved among the versions measured alike (tracking/registry.py). Not the baseline (not ours), not a one-off
    run (`--set`, `--params`), not when mlflow.registered_model is null."""
    if drafter == "baseline" or not cfg.mlflow.registered_model or tracked.one_off:
        return
    ev = cfg.eval
    digests = {s.name: hashlib.md5(Path(s.path).read_bytes()).hexdigest() for s in ev.sets}  # DVC's md5 of a file
    measurement = Measurement(
        target=cfg.target.id + (f"@{cfg.target.revision}" if cfg.target.revision else ""),
        target_digest=identity["target_identity.digest"],
        sets=tuple(f"{name}:{digests[name]}:{count}" for name, count in fields["prompts_by_set"].items()),
        k=ev.k,
        decoding=(f"{ev.backend} backend, temperature {ev.temperature}, top_p {ev.top_p}, topk {ev.topk}, "
                  f"{ev.num_draft_tokens or 'default'} draft tokens, {ev.draft_sample_method} drafts, "
                  f"{ev.max_new_tokens} new tokens"),
        lossless=lossless)
    paths = {s.name: s.path for s in ev.sets}
    linked = {"tau": (fields["tau"], None, None),
              **{f"tau/{name}": (tau, paths[name], digests[name]) for name, tau in fields["tau_by_set"].items()}}
    for block in ("vllm", "sampled"):  # on vLLM, at the sampling temperature: the version shows them too
        if block in fields:
            linked[f"{block}/tau"] = (fields[block]["tau"], None, None)
    tracked.register_drafter(cfg.mlflow.registered_model, weights_sha256(path), fields["tau"], linked, measurement)
