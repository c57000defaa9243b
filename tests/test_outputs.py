"""Nothing of the user's is lost: an output at a path the user names replaces only a previous output of its own
kind (anything else there is refused in one line, nothing changed); a full disk or a place that cannot be written
is one line naming the path, and the train stage finds an unwritable place before it trains."""
from __future__ import annotations

import errno
import json
import os
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import yaml

from eagle3ops import fs
from eagle3ops.cli import main
from eagle3ops.data.vocab import build_vocab_map
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.resume import ResumePoint
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
    earlier.write_text(reproduce.as_json(reproduce.Reproduction(
        [{"path": "data", "kind": "result", "identical": True}], [], tmp_path,
        reproduce.Expectation(True, "the same CPU model"), [])))
    fs.check_output(earlier, fs.REPRODUCTION)


# ------------------------------------------------------------------------------------------------ a full disk

TORCH_SHORT_WRITE = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
SAFETENSORS_FULL = Exception("Error while serializing: I/O error: No space left on device (os error 28)")


def disk_full(message: str, start: str, then: str) -> None:
    """`message` is "START (N MiB free); THEN" (N: the space left, which other writers on this disk move)."""
    assert re.fullmatch(re.escape(start) + r" \(\d+ MiB free\); " + re.escape(then), message), message


def failing_save(error: BaseException, after: int = 0):
    """torch.save that writes `after` states whole, then part of the next before the disk fills up."""
    real, calls = torch.save, []

    def save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) <= after:
            return real(obj, path, *args, **kwargs)
        Path(path).write_bytes(b"PK\x03\x04 half a state")
        raise error
    return save


@pytest.mark.parametrize("error", [TORCH_SHORT_WRITE, OSError(errno.ENOSPC, "No space left on device")],
                         ids=["torch", "oserror"])
def test_a_full_disk_while_saving_a_resume_point_keeps_the_last_one(tmp_path, monkeypatch, error):
    point = ResumePoint(tmp_path / ".eagle3ops" / "resume" / "train@scratch-0123.pt")
    monkeypatch.setattr(torch, "save", failing_save(error, after=1))
    point.save({"step": 5})
    with pytest.raises(fs.DiskFullError) as raised:
        point.save({"step": 10})
    disk_full(str(raised.value), f"{point.path}: disk full writing it", "the last resume point is kept: free space "
              "and run again to resume")
    assert point.load() == {"step": 5}
    no_leftovers(tmp_path)


def test_a_full_disk_while_saving_the_trained_drafter_names_its_directory(tmp_path, monkeypatch, tiny_target_dir):
    """The train stage writes the drafter as `atomic_dir(out_dir)` + save_drafter: config.json, the safetensors
    (safetensors' own error) and training_state.pt (torch's)."""
    from eagle3ops.formats import specforge

    out = tmp_path / "models" / "drafters" / "scratch"
    draft = Eagle3Draft(DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=1,
                                    num_key_value_heads=1, vocab_size=302, draft_vocab_size=16,
                                    target_hidden_size=32))
    for patch in ((specforge, "save_file", lambda *args, **kwargs: (_ for _ in ()).throw(SAFETENSORS_FULL)),
                  (torch, "save", failing_save(TORCH_SHORT_WRITE))):
        with monkeypatch.context() as patched:
            patched.setattr(*patch)
            with pytest.raises(fs.DiskFullError) as raised, fs.atomic_dir(out) as tmp:
                save_drafter(draft, tmp, {"step": 60})
        disk_full(str(raised.value), f"{out}: disk full writing it",
                  "what was there before is kept: free space and run again")
        assert not out.exists()
        no_leftovers(tmp_path)


# -------------------------------------------------------------------------------- the train stage, before work

def write_train_params(root: Path, target: Path, **train) -> Path:
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump({"target": {"path": str(target), "aux_layers": [1, 2, 3]},
                                      "train": train,
                                      "mlflow": {"system_metrics": False, "registered_model": None}}))
    return params


@pytest.mark.parametrize("unwritable", ["train.out_dir", "resume"])
def test_train_refuses_a_place_it_cannot_write_before_it_loads_anything(tmp_path, monkeypatch, capsys,
                                                                        tiny_target_dir, unwritable):
    """A path under a regular file cannot be written, by root too (chmod does not stop root)."""
    from eagle3ops.stages import train

    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(train, "load_inputs", lambda *args: pytest.fail("loaded before probing the outputs"))
    users_file(tmp_path / "blocker")
    if unwritable == "resume":
        users_file(tmp_path / ".eagle3ops")  # a file where the resume points' directory goes
        params, place, base = write_train_params(tmp_path, tiny_target_dir), ".eagle3ops/resume", ".eagle3ops"
    else:
        params = write_train_params(tmp_path, tiny_target_dir, out_dir="blocker/drafters")
        place, base = "blocker/drafters", "blocker"
    rc, err = cli(["train", "--init", "scratch", "--params", str(params)], capsys)
    assert rc == 1 and err == (f"eagle3ops train@scratch: error: {place}: cannot write there "
                               f"({tmp_path / base} is a file, not a directory)\n"), err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory: chmod stops only others")
def test_train_refuses_a_read_only_output_directory_before_it_loads_anything(tmp_path, monkeypatch, capsys,
                                                                           tiny_target_dir):
    from eagle3ops.stages import train

    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(train, "load_inputs", lambda *args: pytest.fail("loaded before probing the outputs"))
    (tmp_path / "shelf").mkdir(mode=0o555)
    params = write_train_params(tmp_path, tiny_target_dir, out_dir="shelf/drafters")
    rc, err = cli(["train", "--init", "scratch", "--params", str(params)], capsys)
    assert rc == 1 and "shelf/drafters: cannot write there (Permission denied" in err, err


def fails(code: int):
    def call(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return call


def test_the_probe_says_a_full_disk_and_a_read_only_place(tmp_path, monkeypatch):
    """What root cannot make happen without mounting: the probe file failing as the kernel fails it."""
    place = tmp_path / "out"
    with monkeypatch.context() as patched:
        patched.setattr(os, "fsync", fails(errno.ENOSPC))
        with pytest.raises(fs.DiskFullError) as full:
            fs.probe_writable(place)
    disk_full(str(full.value), f"{place}: disk full writing a probe file", "free space and run again")
    monkeypatch.setattr(fs.tempfile, "TemporaryFile", fails(errno.EROFS))
    with pytest.raises(fs.NotWritableError) as read_only:
        fs.probe_writable(place)
    assert str(read_only.value) == f"{place}: cannot write there (Read-only file system: {tmp_path})"
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------- the train stage, disk full

@pytest.fixture
def train_workdir(tmp_path, monkeypatch, tiny_target_dir) -> Path:
    """A prepared dataset for the tiny target and params that train on it online (the target beside the drafter:
    no extract stage): 5 steps, a resume point after steps 2 and 4."""
    from eagle3ops.data.prepare import write_tokenized
    from eagle3ops.data.vocab import count_masked_tokens, write_vocab_map

    isolate(monkeypatch, tmp_path)
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 30), ("eval", 2)):
        write_tokenized([{"id": f"{split}-{i}", "input_ids": torch.randint(0, 200, (40,), generator=generator).tolist(),
                          "loss_mask": [1] * 40} for i in range(count)], tmp_path / "data" / "prepared" / split,
                        {"split": split})
    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    write_vocab_map(tmp_path / "data" / "prepared", *build_vocab_map(count_masked_tokens([([1, 2], [1, 1])]), vocab,
                                                                      32))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "target": {"path": str(tiny_target_dir), "aux_layers": [1, 2, 3]},
        "train": {"hidden_states": "online", "epochs": 1, "batch_size": 2, "packed_length": 128, "ttt_steps": 2,
                  "checkpoint_every": 2, "log_every": 2, "simulate": {"every": 0}},
        "pipeline": {"extract": [], "hidden_states_dep": "data/prepared"},
        "mlflow": {"system_metrics": False, "registered_model": None}}))
    return tmp_path


def error_line(err: str, command: str) -> str:
    """The error line main printed (after the progress bar, which an error leaves without its newline)."""
    assert err.count(f"eagle3ops {command}: error: ") == 1 and "Traceback" not in err, err
    return err[err.index(f"eagle3ops {command}: error: "):].rstrip("\n")


@pytest.mark.heavy  # two runs of the train stage, in this process (about 30 s)
def test_train_stage_disk_full_at_a_resume_point_then_at_the_drafter(train_workdir, monkeypatch, capsys):
    with monkeypatch.context() as full:
        full.setattr(torch, "save", failing_save(TORCH_SHORT_WRITE, after=1))  # the 2nd resume point fills it
        rc, err = cli(["train", "--init", "scratch"], capsys)
    point = next(Path(".eagle3ops/resume").glob("train@scratch-*.pt"))
    assert rc == 1
    disk_full(error_line(err, "train@scratch"), f"eagle3ops train@scratch: error: {point}: disk full writing it",
              "the last resume point is kept: free space and run again to resume")
    assert ResumePoint(point).load()["step"] == 2
    no_leftovers(train_workdir)

    from eagle3ops.formats import specforge  # room again, until the drafter is written

    monkeypatch.setattr(specforge, "save_file", lambda *args, **kwargs: (_ for _ in ()).throw(SAFETENSORS_FULL))
    rc, err = cli(["train", "--init", "scratch"], capsys)
    out = Path("models") / "drafters" / "scratch"
    assert rc == 1
    disk_full(error_line(err, "train@scratch"), f"eagle3ops train@scratch: error: {out}: disk full writing it",
              "what was there before is kept: free space and run again")
    assert ResumePoint(point).load()["step"] == 4 and not out.exists()  # resumed at 2; the resume point at 4 is kept
    no_leftovers(train_workdir)


def test_a_full_disk_in_a_nested_write_names_the_output_not_its_temporary_directory(tmp_path):
    """export writes each format with its own atomic write inside the export's: the message names the export."""
    out = tmp_path / "export"
    with pytest.raises(fs.DiskFullError) as raised, fs.atomic_dir(out) as tmp, fs.atomic_dir(tmp / "sglang"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(raised.value).startswith(f"{out}: disk full writing it (") and ".partial" not in str(raised.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []
