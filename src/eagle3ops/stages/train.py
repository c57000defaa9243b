"""Stage `train@<init>`: train the drafter from scratch, or fine-tune an existing one (warm start).

train.hidden_states offline reads the target's hidden states from the extract stage's shards; online runs the target
beside the drafter for them (training/online.py), and dvc.yaml wires the stage to the prepared data and the target
instead (the `pipeline` keys of params.yaml).

Under torchrun every rank runs this stage on its share of each global batch (training/distributed.py); rank 0 alone logs
to MLflow and writes the resume points, the drafter, metrics and plots.
"""
import tempfile
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from pathlib import Path

import pandas as pd

from eagle3ops.config import Config
from eagle3ops.data.prepare import masked_token_counts
from eagle3ops.data.shards import read_manifest
from eagle3ops.data.vocab import read_vocab_map
from eagle3ops.decoding.served import WORK_DIR
from eagle3ops.decoding.settings import SpecSettings
from eagle3ops.errors import InputError
from eagle3ops.extraction.imported import target_layout
from eagle3ops.extraction.vllm import EngineStates, capturing_server
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.fs import atomic_dir, write_json_atomic
from eagle3ops.modeling.target import (
    load_embedding_and_head,
    load_target,
    load_text_config,
    load_tokenizer,
    model_text_config,
    resolve_aux_layers,
    resolve_device,
)
from eagle3ops.resume import resume_point
from eagle3ops.tracking.identity import identity_params
from eagle3ops.tracking.metrics import PLOTS_DIR, destination, record
from eagle3ops.tracking.run import stage_run
from eagle3ops.training import distributed
from eagle3ops.training.data import load_feature_samples
from eagle3ops.training.init import WarmStart, load_warm_start, new_drafter
from eagle3ops.training.loop import Hooks, Recipe, TrainState, train_drafter
from eagle3ops.training.online import EngineTargetStates, TargetStates, token_samples
from eagle3ops.training.simulation import AcceptanceSimulator, held_out_prompts


def run(cfg: Config, init: str) -> None:
    with distributed.process_group(resolve_device(cfg.target.device)) as (world, device):
        _run(cfg, init, world, device)


def _run(cfg: Config, init: str, world: distributed.World, device) -> None:
    online = cfg.train.hidden_states == "online"
    if online and world.size > 1:
        raise InputError("train.hidden_states online runs in one process (the target beside the drafter, on its own "
                         "GPUs with target.device_map): launch it without torchrun")
    features = None if online else Path(cfg.pipeline.hidden_states_dep)  # extract.out_dir (config.py checks it)
    inputs = ([features] if features else []) + [cfg.prepare.out_dir, cfg.target.path] + (
        [cfg.train.warm_start] if init == "warm_start" else [])
    tracking = (stage_run(cfg, "train", variant=init, inputs=inputs, extra_params=identity_params(cfg.target))
                if world.main else nullcontext(distributed.Untracked()))
    with tracking as tracked, ExitStack() as engine:
        if world.main:
            tracked.set_tags({"eagle3ops.hidden_states": str(cfg.train.hidden_states),
                              **({"eagle3ops.online_engine": str(cfg.train.online_engine)} if online else {})})
        with tracked.phase("load"):
            embedding, lm_head = load_embedding_and_head(cfg.target.path)
            if online:
                train_samples = token_samples(Path(cfg.prepare.out_dir) / "train")
                eval_samples = token_samples(Path(cfg.prepare.out_dir) / "eval")
                states = _online_states(cfg, device, len(train_samples) + len(eval_samples), engine)
                aux_layers = states.aux_layers
            else:
                aux_layers = read_manifest(features / "train")["aux_layers"]
                train_samples = load_feature_samples(features / "train", embedding.shape[1])
                eval_samples = load_feature_samples(features / "eval", embedding.shape[1])
                states = None
            d2t, t2d = read_vocab_map(cfg.prepare.out_dir)
            if init == "warm_start":
                warm = load_warm_start(cfg.train.warm_start, cfg.target.path, embedding, lm_head, aux_layers,
                                       masked_token_counts(Path(cfg.prepare.out_dir) / "train"),
                                       (d2t, t2d), cfg.train.warm_start_vocab,
                                       cfg.train.warm_start_optimizer, cfg.train.warm_start_min_coverage)
                draft, optimizer_state = warm.draft, warm.optimizer_state
                if world.main:
                    _log_warm_start(tracked, warm)
            else:
                warm, optimizer_state = None, None
                draft = new_drafter(load_text_config(cfg.target), cfg.train.draft, aux_layers,
                                    embedding, d2t, t2d, cfg.seed)
            simulator = (_simulator(cfg, eval_samples, states) if cfg.train.simulate.every and world.main else None)
        resume = (resume_point(f"train@{init}", {"params": cfg.stage_digest(), "inputs": tracked.input_md5s})
                  if world.main else None)
        saved = distributed.shared_resume(resume, world)
        if saved is not None and world.main:
            print(f"train@{init}: resuming at step {saved['step']} from {resume.path}", flush=True)
        recipe = Recipe(draft, train_samples, eval_samples, lm_head, cfg.train, cfg.seed, device, world,
                        optimizer_state, states)
        hooks = Hooks(log=lambda step, metrics: tracked.log_metrics(metrics, step),
                      checkpoint=(lambda state: resume.save(state.to_dict())) if resume else None,
                      probe=simulator, probe_every=cfg.train.simulate.every, desc=f"train@{init}")
        with tracked.phase("train"):
            result, state = train_drafter(recipe, hooks, TrainState.from_dict(saved) if saved is not None else None)
        if not world.main:
            return
        out_dir = Path(cfg.train.out_dir) / init
        with atomic_dir(out_dir) as out:
            save_drafter(draft.cpu(), out, state.to_dict())
        resume.clear()
        _write_plots(destination(tracked, PLOTS_DIR), init, result.history)
        tracked.log_drafter_model(out_dir, init, {"target": cfg.target.id, "target.revision": str(cfg.target.revision)})
        record(tracked, f"train-{init}", {
            "steps": result.steps, "draft_params": sum(p.numel() for p in draft.parameters() if p.requires_grad),
            "train_tokens": result.tokens, "steps_per_s": round(result.steps_per_s, 2),
            "tokens_per_s": round(result.tokens_per_s, 1), "padding_share": round(result.padding_share, 4),
            "simulator_s": round(result.probe_s, 1), "first_step_s": round(result.first_step_s, 2),
            **({"skipped_nonfinite": len(states.nonfinite)} if online else {}),
            **{key: round(value, 4) for key, value in result.final.items()},  # eval/..., sim/...
            **(_warm_start_metrics(warm) if warm else {}),
        })


def _online_states(cfg: Config, device, samples: int, engine: ExitStack) -> TargetStates:
    """The target beside the drafter, or a vLLM server capturing its states (the one at train.online_url, or one
    started here and stopped when `engine` closes)."""
    if cfg.train.online_engine == "hf":
        target = load_target(cfg.target)
        aux_layers = resolve_aux_layers(cfg.target.aux_layers, model_text_config(target).num_hidden_layers)
        return TargetStates(target, aux_layers, device, samples, cfg.extract.max_nonfinite_fraction)
    if cfg.train.online_url is not None:
        engine_states = EngineStates(cfg.train.online_url, target_layout(cfg.target))
    else:
        WORK_DIR.mkdir(exist_ok=True)
        captured = Path(engine.enter_context(tempfile.TemporaryDirectory(prefix="captured-", dir=WORK_DIR)))
        engine_states = engine.enter_context(capturing_server(cfg.target, cfg.vllm, "train-online", captured))
    return EngineTargetStates(engine_states, device, samples, cfg.extract.max_nonfinite_fraction)


def _simulator(cfg: Config, eval_samples: list[dict], online: TargetStates | None) -> Callable:
    """The acceptance simulator on the first held-out prompts: it needs the whole target beside training (online,
    the one already there, taken in turn with the thread that asks it for hidden states)."""
    simulate = cfg.train.simulate
    prompts = held_out_prompts([{k: s[k].tolist() for k in ("input_ids", "loss_mask")} for s in eval_samples],
                               simulate.prompts)
    if not prompts:
        raise InputError(f"train.simulate: the held-out split ({cfg.prepare.out_dir}/eval) has no sample with an "
                         f"assistant turn to measure acceptance on; raise data.eval_fraction or set "
                         f"train.simulate.every to 0")
    tokenizer = load_tokenizer(cfg.target)
    in_process = online is not None and online.model is not None
    simulator = AcceptanceSimulator(online.model if in_process else load_target(cfg.target), prompts,
                                    SpecSettings(k=simulate.k), simulate.max_new_tokens, {tokenizer.eos_token_id},
                                    cfg.seed)
    if not in_process:
        return simulator

    def in_turn(draft):
        with online.lock:
            return simulator(draft)
    return in_turn


def _log_warm_start(tracked, warm: WarmStart) -> None:
    print(warm.compat.render(), flush=True)
    if warm.compat.verdict == "needs_new_head":
        print("train@warm_start: " + (f"re-headed on this data's draft vocabulary ({warm.remapped_rows} new rows)"
                                      if warm.vocab == "remap" else
                                      "warning: fine-tuning with the source's draft vocabulary as it is "
                                      "(train.warm_start_vocab: keep)"), flush=True)
    tracked.set_tags({"eagle3ops.warm_start.sha256": warm.sha256, "eagle3ops.warm_start.compat": warm.compat.verdict,
                      "eagle3ops.warm_start.vocab": warm.vocab})
    with tempfile.TemporaryDirectory() as tmp:
        write_json_atomic(Path(tmp) / "compat.json", warm.compat.to_dict())
        tracked.log_artifact(Path(tmp) / "compat.json")


def _warm_start_metrics(warm: WarmStart) -> dict:
    """Its draft-vocabulary coverage of the new data and, re-headed, the rows that are new (its digest and the
    check's verdict are tags of the run)."""
    return {"warm_start_coverage": warm.compat.draft_vocab_coverage,
            **({"remapped_rows": warm.remapped_rows} if warm.remapped_rows is not None else {})}


def _write_plots(directory: Path, init: str, history: list[dict]) -> None:
    """plots/train-<init>.csv (the logged training rows) and plots/sim-<init>.csv (the simulator's): apart, so
    neither has empty cells for `dvc plots` to draw as zeros."""
    directory.mkdir(parents=True, exist_ok=True)
    trained = [{k: v for k, v in row.items() if not k.startswith("sim/")} for row in history if "train/loss" in row]
    simulated = [{k: v for k, v in row.items() if k == "step" or k.startswith("sim/")} for row in history
                 if "sim/tau" in row]
    pd.DataFrame(trained).to_csv(directory / f"train-{init}.csv", index=False)
    pd.DataFrame(simulated, columns=list(simulated[0]) if simulated else ["step", "sim/tau"]).to_csv(
        directory / f"sim-{init}.csv", index=False)
