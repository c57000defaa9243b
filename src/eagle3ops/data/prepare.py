"""Conversations -> tokenized samples (ids + assistant loss mask), a stable split and the draft vocabulary."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3ops.data.chat import tokenize_conversation
from eagle3ops.data.conversations import DatasetError
from eagle3ops.data.shards import ShardWriter, iter_samples
from eagle3ops.data.vocab import count_masked_tokens

SPLITS = ("train", "eval")  # the prepared splits, each a directory under prepare.out_dir; extract keeps them apart
DROPPED_IDS_LISTED = 1000  # the dropped samples' ids the metrics file names (all of them up to this many)


@dataclass
class TokenizeStats:
    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_no_assistant: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    dropped_ids: list[str] = field(default_factory=list)

    def metrics(self) -> dict:
        """The counts, and the ids of the conversations dropped for want of an assistant token (the first
        DROPPED_IDS_LISTED of them; `dropped_no_assistant` counts them all): a list, which DVC's metrics tables
        and MLflow's metrics leave out, kept in the stage's metrics file for whoever asks which ones."""
        counts = {k: v for k, v in asdict(self).items() if k != "dropped_ids"}
        return {**counts, "dropped_ids": self.dropped_ids[:DROPPED_IDS_LISTED]}

    def dropped_line(self, metrics_file: str | Path, shown: int = 5) -> str | None:
        """One line naming what was dropped, the first `shown` ids and where the rest are; None where nothing was."""
        if not self.dropped_ids:
            return None
        ids = ", ".join(self.dropped_ids[:shown]) + (", ..." if len(self.dropped_ids) > shown else "")
        listed = "all" if len(self.dropped_ids) <= DROPPED_IDS_LISTED else f"the first {DROPPED_IDS_LISTED}"
        return (f"{len(self.dropped_ids)} of {self.conversations} conversations dropped, no assistant token within "
                f"data.max_len: {ids} ({listed} in {metrics_file}, dropped_ids)")


def tokenize_dataset(tokenizer, conversations: list[dict], max_len: int, source: str) -> tuple[list[dict], TokenizeStats]:
    """Each conversation -> {"id", "input_ids", "loss_mask"}; truncation is counted, and a sample left with no
    assistant token is dropped (and counted): it would train nothing."""
    stats = TokenizeStats(conversations=len(conversations))
    samples = []
    for record in conversations:
        tokenized = tokenize_conversation(tokenizer, record["messages"], max_len)
        stats.truncated += tokenized.truncated
        if not any(tokenized.loss_mask):
            stats.dropped_no_assistant += 1
            stats.dropped_ids.append(record["id"])
            continue
        samples.append({"id": record["id"], "input_ids": tokenized.input_ids, "loss_mask": tokenized.loss_mask})
        stats.tokens += len(tokenized.input_ids)
        stats.loss_tokens += sum(tokenized.loss_mask)
    stats.kept = len(samples)
    if not samples:
        raise DatasetError(f"{source}: no sample left with an assistant token after tokenizing and truncating to "
                           f"max_len={max_len} ({stats.conversations} conversations read)")
    return samples, stats


def _bucket(sample_id: str) -> float:
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") / 2**64


def in_eval_split(sample_id: str, eval_fraction: float) -> bool:
    """Stable across runs, machines and dataset order: decided by a hash of the id alone."""
    return _bucket(sample_id) < eval_fraction


def split(samples: list[dict], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    train = [s for s in samples if not in_eval_split(s["id"], eval_fraction)]
    held_out = [s for s in samples if in_eval_split(s["id"], eval_fraction)]
    if eval_fraction > 0 and not held_out and len(train) > 1:
        # Tiny datasets still get one held-out sample: the lowest hash, so dataset order does not matter.
        lowest = min(train, key=lambda s: _bucket(s["id"]))
        train.remove(lowest)
        held_out = [lowest]
    return train, held_out


def write_tokenized(samples: list[dict], out_dir: str | Path, meta: dict) -> dict:
    writer = ShardWriter(Path(out_dir), samples_per_shard=max(1, len(samples)), meta=meta)
    for sample in samples:
        writer.add(sample["id"], {"input_ids": torch.tensor(sample["input_ids"], dtype=torch.int32),
                                  "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.uint8)})
    return writer.close()


def masked_token_counts(directory: str | Path) -> Counter:
    """Frequencies of the loss-masked token ids of a prepared split (what a drafter is asked to predict)."""
    return count_masked_tokens((t["input_ids"].tolist(), t["loss_mask"].tolist()) for _, t in iter_samples(directory))


def extraction_order(lengths: list[int]) -> list[int]:
    """The order the extract stage stores prepared samples in, shortest first (stable): fewer padded positions in
    its batches; offline training reads them in that order, and online training takes them in it."""
    return sorted(range(len(lengths)), key=lambda i: lengths[i])


def read_tokenized(directory: str | Path) -> list[dict]:
    return [{"id": sample_id, "input_ids": t["input_ids"].tolist(), "loss_mask": t["loss_mask"].tolist()}
            for sample_id, t in iter_samples(directory)]
