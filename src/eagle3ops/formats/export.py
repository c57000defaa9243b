"""A drafter (any layout eagle3ops reads) written the way a serving engine loads it, for one target.

    sglang       our native layout (LlamaForCausalLMEagle3), layer ids in SGLang's convention; SGLang's
                 --speculative-draft-model-path reads it
    speculators  vllm-project/speculators (Eagle3Speculator), layer ids in vLLM's convention; `vllm serve DIR`
                 or vLLM's --speculative-config reads it

For the target: the layer ids are always written (a drafter whose config names none gets the engines' default
for this target), max_position_embeddings is raised to the target's when shorter (it only sizes the rotary
cache and the context limit; too small a value collapses acceptance on long prompts), and the speculators
layout names the target as its verifier. The drafter's rope settings are its own and stay as trained, and so
does its provenance (the eagle3ops record, formats/specforge.py: check-compat reads it). The
export is validated before it is moved into place: one that would not load, or would feed the drafter other
layers than it was trained on, is never written.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from safetensors.torch import save_file

from eagle3ops.config import DType, ExportFormat, VllmConfig
from eagle3ops.errors import InputError
from eagle3ops.formats.checkpoint import read_drafter, read_json
from eagle3ops.formats.conventions import CONVENTIONS, from_hf
from eagle3ops.formats.specforge import WEIGHTS, CheckpointError, dtype_name, write_checkpoint
from eagle3ops.formats.speculators import to_speculators_config, to_speculators_names
from eagle3ops.formats.validate import EXPORT_RECORD, LAYOUT_CONVENTION, ExportReport, validate_export
from eagle3ops.fs import EXPORT, atomic_dir, write_json_atomic
from eagle3ops.modeling.draft import DraftConfig
from eagle3ops.modeling.target import DTYPES as TORCH_DTYPES
from eagle3ops.modeling.target import check_model_dir, default_aux_layers, text_config_checked


def export_drafter(drafter_dir: str | Path, out_dir: str | Path, fmt: str, target_dir: str | Path,
                   speculative_tokens: int = 3, dtype: str | None = None,
                   served_as: str | Path | None = None, vllm: VllmConfig | None = None) -> ExportReport:
    """Write the drafter in `drafter_dir` to `out_dir` in layout `fmt` for the target in `target_dir`; returns the
    validation report (warnings, notes, launch commands). `dtype`: cast the weights (None: keep them).
    `served_as`: the path the launch commands name, when `out_dir` is moved there afterwards."""
    if fmt not in list(ExportFormat):
        raise InputError(f"export format {fmt!r} is not one of {[str(f) for f in ExportFormat]}")
    if dtype is not None and dtype not in list(DType):
        raise InputError(f"export dtype {dtype!r} is not one of {[str(d) for d in DType]}")
    if speculative_tokens < 1:
        raise InputError(f"speculative tokens must be at least 1, got {speculative_tokens}")
    checkpoint = read_drafter(drafter_dir)
    target = text_config_checked(target_dir)
    source = checkpoint.cfg
    aux = source.aux_layers or default_aux_layers(target["num_hidden_layers"])
    cfg = replace(source, aux_layers=list(aux),
                  max_position_embeddings=max(source.max_position_embeddings,
                                              target.get("max_position_embeddings") or 0))
    tensors = {name: t.to(TORCH_DTYPES[dtype]) if dtype and t.is_floating_point() else t
               for name, t in checkpoint.weights.items()}
    convention = LAYOUT_CONVENTION[fmt]
    record = {"format": fmt, "source": str(drafter_dir), "source_layout": checkpoint.layout,
              "trained_aux_layers_hf": list(aux), "eagle_aux_hidden_state_layer_ids": from_hf(aux, convention),
              "convention": CONVENTIONS[convention]}
    with atomic_dir(out_dir, EXPORT) as out:  # replaces a previous export only
        if fmt == "sglang":
            write_checkpoint(cfg, tensors, out, checkpoint.rope_scaling, checkpoint.provenance)
        else:
            if cfg.draft_vocab_size == cfg.vocab_size:
                tensors = _without_identity_map(tensors, drafter_dir)
            architectures = read_json(check_model_dir(target_dir) / "config.json").get("architectures") or []
            config = to_speculators_config(cfg, dtype_name(tensors["fc.weight"].dtype), checkpoint.rope_scaling,
                                           str(target_dir), architectures, speculative_tokens,
                                           checkpoint.provenance)
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            save_file(to_speculators_names(tensors), str(out / WEIGHTS), metadata={"format": "pt"})
        write_json_atomic(out / EXPORT_RECORD, record)
        report = validate_export(out, fmt, target_dir, served_as=served_as or out_dir, vllm=vllm)
        if not report.ok:
            raise CheckpointError(f"{drafter_dir}: its {fmt} export for {target_dir} would not serve correctly; "
                                  f"nothing written:\n  " + "\n  ".join(report.errors))
    report.notes[:0] = checkpoint.notes + _changes(source, cfg, convention)
    return report


def _without_identity_map(tensors: dict, drafter_dir: str | Path) -> dict:
    """A drafter over the whole target vocabulary, for vLLM: without d2t/t2d, which vLLM 0.32 has no parameter
    for then (it refuses to load them). Only the identity map can go: vLLM reads lm_head row i as target id i."""
    if tensors["d2t"].any():
        raise CheckpointError(f"{drafter_dir}: its draft vocabulary is the whole target vocabulary in another order; "
                              f"vLLM keeps no vocabulary map for such a drafter and would read lm_head row i as "
                              f"target id i; nothing written")
    return {name: t for name, t in tensors.items() if name not in ("d2t", "t2d")}


def _changes(source: DraftConfig, cfg: DraftConfig, convention: str) -> list[str]:
    notes = [f"layer ids {from_hf(cfg.aux_layers, convention)} written in {CONVENTIONS[convention]} (HF indices "
             f"{cfg.aux_layers}" + (")" if source.aux_layers else ": the drafter's config named none, so the "
                                    "engines' default for this target)")]
    if convention == "vllm" and cfg.draft_vocab_size == cfg.vocab_size:
        notes.append("d2t/t2d left out: the draft vocabulary is the whole target vocabulary (the identity map), "
                     "and vLLM refuses a vocabulary map then")
    if cfg.max_position_embeddings != source.max_position_embeddings:
        notes.append(f"max_position_embeddings raised from {source.max_position_embeddings} to the target's "
                     f"{cfg.max_position_embeddings}")
    return notes


def serving_guide(reports: dict[str, ExportReport], drafter_dir: str | Path, target_dir: str | Path) -> str:
    """SERVING.md: per exported layout, the commands that serve it and what the validation said."""
    lines = ["# Serving the exported drafter", "",
             f"Drafter `{drafter_dir}`, exported for the target `{target_dir}` and validated against it "
             f"(`eagle3ops validate-export DIR --target {target_dir} --serve` checks it again and serves it once). "
             f"The commands name this checkout's absolute paths and the Python of the environment that exported "
             f"it: they run as they are from any directory of this machine, serving on 127.0.0.1:8000.", ""]
    for fmt, report in reports.items():
        lines += [f"## {fmt}: `{report.directory}`", "", "```bash", *report.commands, "```", ""]
        lines += [f"- warning: {w}" for w in report.warnings] + [f"- {n}" for n in report.notes] + [""]
    return "\n".join(lines)
