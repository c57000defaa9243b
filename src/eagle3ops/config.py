"""The one typed schema of `params.yaml`.

Every stage reads its settings through `load_config()`; an unknown key or a value of the wrong type is
rejected with the dotted key in the message, before any work starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3ops.errors import InputError


class ConfigError(InputError):
    """A params file that does not fit the schema."""


@dataclass
class TinyLlamaConfig:
    """Shape of a zoo target (a Llama-architecture causal LM)."""
    hidden_size: int = 64
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 192
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0


@dataclass
class LMTrainConfig:
    """Plain next-token training of a zoo target."""
    steps: int = 600
    batch_size: int = 16
    lr: float = 3e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0


@dataclass
class DraftShapeConfig:
    """Drafter shape; null means 'same as the target'. The hidden size is always the target's: the drafter
    reads the target's (frozen) token embeddings."""
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    head_dim: Optional[int] = None  # null = hidden_size // num_attention_heads (the K2 drafter: 128, not 112)
    rope_theta: Optional[float] = None


@dataclass
class OptimConfig:
    """Drafter optimisation (AdamW, linear warmup then cosine decay, gradient clipping)."""
    epochs: int = 1
    max_steps: Optional[int] = None  # stop early after this many optimizer steps
    batch_size: int = 8
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_ratio: float = 0.015
    grad_clip: float = 0.5
    log_every: int = 10
    checkpoint_every: int = 100  # steps between resume points (0 = none); see resume.py


@dataclass
class DrafterTrainConfig(OptimConfig):
    """Training-time test settings on top of the optimiser."""
    ttt_steps: int = 7
    loss_decay: float = 0.8
    draft: DraftShapeConfig = field(default_factory=DraftShapeConfig)


@dataclass
class ZooConfig:
    """The embedded default: a tokenizer, two tiny targets, the predecessor's drafter and the datasets."""
    dir: str = "models/zoo"
    data_dir: str = "data/zoo"
    tokenizer_vocab_size: int = 512
    pretrain_conversations: int = 4000
    conversations: int = 1200
    eval_prompts_per_family: int = 10
    target: TinyLlamaConfig = field(default_factory=TinyLlamaConfig)
    predecessor_training: LMTrainConfig = field(default_factory=LMTrainConfig)
    successor_training: LMTrainConfig = field(default_factory=lambda: LMTrainConfig(steps=300, lr=2e-3))
    max_len: int = 384
    draft_vocab_size: int = 256
    drafter_conversations: int = 800
    drafter_training: DrafterTrainConfig = field(default_factory=lambda: DrafterTrainConfig(epochs=4, lr=3e-3))


@dataclass
class TargetConfig:
    path: str = "models/zoo/successor"
    # Who the target is, for the lineage: DVC re-runs the stages that use the target when these change, and every
    # stage run logs them with the digest of the target's config and tokenizer files (modeling/identity.py).
    id: str = "eagle3ops-zoo/successor"  # e.g. the Hugging Face repo id, moonshotai/Kimi-K2.5
    revision: Optional[str] = None  # the commit of that repo the directory holds; checked against the download
    # What dvc.yaml hashes for the target: the whole (tiny) zoo directory by default; for a real target its
    # config.json, so that `dvc status` does not read hundreds of GB of weights (see README, "Using your own target").
    lineage_dep: str = "models/zoo/successor"
    # Indices into Hugging Face's `output_hidden_states` tuple (0 = embeddings, i = output of decoder layer i-1).
    # null = [2, N//2, N-3]. See README, "Which layers".
    aux_layers: Optional[list[int]] = None
    dtype: str = "float32"
    device: str = "auto"
    trust_remote_code: bool = False  # run the model repository's own Python code; only for sources you trust
    # The chat template data is rendered with: null = the tokenizer's own; llama-3 | qwen3 | kimi-k2 (shipped, see
    # data/chat.py); or the path of a .jinja file in the project. A configured one overrides the tokenizer's.
    chat_template: Optional[str] = None


@dataclass
class DataConfig:
    conversations: str = "data/zoo/conversations.jsonl"
    eval_prompts: str = "data/zoo/eval_prompts.jsonl"
    max_len: int = 384
    eval_fraction: float = 0.05
    draft_vocab_size: int = 256


@dataclass
class GenerateConfig:
    backend: str = "hf"  # hf | none
    out: str = "data/generated/conversations.jsonl"
    batch_size: int = 32
    chunk_size: int = 256  # conversations per resumable chunk
    max_new_tokens: int = 160
    temperature: float = 0.0


@dataclass
class PrepareConfig:
    out_dir: str = "data/prepared"


@dataclass
class ExtractConfig:
    out_dir: str = "data/features"
    batch_size: int = 16
    samples_per_shard: int = 512
    dtype: str = "float32"
    max_nonfinite_fraction: float = 0.01  # samples with NaN/inf states are skipped; above this share, fail


@dataclass
class TrainConfig(DrafterTrainConfig):
    out_dir: str = "models/drafters"
    warm_start: str = "models/zoo/predecessor-drafter"  # the drafter `train@warm_start` fine-tunes
    # keep: its own draft vocabulary (d2t/t2d) and head; remap: re-head it on the new data's draft vocabulary
    warm_start_vocab: str = "keep"
    warm_start_optimizer: bool = False  # continue its AdamW moments (needs its training_state.pt; keep only)
    warm_start_min_coverage: float = 0.9  # below this draft-vocab coverage of the new data: "needs a new head"


@dataclass
class EvalConfig:
    k: int = 3
    max_new_tokens: int = 96
    max_prompts: Optional[int] = None


@dataclass
class ReportConfig:
    out_dir: str = "reports"


@dataclass
class HardwareConfig:
    label: Optional[str] = None  # null = derived from the fingerprint, e.g. "cpu-2c" or "1xH200"


@dataclass
class MlflowConfig:
    experiment: str = "eagle3ops"
    tracking_uri: Optional[str] = None  # null = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db at the repo root
    system_metrics: bool = True  # CPU/RAM/disk, and GPU utilisation, memory and power through nvidia-ml-py
    registered_model: Optional[str] = "eagle3-drafter"  # eval registers each drafter version here; null = off


@dataclass
class Config:
    seed: int = 0
    threads: Optional[int] = None  # torch CPU threads; null = torch's default
    zoo: ZooConfig = field(default_factory=ZooConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


GENERATE_BACKENDS = ("hf", "none")
TRAIN_INITS = ("scratch", "warm_start")
WARM_START_VOCABS = ("keep", "remap")
EVAL_DRAFTERS = ("baseline", "scratch", "warm_start")
DTYPES = ("float32", "bfloat16", "float16")


def load_config(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Config:
    """Merge `path` (and `key=value` overrides) over the schema; raise ConfigError naming the bad key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    schema = OmegaConf.structured(Config)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.load(path), OmegaConf.from_dotlist(overrides or []))
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{path}: {'key ' + repr(key) + ': ' if key else ''}{err.msg if hasattr(err, 'msg') else err}") from None
    _check_values(cfg, path)
    return cfg


def _check_values(cfg: Config, path: Path) -> None:
    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{path}: key '{key}': {message}")

    outputs = {"zoo.dir": cfg.zoo.dir, "zoo.data_dir": cfg.zoo.data_dir, "generate.out": cfg.generate.out,
               "prepare.out_dir": cfg.prepare.out_dir, "extract.out_dir": cfg.extract.out_dir,
               "train.out_dir": cfg.train.out_dir, "report.out_dir": cfg.report.out_dir}
    for key, value in outputs.items():  # stages replace whole output directories: never outside the project
        if Path(value).is_absolute() or ".." in Path(value).parts or not Path(value).parts:
            fail(key, f"{value!r} must be a path inside the project (relative, without '..')")
    if cfg.generate.backend not in GENERATE_BACKENDS:
        fail("generate.backend", f"{cfg.generate.backend!r} is not one of {GENERATE_BACKENDS}")
    for key, value in (("target.dtype", cfg.target.dtype), ("extract.dtype", cfg.extract.dtype)):
        if value not in DTYPES:
            fail(key, f"{value!r} is not one of {DTYPES}")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        fail("data.eval_fraction", "must be in [0, 1)")
    if cfg.data.max_len < 8:
        fail("data.max_len", "must be at least 8")
    if cfg.data.draft_vocab_size < 1:
        fail("data.draft_vocab_size", "must be positive")
    if cfg.target.aux_layers is not None and len(cfg.target.aux_layers) != 3:
        fail("target.aux_layers", f"EAGLE-3 fuses exactly three layers, got {cfg.target.aux_layers}")
    dep, target_dir = Path(cfg.target.lineage_dep), Path(cfg.target.path)
    if dep != target_dir and target_dir not in dep.parents:
        fail("target.lineage_dep", f"{cfg.target.lineage_dep!r} is not target.path ({cfg.target.path!r}) or a file in it")

    if cfg.train.warm_start_vocab not in WARM_START_VOCABS:
        fail("train.warm_start_vocab", f"{cfg.train.warm_start_vocab!r} is not one of {WARM_START_VOCABS}")
    if not 0.0 <= cfg.train.warm_start_min_coverage <= 1.0:
        fail("train.warm_start_min_coverage", "must be in [0, 1]")
    if cfg.eval.k < 1:
        fail("eval.k", "must be at least 1")
    for key, recipe in (("train", cfg.train), ("zoo.drafter_training", cfg.zoo.drafter_training)):
        if len(recipe.betas) != 2:
            fail(f"{key}.betas", "needs two values")
        if recipe.batch_size < 1 or recipe.epochs < 1:
            fail(f"{key}.batch_size", "batch_size and epochs must be positive")
        if recipe.ttt_steps < 1:
            fail(f"{key}.ttt_steps", "must be at least 1")
