"""The README's two commands are the ones the project actually runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [block.split("```")[0].strip() for block in blocks]


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [commands()[1]]


def test_first_command_sets_up_and_runs_the_pipeline():
    first = commands()[0]
    assert first.startswith("bash setup.sh && . .venv/bin/activate && ") and "dvc repro" in first
    setup = (ROOT / "setup.sh").read_text()  # the CPU torch first, then vLLM's CPU build, then nothing that breaks it
    assert setup.index("pip install -q torch==2.13.0") < setup.index('pip install -q -e ".[$engine')
    assert "pip uninstall -q -y torchvision torchaudio torchcodec" in setup
