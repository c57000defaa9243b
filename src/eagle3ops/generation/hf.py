"""Regenerate the assistant turns of conversations with the target itself (the `hf` backend).

A drafter learns to predict its target; answers written by some other model teach it the wrong thing. Turns
are regenerated in order, each one conditioned on the turns regenerated before it, batched across
conversations (left-padded, length-sorted).
"""
from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from eagle3ops.data.chat import prompt_ids
from eagle3ops.progress import progress


@dataclass
class GenerateStats:
    conversations: int = 0
    turns: int = 0
    new_tokens: int = 0
    unfinished: int = 0  # hit max_new_tokens before the end-of-turn token
    decode_steps: int = 0  # sequential forwards of the target: each batch decodes until its longest answer ends
    wall_s: float = 0.0


@torch.no_grad()
def regenerate(model, tokenizer, conversations: list[dict], batch_size: int, max_new_tokens: int,
               temperature: float, seed: int, bar=None) -> tuple[list[dict], GenerateStats]:
    """Regenerate every assistant turn of `conversations`; `bar` (a progress bar counting turns) is optional."""
    torch.manual_seed(seed)
    stats = GenerateStats(conversations=len(conversations))
    out = [copy.deepcopy(c) for c in conversations]
    turns = [[i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"] for c in out]
    eos = tokenizer.eos_token_id
    start = time.perf_counter()
    with nullcontext(bar) if bar is not None else progress(sum(map(len, turns)), "generate", "turn") as bar:
        for depth in range(max(map(len, turns), default=0)):
            todo = [(c, turns[c][depth]) for c in range(len(out)) if depth < len(turns[c])]
            prompts = {(c, t): prompt_ids(tokenizer, out[c]["messages"][:t]) for c, t in todo}
            todo.sort(key=lambda item: len(prompts[item]))
            for first in range(0, len(todo), batch_size):
                chunk = todo[first : first + batch_size]
                width = max(len(prompts[item]) for item in chunk)
                ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, item in enumerate(chunk):  # left padding: every row ends where generation starts
                    ids[row, width - len(prompts[item]) :] = torch.tensor(prompts[item])
                    mask[row, width - len(prompts[item]) :] = 1
                generated = model.generate(
                    input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
                    do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_p=None,
                    top_k=None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                )[:, width:].cpu()
                stats.decode_steps += generated.shape[1]
                for row, (c, t) in enumerate(chunk):
                    tokens = generated[row].tolist()
                    if eos in tokens:
                        tokens = tokens[: tokens.index(eos)]
                    else:
                        stats.unfinished += 1
                    out[c]["messages"][t]["content"] = tokenizer.decode(tokens, skip_special_tokens=True)
                    stats.new_tokens += len(tokens) + 1
                    stats.turns += 1
                bar.update(len(chunk))
    stats.wall_s = time.perf_counter() - start
    return out, stats
