"""Several sequences in one Hugging Face KV cache, each with its own length, accepted tokens and tree.

The cache holds L slots per row; `valid` [B, L] says which slots are real tokens of that row. Rows start
left-padded (padding slots invalid); every forward appends the same number of slots to every row, and `commit`
keeps per row only the slots it accepted (the accepted tree path), leaving the rest as holes that no later
query attends to. Trailing slots no row kept are cropped, so batch 1 on a chain never holds a hole.

Every forward passes explicit position ids (a row's position = its count of real tokens before, so padding and
holes never shift RoPE) and a 4D additive float mask [B, 1, n, L + n]: 0 where a query may attend, the dtype's
minimum elsewhere. Transformers' masking_utils (4.53 on, and 5) pass a 4D mask through unchanged ("already
prepared") to the sdpa and eager kernels, which both add a float mask; a bool one would be wrong for eager.
Flash-attention kernels take no custom mask, so the target must run with attn_implementation sdpa or eager.
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from eagle3ops.spec_settings import DecodingError

MASKED_ATTENTION = ("sdpa", "eager")  # the implementations that apply a custom 4D mask


def cache_kwarg(target: PreTrainedModel) -> str:
    """transformers 5 renamed the forward's `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def last_logits_only(target: PreTrainedModel) -> dict:
    """Ask for the last position's logits alone where the model can (a long prompt's [P, V] logits of a 160K
    vocabulary would take gigabytes); models without `logits_to_keep` return them all."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


class TargetBatch:
    def __init__(self, target: PreTrainedModel, batch_size: int):
        implementation = getattr(target.config, "_attn_implementation", "eager")
        if implementation not in MASKED_ATTENTION:
            raise DecodingError("target", f"attention implementation {implementation!r} takes no custom 4D mask; "
                                          f"load the target with attn_implementation one of {MASKED_ATTENTION}")
        self.target = target
        self.cache = DynamicCache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=target.device)  # [B, L]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=target.device)  # [B] real tokens per row

    def forward(self, input_ids: torch.Tensor, depths: torch.Tensor, block_mask: torch.Tensor,
                **model_kwargs) -> torch.Tensor:
        """Append n slots to every row and run them. input_ids [B, n]; depths [B, n]: position offset of each
        new token from the row's next position; block_mask [B, n, n] bool: which new tokens each new token may
        attend to (it always sees the row's valid cached slots). Returns logits [B, n, V]. Call `commit` next."""
        B, n = input_ids.shape
        allowed = torch.cat([self.valid[:, None, :].expand(B, n, -1), block_mask], dim=-1)  # [B, n, L + n]
        dtype = self.target.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]  # [B, 1, n, L + n]
        positions = self.lengths[:, None] + depths
        model_kwargs[cache_kwarg(self.target)] = self.cache
        return self.target(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **model_kwargs).logits

    def commit(self, keep: torch.Tensor) -> None:
        """keep [B, n] bool: which of the last forward's n slots become part of each row."""
        n = keep.shape[1]
        kept = keep.any(0).nonzero()
        drop = n - (int(kept.max()) + 1 if len(kept) else 0)  # trailing slots no row kept
        if drop:
            self.cache.crop(-drop)  # a negative crop means the same in transformers 4 and 5
        self.valid = torch.cat([self.valid, keep[:, : n - drop]], dim=1)
        self.lengths += keep.sum(1)

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Left-padded causal forward of the prompts; every real token is committed. Returns the logits after
        each row's last prompt token [B, V]."""
        P = max(len(p) for p in prompts)
        device = self.valid.device
        ids = torch.zeros(len(prompts), P, dtype=torch.long, device=device)
        real = torch.zeros(len(prompts), P, dtype=torch.bool, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, P - len(prompt):] = torch.tensor(prompt, device=device)
            real[row, P - len(prompt):] = True
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        block = causal & real[:, None, :]  # [B, P, P]; padding queries see nothing and are never read
        depths = (real.cumsum(1) - 1).clamp(min=0)
        logits = self.forward(ids, depths, block, **last_logits_only(self.target))
        self.commit(real)
        return logits[:, -1]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished sequences leave the batch)."""
        self.cache.batch_select_indices(rows)
        self.valid, self.lengths = self.valid[rows], self.lengths[rows]
