"""Tiny Llama targets: built from a config, trained on chat conversations, saved as ordinary HF checkpoints."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from eagle3ops.config import LMTrainConfig, TinyLlamaConfig
from eagle3ops.progress import progress
from eagle3ops.training.data import batches, pad_batch
from eagle3ops.training.loop import seed_everything
from eagle3ops.training.optimizers import warmup_cosine


def build_llama(shape: TinyLlamaConfig, tokenizer, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def train_lm(model: LlamaForCausalLM, samples: list[dict], train: LMTrainConfig, seed: int, desc: str) -> dict:
    """Next-token training on the assistant tokens of tokenized chats ({"input_ids", "loss_mask"} each)."""
    seed_everything(seed)
    model.train()
    rows = [{"input_ids": torch.tensor(s["input_ids"]), "labels": torch.tensor(s["input_ids"]),
             "loss_mask": torch.tensor(s["loss_mask"])} for s in samples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(0.9, 0.95), weight_decay=train.weight_decay)
    scheduler = warmup_cosine(optimizer, train.steps, train.warmup_ratio)
    epoch, step, loss, start = 0, 0, float("nan"), time.perf_counter()
    with progress(train.steps, desc, "step") as bar:
        while step < train.steps:
            for rows_batch in batches(rows, train.batch_size, seed, epoch):
                if step == train.steps:
                    break
                batch = pad_batch(rows_batch, model.device)
                labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, -100)
                out = model(input_ids=batch["input_ids"], labels=labels)
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
                optimizer.step()
                scheduler.step()
                step, loss = step + 1, out.loss.item()
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            epoch += 1
    model.eval()
    return {"steps": step, "final_loss": loss, "wall_s": time.perf_counter() - start}


def save_target(model: LlamaForCausalLM, tokenizer, directory: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """config.json + model.safetensors (in `dtype`) + tokenizer files + generation_config.json (stops at
    <|im_end|>). The model itself stays as it is: the successor goes on training from the predecessor."""
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    stored = model if dtype == model.dtype else copy.deepcopy(model).to(dtype)
    stored.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
