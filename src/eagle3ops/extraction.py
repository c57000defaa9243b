"""Hidden-state capture: run the target over tokenized samples and write what the drafter trains on.

Per sample the shard holds input_ids [T], loss_mask [T], aux_hidden [T, 3H] (the three configured layers,
low to high) and final_hidden [T, H] (after the target's final norm; training gets the target's logits from
it with the target's lm_head, so no [T, V] logits are stored).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3ops.data.shards import ShardWriter
from eagle3ops.errors import InputError
from eagle3ops.progress import progress
from eagle3ops.modeling.target import DTYPES, capture


@dataclass
class ExtractResult:
    samples: int
    tokens: int
    wall_s: float
    manifest: dict
    nonfinite: list[str]  # ids of samples skipped for NaN/inf hidden states

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@torch.no_grad()
def extract_features(model, samples: list[dict], aux_layers: list[int], out_dir: str | Path, batch_size: int,
                     samples_per_shard: int, dtype: str = "float32", meta: dict | None = None,
                     desc: str = "extract", resumable: bool = False, max_nonfinite_fraction: float = 0.01) -> ExtractResult:
    """Batches are length-sorted (less padding) and right-padded with an attention mask; each sample keeps only
    its own positions, so batch composition cannot leak into the stored states. Shards hold the samples in
    that (deterministic) length order, each under its id, and whole batches only (samples_per_shard is rounded
    up to a multiple of batch_size): a run resumed after its last complete shard (`resumable`) forms the very
    same batches, so its shards are byte for byte those of an uninterrupted run."""
    device = model.device
    store_dtype = DTYPES[dtype]
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["input_ids"]))
    samples_per_shard = math.ceil(samples_per_shard / batch_size) * batch_size
    writer = ShardWriter(Path(out_dir), samples_per_shard, resumable=resumable,
                         meta={**(meta or {}), "aux_layers": aux_layers, "hidden_size": model.config.hidden_size,
                               "dtype": dtype})
    done = writer.samples_done
    if done:
        print(f"{desc}: resuming after {done} of {len(samples)} samples (complete shards kept)", flush=True)
    start, tokens, nonfinite = time.perf_counter(), 0, []
    allowed = int(max_nonfinite_fraction * len(samples))
    try:
        with capture(model, aux_layers) as hooks, progress(len(samples), desc, "sample", initial=done) as bar:
            for first in range(done, len(order), batch_size):
                rows = order[first : first + batch_size]
                lengths = [len(samples[i]["input_ids"]) for i in rows]
                ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, i in enumerate(rows):
                    ids[r, : lengths[r]] = torch.tensor(samples[i]["input_ids"])
                    mask[r, : lengths[r]] = 1
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False, logits_to_keep=1)
                aux, final = hooks.aux().to(store_dtype).cpu(), hooks.final().to(store_dtype).cpu()
                for r, i in enumerate(rows):
                    n = lengths[r]
                    if not (torch.isfinite(aux[r, :n]).all() and torch.isfinite(final[r, :n]).all()):
                        nonfinite.append(samples[i]["id"])  # poison for training: skip and count
                        if len(nonfinite) > allowed:
                            raise NonFiniteError(
                                f"{len(nonfinite)} of {len(samples)} samples gave NaN/inf hidden states (first: "
                                f"{nonfinite[:5]}), more than extract.max_nonfinite_fraction={max_nonfinite_fraction}"
                                f"; check target.dtype (float16 overflows) and the weights")
                        continue
                    writer.add(samples[i]["id"], {
                        "input_ids": ids[r, :n].to(torch.int32),
                        "loss_mask": torch.tensor(samples[i]["loss_mask"], dtype=torch.uint8),
                        "aux_hidden": aux[r, :n].clone(), "final_hidden": final[r, :n].clone()})
                tokens += sum(lengths)
                bar.update(len(rows))
        manifest = writer.close()
    except BaseException:
        if not resumable:
            writer.abort()
        raise
    return ExtractResult(manifest["samples"], tokens, time.perf_counter() - start, manifest, nonfinite)


class NonFiniteError(InputError):
    """Too many samples with NaN/inf hidden states."""

