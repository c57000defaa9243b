"""Stage `extract`: run the target over the prepared samples and store the drafter's inputs in shards."""
from pathlib import Path

from eagle3ops.config import Config
from eagle3ops.data.prepare import read_tokenized
from eagle3ops.extraction import extract_features
from eagle3ops.fs import atomic_dir
from eagle3ops.metrics import record
from eagle3ops.modeling.target import load_target, model_size, resolve_aux_layers
from eagle3ops.tracking import stage_run


def run(cfg: Config) -> None:
    prepared = Path(cfg.prepare.out_dir)
    with stage_run(cfg, "extract", inputs=[prepared, cfg.target.path]) as tracked:
        with tracked.phase("load"):
            model = load_target(cfg.target.path, cfg.target.dtype, cfg.target.device)
        aux_layers = resolve_aux_layers(cfg.target.aux_layers, model.config.num_hidden_layers)
        totals = {"samples": 0, "tokens": 0, "seconds": 0.0}
        with tracked.phase("extract"), atomic_dir(cfg.extract.out_dir) as out:
            for split in ("train", "eval"):
                result = extract_features(model, read_tokenized(prepared / split), aux_layers, out / split,
                                          cfg.extract.batch_size, cfg.extract.samples_per_shard, cfg.extract.dtype,
                                          meta={"target": cfg.target.path, "split": split}, desc=f"extract {split}")
                totals["samples"] += result.samples
                totals["tokens"] += result.tokens
                totals["seconds"] += result.wall_s
        size = sum(f.stat().st_size for f in Path(cfg.extract.out_dir).rglob("*") if f.is_file())
        record(tracked, "extract", {**model_size(model), "samples": totals["samples"], "tokens": totals["tokens"],
                                    "tokens_per_s": round(totals["tokens"] / totals["seconds"], 1),
                                    "bytes": size, "aux_layers": aux_layers})
