"""Several processes, several devices: data-parallel training equals one process, and a target whose layers are
spread over devices captures what the whole model on one device captures."""
import json
import math
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from eagle3ops import cli
from eagle3ops.config import ConfigError, DrafterTrainConfig, TargetConfig, load_config
from eagle3ops.data.prepare import write_tokenized
from eagle3ops.data.shards import iter_samples
from eagle3ops.data.vocab import build_vocab_map, count_masked_tokens
from eagle3ops.errors import InputError
from eagle3ops.extraction.hf import extract_features
from eagle3ops.modeling.target import TargetError, load_target
from eagle3ops.training.data import assemble, assembled_ahead, rank_share, remaining_batches, schedule
from eagle3ops.training.distributed import World
from eagle3ops.training.loop import Recipe, train_drafter
from helpers import OUTSIDE_ENV, isolate

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

# One training script for both sides: plain `python` runs it as one process, torchrun as two gloo ranks.
TRAINER = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from eagle3ops.training import distributed
from eagle3ops.config import DrafterTrainConfig
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.resume import ResumePoint
from eagle3ops.training.loop import Hooks, Recipe, TrainState, train_drafter

V, H = 48, 32
out = Path(sys.argv[1])


def drafter(seed):
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=V, draft_vocab_size=V // 2, target_hidden_size=H, aux_layers=[1, 2, 3]))
    draft.embed_tokens.weight.data.normal_()  # the target's, as a train stage copies it in: the tokens count
    chosen = torch.arange(0, V, 2)  # half the target's tokens: each rank counts its own number of positions
    draft.d2t.copy_(chosen - torch.arange(V // 2))
    draft.t2d.zero_()
    draft.t2d[chosen] = True
    return draft


def save(name, draft, result):
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(out / f"{name}.safetensors"))
    (out / f"{name}.json").write_text(json.dumps({"history": result.history, "final": result.final,
                                                  "tokens": result.tokens}))


generator = torch.Generator().manual_seed(0)
samples = []
for n in torch.randint(6, 30, (26,), generator=generator).tolist():
    mask = (torch.rand(n, generator=generator) < 0.7).to(torch.uint8)
    mask[:2] = 0
    samples.append({"input_ids": torch.randint(0, V, (n,), generator=generator), "loss_mask": mask,
                    "aux_hidden": torch.randn(n, 3 * H, generator=generator),
                    "final_hidden": torch.randn(n, H, generator=generator)})
head = torch.randn(V, H, generator=generator)
optim = DrafterTrainConfig(epochs=2, batch_size=2, packed_length=44, lr=1e-3, optimizer="adamw", ttt_steps=3,
                           log_every=1, checkpoint_every=4)  # 11 rows an epoch: the last global batch has one
with distributed.process_group(torch.device("cpu")) as (world, device):
    resume = ResumePoint(out / "resume.pt")

    def keep_first(state):  # the resume point of step 4, for the resumed run below
        if not resume.path.exists():
            resume.save(state.to_dict())

    draft = drafter(0)
    result, _ = train_drafter(Recipe(draft, samples, samples[:7], head, optim, 0, device),
                              Hooks(checkpoint=keep_first if world.main else None))
    if world.main:
        save("uninterrupted", draft, result)
    draft = drafter(1)  # other weights: the resume point's must replace them on every rank
    state = TrainState.from_dict(distributed.shared_resume(resume if world.main else None, world))
    result, _ = train_drafter(Recipe(draft, samples, samples[:7], head, optim, 0, device), state=state)
    if world.main:
        save("resumed", draft, result)
'''


def _env(**extra) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in OUTSIDE_ENV and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


def _same_history(got: list[dict], expected: list[dict]) -> None:
    assert [row["step"] for row in got] == [row["step"] for row in expected]
    for row, reference in zip(got, expected):
        assert row.keys() == reference.keys()
        bad = {key: (row[key], reference[key]) for key in row if not _close(row[key], reference[key])}
        assert not bad, f"step {row['step']}: {bad}"


def _same_weights(got: dict, expected: dict) -> None:
    """Equal up to float rounding. AdamW divides each gradient element by its own running scale, so where an
    element's gradient is near zero a rounding difference moves its update by a fraction of the learning
    rate (1e-3): seen up to 5e-6."""
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-4, msg=name)


@pytest.mark.processes
def test_two_gloo_ranks_train_like_one_process_and_resume(tmp_path, monkeypatch):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    single.mkdir()
    ranks.mkdir()
    two_ranks = subprocess.Popen([*TORCHRUN, str(script), str(ranks)], env=_env(), stderr=subprocess.PIPE, text=True)
    monkeypatch.setattr(sys, "argv", [str(script), str(single)])
    runpy.run_path(str(script), run_name="__main__")  # meanwhile, one process: this one
    assert two_ranks.wait(timeout=300) == 0, two_ranks.stderr.read()[-3000:]

    one, two = (json.loads((out / "uninterrupted.json").read_text()) for out in (single, ranks))
    assert len(one["history"]) == len(two["history"]) == 12 and one["tokens"] == two["tokens"]  # 2 x 6 batches
    _same_history(two["history"], one["history"])  # loss, loss_k, acc_k, grad norm, lr of every step
    assert two["final"].keys() == one["final"].keys() and all(_close(two["final"][k], one["final"][k]) for k in one["final"])
    expected, got = (load_file(str(out / "uninterrupted.safetensors")) for out in (single, ranks))
    _same_weights(got, expected)

    # Two ranks resumed from rank 0's resume point (step 4) end exactly where their uninterrupted run did.
    resumed = load_file(str(ranks / "resumed.safetensors"))
    assert all(torch.equal(resumed[name], got[name]) for name in got)
    assert json.loads((ranks / "resumed.json").read_text())["history"] == two["history"]


def test_each_rank_trains_on_its_own_share_of_the_global_batch():
    rows = [[{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.uint8)}] for n in (3, 4, 5, 6, 7)]
    shares = [rank_share(rows, World(rank, 2)) for rank in (0, 1)]
    assert [[len(row[0]["input_ids"]) for row in share] for share in shares] == [[3, 5, 7], [4, 6]]
    # A last batch shorter than the world: rank 1 runs a row that counts no position.
    alone = rank_share(rows[:1], World(1, 2))
    assert torch.equal(alone[0][0]["input_ids"], rows[0][0]["input_ids"]) and not alone[0][0]["loss_mask"].any()


def test_batches_assembled_ahead_by_a_thread_are_those_assembled_inline():
    """On a GPU a thread assembles the next batches while the step runs: same batches, same order, same shares."""
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 50, (n,), generator=generator), "loss_mask": torch.ones(n, dtype=torch.uint8)}
               for n in (3, 9, 4, 7, 5, 8, 6)]
    by_epoch = schedule(samples, packed_length=12, batch_size=2, seed=0, epochs=2)
    total = sum(len(epoch) for epoch in by_epoch)
    for world in (World(), World(1, 2)):
        rows_per_rank = -(-2 // world.size)
        def make(batch, world=world, rows_per_rank=rows_per_rank):
            return assemble(rank_share(batch, world), 12, rows_per_rank)

        inline, threaded = (list(assembled_ahead(remaining_batches(by_epoch, 1, total), make, depth))
                            for depth in (0, 2))
        assert len(threaded) == len(inline) == total - 1
        assert all(rows["input_ids"].shape == (rows_per_rank, 12) for _, _, rows in inline)  # a short batch filled
        for (epoch, batch, rows), (epoch_t, batch_t, rows_t) in zip(inline, threaded):
            assert epoch == epoch_t and batch == batch_t
            assert rows.keys() == rows_t.keys() and all(torch.equal(rows[k], rows_t[k]) for k in rows)


def test_each_step_runs_its_forward_with_the_last_steps_gradients_released():
    """Gradients held through the forward would add their size (1.7 GB at the 8B shape) to the step's peak."""
    from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft

    torch.manual_seed(0)
    V, H = 24, 16
    draft = Eagle3Draft(DraftConfig(hidden_size=H, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    vocab_size=V, draft_vocab_size=V, target_hidden_size=H))
    draft.t2d.fill_(True)
    samples = [{"input_ids": torch.randint(0, V, (n,)), "loss_mask": torch.ones(n, dtype=torch.uint8),
                "aux_hidden": torch.randn(n, 3 * H), "final_hidden": torch.randn(n, H)} for n in (6, 8, 7, 9)]
    params = [p for p in draft.parameters() if p.requires_grad]
    held_at_forward = []
    fuse = draft.fuse

    def fuse_and_record(aux_hidden):
        if torch.is_grad_enabled():  # a training step (the final evaluation runs without gradients)
            held_at_forward.append(sum(p.grad is not None for p in params))
        return fuse(aux_hidden)

    draft.fuse = fuse_and_record
    optim = DrafterTrainConfig(epochs=2, batch_size=1, packed_length=16, lr=1e-4, optimizer="adamw", ttt_steps=2,
                               checkpoint_every=0)
    train_drafter(Recipe(draft, samples, [], torch.randn(V, H), optim, 0, torch.device("cpu")))
    assert len(held_at_forward) > 2 and not any(held_at_forward)


def test_a_global_batch_smaller_than_the_world_is_refused():
    with pytest.raises(InputError, match="train.batch_size 2 is the global batch, shared by 4 ranks"):
        train_drafter(Recipe(None, [], [], torch.zeros(1, 1), DrafterTrainConfig(batch_size=2), 0,
                             torch.device("cpu"), World(0, 4)))


def _stage_workspace(root: Path, target_dir: Path) -> None:
    """Prepared data, vocabulary map and features of the tiny target, and a params file training on them."""
    from eagle3ops.data.vocab import write_vocab_map

    model = load_target(TargetConfig(path=str(target_dir), device="cpu"))
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 22), ("eval", 6)):
        samples = [{"id": f"{split}-{i}", "input_ids": torch.randint(0, vocab, (n,), generator=generator).tolist(),
                    "loss_mask": [0] * 4 + [1] * (n - 4)}
                   for i, n in enumerate(torch.randint(12, 40, (count,), generator=generator).tolist())]
        write_tokenized(samples, root / "data" / "prepared" / split, {"split": split})
        extract_features(model, samples, [1, 2, 3], root / "data" / "features" / split, 4, 8, desc="test")
        if split == "train":
            d2t, t2d = build_vocab_map(count_masked_tokens((s["input_ids"], s["loss_mask"]) for s in samples), vocab, 64)
    write_vocab_map(root / "data" / "prepared", d2t, t2d)
    OmegaConf.save({"target": {"path": str(target_dir), "lineage_dep": str(target_dir), "device": "cpu"},
                    # AdamW: Muon orthogonalises each step in bf16, which turns the ranks' float32 rounding into bf16's
                    "train": {"epochs": 2, "batch_size": 2, "packed_length": 64, "lr": 3e-3, "ttt_steps": 3, "log_every": 1,
                              "checkpoint_every": 2, "simulate": {"every": 0}, "optimizer": "adamw"},
                    "mlflow": {"system_metrics": False, "registered_model": None}}, root / "params.yaml")


@pytest.mark.processes
def test_train_stage_under_torchrun_writes_once_what_one_process_writes(tmp_path, tiny_target_dir, monkeypatch):
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    _stage_workspace(single, tiny_target_dir)
    shutil.copytree(single, ranks)
    two_ranks = subprocess.Popen([*TORCHRUN, "-m", "eagle3ops.cli", "train", "--init", "scratch"], cwd=ranks,
                                 env=_env(MLFLOW_TRACKING_URI=f"sqlite:///{ranks / 'mlflow.db'}"),
                                 stderr=subprocess.PIPE, text=True)
    isolate(monkeypatch, single)
    assert cli.main(["train", "--init", "scratch"]) == 0  # meanwhile, one process: this one
    assert two_ranks.wait(timeout=300) == 0, two_ranks.stderr.read()[-3000:]

    one, two = (pd.read_csv(root / "plots" / "train-scratch.csv") for root in (single, ranks))
    assert list(two.columns) == list(one.columns) and len(two) == len(one) > 4
    _same_history(two.to_dict("records"), one.to_dict("records"))
    expected, got = (load_file(str(root / "models" / "drafters" / "scratch" / "model.safetensors"))
                     for root in (single, ranks))
    _same_weights(got, expected)
    metrics = [json.loads((root / "metrics" / "train-scratch.json").read_text()) for root in (single, ranks)]
    assert metrics[1]["train_tokens"] == metrics[0]["train_tokens"] and metrics[1]["steps"] == 10
    assert _close(metrics[1]["eval/loss"], metrics[0]["eval/loss"])
    # Rank 0 alone tracked the run and wrote the resume points, and removed them at the end.
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{ranks / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert len(client.search_runs(experiments, "tags.`eagle3ops.stage` = 'train'")) == 1
    assert not list((ranks / ".eagle3ops" / "resume").glob("*"))


def _tiny_samples(vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    return [{"id": f"s{i}", "input_ids": torch.randint(0, vocab, (n,), generator=generator).tolist(), "loss_mask": [1] * n}
            for i, n in enumerate((9, 17, 5, 12, 30, 21))]


def _same_shards(a: Path, b: Path) -> None:
    pairs = list(zip(iter_samples(a), iter_samples(b), strict=True))
    assert len(pairs) == 6
    for (id_a, tensors_a), (id_b, tensors_b) in pairs:
        assert id_a == id_b and tensors_a.keys() == tensors_b.keys()
        for name in tensors_a:
            assert torch.equal(tensors_a[name], tensors_b[name]), (id_a, name)


LAYERS_SPLIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu"}


def test_target_split_over_devices_captures_what_one_device_does(tmp_path, tiny_target_dir):
    """On a CPU the split is CPU + disk offload (accelerate streams layers 1 and 3 in from the safetensors file);
    the GPU test below splits the layers over two GPUs."""
    whole = load_target(TargetConfig(path=str(tiny_target_dir), device="cpu"))
    split = load_target(TargetConfig(path=str(tiny_target_dir), device_map=LAYERS_SPLIT))
    assert split.hf_device_map == LAYERS_SPLIT
    assert {p.device.type for name, p in split.named_parameters() if ".layers.1." in name} == {"meta"}  # offloaded
    samples = _tiny_samples(whole.config.vocab_size)
    for name, model in (("whole", whole), ("split", split)):
        extract_features(model, samples, [1, 2, 3], tmp_path / name, batch_size=3, samples_per_shard=6, desc=name)
    _same_shards(tmp_path / "split", tmp_path / "whole")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_target_split_over_two_gpus_captures_what_one_gpu_does(tmp_path, tiny_target_dir):
    whole = load_target(TargetConfig(path=str(tiny_target_dir), device="cuda:0"))
    halves = {**{name: 0 for name in list(LAYERS_SPLIT)[:4]}, **{name: 1 for name in list(LAYERS_SPLIT)[4:]}}
    split = load_target(TargetConfig(path=str(tiny_target_dir), device_map=halves))
    assert {p.device for name, p in split.named_parameters() if ".layers.3." in name} == {torch.device("cuda", 1)}
    samples = _tiny_samples(whole.config.vocab_size)
    for name, model in (("whole", whole), ("split", split)):
        extract_features(model, samples, [1, 2, 3], tmp_path / name, batch_size=3, samples_per_shard=6, desc=name)
    _same_shards(tmp_path / "split", tmp_path / "whole")


def test_an_offloaded_embedding_is_refused(tiny_target_dir):
    with pytest.raises(TargetError, match="offloads the input embedding"):
        load_target(TargetConfig(path=str(tiny_target_dir), device_map={**LAYERS_SPLIT, "model.embed_tokens": "disk"}))


@pytest.mark.parametrize("target, message", [
    ({"device_map": "everywhere"}, "key 'target.device_map': 'everywhere' is not one of"),
    ({"max_memory": {0: "70GiB"}}, "key 'target.max_memory': caps the devices of a target.device_map placement"),
])
def test_bad_placement_names_the_key(tmp_path, target, message):
    OmegaConf.save({"target": target}, tmp_path / "params.yaml")
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "params.yaml")


def test_placement_keys_keep_their_types(tmp_path):
    OmegaConf.save({"target": {"device_map": {"model.layers.0": 1, "lm_head": "cpu"},
                               "max_memory": {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}}}, tmp_path / "params.yaml")
    target = load_config(tmp_path / "params.yaml").target
    assert target.device_map == {"model.layers.0": 1, "lm_head": "cpu"}
    assert target.max_memory == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}  # GPU indices stay integers
