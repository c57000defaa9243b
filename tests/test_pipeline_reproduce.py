"""`eagle3ops reproduce`: a pipeline run recorded in MLflow, re-run from its commit in a fresh clone, gives the same
file hashes and the same tau. On a copy of the built micro pipeline (the built_pipeline fixture); the re-run is a
whole pipeline of its own (about 4 minutes on 2 cores beside the other worker; vLLM found running in the run's
engine sessions)."""
import json
from pathlib import Path

import pytest

from eagle3ops.tracking import hardware
from helpers import RECORDED, copy_workspace, pipelines, run

pytestmark = [pytest.mark.pipeline, pytest.mark.service]


@pytest.fixture(scope="module")
def repo(built_pipeline, tmp_path_factory) -> Path:
    """A copy of the built pipeline, which the reproduction adds a pipeline run to."""
    return copy_workspace(built_pipeline[0], tmp_path_factory.mktemp("pipeline") / "repo")


def test_reproduce_gives_identical_hashes(repo):
    (first,) = pipelines(repo)
    uri = f"sqlite:///{repo / 'mlflow.db'}"
    output = run(["eagle3ops", "reproduce", first.run_id, "--tracking-uri", uri, "--json", "reproduced.json"], repo)
    result = json.loads((repo / "reproduced.json").read_text())
    # recorded and reproduced on this CPU with the kernels pinned: the bytes are expected, and came back
    assert result["expected"]["same_bytes"] and result["as_expected"], output
    why = ("CPU kernels pinned to AVX2 (cpu_reproducible)" if "Intel" in hardware.fingerprint()["cpu_model"]
           else "the same CPU model")  # MKL ignores the pin on an AMD CPU: its model alone promises the bytes
    assert f"expected: the same bytes: {why}" in output, output
    assert all(row["inside"] for row in result["taus"]) and len(result["taus"]) == 3
    data_and_models = [o for o in result["outputs"] if o["kind"] == "result"]
    # the zoo's two, generated, prepared, features, two drafters, the export, and two plots of each drafter
    assert len(data_and_models) == 12 and all(o["identical"] for o in data_and_models), output
    taus = [m for m in result["metrics"] if m["metric"] == "tau"]
    assert len(taus) == 3 and all(m["delta"] == 0 for m in taus)
    rerun = next(p for p in pipelines(repo) if p.tags.get("eagle3ops.reproduces") == first.run_id)
    assert sorted(rerun.stages) == RECORDED

