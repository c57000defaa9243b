"""The README's two commands are the ones the project actually runs."""
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [block.split("```")[0].strip() for block in blocks]


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [commands()[1]]


def test_first_command_sets_up_and_runs_the_pipeline():
    steps = [step.strip() for step in commands()[0].split(" && ")]
    assert steps[:3] == ["bash setup.sh", ". .venv/bin/activate", "dvc repro"]
    assert steps[3] == "git add -A" and steps[4].endswith('git commit -qm "Results of the embedded default"')
    report = yaml.safe_load((ROOT / "params.yaml").read_text())["report"]["out_dir"]
    assert steps[5:] == [f"cat {report}/summary.md"]  # the report stage's output, the last stage dvc repro runs
    assert "${report.out_dir}" in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["report"]["outs"][0]
    setup = (ROOT / "setup.sh").read_text()  # the CPU torch first, then vLLM's CPU build, then nothing that breaks it
    assert setup.index("pip install -q torch==2.13.0") < setup.index('pip install -q -e ".[$engine')
    assert "pip uninstall -q -y torchvision torchaudio torchcodec" in setup
