"""The drafter's training data: feature samples read from the extract stage's shards and checked, packed whole into
rows of `train.packed_length` tokens in a seeded order, and assembled into batches of such rows.

Packing keeps every step at one shape, so a GPU compiles the step once whatever the lengths of the data, and
computes little padding: only a row's tail, and the empty rows that fill a short last batch to its shape. Each
row carries each document's own positions (from 0), which is how the TTT loss (modeling/draft.py) tells the
documents apart. Samples are shuffled per epoch by a
generator seeded from (seed, epoch), so a run resumed from its training state sees the same rows. Under torchrun
every rank walks the same global batches of `train.batch_size` rows and takes its share.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from eagle3ops.data.hidden_states import STORED, expected_columns
from eagle3ops.data.shards import MANIFEST, iter_samples, read_manifest
from eagle3ops.errors import InputError
from eagle3ops.training import distributed
from eagle3ops.training.distributed import World

OPEN_ROWS = 8  # rows still taking samples while packing: more fill rows fuller, fewer keep the order closer to random


def pack(lengths: list[int], capacity: int, order: list[int]) -> list[list[int]]:
    """Sample indices in rows of at most `capacity` tokens. In `order`, each sample goes to the first open row with
    room for it, else to a new row; a row is closed when full, or the oldest when more than OPEN_ROWS are open.
    Rows come in the order they close."""
    rows, open_rows = [], []  # open: [free tokens, indices]
    for index in order:
        length = lengths[index]
        if length > capacity:
            raise InputError(f"train.packed_length {capacity} is shorter than a sample of {length} tokens: "
                             f"raise it to at least the longest sample (prepare's data.max_len)")
        row = next((row for row in open_rows if row[0] >= length), None)
        if row is None:
            row = [capacity, []]
            open_rows.append(row)
        row[0] -= length
        row[1].append(index)
        if row[0] == 0 or len(open_rows) > OPEN_ROWS:
            closed = row if row[0] == 0 else open_rows[0]
            open_rows.remove(closed)
            rows.append(closed[1])
    return rows + [row[1] for row in open_rows]


def packed_batches(samples: list[dict], packed_length: int, batch_size: int, order: list[int]
                   ) -> list[list[list[dict]]]:
    """The samples packed in `order`, in batches of `batch_size` rows (the last may have fewer), a row a list of
    samples."""
    rows = [[samples[i] for i in row] for row in pack([len(s["input_ids"]) for s in samples], packed_length, order)]
    return [rows[start : start + batch_size] for start in range(0, len(rows), batch_size)]


def epoch_batches(samples: list[dict], packed_length: int, batch_size: int, seed: int, epoch: int
                  ) -> list[list[list[dict]]]:
    """One epoch's global batches, the samples in an order seeded from (seed, epoch)."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return packed_batches(samples, packed_length, batch_size, order)


def schedule(samples: list[dict], packed_length: int, batch_size: int, seed: int, epochs: int
             ) -> list[list[list[list[dict]]]]:
    """Every epoch's global batches, packed before the first step: their number sets the learning-rate schedule."""
    return [epoch_batches(samples, packed_length, batch_size, seed, epoch) for epoch in range(epochs)]


def remaining_batches(batches_by_epoch: list[list], done_steps: int, total_steps: int) -> Iterator[tuple[int, list]]:
    """(epoch, global batch) from global step `done_steps` to `total_steps`, in the order a fresh run sees them."""
    step = 0
    for epoch, batches in enumerate(batches_by_epoch):
        for batch in batches:
            if step >= total_steps:
                return
            if step >= done_steps:
                yield epoch, batch
            step += 1


def eval_batches(samples: list[dict], packed_length: int, batch_size: int) -> list[list[list[dict]]]:
    """The held-out samples packed in their own order, in batches of `batch_size` rows."""
    return packed_batches(samples, packed_length, batch_size, list(range(len(samples))))


def assemble(rows: list[list[dict]], packed_length: int, row_count: int, pin: bool = False) -> dict[str, torch.Tensor]:
    """Packed rows (lists of samples {name: [T_i, ...]}) -> {name: [row_count, packed_length, ...]} and `positions`,
    each document's own from 0. A row's tail is padding: zeros, loss_mask 0, positions 0, 1, ... of a document of
    its own; rows past the given ones are padding whole, so that a short last batch keeps the shape compiled for
    the others. `pin`: in pinned host memory, whose copy to a GPU does not block."""
    first = rows[0][0]
    rows = rows + [[]] * (row_count - len(rows))
    batch = {name: torch.zeros((row_count, packed_length, *first[name].shape[1:]), dtype=first[name].dtype,
                               pin_memory=pin) for name in first}
    batch["positions"] = torch.zeros((row_count, packed_length), dtype=torch.int64, pin_memory=pin)
    for r, row in enumerate(rows):
        start = 0
        for sample in row:
            length = sample["input_ids"].shape[0]
            for name in first:
                batch[name][r, start : start + length] = sample[name]
            batch["positions"][r, start : start + length] = torch.arange(length)
            start += length
        batch["positions"][r, start:] = torch.arange(packed_length - start)
    return batch


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


ASSEMBLED_AHEAD = 2  # batches a thread assembles ahead for a GPU; none on a CPU, where its ops would fight the
# step's for the same cores (2x slower)


def assembled_ahead(items: Iterator[tuple[int, list]], make: Callable[[list], dict[str, torch.Tensor]], depth: int
                    ) -> Iterator[tuple[int, list, dict[str, torch.Tensor]]]:
    """(epoch, global batch, `make(global batch)`: the tensors of the step), in order. With `depth` > 0 a thread
    makes that many batches ahead (a bounded queue): the device does not wait for the CPU to copy the next rows
    together (hundreds of MB of hidden states at real sizes), nor, online, for the target to be asked for them."""
    if depth == 0:
        yield from ((epoch, batch, make(batch)) for epoch, batch in items)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="batch-assembly") as pool:
        ahead: deque = deque()
        for epoch, batch in items:
            ahead.append((epoch, batch, pool.submit(make, batch)))
            if len(ahead) > depth:
                epoch, batch, future = ahead.popleft()
                yield epoch, batch, future.result()
        while ahead:
            epoch, batch, future = ahead.popleft()
            yield epoch, batch, future.result()


def rank_share(batch: list[list[dict]], world: World) -> list[list[dict]]:
    """This rank's rows of a global batch. A rank left without any (a last batch shorter than the world) runs the
    first row with its loss mask cleared: it counts no position and adds zero gradients, but takes part in the
    step's collectives."""
    mine = distributed.share(batch, world)
    return mine or [[{**sample, "loss_mask": torch.zeros_like(sample["loss_mask"])} for sample in batch[0]]]


def batches(samples: list, batch_size: int, seed: int, epoch: int) -> list[list]:
    """Samples in a seeded order per epoch, `batch_size` at a time (the zoo's language-model training)."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [[samples[i] for i in order[start : start + batch_size]] for start in range(0, len(order), batch_size)]


def pad_batch(samples: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad ragged samples ({name: [T_i, ...]}) to [B, T_max, ...] on `device` (the zoo's language models)."""
    length = max(s["input_ids"].shape[0] for s in samples)
    batch = {}
    for name in samples[0]:
        out = torch.zeros((len(samples), length, *samples[0][name].shape[1:]), dtype=samples[0][name].dtype)
        for row, sample in enumerate(samples):
            out[row, : sample[name].shape[0]] = sample[name]
        batch[name] = out.to(device)
    return batch


def load_feature_samples(directory, hidden_size: int | None = None) -> list[dict[str, torch.Tensor]]:
    """All samples of a hidden-state shard directory, in memory, each checked against the manifest (and the
    target's hidden size) before any training starts: a wrong file fails here, naming itself, not hours later."""
    manifest = read_manifest(directory)
    hidden = manifest["hidden_size"]
    if hidden_size is not None and hidden != hidden_size:
        raise InputError(f"{directory}: hidden states of size {hidden}, the target's hidden size is {hidden_size}")
    if manifest["dtype"] not in STORED:
        raise InputError(f"{directory}/{MANIFEST}: dtype {manifest['dtype']!r} is not one of {list(STORED)}")
    expected = expected_columns(manifest["dtype"], hidden, len(manifest["aux_layers"]))
    samples = []
    for sample_id, tensors in iter_samples(directory):
        length = tensors["input_ids"].shape[0]
        missing = [name for name in expected if name not in tensors]
        if missing:
            raise InputError(f"{directory}: sample {sample_id!r} has no {', '.join(missing)}, which a shard of "
                             f"{manifest['dtype']} hidden states holds (the manifest's dtype)")
        for name, (width, kind) in expected.items():
            if tuple(tensors[name].shape) != (length, width) or tensors[name].dtype != kind:
                raise InputError(f"{directory}: sample {sample_id!r}: {name} is {tuple(tensors[name].shape)} "
                                 f"{tensors[name].dtype}, the manifest says ({length}, {width}) {kind}")
        samples.append(tensors)
    return samples
