"""Timing on a device, and the machine's ceilings (matrix product, device copy, disk write with fsync)."""
from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch

from eagle3ops.modeling.draft import compute_dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 10, warmup: int = 3) -> float:
    """Mean seconds of `fn()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def measure_ceilings(device: torch.device, matmul_n: int, disk_dir: Path, disk_bytes: int) -> dict:
    dtype = compute_dtype(device)
    a, b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype), torch.randn(matmul_n, matmul_n, device=device,
                                                                                    dtype=dtype)
    matmul_s = timed(partial(torch.matmul, a, b), device)
    source = torch.empty(disk_bytes // 2, dtype=torch.bfloat16, device=device)
    destination = torch.empty_like(source)
    copy_s = timed(partial(destination.copy_, source), device)
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


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
