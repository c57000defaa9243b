"""Throughput of `generate.backend: openai` against concurrency: completion tokens/s and conversations/s.

    python bench/generate_openai.py --url http://gpu-box:8000/v1 --conversations-file data/my_chats.jsonl
    python bench/generate_openai.py            # serves a tiny random target on vLLM itself (generate.backend vllm)

Each concurrency level regenerates the same conversations from scratch (its own resume log, so nothing is
skipped) through `regenerate_openai`, the code the stage runs. Prints a table and writes the JSON to
bench/results/generate_openai-<time>.json. Without --url, the target is the zoo's shape (random weights, the
zoo's tokenizer and chat template) served with continuous batching, and the conversations the zoo's prompts: an
untrained model rarely stops, so nearly every turn runs to --max-tokens and the levels compare like for like;
it is served on vLLM as the generate stage's backend vllm serves it (params.yaml's `vllm` defaults).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from tabulate import tabulate

from eagle3ops.config import OpenAIEndpointConfig, TinyLlamaConfig, VllmConfig
from eagle3ops.data.conversations import load_conversations, normalise
from eagle3ops.formats.validate import serving_dtype
from eagle3ops.fs import write_json_atomic
from eagle3ops.generation.openai import regenerate_openai
from eagle3ops.serving.vllm import installed_version, vllm_server
from eagle3ops.tracking import hardware
from eagle3ops.zoo import corpus

RESULTS = Path(__file__).resolve().parent / "results"


def tiny_target(directory: Path, seed: int) -> Path:
    """A zoo-shaped Llama with random weights and the zoo's tokenizer, saved as a model directory."""
    from eagle3ops.zoo.targets import build_llama, save_target
    from eagle3ops.zoo.tokenizer import train_tokenizer

    tasks = corpus.make_tasks(400, seed)
    texts = [corpus.render_response(task, style) for task in tasks for style in ("raw", "successor")]
    tokenizer = train_tokenizer(texts + [task.prompt for task in tasks], vocab_size=512)
    save_target(build_llama(TinyLlamaConfig(), tokenizer, seed), tokenizer, directory)
    return directory


def zoo_conversations(n: int, seed: int) -> list[dict]:
    return [normalise(corpus.to_conversation(task, "raw", f"bench-{i:05d}"), "zoo corpus")
            for i, task in enumerate(corpus.make_tasks(n, seed + 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="base URL of a running server (…/v1); default: serve a tiny target here")
    parser.add_argument("--model", help="model name on that server (default: the one it lists)")
    parser.add_argument("--api-key-env", help="NAME of the environment variable holding the key")
    parser.add_argument("--model-dir", help="without --url: the model directory to serve (default: a tiny one)")
    parser.add_argument("--serve-arg", action="append", metavar="ARG", default=[],
                        help="without --url: an argument for the vLLM server (repeatable)")
    parser.add_argument("--conversations-file", help="JSONL conversations (default: the zoo's prompts)")
    parser.add_argument("--conversations", type=int, default=32, help="how many (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the JSON (default: %(default)s)")
    args = parser.parse_args(argv)

    if args.conversations_file:
        conversations = load_conversations(args.conversations_file)[: args.conversations]
    else:
        conversations = zoo_conversations(args.conversations, args.seed)
    turns = sum(m["role"] == "assistant" for c in conversations for m in c["messages"])

    with tempfile.TemporaryDirectory(prefix="bench-generate-openai-") as scratch:
        scratch = Path(scratch)
        if args.url:
            server, served = nullcontext(args.url), args.url
        else:
            model_dir = Path(args.model_dir) if args.model_dir else tiny_target(scratch / "target", args.seed)
            served = f"vLLM {installed_version()} {' '.join(args.serve_arg)} {model_dir}"
            server = vllm_server(model_dir, serving_dtype(model_dir), VllmConfig(extra_args=args.serve_arg),
                                 "bench-generate", args.seed)
        rows = []
        with server as url:
            url = url if args.url else f"{url}/v1"
            settings = OpenAIEndpointConfig(base_url=url, model=args.model, api_key_env=args.api_key_env,
                                            max_retries=2, timeout_s=600.0)
            regenerate_openai(conversations[:1], settings, args.max_tokens, args.temperature, args.seed,
                              scratch / "warmup.jsonl")  # model load, first-request compilation
            for level in args.concurrency:
                settings.concurrency = level
                _, stats = regenerate_openai(conversations, settings, args.max_tokens, args.temperature, args.seed,
                                             scratch / f"c{level}.jsonl")
                rows.append({"concurrency": level, "wall_s": round(stats.wall_s, 3),
                             "completion_tokens": stats.generated_tokens,
                             "tokens_per_s": round(stats.tokens_per_s, 1),
                             "conversations_per_s": round(stats.conversations_per_s, 3),
                             "unfinished_turns": stats.unfinished, "retries": stats.retries})
                print(f"concurrency {level}: {rows[-1]['tokens_per_s']} tok/s", file=sys.stderr, flush=True)

    print(tabulate(rows, headers="keys", tablefmt="github"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {"server": served, "conversations": len(conversations), "turns": turns, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "hardware": hardware.fingerprint(), "rows": rows}
    path = args.out / f"generate_openai-{stamp}.json"
    write_json_atomic(path, result)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
