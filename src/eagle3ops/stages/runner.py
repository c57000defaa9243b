"""The way from `eagle3ops <stage>` to the stage's module: what every stage run goes through.

cli.py's command table hands each stage command here as a StageCall; run_stage then, in order:
1. ends the stage with the `dvc` that started it (serving/server.py, end_with_parent);
2. reads params.yaml as the stage's dvc.yaml entry lets it (tracking/stage_view.py: only the keys it declares);
3. sets the machine up before anything computes: the reproducible CPU kernels and threads, the GPU's deterministic
   settings (reproducible.py);
4. marks a one-off run (`--set`, `--params`: recorded, but the pipeline's metrics and champion stay);
5. holds a CPU slot while a stage that computes runs on a machine without a GPU (cpu_share.py);
6. runs the stage module's `run(cfg)` (or `run(cfg, variant)` for train@scratch, eval@baseline, ...): stage_function
   is the table, each module imported by name (and only then: `eagle3ops --help` loads none);
7. where it fails under `dvc repro`, puts back what DVC removed before running it.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from eagle3ops.config import load_config

# The stages that compute with torch: on a machine without a GPU each holds a CPU slot (cpu_share.py) while it runs
CPU_BOUND_STAGES = ("zoo", "generate", "target_speed", "extract", "train", "eval")


@dataclass(frozen=True)
class StageCall:
    """A stage as the command line names it: `eagle3ops train --init scratch --set train.lr=1e-3`."""
    stage: str
    variant: str | None = None  # train --init, eval --drafter
    params: str = "params.yaml"
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """As dvc.yaml names it: train@scratch."""
        return f"{self.stage}@{self.variant}" if self.variant else self.stage


def run_stage(call: StageCall) -> int:
    """Run the stage (module docstring); 0, or the exception of a stage that failed."""
    try:
        _run(call)
    except BaseException:
        _put_back_outputs(call.name)
        raise
    return 0


def _run(call: StageCall) -> None:
    from eagle3ops.serving.server import end_with_parent
    from eagle3ops.tracking.lineage import declared_params
    from eagle3ops.tracking.metrics import ONE_OFF_DIR
    from eagle3ops.tracking.run import ONE_OFF
    from eagle3ops.tracking.stage_view import for_stage
    from eagle3ops.tracking.store import project_root

    end_with_parent()
    cfg = load_config(call.params, call.overrides)
    declared = declared_params(project_root(), call.name, Path(call.params).name)
    if declared is not None:  # a stage of this project's dvc.yaml: it reads only what that declares
        cfg = for_stage(cfg, call.name, declared)
    if cfg.cpu_reproducible:  # before the stage computes anything: the kernels are chosen at their first use
        from eagle3ops.reproducible import pin_cpu_kernels

        pin_cpu_kernels(cfg.threads)
    elif cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    if cfg.gpu_deterministic:
        from eagle3ops.reproducible import make_gpu_deterministic

        make_gpu_deterministic()
    one_off = one_off_reason(call)
    if one_off:
        print(f"eagle3ops {call.name}: a one-off run ({one_off}): its metrics and plots go to {ONE_OFF_DIR}/, not "
              f"the pipeline's, and no drafter is registered", file=sys.stderr, flush=True)
    run = stage_function(call.stage)
    token = ONE_OFF.set(one_off)
    try:
        with _cores_for(call.name):
            run(cfg, call.variant) if call.variant else run(cfg)
    finally:
        ONE_OFF.reset(token)


def stage_function(stage: str) -> Callable[..., None]:
    """The `run` of dvc.yaml's stage `stage`: the module of the same name in eagle3ops.stages."""
    match stage:
        case "zoo":
            from eagle3ops.stages import zoo as module
        case "generate":
            from eagle3ops.stages import generate as module
        case "target_speed":
            from eagle3ops.stages import target_speed as module
        case "prepare":
            from eagle3ops.stages import prepare as module
        case "extract":
            from eagle3ops.stages import extract as module
        case "train":
            from eagle3ops.stages import train as module
        case "eval":
            from eagle3ops.stages import eval as module
        case "export":
            from eagle3ops.stages import export as module
        case "report":
            from eagle3ops.stages import report as module
        case _:
            raise ValueError(f"no stage {stage!r}")
    return module.run


def computes(name: str) -> bool:
    """Whether the stage `name` (as dvc.yaml names it: train@scratch) computes with torch."""
    return name.partition("@")[0] in CPU_BOUND_STAGES


def _cores_for(name: str) -> AbstractContextManager:
    """A CPU slot for the stage `name` while it runs, where it computes on this machine's CPU (cpu_share.py)."""
    import torch

    from eagle3ops.cpu_share import cpu_slot

    if not computes(name) or torch.cuda.is_available():
        return nullcontext()
    return cpu_slot(f"eagle3ops {name}", torch.get_num_threads())


def one_off_reason(call: StageCall) -> str | None:
    """Why this stage run is not the pipeline's: overrides on the command line, or another params file."""
    from eagle3ops.tracking.store import project_root

    if call.overrides:
        return " ".join(f"--set {item}" for item in call.overrides)
    if Path(call.params).resolve() != (project_root() / "params.yaml").resolve():
        return f"--params {call.params}"
    return None


def _put_back_outputs(name: str) -> None:
    from eagle3ops.tracking.lineage import put_back_outputs
    from eagle3ops.tracking.store import project_root

    dvc_stage = os.environ.get("DVC_STAGE", "")  # the one-item foreach extract@offline runs `eagle3ops extract`
    if name not in (dvc_stage, dvc_stage.partition("@")[0]):  # run by hand: nothing was removed
        return
    name = dvc_stage
    put_back, cached = put_back_outputs(project_root(), name)
    if put_back:
        print(f"eagle3ops {name}: put back the last run's {', '.join(put_back)}", file=sys.stderr)
    if cached:
        print(f"eagle3ops {name}: DVC removed {', '.join(cached)} before running the stage; `dvc checkout "
              f"{' '.join(cached)}` restores the last run's from the cache, and once the change is undone `dvc "
              f"repro` takes all of the stage's outputs from DVC's run cache without running it", file=sys.stderr)
