"""Stage `prepare`: chat template -> token ids + assistant loss mask, train/eval split, draft vocabulary."""
from eagle3ops.config import Config
from eagle3ops.data.conversations import load_conversations
from eagle3ops.data.prepare import split, tokenize_dataset, write_tokenized
from eagle3ops.data.vocab import build_vocab_map, count_masked_tokens, coverage, write_vocab_map
from eagle3ops.fs import atomic_dir
from eagle3ops.modeling.target import load_tokenizer
from eagle3ops.tracking.identity import identity_params
from eagle3ops.tracking.metrics import METRICS_DIR, destination, record
from eagle3ops.tracking.run import stage_run


def run(cfg: Config) -> None:
    source = cfg.generate.out
    with stage_run(cfg, "prepare", inputs=[source, cfg.target.path],
                   extra_params=identity_params(cfg.target)) as tracked:
        tokenizer = load_tokenizer(cfg.target)
        with tracked.phase("tokenize"):
            samples, stats = tokenize_dataset(tokenizer, load_conversations(source), cfg.data.max_len, source)
            train, held_out = split(samples, cfg.data.eval_fraction)
        counts = count_masked_tokens((s["input_ids"], s["loss_mask"]) for s in train)
        d2t, t2d = build_vocab_map(counts, len(tokenizer), cfg.data.draft_vocab_size)
        with atomic_dir(cfg.prepare.out_dir) as out:
            write_tokenized(train, out / "train", {"split": "train", "source": source})
            write_tokenized(held_out, out / "eval", {"split": "eval", "source": source})
            write_vocab_map(out, d2t, t2d)
        record(tracked, "prepare", {**stats.metrics(), "train_samples": len(train), "eval_samples": len(held_out),
                                    "draft_vocab_coverage": round(coverage(counts, t2d), 4)})
        if (dropped := stats.dropped_line(destination(tracked, METRICS_DIR / "prepare.json"))) is not None:
            print(f"prepare: {dropped}", flush=True)
