"""The EAGLE-3 draft model, its training-time-test (TTT) attention and its loss, in one place.

Notation: B batch, T sequence, H hidden size (= the target's), Ht target hidden size, V target vocabulary,
Vd draft vocabulary, nh / nkv attention / key-value heads, hd head dim, K number of TTT steps.

Per position t the drafter sees the fused target feature g_t = fc(cat(h_low, h_mid, h_high)) and the embedding
of the next token x_{t+1}, and predicts x_{t+2}. One Llama decoder layer whose attention input is 2H wide:
cat(input_layernorm(embedding), hidden_norm(feature)); the residual stream is the feature. Its pre-norm output
is the feature for the next draft step, at training time (TTT) and when serving.

EAGLE-3.1 (DraftConfig.fc_norm, .norm_output; speculators, SpecForge and vLLM name them alike) adds one RMSNorm per
target layer before fc (`fc_norm.{0,1,2}`), and carries the post-norm state instead: the head reads it without a
second norm, and it is the feature of the next draft step.

Parameter names are those of SpecForge / SGLang's `LlamaForCausalLMEagle3` checkpoints (`fc`, `fc_norm.*`,
`midlayer.*`, `norm`, `lm_head`, buffers `d2t`, `t2d`); the embedding is the target's, frozen, and never saved.
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
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm over each target layer's features before fc
    norm_output: bool = False  # EAGLE-3.1: the post-norm state goes to the head and to the next draft step

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
        """Normalised in float32, then scaled in x's dtype, in Llama's order."""
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


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


def repeat_kv(kv: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head for the `group` query heads that share it.
    [B, nkv, L, hd] -> [B, nkv * group, L, hd]."""
    return kv.repeat_interleave(group, dim=1)


BLOCK = 128  # the flex kernel's tile: its block mask lists, per tile of queries, the tiles of keys to read


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """positions [B, T] -> the document of each position [B, T]: a packed row's documents each start at position 0."""
    return (positions == 0).cumsum(-1)


def document_block_mask(documents: torch.Tensor):
    """The flex kernel's block mask of step 0: query t sees key s <= t of its own document. documents [B, T].

    Built from the documents of each tile's first and last token (documents are numbered in row order), never by
    evaluating the mask position by position: a tile of keys is skipped when no document reaches from it to the
    tile of queries, read whole when one document covers both tiles, and masked per position otherwise.
    For documents 0 0 0 0 | 0 0 0 0 | 0 0 1 1 | 1 1 1 1 in tiles of 4 (x read whole, m masked per position,
    . skipped):

                          key tile:  0 1 2 3
                query tile 0         m . . .
                           1         x m . .
                           2         m m m .
                           3         . . m m
    """
    from torch.nn.attention.flex_attention import BlockMask

    T = documents.shape[1]
    tiles = -(-T // BLOCK)
    padded = F.pad(documents, (0, tiles * BLOCK - T), value=int(documents.max()) + 1)  # [B, tiles * BLOCK]
    first, last = padded[:, ::BLOCK], padded[:, BLOCK - 1 :: BLOCK]  # [B, tiles]
    causal = torch.ones(tiles, tiles, dtype=torch.bool, device=documents.device).tril()
    reached = causal & (last[:, None, :] >= first[:, :, None])  # [B, q tile, kv tile]
    whole = causal.tril(-1) & (first[:, None, :] == last[:, :, None])

    def visible(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (padded[b, q_idx] == padded[b, kv_idx])

    def listed(tiles_read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # count [B, 1, n], indices [B, 1, n, n]
        order = torch.argsort((~tiles_read).to(torch.int8), dim=-1, stable=True)
        return tiles_read.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*listed(reached & ~whole), *listed(whole), BLOCK_SIZE=BLOCK, mask_mod=visible,
                                    seq_lengths=(T, T))


@dataclass
class TTTContext:
    """What TTT step k attends to besides its own keys; `ttt_loss` makes one per batch and adds each step's keys.

    Query t of step k sees the step-0 keys of its document up to t, causally, and the keys of steps 1..k at its
    own position t only. For a row packed with documents A (3 tokens) and B (2), step 2 (x = visible):

                        K_0           K_1           K_2
        query  t:  A A A B B    A A A B B    A A A B B
               0   x . . . .    x . . . .    x . . . .
               1   x x . . .    . x . . .    . x . . .
               2   x x x . .    . . x . .    . . x . .
               3   . . . x .    . . . x .    . . . x .
               4   . . . x x    . . . . x    . . . . x

    On a GPU step 0's part is the flex kernel within each document (`document_block_mask`) and the own-position keys
    join it through its log-sum-exp (`add_own_positions`), so no step computes scores for the (k + 1) T^2 pairs of
    the picture; elsewhere `ttt_attention_reference` computes the picture's scores outright. Every step k >= 1 has
    the same inputs: one compiled graph.
    """
    documents: torch.Tensor  # [B, T]
    block_mask: object | None  # the flex kernel's (document_block_mask); None: the explicit reference
    keys0: torch.Tensor | None = None  # [B, nkv, T, hd] step 0's keys and values; None during step 0
    values0: torch.Tensor | None = None
    earlier_keys: torch.Tensor | None = None  # [B, nkv, S, T, hd] steps 1..k-1 in S = max(1, K - 2) slots, the rest
    # repeating step 0's (masked)
    earlier_values: torch.Tensor | None = None
    earlier_used: torch.Tensor | None = None  # [S] bool: the slots step k reads
    earlier: tuple = ()  # ((keys, values), ...) of steps 1..k-1, from which the slots are stacked
    slots: int = 1

    def after(self, keys: torch.Tensor, values: torch.Tensor) -> TTTContext:
        """The context of the next step: this step's keys and values [B, nkv, T, hd] added."""
        if self.keys0 is None:
            earlier = ()
            keys0, values0 = keys, values
        else:
            earlier = (*self.earlier, (keys, values))
            keys0, values0 = self.keys0, self.values0
        # Unused slots repeat step 0's keys and values, masked out: a stack that carries gradients at every step,
        # so that steps 1..K-1 run one compiled graph (zeros would not, and step 1 would compile its own).
        filler = (keys0, values0)
        stack = [torch.stack([kv[i] for kv in earlier] + [filler[i]] * (self.slots - len(earlier)), dim=2)
                 for i in (0, 1)]
        used = torch.arange(self.slots, device=keys.device) < len(earlier)
        return TTTContext(self.documents, self.block_mask, keys0, values0, *stack, used, earlier, self.slots)


def document_causal_attention(q, keys, values, block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's part on a GPU, one fused flex kernel: each query over the keys of its document up to itself.
    q [B, nh, T, hd], keys/values [B, nkv, T, hd] -> out [B, nh, T, hd], log-sum-exp of its scores [B, nh, T]."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    out, aux = flex_attention(q, keys, values, block_mask=block_mask, enable_gqa=q.shape[1] != keys.shape[1],
                              return_aux=AuxRequest(lse=True))
    return out, aux.lse


def ttt_attention_reference(q, keys, values, context: TTTContext) -> torch.Tensor:
    """The TTT attention written out, one softmax over every key the step sees: step 0's keys of the query's
    document up to it (scores [B, nh, T, T], masked) and, from step 1 on, the keys of steps 1..k at the query's own
    position (the used slots of `context` and this step's). q [B, nh, T, hd], this step's keys and values
    [B, nkv, T, hd] -> [B, nh, T, hd]. What a CPU trains with, and what the tests hold the fused kernel to."""
    nh, T, hd = q.shape[1:]
    group, scale = nh // keys.shape[1], 1.0 / math.sqrt(hd)
    expand = functools.partial(repeat_kv, group=group)

    keys0, values0 = (keys, values) if context.keys0 is None else (context.keys0, context.values0)
    documents = context.documents
    visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() & (documents[:, :, None] == documents[:, None])
    scores = (q @ expand(keys0).transpose(-1, -2) * scale).masked_fill(~visible[:, None], float("-inf"))  # [B,nh,T,T]
    own_scores, own_values = [], []  # [B, nh, T, 1] and [B, nh, T, hd] of each key at the query's own position
    if context.keys0 is not None:
        for j in range(context.earlier_keys.shape[2]):
            score = (q * expand(context.earlier_keys[:, :, j])).sum(-1, keepdim=True) * scale
            own_scores.append(score.masked_fill(~context.earlier_used[j], float("-inf")))
            own_values.append(expand(context.earlier_values[:, :, j]))
        own_scores.append((q * expand(keys)).sum(-1, keepdim=True) * scale)
        own_values.append(expand(values))
    weights = torch.cat([scores, *own_scores], dim=-1).float().softmax(-1).to(q.dtype)  # [B, nh, T, T + k]
    out = weights[..., :T] @ expand(values0)
    for j, value in enumerate(own_values):
        out = out + weights[..., T + j : T + j + 1] * value
    return out


def add_own_positions(out0, lse0, q, keys, values, context: TTTContext) -> torch.Tensor:
    """Step k >= 1: the softmax over step 0's keys (given as their output out0 [B, nh, T, hd] and log-sum-exp lse0
    [B, nh, T]) widened by the keys of steps 1..k at the query's own position: the earlier steps' from `context`,
    this step's `keys`/`values` [B, nkv, T, hd]. -> [B, nh, T, hd].

    One score and one weight per (head, position, step): the weights are normalised first, so that the output is a
    weighted sum of out0 and the values, and the compiled backward keeps little beyond the bf16 inputs and those
    weights (no float32 copy of the queries or of the sum). Scores and weights in float32."""
    B, nh, T, hd = q.shape
    nkv = keys.shape[1]
    grouped = q.view(B, nkv, nh // nkv, T, hd)  # the query heads that share each key head

    def score(key: torch.Tensor) -> torch.Tensor:  # [B, nkv, T, hd] -> [B, nkv, g, T]
        return (grouped.float() * key.float()[:, :, None]).sum(-1) / math.sqrt(hd)

    slots = context.earlier_keys.shape[2]
    earlier = [score(context.earlier_keys[:, :, j]).masked_fill(~context.earlier_used[j], float("-inf"))
               for j in range(slots)]
    scores = torch.stack([lse0.view(B, nkv, nh // nkv, T), score(keys), *earlier])  # [2 + S, B, nkv, g, T]
    weights = scores.softmax(0)[..., None]  # [2 + S, B, nkv, g, T, 1]
    mixed = weights[0] * out0.view(B, nkv, nh // nkv, T, hd) + weights[1] * values[:, :, None]
    for j in range(slots):
        mixed = mixed + weights[2 + j] * context.earlier_values[:, :, j, None]
    return mixed.view(B, nh, T, hd).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def _qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward_ttt(self, x, cos, sin, context: TTTContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One TTT step (TTTContext draws the mask). x [B, T, 2H] -> (out [B, T, H], this step's keys and values
        [B, nkv, T, hd])."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if context.block_mask is None:
            out = ttt_attention_reference(q, k, v, context)
        elif context.keys0 is None:  # step 0: attention within each document
            out, _ = document_causal_attention(q, k, v, context.block_mask)
        else:
            out0, lse0 = document_causal_attention(q, context.keys0, context.values0, context.block_mask)
            out = add_own_positions(out0, lse0, q, k, v, context)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd)), k, v

    def forward_cached(self, x, cos, sin, cache: KVCache) -> torch.Tensor:
        """Serving: new positions attend causally to everything cached. x [B, n, 2H] -> [B, n, H]."""
        B, n, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        past = cache.length
        keys, values = cache.append(k, v)
        causal = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(diagonal=past)
        group = self.nh // self.nkv
        out = F.scaled_dot_product_attention(q, repeat_kv(keys, group), repeat_kv(values, group), attn_mask=causal)
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

    def forward_ttt(self, embeds, hidden, cos, sin, context: TTTContext):
        """One TTT step: embeds, hidden [B, T, H] -> (new hidden [B, T, H] (pre-norm residual stream), this step's
        keys and values [B, nkv, T, hd])."""
        attn, keys, values = self.self_attn.forward_ttt(self.attention_input(embeds, hidden), cos, sin, context)
        return self.feed_forward(hidden + attn), keys, values

    def forward(self, embeds, hidden, cos, sin, kv_cache: KVCache) -> torch.Tensor:
        """Serving: embeds, hidden [B, n, H] -> new hidden [B, n, H], attending to `kv_cache`."""
        attn = self.self_attn.forward_cached(self.attention_input(embeds, hidden), cos, sin, kv_cache)
        return self.feed_forward(hidden + attn)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, attention_kernel: str = "auto"):
        """`attention_kernel`: how TTT attention is computed, flex (the fused kernel), reference (the explicit
        scores) or auto (flex on a GPU); the weights and the serving path are the same with each."""
        super().__init__()
        if attention_kernel not in ("auto", "flex", "reference"):
            raise ValueError(f"attention_kernel {attention_kernel!r}: auto, flex or reference")
        self.cfg = cfg
        self.attention_kernel = attention_kernel
        # The target's embedding, frozen: whoever builds a drafter copies it in, so it starts as zeros rather than
        # spending seconds on random values nobody uses (a billion of them for Kimi-K2.5).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.zeros(cfg.vocab_size,
                                                                                             cfg.hidden_size),
                                         _freeze=True)
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
                        if cfg.fc_norm else None)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3Ht] target features (low, mid, high) -> [B, T, H]; EAGLE-3.1 normalises each layer's first."""
        if self.fc_norm is not None:
            layers = aux_hidden.chunk(3, dim=-1)  # 3 x [B, T, Ht]
            aux_hidden = torch.cat([norm(layer) for norm, layer in zip(self.fc_norm, layers)], dim=-1)
        return self.fc(aux_hidden)

    def forward(self, input_ids, hidden, positions, context: TTTContext):
        """One training-time-test step: input_ids [B, T], hidden [B, T, H], positions [B, T] (the step's rotary
        positions) -> (hidden out [B, T, H] (the next step's feature), draft logits [B, T, Vd], this step's keys and
        values [B, nkv, T, hd] for `context.after`). What a training loop compiles (`module.compile()`); serving
        calls `step`, never compiled."""
        cos, sin = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta)
        hidden, keys, values = self.midlayer.forward_ttt(self.embed_tokens(input_ids), hidden, cos, sin, context)
        return *self.output(hidden), keys, values

    def step(self, input_ids, hidden, positions, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One serving step over new positions, attending to `kv_cache` (shapes as `forward`'s)."""
        cos, sin = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return self.output(self.midlayer(self.embed_tokens(input_ids), hidden, cos, sin, kv_cache))

    def output(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's output [B, T, H] -> (the feature of the next draft step [B, T, H], draft logits
        [B, T, Vd]): EAGLE-3 carries the pre-norm state, EAGLE-3.1 the post-norm one, which the head reads as is."""
        normed = self.norm(hidden)
        return normed if self.cfg.norm_output else hidden, self.lm_head(normed)

    def ttt_context(self, positions: torch.Tensor, ttt_steps: int) -> TTTContext:
        """Step 0's context for a batch of packed rows (positions [B, T], each document's own from 0)."""
        documents = document_ids(positions)
        flex = self.attention_kernel == "flex" or (self.attention_kernel == "auto" and positions.device.type == "cuda")
        return TTTContext(documents, document_block_mask(documents) if flex else None, slots=max(1, ttt_steps - 2))

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
def target_distribution(final_hidden, lm_head_weight, t2d) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target's next-token distribution restricted to the draft vocabulary.

    final_hidden [B, T, Ht] (after the target's final norm), lm_head_weight [V, Ht]
    -> probs [B, T, Vd] (renormalised over the draft vocabulary), in_draft [B, T] (the target's argmax is a draft
    token; only such positions count), draft_mass [B, T] (the target's probability inside the draft vocabulary:
    probs * draft_mass is the target's own distribution on those tokens).
    The full-vocabulary logits serve the argmax and their normaliser alone; the softmax needs only the draft rows of
    lm_head. On a GPU both products run in bf16, as the target computes its own logits, and the softmax in fp32 (the
    full normaliser vocabulary-chunk by chunk, so that no float32 copy of [B, T, V] is made).
    """
    dtype = compute_dtype(final_hidden.device)
    hidden, weight = final_hidden.to(dtype), lm_head_weight.to(dtype)
    full = hidden @ weight.T  # [B, T, V]
    in_draft = t2d[full.argmax(-1)]  # [B, T]
    full_lse = torch.stack([chunk.float().logsumexp(-1) for chunk in full.split(16384, dim=-1)]).logsumexp(0)
    del full  # [B, T, V]: the largest tensor of the step, not kept beside the draft logits
    draft_logits = (hidden @ weight[t2d].T).float()  # [B, T, Vd]
    draft_lse = draft_logits.logsumexp(-1)  # [B, T]
    probs = (draft_logits - draft_lse[..., None]).exp()
    return probs, in_draft, (draft_lse - full_lse).exp().clamp(max=1.0)


@dataclass
class TTTResult:
    loss: torch.Tensor  # sum_k decay^k * loss_k, to backpropagate
    losses: list[float]  # loss_k
    accs: list[float]  # acc_k over counted positions (target argmax in the draft vocabulary)
    alphas: list[float]  # alpha_k, the mean acceptance probability at temperature 1 over counted positions
    counted: list[int]  # positions counted at step k
    masked: list[int]  # loss-masked positions at step k, counted or not: counted/masked is the vocab coverage


STEP_LOSSES = ("kl", "lk_alpha", "lk_lambda")  # params.yaml train.loss


def step_loss(logits: torch.Tensor, target_p: torch.Tensor, draft_mass: torch.Tensor, target_top: torch.Tensor,
              counted: torch.Tensor, kind: str = "kl", kl_scale: float = 1.0, kl_decay: float = 3.0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step's summed loss, correct count and summed acceptance probability over its counted positions.

    logits [B, T, Vd] (bf16 under autocast); target_p [B, T, Vd] float32, the target's distribution over the draft
    vocabulary renormalised; draft_mass [B, T], the target's probability inside the draft vocabulary; target_top,
    counted [B, T] -> (summed loss, correct count, summed alpha), each [].

    alpha = sum_v min(draft_mass * p_v, q_v), q = softmax(logits): the probability that a token drafted from q is
    accepted by a verifier sampling from the target at temperature 1 (target mass outside the draft vocabulary is
    never drafted, so never accepted). Per position, by `kind`:

        kl         -(p * log q).sum(-1): the soft cross-entropy, the KL to p up to p's entropy (a constant)
        lk_alpha   -log alpha: the LK loss that maximises acceptance itself (arXiv 2602.23881)
        lk_lambda  w * kl + (1 - w) * (1 - alpha), w = kl_scale * exp(-kl_decay * mean alpha): the KL's dense
                   gradient while alpha is small, acceptance once it grows; mean alpha over this step's counted
                   positions (this rank's, under torchrun), detached

    The KL is written as lse(z) * sum(p) - (p * z).sum(-1), so that compiled (as the training loop runs it on a GPU)
    the forward is reductions over the logits and the backward pointwise kernels, with no float32 copy of the
    logits kept between them; alpha, a reduction too, costs one more pass and is reported whatever the loss.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32
    lse = torch.logsumexp(z, dim=-1)  # [B, T]
    alpha = torch.minimum((z - lse[..., None]).exp(), target_p * draft_mass[..., None]).sum(-1)  # [B, T]
    alpha_sum = (alpha * counted).sum()
    if kind not in STEP_LOSSES:
        raise ValueError(f"step_loss: kind {kind!r} is not one of {STEP_LOSSES}")
    if kind == "lk_alpha":
        per_position = -alpha.clamp(min=1e-6).log()
    else:  # the KL, alone or weighted
        per_position = lse * target_p.sum(-1) - (target_p * z).sum(-1)  # [B, T]
        if kind == "lk_lambda":
            w = kl_scale * torch.exp(-kl_decay * alpha_sum.detach() / counted.sum().clamp(min=1))
            per_position = w * per_position + (1 - w) * (1 - alpha)
    correct = (logits.argmax(-1) == target_top) & counted
    return (per_position * counted).sum(), correct.sum(), alpha_sum.detach()


def ttt_loss(draft: Eagle3Draft, input_ids, aux_hidden, final_hidden, loss_mask, positions, lm_head_weight,
             ttt_steps: int = 7, decay: float = 0.8, normaliser=None, loss=step_loss,
             raise_positions: bool = False) -> TTTResult:
    """Training-time test over packed rows: K draft steps, each feeding its own output hidden state to the next.

    input_ids, loss_mask, positions [B, T]; aux_hidden [B, T, 3Ht]; final_hidden [B, T, Ht]. A row holds whole
    documents one after another, each with its own positions from 0 (training/data.py packs them); loss_mask marks
    the tokens the drafter must predict. Step k at position t sees emb(x_{t+k+1}), predicts x_{t+k+2} against the
    target's distribution at t+k+1, and counts where x_{t+k+2} is in t's document, loss_mask[t+k+2] is 1 and the
    target's argmax is in the draft vocabulary (a token outside it can never be drafted; acc_k leaves it out, as
    SpecForge does, so acc_k * coverage is the share of all masked tokens the drafter gets right).

    Nothing crosses a document's end: not the attention (TTTContext), not the tokens shifted in at each step (zeros
    past the end, as the document alone would see), not the counted positions; a document's losses and gradients
    are those it has trained alone. The target side is computed once, padded by K + 1 positions, and read through
    views at each step's offset: every step's loss has the same shapes, never a copy.

    Rotary positions: every step at the document's own positions (`raise_positions` false, SpecForge's sdpa
    backend), or step k at t + k (true): what t's k-th draft has when vLLM and SGLang serve it (decoding/drafting.py
    does the same), and what speculators' trainer and SpecForge's flex backend train with. Only the relative
    positions in the picture of TTTContext change: step k's query at t + k against step 0's keys at s <= t and the
    own-position keys of steps j at t + j.

    Each step's loss is its summed loss (`loss`: `step_loss`, or a partial of it for another train.loss, compiled by
    the training loop on a GPU) over the counted positions divided by their count (at least 1); `normaliser`
    (data-parallel training: distributed.global_normaliser) maps that count [] to the divisor instead, so that the
    ranks' losses average to the loss of the whole global batch.
    """
    B, T = input_ids.shape
    ahead = ttt_steps + 1  # the last step, K - 1, reads the target side at t + K and the token x_{t+K+1}
    padded_final = F.pad(final_hidden, (0, 0, 0, ahead))
    # [B, T + ahead]: x_{j+1} at j
    target_p, in_draft, draft_mass = target_distribution(padded_final, lm_head_weight, draft.t2d)
    target_top = target_p.argmax(-1)  # the target's choice, as a draft id
    context = draft.ttt_context(positions, ttt_steps)
    documents = F.pad(context.documents, (0, ahead), value=-1)  # [B, T + ahead]
    mask = F.pad(loss_mask.bool(), (0, ahead))
    continues = documents[:, 1 : T + 1] == documents[:, :T]  # [B, T] t + 1 is in t's document
    next_ids = shift_left(input_ids) * continues  # x_{t+1} at t, 0 past the document's end
    hidden = draft.fuse(aux_hidden)
    total = hidden.new_zeros((), dtype=torch.float32)
    per_step = []  # [loss_k, correct_k, alpha_k, counted_k, masked_k] as tensors: read back once, not once per step
    for k in range(ttt_steps):
        hidden, logits, keys, values = draft(next_ids, hidden, positions + k if raise_positions else positions, context)
        if k + 1 < ttt_steps:
            context = context.after(keys, values)
        target = slice(k + 1, k + 1 + T)  # the target side of position t: t + k + 1
        predicted = slice(k + 2, k + 2 + T)  # x_{t+k+2}
        masked = mask[:, predicted] & (documents[:, predicted] == documents[:, :T])  # [B, T] an assistant token of t's
        counted = masked & in_draft[:, target]
        count = counted.sum()
        divisor = count.clamp(min=1) if normaliser is None else normaliser(count)
        summed, correct, alpha = loss(logits, target_p[:, target], draft_mass[:, target], target_top[:, target], counted)
        loss_k = summed / divisor
        total = total + decay**k * loss_k
        per_step.append(torch.stack([loss_k.detach(), correct.float(), alpha, count.float(), masked.sum().float()]))
        next_ids = shift_left(next_ids) * continues
    losses, corrects, alphas, counts, masks = torch.stack(per_step).T.tolist()
    return TTTResult(total, losses, [c / max(1, n) for c, n in zip(corrects, counts)],
                     [a / max(1, n) for a, n in zip(alphas, counts)], [int(n) for n in counts], [int(m) for m in masks])
