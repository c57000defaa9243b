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
from eagle3ops.extraction.vllm import EngineStates, capture_layer_ids, capturing_server, read_captured
from eagle3ops.serving.http import fetch_json, served_model
from test_resume import train_workspace

pytestmark = pytest.mark.service  # a capturing vLLM server in every test

AUX = [1, 2, 3]
TOLERANCE = 1e-4  # of a state's largest magnitude


@pytest.fixture(scope="module")
def capturing(tiny_target_dir, tmp_path_factory):
    """A vLLM server of the tiny target that captures the aux layers and the last layer; (url, layout, directory)."""
    directory = tmp_path_factory.mktemp("captured")
    with capturing_server(TargetConfig(path=str(tiny_target_dir), aux_layers=AUX, dtype="float32"), VllmConfig(),
                          f"tests-capture-{os.getpid()}", directory) as states:
        yield states.url, states.layout, directory


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


def online_workspace(root: Path, target: Path, url: str) -> dict:
    """A train workspace (test_resume's) whose train stage reads the target's states online from the vLLM server
    at `url`; the environment to run it in."""
    env = train_workspace(root, target, online=True)
    set_params(root, train__optimizer="adamw", train__online_engine="vllm", train__online_url=url)
    return env


@pytest.fixture(scope="module")
def trained_online(capturing, tiny_target_dir, tmp_path_factory) -> tuple[Path, str]:
    """`train --init scratch` online from the capturing server, uninterrupted: (workspace, what it printed)."""
    root = tmp_path_factory.mktemp("online") / "ws"
    env = online_workspace(root, tiny_target_dir, capturing[0])
    return root, run_stage(root, env, "train", "--init", "scratch")


def test_online_training_fed_by_vllm_is_offline_training_on_vllms_states(vllm_features, trained_online):
    """train.hidden_states online from a vLLM server at a URL (the drafter alone in the train process) against
    offline training on the shards vLLM's extraction wrote: the same steps, the same losses."""
    offline_root, env, _ = vllm_features["vllm"]
    run_stage(offline_root, env, "train", "--init", "scratch")

    online_root, output = trained_online
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
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{online_root / 'mlflow.db'}")
    run = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`eagle3ops.online_engine` = 'vllm'")
    assert len(run) == 1 and run["tags.eagle3ops.hidden_states"][0] == "online"


def test_a_document_whose_engine_states_hold_nan_is_dropped_and_counted(capturing, tiny_target_dir, tmp_path,
                                                                       monkeypatch):
    """A NaN embedding row in the served target poisons the documents holding that token, in vLLM as in the hooks:
    online from the engine, only those documents lose their states and counted positions, the others keep the
    clean server's, and past extract.max_nonfinite_fraction the stage stops."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3ops.errors import InputError
    from eagle3ops.training import online
    from eagle3ops.training.online import EngineTargetStates, token_samples
    from test_online import packed_batch, positions_of_documents_holding

    train_workspace(tmp_path / "ws", tiny_target_dir, online=True)
    tokens = token_samples(tmp_path / "ws" / "data" / "prepared" / "eval")
    rows, batch = packed_batch(tokens)
    row = next(r for r, documents in enumerate(rows) if len(documents) > 2)
    own = [set(sample["input_ids"].tolist()) for sample in rows[row]]
    token = next(iter(own[1] - set().union(*own[:1], *own[2:])))  # in the second document of the row alone
    poisoned_dir = tmp_path / "poisoned"
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    model.get_input_embeddings().weight.data[token] = float("nan")
    model.save_pretrained(poisoned_dir)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(poisoned_dir)

    url, layout, _ = capturing
    clean = EngineTargetStates(EngineStates(url, layout), torch.device("cpu"), len(tokens), 0.5)(rows, batch)
    # One request in flight to the poisoned server: a request the engine batches with a poisoned one can get its
    # NaN too (a masked score times NaN), so which clean documents lose their states would depend on how the
    # requests happened to arrive (it did beside another test worker).
    monkeypatch.setattr(online, "REQUESTS_IN_FLIGHT", 1)
    with capturing_server(TargetConfig(path=str(poisoned_dir), aux_layers=AUX, dtype="float32"), VllmConfig(),
                          f"tests-poisoned-{os.getpid()}", tmp_path / "captured") as poisoned:
        states = EngineTargetStates(poisoned, torch.device("cpu"), len(tokens), 1.0)
        out = states(rows, batch)
        # counted now: the engine reuses the poisoned requests' KV blocks without zeroing them, and a NaN left in
        # a block reaches the later requests that get it (a masked score times NaN), so a second pass poisons more
        dropped = len(states.nonfinite)
        states.fraction = 0.0
        with pytest.raises(InputError, match=r"\d+ of .* samples gave NaN/inf hidden states.*max_nonfinite_fraction"):
            states(rows, batch)
    hit = positions_of_documents_holding(token, rows, batch)
    assert hit[row].any() and not out["loss_mask"][hit].any()
    assert torch.equal(out["loss_mask"][~hit], batch["loss_mask"][~hit])
    assert torch.isfinite(out["aux_hidden"]).all() and not out["aux_hidden"][hit].any()
    real = batch["loss_mask"].bool() & ~hit
    assert close(out["final_hidden"][real], clean["final_hidden"][real]) < TOLERANCE
    assert dropped == sum(token in s["input_ids"].tolist() for row in rows for s in row)


@pytest.mark.processes
def test_online_training_fed_by_vllm_resumes_after_sigkill(capturing, trained_online, tiny_target_dir, tmp_path):
    """Killed after a resume point and run again, online training from the engine continues from that point and
    ends where an uninterrupted run (trained_online) ends, to the engine's rounding (vLLM's batching of the
    requests in flight moves its results in the last bits, so not byte for byte)."""
    import re
    import signal
    import time

    from eagle3ops.resume import ResumePoint

    reference, resumed = trained_online[0], tmp_path / "resumed"
    env = online_workspace(resumed, tiny_target_dir, capturing[0])
    child = subprocess.Popen([sys.executable, "-m", "eagle3ops.cli", "train", "--init", "scratch"], cwd=resumed,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while child.poll() is None and time.monotonic() < deadline:
        points = list(resumed.glob(".eagle3ops/resume/train@scratch-*.pt"))
        state = ResumePoint(points[0]).load() if points else None
        if state is not None and state["step"] >= 20:
            child.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL, "training finished before it could be killed"
    printed = run_stage(resumed, env, "train", "--init", "scratch")
    assert int(re.search(r"train@scratch: resuming at step (\d+)", printed).group(1)) >= 20
    ours, theirs = (pd.read_csv(root / "plots/train-scratch.csv") for root in (resumed, reference))
    assert list(ours["step"]) == list(theirs["step"])
    assert ours["train/loss"].tolist() == pytest.approx(theirs["train/loss"].tolist(), rel=1e-4)
    assert not list(resumed.glob(".eagle3ops/resume/train@scratch-*"))
