"""The one typed schema of `params.yaml`.

Every stage reads its settings through `load_config()`; an unknown key or a value of the wrong type is
rejected with the dotted key in the message, before any work starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3ops.decoding.settings import DecodingError, SpecSettings
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
    # Layer-wise placement of a target too big for one GPU (README, "Several GPUs"), given to from_pretrained:
    # null = the whole model on `device`; auto | balanced | balanced_low_0 | sequential | {module name: GPU index,
    # "cpu" or "disk"}. max_memory caps each device, e.g. {0: 120GiB, 1: 120GiB, cpu: 200GiB}.
    device_map: Any = None
    max_memory: Optional[dict] = None
    trust_remote_code: bool = False  # run the model repository's own Python code; only for sources you trust
    # The chat template data is rendered with: null = the tokenizer's own; llama-3 | qwen3 | kimi-k2 (shipped, see
    # data/chat.py); or the path of a .jinja file in the project. A configured one overrides the tokenizer's.
    chat_template: Optional[str] = None


@dataclass
class DataConfig:
    conversations: str = "data/zoo/conversations.jsonl"
    max_len: int = 384
    eval_fraction: float = 0.05
    draft_vocab_size: int = 256


@dataclass
class OpenAIEndpointConfig:
    """A running OpenAI-compatible server (vLLM, SGLang, `transformers serve`) serving the target."""
    base_url: str = "http://127.0.0.1:8000/v1"  # what precedes /chat/completions
    model: Optional[str] = None  # null = the one model the server lists at /models
    api_key_env: Optional[str] = None  # the NAME of the environment variable holding the key, never the key
    concurrency: int = 32  # conversations in flight (each sends its turns one after the other)
    max_retries: int = 6  # per request, on 408/429/5xx, timeouts and connection errors
    timeout_s: float = 600.0  # per request
    extra_body: Optional[dict] = None  # merged into every request, e.g. {chat_template_kwargs: {enable_thinking: true}}


@dataclass
class GenerateConfig:
    backend: str = "hf"  # hf | openai | none
    out: str = "data/generated/conversations.jsonl"
    batch_size: int = 32
    chunk_size: int = 256  # conversations per resumable chunk
    max_new_tokens: int = 160
    temperature: float = 0.0
    openai: OpenAIEndpointConfig = field(default_factory=OpenAIEndpointConfig)  # backend openai


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
    backend: str = "hf"  # hf: run the target here; import: take a serving engine's output (extraction/imported.py)
    import_dir: Optional[str] = None  # backend import: the speculators / SpecForge output directory
    import_format: Optional[str] = None  # speculators | specforge; null = detect from the file names


@dataclass
class SimulateConfig:
    """The acceptance simulator during training (training/simulation.py): greedy chain speculative decoding of the
    drafter being trained, on the first `prompts` held-out prompts, every `every` steps and at the end."""
    every: int = 0  # optimizer steps between measurements; 0 = off (it loads the whole target beside training)
    prompts: int = 8
    k: int = 3
    max_new_tokens: int = 48


@dataclass
class TrainConfig(DrafterTrainConfig):
    out_dir: str = "models/drafters"
    warm_start: str = "models/zoo/predecessor-drafter"  # the drafter `train@warm_start` fine-tunes
    # keep: its own draft vocabulary (d2t/t2d) and head; remap: re-head it on the new data's draft vocabulary
    warm_start_vocab: str = "keep"
    warm_start_optimizer: bool = False  # continue its AdamW moments (needs its training_state.pt; keep only)
    warm_start_min_coverage: float = 0.9  # below this draft-vocab coverage of the new data: "needs a new head"
    simulate: SimulateConfig = field(default_factory=SimulateConfig)


@dataclass
class PromptSetConfig:
    """One named benchmark set: a JSONL or Parquet file of prompts or conversations (data/benchmarks.py)."""
    name: str = ""
    path: str = ""
    format: Optional[str] = None  # chat | prompt | mtbench | gsm8k | humaneval | math500; null = from the fields
    limit: Optional[int] = None  # the first N prompts of the file; null = eval.max_prompts


def _zoo_prompt_sets() -> list[PromptSetConfig]:
    """The embedded default's sets: one per task family, as zoo/build.py writes them."""
    return [PromptSetConfig(name=family, path=f"data/zoo/bench/{family}.jsonl")
            for family in ("arithmetic", "lists", "code", "qa")]


@dataclass
class EvalConfig:
    k: int = 3
    max_new_tokens: int = 96
    max_prompts: Optional[int] = None  # per set, for sets without a `limit`; null = all
    sets: list[PromptSetConfig] = field(default_factory=_zoo_prompt_sets)
    sets_dir: str = "data/zoo/bench"  # what dvc.yaml tracks for eval: every set's file must be inside it
    # hf: decode here with the target; vllm | sglang: measure on a running server launched with the drafter
    backend: str = "hf"
    server_url: Optional[str] = None  # the engine's base URL, e.g. http://127.0.0.1:8000
    concurrency: int = 8  # engine backends: requests in flight at once
    temperature: float = 0.0  # 0 = greedy; the requests' (engine backends) or the decoding's (hf) temperature
    # hf backend (decoding/settings.py says more): the target's nucleus; tree branching and tokens per
    # verification, root included (SGLang's --speculative-eagle-topk, --speculative-num-draft-tokens; null =
    # k + 1 for a chain, 1 + k * topk for a tree); drafts greedy | probabilistic (vLLM's draft_sample_method)
    top_p: float = 1.0
    topk: int = 1
    num_draft_tokens: Optional[int] = None
    draft_sample_method: str = "greedy"
    batch_size: int = 1  # hf backend: prompts decoded together


@dataclass
class ReportConfig:
    out_dir: str = "reports"


@dataclass
class ExportConfig:
    """The trained drafter written in the layouts the serving engines load, validated against the target."""
    drafter: str = "warm_start"  # which of train's drafters: scratch | warm_start
    out_dir: str = "models/export"  # one subdirectory per format, and SERVING.md with the launch commands
    formats: list[str] = field(default_factory=lambda: ["sglang", "speculators"])  # sglang | speculators


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
    export: ExportConfig = field(default_factory=ExportConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


GENERATE_BACKENDS = ("hf", "openai", "none")
EXTRACT_BACKENDS = ("hf", "import")
IMPORT_FORMATS = ("speculators", "specforge")
TRAIN_INITS = ("scratch", "warm_start")
WARM_START_VOCABS = ("keep", "remap")
EVAL_DRAFTERS = ("baseline", "scratch", "warm_start")
EVAL_BACKENDS = ("hf", "vllm", "sglang")
PROMPT_SET_FORMATS = ("chat", "prompt", "mtbench", "gsm8k", "humaneval", "math500")
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # from_pretrained's placement strategies
EXPORT_FORMATS = ("sglang", "speculators")  # SGLang's layout (SpecForge's, ours) and vllm-project/speculators'


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
               "train.out_dir": cfg.train.out_dir, "report.out_dir": cfg.report.out_dir,
               "export.out_dir": cfg.export.out_dir}
    for key, value in outputs.items():  # stages replace whole output directories: never outside the project
        if Path(value).is_absolute() or ".." in Path(value).parts or not Path(value).parts:
            fail(key, f"{value!r} must be a path inside the project (relative, without '..')")
    if cfg.generate.backend not in GENERATE_BACKENDS:
        fail("generate.backend", f"{cfg.generate.backend!r} is not one of {GENERATE_BACKENDS}")
    endpoint = cfg.generate.openai
    if not endpoint.base_url.startswith(("http://", "https://")):
        fail("generate.openai.base_url", f"{endpoint.base_url!r} is not an http(s) URL")
    if endpoint.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", endpoint.api_key_env):
        fail("generate.openai.api_key_env", "must be the name of an environment variable (e.g. OPENAI_API_KEY), "
                                            "never the key itself")
    if endpoint.concurrency < 1 or endpoint.max_retries < 0 or endpoint.timeout_s <= 0:
        fail("generate.openai", "concurrency must be at least 1, max_retries at least 0, timeout_s positive")
    if cfg.extract.backend not in EXTRACT_BACKENDS:
        fail("extract.backend", f"{cfg.extract.backend!r} is not one of {EXTRACT_BACKENDS}")
    if cfg.extract.import_format is not None and cfg.extract.import_format not in IMPORT_FORMATS:
        fail("extract.import_format", f"{cfg.extract.import_format!r} is not one of {IMPORT_FORMATS} (or null: detect)")
    if cfg.extract.backend == "import":
        if not cfg.extract.import_dir:
            fail("extract.import_dir", "must be set with backend import: the speculators / SpecForge output directory")
        if Path(cfg.extract.import_dir) == Path(cfg.prepare.out_dir):
            fail("extract.import_dir", f"still names the prepared data ({cfg.prepare.out_dir}); with backend import "
                                       f"point it at the generator's output")
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
    placement = cfg.target.device_map
    if placement is not None and not (placement in DEVICE_MAPS or (isinstance(placement, dict) and placement)):
        fail("target.device_map", f"{placement!r} is not one of {DEVICE_MAPS}, a {{module name: device}} mapping or null")
    if cfg.target.max_memory is not None and placement is None:
        fail("target.max_memory", "caps the devices of a target.device_map placement; set target.device_map too")

    if cfg.train.warm_start_vocab not in WARM_START_VOCABS:
        fail("train.warm_start_vocab", f"{cfg.train.warm_start_vocab!r} is not one of {WARM_START_VOCABS}")
    for key in ("every", "prompts", "k", "max_new_tokens"):
        if getattr(cfg.train.simulate, key) < (0 if key == "every" else 1):
            fail(f"train.simulate.{key}", "must be " + ("0 (off) or more" if key == "every" else "at least 1"))
    if not 0.0 <= cfg.train.warm_start_min_coverage <= 1.0:
        fail("train.warm_start_min_coverage", "must be in [0, 1]")
    if cfg.export.drafter not in TRAIN_INITS:
        fail("export.drafter", f"{cfg.export.drafter!r} is not one of {TRAIN_INITS} (the drafters train writes)")
    formats = cfg.export.formats
    if not formats or len(set(formats)) != len(formats) or not set(formats) <= set(EXPORT_FORMATS):
        fail("export.formats", f"{formats} must be distinct values from {EXPORT_FORMATS}, at least one")
    _check_eval(cfg, fail)
    for key, recipe in (("train", cfg.train), ("zoo.drafter_training", cfg.zoo.drafter_training)):
        if len(recipe.betas) != 2:
            fail(f"{key}.betas", "needs two values")
        if recipe.batch_size < 1 or recipe.epochs < 1:
            fail(f"{key}.batch_size", "batch_size and epochs must be positive")
        if recipe.ttt_steps < 1:
            fail(f"{key}.ttt_steps", "must be at least 1")


def _check_eval(cfg: Config, fail) -> None:
    ev = cfg.eval
    try:
        SpecSettings.from_config(ev)  # k, topk, num_draft_tokens, temperature, top_p, draft_sample_method
    except DecodingError as err:
        fail(f"eval.{err.key}", err.reason)
    if ev.batch_size < 1:
        fail("eval.batch_size", "must be at least 1")
    if ev.backend not in EVAL_BACKENDS:
        fail("eval.backend", f"{ev.backend!r} is not one of {EVAL_BACKENDS}")
    if ev.backend != "hf" and not (ev.server_url or "").startswith(("http://", "https://")):
        fail("eval.server_url", f"backend {ev.backend} measures on a running server: give its base URL "
                                f"(http://host:port), got {ev.server_url!r}")
    if ev.concurrency < 1:
        fail("eval.concurrency", "must be at least 1")
    if not ev.sets:
        fail("eval.sets", "name at least one prompt set")
    sets_dir, seen = Path(ev.sets_dir), set()
    for i, prompt_set in enumerate(ev.sets):
        key = f"eval.sets[{i}]"
        if not prompt_set.name or prompt_set.name in seen:
            fail(f"{key}.name", f"{prompt_set.name!r}: every set needs a name of its own")
        seen.add(prompt_set.name)
        if sets_dir not in Path(prompt_set.path).parents:  # DVC tracks the directory, not a list of files
            fail(f"{key}.path", f"{prompt_set.path!r} is not inside eval.sets_dir ({ev.sets_dir!r}), the directory "
                                f"dvc.yaml tracks for the eval stage")
        if prompt_set.format is not None and prompt_set.format not in PROMPT_SET_FORMATS:
            fail(f"{key}.format", f"{prompt_set.format!r} is not one of {PROMPT_SET_FORMATS} (or null: detect)")
        if prompt_set.limit is not None and prompt_set.limit < 1:
            fail(f"{key}.limit", "must be at least 1 (or null: eval.max_prompts)")
    if ev.max_prompts is not None and ev.max_prompts < 1:
        fail("eval.max_prompts", "must be at least 1 (or null: all)")
