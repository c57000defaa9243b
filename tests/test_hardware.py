from __future__ import annotations

import os

from eagle3ops.tracking.hardware import fingerprint, label

KEYS = {
    "accelerator", "gpu_count", "gpu_models", "gpu_memory_gib", "gpu_link", "cpu_model", "cpu_logical_cores",
    "cpu_usable_cores", "torch_threads", "cpu_capability", "cpu_kernels_pinned", "gpu_deterministic", "ram_gib",
    "disk_free_gib",
    "disk_total_gib", "os", "python", "torch", "cuda", "driver", "transformers", "dvc", "mlflow",
}


def test_fingerprint_has_every_key_with_plain_values() -> None:
    fp = fingerprint()
    assert set(fp) == KEYS
    assert all(isinstance(value, (str, int, float)) for value in fp.values())


def test_the_label_of_this_machine() -> None:
    fp = fingerprint()
    if fp["gpu_count"] == 0:
        assert label(fp) == f"cpu-{len(os.sched_getaffinity(0))}c"
    else:  # "1xH200", "8xRTXPRO6000-pcie": the count, then the model without its vendor
        assert label(fp).startswith(f"{fp['gpu_count']}x") and "NVIDIA" not in label(fp) and " " not in label(fp)


def test_gpu_labels_from_hand_made_fingerprints() -> None:
    h200 = {"gpu_count": 1, "gpu_models": "NVIDIA H200", "gpu_link": "n/a"}
    pro = {"gpu_count": 8, "gpu_models": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "gpu_link": "pcie"}
    b300 = {"gpu_count": 8, "gpu_models": "NVIDIA B300", "gpu_link": "nvlink"}
    assert label(h200) == "1xH200"
    assert label(pro) == "8xRTXPRO6000-pcie"
    assert label(b300) == "8xB300-nvlink"
    assert label({"gpu_count": 0, "cpu_usable_cores": "unknown", "cpu_logical_cores": 4}) == "cpu-4c"


def test_override_wins() -> None:
    assert label(fingerprint(), override="laptop") == "laptop"
    assert label({"gpu_count": 8, "gpu_models": "NVIDIA H200", "gpu_link": "nvlink"}, "rented-b") == "rented-b"
