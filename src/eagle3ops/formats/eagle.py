"""Drafter checkpoints in the EAGLE authors' layout (SafeAILab/EAGLE, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).

    <dir>/config.json          a Llama config with num_hidden_layers 1 and draft_vocab_size; no layer ids (their
                               code captures HF indices [2, N//2, N-3], the engines' default)
    <dir>/pytorch_model.bin    torch.save of the model's state dict: fc, midlayer.*, norm, lm_head, d2t, t2d and
                               sometimes embed_tokens; d2t/t2d are absent when the draft vocabulary is the target's

The parameter names are ours, so the config reads like the SpecForge layout's (specforge.from_hf_config). A
`.bin` is a pickle: it is read with `weights_only=True`, which unpickles tensors and containers only, so a file
that needs Python code to load is refused instead of run.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from eagle3ops.formats.specforge import CheckpointError

WEIGHTS_BIN = "pytorch_model.bin"


def read_bin(path: str | Path) -> dict[str, torch.Tensor]:
    """A plain state dict {name: tensor} from a torch.save file, never running code from it."""
    path = Path(path)
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ... for bad files
        if "Weights only load failed" not in str(err):  # truncated, or not a torch.save file at all
            raise CheckpointError(f"{path}: not a readable torch.save file ({type(err).__name__}: "
                                  f"{str(err)[:200]})") from None
        found = re.search(r"GLOBAL (\S+)", str(err))
        needs = f": it references {found.group(1)}" if found else ""
        raise CheckpointError(f"{path}: refused: unpickling it needs Python code named in the file{needs}; only plain "
                              f"tensor state dicts are read (torch.load weights_only=True). Re-save it as "
                              f"model.safetensors where you trust the code") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    others = sorted(str(name) for name, value in state.items() if not isinstance(value, torch.Tensor))
    if others:
        raise CheckpointError(f"{path}: entries that are not tensors: {others[:10]}; expected a plain state dict")
    return state
