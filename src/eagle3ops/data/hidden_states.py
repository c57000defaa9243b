"""How the target's hidden states are stored in feature shards (extract.dtype), and read back for training.

float32, bfloat16, float16: the states cast to that dtype, one tensor per name.

float8_e4m3: each token's slice of each layer (aux_hidden holds three layers side by side, final_hidden one) is
divided by its own scale, amax / 448, so that its largest magnitude lands on e4m3's largest finite value, and
stored as e4m3 beside the scales:

    aux_hidden        [T, 3H] float8_e4m3fn     aux_hidden_scale    [T, 3] float32
    final_hidden      [T, H]  float8_e4m3fn     final_hidden_scale  [T, 1] float32

A token then costs 4H + 16 bytes instead of 8H (bf16): 3 bits of mantissa, with the range of every token and layer
kept whole. `decode` multiplies back, on whatever device the tensors are (the training device: the host keeps the
8-bit copy). A NaN or inf state makes its scale NaN or inf, which is how `finite_positions` sees it; no value can
overflow e4m3, since each is at most its scale's 448.
"""
from __future__ import annotations

import torch

FP8 = "float8_e4m3"
STORED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, FP8: torch.float8_e4m3fn}
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
SCALE = "_scale"  # suffix of a quantised tensor's scales
QUANTISE_ROWS = 8192  # positions quantised at a time: 0.7 GB of float32 temporaries at Kimi-K2.5's 3 x 7168


def encode(name: str, states: torch.Tensor, layers: int, dtype: str) -> dict[str, torch.Tensor]:
    """`states` [N, layers * H] as stored under `name` in `dtype`: {name: [N, layers * H]} and, in FP8,
    {name + "_scale": [N, layers]} (float32). FP8 is computed QUANTISE_ROWS positions at a time, so that its float32
    temporaries stay small beside the states."""
    if dtype != FP8:
        return {name: states.to(STORED[dtype])}
    quantised = torch.empty(states.shape, dtype=torch.float8_e4m3fn, device=states.device)
    scales = torch.empty((states.shape[0], layers), dtype=torch.float32, device=states.device)
    for start in range(0, states.shape[0], QUANTISE_ROWS):
        rows = slice(start, start + QUANTISE_ROWS)
        grouped = states[rows].float().unflatten(-1, (layers, -1))  # [n, L, H]
        # a slice all zeros takes any scale; one far below float32's normal range one that still divides it
        scale = (grouped.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
        quantised[rows] = (grouped / scale).clamp_(-E4M3_MAX, E4M3_MAX).flatten(-2)  # float32 states: not in place
        scales[rows] = scale.squeeze(-1)
    return {name: quantised, name + SCALE: scales}


def decode(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """The states stored under `name` ([..., L * H]) in `dtype`, dequantised if they are FP8."""
    scale = tensors.get(name + SCALE)  # [..., L]
    if scale is None:
        return tensors[name].to(dtype)
    grouped = tensors[name].unflatten(-1, (scale.shape[-1], -1)).float()  # [..., L, H]
    return (grouped * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def finite_positions(encoded: dict[str, torch.Tensor]) -> torch.Tensor:
    """[...]: whether every stored value of a position is finite (for FP8, its scales: see the module's doc)."""
    checks = [tensor.isfinite().all(-1) for tensor in encoded.values() if tensor.dtype != torch.float8_e4m3fn]
    return torch.stack(checks).all(0)


def expected_columns(dtype: str, hidden: int, aux_layers: int) -> dict[str, tuple[int, torch.dtype]]:
    """{name: (width, dtype)} of the hidden-state tensors a sample of a shard directory in `dtype` holds."""
    columns = {"aux_hidden": (aux_layers * hidden, STORED[dtype]), "final_hidden": (hidden, STORED[dtype])}
    if dtype == FP8:
        columns.update({"aux_hidden" + SCALE: (aux_layers, torch.float32), "final_hidden" + SCALE: (1, torch.float32)})
    return columns


def bytes_per_token(dtype: str, hidden: int, aux_layers: int = 3) -> int:
    """Bytes a token's hidden states take in a shard (input_ids int32 and loss_mask uint8 add 5)."""
    return sum(width * torch.empty((), dtype=kind).element_size()
               for width, kind in expected_columns(dtype, hidden, aux_layers).values())
