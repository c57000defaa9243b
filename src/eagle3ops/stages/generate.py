"""Stage `generate`: regenerate the assistant turns with the target (`hf`), or keep the dataset's own (`none`)."""
from eagle3ops.config import Config
from eagle3ops.data.conversations import load_conversations
from eagle3ops.fs import write_jsonl_atomic
from eagle3ops.generation import regenerate
from eagle3ops.metrics import record
from eagle3ops.modeling.target import load_target, load_tokenizer, model_size
from eagle3ops.tracking import stage_run


def run(cfg: Config) -> None:
    backend = cfg.generate.backend
    with stage_run(cfg, "generate", variant=backend, inputs=[cfg.data.conversations, cfg.target.path]) as tracked:
        conversations = load_conversations(cfg.data.conversations)
        metrics: dict = {"backend": backend, "conversations": len(conversations)}
        if backend == "hf":
            with tracked.phase("load"):
                tokenizer, model = load_tokenizer(cfg.target.path), load_target(cfg.target.path, cfg.target.dtype,
                                                                                 cfg.target.device)
            with tracked.phase("generate"):
                conversations, stats = regenerate(model, tokenizer, conversations, cfg.generate.batch_size,
                                                  cfg.generate.max_new_tokens, cfg.generate.temperature, cfg.seed)
            metrics.update(**model_size(model), turns=stats.turns, new_tokens=stats.new_tokens, unfinished_turns=stats.unfinished,
                           tokens_per_s=round(stats.tokens_per_s, 1))
        write_jsonl_atomic(cfg.generate.out, conversations)
        record(tracked, "generate", metrics)
