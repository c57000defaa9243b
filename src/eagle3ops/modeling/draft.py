"""The EAGLE-3 draft model, its training-time-test (TTT) attention and its loss, in one place.

Notation: B batch, T sequence, H hidden size (= the target's), Ht target hidden size, V target vocabulary,
Vd draft vocabulary, nh / nkv attention / key-value heads, hd head dim, K number of TTT steps.

Per position t the drafter sees the fused target feature g_t = fc(cat(h_low, h_mid, h_high)) and the embedding
of the next token x_{t+1}, and predicts x_{t+2}. One Llama decoder layer whose attention input is 2H wide:
cat(input_layernorm(embedding), hidden_norm(feature)); the residual stream is the feature. Its pre-norm output
is the feature for the next draft step, at training time (TTT) and when serving.

Parameter names are those of SpecForge / SGLang's `LlamaForCausalLMEagle3` checkpoints (`fc`, `midlayer.*`,
`norm`, `lm_head`, buffers `d2t`, `t2d`); the embedding is the target's, frozen, and never saved.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: list[int] = field(default_factory=list)  # HF hidden_states indices the features come from
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, 1, T, hd] (Llama's rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [B, T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache:
    """Keys/values of the draft layer while serving: [B, nkv, L, hd], cut back after each verification."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


@torch.compiler.disable  # built on the host once per shape and kept; a compiled step receives it as an input
@functools.cache
def _ttt_block_mask(T: int, steps: int, device: str):
    """The TTT mask: which keys of cat(K_0, ..., K_{steps-1}) [steps * T] query t of step k = steps - 1 sees:
    the step-0 keys causally (K_0[<= t]) and every later step's key at its own position only (K_j[t]).
    For T = 4 and step 2 (x = visible):

                     K_0        K_1        K_2
        query   t:  0 1 2 3    0 1 2 3    0 1 2 3
                0   x . . .    x . . .    x . . .
                1   x x . .    . x . .    . x . .
                2   x x x .    . . x .    . . x .
                3   x x x x    . . . x    . . . x

    Built once per (length, step): flex attention then skips the empty tiles, so steps 1..k cost only their
    diagonal tiles instead of the (k+1) T^2 scores an explicit mask would compute."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):
        block, position = kv_idx // T, kv_idx % T
        return ((block == 0) & (position <= q_idx)) | ((block > 0) & (position == q_idx))

    return create_block_mask(visible, None, None, T, steps * T, device=device)


def ttt_attention_flex(q: torch.Tensor, ttt_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The TTT attention in one fused kernel: q [B, nh, T, hd] over cat(K_0..K_k) [B, nkv, (k+1)T, hd]."""
    T, steps = q.shape[2], len(ttt_cache)
    keys = torch.cat([k for k, _ in ttt_cache], dim=2) if steps > 1 else ttt_cache[0][0]
    values = torch.cat([v for _, v in ttt_cache], dim=2) if steps > 1 else ttt_cache[0][1]
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, keys, values, enable_gqa=q.shape[1] != keys.shape[1],
                          block_mask=_ttt_block_mask(T, steps, str(q.device)))


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.kernel = "auto"  # TTT attention: flex (fused), reference (explicit), auto = flex on a GPU

    def _qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.repeat_interleave(self.nh // self.nkv, dim=1)  # [B, nkv, ., hd] -> [B, nh, ., hd]

    def forward_ttt(self, x, cos, sin, ttt_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """TTT step k = len(ttt_cache): queries attend causally to step-0 keys and to the keys of steps 1..k at
        their own position only. x [B, T, 2H] -> [B, T, H]; appends this step's keys/values [B, nkv, T, hd]
        to `ttt_cache`. On a GPU one fused flex-attention kernel does it (`ttt_attention_flex`), anywhere else
        the explicit form below, which is also the reference the tests hold the kernel to."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        ttt_cache.append((k, v))
        if self.kernel == "flex" or (self.kernel == "auto" and x.is_cuda):
            out = ttt_attention_flex(q, ttt_cache)
        else:
            out = self.ttt_attention_reference(q, ttt_cache)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def ttt_attention_reference(self, q: torch.Tensor, ttt_cache: list) -> torch.Tensor:
        """q [B, nh, T, hd] -> [B, nh, T, hd]: step-0 scores [T, T] causal, steps 1..k one score per position."""
        T = q.shape[2]
        (k0, v0), *later = [(self._expand(k), self._expand(v)) for k, v in ttt_cache]
        scale = 1.0 / math.sqrt(self.hd)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, nh, T, T]
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in later]  # k x [B, nh, T, 1]
        weights = torch.cat([scores0, *diag], dim=-1).float().softmax(-1).to(q.dtype)  # [B, nh, T, T + k]
        out = weights[..., :T] @ v0  # [B, nh, T, hd]
        for j, (_, vj) in enumerate(later):
            out = out + weights[..., T + j : T + j + 1] * vj
        return out

    def forward_cached(self, x, cos, sin, cache: KVCache) -> torch.Tensor:
        """Serving: new positions attend causally to everything cached. x [B, n, 2H] -> [B, n, H]."""
        B, n, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        past = cache.length
        keys, values = cache.append(k, v)
        causal = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(q, self._expand(keys), self._expand(values), attn_mask=causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, ttt_cache=None, kv_cache=None) -> torch.Tensor:
        """embeds, hidden [B, T, H] -> new hidden [B, T, H] (pre-norm residual stream)."""
        x = self.attention_input(embeds, hidden)  # [B, T, 2H]
        if kv_cache is not None:
            attn = self.self_attn.forward_cached(x, cos, sin, kv_cache)
        else:
            attn = self.self_attn.forward_ttt(x, cos, sin, ttt_cache)
        return self.feed_forward(hidden + attn)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3Ht] target features -> [B, T, H]."""
        return self.fc(aux_hidden)

    def forward(self, input_ids, hidden, positions, ttt_cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One training-time-test step: input_ids [B, T], hidden [B, T, H], positions [B, T]
        -> (hidden out [B, T, H], draft logits [B, T, Vd]); this step's keys and values join `ttt_cache`.
        What a training loop compiles (`module.compile()`); serving calls `step`, never compiled."""
        cos, sin = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta)
        hidden = self.midlayer(self.embed_tokens(input_ids), hidden, cos, sin, ttt_cache=ttt_cache)
        return hidden, self.head(hidden)

    def step(self, input_ids, hidden, positions, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One serving step over new positions, attending to `kv_cache` (shapes as `forward`'s)."""
        cos, sin = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta)
        hidden = self.midlayer(self.embed_tokens(input_ids), hidden, cos, sin, kv_cache=kv_cache)
        return hidden, self.head(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> draft logits [B, T, Vd]."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def compute_dtype(device: torch.device) -> torch.dtype:
    """What training computes in: bf16 on a GPU, as autocast runs it and the target produced its states;
    float32 elsewhere, where bf16 matrix products are slow."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def shift_left(x: torch.Tensor, by: int = 1) -> torch.Tensor:
    """[B, T, ...] -> the same shape, x[:, t + by] at t, zero-padded at the end."""
    return torch.cat([x[:, by:], torch.zeros_like(x[:, :by])], dim=1)


@torch.no_grad()
def target_distribution(final_hidden, lm_head_weight, t2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Target's next-token distribution restricted to the draft vocabulary.

    final_hidden [B, T, Ht] (after the target's final norm), lm_head_weight [V, Ht]
    -> probs [B, T, Vd], in_draft [B, T] (the target's argmax is a draft token; only such positions count).
    The full-vocabulary logits serve the argmax alone; the softmax needs only the draft rows of lm_head. On a
    GPU both products run in bf16, as the target computes its own logits, and the softmax in fp32.
    """
    dtype = compute_dtype(final_hidden.device)
    hidden, weight = final_hidden.to(dtype), lm_head_weight.to(dtype)
    in_draft = t2d[(hidden @ weight.T).argmax(-1)]  # [B, T, V] -> [B, T]
    return (hidden @ weight[t2d].T).float().softmax(-1), in_draft


@dataclass
class TTTResult:
    loss: torch.Tensor  # sum_k decay^k * loss_k, to backpropagate
    losses: list[float]  # loss_k
    accs: list[float]  # acc_k over counted positions (target argmax in the draft vocabulary)
    counted: list[int]  # positions counted at step k
    masked: list[int]  # loss-masked positions at step k, counted or not: counted/masked is the vocab coverage


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, target_top: torch.Tensor,
                       counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One TTT step's summed loss and correct count over its counted positions.

    logits [B, n, Vd] (bf16 under autocast), target_p [B, n, Vd] float32, target_top, counted [B, n]
    -> (sum over counted positions of -(p * log_softmax(z)).sum(-1), how many of them have argmax z = target_top).
    Written as lse(z) * sum(p) - (p * z).sum(-1), so that compiled (as the training loop runs it on a GPU) the forward
    is one reduction kernel over the logits and the backward one pointwise kernel, softmax(z) * sum(p) - p, with
    no float32 copy of the logits kept between them.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32
    per_position = torch.logsumexp(z, dim=-1) * target_p.sum(-1) - (target_p * z).sum(-1)  # [B, n]
    correct = (logits.argmax(-1) == target_top) & counted
    return (per_position * counted).sum(), correct.sum()


def ttt_loss(draft: Eagle3Draft, input_ids, aux_hidden, final_hidden, loss_mask, lm_head_weight,
             ttt_steps: int = 7, decay: float = 0.8, normaliser=None, cross_entropy=soft_cross_entropy) -> TTTResult:
    """Training-time test: K draft steps, each feeding its own output hidden state to the next.

    input_ids, loss_mask [B, T]; aux_hidden [B, T, 3Ht]; final_hidden [B, T, Ht]; loss_mask marks the
    tokens the drafter must predict. Step k at position t sees emb(x_{t+k+1}), predicts x_{t+k+2} against the
    target's distribution at t+k+1, and counts where loss_mask[t+k+2] is 1 and the target's argmax is in
    the draft vocabulary (a token outside it can never be drafted; acc_k leaves it out, as SpecForge does,
    so acc_k * coverage is the share of all masked tokens the drafter gets right). The target side is
    computed once and read through views at each step's offset, never copied per step.

    Each step's loss is its summed soft cross-entropy over the counted positions divided by their count (at
    least 1); `normaliser` (data-parallel training: distributed.global_normaliser) maps that count [] to
    the divisor instead, so that the ranks' losses average to the loss of the whole global batch.
    `cross_entropy` computes one step's summed loss (`soft_cross_entropy`, compiled by the training loop on a GPU).
    """
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    target_p, in_draft = target_distribution(final_hidden, lm_head_weight, draft.t2d)  # x_{j+1} at j
    target_top = target_p.argmax(-1)  # [B, T] the target's choice, as a draft id
    mask = loss_mask.bool()
    next_ids = shift_left(input_ids)  # x_{t+1} at t
    hidden = draft.fuse(aux_hidden)
    ttt_cache: list = []
    total = hidden.new_zeros((), dtype=torch.float32)
    per_step = []  # [loss_k, correct_k, counted_k, masked_k] as tensors: read back once, not once per step
    for k in range(ttt_steps):
        hidden, logits = draft(next_ids, hidden, positions, ttt_cache)
        n = max(0, T - k - 2)  # positions t whose target token x_{t+k+2} exists
        aligned = slice(k + 1, k + 1 + n)  # target side of position t at t+k+1
        masked = mask[:, k + 2 : k + 2 + n]  # [B, n] x_{t+k+2} is an assistant token
        counted = masked & in_draft[:, aligned]
        count = counted.sum()
        divisor = count.clamp(min=1) if normaliser is None else normaliser(count)
        summed, correct = cross_entropy(logits[:, :n], target_p[:, aligned], target_top[:, aligned], counted)
        loss_k = summed / divisor
        total = total + decay**k * loss_k
        per_step.append(torch.stack([loss_k.detach(), correct.float(), count.float(), masked.sum().float()]))
        next_ids = shift_left(next_ids)
    losses, corrects, counts, masks = torch.stack(per_step).T.tolist()
    return TTTResult(total, losses, [c / max(1, n) for c, n in zip(corrects, counts)],
                     [int(n) for n in counts], [int(m) for m in masks])
