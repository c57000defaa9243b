"""The bench's scales: a target architecture and the workloads measured on it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BenchSize:
    """One benchmark scale: the target architecture (a presets/*.json or an inline config) and the workloads."""
    architecture: dict
    draft_vocab_size: int
    extract_seq_len: int
    extract_sequences: int
    extract_batch_size: int
    extract_lengths: list[int]  # the length sweep, at extract_batch_tokens tokens per batch
    extract_batch_tokens: int
    extract_batches: list[int]  # the batch sweep, at extract_seq_len
    extract_shard_tokens: int  # tokens per shard (the same bytes per shard at every length)
    train_batches: list[int]  # batch sizes at train_seq_len
    train_seq_len: int
    long_seq_lens: list[int]  # batch 1
    train_steps: int
    matmul_n: int
    disk_bytes: int
    data_parallel_batch: int = 4  # global batch of the data-parallel bench (at least one sample per rank)
    data_parallel_steps: int = 16
    train_packed_lengths: list[int] = field(default_factory=list)  # rows packed with log-normal documents, batch 1
    varlen_samples: int = 40  # train-varlen: the set trained on from process start
    varlen_median: float = 1000.0
    varlen_sigma: float = 0.8  # log-normal: mean = median * exp(sigma^2 / 2)
    varlen_range: tuple[int, int] = (128, 8192)
    varlen_seed: int = 1  # 54,976 tokens (the reference run's set had 54,900)
    varlen_packed_length: int = 8192
    online_samples: int = 160  # online: the varying-length set extracted and trained on, online and offline
    online_extract_batch: int = 8
    online_samples_per_shard: int = 64


TINY_ARCH = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 6, "hidden_size": 128,
             "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
             "max_position_embeddings": 2048, "rope_theta": 10000.0}


def _preset_architecture(name: str) -> dict:
    return json.loads((Path(__file__).parents[1] / "presets" / name).read_text())


SIZES = {
    "tiny": lambda: BenchSize(TINY_ARCH, 256, 256, 32, 8, [128, 256, 512], 2048, [1, 4, 8], 4096, [1, 4], 256, [512],
                              4, 512, 32 << 20, train_packed_lengths=[512], varlen_samples=12, varlen_median=60.0,
                              varlen_range=(16, 256), varlen_packed_length=256, online_samples=24,
                              online_samples_per_shard=8),
    # 128 x 2048 tokens per extraction point: 8.6 GB written, shards of 2 GiB as the presets size them.
    "8b": lambda: BenchSize(_preset_architecture("llama-3.1-8b.json"), 32000, 2048, 128, 8, [1024, 2048, 4096, 8192],
                            16384, [1, 2, 4, 8, 16], 65536, [1, 2, 4], 2048, [4096, 8192, 16384], 8, 8192, 4 << 30,
                            train_packed_lengths=[8192, 16384]),
}
