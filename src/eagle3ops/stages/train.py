"""Stage `train@<init>`: train the drafter from scratch, or fine-tune an existing one (warm start)."""
from pathlib import Path

import pandas as pd
from safetensors.torch import load_file
from transformers import AutoConfig

from eagle3ops.config import Config
from eagle3ops.data.shards import read_manifest
from eagle3ops.formats.specforge import CheckpointError, load_drafter, save_drafter
from eagle3ops.fs import atomic_dir
from eagle3ops.metrics import PLOTS_DIR, record
from eagle3ops.modeling.target import default_aux_layers, load_embedding_and_head, resolve_device
from eagle3ops.stages.prepare import VOCAB_MAP
from eagle3ops.resume import resume_point
from eagle3ops.tracking import params_digest, stage_run
from eagle3ops.training import load_feature_samples, new_drafter, train_drafter


def run(cfg: Config, init: str) -> None:
    features = Path(cfg.extract.out_dir)
    inputs = [features, cfg.prepare.out_dir, cfg.target.path] + ([cfg.train.warm_start] if init == "warm_start" else [])
    with stage_run(cfg, "train", variant=init, inputs=inputs) as tracked:
        with tracked.phase("load"):
            embedding, lm_head = load_embedding_and_head(cfg.target.path)
            aux_layers = read_manifest(features / "train")["aux_layers"]
            if init == "warm_start":
                draft = load_drafter(cfg.train.warm_start, embedding)  # keeps the drafter's own d2t/t2d
                trained_on = draft.cfg.aux_layers or default_aux_layers(AutoConfig.from_pretrained(cfg.target.path).num_hidden_layers)
                if trained_on != aux_layers:
                    raise CheckpointError(
                        f"{cfg.train.warm_start}: the drafter was trained on target layers {trained_on} (HF hidden-state "
                        f"indices) but {features} holds layers {aux_layers}; set target.aux_layers to {trained_on}")
            else:
                vocab = load_file(str(Path(cfg.prepare.out_dir) / VOCAB_MAP))
                draft = new_drafter(AutoConfig.from_pretrained(cfg.target.path), cfg.train.draft, aux_layers,
                                    embedding, vocab["d2t"], vocab["t2d"], cfg.seed)
            train_samples = load_feature_samples(features / "train", embedding.shape[1])
            eval_samples = load_feature_samples(features / "eval", embedding.shape[1])
        resume = resume_point(f"train@{init}", {"params": params_digest(cfg), "inputs": tracked.input_md5s})
        resumed = resume.load()
        if resumed is not None:
            print(f"train@{init}: resuming at step {resumed['step']} from {resume.path}", flush=True)
        with tracked.phase("train"):
            result, state = train_drafter(draft, train_samples, eval_samples, lm_head, cfg.train, cfg.seed,
                                          resolve_device(cfg.target.device), log=lambda step, m: tracked.log_metrics(m, step),
                                          state=resumed, checkpoint=resume.save, desc=f"train@{init}")
        out_dir = Path(cfg.train.out_dir) / init
        with atomic_dir(out_dir) as out:
            save_drafter(draft.cpu(), out, state)
        resume.clear()
        pd.DataFrame(result.history).to_csv(_plot_path(init), index=False)
        tracked.log_artifact(out_dir, "drafter")
        record(tracked, f"train-{init}", {
            "init": init, "steps": result.steps, "ttt_steps": cfg.train.ttt_steps,
            "draft_params": sum(p.numel() for p in draft.parameters() if p.requires_grad), "train_tokens": result.tokens,
            "steps_per_s": round(result.steps_per_s, 2), "tokens_per_s": round(result.tokens_per_s, 1),
            **{key.replace("/", "_"): round(value, 4) for key, value in result.final.items()},
        })


def _plot_path(init: str) -> Path:
    PLOTS_DIR.mkdir(exist_ok=True)
    return PLOTS_DIR / f"train-{init}.csv"
