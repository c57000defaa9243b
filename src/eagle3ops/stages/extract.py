"""Stage `extract`: the drafter's inputs for the prepared samples, in shards.

extract.backend hf runs the target over the prepared samples (extraction/hf.py); vllm has a vLLM server of the target
capture them (extraction/vllm.py); import takes the hidden states a serving engine extracted with speculators or
SpecForge (extraction/imported.py). All three write the same shards.

Resumable: shards are built under `.eagle3ops/resume/` (keyed by params and input md5s, see resume.py); a run
killed midway keeps its complete shards and the next run continues after them. The finished directory is
moved to `extract.out_dir` only at the end.
"""
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from eagle3ops.config import Config
from eagle3ops.data.prepare import SPLITS, read_tokenized
from eagle3ops.data.shards import MANIFEST, read_manifest
from eagle3ops.extraction.hf import ExtractResult, extract_features
from eagle3ops.extraction.imported import checkpoint_size, import_features, open_source, plan_import
from eagle3ops.extraction.vllm import capture_layer_ids, capturing_server, extract_features_vllm
from eagle3ops.modeling.target import load_target, model_size, model_text_config, resolve_aux_layers, target_layout
from eagle3ops.resume import resume_point
from eagle3ops.tracking.identity import identity_params
from eagle3ops.tracking.metrics import record
from eagle3ops.tracking.run import stage_run
from eagle3ops.tracking.stage_view import stage_digest


def run(cfg: Config) -> None:
    prepared = Path(cfg.prepare.out_dir)
    importing = cfg.extract.backend == "import"
    inputs = [prepared, cfg.target.path, *([cfg.extract.import_dir] if importing else [])]
    with stage_run(cfg, "extract", inputs=inputs, extra_params=identity_params(cfg.target)) as tracked:
        work = resume_point("extract", {"params": stage_digest(cfg), "inputs": tracked.input_md5s}).path.with_suffix("")
        produce = {"hf": _extract, "vllm": _extract_vllm, "import": _import}[str(cfg.extract.backend)]
        counters = produce(cfg, prepared, work, tracked)
        out = Path(cfg.extract.out_dir)
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(work), str(out))  # a rename, or a copy when the resume area is on another disk
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        record(tracked, "extract", {**counters, "bytes": size,
                                    "tokens": sum(read_manifest(out / split)["tokens"] for split in SPLITS)})


def _extract(cfg: Config, prepared: Path, work: Path, tracked) -> dict:
    with tracked.phase("load"):
        model = load_target(cfg.target)
    aux_layers = resolve_aux_layers(cfg.target.aux_layers, model_text_config(model).num_hidden_layers)
    with tracked.phase("extract"):
        counters = _each_split(work, lambda split: extract_features(
            model, read_tokenized(prepared / split), aux_layers, work / split, cfg.extract.batch_size,
            cfg.extract.samples_per_shard, cfg.extract.dtype, meta={"target": cfg.target.path, "split": split},
            desc=f"extract {split}", resumable=True, max_nonfinite_fraction=cfg.extract.max_nonfinite_fraction))
    tracked.set_tags({"eagle3ops.aux_layers": str(aux_layers)})
    return {**model_size(model), **counters}


def _extract_vllm(cfg: Config, prepared: Path, work: Path, tracked) -> dict:
    captured = work / "captured"  # each request's file, deleted once read
    with ExitStack() as server:
        with tracked.phase("load"):  # the server's start: the engine loading the target
            states = server.enter_context(capturing_server(cfg.target, cfg.vllm, "extract", captured))
        with tracked.phase("extract"):
            counters = _each_split(work, lambda split: extract_features_vllm(
                states, read_tokenized(prepared / split), work / split, cfg.extract.batch_size,
                cfg.extract.samples_per_shard, cfg.extract.dtype, meta={"target": cfg.target.path, "split": split},
                desc=f"extract {split} on vLLM", resumable=True,
                max_nonfinite_fraction=cfg.extract.max_nonfinite_fraction))
    shutil.rmtree(captured, ignore_errors=True)
    tracked.set_tags({"eagle3ops.aux_layers": str(states.layout.aux_layers),
                      "eagle3ops.extract.vllm_layer_ids": str(capture_layer_ids(states.layout))})
    return {**checkpoint_size(cfg.target.path), **counters}


def _import(cfg: Config, prepared: Path, work: Path, tracked) -> dict:
    layout = target_layout(cfg.target)
    source = open_source(cfg.extract.import_dir, cfg.extract.import_format, layout)
    origin = {"format": source.name, "dir": str(cfg.extract.import_dir), "layer_ids": source.layer_ids,
              "layer_id_convention": source.convention}
    with tracked.phase("import"):  # not "extract": the projection must not take a file copy for target forwards
        plan = plan_import(source, prepared, cfg.extract.max_nonfinite_fraction)
        counters = _each_split(work, lambda split: import_features(
            source, plan.splits[split], work / split, cfg.extract.samples_per_shard, cfg.extract.dtype,
            meta={"target": cfg.target.path, "split": split, "source": origin}, desc=f"import {split}",
            resumable=True, max_nonfinite_fraction=cfg.extract.max_nonfinite_fraction))
    tracked.set_tags({"eagle3ops.aux_layers": str(layout.aux_layers), "eagle3ops.import.format": source.name,
                      "eagle3ops.import.layer_ids": str(source.layer_ids)})  # the manifests record them too
    return {**checkpoint_size(cfg.target.path), **counters, "missing": plan.missing,
            "loss_mask_differs": plan.loss_mask_differs}


def _each_split(work: Path, produce: Callable[[str], ExtractResult]) -> dict:
    """`produce` each split not finished before an interruption; tokens and seconds count this run's work."""
    samples, tokens, seconds, skipped = 0, 0, 0.0, 0
    for split in SPLITS:
        if (work / split / MANIFEST).is_file():  # finished before an interruption
            samples += read_manifest(work / split)["samples"]
            continue
        result = produce(split)
        samples, tokens, seconds = samples + result.samples, tokens + result.tokens, seconds + result.wall_s
        skipped += len(result.nonfinite)
    return {"samples": samples, "skipped_nonfinite": skipped,
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None}
