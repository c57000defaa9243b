"""Stage `generate`: regenerate the assistant turns with the target in this process (`hf`), through a vLLM server
the stage starts (`vllm`) or an OpenAI-compatible server that serves it (`openai`), or keep the dataset's own
answers (`none`).

Resumable, under `.eagle3ops/resume/generate-<key>/` (the key hashes what determines the result):
- hf: conversations are regenerated in fixed chunks of `generate.chunk_size`, each written whole; a run killed
  midway keeps the finished chunks, and since a chunk's batches never depend on what ran before, the result
  equals an uninterrupted run.
- vllm, openai: each finished conversation is appended to `openai.jsonl` (generation/openai.py) and never sent
  again.
  The key covers the conversations themselves, the generation settings and the target's identity, not the
  server's address or concurrency: a run restarted against another replica, or with fewer requests in flight,
  picks up where the last one stopped.
"""
import hashlib
import json
import shutil
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

from eagle3ops.config import Config, OpenAIEndpointConfig
from eagle3ops.data.chat import read_chat_template
from eagle3ops.data.conversations import load_conversations, read_jsonl
from eagle3ops.fs import write_json_atomic, write_jsonl_atomic
from eagle3ops.generation.hf import GenerateStats, regenerate
from eagle3ops.generation.openai import regenerate_openai
from eagle3ops.modeling.target import load_target, load_tokenizer, model_size
from eagle3ops.progress import progress
from eagle3ops.resume import resume_point
from eagle3ops.serving.vllm import vllm_server
from eagle3ops.tracking.identity import identity_params
from eagle3ops.tracking.metrics import record
from eagle3ops.tracking.run import stage_run


def run(cfg: Config) -> None:
    backend = cfg.generate.backend
    identity = identity_params(cfg.target)
    with stage_run(cfg, "generate", inputs=[cfg.data.conversations, cfg.target.path],
                   extra_params=identity) as tracked:
        conversations = load_conversations(cfg.data.conversations)
        metrics: dict = {"dataset_conversations": len(conversations)}
        if cfg.generate.max_conversations is not None:  # a pilot: the first N, the same N every run
            conversations = conversations[: cfg.generate.max_conversations]
        metrics["conversations"] = len(conversations)
        work = None
        if backend == "hf":
            work = _work_dir({"params": cfg.stage_digest(), "inputs": tracked.input_md5s})
            conversations = _regenerate_hf(cfg, conversations, tracked, work, metrics)
        elif backend in ("vllm", "openai"):
            gen = cfg.generate
            work = _work_dir({"backend": backend, "target": identity, "seed": cfg.seed,
                              "conversations": hashlib.sha256(json.dumps(conversations).encode()).hexdigest(),
                              "max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature,
                              "model": gen.openai.model, "extra_body": gen.openai.extra_body})
            if backend == "vllm":
                conversations = _regenerate_vllm(cfg, conversations, tracked, work, metrics)
            else:
                conversations = _regenerate_openai(cfg, gen.openai, conversations, tracked, work, metrics)
        write_jsonl_atomic(cfg.generate.out, conversations)
        if work is not None:
            shutil.rmtree(work)
        record(tracked, "generate", metrics)


def _work_dir(determinants: dict) -> Path:
    work = resume_point("generate", determinants).path.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    return work


def _regenerate_hf(cfg: Config, conversations: list[dict], tracked, work: Path, metrics: dict) -> list[dict]:
    gen = cfg.generate
    with tracked.phase("load"):
        tokenizer, model = load_tokenizer(cfg.target), load_target(cfg.target)
    chunks = [conversations[i : i + gen.chunk_size] for i in range(0, len(conversations), gen.chunk_size)]
    total = GenerateStats(conversations=len(conversations))
    turns = sum(m["role"] == "assistant" for c in conversations for m in c["messages"])
    regenerated, fresh_tokens = [], 0
    finished = sum((work / f"chunk-{i:05d}.jsonl").is_file() for i in range(len(chunks)))
    if finished:
        print(f"generate: resuming after {finished} of {len(chunks)} finished chunks", flush=True)
    with tracked.phase("generate"), progress(turns, "generate", "turn") as bar:
        for index, chunk in enumerate(chunks):
            path, stats_path = work / f"chunk-{index:05d}.jsonl", work / f"chunk-{index:05d}.json"
            if path.is_file():  # finished before an interruption; its throughput belongs to that run
                done = [record for _, record in read_jsonl(path)]
                stats = GenerateStats(**{**json.loads(stats_path.read_text()), "wall_s": 0.0})
                bar.update(stats.turns)
            else:
                done, stats = regenerate(model, tokenizer, chunk, gen.batch_size, gen.max_new_tokens,
                                         gen.temperature, cfg.seed + index, bar)
                write_json_atomic(stats_path, asdict(stats))
                write_jsonl_atomic(path, done)  # last: its presence marks the chunk finished
                fresh_tokens += stats.new_tokens
            total.turns, total.new_tokens = total.turns + stats.turns, total.new_tokens + stats.new_tokens
            total.unfinished, total.wall_s = total.unfinished + stats.unfinished, total.wall_s + stats.wall_s
            total.decode_steps += stats.decode_steps
            regenerated.extend(done)
    metrics.update(**model_size(model), turns=total.turns, new_tokens=total.new_tokens,
                   unfinished_turns=total.unfinished, decode_steps=total.decode_steps,
                   tokens_per_s=round(fresh_tokens / total.wall_s, 1) if total.wall_s else None)
    return regenerated


def _regenerate_vllm(cfg: Config, conversations: list[dict], tracked, work: Path, metrics: dict) -> list[dict]:
    """The openai backend against a vLLM server of the target that this stage starts and stops."""
    template = read_chat_template(cfg.target.chat_template) if cfg.target.chat_template else None
    with ExitStack() as server:
        with tracked.phase("load"):  # the server's start: the engine loading the target
            url = server.enter_context(vllm_server(cfg.target.path, cfg.target.dtype, cfg.vllm, "generate",
                                                   cfg.seed, chat_template=template))
        endpoint = replace(cfg.generate.openai, base_url=f"{url}/v1", model=None)
        return _regenerate_openai(cfg, endpoint, conversations, tracked, work, metrics)


def _regenerate_openai(cfg: Config, endpoint: OpenAIEndpointConfig, conversations: list[dict], tracked, work: Path,
                       metrics: dict) -> list[dict]:
    gen = cfg.generate
    turns = sum(m["role"] == "assistant" for c in conversations for m in c["messages"])
    with tracked.phase("generate"), progress(turns, "generate", "turn") as bar:
        records, stats = regenerate_openai(conversations, endpoint, gen.max_new_tokens, gen.temperature, cfg.seed,
                                           work / "openai.jsonl", on_turns=bar.update)
    metrics.update(turns=stats.turns, new_tokens=stats.completion_tokens, prompt_tokens=stats.prompt_tokens,
                   unfinished_turns=stats.unfinished, resumed_conversations=stats.resumed,
                   requests=stats.requests, retries=stats.retries,
                   tokens_per_s=round(stats.tokens_per_s, 1) if stats.tokens_per_s else None,
                   conversations_per_s=round(stats.conversations_per_s, 3) if stats.conversations_per_s else None)
    return records
