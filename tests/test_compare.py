"""`eagle3ops compare` on three pipeline runs recorded in a real sqlite MLflow store (two on cpu-2c, one on H200)."""
from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot
import pandas as pd
import pytest
from mlflow import MlflowClient

from eagle3ops.cli import main
from eagle3ops.config import Config
from eagle3ops.runs.compare import (
    against_reference,
    differing_params,
    draw,
    load_warnings,
    markdown,
    select_pipelines,
    side_by_side,
    speedups,
    within_runs,
    write_report,
)
from eagle3ops.runs.phases import timed_phases
from eagle3ops.runs.records import PipelineRecord, StageRecord
from eagle3ops.tracking.run import stage_run
from helpers import FakeDvc, isolate


def _eval(load: float, decode: float, accepts: tuple[float, ...], spec_tokens_per_s: float) -> dict[str, float]:
    tau = 1 + sum(accepts)  # over 100 verification steps, with a 95% interval of +-0.15 around it
    return {"time/load_s": load, "time/decode_s": decode, "tau": tau, "tau_ci_low": tau - 0.15,
            "tau_ci_high": tau + 0.15, "spec_tokens_per_s": spec_tokens_per_s, "verify_steps": 100,
            "accepted_tokens": round(100 * sum(accepts)), **{f"accept_{i}": a for i, a in enumerate(accepts, 1)}}


def _train(load: float, seconds: float, steps: int, tokens: int, tokens_per_s: float) -> dict[str, float]:
    return {"time/load_s": load, "time/train_s": seconds, "steps": steps, "train_tokens": tokens,
            "tokens_per_s": tokens_per_s, "steps_per_s": steps / seconds, "eval/acc_0": 0.8}


# run-a: the local reference. run-b: the same machine, more training data, and something else busy on the machine
# while it generated. run-c: a rented H200, no baseline eval.
RUNS = {
    "run-a": ("cpu-2c", {
        "generate": {"time/load_s": 10, "time/generate_s": 100, "new_tokens": 50_000, "tokens_per_s": 500},
        "extract": {"time/load_s": 10, "time/extract_s": 40, "tokens": 100_000, "tokens_per_s": 2_500, "bytes": 4e9},
        "train@scratch": _train(2, 300, 1000, 600_000, 2_000),
        "train@warm_start": _train(2, 300, 1000, 600_000, 2_000),
        "eval@baseline": _eval(10, 60, (0.3, 0.15, 0.05), 100),
        "eval@scratch": _eval(10, 40, (0.7, 0.5, 0.3), 150),
        "eval@warm_start": _eval(10, 30, (0.8, 0.7, 0.6), 200),
    }),
    "run-b": ("cpu-2c", {
        "generate": {"time/load_s": 10, "time/generate_s": 200, "new_tokens": 50_000, "tokens_per_s": 250},
        "extract": {"time/load_s": 10, "time/extract_s": 80, "tokens": 200_000, "tokens_per_s": 2_500, "bytes": 8e9},
        "train@scratch": _train(2, 600, 2000, 1_200_000, 2_000),
        "train@warm_start": _train(2, 450, 1500, 900_000, 2_000),
        "eval@baseline": _eval(10, 60, (0.3, 0.15, 0.05), 100),
        "eval@scratch": _eval(10, 40, (0.8, 0.6, 0.5), 160),
        "eval@warm_start": _eval(10, 30, (0.85, 0.75, 0.7), 220),
    }),
    "run-c": ("H200", {
        "generate": {"time/load_s": 5, "time/generate_s": 20, "new_tokens": 50_000, "tokens_per_s": 2_500},
        "extract": {"time/load_s": 5, "time/extract_s": 10, "tokens": 100_000, "tokens_per_s": 10_000, "bytes": 4e9},
        "train@scratch": _train(1, 200, 1000, 600_000, 3_000),
        "train@warm_start": _train(1, 200, 1000, 600_000, 3_000),
        "eval@scratch": _eval(5, 10, (0.7, 0.5, 0.3), 600),
        "eval@warm_start": _eval(5, 8, (0.8, 0.65, 0.55), 700),
    }),
}
A, B, C = "run-a (cpu-2c)", "run-b (cpu-2c)", "run-c (H200)"
CONVERSATIONS = {"run-b": 2400}  # zoo.conversations where it is not the default's
LOAD = {"run-b": 3.2}  # the machine's load per core as each stage ended; 1.0 elsewhere


@pytest.fixture(scope="session")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One store with the three pipeline runs, recorded once through `stage_run` as the stages record them."""
    root = tmp_path_factory.mktemp("recorded")
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, root)
        mp.setattr("eagle3ops.tracking.run._cores", lambda fingerprint: 2)
        for run_name, (label, stages) in RUNS.items():
            mp.setenv("DVC_EXP_NAME", run_name)
            mp.setattr("os.getloadavg", lambda load=2 * LOAD.get(run_name, 1.0): (load, load, load))
            cfg = Config()
            cfg.hardware.label = label
            cfg.zoo.conversations = CONVERSATIONS.get(run_name, cfg.zoo.conversations)
            cfg.mlflow.system_metrics = False
            for dvc_stage, metrics in stages.items():
                mp.setenv("DVC_STAGE", dvc_stage)
                stage, _, variant = dvc_stage.partition("@")
                with stage_run(cfg, stage, variant or None) as run:
                    run.log_metrics(metrics)
        # Two newer pipeline runs that did not finish: one whose stage failed, one stopped between its stages
        # (its `dvc exp run` would go on to the report)
        mp.setenv("DVC_STAGE", "train@scratch")
        mp.setenv("DVC_EXP_NAME", "run-failed")
        with pytest.raises(RuntimeError), stage_run(cfg, "train", "scratch"):
            raise RuntimeError("out of memory")
        mp.setenv("DVC_EXP_NAME", "run-running")
        shutil.copy(Path(__file__).resolve().parents[1] / "dvc.yaml", root / "dvc.yaml")
        mp.setattr("eagle3ops.tracking.run._dvc_process", lambda: FakeDvc("exp", "run", "-n", "run-running"))
        with stage_run(cfg, "train", "scratch"):
            pass
    return root / "mlflow.db"


@pytest.fixture
def client(recorded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MlflowClient:
    """A copy of the recorded store in this test's own directory, which is also the working directory."""
    shutil.copy(recorded, tmp_path / "mlflow.db")
    return MlflowClient(isolate(monkeypatch, tmp_path))


def run_id(client: MlflowClient, name: str) -> str:
    return next(r.run_id for r in select_pipelines(client, last=None) if r.name == name)


def by_name(client: MlflowClient, *names: str):
    return select_pipelines(client, run_ids=[run_id(client, n) for n in names])


def test_newest_first_and_last(client: MlflowClient) -> None:
    assert [r.name for r in select_pipelines(client)] == ["run-c", "run-b", "run-a"]
    assert [r.name for r in select_pipelines(client, last=2)] == ["run-c", "run-b"]
    assert [r.name for r in by_name(client, "run-a", "run-c")] == ["run-a", "run-c"]  # the order given
    assert [r.name for r in select_pipelines(client, filter_string="attributes.run_name = 'run-b'")] == ["run-b"]


def test_side_by_side_values(client: MlflowClient) -> None:
    table = side_by_side(by_name(client, "run-a", "run-b", "run-c"))
    assert list(table.columns) == [A, B, C]
    assert list(table.index) == [
        *(f"{d} {m}" for d in ("baseline", "scratch", "warm_start")
          for m in ("tau", "tau 95% low", "tau 95% high", "a1", "a2", "a3")),
        "load s", "generate s", "generate tok/s", "extract s", "extract tok/s",
        "train@scratch s", "train@scratch tok/s", "train@warm_start s", "train@warm_start tok/s",
        "eval@baseline s", "eval@baseline tok/s", "eval@scratch s", "eval@scratch tok/s",
        "eval@warm_start s", "eval@warm_start tok/s"]
    assert table.loc["warm_start tau"].tolist() == pytest.approx([3.1, 3.3, 3.0])
    assert table.loc["warm_start tau 95% high"].tolist() == pytest.approx([3.25, 3.45, 3.15])
    assert table.loc["scratch a2"].tolist() == pytest.approx([0.5, 0.6, 0.5])
    assert table.loc["load s"].tolist() == [10, 10, 5]  # the target load, as extract times it
    assert table.loc["extract tok/s"].tolist() == [2_500, 2_500, 10_000]
    assert table.loc["train@warm_start s"].tolist() == [300, 450, 200]
    assert table.loc["eval@warm_start tok/s"].tolist() == [200, 220, 700]
    assert table.loc["baseline tau", A] == 1.5 and math.isnan(table.loc["baseline tau", C])


def test_ratios_against_the_first_run(client: MlflowClient) -> None:
    records = by_name(client, "run-a", "run-b", "run-c")
    ratios = speedups(records)
    # Throughput ratios (tokens/s over the reference's); load from its time (10 s / 5 s).
    assert ratios[C].dropna().to_dict() == pytest.approx({
        "load": 2.0, "generate": 5.0, "extract": 4.0, "train@scratch": 1.5, "train@warm_start": 1.5,
        "eval@scratch": 4.0, "eval@warm_start": 3.5})
    assert math.isnan(ratios.loc["eval@baseline", C])  # run-c has no baseline eval
    assert ratios.loc["generate", B] == 0.5 and ratios.loc["extract", B] == 1.0  # twice the data, same speed
    assert against_reference(records) == [
        f"{B}: load 1.0x faster, generate 2.0x slower, extract 1.0x faster, train@scratch 1.0x faster, "
        "train@warm_start 1.0x faster, eval@baseline 1.0x faster, eval@scratch 1.1x faster, "
        "eval@warm_start 1.1x faster; baseline +0.00 tau (95% intervals overlap: within noise), scratch +0.40 tau, "
        "warm_start +0.20 tau (95% intervals overlap: within noise)",
        f"{C}: load 2.0x faster, generate 5.0x faster, extract 4.0x faster, train@scratch 1.5x faster, "
        "train@warm_start 1.5x faster, eval@scratch 4.0x faster, eval@warm_start 3.5x faster; "
        "scratch +0.00 tau (95% intervals overlap: within noise), warm_start -0.10 tau (95% intervals overlap: "
        "within noise)",
    ]
    assert within_runs(records) == [
        f"{A}: warm_start +0.60 tau vs scratch at the same steps (1,000)",
        f"{B}: warm_start +0.40 tau vs scratch at 1,500 vs 2,000 steps",
        f"{C}: warm_start +0.50 tau vs scratch at the same steps (1,000)",
    ]


def test_the_sampled_decoding_is_a_phase_of_its_own() -> None:
    """An eval that measured tau again at eval.sampled_temperature times that decoding as decode_sampled: compare
    shows it beside the primary decoding (seconds and tokens/s); runs without it show no such row."""
    def record(name: str, sampled_s: float | None) -> PipelineRecord:
        metrics = {**_eval(10, 40, (0.7, 0.5, 0.3), 150),
                   **({"time/decode_sampled_s": sampled_s, "sampled/spec_tokens_per_s": 120.0} if sampled_s else {})}
        stage = StageRecord("eval@scratch", "eval", "scratch", f"id-{name}", False, metrics, {},
                            {"hardware.label": "cpu-2c"})
        return PipelineRecord(f"parent-{name}", name, {}, stages={"eval@scratch": stage})

    both, primary_only = record("both", 25.0), record("primary", None)
    assert [phase.name for phase, _ in timed_phases(both)] == ["eval@scratch", "eval@scratch sampled"]
    assert [phase.name for phase, _ in timed_phases(primary_only)] == ["eval@scratch"]
    table = side_by_side([both, primary_only])
    seconds, rate = table.loc["eval@scratch sampled s"].tolist(), table.loc["eval@scratch sampled tok/s"].tolist()
    assert seconds[0] == 25.0 and rate[0] == 120.0 and math.isnan(seconds[1]) and math.isnan(rate[1])
    assert "eval@scratch sampled s" not in side_by_side([primary_only]).index


def test_variant_filter_keeps_that_drafters_runs_and_rows(client: MlflowClient) -> None:
    warm = select_pipelines(client, variants=["warm_start"])
    assert [r.name for r in warm] == ["run-c", "run-b", "run-a"]
    rows = set(side_by_side(warm).index)
    assert {"warm_start tau", "warm_start a3", "train@warm_start s", "eval@warm_start tok/s", "extract s"} <= rows
    assert not rows & {"scratch tau", "baseline tau", "train@scratch s", "eval@scratch tok/s", "eval@baseline s"}
    assert within_runs(warm) == []  # no scratch to compare with
    baseline = select_pipelines(client, variants=["baseline"])
    assert [r.name for r in baseline] == ["run-b", "run-a"]  # run-c never evaluated the baseline


def test_hardware_filter(client: MlflowClient) -> None:
    assert [r.name for r in select_pipelines(client, hardware=["H200"])] == ["run-c"]
    assert [r.name for r in select_pipelines(client, hardware=["cpu-2c"], last=1)] == ["run-b"]
    assert select_pipelines(client, hardware=["B300"]) == []


def test_writes_markdown_csv_and_png(client: MlflowClient, tmp_path: Path) -> None:
    records = select_pipelines(client)
    text = write_report(records, tmp_path / "out")
    assert (tmp_path / "out" / "compare.md").read_text() == text
    csv = pd.read_csv(tmp_path / "out" / "compare.csv", index_col="metric")
    assert csv.loc["extract tok/s", C] == 10_000 and list(csv.columns) == [C, B, A]
    png = tmp_path / "out" / "compare.png"
    assert png.stat().st_size > 20_000
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[1] > 1000 and pixels[..., :3].std() > 0.05  # two drawn panels, not a blank canvas


def test_the_params_that_differ_come_first(client: MlflowClient) -> None:
    records = by_name(client, "run-a", "run-b")
    assert differing_params(records).to_dict("index") == {"zoo.conversations": {A: "1200", B: "2400"}}
    text = markdown(records)
    assert text.index("## What differs") < text.index("## Side by side")
    assert "| zoo.conversations | 1200 | 2400 |" in re.sub(" +", " ", text)
    assert differing_params(by_name(client, "run-a", "run-c")).empty  # only the hardware differs
    assert "The runs have the same params." in markdown(by_name(client, "run-a", "run-c"))


def test_a_speed_gap_on_one_hardware_label_is_a_warning_with_the_machine_load(client: MlflowClient) -> None:
    records = by_name(client, "run-a", "run-b")
    assert load_warnings(records) == [
        f"generate: {B} is 2.0x slower than {A} on the same hardware label; machine load per core 3.20 vs 1.00. "
        "Re-run on an idle machine before reading it as a speed-up."]
    assert "## Warnings" in markdown(records)
    assert load_warnings(by_name(client, "run-a", "run-c")) == []  # another label: a real difference


def test_the_plot_compares_tau_with_intervals_in_one_colour_per_run(client: MlflowClient) -> None:
    """tau per drafter as grouped bars, one colour per run in every panel, the 95% intervals drawn; acceptance by
    position in the run's colour, the drafter by line style; one run alone draws as well."""
    records = by_name(client, "run-a", "run-b", "run-c")
    figure = draw(records)
    taus, positions, phases = figure.axes
    assert [text.get_text() for text in taus.get_legend().get_texts()] == [A, B, C]
    assert [tick.get_text() for tick in taus.get_xticklabels()] == ["baseline", "scratch", "warm_start"]
    colour = {container.get_label(): container.patches[0].get_facecolor() for container in taus.containers
              if hasattr(container, "patches")}
    assert len(set(colour.values())) == 3
    # run-a's bars: its three drafters at its tau, each with its interval
    run_a = next(c for c in taus.containers if getattr(c, "patches", None) and c.get_label() == A)
    assert [p.get_height() for p in run_a.patches] == pytest.approx([1.5, 2.5, 3.1])
    assert [c for c in taus.containers if not hasattr(c, "patches")], "no error bars"
    # run-c has no baseline: its bar is missing, not zero
    run_c = next(c for c in taus.containers if getattr(c, "patches", None) and c.get_label() == C)
    assert math.isnan(run_c.patches[0].get_height())
    assert {phase.get_facecolor() for phase in phases.patches} == set(colour.values())
    lines = [line for line in positions.get_lines() if len(line.get_xdata())]
    assert {tuple(line.get_color()) for line in lines} == set(colour.values())
    assert {line.get_linestyle() for line in lines} == {":", "--", "-"}
    matplotlib.pyplot.close(figure)
    alone = draw(by_name(client, "run-b"))
    assert [text.get_text() for text in alone.axes[0].get_legend().get_texts()] == [B]
    matplotlib.pyplot.close(alone)


def test_cli_prints_the_table(client: MlflowClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = [run_id(client, name) for name in ("run-a", "run-c")]
    assert main(["compare", "--runs", *ids, "--out", "cmp"]) == 0
    out = capsys.readouterr().out
    lines = [line.replace(" ", "") for line in out.splitlines()]
    assert f"|metric|{A}|{C}|".replace(" ", "") in lines
    assert "|warm_starttau|3.1|3|" in lines
    assert "|extracttok/s|2,500|10,000|" in lines
    assert "|baselinetau|1.5|-|" in lines
    assert f"- {C}: load 2.0x faster, generate 5.0x faster, extract 4.0x faster" in out
    assert {p.name for p in (tmp_path / "cmp").iterdir()} == {"compare.md", "compare.csv", "params.csv", "compare.png"}


def test_cli_filters_and_errors(client: MlflowClient, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--hardware", "H200", "--variant", "scratch", "--out", "cmp"]) == 0
    out = capsys.readouterr().out
    assert C in out and A not in out and "warm_start tau" not in out and "scratch tau" in out
    assert main(["compare", "--hardware", "B300"]) == 1
    assert "no finished pipeline runs match" in capsys.readouterr().err
    assert main(["compare", "--filter", "nonsense ="]) == 2
    assert main(["compare", "--runs", run_id(client, "run-a"), "--last", "1"]) == 0
    experiment = client.get_experiment_by_name("eagle3ops").experiment_id
    stage = client.search_runs([experiment], "tags.`eagle3ops.role` = 'stage'", max_results=1)[0]
    assert main(["compare", "--runs", stage.info.run_id]) == 2
    assert "is not a pipeline run" in capsys.readouterr().err


def test_last_takes_finished_runs_and_names_those_it_left_out(client: MlflowClient, capsys) -> None:
    """A pipeline run whose stage failed, and one stopped between its stages, are newer than the three finished
    runs: `compare --last 2` compares the two newest finished ones and says which it left out, and why."""
    assert main(["compare", "--last", "2", "--out", "cmp"]) == 0
    captured = capsys.readouterr()
    assert C in captured.out and B in captured.out and A not in captured.out
    assert "run-running" not in captured.out and "run-failed" not in captured.out
    assert captured.err.strip() == (
        "eagle3ops compare: left out 2 pipeline run(s) not finished (compare them by id with --runs): "
        "run-running (RUNNING: a stage is running, or the run stopped before its report); "
        "run-failed (FAILED: a stage failed)")
