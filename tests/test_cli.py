"""The command line: one table of commands, stages imported by name, one exit-code policy, `--help` and
`--version` from a source tree. Fast: no stage runs, no server starts."""
from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3ops import cli
from eagle3ops.config import ConfigError
from eagle3ops.errors import InputError, UsageError
from eagle3ops.training.compat import EXIT_CODES as VERDICT_CODES

SRC = Path(__file__).resolve().parents[1] / "src" / "eagle3ops"
STAGE_MODULES = {path.stem for path in (SRC / "stages").glob("*.py") if path.stem not in ("__init__", "runner")}


def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """main(argv) for the commands argparse ends itself (--help, --version, usage errors)."""
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    out, err = capsys.readouterr()
    return ended.value.code or 0, out, err


def test_each_stage_is_a_command_that_imports_its_module_by_name():
    """One hop from the command to the stage: the runner's table imports each module by name."""
    runner = SRC / "stages" / "runner.py"
    imported = {alias.name for node in ast.walk(ast.parse(runner.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module == "eagle3ops.stages" for alias in node.names}
    assert imported == STAGE_MODULES
    assert {command.name for command in cli.COMMANDS if command.stage} == STAGE_MODULES
    assert "import_module" not in runner.read_text() + (SRC / "cli.py").read_text()
    assert not [node for node in ast.walk(ast.parse((SRC / "cli.py").read_text()))
                if isinstance(node, ast.ImportFrom) and node.module == "eagle3ops.stages"]  # no stage logic in cli


def test_argparse_only_in_the_cli():
    users = sorted(str(path.relative_to(SRC)) for path in SRC.rglob("*.py")
                   if any(isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names)
                          for node in ast.walk(ast.parse(path.read_text()))))
    assert users == ["cli.py"]


def test_help_lists_every_command_grouped_and_the_exit_codes(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    stages, tools = out.index("pipeline stages"), out.index("tools:")
    codes = out.index("exit codes:")
    for command in cli.COMMANDS:
        at = out.index(f"\n  {command.name} ")
        assert (stages < at < tools) if command.stage else (tools < at < codes), command.name
    for number in cli.EXIT_CODES:
        assert f"\n  {number}  " in out[codes:]
    for verdict, number in VERDICT_CODES.items():  # check-compat's verdicts are in the policy
        assert number == 0 or verdict in cli.EXIT_CODES[number]


@pytest.mark.parametrize("command", [command.name for command in cli.COMMANDS])
def test_each_command_has_its_help(command, capsys):
    code, out, _ = run_main([command, "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: eagle3ops {command}")


@pytest.mark.parametrize("columns", [80, 100])
def test_help_wraps_to_the_terminal(columns, monkeypatch, capsys):
    """Every line of every help fits the terminal (COLUMNS, as argparse reads it), the command listing included."""
    monkeypatch.setenv("COLUMNS", str(columns))
    for argv in (["--help"], *([command.name, "--help"] for command in cli.COMMANDS)):
        _, out, _ = run_main(argv, capsys)
        wide = [line for line in out.splitlines() if len(line) > columns]
        assert not wide, (argv, wide)


def test_help_loads_no_stage_and_no_heavy_library():
    loaded = subprocess.run([sys.executable, "-c", "import sys\nfrom eagle3ops.cli import main\ntry:\n    main(['--help'])\n"
                             "except SystemExit:\n    pass\nprint(' '.join(sys.modules))"],
                            capture_output=True, text=True, check=True).stdout.splitlines()[-1].split()
    assert not [name for name in loaded if name.startswith("eagle3ops.stages.") and name != "eagle3ops.stages.runner"
                or name in ("torch", "mlflow")]


def test_the_bench_trains_and_renders_without_mlflow():
    """The GPU machines the bench runs on may have no MLflow: neither its training processes (the train stage's loop
    and compile cache) nor its report module may need it."""
    loaded = subprocess.run([sys.executable, "-c", "import sys\nimport eagle3ops.benchmark.report\n"
                             "import eagle3ops.reporting.summary\nimport eagle3ops.benchmark.varlen\n"
                             "import eagle3ops.benchmark.training\nimport eagle3ops.training.compile_cache\n"
                             "import eagle3ops.training.loop\nprint('mlflow' in sys.modules)"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["False"]


def test_help_and_version_without_package_metadata(monkeypatch, capsys):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert run_main(["--help"], capsys)[0] == 0
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0 and out.startswith("eagle3ops ") and "(source tree)" in out


def test_version_from_the_metadata(capsys):
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0 and out == f"eagle3ops {importlib.metadata.version('eagle3ops')}\n"


@pytest.mark.parametrize("argv", [["nonsense"], [], ["train"], ["compare", "--last", "many"]])
def test_usage_errors_exit_2(argv, capsys):
    code, _, err = run_main(argv, capsys)
    assert code == 2 and "error:" in err


def test_errors_map_to_the_policy():
    assert cli.exit_code(InputError("x")) == 1
    assert cli.exit_code(ConfigError("params.yaml: key 'train.lr': x")) == 2
    assert cli.exit_code(UsageError("--filter: x")) == 2


def test_a_tool_error_is_one_line_with_its_code(tmp_path, capsys):
    assert cli.main(["import-drafter", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("eagle3ops import-drafter: error: ") and len(err.strip().splitlines()) == 1


def test_export_without_drafter_is_the_stage_and_half_the_tool_is_refused(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), str(tmp_path / "out"), "--format", "sglang"]) == 1
    assert "give DRAFTER OUT --format F --target TARGET_DIR" in capsys.readouterr().err
    args = cli.parser().parse_args(["export"])
    assert args.handler is cli._export and not any((args.source, args.out, args.format, args.target))


def test_tracking_server_options_from_the_command_line(tmp_path):
    from eagle3ops.tracking.server import ServerOptions

    args = cli.parser().parse_args(["tracking-server", "--state-dir", str(tmp_path), "--port", "5055",
                                    "--", "--allowed-hosts", "mlflow.example.com"])
    assert cli._server_options(args) == ServerOptions(state_dir=tmp_path, port=5055,
                                                      mlflow_args=("--allowed-hosts", "mlflow.example.com"))
    assert cli._server_options(cli.parser().parse_args(["tracking-server"])) == ServerOptions()
