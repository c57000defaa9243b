"""Stage `extract`: run the target over the prepared samples and store the drafter's inputs in shards.

Resumable: shards are built under `.eagle3ops/resume/` (keyed by params and input md5s, see resume.py); a run
killed midway keeps its complete shards and the next run continues after them. The finished directory is
moved to `extract.out_dir` only at the end.
"""
import shutil
from pathlib import Path

from eagle3ops.config import Config
from eagle3ops.data.prepare import read_tokenized
from eagle3ops.data.shards import MANIFEST, read_manifest
from eagle3ops.extraction import extract_features
from eagle3ops.metrics import record
from eagle3ops.modeling.target import load_target, model_size, resolve_aux_layers
from eagle3ops.resume import resume_point
from eagle3ops.tracking import params_digest, stage_run

SPLITS = ("train", "eval")


def run(cfg: Config) -> None:
    prepared = Path(cfg.prepare.out_dir)
    with stage_run(cfg, "extract", inputs=[prepared, cfg.target.path]) as tracked:
        with tracked.phase("load"):
            model = load_target(cfg.target)
        aux_layers = resolve_aux_layers(cfg.target.aux_layers, model.config.num_hidden_layers)
        work = resume_point("extract", {"params": params_digest(cfg), "inputs": tracked.input_md5s}).path.with_suffix("")
        samples, tokens, seconds, skipped = 0, 0, 0.0, 0  # tokens and seconds: the work this run did
        with tracked.phase("extract"):
            for split in SPLITS:
                if (work / split / MANIFEST).is_file():  # finished before an interruption
                    samples += read_manifest(work / split)["samples"]
                    continue
                result = extract_features(model, read_tokenized(prepared / split), aux_layers, work / split,
                                          cfg.extract.batch_size, cfg.extract.samples_per_shard, cfg.extract.dtype,
                                          meta={"target": cfg.target.path, "split": split}, desc=f"extract {split}",
                                          resumable=True, max_nonfinite_fraction=cfg.extract.max_nonfinite_fraction)
                samples, tokens, seconds = samples + result.samples, tokens + result.tokens, seconds + result.wall_s
                skipped += len(result.nonfinite)
        out = Path(cfg.extract.out_dir)
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(work), str(out))  # a rename, or a copy when the resume area is on another disk
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        record(tracked, "extract", {**model_size(model), "samples": samples, "bytes": size, "aux_layers": aux_layers,
                                    "skipped_nonfinite": skipped,
                                    "tokens": sum(read_manifest(out / split)["tokens"] for split in SPLITS),
                                    "tokens_per_s": round(tokens / seconds, 1) if seconds else None})
