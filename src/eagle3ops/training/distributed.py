"""Data-parallel drafter training over the processes torchrun starts: one per GPU (NCCL), or CPU processes (gloo).

    torchrun --nproc-per-node 8 -m eagle3ops.cli train --init scratch

torchrun gives each process RANK, WORLD_SIZE and LOCAL_RANK. Every rank reads params.yaml and the features,
walks the same sequence of global batches (train.batch_size samples each) and trains on its share of each;
DistributedDataParallel averages the gradients, so every rank takes the same optimizer step. Rank 0 alone
writes: the MLflow run, metrics, plots, resume points and the drafter. Without torchrun (or with one process)
none of this runs and training is the single-process loop it always was.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Ranks wait for rank 0 while it alone runs the acceptance simulator or writes a resume point; the default
# collective timeout (10 minutes for NCCL) would kill a long simulator run.
TIMEOUT = timedelta(minutes=60)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched_world() -> World:
    """The world torchrun describes in the environment (a single process without it)."""
    return World(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def current() -> World:
    """The world of the process group this process has joined; a single process when it has joined none."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(dist.get_rank(), dist.get_world_size(), launched_world().local_rank)


@contextmanager
def process_group(device: torch.device) -> Iterator[tuple[World, torch.device]]:
    """Join torchrun's process group for the block: NCCL when `device` is a GPU (this rank's, cuda:LOCAL_RANK),
    gloo on the CPU. Yields the world and this rank's device. Launched without torchrun, or with one process,
    it joins nothing and yields a single-process world and `device` unchanged. The ranks leave together."""
    world = launched_world()
    if world.size == 1:
        yield world, device
        return
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    try:
        yield current(), device
        dist.barrier()  # not on an error: the other ranks would wait for this one until the timeout
    finally:
        dist.destroy_process_group()


def share(batch: list, world: World) -> list:
    """This rank's samples of a global batch: every size-th one from its rank on (empty when the batch is
    shorter than the world)."""
    return batch[world.rank :: world.size]


def wrap(module: torch.nn.Module, device: torch.device) -> torch.nn.parallel.DistributedDataParallel:
    """DDP over the group: it broadcasts rank 0's weights and buffers, then averages the gradients in buckets
    while the backward runs; the gradients live in those buckets instead of beside them (one copy fewer)."""
    return torch.nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)


def global_normaliser(world: World) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a TTT step's summed loss is divided by on each rank, given the rank's count of positions that
    step (modeling/draft.py ttt_loss): the count of the whole global batch (summed over the ranks), at least
    1, over the world size. Every rank's loss is then world size x its share of the global batch's loss, and
    the mean over the ranks, the one DDP's gradient averaging takes, is the loss of the global batch in one
    process, counted positions and all: grad = sum_k decay^k * sum_r grad(S_k^r) / N_k."""
    def normaliser(count: torch.Tensor) -> torch.Tensor:
        total = count.detach().to(torch.float32, copy=True)
        dist.all_reduce(total)
        return total.clamp(min=1) / world.size

    return normaliser


def broadcast_from_main(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values, in place, on every rank of the group (nothing without one)."""
    if dist.is_available() and dist.is_initialized():
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums over the ranks (float64, on `device`: NCCL reduces GPU tensors only)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def broadcast(obj, world: World):
    """Rank 0's `obj` on every rank (picklable)."""
    if world.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shared_resume(resume, world: World) -> dict | None:
    """Rank 0's resume state (resume.ResumePoint, None on the other ranks) on every rank. Rank 0 loads it;
    the others load the same file onto the CPU, since its tensors name rank 0's GPU (training moves the
    optimizer state to each rank's own device)."""
    state = resume.load() if world.main else None
    path = broadcast(str(resume.path) if state is not None else None, world)
    if world.main or path is None:
        return state
    return torch.load(path, map_location="cpu", weights_only=True)


def wait_for_main(world: World) -> None:
    """Other ranks wait here while rank 0 works alone (a one-GPU reference run, a write)."""
    if world.size > 1:
        dist.barrier()

