"""Warm start: an existing drafter, checked against the target and the new data, ready to fine-tune.

- It keeps the source drafter's d2t/t2d: its lm_head rows are tied to them, and re-deriving them from the new
  data would silently give every row another token's meaning.
- When its draft vocabulary covers too little of the new data (`check-compat` says needs_new_head),
  `train.warm_start_vocab: remap` re-heads it instead: the new data's draft vocabulary, with the old lm_head
  row for every token both vocabularies share and the target's own lm_head row for each new token. `auto` (the
  default) re-heads exactly then: a head whose vocabulary misses the new data's tokens is a guaranteed rejection
  on each of them, and fine-tuning cannot teach it tokens it has no row for.
- `train.warm_start_optimizer: true` also continues the source's AdamW moments (when it was saved with them).
- The source's files are digested (sha256), so the lineage says exactly which drafter was fine-tuned.

No drafter is randomly initialised only to be overwritten: a loaded one is built on the meta device and given memory
its checkpoint fills, a re-headed one gets its new head without a random one first, and a new one (scratch) is
initialised on the device it trains on, where at a real target's size a GPU takes milliseconds and the host seconds.
The frozen embedding is the target's tensor itself, or, in another dtype, converted once on the drafter's device.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3ops.config import DraftShapeConfig, TrainConfig
from eagle3ops.data.shards import sha256_file
from eagle3ops.data.vocab import draft_to_target_ids
from eagle3ops.errors import InputError
from eagle3ops.formats.checkpoint import load_any_drafter
from eagle3ops.formats.conventions import rope_settings
from eagle3ops.formats.specforge import TRAINING_STATE, CheckpointError, use_embedding
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.training.compat import CompatReport, IncompatibleDrafter, check_compat


@dataclass
class WarmStart:
    draft: Eagle3Draft
    compat: CompatReport
    sha256: str  # of the source drafter's files
    vocab: str  # keep | remap: what was done (train.warm_start_vocab auto resolved by the check's verdict)
    remapped_rows: int | None = None  # new-vocabulary rows that had no row in the source head (remap only)
    optimizer_state: dict | None = None


def drafter_sha256(directory: str | Path) -> str:
    """One digest over every file of a drafter directory (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(directory).as_posix()}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def rehead(draft: Eagle3Draft, d2t: torch.Tensor, t2d: torch.Tensor, target_lm_head: torch.Tensor) -> int:
    """Give `draft` a new draft vocabulary (d2t [Vd'], t2d [V]) in place; returns how many rows are new.

    Row r of the new head predicts target token tok(r): it is the old row of tok(r) if the old vocabulary had
    it, else the target's lm_head row of tok(r) (the drafter's last hidden state lives in the target's space).
    """
    old_ids, new_ids = draft_to_target_ids(draft.d2t), draft_to_target_ids(d2t)  # [Vd], [Vd'] target ids
    old_row = torch.full((draft.cfg.vocab_size,), -1, dtype=torch.int64)
    old_row[old_ids] = torch.arange(old_ids.numel())
    source = old_row[new_ids]  # [Vd'] old row per new row, -1 where the token is new
    kept = source >= 0
    weight = target_lm_head[new_ids].to(draft.lm_head.weight.dtype)  # [Vd', H] a new tensor: indexing copies
    weight[kept] = draft.lm_head.weight.detach()[source[kept]]
    draft.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")  # no random init
    draft.lm_head.weight = torch.nn.Parameter(weight)
    draft.d2t, draft.t2d = d2t.clone(), t2d.clone()
    draft.cfg.draft_vocab_size = d2t.numel()
    return int((~kept).sum())


def load_warm_start(source: str | Path, target_dir: str | Path, embedding: torch.Tensor, lm_head: torch.Tensor,
                    aux_layers: list[int], counts: Counter, new_vocab: tuple[torch.Tensor, torch.Tensor],
                    vocab: str = TrainConfig.warm_start_vocab, resume_optimizer: bool = False,
                    min_coverage: float = TrainConfig.warm_start_min_coverage) -> WarmStart:
    """The source drafter, after `check_compat` against the target and the new data's loss-masked token counts.

    Refuses an incompatible drafter, and one trained on other layers than the features hold."""
    report = check_compat(target_dir, source, aux_layers, counts, min_coverage)
    if report.verdict == "incompatible":
        reasons = [f"{f.check}: {f.message}" for f in report.findings if f.level == "incompatible"]
        raise IncompatibleDrafter(f"{source}: cannot warm-start on {target_dir}:\n  " + "\n  ".join(reasons))
    layers = next(f for f in report.findings if f.check == "layers")
    if layers.level != "ok":
        raise CheckpointError(f"{source}: {layers.message}")
    draft = load_any_drafter(source, embedding)
    sha = drafter_sha256(source)
    chosen = vocab if vocab != "auto" else "remap" if report.verdict == "needs_new_head" else "keep"
    if chosen == "keep":
        return WarmStart(draft, report, sha, "keep",
                         optimizer_state=_optimizer_state(source) if resume_optimizer else None)
    if resume_optimizer:
        why = "remap" if vocab == "remap" else "auto, and check-compat says needs_new_head"
        raise InputError(f"train.warm_start_optimizer: the source's optimizer moments belong to its old head; "
                         f"they cannot be continued when the drafter is re-headed (train.warm_start_vocab: {why}); "
                         f"set train.warm_start_vocab: keep to keep its head and moments")
    return WarmStart(draft, report, sha, "remap", remapped_rows=rehead(draft, *new_vocab, lm_head))


def _optimizer_state(source: str | Path) -> dict:
    path = Path(source) / TRAINING_STATE
    if not path.is_file():
        raise CheckpointError(f"{source}: train.warm_start_optimizer is true but there is no {TRAINING_STATE}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle and zip errors alike mean "not a state we can read"
        raise CheckpointError(f"{path}: not a training state eagle3ops can read safely ({err})") from None
    if not isinstance(state, dict) or "optimizer" not in state:
        raise CheckpointError(f"{path}: holds no 'optimizer' state")
    return state["optimizer"]


def new_drafter(target_config, shape: DraftShapeConfig, aux_layers: list[int], embedding: torch.Tensor,
                d2t: torch.Tensor, t2d: torch.Tensor, seed: int, device: torch.device | str | None = None
                ) -> Eagle3Draft:
    """A randomly initialised drafter for a target (its HF config; a wrapper's text config is used), with the
    target's embedding and a vocab map, built on `device` (see `build_drafter`)."""
    if t2d.numel() != embedding.shape[0]:
        raise InputError(f"the draft vocabulary map covers {t2d.numel()} target tokens but the target has "
                         f"{embedding.shape[0]}: it was built for another tokenizer; re-run prepare")
    target_config = target_config.get_text_config()
    hidden = target_config.hidden_size
    cfg = DraftConfig(
        hidden_size=hidden,
        intermediate_size=shape.intermediate_size or target_config.intermediate_size,
        num_attention_heads=shape.num_attention_heads or target_config.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads or shape.num_attention_heads or target_config.num_key_value_heads,
        vocab_size=embedding.shape[0],
        draft_vocab_size=d2t.numel(),
        target_hidden_size=hidden,
        aux_layers=list(aux_layers),
        max_position_embeddings=shape.max_position_embeddings or target_config.max_position_embeddings,
        rope_theta=shape.rope_theta or rope_settings(target_config.to_dict())[0],
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        head_dim=shape.head_dim,
        fc_norm=shape.fc_norm,
        norm_output=shape.norm_output,
    )
    return build_drafter(cfg, embedding, d2t, t2d, seed, device)


def build_drafter(cfg: DraftConfig, embedding: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, seed: int,
                  device: torch.device | str | None = None) -> Eagle3Draft:
    """A drafter of `cfg`, its weights randomly initialised from `seed` on `device` (None: the default device, the
    CPU unless a `torch.device` context says otherwise), holding the target's embedding and the vocab map.

    The same seed gives the same weights on the same kind of device (on the CPU, those of a drafter built there before
    this function took a device); a GPU draws other numbers than the CPU from the same seed."""
    if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise InputError(f"the target's embedding is {tuple(embedding.shape)}; a drafter of hidden size "
                         f"{cfg.hidden_size} over {cfg.vocab_size} tokens reads one of {(cfg.vocab_size, cfg.hidden_size)}")
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else nullcontext():
        draft = Eagle3Draft(cfg)
    use_embedding(draft, embedding)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft
