"""The drafter's training data: feature samples read from the extract stage's shards and checked, batched in a
seeded order and right-padded (causal attention never looks right, and padded positions carry loss_mask 0).

Batches are shuffled per epoch by a generator seeded from (seed, epoch), so a run resumed from its training
state sees the same batches. Under torchrun every rank walks the same global batches and takes its share.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from eagle3ops.data.shards import iter_samples, read_manifest
from eagle3ops.errors import InputError
from eagle3ops.modeling.target import DTYPES
from eagle3ops.training import distributed
from eagle3ops.training.distributed import World

GPU_LENGTH_BUCKET = 256  # compiled kernels exist per length: bucket lengths so few are built


def pad_batch(samples: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad ragged samples ({name: [T_i, ...]}) to [B, T_max, ...] on `device`; on a GPU T_max is rounded up
    to a multiple of GPU_LENGTH_BUCKET. Padding changes nothing: causal attention never looks right, and padded
    positions carry loss_mask 0."""
    return to_device(_pad_on_host(samples, device), device)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def _pad_on_host(samples: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """pad_batch's host side, in pinned memory when the batch goes to a GPU (its copy then does not block)."""
    length = max(s["input_ids"].shape[0] for s in samples)
    if device.type == "cuda":
        length = math.ceil(length / GPU_LENGTH_BUCKET) * GPU_LENGTH_BUCKET
    batch = {}
    for name in samples[0]:
        first = samples[0][name]
        out = torch.zeros((len(samples), length, *first.shape[1:]), dtype=first.dtype, pin_memory=device.type == "cuda")
        for row, sample in enumerate(samples):
            out[row, : sample[name].shape[0]] = sample[name]
        batch[name] = out
    return batch


PADDED_AHEAD = 2  # batches a thread pads ahead for a GPU; none on a CPU, where its ops would fight the step's
# for the same cores (2x slower)


def padded_ahead(items: Iterator[tuple[int, list]], world: World, device: torch.device, depth: int
                  ) -> Iterator[tuple[int, list, dict[str, torch.Tensor]]]:
    """(epoch, global batch, this rank's share padded on the host), in order. With `depth` > 0 a thread pads
    that many batches ahead: the device does not wait for the CPU to assemble the next batch (hundreds of MB of
    hidden states at real sizes)."""
    def pad(batch: list) -> dict[str, torch.Tensor]:
        return _pad_on_host(rank_share(batch, world), device)

    if depth == 0:
        yield from ((epoch, batch, pad(batch)) for epoch, batch in items)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="batch-padding") as pool:
        ahead: deque = deque()
        for epoch, batch in items:
            ahead.append((epoch, batch, pool.submit(pad, batch)))
            if len(ahead) > depth:
                epoch, batch, padded = ahead.popleft()
                yield epoch, batch, padded.result()
        while ahead:
            epoch, batch, padded = ahead.popleft()
            yield epoch, batch, padded.result()


def batches(samples: list, batch_size: int, seed: int, epoch: int) -> list[list]:
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [[samples[i] for i in order[start : start + batch_size]] for start in range(0, len(order), batch_size)]


def rank_share(batch: list, world: World) -> list:
    """This rank's samples of a global batch. A rank left without any (a last batch shorter than the world)
    runs the first sample with its loss mask cleared: it counts no position and adds zero gradients, but
    takes part in the step's collectives."""
    mine = distributed.share(batch, world)
    return mine or [{**batch[0], "loss_mask": torch.zeros_like(batch[0]["loss_mask"])}]


def remaining_batches(samples, batch_size, seed, done_steps, total_steps, epochs) -> Iterator[tuple[int, list]]:
    """(epoch, batch) pairs from global step `done_steps` to `total_steps`, in the order a fresh run would see."""
    step = 0
    for epoch in range(epochs):
        for batch in batches(samples, batch_size, seed, epoch):
            if step >= total_steps:
                return
            if step >= done_steps:
                yield epoch, batch
            step += 1


def load_feature_samples(directory, hidden_size: int | None = None) -> list[dict[str, torch.Tensor]]:
    """All samples of a hidden-state shard directory, in memory, each checked against the manifest (and the
    target's hidden size) before any training starts: a wrong file fails here, naming itself, not hours later."""
    manifest = read_manifest(directory)
    hidden, dtype = manifest["hidden_size"], DTYPES[manifest["dtype"]]
    if hidden_size is not None and hidden != hidden_size:
        raise InputError(f"{directory}: hidden states of size {hidden}, the target's hidden size is {hidden_size}")
    expected = {"aux_hidden": (len(manifest["aux_layers"]) * hidden, dtype), "final_hidden": (hidden, dtype)}
    samples = []
    for sample_id, tensors in iter_samples(directory):
        length = tensors["input_ids"].shape[0]
        for name, (width, kind) in expected.items():
            if tuple(tensors[name].shape) != (length, width) or tensors[name].dtype != kind:
                raise InputError(f"{directory}: sample {sample_id!r}: {name} is {tuple(tensors[name].shape)} "
                                 f"{tensors[name].dtype}, the manifest says ({length}, {width}) {kind}")
        samples.append(tensors)
    return samples
