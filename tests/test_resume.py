"""Training killed with SIGKILL at several points and resumed ends with the weights of an uninterrupted run."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3ops.resume import ResumePoint, resume_point
from helpers import copy_workspace

ROOT = Path(__file__).resolve().parents[1]

TRAINER = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from eagle3ops.config import DrafterTrainConfig
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.resume import ResumePoint
from eagle3ops.training.loop import Hooks, Recipe, TrainState, train_drafter

out, resume_path = Path(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
V, H = 48, 32
draft = Eagle3Draft(DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                vocab_size=V, draft_vocab_size=V, target_hidden_size=H, aux_layers=[1, 2, 3]))
draft.embed_tokens.weight.data.normal_()  # the target's, as a train stage copies it in: the tokens count
draft.d2t.zero_()
draft.t2d.fill_(True)
samples = [{"input_ids": torch.randint(0, V, (n,)), "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden": torch.randn(n, 3 * H), "final_hidden": torch.randn(n, H)} for n in range(8, 40)]
head = torch.randn(V, H)
optim = DrafterTrainConfig(epochs=4, batch_size=1, packed_length=96, lr=1e-3, optimizer="adamw", ttt_steps=3,
                           log_every=2, checkpoint_every=3)
resume = ResumePoint(Path(resume_path)) if resume_path != "-" else None
saved = resume.load() if resume else None
result, state = train_drafter(Recipe(draft, samples, samples[:4], head, optim, 0, torch.device("cpu")),
                              Hooks(checkpoint=(lambda state: resume.save(state.to_dict())) if resume else None),
                              TrainState.from_dict(saved) if saved else None)
save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(out / "weights.safetensors"))
(out / "history.json").write_text(json.dumps(result.history))
(out / "resumed_at.json").write_text(json.dumps(result.resumed_at))
'''


def train(out: Path, resume: str, env: dict) -> subprocess.Popen:
    out.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(out), resume], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.processes
def test_sigkilled_training_resumes_to_identical_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = train(tmp_path / "reference", "-", env)
    assert reference.wait(timeout=300) == 0, reference.stderr.read()

    resume_file = tmp_path / "resume.pt"
    kills = []
    for kill_after_step in sorted(random.Random(2).sample(range(3, 28, 3), 3)):  # of 32 steps, a resume point every 3
        child = train(tmp_path / "resumed", str(resume_file), env)
        deadline = time.monotonic() + 300
        while child.poll() is None and time.monotonic() < deadline:
            state = ResumePoint(resume_file).load() if resume_file.exists() else None
            if state is not None and state["step"] >= kill_after_step:
                child.send_signal(signal.SIGKILL)
                kills.append(state["step"])
                break
            time.sleep(0.01)
        child.wait(timeout=60)
        assert child.returncode == -signal.SIGKILL, "training finished before it could be killed"
    final = train(tmp_path / "resumed", str(resume_file), env)
    assert final.wait(timeout=300) == 0, final.stderr.read()
    # The last process continued from the last resume point rather than starting over.
    assert json.loads((tmp_path / "resumed" / "resumed_at.json").read_text())[0] >= kills[-1]

    assert kills == sorted(kills) and kills[0] >= 3
    expected = load_file(str(tmp_path / "reference" / "weights.safetensors"))
    got = load_file(str(tmp_path / "resumed" / "weights.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert json.loads((tmp_path / "resumed" / "history.json").read_text()) == \
        json.loads((tmp_path / "reference" / "history.json").read_text())


def test_resume_point_is_keyed_by_what_determines_the_result(tmp_path):
    a = resume_point("train@scratch", {"params": "abc", "inputs": {"data/features": "1"}}, tmp_path)
    b = resume_point("train@scratch", {"params": "abc", "inputs": {"data/features": "2"}}, tmp_path)
    assert a.path != b.path
    a.save({"step": 3})
    assert a.load() == {"step": 3} and b.load() is None
    assert not list(tmp_path.rglob("*.tmp"))  # written through a temporary file, renamed into place
    a.clear()
    assert a.load() is None


def _extract_workspace(root: Path, target: Path, extra: dict | None = None) -> dict:
    """A prepared dataset for the tiny target and a params file that extracts it in small shards."""
    from omegaconf import OmegaConf

    from eagle3ops.data.prepare import write_tokenized

    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 240), ("eval", 16)):
        samples = [{"id": f"{split}-{i}", "input_ids": torch.randint(0, 200, (int(n),), generator=generator).tolist(),
                    "loss_mask": [1] * int(n)}
                   for i, n in enumerate(torch.randint(40, 250, (count,), generator=generator))]
        write_tokenized(samples, root / "data" / "prepared" / split, {"split": split})
    OmegaConf.save({"target": {"path": str(target), "aux_layers": [1, 2, 3]},
                    "extract": {"batch_size": 4, "samples_per_shard": 8},
                    "mlflow": {"system_metrics": False, "registered_model": None}, **(extra or {})},
                   root / "params.yaml")
    return _workspace_env(root)


def _workspace_env(root: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}


def _extract(root: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eagle3ops.cli", "extract"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _manifests(root: Path) -> dict:
    return {split: json.loads((root / "data" / "features" / split / "manifest.json").read_text())
            for split in ("train", "eval")}


@pytest.mark.processes
def test_sigkilled_extraction_resumes_to_identical_shards(tmp_path, tiny_target_dir, extracted):
    reference, resumed = extracted, tmp_path / "resumed"  # the reference: one uninterrupted run
    env = train_inputs(resumed, tiny_target_dir, online=False)

    kills = []
    for kill_after_shards in sorted(random.Random(3).sample(range(1, 28), 3)):  # of 30 train shards
        child = _extract(resumed, env)
        deadline = time.monotonic() + 300
        while child.poll() is None and time.monotonic() < deadline:
            progress = list(resumed.glob(".eagle3ops/resume/extract-*/.train.partial/progress.json"))
            try:
                done = len(json.loads(progress[0].read_text())["shards"]) if progress else 0
            except (OSError, ValueError):  # replaced between listing and reading
                done = 0
            if done >= kill_after_shards:
                child.send_signal(signal.SIGKILL)
                kills.append(done)
                break
            time.sleep(0.005)
        child.wait(timeout=60)
        assert child.returncode == -signal.SIGKILL, "extraction finished before it could be killed"
    assert not (resumed / "data" / "features").exists()  # nothing half-written where DVC looks
    final = _extract(resumed, env)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    kept = int(re.search(r"extract train: resuming after (\d+) of 240 samples", out).group(1))
    assert kept >= kills[-1] * 8  # the last run continued after the shards already written

    assert kills == sorted(kills)
    expected, got = _manifests(reference), _manifests(resumed)
    assert got == expected  # every shard's sha256, sample and token count
    assert not list(resumed.glob(".eagle3ops/resume/extract-*"))  # the work directory became the output


@pytest.mark.processes
def test_sigkilled_generation_resumes_to_identical_conversations(tmp_path, tiny_target_dir):
    from omegaconf import OmegaConf

    def workspace(root: Path) -> dict:
        root.mkdir()
        lines = [json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 5)},
                                                          {"role": "assistant", "content": "old answer"}]})
                 for i in range(48)]
        (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
        OmegaConf.save({"target": {"path": str(tiny_target_dir)}, "data": {"conversations": "chats.jsonl"},
                        "generate": {"batch_size": 4, "chunk_size": 4, "max_new_tokens": 48},
                        "mlflow": {"system_metrics": False, "registered_model": None}}, root / "params.yaml")
        return {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}

    def generate(root: Path, env: dict) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "eagle3ops.cli", "generate"], cwd=root, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    uninterrupted = generate(reference, workspace(reference))
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read()
    env = workspace(resumed)
    for kill_after_chunks in sorted(random.Random(5).sample(range(1, 11), 3)):  # of 12 chunks
        child = generate(resumed, env)
        deadline = time.monotonic() + 300
        while child.poll() is None and time.monotonic() < deadline:
            if len(list(resumed.glob(".eagle3ops/resume/generate-*/chunk-*.jsonl"))) >= kill_after_chunks:
                child.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
        child.wait(timeout=60)
        assert child.returncode == -signal.SIGKILL, "generation finished before it could be killed"
    assert not (resumed / "data" / "generated").exists()
    final = generate(resumed, env)
    printed, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    assert int(re.search(r"generate: resuming after (\d+) of 12 finished chunks", printed).group(1)) >= 10
    out = "data/generated/conversations.jsonl"
    assert (resumed / out).read_bytes() == (reference / out).read_bytes()
    metrics = json.loads((resumed / "metrics" / "generate.json").read_text())
    reference_metrics = json.loads((reference / "metrics" / "generate.json").read_text())
    assert metrics["turns"] == 48 and metrics["new_tokens"] == reference_metrics["new_tokens"]
    # 12 batches of 4, each decoding until its longest answer ends (at most 48 tokens); the resumed run counts the
    # steps of the chunks finished before it from their records
    assert metrics["decode_steps"] == reference_metrics["decode_steps"]
    assert 12 <= metrics["decode_steps"] <= 12 * 48


@pytest.mark.processes
def test_disk_full_during_extraction_then_resume(tmp_path, tiny_target_dir):
    """Shards go to a 1 MiB tmpfs: a clear error, no partial shard left, and after making room the run resumes."""
    root = tmp_path / "work"
    env = _extract_workspace(root, tiny_target_dir)
    store = root / ".eagle3ops"
    store.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(store)], capture_output=True).returncode:
        pytest.skip("needs root to mount a size-limited tmpfs")
    try:
        full = subprocess.run([sys.executable, "-m", "eagle3ops.cli", "extract"], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        assert full.returncode == 1
        assert "disk full writing shard-" in full.stderr and "run again to resume" in full.stderr
        assert not list(store.rglob("*.tmp"))  # the shard being written was removed
        kept = json.loads(next(store.glob("resume/extract-*/.train.partial/progress.json")).read_text())["shards"]
        assert kept and not (root / "data" / "features").exists()
        subprocess.run(["mount", "-o", "remount,size=256m", str(store)], check=True)
        resumed = subprocess.run([sys.executable, "-m", "eagle3ops.cli", "extract"], cwd=root, env=env,
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        manifest = json.loads((root / "data" / "features" / "train" / "manifest.json").read_text())
        assert manifest["shards"][: len(kept)] == kept and manifest["samples"] == 240
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)


TRAIN_PARAMS = {"epochs": 2, "batch_size": 2, "packed_length": 576, "lr": 1e-3, "checkpoint_every": 5, "log_every": 5,
                "simulate": {"every": 0}}
ONLINE = {"train": {**TRAIN_PARAMS, "hidden_states": "online"},
          "pipeline": {"extract": [], "hidden_states_dep": "data/prepared"}}


def train_inputs(root: Path, target: Path, online: bool) -> dict:
    """_extract_workspace with the project's dvc.yaml, a draft vocabulary, and the train params of the tests
    below; nothing extracted. Returns the environment to run its stages in."""
    from eagle3ops.data.vocab import build_vocab_map, count_masked_tokens, write_vocab_map

    env = _extract_workspace(root, target, ONLINE if online else {"train": TRAIN_PARAMS})
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    counts = count_masked_tokens([([1, 2, 3], [1, 1, 1])])
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    write_vocab_map(root / "data" / "prepared", *build_vocab_map(counts, vocab, 32))
    return env


def train_workspace(root: Path, target: Path, online: bool) -> dict:
    """train_inputs; offline, the extract stage run."""
    env = train_inputs(root, target, online)
    if not online:
        done = subprocess.run([sys.executable, "-m", "eagle3ops.cli", "extract"], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    return env


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_target_dir) -> Path:
    """An offline train workspace, extracted by one uninterrupted run: the extraction test's reference and the
    offline train test's starting point (copies of it), so that this module extracts the same data once."""
    root = tmp_path_factory.mktemp("extracted") / "work"
    train_workspace(root, tiny_target_dir, online=False)
    return root


@pytest.mark.processes
@pytest.mark.parametrize("hidden_states", ["offline", "online"])
def test_sigkilled_train_stage_resumes_to_identical_checkpoint(tmp_path, tiny_target_dir, hidden_states, request):
    """The train stage itself (CLI, held to the project's dvc.yaml; offline after a real extract, online with the
    target beside it), killed at resume points chosen by a seeded RNG; before the last run a key the stage does not
    read is edited, which keeps the resume point (it is keyed on the stage's declared params and input md5s)."""
    def workspace(root: Path) -> dict:
        if hidden_states == "online":
            return train_workspace(root, tiny_target_dir, online=True)
        return _workspace_env(copy_workspace(request.getfixturevalue("extracted"), root))

    def train(root: Path, env: dict) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "eagle3ops.cli", "train", "--init", "scratch"], cwd=root,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    env_ref = workspace(reference)
    done = train(reference, env_ref)
    assert done.wait(timeout=600) == 0, done.stderr.read()

    env = workspace(resumed)
    kill_points = sorted(random.Random(8).sample(range(5, 56, 5), 3))  # of 60 steps, a resume point every 5
    for kill_after_step in kill_points:
        child = train(resumed, env)
        deadline = time.monotonic() + 300
        while child.poll() is None and time.monotonic() < deadline:
            points = list(resumed.glob(".eagle3ops/resume/train@scratch-*.pt"))
            state = ResumePoint(points[0]).load() if points else None
            if state is not None and state["step"] >= kill_after_step:
                child.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        child.wait(timeout=60)
        assert child.returncode == -signal.SIGKILL, "training finished before it could be killed"
    params = resumed / "params.yaml"
    params.write_text(params.read_text() + "eval: {k: 5}\nreport: {out_dir: elsewhere}\n")
    final = train(resumed, env)
    printed, err = final.communicate(timeout=600)
    assert final.returncode == 0, err
    assert int(re.search(r"train@scratch: resuming at step (\d+)", printed).group(1)) >= kill_points[-1]

    # every file of the stage's outputs byte for byte (weights, config, training_state.pt: DVC hashes them, and a
    # changed one would make eval and export stale), and its metrics but the timings
    drafter = Path("models/drafters/scratch")
    written = sorted(path.relative_to(reference) for path in (reference / drafter).rglob("*") if path.is_file())
    assert {drafter / "model.safetensors", drafter / "config.json", drafter / "training_state.pt"} <= set(written)
    assert sorted(path.relative_to(resumed) for path in (resumed / drafter).rglob("*") if path.is_file()) == written
    for path in [*written, Path("plots/train-scratch.csv")]:
        assert (resumed / path).read_bytes() == (reference / path).read_bytes(), path

    def results(root: Path) -> dict:
        metrics = json.loads((root / "metrics" / "train-scratch.json").read_text())
        return {key: value for key, value in metrics.items() if key not in ("time", "tokens_per_s", "steps_per_s",
                                                                            "first_step_s", "simulator_s")}
    assert results(resumed) == results(reference)  # padding_share too: the whole run's, not the last process's
    assert not list(resumed.glob(".eagle3ops/resume/train@scratch-*"))  # cleared once the checkpoint is written
