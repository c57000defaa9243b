"""Will SGLang / vLLM load an exported drafter and feed it what it was trained on? `validate_export` re-reads the
export and checks every field the servers read against the target's config; errors mean it would fail to load
or silently draft badly, warnings are worth a look. The report ends with the commands that serve it.

The export writes which target layers the drafter was trained on (EXPORT_RECORD, beside the weights; the
servers ignore it), so a layer id written in the wrong engine's convention is caught, not just one out of range.
"""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3ops.config import VllmConfig
from eagle3ops.formats import specforge, speculators
from eagle3ops.formats.checkpoint import (
    LAYOUTS,
    DrafterCheckpoint,
    RawCheckpoint,
    drafter_from_raw,
    read_json,
    read_raw,
)
from eagle3ops.formats.conventions import CONVENTIONS, rope_settings, to_hf
from eagle3ops.formats.specforge import CheckpointError
from eagle3ops.fs import EXPORT
from eagle3ops.modeling.target import check_model_dir, default_aux_layers, text_config, text_config_checked
from eagle3ops.serving.vllm import cpu_head_size_problems, printed_command

EXPORT_RECORD = EXPORT.marker  # eagle3ops_export.json: what tells an export from a directory of the user's
LAYOUT_CONVENTION = {"sglang": "sglang", "speculators": "vllm"}  # how each export layout writes layer ids
ENGINES = {"sglang": ("sglang", "vllm"), "speculators": ("vllm",)}  # which engines load each layout
SERVING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ExportReport:
    directory: str
    fmt: str | None
    target: str
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"ok": self.ok, **asdict(self)}

    def render(self) -> str:
        lines = [f"export: {self.directory} ({self.fmt or 'layout unknown'})", f"target: {self.target}"]
        lines += [f"ERROR    {m}" for m in self.errors] + [f"WARNING  {m}" for m in self.warnings]
        lines += [f"note     {m}" for m in self.notes]
        if self.commands:
            lines += ["serve it with:"] + [f"  {c}" for c in self.commands]
        lines.append("valid" if self.ok else f"INVALID: {len(self.errors)} error(s)")
        return "\n".join(lines)


def validate_export(out_dir: str | Path, fmt: str | None, target_dir: str | Path,
                    served_as: str | Path | None = None, vllm: VllmConfig | None = None) -> ExportReport:
    """Check the export in `out_dir` (layout `fmt`, or the one it holds when None) against the target, and
    against what vLLM can serve on this machine with the settings `vllm` (params.yaml's; None = the defaults).
    `served_as`: where the export will be served from, when it is checked before it is moved there; the report
    (commands and messages) names that path."""
    report = ExportReport(str(served_as or out_dir), fmt, str(target_dir))
    out_dir = Path(out_dir)
    _validate(report, out_dir, fmt, target_dir, vllm or VllmConfig())
    if served_as is not None:
        for messages in (report.errors, report.warnings, report.notes):
            messages[:] = [message.replace(str(out_dir), str(served_as)) for message in messages]
    return report


def _validate(report: ExportReport, out_dir: Path, fmt: str | None, target_dir: str | Path,
              vllm: VllmConfig) -> None:
    target = text_config_checked(target_dir)
    try:
        raw = read_raw(out_dir)
    except CheckpointError as err:
        report.errors.append(str(err))
        return
    if raw.layout not in LAYOUT_CONVENTION or fmt not in (None, raw.layout):
        report.errors.append(f"{out_dir}: holds the {LAYOUTS[raw.layout]} layout, not an export for "
                             f"{fmt or 'SGLang or vLLM'}; `eagle3ops export` writes one")
        return
    report.fmt = raw.layout
    _check_config(report, raw, target_dir)
    _check_stored_tensors(report, raw)
    try:
        checkpoint = drafter_from_raw(raw)
    except CheckpointError as err:
        report.errors.append(str(err))
        return
    report.notes += [f"reading it: {note}" for note in checkpoint.notes]
    _check_against_target(report, checkpoint, target)
    check_engine_limits(report.errors, report.warnings, checkpoint.cfg, target, vllm, where=raw.config_path,
                        head_sizes=raw.layout == "speculators")
    trained = _check_layers(report, raw, checkpoint, target)
    if report.ok:
        _commands(report, raw, trained, default_aux_layers(target["num_hidden_layers"]), target_dir, vllm)


def _check_config(report: ExportReport, raw: RawCheckpoint, target_dir: str | Path) -> None:
    config, where = raw.config, raw.config_path
    if raw.layout == "sglang":
        if config.get("architectures") != [specforge.ARCHITECTURE]:
            report.errors.append(f"{where}: architectures {config.get('architectures')}; SGLang and vLLM pick the "
                                 f"EAGLE-3 model class by {[specforge.ARCHITECTURE]}")
        layer = config
        if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            report.errors.append(f"{where}: eagle_config.use_aux_hidden_state is false: the engines would skip fc "
                                 f"and feed the drafter one hidden state instead of three")
    else:
        if config.get("architectures") != [speculators.ARCHITECTURE]:
            report.errors.append(f"{where}: architectures {config.get('architectures')}; speculators layouts "
                                 f"declare {[speculators.ARCHITECTURE]}")
        if config.get("norm_before_residual") is not False:
            report.errors.append(f"{where}: norm_before_residual is {config.get('norm_before_residual', 'missing')}; "
                                 f"vLLM reads a missing one as true, and this drafter's residual is the un-normed "
                                 f"feature: it must be false")
        layer = config.get("transformer_layer_config") or {}
        if layer.get("model_type") != "llama":
            report.errors.append(f"{where}: transformer_layer_config.model_type {layer.get('model_type')!r}; vLLM "
                                 f"loads a Llama EAGLE-3 drafter for 'llama'")
        _check_speculators_config(report, config.get("speculators_config"), where, target_dir)
    if layer.get("tie_word_embeddings"):
        report.errors.append(f"{where}: tie_word_embeddings is true: the engines would use the embedding as lm_head")
    for flag in ("fc_norm", "norm_output"):
        if not isinstance(config.get(flag, False), bool):
            report.errors.append(f"{where}: {flag} is {config[flag]!r}; the engines read a boolean")
    if config.get("fc_norm") is True or config.get("norm_output") is True:
        report.notes.append(f"EAGLE-3.1 (fc_norm {config.get('fc_norm', False)}, norm_output "
                            f"{config.get('norm_output', False)}): serve it with an engine that reads these fields "
                            f"(vLLM and SGLang releases with EAGLE-3.1); an older one refuses the fc_norm weights "
                            f"or feeds the next draft step the pre-norm state")


def _check_speculators_config(report: ExportReport, spec, where: Path, target_dir: str | Path) -> None:
    if not isinstance(spec, dict):
        report.errors.append(f"{where}: no speculators_config; vLLM needs it to serve the directory")
        return
    if spec.get("algorithm") != speculators.MODEL_TYPE:
        report.errors.append(f"{where}: speculators_config.algorithm {spec.get('algorithm')!r}, not 'eagle3'")
    methods = spec.get("proposal_methods")
    if not (isinstance(methods, list) and methods and all(isinstance(m, dict) for m in methods)):
        report.errors.append(f"{where}: speculators_config.proposal_methods must be a non-empty list")
    else:
        tokens = [m.get("speculative_tokens") for m in methods]
        if not all(isinstance(t, int) and t >= 1 for t in tokens):
            report.errors.append(f"{where}: speculators_config.proposal_methods speculative_tokens {tokens}; each "
                                 f"must be a positive integer")
        if spec.get("default_proposal_method") not in [m.get("proposal_type") for m in methods]:
            report.errors.append(f"{where}: default_proposal_method {spec.get('default_proposal_method')!r} is none "
                                 f"of the proposal_methods")
    verifier = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
    architectures = read_json(check_model_dir(target_dir) / "config.json").get("architectures")
    if verifier.get("architectures") != architectures:
        report.errors.append(f"{where}: speculators_config.verifier.architectures {verifier.get('architectures')}, "
                             f"the target's are {architectures}")
    name = verifier.get("name_or_path")
    if not name:
        report.errors.append(f"{where}: no speculators_config.verifier.name_or_path: `vllm serve` on the directory "
                             f"would not know which target to load")
    elif Path(name).resolve() != Path(target_dir).resolve():
        report.warnings.append(f"{where}: `vllm serve {report.directory}` loads the target from {name!r}, not "
                               f"{str(target_dir)!r}")


def _check_stored_tensors(report: ExportReport, raw: RawCheckpoint) -> None:
    """What the servers read as stored: the vocabulary map itself (never derived) and the dtypes."""
    where, tensors = raw.weights_path, raw.tensors
    layer = raw.config.get("transformer_layer_config") or {}
    if raw.layout == "speculators" and raw.config.get("draft_vocab_size") == layer.get("vocab_size"):
        if "d2t" in tensors:  # vLLM 0.32 creates no d2t parameter then, and fails to load one
            report.errors.append(f"{where}: d2t stored, but the draft vocabulary is the whole target vocabulary: "
                                 f"vLLM then has no parameter for it and refuses to load the drafter; leave d2t and "
                                 f"t2d out (`eagle3ops export` does)")
        return
    for name, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
        if name not in tensors:
            report.errors.append(f"{where}: no {name}; the engines map draft ids to target ids with d2t, training "
                                 f"tools restrict the target's logits with t2d")
        elif tensors[name].dtype != dtype:
            report.errors.append(f"{where}: {name} is {tensors[name].dtype}, must be {dtype}")
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floats) > 1 or not floats <= set(SERVING_DTYPES):
        report.errors.append(f"{where}: weight dtypes {sorted(map(str, floats))}; expected one of "
                             f"{[str(d) for d in SERVING_DTYPES]} for all of them")
    declared = raw.config.get("torch_dtype") or (raw.config.get("transformer_layer_config") or {}).get("torch_dtype")
    if len(floats) == 1 and declared != specforge.dtype_name(next(iter(floats))):
        report.warnings.append(f"{raw.config_path}: torch_dtype {declared!r} but the weights are "
                               f"{specforge.dtype_name(next(iter(floats)))}")


def _check_against_target(report: ExportReport, checkpoint: DrafterCheckpoint, target: dict) -> None:
    cfg, where = checkpoint.cfg, checkpoint.directory / "config.json"
    vocab, hidden = target.get("vocab_size"), target.get("hidden_size")
    if cfg.vocab_size != vocab:
        report.errors.append(f"{where}: vocab_size {cfg.vocab_size}, the target's is {vocab}: the drafter reads the "
                             f"target's embedding and its t2d is indexed by target token id")
    if cfg.draft_vocab_size > cfg.vocab_size:
        report.errors.append(f"{where}: draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")
    for name, size in (("hidden_size", cfg.hidden_size), ("target_hidden_size", cfg.target_hidden_size)):
        if size != hidden:
            report.errors.append(f"{where}: {name} {size}, the target's hidden size is {hidden} (the drafter reads "
                                 f"its embedding and fuses 3 of its hidden states)")
    theta, scaling = rope_settings(target)
    if cfg.rope_theta != theta:
        report.warnings.append(f"{where}: rope_theta {cfg.rope_theta}, the target's is {theta}: the drafter's own "
                               f"setting, kept as trained; check it is the one it was trained with")
    if checkpoint.rope_scaling != scaling:
        report.warnings.append(f"{where}: rope scaling {checkpoint.rope_scaling}, the target's is {scaling}: the "
                               f"engines apply the drafter's own, as it was trained")


def serving_findings(draft, target_dir: str | Path, drafter: str) -> list[tuple[str, str]]:
    """(level, message) of check-compat's `serving` check: whether vLLM serves the drafter (its DraftConfig `draft`)
    with the target on this machine, by the rules this module holds an export to; errors are incompatible."""
    errors, warnings = [], []
    check_engine_limits(errors, warnings, draft, text_config(target_dir), VllmConfig(), drafter)
    findings = [("incompatible", problem) for problem in errors] + [("warning", problem) for problem in warnings]
    return findings or [("ok", f"vLLM serves its head size ({draft.head_dim}), the target's and its length on "
                               f"this machine")]


def check_engine_limits(errors: list[str], warnings: list[str], draft, target: dict, vllm: VllmConfig,
                        where: str | Path, head_sizes: bool = True) -> None:
    """What the engines cannot serve as configured here. Errors: a drafter whose max_position_embeddings is below
    the serving length (vLLM then stops drafting past it, silently: acceptance falls to about zero). Warnings, with
    `head_sizes` (the export may be served on other hardware): cpu_head_size_problems."""
    serving_length = vllm.max_model_len or target.get("max_position_embeddings")
    if serving_length and draft.max_position_embeddings < serving_length:
        errors.append(f"{where}: max_position_embeddings {draft.max_position_embeddings} is below the serving length "
                      f"{serving_length} (" + ("vllm.max_model_len" if vllm.max_model_len else "the target's") +
                      "): vLLM stops drafting past it and acceptance falls to about zero")
    if head_sizes:
        warnings += [f"{where}: {problem}" for problem in cpu_head_size_problems(target, draft.head_dim)]


def _check_layers(report: ExportReport, raw: RawCheckpoint, checkpoint: DrafterCheckpoint,
                  target: dict) -> list[int]:
    """Check the ids against the target and the recorded trained layers; returns the trained HF indices."""
    depth, convention = target["num_hidden_layers"], LAYOUT_CONVENTION[raw.layout]
    written = _written_ids(raw)
    fed = checkpoint.cfg.aux_layers or default_aux_layers(depth)
    where = raw.config_path
    if not written:
        report.warnings.append(f"{where}: no eagle_aux_hidden_state_layer_ids: the engines feed their default, HF "
                               f"hidden-state indices {fed}")
    bad = [i for i in fed if not 0 <= i < depth]
    if len(fed) != 3 or len(set(fed)) != 3 or bad:
        report.errors.append(f"{where}: layer ids {written} ({CONVENTIONS[convention]}) are HF indices {fed}; EAGLE-3 "
                             f"fuses three different ones that exist in a target with {depth} decoder layers "
                             f"(HF indices 0..{depth - 1})" + (f"; {bad} do not" if bad else ""))
    record = raw.directory / EXPORT_RECORD
    if not record.is_file():
        report.warnings.append(f"{raw.directory}: no {EXPORT_RECORD}; which layers the drafter was trained on is "
                               f"unknown, so the ids are taken to be in {CONVENTIONS[convention]}: HF indices {fed}")
        return fed
    trained = read_json(record).get("trained_aux_layers_hf")
    if trained != fed:
        report.errors.append(f"{where}: layer ids {written} mean HF hidden-state indices {fed} here "
                             f"({CONVENTIONS[convention]}), but the drafter was trained on HF indices {trained} "
                             f"({record.name}): the ids are in the wrong convention or wrong")
    return trained


def _written_ids(raw: RawCheckpoint) -> list[int]:
    holder = raw.config if raw.layout == "speculators" else (raw.config.get("eagle_config") or {})
    return list(holder.get("eagle_aux_hidden_state_layer_ids") or [])


def _commands(report: ExportReport, raw: RawCheckpoint, trained: list[int], default: list[int],
              target_dir: str | Path, vllm: VllmConfig) -> None:
    """The launch commands of the engines that load this layout and would feed the drafter its trained layers."""
    written = _written_ids(raw)
    methods = (raw.config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    steps = methods[0].get("speculative_tokens", 3)
    for engine in ENGINES[raw.layout]:
        fed = to_hf(written, engine) if written else default
        if fed == trained:
            report.commands += launch_commands(engine, report.directory, target_dir, steps, raw.layout, vllm,
                                               raw.config)
        else:
            report.notes.append(f"not for {engine}: it would read these ids as HF indices {fed} "
                                f"({CONVENTIONS[engine]}), not the trained {trained}; for {engine}, serve the "
                                f"{'speculators' if engine == 'vllm' else 'sglang'} export")


def launch_commands(engine: str, directory: str | Path, target_dir: str | Path, steps: int = 3,
                    layout: str = "sglang", vllm: VllmConfig | None = None, config: dict | None = None) -> list[str]:
    """Chain drafting of `steps` tokens, top-1: SGLang's draft tokens are the steps plus the bonus token. Absolute
    paths, so that each runs from any directory; vLLM's in the target's own dtype, with this machine's settings
    (serving/vllm.py), the second serving the speculators directory alone (vLLM reads the target from its
    verifier in `config`, relative to where it starts: the command changes to this directory first when that
    path is relative, as target.path is in the zoo)."""
    drafter, target = Path(directory).resolve(), Path(target_dir).resolve()
    if engine == "sglang":
        return [f"python -m sglang.launch_server --model-path {shlex.quote(str(target))} --speculative-algorithm "
                f"EAGLE3 --speculative-draft-model-path {shlex.quote(str(drafter))} --speculative-num-steps {steps} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}"]
    vllm, dtype = vllm or VllmConfig(), serving_dtype(target_dir)
    commands = [printed_command(target, dtype, vllm, drafter=drafter, k=steps)]
    if layout != "speculators":
        return commands
    # alone, vLLM loads the target from the export's verifier: a relative one resolves where the server starts
    relative = not verifier_path(config or {}).is_absolute()
    return commands + [printed_command(drafter, dtype, vllm, cwd=Path.cwd() if relative else None)]


def verifier_path(config: dict) -> Path:
    """The target a speculators export's config.json names (speculators_config.verifier.name_or_path)."""
    return Path(((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "")


def serving_dtype(target_dir: str | Path) -> str:
    """The dtype the target's config.json declares (vLLM's `auto` would serve a float32 model in bf16)."""
    config = text_config(target_dir)
    return str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
