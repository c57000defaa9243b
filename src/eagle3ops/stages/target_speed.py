"""Stage `target_speed`: the target alone on vLLM, the eval sets' requests at eval.temperature: its tokens/s on this
hardware, what the report divides each drafter's served speed by (the speed-up). Measured where the evals serve
their drafters on vLLM (eval.engine vllm); otherwise it records that nothing was measured.

A stage of its own so that it runs once per target, prompts and engine settings (its dvc.yaml params), not once
per drafter or per experiment: a run that changes a training or drafter key takes it from DVC's cache. The
hardware is recorded beside it; the report divides only figures of the same hardware (hardware.label)."""
from functools import partial

from eagle3ops.config import Config, EvalBackend, EvalEngine
from eagle3ops.data.chat import prompt_ids, read_chat_template
from eagle3ops.data.prompt_sets import load_sets
from eagle3ops.decoding.served import Served, measure_target_alone
from eagle3ops.modeling.target import load_tokenizer
from eagle3ops.serving.session import ENGINES_TAG
from eagle3ops.serving.vllm import installed_version
from eagle3ops.tracking import hardware
from eagle3ops.tracking.identity import identity_params
from eagle3ops.tracking.metrics import record
from eagle3ops.tracking.run import stage_run


def run(cfg: Config) -> None:
    ev = cfg.eval
    with stage_run(cfg, "target_speed", inputs=[cfg.target.path, *(s.path for s in ev.sets)],
                   extra_params=identity_params(cfg.target)) as tracked:
        if not (ev.backend == EvalBackend.hf and ev.engine == EvalEngine.vllm):
            print("target_speed: nothing to measure: the evals do not serve their drafters on vLLM here "
                  "(eval.engine: vllm, eval.backend: hf)", flush=True)
            record(tracked, "target_speed", {"measured": False})
            return
        with tracked.phase("load"):
            sets = load_sets(ev.sets, ev.max_prompts)
            encode = partial(prompt_ids, load_tokenizer(cfg.target))  # token ids, as the evals send them
            template = read_chat_template(cfg.target.chat_template) if cfg.target.chat_template else None
        with tracked.phase("serve"):
            alone, served = measure_target_alone(cfg.target.path, cfg.target.dtype, cfg.vllm, sets, encode,
                                                 ev.max_new_tokens, ev.temperature, ev.concurrency, cfg.seed,
                                                 template)
        tracked.set_tags({ENGINES_TAG: served.summary()})
        record(tracked, "target_speed", {
            "measured": True, "prompts": sum(len(prompts) for prompts in sets.values()),
            "completion_tokens": sum(m.completion_tokens for m in alone.values()),
            "tokens_per_s": round(Served.tokens_per_s(alone), 1), "concurrency": ev.concurrency,
            "engine_starts": int(served.started), "engine_start_s": round(served.start_s, 1) if served.started else 0.0,
            # what it ran on, as eval's vllm block says it (metrics files hold numbers at their top level)
            "vllm": {"version": installed_version(),
                     "hardware": hardware.label(hardware.fingerprint(), cfg.hardware.label)}})
