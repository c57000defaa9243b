"""Online training (train.hidden_states: online): the target runs beside the drafter and computes each batch's hidden
states as the extract stage would have stored them; none is written to disk.

    samples = token_samples(prepared / "train")            # the prepared samples, in the extract stage's order
    states = TargetStates(model, aux_layers, device, ...)  # Recipe.hidden_states: (rows, batch) -> batch + states

The samples are those offline training reads from the shards, in the same order (the shards hold them shortest
first), so the seeded epochs pack the same rows. The target runs on the packed rows themselves: every document
carries its own positions from 0, which Hugging Face's attention reads as packed sequences (a block-diagonal causal
mask), so each document's states are those it has run alone; `check_packed_attention` holds the target to that on
the first batch, before its step. The training loop asks for each batch's states on the thread that assembles
batches ahead (training/data.py, `assembled_ahead`): a bounded queue, so a target on other GPUs (target.device_map)
computes batch i+1 while the drafter trains on batch i, and one on the drafter's GPU has its kernels queued
ahead. On a CPU both run in turn.

train.online_engine vllm takes the states from a vLLM server instead (EngineTargetStates: the one at
train.online_url, or one the stage starts): the engine that already shards a target too large for this process,
each document a request of its own; the samples, their order and packing, the resume points and the NaN handling
are the same, and batches are assembled ahead (the bounded queue) whatever the training device.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3ops.data.prepare import extraction_order
from eagle3ops.data.shards import iter_samples
from eagle3ops.errors import InputError
from eagle3ops.extraction.vllm import EngineStates
from eagle3ops.modeling.draft import document_ids
from eagle3ops.modeling.target import capture


class NonFiniteStatesError(InputError):
    """Too many samples whose hidden states hold NaN/inf."""


def token_samples(directory: str | Path) -> list[dict[str, torch.Tensor]]:
    """A prepared split's samples as training takes them ({input_ids int32 [T], loss_mask uint8 [T]}, the dtypes of
    the feature shards), in the extract stage's order."""
    samples = [{"input_ids": t["input_ids"].to(torch.int32), "loss_mask": t["loss_mask"].to(torch.uint8)}
               for _, t in iter_samples(directory)]
    return [samples[i] for i in extraction_order([len(s["input_ids"]) for s in samples])]


class TargetStates:
    """A batch's hidden states from the target: aux_hidden [R, T, 3H] (the aux layers, low to high) and
    final_hidden [R, T, H] (after the final norm), in the target's dtype on the drafter's device.

    A document whose states hold a NaN or inf gets zero states and no counted position (offline, the extract stage
    leaves such a sample out); more such samples than `max_nonfinite_fraction` of them stops training."""
    remote = False  # the target runs in this process, on the training device's cores or GPUs

    def __init__(self, model, aux_layers: list[int], device: torch.device, samples: int,
                 max_nonfinite_fraction: float):
        self.model, self.aux_layers, self.device = model, aux_layers, device
        self.samples, self.fraction = samples, max_nonfinite_fraction
        self.nonfinite: set[int] = set()  # id() of the samples with NaN/inf states
        self.lock = threading.Lock()  # the target's forwards, one user at a time (the acceptance simulator too)
        self.checked = False  # by check_packed_attention, on the first batch that can tell

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, T] token ids and positions (on any device) -> aux [R, T, 3H], final [R, T, H] on the target's."""
        target = self.model.device
        with self.lock, capture(self.model, self.aux_layers) as hooks:
            self.model(input_ids=input_ids.to(target, non_blocking=True).long(),
                       position_ids=positions.to(target, non_blocking=True), use_cache=False, logits_to_keep=1)
            return hooks.aux(), hooks.final()

    def __call__(self, rows: list[list[dict]], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` (training/data.py, `assemble`; its rows `rows`) with the states added."""
        if not self.checked:
            self.checked = check_packed_attention(self, rows, batch)
        aux, final = self.forward(batch["input_ids"], batch["positions"])
        finite = aux.isfinite().all(-1) & final.isfinite().all(-1)  # [R, T]
        if not bool(finite.all()):  # waits for the target, on the thread that assembles batches ahead
            aux, final, finite = self._rows_again_document_by_document(rows, batch, aux, final, finite.all(-1))
        return self._with_states(rows, batch, aux, final, finite)

    def _with_states(self, rows: list[list[dict]], batch: dict[str, torch.Tensor], aux: torch.Tensor,
                     final: torch.Tensor, finite: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch with its states; a document with a NaN/inf gets zeros and no counted position."""
        if not bool(finite.all()):
            documents = document_ids(batch["positions"]) - 1  # [R, T], from 0
            dropped = self._drop_nonfinite(rows, documents, ~finite.cpu())  # [R, T]
            keep = ~dropped.to(aux.device)[..., None]
            aux, final = torch.where(keep, aux, 0), torch.where(keep, final, 0)
            batch = {**batch, "loss_mask": batch["loss_mask"] * ~dropped}
        return {**batch, "aux_hidden": aux.to(self.device, non_blocking=True),
                "final_hidden": final.to(self.device, non_blocking=True)}

    def documents_alone(self, rows: list[list[dict]], batch: dict[str, torch.Tensor], row: int):
        """(start, end, aux [n, 3H], final [n, H]) of each document of `batch`'s row `row`, run alone."""
        start = 0
        for sample in rows[row] if row < len(rows) else []:
            end = start + sample["input_ids"].shape[0]
            aux, final = self.forward(batch["input_ids"][row : row + 1, start:end],
                                      batch["positions"][row : row + 1, start:end])
            yield start, end, aux[0], final[0]
            start = end

    def _rows_again_document_by_document(self, rows, batch, aux, final, clean_rows: torch.Tensor):
        """A NaN/inf in one document's keys reaches every query of its row (a masked score times NaN is still NaN):
        the rows that hold any are run again a document at a time, so that only a document whose own states hold
        one is dropped, as offline. A row's padded tail is no sample: zeros."""
        for r in (~clean_rows).nonzero().flatten().tolist():
            end = 0
            for start, end, own_aux, own_final in self.documents_alone(rows, batch, r):
                aux[r, start:end], final[r, start:end] = own_aux, own_final
            aux[r, end:], final[r, end:] = 0, 0
        return aux, final, aux.isfinite().all(-1) & final.isfinite().all(-1)

    def _drop_nonfinite(self, rows: list[list[dict]], documents: torch.Tensor, poisoned: torch.Tensor
                        ) -> torch.Tensor:
        """The positions of the documents with a poisoned position ([R, T] each); counts their samples and raises
        past the allowed share."""
        hit = torch.zeros(documents.shape, dtype=torch.long).scatter_reduce(1, documents, poisoned.long(), "amax")
        for r, d in hit.nonzero().tolist():  # [R, documents]: 1 where a document holds a NaN/inf
            if r < len(rows) and d < len(rows[r]):  # a sample, not a row's padded tail
                self.nonfinite.add(id(rows[r][d]))
        if len(self.nonfinite) > int(self.fraction * self.samples):
            raise NonFiniteStatesError(
                f"{len(self.nonfinite)} of {self.samples} samples gave NaN/inf hidden states, more than "
                f"extract.max_nonfinite_fraction={self.fraction}; check target.dtype (float16 overflows) and the "
                f"weights")
        return hit.gather(1, documents).bool()


class EngineTargetStates(TargetStates):
    """TargetStates from a vLLM server that captures them (extraction/vllm.py): the train process holds no target.
    Every document of a batch is a request of its own, all sent at once (the engine batches them), so packed
    documents cannot see each other and need no check; a row's padded tail gets zeros."""
    remote = True  # the engine works while the drafter trains: batches are assembled ahead, also on a CPU

    def __init__(self, engine: EngineStates, device: torch.device, samples: int, max_nonfinite_fraction: float):
        super().__init__(None, engine.layout.aux_layers, device, samples, max_nonfinite_fraction)
        self.engine = engine
        self.checked = True

    def __call__(self, rows: list[list[dict]], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        places = [(r, start, sample) for r, row in enumerate(rows)
                  for start, sample in zip(_starts(row), row)]
        with ThreadPoolExecutor(min(len(places), REQUESTS_IN_FLIGHT), thread_name_prefix="vllm-states") as pool:
            states = self.engine.many([sample["input_ids"].tolist() for _, _, sample in places], pool)
        rows_, length = batch["input_ids"].shape
        aux = torch.zeros(rows_, length, states[0][0].shape[-1], dtype=states[0][0].dtype)  # [R, T, 3H]
        final = torch.zeros(rows_, length, states[0][1].shape[-1], dtype=states[0][1].dtype)  # [R, T, H]
        for (r, start, sample), (own_aux, own_final) in zip(places, states):
            end = start + sample["input_ids"].shape[0]
            aux[r, start:end], final[r, start:end] = own_aux, own_final
        finite = aux.isfinite().all(-1) & final.isfinite().all(-1)  # [R, T]
        return self._with_states(rows, batch, aux, final, finite)


REQUESTS_IN_FLIGHT = 64  # at most; the engine's scheduler batches them as its KV cache allows


def _starts(row: list[dict]) -> list[int]:
    """Where each document of a packed row starts."""
    lengths = [sample["input_ids"].shape[0] for sample in row]
    return [sum(lengths[:i]) for i in range(len(lengths))]


def check_packed_attention(states: TargetStates, rows: list[list[dict]], batch: dict[str, torch.Tensor]) -> bool:
    """Hold the target to packed rows: each document of the first row that has several must get the states it gets
    run alone. A target whose attention ignores the packed positions (some remote-code models) lets documents see
    the ones before them, and would train the drafter on states no engine ever shows it.

    Packed and alone run other kernels, whose rounding differs (a few % in bf16 over a deep random-weight model):
    the row's first document, which has nothing before it to see, measures that rounding; a later one that differs
    by more than twice as much, plus 1%, saw another document. Returns whether it could tell: not on a batch without
    a row of several documents, nor on one whose states hold a NaN/inf (the next batch is checked then)."""
    row = next((r for r, documents in enumerate(rows) if len(documents) > 1), None)
    if row is None:
        return False
    packed = states.forward(batch["input_ids"][row : row + 1], batch["positions"][row : row + 1])
    differences = []
    for start, end, *alone in states.documents_alone(rows, batch, row):
        differences.append(max(float((own.float() - together[0, start:end].float()).abs().mean()
                                     / own.float().abs().mean()) for together, own in zip(packed, alone)))
    if not all(math.isfinite(difference) for difference in differences):
        return False
    rounding, worst = differences[0], max(differences[1:])
    if worst > 2 * rounding + 0.01:
        raise InputError(
            f"the target's attention does not keep packed documents apart: a document's states differ from its "
            f"own alone by {worst:.1%}, where rounding alone gives {rounding:.1%} (the row's first document). Online "
            f"training runs the target on packed rows, which needs an attention that reads packed position_ids "
            f"(Hugging Face's own architectures do); train offline instead (train.hidden_states: offline)")
    return True
