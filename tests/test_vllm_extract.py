"""Hidden states from vLLM (extract.backend vllm, and online training fed by a vLLM server): real servers of the
CPU build with the extract_hidden_states method and the hidden-states connector, held to the forward hooks.

Tolerance: float32 on both sides; vLLM's CPU kernels (its own attention, fused RMSNorm and SiLU) round differently
from Hugging Face's eager PyTorch, by about 1e-6 of a state's magnitude on the tiny target: held to 1e-4.
"""
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from eagle3ops.config import TargetConfig, VllmConfig
from eagle3ops.data.shards import iter_samples, read_manifest
from eagle3ops.extraction.imported import target_layout
from eagle3ops.extraction.vllm import EngineStates, capture_layer_ids, read_captured
from eagle3ops.serving.http import EngineError, fetch_json, served_model
from eagle3ops.serving.vllm import Capture, vllm_server
from test_resume import train_workspace

AUX = [1, 2, 3]
TOLERANCE = 1e-4  # of a state's largest magnitude


@pytest.fixture(scope="module")
def capturing(tiny_target_dir, tmp_path_factory):
    """A vLLM server of the tiny target that captures the aux layers and the last layer; (url, layout, directory)."""
    layout = target_layout(TargetConfig(path=str(tiny_target_dir), aux_layers=AUX))
    directory = tmp_path_factory.mktemp("captured")
    with vllm_server(tiny_target_dir, "float32", VllmConfig(), f"tests-capture-{os.getpid()}",
                     capture=Capture(capture_layer_ids(layout), directory)) as url:
        yield url, layout, directory


def close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference, as a share of the largest magnitude."""
    return float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())


def test_vllm_layer_ids_are_hf_indices_and_the_last_is_before_the_final_norm(capturing, tiny_target_dir):
    """What vLLM's layer id means, pinned on the real engine: id i is Hugging Face's hidden_states[i] (the input
    of decoder layer i), and id N is the last layer's output before the final norm (HF's hidden_states[N] is after
    it), which EngineStates normalises into what the hooks' backend stores."""
    from transformers import AutoModelForCausalLM

    url, layout, directory = capturing
    ids = list(range(5, 70))
    answer = fetch_json(f"{url}/v1/completions", {"model": served_model(url), "prompt": ids, "max_tokens": 1})
    raw = read_captured(Path(answer["kv_transfer_params"]["hidden_states_path"]))
    assert raw["token_ids"].tolist() == ids and list(raw["hidden_states"].shape) == [len(ids), 4, 32]

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    before_norm = {}
    model.model.norm.register_forward_hook(lambda module, args, output: before_norm.update(state=args[0][0]))
    with torch.no_grad():
        hf = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # N + 1 of [1, T, H]
    for slot, layer_id in enumerate(capture_layer_ids(layout)[:3]):  # 1, 2, 3
        assert close(raw["hidden_states"][:, slot], hf[layer_id][0]) < TOLERANCE, layer_id
        assert close(raw["hidden_states"][:, slot], hf[layer_id + 1][0]) > 0.1  # not the layer's output
    last = raw["hidden_states"][:, 3]
    assert close(last, before_norm["state"]) < TOLERANCE
    assert close(last, hf[layout.num_layers][0]) > 0.1

    aux, final = EngineStates(url, layout)(ids)
    assert close(aux, torch.cat([hf[i][0] for i in AUX], -1)) < TOLERANCE
    assert close(final, hf[layout.num_layers][0]) < TOLERANCE
    assert not list(directory.iterdir())  # each file is deleted once read


def test_a_server_that_does_not_capture_is_named(vllm_tiny_target, tiny_target_dir):
    layout = target_layout(TargetConfig(path=str(tiny_target_dir), aux_layers=AUX))
    with pytest.raises(EngineError, match=r"/v1/completions: no kv_transfer_params.hidden_states_path .*"
                                          r"extract_hidden_states"):
        EngineStates(vllm_tiny_target, layout)([5, 6, 7])


def run_stage(root: Path, env: dict, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "eagle3ops.cli", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def set_params(root: Path, **dotted) -> None:
    params = OmegaConf.load(root / "params.yaml")
    for key, value in dotted.items():
        OmegaConf.update(params, key.replace("__", "."), value)
    OmegaConf.save(params, root / "params.yaml")


@pytest.fixture(scope="module")
def vllm_features(tiny_target_dir, tmp_path_factory):
    """A workspace whose extract stage ran on vLLM (a server the stage started), beside one on the hooks."""
    roots = {}
    for backend in ("hf", "vllm"):
        root = tmp_path_factory.mktemp(f"extract-{backend}")
        env = train_workspace(root, tiny_target_dir, online=True)  # prepared data and params; nothing extracted
        set_params(root, train__hidden_states="offline", train__optimizer="adamw", extract__backend=backend,
                   pipeline__extract=["offline"], pipeline__hidden_states_dep="data/features")
        output = run_stage(root, env, "extract")
        roots[backend] = (root, env, output)
    return roots


def test_extract_on_vllm_writes_the_hooks_shards(vllm_features):
    """The same samples, in the same order and shards, with the same tokens and loss masks; the states within the
    engine's rounding."""
    (hf_root, _, _), (vllm_root, _, output) = vllm_features["hf"], vllm_features["vllm"]
    assert "extract train on vLLM" in output and "vllm: starting vLLM" in output
    for split in ("train", "eval"):
        hooks, engine = read_manifest(hf_root / "data/features" / split), read_manifest(vllm_root / "data/features" / split)
        assert [s["samples"] for s in engine["shards"]] == [s["samples"] for s in hooks["shards"]]
        assert engine["tokens"] == hooks["tokens"] and engine["aux_layers"] == hooks["aux_layers"] == AUX
        for (hook_id, ours), (engine_id, theirs) in zip(iter_samples(hf_root / "data/features" / split),
                                                        iter_samples(vllm_root / "data/features" / split),
                                                        strict=True):
            assert engine_id == hook_id
            assert torch.equal(theirs["input_ids"], ours["input_ids"])
            assert torch.equal(theirs["loss_mask"], ours["loss_mask"])
            for name in ("aux_hidden", "final_hidden"):
                assert theirs[name].dtype == ours[name].dtype
                assert close(theirs[name], ours[name]) < TOLERANCE, (engine_id, name)
    def files(root: Path) -> list[str]:
        return sorted(str(f.relative_to(root)) for f in (root / "data/features").rglob("*"))
    assert files(vllm_root) == files(hf_root)  # the shards and manifests alone: the engine's files are gone
    metrics = yaml.safe_load((vllm_root / "metrics/extract.json").read_text())
    assert metrics["samples"] == 256 and metrics["tokens_per_s"] > 0


def test_online_training_fed_by_vllm_is_offline_training_on_vllms_states(vllm_features, capturing, tmp_path,
                                                                         tiny_target_dir):
    """train.hidden_states online from a vLLM server at a URL (the drafter alone in the train process) against
    offline training on the shards vLLM's extraction wrote: the same steps, the same losses."""
    offline_root, env, _ = vllm_features["vllm"]
    run_stage(offline_root, env, "train", "--init", "scratch")

    online_root = tmp_path / "online"
    env = train_workspace(online_root, tiny_target_dir, online=True)
    set_params(online_root, train__optimizer="adamw", train__online_engine="vllm", train__online_url=capturing[0])
    output = run_stage(online_root, env, "train", "--init", "scratch")
    assert "vllm: starting" not in output  # the server at the URL, none of its own

    offline = pd.read_csv(offline_root / "plots/train-scratch.csv")
    online = pd.read_csv(online_root / "plots/train-scratch.csv")
    assert len(offline) == len(online) >= 10 and list(offline["step"]) == list(online["step"])
    for column in [c for c in offline.columns if c.startswith("train/loss")]:
        assert online[column].tolist() == pytest.approx(offline[column].tolist(), rel=1e-4), column
    metrics = {root: yaml.safe_load((root / "metrics/train-scratch.json").read_text())
               for root in (offline_root, online_root)}
    assert metrics[online_root]["train_tokens"] == metrics[offline_root]["train_tokens"]
    assert metrics[online_root]["eval/loss"] == pytest.approx(metrics[offline_root]["eval/loss"], rel=1e-4)
    assert metrics[online_root]["skipped_nonfinite"] == 0
