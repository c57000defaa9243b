"""`eagle3ops bench`: extraction and drafter-training speed, against the machine's own limits and a naive
baseline measured in the same run.

Targets and drafters are built from architecture configs with random weights (speed does not depend on the
values). Figures:
- ceilings: bf16 matrix product TFLOP/s, device copy GB/s (bytes read + written), disk write with fsync GB/s;
- extraction: the naive pipeline (`output_hidden_states=True`, copy to host and save after each batch) and ours
  (extraction.extract_features: hooks, length-sorted batches, overlapped copies and shard writing), tokens/s,
  disk GB/s, MFU = 2 * target params * tokens/s over the measured matrix ceiling; ours also as the sequence
  length grows (at a fixed number of tokens per batch) and as the batch grows, each beside the target's forward
  alone at that shape, the compute limit;
- extraction with the target split layer-wise over the GPUs (`extract-split`, target.device_map "balanced" through
  the real loading code) against the same weights on one GPU: tokens/s, peak memory of each GPU, and the largest
  difference between the hidden states the two placements stored;
- training: one optimizer step of the TTT loss (modeling/draft.py) at each batch size and length, the first
  step (compilation included) apart, tokens/s, peak memory, MFU from the step's counted FLOPs; `reference`
  rows run the explicit TTT attention (scores materialised), `flex` rows the fused kernel;
- data-parallel training (under torchrun, `run_data_parallel_bench`): the train stage's loop at one global
  batch on one rank alone, then over all ranks with DDP: tokens/s, scaling, and the loss of every step of both.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3ops import distributed
from eagle3ops.config import DrafterTrainConfig
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft, compute_dtype, ttt_loss
from eagle3ops.training import to_training_device, train_drafter


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


TINY_ARCH = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 6, "hidden_size": 128,
             "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
             "max_position_embeddings": 2048, "rope_theta": 10000.0}


def _preset_architecture(name: str) -> dict:
    return json.loads((Path(__file__).parent / "presets" / name).read_text())


SIZES = {
    "tiny": lambda: BenchSize(TINY_ARCH, 256, 256, 32, 8, [128, 256, 512], 2048, [1, 4, 8], 4096, [1, 4], 256, [512],
                              4, 512, 32 << 20),
    # 128 x 2048 tokens per extraction point: 8.6 GB written, shards of 2 GiB as the presets size them.
    "8b": lambda: BenchSize(_preset_architecture("llama-3.1-8b.json"), 32000, 2048, 128, 8, [1024, 2048, 4096, 8192],
                            16384, [1, 2, 4, 8, 16], 65536, [1, 2, 4], 2048, [4096, 8192, 16384], 8, 8192, 4 << 30),
}


# ----------------------------------------------------------------------------------------------- timing, ceilings

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 10, warmup: int = 3) -> float:
    """Mean seconds of `fn()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def measure_ceilings(device: torch.device, matmul_n: int, disk_dir: Path, disk_bytes: int) -> dict:
    dtype = compute_dtype(device)
    a, b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype), torch.randn(matmul_n, matmul_n, device=device,
                                                                                    dtype=dtype)
    matmul_s = timed(lambda: a @ b, device)
    source = torch.empty(disk_bytes // 2, dtype=torch.bfloat16, device=device)
    destination = torch.empty_like(source)
    copy_s = timed(lambda: destination.copy_(source), device)
    del a, b, source, destination
    return {"matmul_tflops": 2 * matmul_n**3 / matmul_s / 1e12, "matmul_dtype": str(dtype).removeprefix("torch."),
            "copy_gbps": 2 * disk_bytes / copy_s / 1e9, "disk_write_gbps": measure_disk(disk_dir, disk_bytes)}


def measure_disk(directory: Path, total: int, block: int = 64 << 20) -> float:
    """Sequential write of `total` bytes in `block`-sized writes, fsync at the end: what a shard writer can get."""
    directory.mkdir(parents=True, exist_ok=True)
    path, data = directory / "disk-probe.bin", bytes(min(block, total))
    start = time.perf_counter()
    with path.open("wb") as out:
        for _ in range(max(1, total // len(data))):
            out.write(data)
        out.flush()
        import os

        os.fsync(out.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return max(1, total // len(data)) * len(data) / seconds / 1e9


# ---------------------------------------------------------------------------------------------------- extraction

def build_target(architecture: dict, device: torch.device, dtype: torch.dtype):
    """A random-weight causal LM of this architecture, built directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in architecture.items() if not k.startswith("_")})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def _samples(count: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"id": f"s{i:05d}", "input_ids": torch.randint(0, vocab, (length,), generator=generator).tolist(),
             "loss_mask": [1] * length} for i in range(count)]


@torch.no_grad()
def extract_naive(model, samples: list[dict], aux_layers: list[int], batch_size: int, out_dir: Path) -> dict:
    """What a first script does: all hidden states, copied to the host and saved synchronously per batch."""
    import os

    from safetensors.torch import save

    out_dir.mkdir(parents=True, exist_ok=True)
    device, tokens, written = model.device, 0, 0
    _sync(device)
    start = time.perf_counter()
    for first in range(0, len(samples), batch_size):
        ids = torch.tensor([s["input_ids"] for s in samples[first : first + batch_size]], device=device)
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
        stacked = torch.stack([states[i] for i in aux_layers] + [states[-1]], dim=2).cpu()  # [B, T, 4, H]
        data = save({"hidden_states": stacked, "input_ids": ids.cpu()})
        with (out_dir / f"batch-{first:06d}.safetensors").open("wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        tokens, written = tokens + ids.numel(), written + len(data)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "disk_gbps": written / seconds / 1e9}


def extract_ours(model, samples: list[dict], aux_layers: list[int], batch_size: int, out_dir: Path,
                 samples_per_shard: int) -> dict:
    from eagle3ops.extraction import extract_features

    _sync(model.device)
    start = time.perf_counter()
    result = extract_features(model, samples, aux_layers, out_dir, batch_size, samples_per_shard=samples_per_shard,
                              dtype="bfloat16", desc="bench extract")
    seconds = time.perf_counter() - start
    written = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    # Steady: while the forwards run; the drain after them (the last shard's write) is paid once per run.
    return {"tokens": result.tokens, "seconds": seconds, "tokens_per_s": result.tokens / seconds,
            "disk_gbps": written / seconds / 1e9, "drain_s": result.drain_s,
            "steady_tokens_per_s": result.tokens / (seconds - result.drain_s)}


def _aux_layers(architecture: dict) -> list[int]:
    layers = architecture["num_hidden_layers"]
    return [2, layers // 2, layers - 3]


def bench_extraction(size: BenchSize, device: torch.device, work_dir: Path, peak_tflops: float) -> dict:
    """The naive pipeline and ours at the base shape, then ours at every shape of the length and batch sweeps,
    each point over the same number of tokens and beside the forward alone at its shape."""
    arch = size.architecture
    model = build_target(arch, device, compute_dtype(device))
    params = sum(p.numel() for p in model.parameters())
    aux_layers, total_tokens = _aux_layers(arch), size.extract_sequences * size.extract_seq_len
    mfu = lambda tokens_per_s: 2 * params * tokens_per_s / (peak_tflops * 1e12)  # noqa: E731
    base = (size.extract_batch_size, size.extract_seq_len)
    shapes = sorted({base, *((size.extract_batch_tokens // n, n) for n in size.extract_lengths),
                     *((b, size.extract_seq_len) for b in size.extract_batches)}, key=lambda shape: (shape[1], shape[0]))
    result: dict = {"target_params": params, "bytes_per_token": 4 * arch["hidden_size"] * 2, "tokens_per_point": total_tokens,
                    "shard_tokens": size.extract_shard_tokens, "base": {"batch": base[0], "length": base[1]}, "runs": []}
    for batch, length in shapes:
        samples = _samples(total_tokens // length, length, arch["vocab_size"])
        ids = torch.tensor([s["input_ids"] for s in samples[:batch]], device=device)
        forward_s = timed(lambda: model(input_ids=ids, logits_to_keep=1), device, repeats=3, warmup=1)  # warms up too
        shard_samples = max(batch, size.extract_shard_tokens // length)
        pipelines = {"ours": lambda out: extract_ours(model, samples, aux_layers, batch, out, shard_samples)}
        if (batch, length) == base:
            pipelines = {"naive": lambda out: extract_naive(model, samples, aux_layers, batch, out), **pipelines}
        for name, extract in pipelines.items():
            out = work_dir / f"extract-{name}"
            row = extract(out)
            shutil.rmtree(out, ignore_errors=True)
            row.update(pipeline=name, batch=batch, length=length, mfu=mfu(row["tokens_per_s"]),
                       forward_only_tokens_per_s=batch * length / forward_s, forward_only_mfu=mfu(batch * length / forward_s))
            result["runs"].append(row)
            print(f"bench extract {name} batch {batch} x {length}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def bench_split_extraction(size: BenchSize, device: torch.device, work_dir: Path) -> dict:
    """The target saved once, then loaded by the extract stage's own code (load_target) twice: whole on one
    device, and split layer-wise over every GPU (target.device_map "balanced"); the same samples extracted by
    both, and the stored hidden states compared. On a machine with fewer than two GPUs the second placement is
    one device too (a check of the bench itself, not of a split)."""
    from eagle3ops.config import TargetConfig
    from eagle3ops.data.shards import iter_samples
    from eagle3ops.modeling.target import DTYPES, load_target

    arch = size.architecture
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    target_dir = work_dir / "split-target"
    build_target(arch, device, DTYPES[dtype]).save_pretrained(target_dir)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    placements = {"one_device": {"device": str(device)},
                  "split": {"device_map": "balanced"} if gpus >= 2 else {"device_map": {"": str(device)}}}
    samples = _samples(size.extract_sequences // 2, size.extract_seq_len, arch["vocab_size"], seed=1)
    shard_samples = max(size.extract_batch_size, size.extract_shard_tokens // size.extract_seq_len)
    runs = []
    for name, placement in placements.items():
        model = load_target(TargetConfig(path=str(target_dir), dtype=dtype, **placement))
        layout = getattr(model, "hf_device_map", {"": str(model.device)})
        for index in range(gpus):
            torch.cuda.reset_peak_memory_stats(index)
        # A whole untimed pass first: it also pins the host memory the pipeline keeps (a one-off cost of a
        # process, which would otherwise fall on whichever placement runs first).
        extract_ours(model, samples, _aux_layers(arch), size.extract_batch_size, work_dir / "split-warmup",
                     shard_samples)
        shutil.rmtree(work_dir / "split-warmup")
        row = extract_ours(model, samples, _aux_layers(arch), size.extract_batch_size, work_dir / f"split-{name}",
                           shard_samples)
        row.update(placement=name, modules_per_device={str(d): list(layout.values()).count(d) for d in
                                                        dict.fromkeys(layout.values())},
                   peak_gib_per_gpu=[round(torch.cuda.max_memory_allocated(i) / 2**30, 2) for i in range(gpus)])
        runs.append(row)
        print(f"bench extract-split {name}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
        del model
        if gpus:
            torch.cuda.empty_cache()
    differences = {"aux_hidden": 0.0, "final_hidden": 0.0}
    pairs = zip(iter_samples(work_dir / "split-one_device"), iter_samples(work_dir / "split-split"), strict=True)
    for (id_one, one), (id_split, split) in pairs:
        if id_one != id_split:
            raise RuntimeError(f"the two placements stored samples in another order: {id_one} vs {id_split}")
        for key in differences:
            differences[key] = max(differences[key], (one[key].float() - split[key].float()).abs().max().item())
    for path in (target_dir, work_dir / "split-one_device", work_dir / "split-split"):
        shutil.rmtree(path)
    return {"gpus": gpus, "sequences": len(samples), "seq_len": size.extract_seq_len,
            "batch_size": size.extract_batch_size, "runs": runs, "max_abs_difference": differences}


# ------------------------------------------------------------------------------------------------------ training

def draft_config(architecture: dict, draft_vocab_size: int) -> DraftConfig:
    hidden = architecture["hidden_size"]
    return DraftConfig(hidden_size=hidden, intermediate_size=architecture["intermediate_size"],
                       num_attention_heads=architecture["num_attention_heads"],
                       num_key_value_heads=architecture["num_key_value_heads"], vocab_size=architecture["vocab_size"],
                       draft_vocab_size=draft_vocab_size, target_hidden_size=hidden, aux_layers=[2, 3, 4],
                       head_dim=architecture.get("head_dim"), max_position_embeddings=32768)


def train_step_flops(cfg: DraftConfig, batch: int, length: int, ttt_steps: int) -> float:
    """FLOPs of one optimizer step: forward + backward (2x) of the drafter per TTT step, the fc once, and the
    target's logits (forward only: the full vocabulary for the argmax, the draft rows for the distribution)."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_width, kv_width = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_token = 2 * (2 * H * (q_width + 2 * kv_width) + q_width * H + 3 * H * I + H * cfg.draft_vocab_size)
    attention = 2 * 2 * q_width * (length / 2)  # causal step-0 scores and values; the diagonal terms are negligible
    tokens = batch * length
    drafter = 3 * ttt_steps * tokens * (per_token + attention) + 3 * tokens * 2 * 3 * cfg.target_hidden_size * H
    target = tokens * 2 * cfg.target_hidden_size * (cfg.vocab_size + cfg.draft_vocab_size)
    return drafter + target


@dataclass
class TrainBench:
    kernel: str
    batch: int
    length: int
    first_step_s: float
    step_ms: float
    tokens_per_s: float
    peak_gib: float | None
    tflops: float
    losses: list[float] = field(default_factory=list)


def random_drafter(cfg: DraftConfig, seed: int) -> Eagle3Draft:
    """Random weights and a random draft vocabulary, from `seed`, on the CPU."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    vocab_rows = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    draft.d2t.copy_(vocab_rows - torch.arange(cfg.draft_vocab_size))
    draft.t2d.zero_()
    draft.t2d[vocab_rows] = True
    return draft


def bench_train(cfg: DraftConfig, batch: int, length: int, steps: int, device: torch.device, kernel: str,
                ttt_steps: int = 7, seed: int = 0) -> TrainBench:
    """`steps` optimizer steps on random inputs (the same for both kernels, from `seed`); bf16 autocast on a GPU
    with fp32 master weights, as the train stage runs."""
    draft = to_training_device(random_drafter(cfg, seed), device)
    draft.midlayer.self_attn.kernel = kernel
    lm_head = (torch.randn(cfg.vocab_size, cfg.target_hidden_size, device=device) * 0.02)
    features = compute_dtype(device)  # as the train stage passes the features and the target's lm_head
    lm_head = lm_head.to(features)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), device=device)
    aux = torch.randn(batch, length, 3 * cfg.target_hidden_size, device=device, dtype=features)
    final = torch.randn(batch, length, cfg.target_hidden_size, device=device, dtype=features)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    losses = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)  # before the forward, as the train stage does
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            result = ttt_loss(draft, ids, aux, final, mask, lm_head, ttt_steps)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        losses.append(round(result.losses[0], 5))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - start
    seconds = timed(step, device, repeats=steps, warmup=1)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    flops = train_step_flops(cfg, batch, length, ttt_steps)
    return TrainBench(kernel, batch, length, round(first, 2), round(seconds * 1e3, 1), batch * length / seconds,
                      round(peak, 2) if peak else None, flops / seconds / 1e12, losses)


# ----------------------------------------------------------------------------------------- data-parallel training

def random_features(cfg: DraftConfig, count: int, length: int, distinct: int, seed: int = 0) -> list[dict]:
    """`count` feature samples as extraction stores them (bf16 states, every position trained on), cycling
    through `distinct` random ones: generating them all would take longer than the bench."""
    generator = torch.Generator().manual_seed(seed)
    made = [{"input_ids": torch.randint(0, cfg.vocab_size, (length,), generator=generator, dtype=torch.int32),
             "loss_mask": torch.ones(length, dtype=torch.uint8),
             "aux_hidden": torch.randn(length, 3 * cfg.target_hidden_size, generator=generator).to(torch.bfloat16),
             "final_hidden": torch.randn(length, cfg.target_hidden_size, generator=generator).to(torch.bfloat16)}
            for _ in range(min(count, distinct))]
    return [made[i % len(made)] for i in range(count)]


def time_training(cfg: DraftConfig, samples: list[dict], lm_head: torch.Tensor, recipe: DrafterTrainConfig,
                  device: torch.device, world: distributed.World) -> dict:
    """train_drafter over `world` (one rank alone: World()): seconds to the end of the first step (setup and
    compilation included), then the steady step time from the second step on, and every step's loss."""
    draft = random_drafter(cfg, seed=0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stamps, start = [], time.perf_counter()
    result, _ = train_drafter(draft, samples, [], lm_head, recipe, seed=0, device=device,
                              log=lambda step, row: stamps.append(time.perf_counter()),  # synced: rows are read back
                              desc=f"bench train x{world.size}", world=world)
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    tokens_per_step = recipe.batch_size * samples[0]["input_ids"].shape[0]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del draft
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ranks": world.size, "batch_per_rank": math.ceil(recipe.batch_size / world.size),
            "first_step_s": round(stamps[0] - start, 2), "step_ms": round(step_s * 1e3, 1),
            "tokens_per_s": tokens_per_step / step_s, "peak_gib": round(peak, 2) if peak else None,
            "losses": [row["train/loss"] for row in result.history]}


def run_data_parallel_bench(size_name: str, device: torch.device) -> dict | None:
    """Under torchrun: the train stage's loop (train_drafter: TTT 7, AdamW, clipping, bf16 autocast on GPUs) on
    random features at one global batch (at least one sample per rank), first on rank 0 alone (the one-GPU
    reference; the other ranks wait), then on all ranks with DDP. Returns the result on rank 0, None elsewhere."""
    size = SIZES[size_name]()
    cfg = draft_config(size.architecture, size.draft_vocab_size)
    with distributed.process_group(device) as (world, device):
        global_batch = math.ceil(size.data_parallel_batch / world.size) * world.size
        samples = random_features(cfg, global_batch * size.data_parallel_steps, size.train_seq_len, 2 * global_batch)
        lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=torch.Generator().manual_seed(1)) * 0.02
        recipe = DrafterTrainConfig(epochs=1, batch_size=global_batch, lr=1e-4, log_every=1, checkpoint_every=0)
        runs = [time_training(cfg, samples, lm_head, recipe, device, distributed.World())] if world.main else []
        distributed.wait_for_main(world)
        runs.append(time_training(cfg, samples, lm_head, recipe, device, world))
        backend = torch.distributed.get_backend() if world.size > 1 else "-"
    if not world.main:
        return None
    alone, together = runs
    return {"size": size_name, "device": _device_name(device), "torch": torch.__version__, "backend": backend,
            "data_parallel": {
                "world_size": world.size, "global_batch": global_batch, "length": size.train_seq_len,
                "steps": size.data_parallel_steps, "runs": runs,
                "speedup": together["tokens_per_s"] / alone["tokens_per_s"],
                "max_loss_rel_diff": max(abs(a - b) / abs(a) for a, b in zip(alone["losses"], together["losses"]))}}


# ------------------------------------------------------------------------------------------------------ the run

def run_bench(size_name: str, device: torch.device, work_dir: Path, parts: tuple[str, ...] = ("extract", "train"),
              kernels: tuple[str, ...] = ("flex", "reference"),
              train_shapes: list[tuple[int, int]] | None = None) -> dict:
    """`train_shapes` ((batch, length) pairs) replace the size's training shapes."""
    size = SIZES[size_name]()
    arch = size.architecture
    work_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"size": size_name, "device": _device_name(device), "torch": torch.__version__,
                    "architecture": {k: arch[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                          "num_attention_heads", "num_key_value_heads", "vocab_size")}}
    result["ceilings"] = measure_ceilings(device, size.matmul_n, work_dir, size.disk_bytes)
    peak_tflops = result["ceilings"]["matmul_tflops"]
    if "extract" in parts:
        result["extract"] = bench_extraction(size, device, work_dir, peak_tflops)
    if "extract-split" in parts:
        result["extract_split"] = bench_split_extraction(size, device, work_dir)
    if "train" in parts:
        cfg = draft_config(arch, size.draft_vocab_size)
        shapes = train_shapes or [(b, size.train_seq_len) for b in size.train_batches] + [(1, n) for n in size.long_seq_lens]
        rows = []
        for kernel in [k for k in kernels if k == "reference" or device.type == "cuda"]:  # flex trains on GPUs only
            for batch, length in shapes:
                try:
                    bench = bench_train(cfg, batch, length, size.train_steps, device, kernel)
                except torch.OutOfMemoryError:
                    print(f"bench train {kernel} batch {batch} x {length}: out of memory", flush=True)
                    torch.cuda.empty_cache()
                    continue
                row = asdict(bench)
                row["mfu"] = bench.tflops / peak_tflops
                rows.append(row)
                print(f"bench train {kernel} batch {batch} x {length}: {bench.tokens_per_s:,.0f} tok/s", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        result["train"] = rows
    return result


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


REFERENCE = {  # SpecForge v0.2 on one H200, Llama-3.1-8B drafter, TTT 7, seq 2048 unless stated (the figures)
    "specforge_train": {(1, 2048): (22_000, 13.6), (2, 2048): (24_500, 17.6), (4, 2048): (26_200, 26.2),
                        (1, 4096): (24_400, 17.4), (1, 8192): (24_800, 25.5), (1, 16384): (22_700, 43.2)},
    "naive_extract_tokens_per_s": (12_300, 14_100),
}


def render(result: dict) -> str:
    import pandas as pd

    from eagle3ops.reporting import markdown_table

    lines = [f"# eagle3ops bench: {result['size']} on {result['device']} (torch {result['torch']})", ""]
    if "data_parallel" in result:
        return "\n".join(lines + render_data_parallel(result["data_parallel"], result["backend"]))
    ceilings = result["ceilings"]
    lines += [f"Ceilings: matmul {ceilings['matmul_tflops']:.0f} TFLOP/s ({ceilings['matmul_dtype']}), device copy "
              f"{ceilings['copy_gbps']:.0f} GB/s, disk write+fsync {ceilings['disk_write_gbps']:.2f} GB/s", ""]
    if "extract" in result:
        lines += render_extraction(result["extract"], ceilings)
    if "extract_split" in result:
        lines += render_split_extraction(result["extract_split"])
    if "train" in result:
        rows = []
        for row in result["train"]:
            reference = REFERENCE["specforge_train"].get((row["batch"], row["length"])) if result["size"] == "8b" else None
            rows.append({"kernel": row["kernel"], "batch": row["batch"], "length": row["length"],
                         "first step s": row["first_step_s"], "step ms": row["step_ms"],
                         "tok/s": f"{row['tokens_per_s']:,.0f}", "peak GiB": row["peak_gib"] or "-",
                         "MFU": f"{row['mfu']:.0%}",
                         "SpecForge tok/s": f"{reference[0]:,}" if reference else "-",
                         "vs SpecForge": f"{row['tokens_per_s'] / reference[0]:.2f}x" if reference else "-",
                         "SpecForge GiB": reference[1] if reference else "-"})
        lines += ["## Drafter training (TTT 7, one optimizer step)", "", markdown_table(pd.DataFrame(rows), "g"), ""]
    return "\n".join(lines)


def render_extraction(extract: dict, ceilings: dict) -> list[str]:
    import pandas as pd

    from eagle3ops.reporting import markdown_table

    disk_limit = ceilings["disk_write_gbps"] * 1e9 / extract["bytes_per_token"]
    rows = [{"pipeline": run["pipeline"], "batch": run["batch"], "length": run["length"],
             "tok/s": f"{run['tokens_per_s']:,.0f}", "MFU": f"{run['mfu']:.0%}", "disk GB/s": f"{run['disk_gbps']:.2f}",
             "drain s": f"{run['drain_s']:.2f}" if "drain_s" in run else "-",
             "steady tok/s": f"{run['steady_tokens_per_s']:,.0f}" if "steady_tokens_per_s" in run else "-",
             "forward alone tok/s": f"{run['forward_only_tokens_per_s']:,.0f}",
             "of forward": f"{run['tokens_per_s'] / run['forward_only_tokens_per_s']:.0%}",
             "of disk limit": f"{run['tokens_per_s'] / disk_limit:.0%}"} for run in extract["runs"]]
    base = extract["base"]
    at_base = {run["pipeline"]: run["tokens_per_s"] for run in extract["runs"]
               if (run["batch"], run["length"]) == (base["batch"], base["length"])}
    return [f"## Extraction ({extract['target_params'] / 1e9:.1f}B target, {extract['tokens_per_point']:,} tokens per "
            f"row, shards of {extract['shard_tokens']:,} tokens; the disk allows {disk_limit:,.0f} tok/s at "
            f"{extract['bytes_per_token']:,} bytes/token)", "", markdown_table(pd.DataFrame(rows), "g"), "",
            f"ours / naive at batch {base['batch']} x {base['length']}: {at_base['ours'] / at_base['naive']:.2f}x", ""]


def render_split_extraction(split: dict) -> list[str]:
    import pandas as pd

    from eagle3ops.reporting import markdown_table

    rows = [{"placement": run["placement"], "modules per device": ", ".join(f"{d}: {n}" for d, n in
                                                                            run["modules_per_device"].items()),
             "tok/s": f"{run['tokens_per_s']:,.0f}",
             "peak GiB per GPU": " / ".join(str(g) for g in run["peak_gib_per_gpu"]) or "-"} for run in split["runs"]]
    difference = split["max_abs_difference"]
    return [f"## Extraction with the target split over {split['gpus']} GPUs ({split['sequences']} x {split['seq_len']} "
            f"tokens, batch {split['batch_size']})", "", markdown_table(pd.DataFrame(rows), "g"), "",
            f"Largest difference between the stored hidden states of the two placements: aux "
            f"{difference['aux_hidden']:.3g}, final {difference['final_hidden']:.3g}", ""]


def render_data_parallel(bench: dict, backend: str) -> list[str]:
    import pandas as pd

    from eagle3ops.reporting import markdown_table

    alone, together = bench["runs"]
    runs = [{"ranks": run["ranks"], "batch per rank": run["batch_per_rank"], "first step s": run["first_step_s"],
             "step ms": run["step_ms"], "tok/s": f"{run['tokens_per_s']:,.0f}", "peak GiB": run["peak_gib"] or "-"}
            for run in bench["runs"]]
    losses = [{"step": step, "1 rank": a, f"{together['ranks']} ranks": b, "relative difference": abs(a - b) / abs(a)}
              for step, (a, b) in enumerate(zip(alone["losses"], together["losses"]), start=1)]
    return [f"## Data-parallel drafter training ({backend}; TTT 7, global batch {bench['global_batch']} x "
            f"{bench['length']} tokens, {bench['steps']} steps)", "",
            markdown_table(pd.DataFrame(runs), "g"), "",
            f"{together['ranks']} ranks / 1: {bench['speedup']:.2f}x tokens/s "
            f"({bench['speedup'] / together['ranks']:.0%} scaling efficiency); loss curves differ by at most "
            f"{bench['max_loss_rel_diff']:.1e} (relative)", "", "Loss of each optimizer step:", "",
            markdown_table(pd.DataFrame(losses), ("d", ".6f", ".6f", ".1e")), ""]


def batch_sweep_length(rows: list[dict]) -> int:
    """The length measured at the most batch sizes (the shortest of equals): the batch panel's length."""
    batches_at = {n: len({r["batch"] for r in rows if r["length"] == n}) for n in sorted({r["length"] for r in rows})}
    return max(batches_at, key=batches_at.get, default=0)


def plot(results: list[dict], path: Path) -> None:
    """Training tokens/s as the length grows (batch 1) and as the batch grows (at the length measured at the most
    batch sizes), one line per kernel, with SpecForge's reference figures where the size is 8b."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for result in results for row in result.get("train", [])]
    figure, (by_length, by_batch) = plt.subplots(1, 2, figsize=(10, 4))
    series = {kernel: [r for r in rows if r["kernel"] == kernel] for kernel in sorted({r["kernel"] for r in rows})}
    if any(result["size"] == "8b" for result in results):
        series["SpecForge (reference)"] = [{"batch": b, "length": n, "tokens_per_s": v[0]}
                                           for (b, n), v in REFERENCE["specforge_train"].items()]
    base = batch_sweep_length(rows)
    for name, points in series.items():
        longs = sorted((r["length"], r["tokens_per_s"]) for r in points if r["batch"] == 1)
        batches = sorted((r["batch"], r["tokens_per_s"]) for r in points if r["length"] == base)
        by_length.plot(*zip(*longs), marker="o", label=name) if longs else None
        by_batch.plot(*zip(*batches), marker="o", label=name) if batches else None
    lengths = sorted({r["length"] for points in series.values() for r in points if r["batch"] == 1})
    by_length.set(xscale="log", xlabel="sequence length (batch 1)", ylabel="training tokens/s", ylim=(0, None))
    by_length.set_xticks(lengths, [str(n) for n in lengths])
    by_length.minorticks_off()
    by_batch.set(xlabel=f"batch size (length {base})", ylabel="training tokens/s", ylim=(0, None))
    by_length.legend()
    figure.suptitle(f"Drafter training speed on {results[0]['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_extraction(result: dict, path: Path) -> None:
    """Extraction tokens/s as the length grows (fixed tokens per batch) and as the batch grows (at the base
    length): ours, the forward alone at each shape (the compute limit) and the disk limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extract = result["extract"]
    ours = [run for run in extract["runs"] if run["pipeline"] == "ours"]
    base, batch_tokens = extract["base"], extract["base"]["batch"] * extract["base"]["length"]
    disk_limit = result["ceilings"]["disk_write_gbps"] * 1e9 / extract["bytes_per_token"]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key, keep, label in (
            (axes[0], "length", lambda r: r["batch"] * r["length"] == batch_tokens, f"sequence length ({batch_tokens:,} tokens per batch)"),
            (axes[1], "batch", lambda r: r["length"] == base["length"], f"batch size (length {base['length']})")):
        points = sorted((r for r in ours if keep(r)), key=lambda r: r[key])
        xs = [r[key] for r in points]
        axis.plot(xs, [r["forward_only_tokens_per_s"] for r in points], marker="s", linestyle="--", label="forward alone")
        axis.plot(xs, [r["tokens_per_s"] for r in points], marker="o", label="eagle3ops extraction, end to end (on disk)")
        axis.plot(xs, [r["steady_tokens_per_s"] for r in points], marker="o", linestyle=":", color="C1",
                  label="eagle3ops, before the last shard's write")
        axis.axhline(disk_limit, color="grey", linestyle=":", label="disk write limit")
        naive = [r for r in extract["runs"] if r["pipeline"] == "naive"]
        axis.plot([r[key] for r in naive], [r["tokens_per_s"] for r in naive], marker="x", linestyle="", color="red",
                  label="naive pipeline")
        axis.set(xscale="log", xlabel=label, ylabel="extraction tokens/s", ylim=(0, None))
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.minorticks_off()
    axes[0].legend(fontsize=8, loc="lower right")
    figure.suptitle(f"Hidden-state extraction speed on {result['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_result(result: dict, out: Path) -> None:
    from eagle3ops.fs import write_json_atomic

    write_json_atomic(out, result)
    out.with_suffix(".md").write_text(render(result) + "\n")
    if result.get("train"):
        plot([result], out.with_suffix(".png"))
    if result.get("extract"):
        plot_extraction(result, out.with_name(out.stem + "-extract.png"))
