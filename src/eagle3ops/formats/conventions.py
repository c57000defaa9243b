"""What the serving engines mean by the config fields a drafter export translates: layer ids and rope settings.

Layer ids. In memory we keep indices into Hugging Face's `output_hidden_states` tuple (0 = embeddings, i = output
of decoder layer i-1 = input of decoder layer i). On disk each engine has its own meaning of an id:

    sglang   id i = output of decoder layer i = HF index i + 1     (SGLang, SpecForge; our native layout)
    vllm     id i = input of decoder layer i  = HF index i         (vLLM, speculators)

With no ids in the config, both engines (and the EAGLE authors' code) capture HF indices [2, N//2, N-3].
"""
from __future__ import annotations

CONVENTIONS = {
    "sglang": "SGLang's convention: id i = output of decoder layer i = HF hidden-state index i+1",
    "vllm": "vLLM's convention: id i = input of decoder layer i = HF hidden-state index i",
}
_OFFSET = {"sglang": 1, "vllm": 0}


def to_hf(ids: list[int], convention: str) -> list[int]:
    """Config ids written in `convention` -> HF hidden-state indices."""
    return [int(i) + _OFFSET[convention] for i in ids]


def from_hf(indices: list[int], convention: str) -> list[int]:
    """HF hidden-state indices -> config ids in `convention`."""
    return [int(i) - _OFFSET[convention] for i in indices]


def rope_settings(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) of a config.json, in either style: transformers 4 writes `rope_theta`
    and `rope_scaling`, transformers 5 one `rope_parameters` dict. A "default" rope type means no scaling."""
    parameters = config.get("rope_parameters") or {}
    theta = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or {key: value for key, value in parameters.items() if key != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, dict(scaling)
