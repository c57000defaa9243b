"""Drafter checkpoints in the layouts peers publish: which one a directory holds, reading any of them into our
DraftConfig and tensors, and importing one into our native layout.

    sglang        config.json + model.safetensors (fc, midlayer.*)   SpecForge, SGLang and ours (specforge.py)
    eagle         config.json + pytorch_model.bin                     the EAGLE authors' (eagle.py)
    speculators   config.json (Eagle3Speculator) + model.safetensors  vllm-project/speculators (speculators.py)

Whatever the layout, a read drafter has our parameter names (fc, midlayer.*, norm, lm_head, d2t, t2d), float32
weights, no embedding (it reads the target's), and a complete vocabulary map: a checkpoint with only one of
d2t/t2d gets the other derived from it; one with neither is accepted only when its draft vocabulary is the whole
target vocabulary (the identity map, as the EAGLE authors' code assumes). Anything that does not fit its config
is refused with every key named. What is known of how it was trained travels with it: its config's eagle3ops
record, or the layout it was read from (formats/specforge.py, PROVENANCE), which import_drafter and the export
write into their copies.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3ops.data.vocab import draft_to_target_ids
from eagle3ops.formats.conventions import rope_settings
from eagle3ops.formats.eagle import WEIGHTS_BIN, read_bin
from eagle3ops.formats.specforge import (
    PROVENANCE,
    TRAINING_STATE,
    WEIGHTS,
    CheckpointError,
    from_hf_config,
    load_drafter,
    new_with_embedding,
    read_weights,
    write_checkpoint,
)
from eagle3ops.formats.speculators import from_speculators_config, from_speculators_names
from eagle3ops.fs import IMPORTED_DRAFTER, atomic_dir, write_json_atomic
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft

LAYOUTS = {
    "sglang": "SpecForge / SGLang (LlamaForCausalLMEagle3: config.json + model.safetensors)",
    "eagle": "EAGLE authors' (SafeAILab/EAGLE: config.json + pytorch_model.bin)",
    "speculators": "vllm-project/speculators (Eagle3Speculator: config.json + model.safetensors)",
}


@dataclass
class RawCheckpoint:
    """A checkpoint directory as stored: its layout, config.json and tensors under their stored names."""
    directory: Path
    layout: str
    config: dict
    tensors: dict[str, torch.Tensor]

    @property
    def config_path(self) -> Path:
        return self.directory / "config.json"

    @property
    def weights_path(self) -> Path:
        return self.directory / (WEIGHTS_BIN if self.layout == "eagle" else WEIGHTS)


@dataclass
class DrafterCheckpoint:
    cfg: DraftConfig  # aux_layers: HF hidden-state indices; [] when the config names none (the engines' default)
    weights: dict[str, torch.Tensor]  # our names, float32, d2t int64, t2d bool, no embedding
    layout: str
    directory: Path
    rope_scaling: dict | None = None  # the drafter's own, as trained (our drafter applies plain rope)
    notes: list[str] = field(default_factory=list)  # what reading changed: a left-out embedding, a derived map
    # its config's eagle3ops record ({"carried_state": ...} for a drafter eagle3ops trained), or, with none,
    # {"source_layout": <layout>}: what a copy of it writes, so that a peer's drafter never passes for ours
    provenance: dict = field(default_factory=dict)


def read_json(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no config.json; not a drafter checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config


def _layout(directory: Path, config: dict) -> str:
    if "speculators_model_type" in config:
        return "speculators"
    if (directory / WEIGHTS).is_file():
        return "sglang"
    if (directory / WEIGHTS_BIN).is_file():
        return "eagle"
    raise CheckpointError(f"{directory}: neither {WEIGHTS} nor {WEIGHTS_BIN} beside config.json; not a drafter "
                          f"layout eagle3ops reads ({'; '.join(LAYOUTS.values())})")


def detect_layout(directory: str | Path) -> str:
    """'sglang', 'eagle' or 'speculators' (see LAYOUTS)."""
    directory = Path(directory)
    return _layout(directory, read_json(directory / "config.json"))


def read_raw(directory: str | Path) -> RawCheckpoint:
    directory = Path(directory)
    config = read_json(directory / "config.json")
    layout = _layout(directory, config)
    tensors = read_bin(directory / WEIGHTS_BIN) if layout == "eagle" else read_weights(directory)
    return RawCheckpoint(directory, layout, config, tensors)


def read_drafter(directory: str | Path) -> DrafterCheckpoint:
    """The drafter in `directory`, whatever its layout, as our DraftConfig and tensors."""
    return drafter_from_raw(read_raw(directory))


def load_any_drafter(directory: str | Path, embedding: torch.Tensor) -> Eagle3Draft:
    """A drafter from `directory` in any layout eagle3ops reads (see `detect_layout`), with the target's
    embedding [V, H] put in: what eval and a warm start load, so a peer's drafter needs no import step first."""
    if detect_layout(directory) == "sglang":
        draft = load_drafter(directory, embedding)
        _check_vocab_map(Path(directory) / WEIGHTS, draft.d2t, draft.t2d)
        return draft
    checkpoint = read_drafter(directory)
    draft = new_with_embedding(checkpoint.cfg, embedding, directory)
    draft.load_state_dict(checkpoint.weights, strict=False)  # read_drafter checked every name and shape
    return draft


def drafter_from_raw(raw: RawCheckpoint) -> DrafterCheckpoint:
    where = str(raw.config_path)
    if raw.layout == "speculators":
        cfg, rope_scaling = from_speculators_config(raw.config, where)
        tensors = from_speculators_names(raw.tensors, str(raw.weights_path))
    else:
        if raw.config.get("num_hidden_layers", 1) != 1:
            raise CheckpointError(f"{where}: num_hidden_layers is {raw.config['num_hidden_layers']}; eagle3ops' "
                                  f"drafter has one decoder layer")
        cfg, rope_scaling, tensors = from_hf_config(raw.config, where), rope_settings(raw.config)[1], dict(raw.tensors)
    notes: list[str] = []
    embedding = tensors.pop("embed_tokens.weight", None)
    if embedding is not None:
        notes.append(f"left out embed_tokens.weight {tuple(embedding.shape)}: the drafter reads the target's embedding")
    _complete_vocab_map(cfg, tensors, raw.weights_path, notes)
    _check_fit(cfg, tensors, raw)
    weights = {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}
    weights["d2t"], weights["t2d"] = weights["d2t"].long(), weights["t2d"].bool()
    _check_vocab_map(raw.weights_path, weights["d2t"], weights["t2d"])
    return DrafterCheckpoint(cfg, weights, raw.layout, raw.directory, rope_scaling, notes, provenance_of(raw))


def provenance_of(raw: RawCheckpoint) -> dict:
    """What is known of how the drafter in `raw` was trained: its config's eagle3ops record, or, where it has none
    (or not an object), the layout it is stored in."""
    record = raw.config.get(PROVENANCE)
    return dict(record) if isinstance(record, dict) and record else {"source_layout": raw.layout}


def _check_vocab_map(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    problems = vocab_map_problems(d2t, t2d)
    if problems:
        raise CheckpointError(f"{path}: inconsistent vocabulary map: {'; '.join(problems)}")


def _complete_vocab_map(cfg: DraftConfig, tensors: dict[str, torch.Tensor], path: Path, notes: list[str]) -> None:
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None and t2d is None:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise CheckpointError(f"{path}: no d2t/t2d, but the draft vocabulary ({cfg.draft_vocab_size}) is smaller "
                                  f"than the target's ({cfg.vocab_size}): which target token each lm_head row "
                                  f"predicts is unknown")
        tensors["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        notes.append("no d2t/t2d: the draft vocabulary is the whole target vocabulary; identity map written")
    elif t2d is None and d2t.dim() == 1 and not d2t.is_floating_point():
        ids = draft_to_target_ids(d2t.long())
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < cfg.vocab_size):
            raise CheckpointError(f"{path}: d2t maps draft ids outside the target vocabulary (0..{cfg.vocab_size - 1})")
        tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        notes.append("no t2d: derived from d2t")
    elif d2t is None and t2d.dim() == 1:
        ids = t2d.bool().nonzero().flatten()
        tensors["d2t"] = ids - torch.arange(ids.numel())
        notes.append("no d2t: derived from t2d")


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter of this config stores, with its shape (built on the meta device: no memory)."""
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    return {name: tuple(t.shape) for name, t in draft.state_dict().items() if not name.startswith("embed_tokens.")}


def _check_fit(cfg: DraftConfig, tensors: dict[str, torch.Tensor], raw: RawCheckpoint) -> None:
    expected = expected_shapes(cfg)
    problems = [f"{name}: {tuple(tensors[name].shape)} in the weights, {shape} from the config"
                for name, shape in expected.items() if name in tensors and tuple(tensors[name].shape) != shape]
    problems += [f"{name}: missing" for name in expected if name not in tensors]
    problems += [f"{name}: not a parameter of an EAGLE-3 drafter" for name in tensors if name not in expected]
    if "d2t" in tensors and tensors["d2t"].is_floating_point():
        problems.append(f"d2t: {tensors['d2t'].dtype}; it holds token-id offsets, an integer type")
    fc = tensors.get("fc.weight")
    if problems and fc is not None and fc.dim() == 2 and fc.shape[1] == 2 * cfg.hidden_size:
        problems.append("fc fuses 2 x hidden: an EAGLE-1/EAGLE-2 drafter, not EAGLE-3")
    if any(name.startswith("fc_norm.") for name in tensors) != cfg.fc_norm:
        problems.append(f"the config says fc_norm: {str(cfg.fc_norm).lower()} (EAGLE-3.1's norms before fc) but the "
                        f"weights {'lack' if cfg.fc_norm else 'hold'} fc_norm.*")
    if problems:
        raise CheckpointError(f"{raw.weights_path}: does not fit {raw.config_path.name} ({LAYOUTS[raw.layout]}):\n  "
                              + "\n  ".join(problems))


def vocab_map_problems(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """What is wrong with a vocabulary map (d2t [Vd] int, t2d [V] bool): target_id = draft_id + d2t[draft_id]
    must run through exactly the ids t2d marks, in ascending order (the order of the target logits restricted
    to the draft vocabulary, which lm_head's rows follow)."""
    ids = draft_to_target_ids(d2t.long())
    outside = ((ids < 0) | (ids >= t2d.numel())).nonzero().flatten()
    if outside.numel():
        i = int(outside[0])
        return [f"d2t maps draft id {i} to target id {int(ids[i])}, outside the target vocabulary "
                f"(0..{t2d.numel() - 1})"]
    problems = []
    descending = (ids[1:] <= ids[:-1]).nonzero().flatten()
    if descending.numel():
        i = int(descending[0]) + 1
        problems.append(f"d2t is not strictly ascending: draft id {i} -> target id {int(ids[i])} after draft id "
                        f"{i - 1} -> {int(ids[i - 1])}")
    unmarked = (~t2d.bool()[ids]).nonzero().flatten()
    if unmarked.numel():
        i = int(unmarked[0])
        problems.append(f"draft id {i} maps to target id {int(ids[i])}, which t2d does not mark "
                        f"({unmarked.numel()} such draft ids)")
    if int(t2d.sum()) != d2t.numel():
        problems.append(f"t2d marks {int(t2d.sum())} target tokens, the draft vocabulary has {d2t.numel()}")
    return problems


def import_drafter(src_dir: str | Path, out_dir: str | Path) -> DrafterCheckpoint:
    """Convert the drafter in `src_dir` (any layout) into our native layout in `out_dir`, atomically, with the
    source's provenance (a converted drafter is not one eagle3ops trained) and a record of where it came from
    (IMPORTED_DRAFTER.marker): what is at `out_dir` is replaced only when it holds that record, a drafter imported
    before. A native source's training_state.pt is copied as bytes (it is only ever loaded with weights_only)."""
    checkpoint = read_drafter(src_dir)
    with atomic_dir(out_dir, IMPORTED_DRAFTER) as out:  # replaces a drafter it imported before, nothing else
        write_checkpoint(checkpoint.cfg, checkpoint.weights, out, checkpoint.rope_scaling, checkpoint.provenance)
        write_json_atomic(out / IMPORTED_DRAFTER.marker, {"source": str(src_dir), "source_layout": checkpoint.layout})
        state = Path(src_dir) / TRAINING_STATE
        if checkpoint.layout == "sglang" and state.is_file():
            shutil.copyfile(state, out / TRAINING_STATE)
            checkpoint.notes.append(f"copied {TRAINING_STATE}")
    return checkpoint
