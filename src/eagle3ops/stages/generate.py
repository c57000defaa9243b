"""Stage `generate`: regenerate the assistant turns with the target in this process (`hf`), through a vLLM server
the stage starts (`vllm`) or an OpenAI-compatible server that serves it (`openai`), or keep the dataset's own
answers (`none`).

Resumable, under `.eagle3ops/resume/generate-<key>/`: hf in chunks of `generate.chunk_size` (generation/hf.py);
vllm and openai a conversation at a time (generation/openai.py). The key hashes what determines the result: the
stage's params and the inputs' content, but not where the server is or how hard it is driven
(SERVER_NOT_IN_RESUME_KEY): a run restarted against another replica, or with fewer requests in flight, picks up
where the last one stopped.
"""
import shutil
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from eagle3ops.config import Config, OpenAIEndpointConfig
from eagle3ops.data.chat import read_chat_template
from eagle3ops.data.conversations import load_conversations
from eagle3ops.fs import write_jsonl_atomic
from eagle3ops.generation.hf import regenerate_in_chunks
from eagle3ops.generation.openai import regenerate_openai
from eagle3ops.modeling.target import load_target, load_tokenizer, model_size
from eagle3ops.progress import progress
from eagle3ops.resume import resume_point
from eagle3ops.serving.session import ENGINES_TAG, EngineSpec, engine
from eagle3ops.tracking.identity import identity_params
from eagle3ops.tracking.metrics import record
from eagle3ops.tracking.run import stage_run
from eagle3ops.tracking.stage_view import stage_digest

# Where the server is and how hard the stage drives it: none changes what is generated
SERVER_NOT_IN_RESUME_KEY = ("generate.openai.base_url", "generate.openai.concurrency", "generate.openai.max_retries",
                            "generate.openai.timeout_s", "generate.openai.api_key_env")


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
        if backend != "none":
            key = {"params": stage_digest(cfg, ignore=SERVER_NOT_IN_RESUME_KEY), "inputs": tracked.input_md5s}
            work = resume_point("generate", key).path.with_suffix("")
            work.mkdir(parents=True, exist_ok=True)
        if backend == "hf":
            conversations = _regenerate_hf(cfg, conversations, tracked, work, metrics)
        elif backend == "vllm":
            conversations = _regenerate_vllm(cfg, conversations, tracked, work, metrics)
        elif backend == "openai":
            conversations = _regenerate_openai(cfg, cfg.generate.openai, conversations, tracked, work, metrics)
        write_jsonl_atomic(cfg.generate.out, conversations)
        if work is not None:
            shutil.rmtree(work)
        record(tracked, "generate", metrics)


def _regenerate_hf(cfg: Config, conversations: list[dict], tracked, work: Path, metrics: dict) -> list[dict]:
    gen = cfg.generate
    with tracked.phase("load"):
        tokenizer, model = load_tokenizer(cfg.target), load_target(cfg.target)
    with tracked.phase("generate"):
        regenerated, total, tokens_per_s = regenerate_in_chunks(model, tokenizer, conversations, gen.chunk_size,
                                                                gen.batch_size, gen.max_new_tokens, gen.temperature,
                                                                cfg.seed, work)
    metrics.update(**model_size(model), turns=total.turns, new_tokens=total.new_tokens,
                   unfinished_turns=total.unfinished, decode_steps=total.decode_steps,
                   tokens_per_s=round(tokens_per_s, 1) if tokens_per_s else None)
    return regenerated


def _regenerate_vllm(cfg: Config, conversations: list[dict], tracked, work: Path, metrics: dict) -> list[dict]:
    """The openai backend against the run's vLLM engine of the target alone (serving/session.py), found or started
    here; eval measures the target alone on the same engine."""
    template = read_chat_template(cfg.target.chat_template) if cfg.target.chat_template else None
    with ExitStack() as held:
        with tracked.phase("load"):  # the engine's start, where it must start: loading the target
            served = held.enter_context(engine(EngineSpec(cfg.target.path, cfg.target.dtype, cfg.seed,
                                                          chat_template=template), cfg.vllm, "generate"))
        tracked.set_tags({ENGINES_TAG: served.summary()})
        metrics.update(engine_starts=int(served.started))
        endpoint = replace(cfg.generate.openai, base_url=f"{served.url}/v1", model=None)
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
