"""Stage `train@<init>`: train the drafter from scratch, or fine-tune an existing one (warm start).

train.hidden_states offline reads the target's hidden states from the extract stage's shards (extract.out_dir); online
runs the target beside the drafter for them (training/inputs.py), and dvc.yaml wires the stage to the prepared data
and the target instead (the `pipeline` keys of params.yaml).

Under torchrun every rank runs this stage on its share of each global batch (training/distributed.py); rank 0 alone logs
to MLflow and writes the resume points, the drafter, metrics and plots.
"""
import tempfile
from contextlib import ExitStack, nullcontext
from pathlib import Path

import pandas as pd

from eagle3ops.config import Config
from eagle3ops.errors import InputError
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.fs import atomic_dir, probe_writable, write_json_atomic
from eagle3ops.modeling.target import resolve_device
from eagle3ops.resume import RESUME_DIR, resume_point
from eagle3ops.tracking.identity import identity_params
from eagle3ops.tracking.metrics import PLOTS_DIR, destination, record
from eagle3ops.tracking.run import Untracked, stage_run
from eagle3ops.tracking.stage_view import stage_digest
from eagle3ops.training import compile_cache, distributed
from eagle3ops.training.init import WarmStart
from eagle3ops.training.inputs import acceptance_simulator, initial_drafter, load_inputs
from eagle3ops.training.loop import Hooks, Recipe, TrainState, train_drafter


def run(cfg: Config, init: str) -> None:
    if distributed.launched_world().main:  # rank 0 writes: a place it cannot write fails before any work
        probe_writable(cfg.train.out_dir, RESUME_DIR)
    with distributed.process_group(resolve_device(cfg.target.device)) as (world, device):
        _run(cfg, init, world, device)


def _run(cfg: Config, init: str, world: distributed.World, device) -> None:
    online = cfg.train.hidden_states == "online"
    if online and world.size > 1:
        raise InputError("train.hidden_states online runs in one process (the target beside the drafter, on its own "
                         "GPUs with target.device_map): launch it without torchrun")
    inputs = ([] if online else [cfg.extract.out_dir]) + [cfg.prepare.out_dir, cfg.target.path] + (
        [cfg.train.warm_start] if init == "warm_start" else [])
    tracking = (stage_run(cfg, "train", variant=init, inputs=inputs, extra_params=identity_params(cfg.target))
                if world.main else nullcontext(Untracked()))
    with tracking as tracked, ExitStack() as engine:
        if world.main:
            tracked.set_tags({"eagle3ops.hidden_states": str(cfg.train.hidden_states),
                              **({"eagle3ops.online_engine": str(cfg.train.online_engine)} if online else {})})
        with tracked.phase("load"):
            loaded = load_inputs(cfg, device, engine)
            draft, warm = initial_drafter(cfg, init, loaded, device)
            if warm and world.main:
                _log_warm_start(tracked, warm)
            simulator = acceptance_simulator(cfg, loaded) if cfg.train.simulate.every and world.main else None
        resume = (resume_point(f"train@{init}", {"params": stage_digest(cfg), "inputs": tracked.input_md5s})
                  if world.main else None)
        carried = compile_cache.last_entries(f"train@{init}")
        if device.type == "cuda":
            state, line = compile_cache.load(carried)
            print(f"train@{init}: {line}", flush=True)
            if world.main:
                tracked.set_tags({"eagle3ops.compile_cache": state})
        saved = distributed.shared_resume(resume, world)
        if saved is not None and world.main:
            print(f"train@{init}: resuming at step {saved['step']} from {resume.path}", flush=True)
        recipe = Recipe(draft, loaded.train_samples, loaded.eval_samples, loaded.lm_head, cfg.train, cfg.seed, device,
                        world, warm.optimizer_state if warm else None, loaded.states)
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
        if saved_line := compile_cache.save(compile_cache.stage_output(f"train@{init}"), carried):
            print(f"train@{init}: {saved_line}", flush=True)
        _write_plots(destination(tracked, PLOTS_DIR), init, result.history)
        tracked.log_drafter_model(out_dir, init, {"target": cfg.target.id, "target.revision": str(cfg.target.revision)})
        record(tracked, f"train-{init}", {
            "steps": result.steps, "draft_params": sum(p.numel() for p in draft.parameters() if p.requires_grad),
            "train_tokens": result.tokens, "steps_per_s": round(result.steps_per_s, 2),
            "tokens_per_s": round(result.tokens_per_s, 1), "padding_share": round(result.padding_share, 4),
            "simulator_s": round(result.probe_s, 1), "first_step_s": round(result.first_step_s, 2),
            **({"skipped_nonfinite": len(loaded.states.nonfinite)} if online else {}),
            **{key: round(value, 4) for key, value in result.final.items()},  # eval/..., sim/...
            **(_warm_start_metrics(warm) if warm else {}),
        })


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
