"""Stage `eval@<drafter>`: speculative decoding on held-out prompts; acceptance length and losslessness."""
import time
from collections import defaultdict
from pathlib import Path

import torch

from eagle3ops.config import Config
from eagle3ops.data.chat import prompt_ids
from eagle3ops.data.conversations import DatasetError, normalise, read_jsonl
from eagle3ops.decoding.speculative import AcceptanceStats, speculative_greedy, target_greedy
from eagle3ops.formats.specforge import load_drafter
from eagle3ops.metrics import record
from eagle3ops.modeling.target import default_aux_layers, load_target, load_tokenizer, model_size
from eagle3ops.progress import progress
from eagle3ops.tracking import stage_run


def drafter_path(cfg: Config, drafter: str) -> Path:
    """baseline = the existing drafter used as-is on the new target; otherwise our trained one."""
    return Path(cfg.train.warm_start) if drafter == "baseline" else Path(cfg.train.out_dir) / drafter


def load_prompts(path: str, limit: int | None) -> list[dict]:
    prompts = []
    for lineno, raw in read_jsonl(path):
        record = normalise(raw, f"{path}:{lineno}")
        if record["messages"][-1]["role"] == "assistant":
            raise DatasetError(f"{path}:{lineno}: an eval prompt must end with a user turn")
        prompts.append({**record, "set": raw.get("family", "all")})
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    return prompts[:limit] if limit else prompts


def run(cfg: Config, drafter: str) -> None:
    path = drafter_path(cfg, drafter)
    with stage_run(cfg, "eval", variant=drafter, inputs=[path, cfg.target.path, cfg.data.eval_prompts]) as tracked:
        with tracked.phase("load"):
            tokenizer = load_tokenizer(cfg.target)
            target = load_target(cfg.target)
            draft = load_drafter(path, target.get_input_embeddings().weight.detach().cpu()).to(target.device).eval()
            draft.cfg.aux_layers = draft.cfg.aux_layers or default_aux_layers(target.config.num_hidden_layers)
            prompts = load_prompts(cfg.data.eval_prompts, cfg.eval.max_prompts)
        eos = {tokenizer.eos_token_id}
        overall, per_set = AcceptanceStats(cfg.eval.k), defaultdict(lambda: AcceptanceStats(cfg.eval.k))
        mismatched, spec_s, plain_s, spec_tokens, plain_tokens, in_vocab = [], 0.0, 0.0, 0, 0, 0
        with tracked.phase("decode"), progress(len(prompts), f"eval@{drafter}", "prompt") as bar:
            for prompt in prompts:
                ids = prompt_ids(tokenizer, prompt["messages"])
                start = time.perf_counter()
                tokens, stats = speculative_greedy(target, draft, ids, cfg.eval.k, cfg.eval.max_new_tokens, eos)
                spec_s += time.perf_counter() - start
                start = time.perf_counter()
                reference = target_greedy(target, ids, cfg.eval.max_new_tokens, eos)
                plain_s += time.perf_counter() - start
                spec_tokens, plain_tokens = spec_tokens + len(tokens), plain_tokens + len(reference)
                in_vocab += int(draft.t2d[torch.tensor(reference)].sum())
                if tokens != reference:
                    mismatched.append(prompt["id"])
                overall.merge(stats)
                per_set[prompt["set"]].merge(stats)
                bar.update(1)
        tracked.log_artifact(path, "drafter")
        if cfg.mlflow.registered_model:
            tracked.register_drafter(cfg.mlflow.registered_model, "drafter", overall.tau)
        record(tracked, f"eval-{drafter}", {
            **model_size(target), "emitted_tokens": spec_tokens,
            "drafter": drafter, "k": cfg.eval.k, "prompts": len(prompts), "tau": round(overall.tau, 4),
            **{f"accept_{i + 1}": round(a, 4) for i, a in enumerate(overall.per_position)},
            "verify_steps": overall.steps, "accepted_tokens": overall.accepted,
            "lossless": not mismatched, "mismatched_prompts": len(mismatched), "mismatched_ids": mismatched[:20],
            "draft_vocab_coverage": round(in_vocab / max(1, plain_tokens), 4),  # target tokens it can draft at all
            "tau_by_set": {name: round(s.tau, 4) for name, s in sorted(per_set.items())},
            "spec_tokens_per_s": round(spec_tokens / spec_s, 1), "target_tokens_per_s": round(plain_tokens / plain_s, 1),
        })
