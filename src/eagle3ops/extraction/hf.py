"""Hidden-state capture: run the target over tokenized samples and write what the drafter trains on (the shards'
writer, `write_features`, is also extraction/vllm.py's).

Per sample the shard holds input_ids [T], loss_mask [T], aux_hidden [T, 3H] (the three configured layers,
low to high) and final_hidden [T, H] (after the target's final norm; training gets the target's logits from
it with the target's lm_head, so no [T, V] logits are stored), in extract.dtype (data/hidden_states.py: in FP8
with their scales, quantised on the device before the copy to the host).
"""
from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3ops.data.hidden_states import encode, finite_positions
from eagle3ops.data.prepare import extraction_order
from eagle3ops.data.shards import ShardWriter
from eagle3ops.errors import InputError
from eagle3ops.modeling.target import capture, model_text_config
from eagle3ops.progress import progress


@dataclass
class ExtractResult:
    samples: int
    tokens: int
    wall_s: float
    manifest: dict
    nonfinite: list[str]  # ids of samples skipped for NaN/inf hidden states
    drain_s: float = 0.0  # of wall_s, the wait after the last batch was queued (its forward, the last shard's write)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


# A batch's states, packed sample after sample: (aux [sum(lengths), 3H] low to high, final [sum(lengths), H])
BatchStates = Callable[[torch.Tensor, list[int]], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def extract_features(model, samples: list[dict], aux_layers: list[int], out_dir: str | Path, batch_size: int,
                     samples_per_shard: int, dtype: str = "float32", meta: dict | None = None,
                     desc: str = "extract", resumable: bool = False, max_nonfinite_fraction: float = 0.01) -> ExtractResult:
    """The target's states through forward hooks, written by `write_features`. Batches are right-padded with an
    attention mask; each sample keeps only its own positions, so batch composition cannot leak into the stored
    states."""
    device = model.device
    with capture(model, aux_layers) as hooks:
        def forward(ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            mask = torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]  # [B, T] real positions
            # Known on the host, so packing needs no sync with the device: the CPU queues batch i+1's
            # forward while the device still runs batch i's.
            positions = mask.reshape(-1).nonzero().squeeze(1).to(device, non_blocking=True)  # [sum(lengths)]
            padded = min(lengths) < ids.shape[1]  # without padding, no mask: the plain causal kernel
            model(input_ids=ids.to(device, non_blocking=True),
                  attention_mask=mask.to(device, non_blocking=True).long() if padded else None, use_cache=False,
                  logits_to_keep=1)
            return (hooks.aux().flatten(0, 1).index_select(0, positions),
                    hooks.final().flatten(0, 1).index_select(0, positions))

        return write_features(forward, samples, aux_layers, model_text_config(model).hidden_size, out_dir,
                              batch_size, samples_per_shard, dtype, meta, desc, resumable, max_nonfinite_fraction)


def write_features(forward: BatchStates, samples: list[dict], aux_layers: list[int], hidden_size: int,
                   out_dir: str | Path, batch_size: int, samples_per_shard: int, dtype: str = "float32",
                   meta: dict | None = None, desc: str = "extract", resumable: bool = False,
                   max_nonfinite_fraction: float = 0.01) -> ExtractResult:
    """Run `forward` over length-sorted batches (less padding; ids [B, T] right-padded with 0) and write its states
    to shards. Shards hold the samples in that (deterministic) length order, each under its id, and whole batches
    only (samples_per_shard is rounded up to a multiple of batch_size): a run resumed after its last complete shard
    (`resumable`) forms the very same batches, so its shards are byte for byte those of an uninterrupted run.

    Four things overlap: the forward of batch i+1 on the device, the copy of batch i's states to the host, the
    sorting of copied batches into samples by a background thread, and the writing of the last full shard by
    another. At most `QUEUED_BATCHES` batches wait, so host memory stays bounded by two shards (one filling, one
    being written) plus those batches; when the disk is the slower side, the forward waits."""
    order = extraction_order([len(sample["input_ids"]) for sample in samples])
    samples_per_shard = math.ceil(samples_per_shard / batch_size) * batch_size
    writer = ShardWriter(Path(out_dir), samples_per_shard, resumable=resumable, background=True,
                         meta={**(meta or {}), "aux_layers": aux_layers, "hidden_size": hidden_size, "dtype": dtype})
    done = writer.samples_done
    if done:
        print(f"{desc}: resuming after {done} of {len(samples)} samples (complete shards kept)", flush=True)
    sink = _BatchWriter(writer, samples, int(max_nonfinite_fraction * len(samples)), max_nonfinite_fraction)
    start, tokens = time.perf_counter(), 0
    try:
        with progress(len(samples), desc, "sample", initial=done) as bar:
            for first in range(done, len(order), batch_size):
                rows = order[first : first + batch_size]
                lengths = [len(samples[i]["input_ids"]) for i in rows]
                ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
                for r, i in enumerate(rows):
                    ids[r, : lengths[r]] = torch.tensor(samples[i]["input_ids"])
                aux, final = forward(ids, lengths)
                states = {**encode("aux_hidden", aux, len(aux_layers), dtype),
                          **encode("final_hidden", final, 1, dtype)}  # in FP8 with their scales
                finite = finite_positions(states)  # [sum(lengths)]
                sink.put(rows, lengths, ids, {name: _to_host(t) for name, t in states.items()}, _to_host(finite))
                tokens += sum(lengths)
                bar.update(len(rows))
        forwards_done = time.perf_counter()
        sink.close()
        manifest = writer.close()
    except BaseException:
        sink.abandon()
        if not resumable:
            writer.abort()
        raise
    end = time.perf_counter()
    return ExtractResult(manifest["samples"], tokens, end - start, manifest, sink.nonfinite, end - forwards_done)


QUEUED_BATCHES = 2


def _to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying to (pinned) host memory; the event says when the copy is done. On the CPU: the tensor."""
    if not tensor.is_cuda:
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class _BatchWriter:
    """The background thread that turns copied batches into samples for the ShardWriter (which writes a shard
    whenever it has enough). An error there (a full disk, too many NaN samples) is raised in the caller."""

    def __init__(self, writer: ShardWriter, samples: list[dict], allowed_nonfinite: int, fraction: float):
        self.writer, self.samples = writer, samples
        self.allowed, self.fraction = allowed_nonfinite, fraction
        self.nonfinite = writer.skipped_ids  # ids of samples skipped for NaN/inf hidden states, also before a resume
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUED_BATCHES)
        self.thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self.thread.start()

    def put(self, *batch) -> None:
        self._raise()
        self.queue.put(batch)

    def _run(self) -> None:
        while (batch := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self._write(*batch)
                except BaseException as err:  # handed to the caller's thread
                    self.error = err

    def _write(self, rows, lengths, ids, states, finite) -> None:
        for copied in (*states.values(), finite):
            if copied[1] is not None:
                copied[1].synchronize()
        offset = 0
        for r, (i, n) in enumerate(zip(rows, lengths)):
            sample = self.samples[i]
            if not finite[0][offset : offset + n].all():
                self.nonfinite.append(sample["id"])  # poison for training: skip and count
                self.writer.skip(sample["id"])
                if len(self.nonfinite) > self.allowed:
                    raise NonFiniteError(
                        f"{len(self.nonfinite)} of {len(self.samples)} samples gave NaN/inf hidden states (first: "
                        f"{self.nonfinite[:5]}), more than extract.max_nonfinite_fraction={self.fraction}; "
                        f"check target.dtype (float16 overflows) and the weights")
            else:
                self.writer.add(sample["id"], {
                    "input_ids": ids[r, :n].to(torch.int32),
                    "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.uint8),
                    **{name: host[offset : offset + n] for name, (host, _) in states.items()}})
            offset += n

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Wait until every queued batch is with the ShardWriter."""
        self.queue.put(None)
        self.thread.join()
        self._raise()

    def abandon(self) -> None:
        if self.thread.is_alive():
            self.error = self.error or RuntimeError("abandoned")
            self.queue.put(None)
            self.thread.join()


class NonFiniteError(InputError):
    """Too many samples with NaN/inf hidden states."""
