"""What the train stage starts from: the samples with their hidden states, the drafter and the acceptance simulator.

    inputs = load_inputs(cfg, device, engine)      # offline: the extract stage's shards; online: the prepared data
    draft, warm = initial_drafter(cfg, init, inputs)  # new (scratch), or the predecessor's, fine-tuned (warm_start)
    probe = acceptance_simulator(cfg, inputs)       # tau of the drafter being trained, on held-out prompts

train.hidden_states offline reads the states from extract.out_dir; online computes them from the target as
training asks for them (training/online.py): the target in this process (train.online_engine hf), or a vLLM server
capturing them (vllm: the one at train.online_url, or one started here and stopped when `engine` closes).
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3ops.config import Config
from eagle3ops.data.prepare import masked_token_counts
from eagle3ops.data.shards import read_manifest
from eagle3ops.data.vocab import read_vocab_map
from eagle3ops.errors import InputError
from eagle3ops.extraction.vllm import EngineStates, capturing_server
from eagle3ops.fs import WORK_DIR
from eagle3ops.modeling.draft import Eagle3Draft
from eagle3ops.modeling.target import (
    load_embedding_and_head,
    load_target,
    load_text_config,
    load_tokenizer,
    model_text_config,
    resolve_aux_layers,
    target_layout,
)
from eagle3ops.spec_settings import SpecSettings
from eagle3ops.training.data import load_feature_samples
from eagle3ops.training.init import WarmStart, load_warm_start, new_drafter
from eagle3ops.training.online import EngineTargetStates, TargetStates, token_samples


@dataclass
class TrainingInputs:
    train_samples: list[dict[str, torch.Tensor]]
    eval_samples: list[dict[str, torch.Tensor]]
    states: TargetStates | None  # online: where each batch's hidden states come from; offline: in the samples
    aux_layers: list[int]
    embedding: torch.Tensor  # [V, H] the target's, frozen
    lm_head: torch.Tensor  # [V, H] the target's, frozen: the teacher's logits from its final states
    d2t: torch.Tensor  # [draft_vocab] the draft vocabulary's offsets into the target's
    t2d: torch.Tensor  # [V] bool: which target tokens the draft vocabulary holds


def load_inputs(cfg: Config, device: torch.device, engine: ExitStack) -> TrainingInputs:
    embedding, lm_head = load_embedding_and_head(cfg.target.path)
    prepared = Path(cfg.prepare.out_dir)
    if cfg.train.hidden_states == "online":
        train_samples, eval_samples = token_samples(prepared / "train"), token_samples(prepared / "eval")
        states = target_states(cfg, device, len(train_samples) + len(eval_samples), engine)
        aux_layers = states.aux_layers
    else:
        features = Path(cfg.extract.out_dir)
        aux_layers = read_manifest(features / "train")["aux_layers"]
        train_samples = load_feature_samples(features / "train", embedding.shape[1])
        eval_samples = load_feature_samples(features / "eval", embedding.shape[1])
        states = None
    d2t, t2d = read_vocab_map(prepared)
    return TrainingInputs(train_samples, eval_samples, states, aux_layers, embedding, lm_head, d2t, t2d)


def target_states(cfg: Config, device: torch.device, samples: int, engine: ExitStack) -> TargetStates:
    """The target beside the drafter, or a vLLM server capturing its states (the one at train.online_url, or one
    started here and stopped when `engine` closes)."""
    max_nonfinite = cfg.extract.max_nonfinite_fraction
    if cfg.train.online_engine == "hf":
        target = load_target(cfg.target)
        aux_layers = resolve_aux_layers(cfg.target.aux_layers, model_text_config(target).num_hidden_layers)
        return TargetStates(target, aux_layers, device, samples, max_nonfinite)
    if cfg.train.online_url is not None:
        engine_states = EngineStates(cfg.train.online_url, target_layout(cfg.target))
    else:
        WORK_DIR.mkdir(exist_ok=True)
        captured = Path(engine.enter_context(tempfile.TemporaryDirectory(prefix="captured-", dir=WORK_DIR)))
        engine_states = engine.enter_context(capturing_server(cfg.target, cfg.vllm, "train-online", captured))
    return EngineTargetStates(engine_states, device, samples, max_nonfinite)


def initial_drafter(cfg: Config, init: str, inputs: TrainingInputs, device: torch.device | None = None
                    ) -> tuple[Eagle3Draft, WarmStart | None]:
    """scratch: a new drafter on the target's embedding (seeded), initialised on `device`, the one it trains on (None:
    the host); warm_start: train.warm_start (loaded on the host), checked against this target and data and re-headed
    or kept as train.warm_start_vocab says."""
    if init != "warm_start":
        return new_drafter(load_text_config(cfg.target), cfg.train.draft, inputs.aux_layers, inputs.embedding,
                           inputs.d2t, inputs.t2d, cfg.seed, device), None
    warm = load_warm_start(cfg.train.warm_start, cfg.target.path, inputs.embedding, inputs.lm_head, inputs.aux_layers,
                           masked_token_counts(Path(cfg.prepare.out_dir) / "train"), (inputs.d2t, inputs.t2d),
                           cfg.train.warm_start_vocab, cfg.train.warm_start_optimizer,
                           cfg.train.warm_start_min_coverage)
    return warm.draft, warm


def acceptance_simulator(cfg: Config, inputs: TrainingInputs) -> Callable:
    """The acceptance simulator on the first held-out prompts: it needs the whole target beside training (online,
    the one already there, taken in turn with the thread that asks it for hidden states). Its speculative decoding,
    and transformers' model classes with it, is imported here: training without the simulator never needs them."""
    from eagle3ops.training.simulation import AcceptanceSimulator, held_out_prompts

    simulate = cfg.train.simulate
    prompts = held_out_prompts([{k: s[k].tolist() for k in ("input_ids", "loss_mask")} for s in inputs.eval_samples],
                               simulate.prompts)
    if not prompts:
        raise InputError(f"train.simulate: the held-out split ({cfg.prepare.out_dir}/eval) has no sample with an "
                         f"assistant turn to measure acceptance on; raise data.eval_fraction or set "
                         f"train.simulate.every to 0")
    tokenizer = load_tokenizer(cfg.target)
    online = inputs.states
    in_process = online is not None and online.model is not None
    simulator = AcceptanceSimulator(online.model if in_process else load_target(cfg.target), prompts,
                                    SpecSettings(k=simulate.k), simulate.max_new_tokens, {tokenizer.eos_token_id},
                                    cfg.seed)
    if not in_process:
        return simulator

    def in_turn(draft):
        with online.lock:
            return simulator(draft)
    return in_turn
