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
import os
import shutil
import struct
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3ops.errors import InputError
from eagle3ops.fs import disk_full, is_disk_full, write_json_atomic

MANIFEST = "manifest.json"
PROGRESS = "progress.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                      torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
                      torch.float8_e4m3fn: "F8_E4M3"}


def write_safetensors(path: Path, columns: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> str:
    """Write a safetensors file whose tensor `name` is the concatenation (along dim 0) of `columns[name]`,
    straight from the parts' memory: no packed copy and no serialised copy of a multi-GB shard. The sha256 is
    computed by a second thread while the first writes (both release the GIL), and the file is fsynced.
    Returns the file's sha256."""
    header: dict = {"__metadata__": metadata}
    chunks: list[memoryview] = []
    offset = 0
    for name in sorted(columns):
        parts = [part.contiguous() for part in columns[name]]
        size = sum(part.numel() * part.element_size() for part in parts)
        header[name] = {"dtype": SAFETENSORS_DTYPES[parts[0].dtype],
                        "shape": [sum(part.shape[0] for part in parts), *parts[0].shape[1:]],
                        "data_offsets": [offset, offset + size]}
        chunks += [memoryview(part.reshape(-1).view(torch.uint8).numpy()) for part in parts if part.numel()]
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    chunks.insert(0, memoryview(struct.pack("<Q", len(encoded)) + encoded))
    digest = hashlib.sha256()
    with ThreadPoolExecutor(1) as hasher:
        hashed = hasher.submit(lambda: [digest.update(chunk) for chunk in chunks])
        with path.open("wb") as out:  # written by us, so a full disk surfaces as ENOSPC
            for chunk in chunks:
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        hashed.result()
    return digest.hexdigest()


@dataclass
class ShardWriter:
    """Collects samples ({name: tensor [T, ...]}) and writes a shard every `samples_per_shard` samples.

    With `resumable`, the partial directory survives a crash: each shard is renamed into it only once complete,
    and `progress.json` lists the complete ones (their sha256 checked on resume), so a new writer continues
    after the last complete shard; `samples_done` says how many samples that covers.

    With `background`, a full shard is written by a thread while the next one fills, at most one at a time: the
    caller blocks only when a second shard is full before the first is on disk, so host memory stays bounded by
    two shards. A failed write (a full disk) is raised by the next `add` or by `close`.
    """
    out_dir: Path
    samples_per_shard: int
    meta: dict = field(default_factory=dict)
    resumable: bool = False
    background: bool = False

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self._tmp = self.out_dir.with_name(f".{self.out_dir.name}.partial")
        self._pending: list[dict[str, torch.Tensor]] = []
        self._ids: list[str] = []
        self._skipped: list[str] = []  # inputs left out since the last shard (e.g. NaN hidden states)
        self._shards: list[dict] = self._resume() if self.resumable else []
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="shard-flush") if self.background else None
        self._writing: Future | None = None
        if not self._shards:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp.mkdir(parents=True)

    def _resume(self) -> list[dict]:
        progress = self._tmp / PROGRESS
        if not progress.is_file():
            return []
        state = json.loads(progress.read_text())
        if state["meta"] != self.meta or state["samples_per_shard"] != self.samples_per_shard:
            return []
        shards = state["shards"]
        if any(sha256_file(self._tmp / s["file"]) != s["sha256"] for s in shards):
            return []  # a damaged partial directory: start over rather than trust it
        return shards

    @property
    def samples_done(self) -> int:
        """Inputs the complete shards account for: those written and those skipped (`skip`) before them (read it
        before adding: a shard being written in the background is not counted yet)."""
        return sum(s["samples"] + len(s.get("skipped", [])) for s in self._shards)

    @property
    def skipped_ids(self) -> list[str]:
        return [i for s in self._shards for i in s.get("skipped", [])] + self._skipped

    def skip(self, sample_id: str) -> None:
        """Count an input that gets no sample, so that a resumed run does not do it again."""
        self._skipped.append(sample_id)

    def add(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        self._pending.append(tensors)
        self._ids.append(sample_id)
        if len(self._pending) == self.samples_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        self._wait()  # the previous shard is on disk (or its error raised) before this one is named
        shard = self._pending, self._ids, self._skipped
        self._pending, self._ids, self._skipped = [], [], []
        if self._flusher is None:
            self._write(*shard)
        else:
            self._writing = self._flusher.submit(self._write, *shard)

    def _wait(self) -> None:
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _write(self, samples: list[dict[str, torch.Tensor]], ids: list[str], skipped: list[str]) -> None:
        lengths = [next(iter(sample.values())).shape[0] for sample in samples]
        columns = {name: [s[name] for s in samples] for name in samples[0]}
        columns["offsets"] = [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)]
        name = f"shard-{len(self._shards):05d}.safetensors"
        incomplete = self._tmp / f".{name}.tmp"
        try:
            digest = write_safetensors(incomplete, columns, {"sample_ids": json.dumps(ids)})
        except (OSError, RuntimeError) as err:
            incomplete.unlink(missing_ok=True)
            if not is_disk_full(err):
                raise
            raise disk_full(self._tmp, name, f"the {len(self._shards)} complete shards are kept: free space and run "
                                             f"again to resume") from None
        os.replace(incomplete, self._tmp / name)
        self._shards.append({"file": name, "sha256": digest, "samples": len(lengths), "tokens": int(sum(lengths)),
                             **({"skipped": skipped} if skipped else {})})
        if self.resumable:
            write_json_atomic(self._tmp / PROGRESS, {"meta": self.meta, "samples_per_shard": self.samples_per_shard,
                                                     "shards": self._shards})

    def close(self) -> dict:
        """Write the last shard and the manifest, then move the directory into place."""
        self._flush()
        self._wait()
        self._stop_flusher()
        manifest = {**self.meta, "samples": sum(s["samples"] for s in self._shards),
                    "tokens": sum(s["tokens"] for s in self._shards), "shards": self._shards}
        (self._tmp / PROGRESS).unlink(missing_ok=True)
        (self._tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(self.out_dir, ignore_errors=True)
        self._tmp.rename(self.out_dir)
        return manifest

    def abort(self) -> None:
        self._stop_flusher()  # a shard in flight finishes before its directory goes
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _stop_flusher(self) -> None:
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)


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
