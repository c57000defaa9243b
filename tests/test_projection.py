"""`eagle3ops project` against real pipeline runs recorded in a temporary sqlite MLflow store (no mocks).

A pilot run of 1,000 samples is recorded stage by stage with `stage_run`, with round counters and timings, on
hardware labelled "pilotbox"; two small profiles with round numbers describe that box ("pilot", 1 GPU) and a
bigger one ("big", 4 GPUs). Every projected number below is worked out by hand in the comments.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from eagle3ops.cli import main
from eagle3ops.config import Config
from eagle3ops.runs.cost_model import estimate, read_target_shape
from eagle3ops.runs.hardware_profiles import Profile, ProjectionError, load_profile, shipped_profiles
from eagle3ops.runs.projection import check_against, fetch_pipeline, project
from eagle3ops.runs.projection_report import render
from eagle3ops.runs.records import PipelineRecord, StageRecord
from eagle3ops.runs.target_loads import stage_loads, target_loads
from eagle3ops.tracking.run import stage_run
from helpers import isolate

# A host floor of a picosecond a layer pass: negligible for the 1 G-parameter target of the hand calculation below
# (test_host_floor_and_compile_phase has a model small enough for it to count).
PILOT_PROFILE = {
    "name": "pilot", "gpu": "Test GPU", "gpu_count": 1, "bf16_tflops": 100, "hbm_tb_s": 1, "interconnect_gb_s": None,
    "disk_gb_s": 1, "layer_pass_ms": 1e-9, "price_per_hour": 2, "compile_s": 0, "compile_cached_s": 0,
    "labels": ["pilotbox"],
    "notes": "round numbers for the tests",
}
BIG_PROFILE = {
    "name": "big", "gpu": "Bigger test GPU", "gpu_count": 4, "bf16_tflops": 400, "hbm_tb_s": 4, "interconnect_gb_s": 100,
    "disk_gb_s": 2, "layer_pass_ms": 1e-9, "price_per_hour": 10, "compile_s": 0, "compile_cached_s": 0,
    "labels": ["bigbox"],
    "notes": "round numbers for the tests",
}

# The pilot: 1,000 samples; a dense 1 G-parameter target in bf16 (2 GB) with 10 layers of hidden size 1,000.
TARGET = {"target_params": 1e9, "target_bytes": 2e9}
PILOT_STAGES = {  # dvc stage -> (stage, variant, metrics)
    "prepare": ("prepare", None, {"conversations": 1000, "kept": 1000}),
    "generate": ("generate", "hf", {"time/load_s": 4.0, "time/generate_s": 12.0, "conversations": 1000,
                                    "new_tokens": 1e5, **TARGET}),
    "extract": ("extract", None, {"time/load_s": 4.0, "time/extract_s": 28.2, "samples": 1000, "tokens": 5e5,
                                  "bytes": 4e9, **TARGET}),
    "train@scratch": ("train", "scratch", {"time/train_s": 30.0, "draft_params": 1e7, "train_tokens": 2e6,
                                           "steps": 1000}),
    "train@warm_start": ("train", "warm_start", {"time/train_s": 24.0, "draft_params": 1e7, "train_tokens": 2e6,
                                                 "steps": 1000}),
    "eval@scratch": ("eval", "scratch", {"time/load_s": 4.0, "time/decode_s": 16.28, "emitted_tokens": 3000,
                                         "verify_steps": 1000, "time/decode_sampled_s": 6.24,
                                         "sampled/verify_steps": 1500, **TARGET}),
}
# A run of 5,000 samples on the big box: timings only (a comparison needs no counters); no train@warm_start.
MEASURED_STAGES = {
    "prepare": ("prepare", None, {"conversations": 5000}),
    "generate": ("generate", "hf", {"time/generate_s": 8.7}),
    "extract": ("extract", None, {"time/load_s": 3.0, "time/extract_s": 29.3125}),
    "train@scratch": ("train", "scratch", {"time/train_s": 30.0}),
    "eval@scratch": ("eval", "scratch", {"time/decode_s": 4.07}),
}


@dataclass
class Store:
    root: Path
    uri: str
    pilot_id: str
    measured_id: str
    pilot: Profile
    big: Profile

    def client(self) -> MlflowClient:
        return MlflowClient(self.uri)


def write_profile(directory: Path, data: dict) -> Path:
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def record_pipeline(mp: pytest.MonkeyPatch, experiment: str, label: str, stages: dict) -> str:
    """Run each stage under `stage_run` as DVC would (DVC_STAGE, DVC_EXP_NAME) and log the given metrics."""
    mp.setenv("DVC_EXP_NAME", experiment)
    cfg = Config()
    cfg.hardware.label = label
    cfg.mlflow.system_metrics = False
    cfg.generate.batch_size = 50  # 1e5 new tokens / 50 = 2,000 decode steps
    cfg.extract.batch_size = 20  # 1,000 samples / 20 = 50 forward passes
    cfg.train.ttt_steps = 5  # a param of the train runs, as the stage logs it
    parent = ""
    for dvc_stage, (stage, variant, metrics) in stages.items():
        mp.setenv("DVC_STAGE", dvc_stage)
        with stage_run(cfg, stage, variant) as run:
            run.log_metrics(metrics)
        parent = run.parent_id
    return parent


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    tmp_path = tmp_path_factory.mktemp("project")
    with pytest.MonkeyPatch.context() as monkeypatch:
        uri = isolate(monkeypatch, tmp_path)
        pilot_id = record_pipeline(monkeypatch, "pilot", "pilotbox", PILOT_STAGES)
        measured_id = record_pipeline(monkeypatch, "hero-on-big", "bigbox", MEASURED_STAGES)
    # Kimi-style config.json: the language model's settings under text_config (Config().target.path).
    target = tmp_path / "models/zoo/successor"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 10, "hidden_size": 1000}}))
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    pilot, big = (load_profile(write_profile(profiles, p)) for p in (PILOT_PROFILE, BIG_PROFILE))
    return Store(tmp_path, uri, pilot_id, measured_id, pilot, big)


def pilot_projection(store: Store, samples: int = 10_000):
    record = fetch_pipeline(store.client(), store.pilot_id)
    shape = read_target_shape(record, store.root)
    return project(record, samples, [store.big, store.pilot], known=[store.pilot], shape=shape)


def test_projection_matches_hand_calculation(store: Store) -> None:
    projection = pilot_projection(store)
    assert (projection.shape.layers, projection.shape.hidden) == (10, 1000)
    assert projection.pilot_samples == 1000 and projection.work_ratio == 10  # 10,000 / 1,000
    big = {row.phase.name: row.estimates["big"] for row in projection.rows}
    same = {row.phase.name: row.estimates["pilot"] for row in projection.rows}
    assert list(big) == ["load", "generate", "extract", "train@scratch", "train@warm_start", "eval@scratch",
                         "eval@scratch sampled"]
    assert all(row.pilot.name == "pilot" for row in projection.rows)  # by the stages' hardware label "pilotbox"

    # Ideal time = demand / capacity. Pilot: 1 GPU, 100 TFLOP/s, 1 TB/s HBM, disk 1 GB/s.
    # Big: 4 GPUs of 400 TFLOP/s and 4 TB/s (1.6e15 FLOP/s, 1.6e13 B/s when all four work), 100 GB/s link, disk 2 GB/s.
    # projected = measured / sum(ideal on pilot) * sum(ideal on big) * work ratio (10; load and eval: 1).

    # load: disk reads target_bytes 2e9. Pilot 2e9 / 1e9 = 2 s -> measured 4 s is 2x ideal.
    # Big: 2e9 / 2e9 = 1 s; 2 * 1 = 2 s (no work ratio).
    assert big["load"].seconds == pytest.approx(2.0)
    assert (big["load"].dominant, big["load"].gpus) == ("disk", 4)

    # generate: compute 2 * 1e9 * 1e5 new tokens = 2e14 FLOP; HBM 2e9 B * (1e5 / batch 50 = 2,000 steps) = 4e12 B.
    # Pilot: 2e14 / 1e14 = 2 s + 4e12 / 1e12 = 4 s (one GPU: no all-reduce) = 6 s -> measured 12 s is 2x ideal.
    # Big: compute 2e14 / 1.6e15 = 0.125 s; HBM 4e12 / 1.6e13 = 0.25 s;
    #   all-reduce buffers 2 per layer * 10 layers * 1e5 tokens * 1000 hidden * 2 B = 4e9 B, each GPU sends
    #   2 * 3/4 of them = 6e9 B / 100e9 B/s = 0.06 s. Sum 0.435 s; 2 * 0.435 * 10 = 8.7 s, HBM bound.
    assert big["generate"].seconds == pytest.approx(8.7)
    assert big["generate"].dominant == "memory"

    # extract: compute 2 * 1e9 * 5e5 tokens = 1e15 FLOP; HBM 2e9 B * (1,000 samples / batch 20 = 50 passes) = 1e11 B;
    #   disk writes 4e9 B of features.
    # Pilot: 1e15 / 1e14 = 10 s + 1e11 / 1e12 = 0.1 s + 4e9 / 1e9 = 4 s = 14.1 s -> measured 28.2 s is 2x ideal.
    # Big: 1e15 / 1.6e15 = 0.625 s; 1e11 / 1.6e13 = 0.00625 s; all-reduce 2 * 10 * 5e5 * 1000 * 2 = 2e10 B,
    #   * 2 * 3/4 = 3e10 B / 1e11 = 0.3 s; disk 4e9 / 2e9 = 2 s. Sum 2.93125 s; 2 * 2.93125 * 10 = 58.625 s.
    assert big["extract"].seconds == pytest.approx(58.625)
    assert big["extract"].dominant == "disk"

    # train: 6 * 1e7 draft params * 2e6 tokens * 5 TTT steps = 6e14 FLOP, on one GPU everywhere.
    # Pilot: 6e14 / 1e14 = 6 s. scratch measured 30 s = 5x ideal; warm start 24 s = 4x ideal.
    # Big, one of its GPUs: 6e14 / 4e14 = 1.5 s. scratch 5 * 1.5 * 10 = 75 s; warm start 4 * 1.5 * 10 = 60 s.
    assert big["train@scratch"].seconds == pytest.approx(75.0)
    assert big["train@warm_start"].seconds == pytest.approx(60.0)
    assert (big["train@scratch"].dominant, big["train@scratch"].gpus) == ("compute", 1)

    # eval (k = 3): target forwards 1000 verify steps * 4 tokens + 3000 reference tokens = 7000 tokens,
    #   compute 2 * 1e9 * 7000 = 1.4e13 FLOP; HBM 2e9 B * (1000 + 3000 forward passes) = 8e12 B.
    # Pilot: 1.4e13 / 1e14 = 0.14 s + 8e12 / 1e12 = 8 s = 8.14 s -> measured 16.28 s is 2x ideal.
    # Big, one GPU: 1.4e13 / 4e14 = 0.035 s + 8e12 / 4e12 = 2 s = 2.035 s; 2 * 2.035 = 4.07 s (fixed prompt set).
    assert big["eval@scratch"].seconds == pytest.approx(4.07)
    assert (big["eval@scratch"].dominant, big["eval@scratch"].gpus) == ("memory", 1)

    # eval at the sampled temperature: 1500 verify steps of 4 tokens, no reference decoding: compute
    #   2 * 1e9 * 6000 = 1.2e13 FLOP; HBM 2e9 B * 1500 = 3e12 B. Pilot: 0.12 s + 3 s = 3.12 s -> measured 6.24 s is
    #   2x ideal. Big, one GPU: 1.2e13 / 4e14 = 0.03 s + 3e12 / 4e12 = 0.75 s; 2 * 0.78 = 1.56 s.
    assert big["eval@scratch sampled"].seconds == pytest.approx(1.56)

    # Total on big: 2 + 8.7 + 58.625 + 75 + 60 + 4.07 + 1.56 = 209.955 s = 0.05832 h; * 10 USD/h = 0.583208 USD.
    assert projection.total_s(store.big) == pytest.approx(209.955)
    assert projection.cost(store.big) == pytest.approx(0.5832083)

    # Projected onto its own profile, a phase is its measured time times the work ratio:
    # 4 + 120 + 282 + 300 + 240 + 16.28 + 6.24 = 968.52 s = 0.26903 h; * 2 USD/h = 0.538067 USD.
    assert {name: e.seconds for name, e in same.items()} == pytest.approx(
        {"load": 4.0, "generate": 120.0, "extract": 282.0, "train@scratch": 300.0, "train@warm_start": 240.0,
         "eval@scratch": 16.28, "eval@scratch sampled": 6.24})
    assert projection.cost(store.pilot) == pytest.approx(0.5380667)
    assert not projection.notes


def test_without_target_config_interconnect_is_left_out_and_said(store: Store) -> None:
    record = fetch_pipeline(store.client(), store.pilot_id)
    projection = project(record, 10_000, [store.big], known=[store.pilot], shape=None)
    generate = next(row.estimates["big"] for row in projection.rows if row.phase.name == "generate")
    assert generate.seconds == pytest.approx(2 * (0.125 + 0.25) * 10)  # the 0.06 s of all-reduce is gone
    assert "Interconnect" in projection.notes[0] and "Interconnect" in render(projection)
    assert "floor a decoder-layer pass is not modelled" in projection.notes[1]


def test_host_floor_and_compile_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 M-parameter target of 10 layers: every phase is bound by the host's floor a layer pass, which only the
    profile's layer_pass_ms moves; the training loop's compilation is a phase of its own that does not scale."""
    uri = isolate(monkeypatch, tmp_path)
    small = {"target_params": 1e6, "target_bytes": 2e6}
    record_pipeline(monkeypatch, "small-model", "hostbox", {
        "prepare": ("prepare", None, {"conversations": 100}),
        "generate": ("generate", "hf", {"time/generate_s": 3.0, "new_tokens": 1000, "decode_steps": 100, **small}),
        # train: loop 1e4 tokens / 1,000 tok/s = 10 s, of which the first step 3 s; held-out evaluation 12 - 10 = 2 s
        "train@scratch": ("train", "scratch", {"time/train_s": 12.0, "first_step_s": 3.0, "train_tokens": 1e4,
                                               "tokens_per_s": 1000, "steps": 11, "draft_params": 1e3}),
        "train@warm_start": ("train", "warm_start", {"time/train_s": 12.0, "first_step_s": 3.0, "train_tokens": 1e4,
                                                     "tokens_per_s": 1000, "steps": 11, "draft_params": 1e3}),
    })
    (tmp_path / "models/zoo/successor").mkdir(parents=True)
    (tmp_path / "models/zoo/successor/config.json").write_text(json.dumps({"num_hidden_layers": 10, "hidden_size": 64}))
    host_pilot, host_big = (load_profile(write_profile(tmp_path, {**base, **change})) for base, change in (
        (PILOT_PROFILE, {"name": "hostpilot", "layer_pass_ms": 1.0, "labels": ["hostbox"]}),
        (PILOT_PROFILE, {"name": "hostbig", "bf16_tflops": 400, "hbm_tb_s": 4, "layer_pass_ms": 0.25, "compile_s": 40,
                         "compile_cached_s": 8, "labels": ["hostbig"]})))
    client = MlflowClient(uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("eagle3ops").experiment_id],
                                   "tags.`eagle3ops.role` = 'pipeline'")
    record = fetch_pipeline(client, parent.info.run_id)
    projection = project(record, 400, [host_big, host_pilot], known=[host_pilot],
                         shape=read_target_shape(record, tmp_path))
    big = {row.phase.name: row.estimates["hostbig"] for row in projection.rows}
    own = {row.phase.name: row.estimates["hostpilot"] for row in projection.rows}
    assert list(big) == ["generate", "train@scratch compile", "train@scratch", "train@warm_start compile",
                         "train@warm_start"]
    assert [row.phase.measured_s for row in projection.rows] == pytest.approx([3.0, 5.0, 7.0, 5.0, 7.0])

    # generate: host 100 decode steps * 10 layers = 1,000 passes: 1 s on the pilot (1 ms), 0.25 s on big, taken as
    # they are. The peak resources took the other 3 - 1 = 2 s: compute 2e6 * 1000 = 2e9 FLOP (2e-5 s on the pilot,
    # 5e-6 s on big), HBM 2e6 B * 100 steps = 2e8 B (2e-4 s, 5e-5 s): 2 / 2.2e-4 * 5.5e-5 = 0.5 s on big.
    # (0.5 + 0.25) * 4 (400 / 100 samples) = 3 s; the largest part is HBM's 0.4545 s.
    assert big["generate"].seconds == pytest.approx(3.0)
    assert big["generate"].dominant == "memory"
    # train, the loop less its first step: host (11 - 1) steps * 5 TTT steps * 3 passes = 150 passes: 0.15 s on the
    # pilot, 0.0375 s on big; compute 6 * 1e3 * 1e4 * 5 = 3e8 FLOP: 3e-6 s and 7.5e-7 s, so the other
    # 7 - 0.15 = 6.85 s become 6.85 / 4 on big. (1.7125 + 0.0375) * 4 = 7 s.
    assert big["train@scratch"].seconds == pytest.approx(7.0)
    # the compilation: big compiles (compile_s 40, a cold cache: the run's first train stage); the pilot's own
    # profile runs eager, so there it is what the pilot measured, whatever the samples
    assert (big["train@scratch compile"].seconds, own["train@scratch compile"].seconds) == (40.0, 5.0)
    assert big["train@scratch compile"].dominant == "fixed"
    assert big["train@warm_start compile"].seconds == 8.0  # the second finds the graphs in the cache
    # checked against a run on big with twice the decode steps a conversation: "at its work" projects those
    # 800 steps (compute 2e6 * 4000 = 8e9 FLOP: 2e-5 s; HBM 2e6 * 800 = 1.6e9 B: 4e-4 s; host 8,000 passes: 2 s),
    # 2 / 2.2e-4 * 4.2e-4 + 2 = 5.818 s; the plain projection stays at the pilot's work times 4: 3 s
    record_pipeline(monkeypatch, "small-model-on-big", "hostbig", {
        "prepare": ("prepare", None, {"conversations": 400}),
        "generate": ("generate", "hf", {"time/generate_s": 6.0, "new_tokens": 4000, "decode_steps": 800, **small})})
    (measured,) = client.search_runs([client.get_experiment_by_name("eagle3ops").experiment_id],
                                     "attributes.run_name = 'small-model-on-big'")
    check = check_against(projection, fetch_pipeline(client, measured.info.run_id), [host_pilot, host_big])
    (row,) = check.rows
    assert row[:2] == ("generate", host_big) and row[2:4] == pytest.approx((3.0, 6.0))
    assert row[4] == pytest.approx(2 / 2.2e-4 * 4.2e-4 + 2)
    # a phase measured below its host floor scales the floor down: 0.5 s measured against 1 s of host time
    fast = next(row.phase for row in projection.rows if row.phase.name == "generate")
    fast = dataclasses.replace(fast, measured_s=0.5)
    assert estimate(fast, host_pilot, host_big, 1.0).seconds == pytest.approx(0.5 * 0.25 / 1.0)
    assert estimate(fast, host_pilot, host_pilot, 1.0).seconds == pytest.approx(0.5)
    assert own["generate"].seconds == pytest.approx(12.0) and own["train@scratch"].seconds == pytest.approx(28.0)


def test_prompts_decoded_together_share_the_passes_and_the_weight_reads() -> None:
    """eval.batch_size 8: the counters sum over the prompts, a forward serves eight of them; the FLOPs stay."""
    from eagle3ops.runs.cost_model import TargetShape, _demand
    from eagle3ops.runs.records import PipelineRecord, StageRecord

    metrics = {"verify_steps": 400, "emitted_tokens": 1000, "sampled/verify_steps": 600, **TARGET}

    def demands(params: dict[str, str]) -> list:
        stage = StageRecord("eval@scratch", "eval", "scratch", "r", False, metrics, {"eval.k": "3", **params}, {})
        record = PipelineRecord("p", "p", {}, stages={"eval@scratch": stage})
        return [_demand(record, phase, stage, TargetShape(30, 576, "config.json"))
                for phase in ("eval@scratch", "eval@scratch sampled")]

    alone, together = demands({}), demands({"eval.batch_size": "8"})  # a run from before the param: one at a time
    assert alone == demands({"eval.batch_size": "1"})
    assert alone[0].layer_passes == (400 + 1000) * 30 + 400 * 3 and alone[1].layer_passes == 600 * (30 + 3)
    for one, eight in zip(alone, together):
        assert (eight.layer_passes, eight.hbm_bytes) == pytest.approx((one.layer_passes / 8, one.hbm_bytes / 8))
        assert eight.flops == one.flops


def test_measured_run_comparison(store: Store) -> None:
    projection = pilot_projection(store)
    check = check_against(projection, fetch_pipeline(store.client(), store.measured_id), [store.pilot, store.big])
    # The measured run had 5,000 samples on the big box: work ratio 5 (not --samples' 10), so the scaling phases
    # halve: generate 8.7 / 2 = 4.35, extract 58.625 / 2 = 29.3125, train@scratch 75 / 2 = 37.5; load 2 and
    # eval 4.07 stay. train@warm_start is not in the measured run.
    assert check.samples == 5000
    rows = {phase: (target.name, projected, measured) for phase, target, projected, measured, _ in check.rows}
    assert all(at_work is None for *_, at_work in check.rows)  # the measured run logged timings, no counters
    assert list(rows) == ["load", "generate", "extract", "train@scratch", "eval@scratch"]
    assert {phase: r[0] for phase, r in rows.items()} == dict.fromkeys(rows, "big")
    assert [r[1] for r in rows.values()] == pytest.approx([2.0, 4.35, 29.3125, 37.5, 4.07])
    # measured / projected: 3 / 2 = 1.5, 8.7 / 4.35 = 2, 29.3125 / 29.3125 = 1, 30 / 37.5 = 0.8, 4.07 / 4.07 = 1.
    assert [r[2] / r[1] for r in rows.values()] == pytest.approx([1.5, 2.0, 1.0, 0.8, 1.0])
    projection.check = check
    text = render(projection)
    assert "Projection vs measured run hero-on-big" in text
    assert "| train@scratch | big      | 37.5          | 30.0         | 0.80" in text


def test_a_run_checked_against_itself_is_exact_in_both_columns(store: Store) -> None:
    """Projected onto its own hardware and sample count, with its own work: each phase is what it measured."""
    record = fetch_pipeline(store.client(), store.pilot_id)
    projection = project(record, 1000, [store.pilot], known=[store.pilot], shape=read_target_shape(record, store.root))
    check = check_against(projection, record, [store.pilot])
    assert [row[0] for row in check.rows] == [row.phase.name for row in projection.rows]
    for phase, _, projected, measured, at_work in check.rows:
        assert projected == pytest.approx(measured) and at_work == pytest.approx(measured), phase


def table_row(text: str, phase: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {phase} "))
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_cli_prints_table_and_writes_report(store: Store, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(store.root)  # the target's config.json is found under the working directory
    profiles = store.root / "profiles"
    rc = main(["project", "--run", store.pilot_id, "--samples", "10000", "--to", str(profiles / "big.yaml"),
               "--to", str(profiles / "pilot.yaml"), "--measured", store.measured_id, "--tracking-uri", store.uri,
               "--out", "projection.md"])
    out = capsys.readouterr().out
    assert rc == 0
    # phase, GPUs, measured on, pilot s, big s, big bound, pilot s, pilot bound (numbers from the hand calculation)
    assert table_row(out, "load") == ["load", "all", "pilot", "4", "2", "disk", "4", "disk"]
    assert table_row(out, "extract") == ["extract", "all", "pilot", "28.2", "58.6", "disk", "282", "compute"]
    assert table_row(out, "train@scratch") == ["train@scratch", "1", "pilot", "30.0", "75.0", "compute", "300", "compute"]
    assert table_row(out, "eval@scratch") == ["eval@scratch", "1", "pilot", "16.3", "4.07", "HBM", "16.3", "HBM"]
    assert table_row(out, "eval@scratch sampled") == ["eval@scratch sampled", "1", "pilot", "6.24", "1.56", "HBM",
                                                      "6.24", "HBM"]
    assert table_row(out, "**total s**")[4] == "210"  # 209.955 s
    assert table_row(out, "**cost USD**")[4:] == ["$0.583", "at $10/h", "$0.538", "at $2/h"]
    assert "big (4 GPU) s" in out and "Pilot: 1,000 samples; work ratio x10" in out
    assert "Projection vs measured run hero-on-big" in out
    # the pilot's stages load the target in their own processes: once each, as with a server per stage
    assert ("Target loads a run: 3 (generate 1, extract 1, eval@scratch 1); with a vLLM server of each stage's own "
            "(vllm.engine_idle_s 0): 3.") in out
    assert "- big: 2 s a load; loading a run: 0.1 min, 0.1 min with a server per stage" in out
    assert (store.root / "projection.md").read_text() == out
    assert (store.root / "projection.png").read_bytes().startswith(b"\x89PNG")  # the check, drawn


def test_cli_unknown_label_is_a_clear_error(store: Store, capsys) -> None:
    # Only the big profile is given: no profile lists the pilot's label "pilotbox".
    rc = main(["project", "--run", store.pilot_id, "--samples", "10000", "--to", str(store.big.source),
               "--tracking-uri", store.uri])
    captured = capsys.readouterr()
    assert rc == 1 and not captured.out
    assert captured.err.startswith("eagle3ops project: error: ")
    assert "'pilotbox'" in captured.err and "big [bigbox]" in captured.err and "h200 [1xH200, H200]" in captured.err
    assert "--from" in captured.err


def test_from_overrides_the_label(store: Store) -> None:
    # --from big: the pilot is taken to have run on the big box; projected onto big itself, each phase is its
    # measured time times the work ratio (the all-reduce part cancels like the others).
    record = fetch_pipeline(store.client(), store.pilot_id)
    projection = project(record, 10_000, [store.big], known=[], pilot=store.big, shape=read_target_shape(record, store.root))
    assert [row.estimates["big"].seconds for row in projection.rows] == pytest.approx([4, 120, 282, 300, 240, 16.28, 6.24])


def test_cli_other_errors(store: Store, capsys) -> None:
    stage_id = fetch_pipeline(store.client(), store.pilot_id).stages["extract"].run_id
    cases = {
        "is not a pipeline run": ["--run", stage_id, "--to", "h200"],
        "not found in": ["--run", "0" * 32, "--to", "h200"],
        "unknown profile 'h300'": ["--run", store.pilot_id, "--to", "h300"],
    }
    for message, args in cases.items():
        assert main(["project", "--samples", "10", "--tracking-uri", store.uri, *args]) == 1
        err = capsys.readouterr().err
        assert message in err, err
    assert "b300-nvl8" in err  # the unknown profile's message lists the shipped ones


@pytest.mark.parametrize(("change", "key", "message"), [
    ({"disk_gb_s": None}, "disk_gb_s", "must be a positive number"),
    ({"price_per_hour": -1}, "price_per_hour", "must be a positive number"),
    ({"bf16_tflops": "fast"}, "bf16_tflops", "must be a positive number"),
    ({"gpu_count": 0}, "gpu_count", "whole number >= 1"),
    ({"gpu_count": 8}, "interconnect_gb_s", "null only with gpu_count 1"),
    ({"labels": []}, "labels", "non-empty list"),
    ({"layer_pass_ms": 0}, "layer_pass_ms", "must be a positive number"),
    ({"compile_s": -1}, "compile_s", "must be a number >= 0"),
    ({"compile_cached_s": None}, "compile_cached_s", "must be a number >= 0"),
    ({"nvlink": True}, "nvlink", "unknown key"),
    ({"name": "other"}, "name", "differs from the file name"),
])
def test_profile_validation_names_file_and_key(tmp_path: Path, change: dict, key: str, message: str) -> None:
    path = tmp_path / "pilot.yaml"
    path.write_text(yaml.safe_dump({**PILOT_PROFILE, **change}))
    with pytest.raises(ProjectionError) as err:
        load_profile(path)
    assert str(err.value).startswith(f"{path}: key '{key}': ")
    assert message in str(err.value)


def test_profile_missing_key_and_bad_yaml(tmp_path: Path) -> None:
    path = tmp_path / "pilot.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in PILOT_PROFILE.items() if k != "hbm_tb_s"}))
    with pytest.raises(ProjectionError, match=r"pilot\.yaml: key 'hbm_tb_s': missing"):
        load_profile(path)
    path.write_text("name: [unclosed\n")
    with pytest.raises(ProjectionError, match=r"pilot\.yaml: not valid YAML"):
        load_profile(path)
    path.write_text("- a list\n")
    with pytest.raises(ProjectionError, match=r"pilot\.yaml: expected a mapping"):
        load_profile(path)


def test_shipped_profiles_load() -> None:
    profiles = shipped_profiles()
    assert set(profiles) == {"h200", "h100-sxm", "b300-nvl8", "rtx-pro-6000-pcie-x8", "cpu-2c"}
    h200 = profiles["h200"]
    assert (h200.gpu_count, h200.bf16_tflops, h200.hbm_tb_s, h200.disk_gb_s) == (1, 789, 4.25, 1.19)
    assert {"1xH200", "H200"} <= set(h200.labels)
    assert profiles["b300-nvl8"].gpu_count == profiles["rtx-pro-6000-pcie-x8"].gpu_count == 8
    assert profiles["rtx-pro-6000-pcie-x8"].interconnect_gb_s < profiles["b300-nvl8"].interconnect_gb_s  # PCIe < NVLink
    assert "cpu-2c" in profiles["cpu-2c"].labels and "rough" in profiles["cpu-2c"].notes.lower()
    labels = [label for p in profiles.values() for label in p.labels]
    assert len(labels) == len(set(labels))  # a hardware label maps to one profile


def stage_record(name: str, params: dict[str, str], engines: str = "", **metrics: float) -> StageRecord:
    stage, _, variant = name.partition("@")
    return StageRecord(name, stage, variant, f"run-{name}", False, metrics, params,
                       {"eagle3ops.engines": engines} if engines else {})


def test_target_loads_count_each_stages_own_and_the_engines_it_started() -> None:
    """The story's shape (generate, extract and eval on vLLM, the export's check): one engine of the target alone
    for generate, a capturing server for extract, one engine with a drafter that every eval and the export find;
    with a server per stage each of them starts its own. The micro pipeline's shape (the decoder in each eval,
    vLLM beside it) counts the decoder's loads too."""
    vllm_eval = {"eval.backend": "vllm", "eval.server_url": "None"}
    story = PipelineRecord("p", "story", {}, stages={record.name: record for record in (
        stage_record("generate", {"generate.backend": "vllm"}, "started 1a (1342.0 s start)"),
        stage_record("target_speed", vllm_eval),  # measures where the evals decode beside vLLM: nothing here
        stage_record("extract", {"extract.backend": "vllm"}),
        stage_record("train@scratch", {"train.hidden_states": "offline"}),
        stage_record("eval@baseline", vllm_eval, "started 2b (1350.5 s start)"),
        stage_record("eval@scratch", vllm_eval, "found 2b (1350.5 s start)"),
        stage_record("eval@warm_start", vllm_eval, "found 2b (1350.5 s start)"),
        stage_record("export", {"export.serve": "True"}, engine_started=0.0))})
    loads = target_loads(story)
    assert loads.in_run == {"generate": 1, "extract": 1, "eval@baseline": 1, "eval@scratch": 0, "eval@warm_start": 0,
                            "export": 0}
    assert (loads.total, loads.per_stage_total) == (3, 6)

    micro = {"eval.backend": "hf", "eval.engine": "vllm"}
    assert stage_loads(stage_record("target_speed", micro, "started 1a (2.9 s start)")) == (1, 1)
    assert stage_loads(stage_record("target_speed", micro, "found 1a (2.9 s start)")) == (0, 1)  # generate's engine
    assert stage_loads(stage_record("eval@baseline", micro, "started 2b (3.1 s start)")) == (2, 2)
    assert stage_loads(stage_record("eval@scratch", micro, "found 2b (3.1 s start)")) == (1, 2)
    assert stage_loads(stage_record("eval@scratch", {**micro, "eval.engine": "None"})) == (1, 1)  # the decoder alone
    online = {"train.hidden_states": "online", "train.online_engine": "vllm"}
    assert stage_loads(stage_record("train@scratch", {**online, "train.online_url": "http://gpu-box:8000"})) == (0, 0)
    assert stage_loads(stage_record("train@scratch", {**online, "train.online_url": "None"})) == (1, 1)
    assert stage_loads(stage_record("generate", {"generate.backend": "openai"})) == (0, 0)
    assert stage_loads(stage_record("extract", {"extract.backend": "import"})) == (0, 0)
