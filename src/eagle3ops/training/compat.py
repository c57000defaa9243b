"""Can this drafter be warm-started on (or served with) this target? The checks behind `eagle3ops check-compat`.

A drafter reads the target's token embedding (so it needs the same vocabulary and hidden size), fuses three of
the target's layers (so the ids must exist in the target, and must be the layers it was trained on), and
predicts over its own draft vocabulary (so that vocabulary must cover the tokens the new data asks for).
It also says which variant it is and, for EAGLE-3.1's norm_output, whether the recurrence it learned is the one the
engines will run (`_variant`). Each check gives a finding; the verdict is the worst of them:

    compatible       warm-start as is (warnings, if any, say what to watch)
    needs_new_head   the body fits, but the draft vocabulary covers too little of the new data: re-head it
                     (`train.warm_start_vocab: auto`, the default, does; or `remap`) or expect lower acceptance
    incompatible     cannot work: another vocabulary, hidden size or layers the target does not have
"""
from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3ops.config import TrainConfig
from eagle3ops.data.vocab import build_vocab_map, coverage
from eagle3ops.errors import InputError
from eagle3ops.formats.checkpoint import DrafterCheckpoint, read_drafter
from eagle3ops.formats.conventions import rope_settings
from eagle3ops.modeling.draft import DraftConfig
from eagle3ops.modeling.target import default_aux_layers, text_config

VERDICTS = ("compatible", "needs_new_head", "incompatible")  # from best to worst
EXIT_CODES = {"compatible": 0, "needs_new_head": 4, "incompatible": 5}


class IncompatibleDrafter(InputError):
    """A warm start that cannot work; the message lists the reasons."""


@dataclass
class Finding:
    check: str  # vocabulary | hidden_size | layers | draft_vocab | attention | positions | rope | serving | variant
    level: str  # ok | warning | needs_new_head | incompatible
    message: str


@dataclass
class CompatReport:
    target: str
    drafter: str
    findings: list[Finding] = field(default_factory=list)
    draft_vocab_coverage: float | None = None  # share of the new data's loss-masked tokens the drafter can express
    best_coverage: float | None = None  # what a draft vocabulary of the same size built from that data would reach
    draft_config: DraftConfig | None = None  # the drafter's, for the serving checks made beside these

    @property
    def verdict(self) -> str:
        levels = {f.level for f in self.findings}
        return next((v for v in reversed(VERDICTS) if v in levels), "compatible")

    def add(self, check: str, level: str, message: str) -> None:
        self.findings.append(Finding(check, level, message))

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, **asdict(self)}

    def render(self) -> str:
        marks = {"ok": "ok", "warning": "WARN", "needs_new_head": "HEAD", "incompatible": "FAIL"}
        lines = [f"target:  {self.target}", f"drafter: {self.drafter}", ""]
        lines += [f"[{marks[f.level]:>4}] {f.check}: {f.message}" for f in self.findings]
        lines += ["", f"verdict: {self.verdict}"]
        return "\n".join(lines)


def check_compat(target_dir: str | Path, drafter_dir: str | Path, aux_layers: list[int] | None = None,
                 data_counts: Counter | None = None,
                 min_coverage: float = TrainConfig.warm_start_min_coverage) -> CompatReport:
    """Compare a drafter's config with a target's config (and, given token counts of the new data's
    loss-masked tokens, its draft vocabulary with that data). `aux_layers` are the HF hidden-state indices the
    features are (or will be) extracted at; None = the target's default [2, N//2, N-3]."""
    target = text_config(target_dir)
    checkpoint = read_drafter(drafter_dir)  # any layout eagle3ops reads
    cfg = checkpoint.cfg
    report = CompatReport(str(target_dir), str(drafter_dir), draft_config=cfg)
    _vocabulary(report, cfg, target)
    _hidden_size(report, cfg, target)
    _layers(report, cfg, target, aux_layers)
    _attention(report, cfg, target)
    _variant(report, checkpoint)
    if data_counts is not None:
        _draft_vocab(report, cfg, checkpoint.weights["t2d"], data_counts, min_coverage)
    return report


def new_data_counts(data: str | Path, target_dir: str | Path, chat_template: str | None = None,
                    max_len: int = 4096) -> Counter:
    """The loss-masked token counts of the data a drafter would be warm-started on: a prepared split directory
    (data/prepared/train) as it is, a conversations JSONL tokenized with the target's tokenizer and chat template,
    truncated at `max_len`."""
    from eagle3ops.data.prepare import masked_token_counts

    if Path(data).is_dir():
        return masked_token_counts(data)
    from eagle3ops.config import TargetConfig
    from eagle3ops.data.conversations import load_conversations
    from eagle3ops.data.prepare import tokenize_dataset
    from eagle3ops.data.vocab import count_masked_tokens
    from eagle3ops.modeling.target import load_tokenizer

    tokenizer = load_tokenizer(TargetConfig(path=str(target_dir), chat_template=chat_template))
    samples, _ = tokenize_dataset(tokenizer, load_conversations(data), max_len, str(data))
    return count_masked_tokens((s["input_ids"], s["loss_mask"]) for s in samples)


def _variant(report: CompatReport, checkpoint: DrafterCheckpoint) -> None:
    cfg = checkpoint.cfg
    switches = (("fc_norm: an RMSNorm per target layer before fc", cfg.fc_norm),
                ("norm_output: the post-norm state carried to the next step", cfg.norm_output))
    parts = [part for part, on in switches if on]
    if not parts:
        report.add("variant", "ok", "EAGLE-3")
        return
    named = "EAGLE-3.1 (" + "; ".join(parts) + "): the engine serving it must read these fields"
    if not cfg.norm_output:  # the pre-norm state goes to the next step, whoever trained it
        report.add("variant", "ok", named)
        return
    level, why = _norm_output_provenance(checkpoint, report.drafter)
    report.add("variant", level, f"{named}. {why}")


LAYOUT_NAMES = {"sglang": "SpecForge / SGLang (LlamaForCausalLMEagle3)", "eagle": "EAGLE authors'",
                "speculators": "speculators (Eagle3Speculator)"}


def _norm_output_provenance(checkpoint: DrafterCheckpoint, drafter: str) -> tuple[str, str]:
    """(level, why) for a drafter whose config says norm_output true: vLLM, SGLang and eagle3ops then carry the
    post-norm state to the next draft step, and SpecForge before #879 trained with the pre-norm one under the same
    field. What decides is the drafter's provenance (formats/specforge.py, PROVENANCE): SpecForge records no
    version of its own."""
    record = checkpoint.provenance
    carried = record.get("carried_state")
    if carried == "post_norm":
        return "ok", ("Its training carried the post-norm state to the next step (its config's eagle3ops record), "
                      "the recurrence vLLM and SGLang run for norm_output true")
    if carried == "pre_norm":
        return "warning", ("But its config's eagle3ops record says its training carried the PRE-norm state to the "
                           "next step (EAGLE-3's recurrence): served with norm_output true, every draft after the "
                           "first reads a state it was not trained on and acceptance drops silently. Set "
                           "norm_output false in its config.json (keep fc_norm): that is the recurrence it learned")
    layout = record.get("source_layout", checkpoint.layout)
    if layout == "speculators":
        return "ok", ("speculators' trainer carries the post-norm state to the next step, as vLLM and SGLang serve "
                      "norm_output true (a drafter `speculators convert` made from a SpecForge checkpoint keeps "
                      "that checkpoint's meaning: check the original)")
    return "warning", _norm_output_trap(LAYOUT_NAMES.get(layout, layout), drafter)


def _norm_output_trap(layout: str, drafter: str) -> str:
    source = Path(drafter)
    copy = source.with_name(source.name + "-norm-output-false")
    flip = ('import json,shutil,sys; s,d=sys.argv[1:]; shutil.copytree(s,d); p=d+"/config.json"; '
            'c=json.load(open(p)); c["norm_output"]=False; open(p,"w").write(json.dumps(c,indent=2))')
    return (f"A {layout} checkpoint with no record of which state its training carried from one draft step to "
            f"the next. vLLM and SGLang (and eagle3ops) run norm_output true as EAGLE-3.1's recurrence: the post-norm "
            f"state feeds the next draft step as well as the head. SpecForge before sgl-project/SpecForge#879 "
            f"(merged 2026-09-15; v0.3 among those releases) wrote norm_output true but trained EAGLE-3's: the head "
            f"on the post-norm state, the PRE-norm state to the next step; and it writes no version of its own into "
            f"config.json, so the files cannot tell. Such a drafter served as EAGLE-3.1 drafts its first token as "
            f"trained and every later one from a state it never saw: acceptance from the second draft on drops, "
            f"silently (the output stays lossless). Trained by SpecForge before #879: set norm_output false and keep "
            f"fc_norm, exactly the recurrence it learned, which the engines serve as such. Trained by SpecForge after "
            f"#879, TorchSpec or speculators: norm_output true is right. Unsure: measure tau both ways, on a copy "
            f"with norm_output false (python -c {shlex.quote(flip)} {shlex.quote(str(source))} "
            f"{shlex.quote(str(copy))}), then `dvc exp run eval@baseline -S train.warm_start={shlex.quote(str(source))}` "
            f"and `dvc exp run eval@baseline -S train.warm_start={shlex.quote(str(copy))}`, and compare tau and "
            f"accept_2.. in metrics/eval-baseline.json; serve, and warm-start from, the better one. To record the "
            f"answer for norm_output true, add \"eagle3ops\": {{\"carried_state\": \"post_norm\"}} to its "
            f"config.json: this check then passes")


def _vocabulary(report: CompatReport, cfg: DraftConfig, target: dict) -> None:
    vocab = target.get("vocab_size")
    if vocab != cfg.vocab_size:
        report.add("vocabulary", "incompatible",
                   f"the drafter was built for a vocabulary of {cfg.vocab_size} tokens, the target has {vocab}: it "
                   f"reads the target's embedding and maps draft ids to target ids, both by token id")
    else:
        report.add("vocabulary", "ok", f"{vocab} tokens on both sides (same size; the draft-vocabulary coverage "
                                        f"below shows whether the ids also mean the same tokens)")


def _hidden_size(report: CompatReport, cfg: DraftConfig, target: dict) -> None:
    hidden = target.get("hidden_size")
    problems = []
    if cfg.hidden_size != hidden:
        problems.append(f"hidden_size {cfg.hidden_size} (it reads the target's {hidden}-wide embedding)")
    if cfg.target_hidden_size != hidden:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} (fc expects 3 x {cfg.target_hidden_size} "
                        f"features, the target gives 3 x {hidden})")
    if problems:
        report.add("hidden_size", "incompatible", "the drafter has " + "; ".join(problems))
    else:
        report.add("hidden_size", "ok", f"{hidden} on both sides")


def _layers(report: CompatReport, cfg: DraftConfig, target: dict, aux_layers: list[int] | None) -> None:
    depth = target["num_hidden_layers"]
    default = default_aux_layers(depth)
    trained = cfg.aux_layers or default
    origin = ("config eagle_aux_hidden_state_layer_ids (SGLang ids "
              f"{[i - 1 for i in trained]})" if cfg.aux_layers else "no ids in its config: the engines' default")
    bad = [i for i in trained if not 0 <= i < depth]
    if bad:
        report.add("layers", "incompatible", f"the drafter reads HF hidden-state indices {trained} ({origin}); "
                                             f"{bad} do not exist in a target with {depth} decoder layers")
        return
    wanted = list(aux_layers) if aux_layers is not None else default
    engines = (f"SGLang feeds it HF indices {trained}; vLLM reads the same ids as layer inputs, i.e. HF indices "
               f"{[i - 1 for i in trained]}, unless the export writes them in vLLM's convention (`eagle3ops export` does)")
    if wanted != trained:
        report.add("layers", "warning",
                   f"the drafter was trained on HF hidden-state indices {trained} ({origin}) but the features are "
                   f"extracted at {wanted}: fine-tuning would first have to unlearn its fc layer, and served as is "
                   f"it sees other layers than it learned; set target.aux_layers to {trained}. {engines}")
    else:
        report.add("layers", "ok", f"HF hidden-state indices {trained} ({origin}). {engines}")


def _attention(report: CompatReport, cfg: DraftConfig, target: dict) -> None:
    shape = (f"{cfg.num_attention_heads} heads x {cfg.head_dim} / {cfg.num_key_value_heads} kv heads, "
             f"intermediate {cfg.intermediate_size}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        report.add("attention", "incompatible", f"{shape}: kv heads must divide the heads")
    else:
        report.add("attention", "ok", shape + " (the drafter's own; independent of the target's attention)")
    positions = target.get("max_position_embeddings")
    if positions and cfg.max_position_embeddings < positions:
        report.add("positions", "warning",
                   f"max_position_embeddings {cfg.max_position_embeddings} < the target's {positions}: engines size "
                   f"the drafter's rotary cache from it, and acceptance collapses on longer contexts; "
                   f"the export raises it to the target's")
    theta = rope_settings(target)[0]
    if theta != cfg.rope_theta:
        report.add("rope", "warning", f"the drafter's rope_theta {cfg.rope_theta} differs from the target's {theta}; "
                                      f"it is the drafter's own setting, kept as trained")


def _draft_vocab(report: CompatReport, cfg: DraftConfig, t2d: torch.Tensor, counts: Counter,
                 min_coverage: float) -> None:
    if t2d.numel() != cfg.vocab_size or any(not 0 <= t < t2d.numel() for t in counts):
        report.add("draft_vocab", "warning", "coverage not measured: the drafter's t2d does not fit the data's ids")
        return
    report.draft_vocab_coverage = round(coverage(counts, t2d), 4)
    _, best = build_vocab_map(counts, cfg.vocab_size, cfg.draft_vocab_size)
    report.best_coverage = round(coverage(counts, best), 4)
    summary = (f"the drafter's {cfg.draft_vocab_size}-token draft vocabulary covers {report.draft_vocab_coverage:.1%} "
               f"of the new data's loss-masked tokens; one built from this data would cover {report.best_coverage:.1%}")
    if report.draft_vocab_coverage < min_coverage:
        report.add("draft_vocab", "needs_new_head",
                   f"{summary}. Below {min_coverage:.0%}: every token outside it is a guaranteed rejection. "
                   f"Re-head the drafter (train.warm_start_vocab auto, the default, does; or remap) or train from "
                   f"scratch")
    else:
        report.add("draft_vocab", "ok", summary)
