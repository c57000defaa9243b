"""`eagle3ops bench` at the tiny size on the CPU: every part runs, and the figures it reports hold together."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3ops.benchmark.report import write_result
from eagle3ops.benchmark.run import run_bench
from eagle3ops.benchmark.sizes import SIZES


@pytest.mark.heavy
def test_tiny_bench_extraction_sweeps_split_and_training(tmp_path):
    result = run_bench("tiny", torch.device("cpu"), tmp_path / "work", parts=("extract", "extract-split", "train"),
                       kernels=("reference",), train_shapes=[(1, 64)])
    size = SIZES["tiny"]()
    runs = result["extract"]["runs"]
    shapes = {(run["batch"], run["length"]) for run in runs if run["pipeline"] == "ours"}
    # Every length at a fixed number of tokens per batch, every batch at the base length, and the naive
    # pipeline at the base shape only.
    assert {(size.extract_batch_tokens // n, n) for n in size.extract_lengths} <= shapes
    assert {(b, size.extract_seq_len) for b in size.extract_batches} <= shapes
    assert [(r["batch"], r["length"]) for r in runs if r["pipeline"] == "naive"] == [(size.extract_batch_size,
                                                                                     size.extract_seq_len)]
    for run in runs:  # each point extracted the same number of tokens, durably written
        assert run["tokens"] == result["extract"]["tokens_per_point"] and run["disk_gbps"] > 0
    # Both placements stored exactly the same hidden states (one device each on a CPU).
    split = result["extract_split"]
    assert [run["placement"] for run in split["runs"]] == ["one_device", "split"]
    assert split["max_abs_difference"] == {"aux_hidden": 0.0, "final_hidden": 0.0}
    assert not list((tmp_path / "work").glob("split-*")), "the saved target and the shards are removed"
    alone, packed = result["train"]  # the shape asked for, a document a row; then the size's packed row
    assert (alone["batch"], alone["length"], alone["kernel"], alone["documents"]) == (1, 64, "reference", 1)
    assert (packed["batch"], packed["length"]) == (1, 512) and packed["documents"] > 1
    assert alone["tokens_per_s"] > 0 and packed["tokens_per_s"] > 0

    out = tmp_path / "tiny.json"
    write_result(result, out)
    assert json.loads(out.read_text())["extract"]["runs"] == json.loads(json.dumps(runs))
    table = out.with_suffix(".md").read_text()
    assert "ours / naive at batch 8 x 256" in table and "split over 0 GPUs" in table
    assert (tmp_path / "tiny-extract.png").stat().st_size > 0 and (tmp_path / "tiny.png").stat().st_size > 0


@pytest.mark.heavy
def test_tiny_bench_times_each_training_variant_on_the_same_row(tmp_path):
    result = run_bench("tiny", torch.device("cpu"), tmp_path / "work", parts=("train-variants",))
    rows = result["train_variants"]
    assert [row["variant"] for row in rows] == ["EAGLE-3, positions fixed, AdamW", "positions raised", "EAGLE-3.1",
                                                "Muon", "LK loss, alpha", "LK loss, lambda"]
    assert {(row["length"], row["documents"], row["kernel"]) for row in rows} == {(512, rows[0]["documents"],
                                                                                   "reference")}
    assert rows[0]["documents"] > 1 and all(row["tokens_per_s"] > 0 for row in rows)
    # the same random inputs and weights: the first step's loss is the same but for the variant's own change
    assert rows[1]["losses"][0] == rows[0]["losses"][0]  # step 0 does not depend on the positions scheme
    assert rows[3]["losses"][0] == rows[0]["losses"][0] and rows[3]["losses"][1:] != rows[0]["losses"][1:]
    assert all(row["losses"][0] != rows[0]["losses"][0] for row in rows[4:])  # another objective from the first step
    write_result(result, tmp_path / "variants.json")
    assert "| Muon" in (tmp_path / "variants.md").read_text()


def test_batch_panel_uses_the_length_measured_at_most_batch_sizes():
    from eagle3ops.benchmark.report import batch_sweep_length

    shapes = [(1, 1024), (1, 2048), (2, 2048), (4, 2048), (1, 4096), (1, 8192)]
    assert batch_sweep_length([{"batch": b, "length": n} for b, n in shapes]) == 2048
    assert batch_sweep_length([{"batch": 1, "length": 512}, {"batch": 1, "length": 256}]) == 256


@pytest.mark.processes
def test_tiny_bench_trains_data_of_varying_length_from_fresh_processes(tmp_path):
    """Two fresh processes (an empty compile cache, then the one it left) train two epochs of the seeded set with
    the train stage's loop: their figures hold together, and the same data give the same losses."""
    from eagle3ops.benchmark.varlen import varlen_lengths

    result = run_bench("tiny", torch.device("cpu"), tmp_path / "work", parts=("train-varlen",))
    varlen = result["train_varlen"]
    lengths = varlen_lengths(SIZES["tiny"]())
    assert (varlen["samples"], varlen["tokens"]) == (len(lengths), sum(lengths))
    cold, warm = varlen["runs"]
    assert (cold["compile_cache"], warm["compile_cache"]) == ("cold", "warm")
    for run in (cold, warm):
        steps = run["steps_per_epoch"]
        assert steps >= sum(lengths) / run["packed_length"] and len(run["losses"]) == 2 * steps
        assert run["padding_share"] == 1 - sum(lengths) / (steps * run["packed_length"])
        assert run["process_s"] >= run["epoch1_from_start_s"] > run["setup_s"] > 0
    assert cold["losses"] == warm["losses"]
    out = tmp_path / "varlen.json"
    write_result(result, out)
    assert "from process start" in out.with_suffix(".md").read_text()
    assert (tmp_path / "varlen-start.png").stat().st_size > 0


@pytest.mark.heavy
def test_tiny_bench_online_against_offline(tmp_path):
    """Extraction in bf16 and FP8, then the same epochs offline and online: the same losses step for step (up to the
    rounding of bf16 shards against the target's float32 states on a CPU), totals that add up, no shard left."""
    result = run_bench("tiny", torch.device("cpu"), tmp_path / "work", parts=("online",))["online"]
    extract = result["extract"]
    assert extract["float8_e4m3"]["bytes"] < 0.6 * extract["bfloat16"]["bytes"]
    assert extract["float8_e4m3"]["bytes_per_token"] == 4 * 128 + 16 + 5
    offline, online = result["offline"], result["online"]
    assert len(offline["losses"]) == len(online["losses"]) == 3 * offline["steps_per_epoch"]
    assert result["loss_max_rel_diff"] < 1e-2
    before = extract["bfloat16"]["seconds"] + extract["bfloat16"]["read_s"]
    # the report rounds each figure to 0.1 s from the unrounded times: recomputed from rounded ones, it may differ
    # by a rounding step or two (a first epoch of 0.45 s and a steady one of 0.5 s: compile -0.1 s, not -0.0)
    assert result["totals_s"]["bfloat16"]["1"]["offline"] == pytest.approx(before + offline["steady_epoch_s"], abs=0.21)
    assert result["totals_s"]["bfloat16"]["3"]["online"] == pytest.approx(3 * online["steady_epoch_s"], abs=0.21)
    assert offline["compile_s"] == pytest.approx(offline["epoch_s"][0] - offline["steady_epoch_s"], abs=0.11)
    assert not list((tmp_path / "work").glob("online-features-*"))
