"""Ragged sample collections in safetensors shards, with a manifest.

A shard packs its samples end to end: every per-token tensor is [tokens_in_shard, ...] and `offsets`
([samples + 1], int64) marks where each sample starts. Tokenized datasets and captured hidden states use the
same container; `manifest.json` lists each shard with its sha256, sample and token counts, so a reader can
verify what it loads and a human can see what a directory holds without opening it.

Writes go to a temporary sibling directory that is renamed into place at the end: a crash never leaves a
directory that looks complete.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3ops.errors import InputError

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class ShardWriter:
    """Collects samples ({name: tensor [T, ...]}) and writes a shard every `samples_per_shard` samples."""
    out_dir: Path
    samples_per_shard: int
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self._tmp = self.out_dir.with_name(f".{self.out_dir.name}.partial")
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True)
        self._pending: list[dict[str, torch.Tensor]] = []
        self._ids: list[str] = []
        self._shards: list[dict] = []

    def add(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        self._pending.append(tensors)
        self._ids.append(sample_id)
        if len(self._pending) == self.samples_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        lengths = [next(iter(sample.values())).shape[0] for sample in self._pending]
        packed = {name: torch.cat([s[name] for s in self._pending]).contiguous() for name in self._pending[0]}
        packed["offsets"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        name = f"shard-{len(self._shards):05d}.safetensors"
        save_file(packed, str(self._tmp / name), metadata={"sample_ids": json.dumps(self._ids)})
        self._shards.append({"file": name, "sha256": sha256_file(self._tmp / name),
                             "samples": len(lengths), "tokens": int(sum(lengths))})
        self._pending, self._ids = [], []

    def close(self) -> dict:
        """Write the last shard and the manifest, then move the directory into place."""
        self._flush()
        manifest = {**self.meta, "samples": sum(s["samples"] for s in self._shards),
                    "tokens": sum(s["tokens"] for s in self._shards), "shards": self._shards}
        (self._tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(self.out_dir, ignore_errors=True)
        self._tmp.rename(self.out_dir)
        return manifest

    def abort(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise InputError(f"{path}: no manifest; is {directory} a shard directory written by eagle3ops?")
    return json.loads(path.read_text())


def iter_samples(directory: str | Path, verify: bool = True) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield (sample_id, {name: tensor [T, ...]}) shard by shard, checking each shard's sha256."""
    directory = Path(directory)
    for shard in read_manifest(directory)["shards"]:
        path = directory / shard["file"]
        if verify and sha256_file(path) != shard["sha256"]:
            raise InputError(f"{path}: sha256 does not match {MANIFEST}; the shard is corrupt or was replaced")
        with safe_open(str(path), framework="pt") as handle:
            ids = json.loads(handle.metadata()["sample_ids"])
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        offsets = tensors.pop("offsets").tolist()
        for index, sample_id in enumerate(ids):
            start, end = offsets[index], offsets[index + 1]
            yield sample_id, {name: tensor[start:end] for name, tensor in tensors.items()}
