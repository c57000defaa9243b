"""Stage `generate`: regenerate the assistant turns with the target (`hf`), or keep the dataset's own (`none`).

Resumable: conversations are regenerated in fixed chunks of `generate.chunk_size`, each written whole to
`.eagle3ops/resume/generate-<key>/` (keyed by params and input md5s); a run killed midway keeps the finished
chunks, and since a chunk's batches never depend on what ran before, the result equals an uninterrupted run.
"""
import json
import shutil
from dataclasses import asdict

from eagle3ops.config import Config
from eagle3ops.data.conversations import load_conversations, read_jsonl
from eagle3ops.fs import write_json_atomic, write_jsonl_atomic
from eagle3ops.generation import GenerateStats, regenerate
from eagle3ops.metrics import record
from eagle3ops.modeling.target import load_target, load_tokenizer, model_size
from eagle3ops.progress import progress
from eagle3ops.resume import resume_point
from eagle3ops.tracking import params_digest, stage_run


def run(cfg: Config) -> None:
    backend, gen = cfg.generate.backend, cfg.generate
    with stage_run(cfg, "generate", variant=backend, inputs=[cfg.data.conversations, cfg.target.path]) as tracked:
        conversations = load_conversations(cfg.data.conversations)
        metrics: dict = {"backend": backend, "conversations": len(conversations)}
        if backend == "hf":
            with tracked.phase("load"):
                tokenizer, model = load_tokenizer(cfg.target), load_target(cfg.target)
            work = resume_point("generate", {"params": params_digest(cfg), "inputs": tracked.input_md5s}).path.with_suffix("")
            work.mkdir(parents=True, exist_ok=True)
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
                    regenerated.extend(done)
            conversations = regenerated
            metrics.update(**model_size(model), turns=total.turns, new_tokens=total.new_tokens,
                           unfinished_turns=total.unfinished,
                           tokens_per_s=round(fresh_tokens / total.wall_s, 1) if total.wall_s else None)
        write_jsonl_atomic(cfg.generate.out, conversations)
        if backend == "hf":
            shutil.rmtree(work)
        record(tracked, "generate", metrics)
