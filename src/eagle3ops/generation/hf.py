"""Regenerate the assistant turns of conversations with the target itself (the `hf` backend).

A drafter learns to predict its target; answers written by some other model teach it the wrong thing. Turns
are regenerated in order, each one conditioned on the turns regenerated before it, batched across
conversations (left-padded, length-sorted).

`regenerate_in_chunks` makes it resumable: conversations in fixed chunks, each written whole to a work directory
and seeded by its index; a run killed midway keeps the finished chunks, and since a chunk's batches never depend
on what ran before, the result equals an uninterrupted run.
"""
from __future__ import annotations

import copy
import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3ops.data.chat import prompt_ids
from eagle3ops.data.conversations import read_jsonl
from eagle3ops.fs import write_json_atomic, write_jsonl_atomic
from eagle3ops.progress import progress


@dataclass
class GenerateStats:
    conversations: int = 0
    turns: int = 0
    new_tokens: int = 0
    unfinished: int = 0  # hit max_new_tokens before the end-of-turn token
    decode_steps: int = 0  # sequential forwards of the target: each batch decodes until its longest answer ends
    wall_s: float = 0.0

    def add(self, other: GenerateStats) -> None:
        self.turns, self.new_tokens = self.turns + other.turns, self.new_tokens + other.new_tokens
        self.unfinished, self.decode_steps = self.unfinished + other.unfinished, self.decode_steps + other.decode_steps
        self.wall_s += other.wall_s


def regenerate_in_chunks(model, tokenizer, conversations: list[dict], chunk_size: int, batch_size: int,
                         max_new_tokens: int, temperature: float, seed: int, work: Path
                         ) -> tuple[list[dict], GenerateStats, float | None]:
    """`regenerate` chunk by chunk (chunk i seeded with seed + i), each chunk kept in `work` once finished and
    taken from there on a later run. Returns the conversations, the totals, and the throughput of the chunks this
    run generated (new tokens a second; None when all were finished before)."""
    chunks = [conversations[i : i + chunk_size] for i in range(0, len(conversations), chunk_size)]
    total, regenerated, fresh_tokens = GenerateStats(conversations=len(conversations)), [], 0
    finished = sum((work / f"chunk-{i:05d}.jsonl").is_file() for i in range(len(chunks)))
    if finished:
        print(f"generate: resuming after {finished} of {len(chunks)} finished chunks", flush=True)
    turns = sum(m["role"] == "assistant" for c in conversations for m in c["messages"])
    with progress(turns, "generate", "turn") as bar:
        for index, chunk in enumerate(chunks):
            path, stats_path = work / f"chunk-{index:05d}.jsonl", work / f"chunk-{index:05d}.json"
            if path.is_file():  # finished before an interruption; its throughput belongs to that run
                done = [record for _, record in read_jsonl(path)]
                stats = GenerateStats(**{**json.loads(stats_path.read_text()), "wall_s": 0.0})
                bar.update(stats.turns)
            else:
                done, stats = regenerate(model, tokenizer, chunk, batch_size, max_new_tokens, temperature,
                                         seed + index, bar)
                write_json_atomic(stats_path, asdict(stats))
                write_jsonl_atomic(path, done)  # last: its presence marks the chunk finished
                fresh_tokens += stats.new_tokens
            total.add(stats)
            regenerated.extend(done)
    return regenerated, total, (fresh_tokens / total.wall_s if total.wall_s else None)


@torch.no_grad()
def regenerate(model, tokenizer, conversations: list[dict], batch_size: int, max_new_tokens: int,
               temperature: float, seed: int, bar=None) -> tuple[list[dict], GenerateStats]:
    """Regenerate every assistant turn of `conversations`; `bar` (a progress bar counting turns) is optional."""
    torch.manual_seed(seed)
    stats = GenerateStats(conversations=len(conversations))
    out = [copy.deepcopy(c) for c in conversations]
    turns = [[i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"] for c in out]
    eos = tokenizer.eos_token_id
    # left padding, masked out: a tokenizer without a pad token (SmolLM2's, Llama's) pads with its end of sequence
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    start = time.perf_counter()
    with nullcontext(bar) if bar is not None else progress(sum(map(len, turns)), "generate", "turn") as bar:
        for depth in range(max(map(len, turns), default=0)):
            todo = [(c, turns[c][depth]) for c in range(len(out)) if depth < len(turns[c])]
            prompts = {(c, t): prompt_ids(tokenizer, out[c]["messages"][:t]) for c, t in todo}
            todo.sort(key=lambda item: len(prompts[item]))
            for first in range(0, len(todo), batch_size):
                chunk = todo[first : first + batch_size]
                width = max(len(prompts[item]) for item in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, item in enumerate(chunk):  # left padding: every row ends where generation starts
                    ids[row, width - len(prompts[item]) :] = torch.tensor(prompts[item])
                    mask[row, width - len(prompts[item]) :] = 1
                generated = model.generate(
                    input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
                    do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_p=None,
                    top_k=None, eos_token_id=eos, pad_token_id=pad,
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
