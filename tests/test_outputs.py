"""Nothing of the user's is lost: an output at a path the user names replaces only a previous output of its own
kind (anything else there is refused in one line, nothing changed)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from eagle3ops import fs
from eagle3ops.cli import main
from eagle3ops.data.vocab import build_vocab_map
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from helpers import isolate

USERS = b"my notes, 16 B\n\n"  # what a user keeps in a file: 16 bytes


def tiny_drafter(path: Path, vocab: int) -> Path:
    """A drafter for the tiny target of conftest.py (4 layers, hidden 32), saved as the train stage saves one."""
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1,
                      vocab_size=vocab, draft_vocab_size=16, target_hidden_size=32, aux_layers=[1, 2, 3],
                      max_position_embeddings=512)
    draft = Eagle3Draft(cfg)
    d2t, t2d = build_vocab_map(Counter({t: 1 for t in range(40, 56)}), vocab, 16)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    save_drafter(draft, path)
    return path


@pytest.fixture
def drafter(tmp_path, tiny_target_dir) -> Path:
    return tiny_drafter(tmp_path / "drafter", json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"])


def users_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(USERS)
    return path


def users_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine\n")
    return path


def snapshot(path: Path) -> dict:
    """Every file under `path` (or `path` itself) with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    return rc, capsys.readouterr().err


def refused(rc: int, err: str, command: str, path: Path, what: str, there: str, option: str) -> None:
    assert rc == 1, err
    assert err == (f"eagle3ops {command}: error: {path} exists and is not {what} ({there}): choose another {option} "
                   f"or remove it\n"), err


def no_leftovers(directory: Path) -> None:
    assert not [p for p in directory.rglob("*") if p.name.endswith((".partial", ".tmp"))]


# ------------------------------------------------------------------------------------------------- export OUT

def export(drafter: Path, out: Path, target: Path, capsys) -> tuple[int, str]:
    return cli(["export", str(drafter), str(out), "--format", "speculators", "--target", str(target)], capsys)


@pytest.mark.parametrize("there", ["file", "directory"])
def test_export_refuses_what_is_not_an_export(tmp_path, drafter, tiny_target_dir, capsys, there):
    out = users_file(tmp_path / "out") if there == "file" else users_dir(tmp_path / "out")
    before = snapshot(out)
    rc, err = export(drafter, out, tiny_target_dir, capsys)
    refused(rc, err, "export", out, "an export written by eagle3ops",
            "it is a file of 16 bytes" if there == "file" else "it holds notes.txt", "OUT")
    assert snapshot(out) == before
    no_leftovers(tmp_path)


def test_export_replaces_a_previous_export_and_writes_into_nothing_or_an_empty_directory(
        tmp_path, drafter, tiny_target_dir, capsys):
    out = tmp_path / "out"
    assert export(drafter, out, tiny_target_dir, capsys)[0] == 0  # nothing there
    (out / "stale.bin").write_bytes(b"from the last export")  # part of that export, as far as anyone can tell
    assert export(drafter, out, tiny_target_dir, capsys)[0] == 0
    assert (out / fs.EXPORT.marker).is_file() and not (out / "stale.bin").exists()
    (tmp_path / "empty").mkdir()
    assert export(drafter, tmp_path / "empty", tiny_target_dir, capsys)[0] == 0
    assert (tmp_path / "empty" / "config.json").is_file()


def test_what_appears_at_the_path_while_an_output_is_written_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(fs.NotOursError, match="it holds notes.txt"), fs.atomic_dir(out, fs.EXPORT) as written:
        (written / fs.EXPORT.marker).write_text("{}")
        users_dir(out)  # the user, meanwhile
    with pytest.raises(fs.NotOursError, match="it is a file of 16 bytes"):
        with fs.atomic_path(tmp_path / "report.json", fs.COMPAT_REPORT) as written:
            written.write_text("{}")
            users_file(tmp_path / "report.json")
    assert snapshot(out) == {"notes.txt": b"mine\n"} and (tmp_path / "report.json").read_bytes() == USERS
    no_leftovers(tmp_path)


def test_the_export_stage_replaces_its_own_output_whatever_it_holds(tmp_path):
    """A stage's output (dvc.yaml outs) is DVC's: the stage writes it without a kind and replaces what is there."""
    users_dir(tmp_path / "models" / "export")
    with fs.atomic_dir(tmp_path / "models" / "export") as out:
        (out / "sglang").mkdir()
    assert [p.name for p in (tmp_path / "models" / "export").iterdir()] == ["sglang"]


# ---------------------------------------------------------------------------------------- import-drafter SRC OUT

@pytest.mark.parametrize("there", ["file", "directory", "another drafter"])
def test_import_drafter_refuses_what_it_did_not_write(tmp_path, drafter, capsys, there):
    out = tmp_path / "out"
    if there == "file":
        users_file(out)
    elif there == "directory":
        users_dir(out)
    else:  # a drafter of the user's (trained here, not imported): not import-drafter's to replace
        tiny_drafter(out, 302)
    before = snapshot(out)
    rc, err = cli(["import-drafter", str(drafter), str(out)], capsys)
    shown = {"file": "it is a file of 16 bytes", "directory": "it holds notes.txt",
             "another drafter": "it holds config.json, model.safetensors"}[there]
    refused(rc, err, "import-drafter", out, "a drafter written by eagle3ops import-drafter", shown, "OUT")
    assert snapshot(out) == before
    no_leftovers(tmp_path)


def test_import_drafter_replaces_what_it_imported_before(tmp_path, drafter, capsys):
    out = tmp_path / "imported"
    assert cli(["import-drafter", str(drafter), str(out)], capsys)[0] == 0
    assert json.loads((out / fs.IMPORTED_DRAFTER.marker).read_text())["source"] == str(drafter)
    (out / "stale.bin").write_bytes(b"x")
    assert cli(["import-drafter", str(drafter), str(out)], capsys)[0] == 0
    assert not (out / "stale.bin").exists() and (out / "model.safetensors").is_file()
    (tmp_path / "empty").mkdir()
    assert cli(["import-drafter", str(drafter), str(tmp_path / "empty")], capsys)[0] == 0


# ----------------------------------------------------------------------------------------------- compare --out

@pytest.fixture
def comparison(monkeypatch):
    """compare's writer with a table and a plot of no runs: what is tested is where it writes."""
    from eagle3ops.runs import compare

    monkeypatch.setattr(compare, "markdown", lambda records: "# compared\n")
    monkeypatch.setattr(compare, "side_by_side", lambda records: pd.DataFrame({"a": [1]}))
    monkeypatch.setattr(compare, "differing_params", lambda records: pd.DataFrame({"b": [2]}))
    monkeypatch.setattr(compare, "plot", lambda records, path: Path(path).write_bytes(b"png"))
    return compare.write_report


@pytest.mark.parametrize("there", ["file", "directory"])
def test_compare_refuses_what_is_not_a_comparison(tmp_path, comparison, monkeypatch, capsys, there):
    from eagle3ops.runs import compare

    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(compare, "select_pipelines", lambda *args: ["a run"])
    out = users_file(tmp_path / "cmp") if there == "file" else users_dir(tmp_path / "cmp")
    before = snapshot(out)
    rc, err = cli(["compare", "--out", str(out)], capsys)
    refused(rc, err, "compare", out, "a comparison written by eagle3ops compare",
            "it is a file of 16 bytes" if there == "file" else "it holds notes.txt", "--out")
    assert snapshot(out) == before
    no_leftovers(tmp_path)


def test_compare_replaces_a_previous_comparison(tmp_path, comparison):
    out = tmp_path / "comparisons"
    out.mkdir()
    (out / "compare.md").write_text("# an older comparison\n")  # as compare wrote it before it wrote atomically
    (out / "compare.png").write_bytes(b"older")
    assert comparison([], out) == "# compared\n"
    assert {p.name for p in out.iterdir()} == {"compare.md", "compare.csv", "params.csv", "compare.png"}
    assert (out / "compare.md").read_text() == "# compared\n" and (out / "compare.png").read_bytes() == b"png"
    comparison([], tmp_path / "new" / "cmp")
    assert (tmp_path / "new" / "cmp" / "compare.md").is_file()


# ----------------------------------------------------------------------------------------------- project --out

def projection(checked: bool):
    return SimpleNamespace(check=object() if checked else None)


@pytest.fixture
def plotted(monkeypatch):
    from eagle3ops.runs import projection_report

    def plot(projection, path):
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(1, 1))
        fig.savefig(path, dpi=10)
        plt.close(fig)
    monkeypatch.setattr(projection_report, "plot_check", plot)
    return projection_report.write_report


def test_project_refuses_what_is_not_a_projection(tmp_path, plotted):
    out = users_file(tmp_path / "projection.md")
    with pytest.raises(fs.NotOursError) as raised:
        plotted(projection(False), "# Projection of pipeline run p (1) to 9 samples\n", out)
    assert str(raised.value) == (f"{out} exists and is not a projection written by eagle3ops project (it is a file "
                                 f"of 16 bytes): choose another --out or remove it")
    assert out.read_bytes() == USERS
    # the plot beside it is checked before the report is written
    out = tmp_path / "checked.md"
    users_file(out.with_suffix(".png"))
    with pytest.raises(fs.NotOursError, match="checked.png exists and is not a plot written by eagle3ops"):
        plotted(projection(True), "# Projection of pipeline run p (1) to 9 samples\n", out)
    assert not out.exists() and out.with_suffix(".png").read_bytes() == USERS
    no_leftovers(tmp_path)


def test_project_replaces_its_previous_report_and_plot(tmp_path, plotted):
    out = tmp_path / "projection.md"
    plotted(projection(True), "# Projection of pipeline run a (1) to 9 samples\n", out)
    plotted(projection(True), "# Projection of pipeline run b (2) to 9 samples\n", out)
    assert out.read_text() == "# Projection of pipeline run b (2) to 9 samples\n\n"
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


# ------------------------------------------------------------------------------------------------- bench --out

def test_bench_refuses_what_it_did_not_write_before_measuring(tmp_path, monkeypatch, capsys):
    from eagle3ops.benchmark import run

    monkeypatch.setattr(run, "run_bench", lambda *args: pytest.fail("measured before checking --out"))
    out = users_file(tmp_path / "bench.json")
    rc, err = cli(["bench", "--out", str(out), "--parts", "train"], capsys)
    refused(rc, err, "bench", out, "a result written by eagle3ops bench", "it is a file of 16 bytes", "--out")
    users_dir(tmp_path / "b.md")  # the table beside it
    rc, err = cli(["bench", "--out", str(tmp_path / "b.json"), "--parts", "train"], capsys)
    refused(rc, err, "bench", tmp_path / "b.md", "a table written by eagle3ops bench",
            "it is a directory holding notes.txt", "--out")
    assert out.read_bytes() == USERS and not (tmp_path / "b.json").exists()


def test_bench_replaces_its_previous_result(tmp_path, monkeypatch):
    from eagle3ops.benchmark import report

    monkeypatch.setattr(report, "render", lambda result: f"# eagle3ops bench: {result['size']} on cpu")
    monkeypatch.setattr(report, "plot", lambda results, path: pytest.fail("no plot of a result without training"))
    out = tmp_path / "bench.json"
    report.write_result({"size": "tiny", "device": "cpu", "torch": "2"}, out)
    report.write_result({"size": "8b", "device": "cpu", "torch": "2"}, out)
    assert json.loads(out.read_text())["size"] == "8b" and out.with_suffix(".md").read_text().startswith(
        "# eagle3ops bench: 8b")
    users_file(out.with_suffix(".md"))
    with pytest.raises(fs.NotOursError, match="bench.md exists and is not a table written by eagle3ops bench"):
        report.write_result({"size": "tiny", "device": "cpu", "torch": "3"}, out)
    assert json.loads(out.read_text())["size"] == "8b"  # nothing written: the table is checked before the JSON


# ------------------------------------------------------------------------------------- the --json of the tools

def test_check_compat_json_replaces_its_own_report_only(tmp_path, drafter, tiny_target_dir, capsys):
    out = tmp_path / "compat.json"
    argv = ["check-compat", str(tiny_target_dir), str(drafter), "--json", str(out)]
    assert cli(argv, capsys)[0] == 0
    assert cli(argv, capsys)[0] == 0 and json.loads(out.read_text())["verdict"] == "compatible"
    users_file(out)
    refused(*cli(argv, capsys), "check-compat", out, "a report written by eagle3ops check-compat",
            "it is a file of 16 bytes", "--json")
    out.write_text(json.dumps({"ok": True, "directory": "x", "fmt": "sglang", "target": "t", "errors": []}))
    rc, err = cli(argv, capsys)  # validate-export's report: another command's
    assert rc == 1 and "is not a report written by eagle3ops check-compat" in err
    assert json.loads(out.read_text())["ok"] is True


def test_validate_export_json_refused_before_validating(tmp_path, drafter, tiny_target_dir, capsys, monkeypatch):
    spec = tmp_path / "spec"
    assert export(drafter, spec, tiny_target_dir, capsys)[0] == 0
    out = tmp_path / "report.json"
    argv = ["validate-export", str(spec), "--target", str(tiny_target_dir), "--json", str(out)]
    assert cli(argv, capsys)[0] == 0 and cli(argv, capsys)[0] == 0  # written, then replaced
    assert json.loads(out.read_text())["ok"] is True
    users_file(out)
    from eagle3ops.formats import validate

    monkeypatch.setattr(validate, "validate_export", lambda *args, **kwargs: pytest.fail("validated first"))
    refused(*cli(argv, capsys), "validate-export", out, "a report written by eagle3ops validate-export",
            "it is a file of 16 bytes", "--json")
    assert out.read_bytes() == USERS


def test_reproduce_json_refused_before_the_pipeline_runs_again(tmp_path, monkeypatch, capsys):
    from eagle3ops.runs import reproduce

    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(reproduce, "reproduce", lambda *args, **kwargs: pytest.fail("ran before checking --json"))
    out = users_file(tmp_path / "reproduced.json")
    refused(*cli(["reproduce", "run-id", "--json", str(out)], capsys), "reproduce", out,
            "a report written by eagle3ops reproduce", "it is a file of 16 bytes", "--json")
    assert out.read_bytes() == USERS
    earlier = tmp_path / "earlier.json"  # what an earlier reproduce --json wrote is its to replace
    earlier.write_text(reproduce.as_json(SimpleNamespace(outputs={"data": "same"}, metrics={})))
    fs.check_output(earlier, fs.REPRODUCTION)
