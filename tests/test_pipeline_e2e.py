"""The whole lineage under DVC on a micro config, in a temporary git repository.

Checks what users rely on: `dvc repro` builds everything; a second run does nothing; changing `train.lr`
re-runs only train, the evals of trained drafters and the report; the same params give the same checkpoint
hash; every stage run is in MLflow, grouped under one parent per pipeline run, with its lineage tags.
"""
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import Request, urlopen

import dvc.api
import pandas as pd
import pytest
import torch
import yaml
from mlflow import MlflowClient
from safetensors.torch import load_file, save_file

from eagle3ops.config import EvalDrafter
from eagle3ops.decoding.engines import vllm_counters
from eagle3ops.formats.export import export_drafter
from eagle3ops.reporting.summary import COLORS
from eagle3ops.runs.records import find_pipelines
from eagle3ops.serving.server import free_port
from helpers import ROOT, command_env, commit, micro_pipeline_repo, ran_stages, run, wait_for_http, write_params

ALL_STAGES = ["zoo", "generate", "prepare", "extract@offline", "train@scratch", "train@warm_start", "eval@baseline",
              "eval@scratch", "eval@warm_start", "export", "report"]  # as DVC names them
RECORDED = sorted(stage.removesuffix("@offline") for stage in ALL_STAGES)  # as the MLflow records name them

pytestmark = [pytest.mark.pipeline, pytest.mark.service]


def lock_md5(repo: Path, stage: str, path: str) -> str:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][stage]
    return next(out["md5"] for out in lock["outs"] if out["path"] == path)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return micro_pipeline_repo(tmp_path_factory.mktemp("pipeline"))


def client(repo: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")


def pipelines(repo: Path) -> list:
    return find_pipelines(client(repo))  # newest first


@pytest.fixture(scope="module")
def first_run(repo) -> str:
    """The README's first command: `dvc repro`, then its results committed as the baseline."""
    output = run(["dvc", "repro"], repo)
    commit(repo, "Results of the embedded default")
    return output


def test_repro_builds_every_stage(repo, first_run):
    assert ran_stages(first_run) == ALL_STAGES
    for drafter in ("baseline", "scratch", "warm_start"):
        metrics = json.loads((repo / "metrics" / f"eval-{drafter}.json").read_text())
        assert metrics["lossless"] is True, metrics["mismatched_prompts"]
        assert 1.0 <= metrics["tau"] <= 4.0 and sorted(k for k in metrics if k.startswith("accept_")) == [
            "accept_1", "accept_2", "accept_3"]
        assert metrics["verify_steps"] > 0
        # measured on vLLM too, in greedy float32: the engine's counters give the decoder's figures, and every
        # prompt's output is the target's
        served = metrics["vllm"]
        assert abs(served["tau"] - metrics["tau"]) <= 0.1 and served["version"].startswith("0.32.0")
        assert all(abs(served[f"accept_{i}"] - metrics[f"accept_{i}"]) <= 0.1 for i in (1, 2, 3))
        assert served["greedy_equal_prompts"] == metrics["prompts"]
        assert served["tokens_per_s"] > 0 and served["hardware"].startswith("cpu-") and served["concurrency"] == 8
        # the target alone, measured once a pipeline (a server loads the whole target): with the baseline
        assert ("target_alone_tokens_per_s" in served) == (drafter == "baseline")
    alone = json.loads((repo / "metrics" / "eval-baseline.json").read_text())["vllm"]["target_alone_tokens_per_s"]
    assert alone > 0
    checkpoint = repo / "models" / "drafters" / "scratch"
    assert {"config.json", "model.safetensors", "training_state.pt"} <= {p.name for p in checkpoint.iterdir()}
    manifest = json.loads((repo / "data" / "features" / "train" / "manifest.json").read_text())
    assert manifest["aux_layers"] == [2, 4, 5] and manifest["samples"] > 0
    summary = (repo / "reports" / "summary.md").read_text()
    assert "warm_start" in summary and "baseline" in summary and "mlflow ui" in summary
    assert str(repo) not in summary and "--backend-store-uri sqlite:///mlflow.db` in the repository" in summary
    assert "## Served on vLLM" in summary and "tok/s target alone" in summary
    headline = json.loads((repo / "metrics.json").read_text())
    assert set(headline["tau_vllm"]) == set(headline["speedup_vllm"]) == {"baseline", "scratch", "warm_start"}
    export = json.loads((repo / "metrics" / "export.json").read_text())
    assert export["served_drafts"] > 0  # vLLM drafted with the export's weights
    # engine sessions: the baseline's eval started the two engines (the target with a drafter, the target alone);
    # the other evals and the export found the first and swapped their drafters in
    starts = {d: json.loads((repo / "metrics" / f"eval-{d}.json").read_text())["vllm"]["engine_starts"]
              for d in ("baseline", "scratch", "warm_start")}
    assert starts == {"baseline": 2, "scratch": 0, "warm_start": 0} and export["engine_started"] == 0
    assert (repo / "reports" / "comparison.png").stat().st_size > 10_000


def test_second_repro_is_a_no_op(repo, first_run):
    output = run(["dvc", "repro"], repo)
    assert ran_stages(output) == []
    assert "Data and pipelines are up to date" in run(["dvc", "status"], repo)


def test_each_warm_start_key_makes_only_the_warm_start_chain_stale(repo, first_run):
    """Each key train@scratch does not read, changed alone: `dvc status` names train@warm_start (and, for the
    predecessor's drafter, eval@baseline, which measures it), never train@scratch: a warm-start experiment re-trains
    nothing else."""
    shutil.copytree(repo / "models" / "zoo" / "predecessor-drafter", repo / "other-drafter")
    changes = ["train.warm_start_vocab=keep", "train.warm_start_optimizer=true", "train.warm_start_min_coverage=0.5",
               "train.warm_start=other-drafter"]
    try:
        for change in changes:
            write_params(repo, [change])
            stale = set(json.loads(run(["dvc", "status", "--json"], repo)))
            expected = {"train@warm_start", "eval@baseline"} if change.startswith("train.warm_start=") else {
                "train@warm_start"}
            assert stale == expected, (change, stale)
        write_params(repo, ["train.lr=0.001"])  # a key both read: both stale
        assert set(json.loads(run(["dvc", "status", "--json"], repo))) == {"train@scratch", "train@warm_start"}
    finally:
        write_params(repo, [])
        shutil.rmtree(repo / "other-drafter")
    assert "Data and pipelines are up to date" in run(["dvc", "status"], repo)


def test_an_edit_to_a_stage_module_makes_the_stage_stale(repo, first_run):
    module = repo / "src" / "eagle3ops" / "stages" / "train.py"
    original = module.read_text()
    module.write_text(original + "\n# an edit\n")
    try:
        status = run(["dvc", "status", "train@scratch", "eval@baseline"], repo)
    finally:
        module.write_text(original)
    assert "train@scratch:" in status and "modified:           src/eagle3ops/stages/train.py" in status, status
    assert "eval@baseline" not in status  # it runs no code of the train stage
    assert "Data and pipelines are up to date" in run(["dvc", "status"], repo)


def test_stage_runs_are_in_mlflow_with_lineage(repo, first_run):
    (first,) = pipelines(repo)
    assert sorted(first.stages) == RECORDED
    assert not any(stage.cached for stage in first.stages.values())
    store = client(repo)
    train = store.get_run(first.stages["train@scratch"].run_id)
    assert train.info.status == "FINISHED"
    assert train.data.params["train.lr"] == "0.003"
    features_md5 = lock_md5(repo, "extract@offline", "data/features")
    assert train.data.tags["dvc.input.data/features"] == features_md5
    assert features_md5 in {d.dataset.digest for d in train.inputs.dataset_inputs}  # MLflow inputs carry DVC md5s
    assert train.data.tags["hardware.label"] and train.data.tags["hardware.cpu_usable_cores"]
    assert len(store.get_metric_history(train.info.run_id, "train/loss")) >= 3
    assert len(train.outputs.model_outputs) == 1  # its drafter, as a logged model
    parent = store.get_run(first.run_id)
    for drafter in ("baseline", "scratch", "warm_start"):
        recorded = json.loads((repo / "metrics" / f"eval-{drafter}.json").read_text())
        assert first.metric(f"eval@{drafter}", "tau") == recorded["tau"]
        # the pipeline run itself shows the headline: tau per drafter and per set, losslessness
        assert parent.data.metrics[f"tau/{drafter}"] == recorded["tau"] and parent.data.metrics[f"lossless/{drafter}"] == 1
        assert all(parent.data.metrics[f"tau/{drafter}/{name}"] == tau for name, tau in recorded["tau_by_set"].items())
        # and tau per drafter per engine, with vLLM's speed-up on this hardware
        assert parent.data.metrics[f"tau_vllm/{drafter}"] == recorded["vllm"]["tau"]
        alone = json.loads((repo / "metrics" / "eval-baseline.json").read_text())["vllm"]["target_alone_tokens_per_s"]
        assert parent.data.metrics[f"speedup_vllm/{drafter}"] == round(recorded["vllm"]["tokens_per_s"] / alone, 3)
    assert parent.data.params["train.lr"] == "0.003" and parent.data.params["overrides"] == "none"
    assert parent.data.tags["mlflow.note.content"].startswith("# eagle3ops report")
    assert json.loads((repo / "metrics.json").read_text())["tau"]["scratch"] == parent.data.metrics["tau/scratch"]
    experiment = store.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on its runs table
    assert {a.path for a in store.list_artifacts(first.run_id, "lineage")} == {
        "lineage/dvc.yaml", "lineage/params.yaml", "lineage/dvc.lock"}


def test_trained_drafters_are_logged_models_registered_with_a_champion(repo, first_run, tmp_path):
    store = client(repo)
    first = pipelines(repo)[-1]
    experiment_id = store.get_experiment_by_name("eagle3ops").experiment_id
    trained_by = {first.stages[f"train@{init}"].run_id: init for init in ("scratch", "warm_start")}
    models = {m.name: m for m in store.search_logged_models([experiment_id]) if m.source_run_id in trained_by}
    assert sorted(models) == ["scratch", "warm_start"]  # the baseline is not ours: no model of it
    for init, model in models.items():
        assert model.model_type == "eagle3-drafter" and model.params["train.lr"] == "0.003"
        assert {f.path for f in store.list_logged_model_artifacts(model.model_id)} == {"config.json",
                                                                                      "model.safetensors"}
        recorded = json.loads((repo / "metrics" / f"eval-{init}.json").read_text())
        linked = {(m.key, m.dataset_name): m.value for m in model.metrics}  # the eval's tau, per set on its set
        assert linked[("tau", None)] == recorded["tau"]
        assert {key: value for (key, dataset), value in linked.items() if dataset} == {
            f"tau/{name}": tau for name, tau in recorded["tau_by_set"].items()}
        assert linked[("vllm/tau", None)] == recorded["vllm"]["tau"]  # the version shows both engines' tau
    versions = store.search_model_versions("name = 'eagle3-drafter'")
    assert sorted(v.source for v in versions) == sorted(f"models:/{m.model_id}" for m in models.values())
    assert all("eagle3ops-zoo/successor" in v.description and "k=3" in v.description for v in versions)
    best = max(versions, key=lambda v: float(v.tags["tau"]))
    assert store.get_model_version_by_alias("eagle3-drafter", "champion").version == best.version
    champion = next(init for init, model in models.items() if best.source == f"models:/{model.model_id}")
    assert first.stages["export"].tags["eagle3ops.export.drafter"] == champion  # export serves the champion
    served = tmp_path / "served"  # and the registry's champion, loaded back by its alias from another directory
    run(["eagle3ops", "export", "models:/eagle3-drafter@champion", str(served), "--format", "sglang",
         "--target", str(repo / "models/zoo/successor")], tmp_path,
        env={"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}"})
    assert {name: tensor.tolist() for name, tensor in load_file(str(served / "model.safetensors")).items()} == {
        name: tensor.tolist() for name, tensor in load_file(str(repo / "models/export/sglang/model.safetensors")).items()}


def test_dvc_shows_tau_and_timings(repo, first_run):
    shown = json.loads(run(["dvc", "metrics", "show", "--json"], repo))
    metrics = next(iter(shown.values()))["data"]
    scratch = metrics["metrics/eval-scratch.json"]["data"]
    assert scratch["tau"] > 1.0 and scratch["time"]["stage_s"] > 0
    assert not any(isinstance(value, str) for file in metrics.values() for value in file["data"].values())
    plots = json.loads(run(["dvc", "plots", "show", "--json"], repo))["data"]

    def drawn(name: str) -> list[dict]:
        return plots[name][0]["content"]["data"]["values"]

    for name, files in (("training loss", "train"), ("training accuracy of the first draft step", "train"),
                        ("simulated acceptance length while training", "sim")):  # scratch and warm_start together
        assert {point["filename"] for point in drawn(name)} == {f"{files}-scratch.csv", f"{files}-warm_start.csv"}
    assert all(float(point["sim/tau"]) >= 1.0 for point in drawn("simulated acceptance length while training"))
    assert {point["field"] for point in drawn("acceptance by draft position")} == {"baseline", "scratch", "warm_start"}


def test_reproduce_gives_identical_hashes(repo, first_run):
    (first,) = pipelines(repo)
    uri = f"sqlite:///{repo / 'mlflow.db'}"
    output = run(["eagle3ops", "reproduce", first.run_id, "--tracking-uri", uri, "--json", "reproduced.json"], repo)
    result = json.loads((repo / "reproduced.json").read_text())
    data_and_models = [o for o in result["outputs"] if o["kind"] == "result"]
    # the zoo's two, generated, prepared, features, two drafters, the export, and two plots of each drafter
    assert len(data_and_models) == 12 and all(o["identical"] for o in data_and_models), output
    taus = [m for m in result["metrics"] if m["metric"] == "tau"]
    assert len(taus) == 3 and all(m["delta"] == 0 for m in taus)
    rerun = next(p for p in pipelines(repo) if p.tags.get("eagle3ops.reproduces") == first.run_id)
    assert sorted(rerun.stages) == RECORDED


def test_changing_lr_reruns_only_train_eval_report(repo, first_run):
    before = lock_md5(repo, "train@scratch", "models/drafters/scratch")
    output = run(["dvc", "exp", "run", "-S", "train.lr=0.001", "-n", "lr-1e-3"], repo)
    assert ran_stages(output) == ["train@scratch", "train@warm_start", "eval@scratch", "eval@warm_start", "export",
                                  "report"]
    assert lock_md5(repo, "train@scratch", "models/drafters/scratch") != before
    # the experiment's evals and export found the first run's engine: no target loaded again
    assert [json.loads((repo / "metrics" / f"eval-{d}.json").read_text())["vllm"]["engine_starts"]
            for d in ("scratch", "warm_start")] == [0, 0]
    assert json.loads((repo / "metrics" / "export.json").read_text())["engine_started"] == 0

    # The experiment's parent run is named after it and still shows the whole chain: the stages DVC skipped
    # are linked to the runs that produced their outputs.
    experiment = next(p for p in pipelines(repo) if p.name == "lr-1e-3")
    assert sorted(experiment.stages) == RECORDED
    cached = {name for name, stage in experiment.stages.items() if stage.cached}
    assert cached == {"zoo", "generate", "prepare", "extract", "eval@baseline"}
    original = next(p for p in pipelines(repo) if "eagle3ops.reproduces" not in p.tags and p.name != "lr-1e-3")
    assert experiment.stages["extract"].run_id == original.stages["extract"].run_id
    assert experiment.stages["train@scratch"].params["train.lr"] == "0.001"
    assert client(repo).get_run(experiment.run_id).data.params["overrides"] == "train.lr=0.001"
    assert experiment.stages["zoo"].params == original.stages["zoo"].params  # a cached stage keeps its own params
    shown = run(["dvc", "exp", "show", "--json"], repo)
    assert "lr-1e-3" in shown and "tau" in shown

    write_params(repo, [])  # back to the first params: forced re-training must give the same bytes
    output = run(["dvc", "repro", "--force", "--single-item", "train@scratch"], repo)
    assert ran_stages(output) == ["train@scratch"]
    assert lock_md5(repo, "train@scratch", "models/drafters/scratch") == before

    # The experiment's commit exists only after its last stage: the next stage run tags the parent with it.
    refs = run(["git", "for-each-ref", "refs/exps", "--format=%(refname) %(objectname)"], repo).split()
    experiment = next(p for p in pipelines(repo) if p.name == "lr-1e-3")
    assert experiment.tags["eagle3ops.result_commit"] == refs[refs.index(next(r for r in refs if r.endswith("/lr-1e-3"))) + 1]


def documented_commands(prefix: str) -> list[list[str]]:
    """The README's commands that start with `prefix`, split as a shell would."""
    import shlex

    blocks = [block.split("```")[0] for block in (ROOT / "README.md").read_text().split("```bash\n")[1:]]
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.startswith(prefix)]


def test_the_documented_views_of_the_experiments_fit_a_terminal(repo, first_run):
    """After the baseline commit and one experiment (test_changing_lr...): each of the README's `dvc exp show`
    filters fits 120 columns with nothing cut off, and `dvc metrics diff` compares the workspace with the
    baseline."""
    show, *engine_views = documented_commands("dvc exp show")
    for view, metric in zip(engine_views, ("tau_vllm", "speedup_vllm")):
        table = run([*view, "--no-pager"], repo, env={"COLUMNS": "120"})
        assert max(len(line.rstrip()) for line in table.splitlines()) <= 120 and "…" not in table, table
        assert [line for line in table.splitlines() if line.strip()][1].split() == [
            "Experiment", *(f"{metric}.{drafter}" for drafter in ("baseline", "scratch", "warm_start"))], table
    table = run([*show, "--no-pager"], repo, env={"COLUMNS": "120"})
    lines = [line for line in table.splitlines() if line.strip()]
    assert max(len(line.rstrip()) for line in lines) <= 120 and "…" not in table, table
    header = lines[1].split()
    assert header[:4] == ["Experiment", "tau.baseline", "tau.scratch", "tau.warm_start"] and "train.lr" in header
    assert any("[lr-1e-3]" in line and "0.001" in line for line in lines), table
    baseline = next(line for line in lines if line.split()[0] in ("master", "main"))
    assert "!" not in baseline, table  # the baseline row has its metrics: they are committed
    (diff,) = documented_commands("dvc metrics diff")
    assert "tau.scratch" in run(diff, repo)


def test_a_stage_that_fails_under_dvc_repro_loses_nothing(repo, first_run):
    """DVC removes a stage's outputs before it runs it. A bad value then fails train@scratch: its metrics are
    put back at once, and its drafter and curves come back with `dvc checkout`, as the message says. A missing
    drafter fails train@warm_start before its command starts: with the change undone, `dvc repro` brings back
    the last run's outputs from DVC's run cache without re-running the stage."""
    cached = ("models/drafters/scratch", "plots/train-scratch.csv", "plots/sim-scratch.csv")
    kept = {"metrics/train-scratch.json": (repo / "metrics" / "train-scratch.json").read_bytes()}
    curves = (repo / "plots" / "train-scratch.csv").read_bytes()
    drafter = lock_md5(repo, "train@scratch", "models/drafters/scratch")
    write_params(repo, ["train.lr=fast"])
    output = run(["dvc", "repro"], repo, fail=True)
    assert "key 'train.lr'" in output and f"`dvc checkout {' '.join(cached)}` restores" in output, output
    assert {path: (repo / path).read_bytes() for path in kept} == kept
    assert not any((repo / path).exists() for path in cached)
    run(["dvc", "checkout", *cached], repo)
    assert (repo / "plots" / "train-scratch.csv").read_bytes() == curves
    write_params(repo, [])
    status = run(["dvc", "status", "train@scratch"], repo)  # the stage and those it depends on
    assert "Data and pipelines are up to date" in status, status
    assert lock_md5(repo, "train@scratch", "models/drafters/scratch") == drafter

    # the extract stage, a foreach of one item (extract@offline), alike
    kept = {"metrics/extract.json": (repo / "metrics" / "extract.json").read_bytes()}
    write_params(repo, ["extract.batch_size=many"])
    output = run(["dvc", "repro", "extract"], repo, fail=True)
    assert "key 'extract.batch_size'" in output and "`dvc checkout data/features` restores" in output, output
    assert {path: (repo / path).read_bytes() for path in kept} == kept
    run(["dvc", "checkout", "data/features"], repo)
    write_params(repo, [])
    assert "Data and pipelines are up to date" in run(["dvc", "status", "extract"], repo)

    run(["dvc", "repro", "train@warm_start"], repo)  # its lock still holds an experiment's params
    outputs = ("metrics/train-warm_start.json", "plots/train-warm_start.csv",
               "models/drafters/warm_start/model.safetensors")
    kept = {path: (repo / path).read_bytes() for path in outputs}
    write_params(repo, ["train.warm_start=models/nowhere"])
    output = run(["dvc", "repro", "train@warm_start"], repo, fail=True)
    assert "models/nowhere" in output and "Running stage" not in output, output
    write_params(repo, [])
    output = run(["dvc", "repro", "train@warm_start"], repo)
    assert "Running stage" not in output and "is cached" in output, output
    assert {path: (repo / path).read_bytes() for path in outputs} == kept


CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")  # Debian's packages
SCREENSHOTS = os.environ.get("EAGLE3OPS_SCREENSHOTS")  # a directory to keep the screenshots in (docs/img does)


@pytest.fixture
def mlflow_ui(repo):
    """`mlflow ui` on the pipeline's store, as the report says to start it."""
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "ui", "--backend-store-uri",
                               f"sqlite:///{repo / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", server)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-extensions", "--window-size=1500,950",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):  # offline, as a cluster's node is
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def shown(driver, url: str, *texts: str) -> str:
    """Open `url` and wait until the page shows every one of `texts`; returns the page's text."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    try:
        WebDriverWait(driver, 60).until(lambda d: all(t in d.find_element(By.TAG_NAME, "body").text for t in texts))
    except Exception:
        raise AssertionError(f"{url} never showed {texts}:\n{driver.find_element(By.TAG_NAME, 'body').text[:3000]}")
    for close in driver.find_elements(By.XPATH, "//button[@aria-label='Close']"):  # the assistant side panel
        if close.is_displayed():
            close.click()
    return driver.find_element(By.TAG_NAME, "body").text


def scroll_to(driver, text: str) -> None:
    """Scroll the first element showing `text` to the middle of the window, for the screenshot."""
    from selenium.webdriver.common.by import By

    for element in driver.find_elements(By.XPATH, f"//*[text()[contains(., '{text}')]]")[:1]:
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)


def screenshot(driver, name: str, tmp_path: Path) -> Path:
    directory = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path
    directory.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(directory / f"{name}.png"))
    return directory / f"{name}.png"


def test_the_mlflow_ui_shows_what_a_user_compares(repo, first_run, mlflow_ui, browser, tmp_path):
    """After the first run and the lr experiment, in Chromium against `mlflow ui`: the link the report gives opens
    the experiment's runs table; a pipeline run's page shows tau per drafter; the compare view of two pipeline runs
    shows the param that differs; the model page shows the champion with its tau; an experiment's pipeline run is
    "Running" while its stages run and "Finished" after its report."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    store = client(repo)
    experiment_id = store.get_experiment_by_name("eagle3ops").experiment_id
    first = pipelines(repo)[-1]
    lr = next(p for p in pipelines(repo) if p.name == "lr-1e-3")
    link = re.search(r"http://127\.0\.0\.1:5000(\S*)", (repo / "reports" / "summary.md").read_text()).group(1)
    assert link == f"/#/experiments/{experiment_id}/runs?viewStateShareKey=eagle3ops&workflowType=machine_learning"

    # the saved view: the pipeline runs with tau per drafter and the overrides as columns, at first sight (once
    # the assistant's side panel is closed, the overrides column is in the window too)
    text = shown(browser, mlflow_ui + link, "Run Name", "lr-1e-3", first.name, "tau/scratch", "tau/warm_start")
    WebDriverWait(browser, 30).until(lambda d: "overrides" in d.find_element(By.TAG_NAME, "body").text)
    assert f"/#/experiments/{experiment_id}/runs?" in browser.current_url  # not sent on to the GenAI overview
    screenshot(browser, "mlflow-runs", tmp_path)

    parent = store.get_run(first.run_id)
    taus = {d: parent.data.metrics[f"tau/{d}"] for d in ("baseline", "scratch", "warm_start")}
    text = shown(browser, f"{mlflow_ui}/#/experiments/{experiment_id}/runs/{first.run_id}?workflowType=machine_learning",
                 "tau/warm_start")
    lines = text.splitlines()
    for drafter, tau in taus.items():  # the metric's name, then its value
        assert float(lines[lines.index(f"tau/{drafter}") + 1]) == pytest.approx(tau, abs=1e-4), drafter
    assert "eagle3ops report" in text  # the report is the run's description
    figures = [image for image in browser.find_elements(By.TAG_NAME, "img")
               if "get-artifact?path=report/tau_by_set.png" in (image.get_attribute("src") or "")]
    assert figures, "the report's figure is not on the run page"
    WebDriverWait(browser, 30).until(lambda d: d.execute_script(  # fetched from the run's artifacts, not broken
        "return arguments[0].complete && arguments[0].naturalWidth > 0", figures[0]))
    screenshot(browser, "mlflow-pipeline-run", tmp_path)

    assert {o.model_id for o in parent.outputs.model_outputs} == {  # the trained drafters, in its Models column
        o.model_id for init in ("scratch", "warm_start") for o in store.get_run(
            first.stages[f"train@{init}"].run_id).outputs.model_outputs}

    runs, experiments = json.dumps([first.run_id, lr.run_id]), json.dumps([experiment_id])
    text = shown(browser, f"{mlflow_ui}/#/compare-runs?runs={runs}&experiments={experiments}"
                          "&workflowType=machine_learning", "train.lr")
    assert re.search(r"^train\.lr 0\.003 0\.001$", text, re.MULTILINE), text  # the param that differs
    scroll_to(browser, "Show diff only")
    browser.find_elements(By.XPATH, "//*[@role='switch']")[0].click()  # the parameters' "Show diff only"
    WebDriverWait(browser, 30).until(lambda d: "data.max_len" not in d.find_element(By.TAG_NAME, "body").text)
    assert re.search(r"^train\.lr 0\.003 0\.001$", browser.find_element(By.TAG_NAME, "body").text, re.MULTILINE)
    screenshot(browser, "mlflow-compare", tmp_path)

    champion = store.get_model_version_by_alias("eagle3-drafter", "champion")
    shown(browser, f"{mlflow_ui}/#/models/eagle3-drafter?workflowType=machine_learning", "@ champion")
    (row,) = [r for r in browser.find_elements(By.XPATH, "//*[@role='row']") if "champion" in r.text]
    assert f"Version {champion.version}" in row.text and champion.tags["tau"] in row.text, row.text
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", row)
    screenshot(browser, "mlflow-model", tmp_path)

    # while an experiment's stages run (export serves on vLLM, then the report), its pipeline run says so
    experiment = subprocess.Popen(["dvc", "exp", "run", "--temp", "-n", "export-scratch", "-S", "export.drafter=scratch"],
                                  cwd=repo, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (found := store.search_runs([experiment_id], "tags.`eagle3ops.role` = 'pipeline' and "
                                              "tags.`eagle3ops.pipeline_key` = 'export-scratch'")):
            assert experiment.poll() is None and time.monotonic() < deadline, experiment.communicate()[0][-4000:]
            time.sleep(0.5)
        run_page = f"{mlflow_ui}/#/experiments/{experiment_id}/runs/{found[0].info.run_id}?workflowType=machine_learning"
        assert re.search(r"^Status\s+Running$", shown(browser, run_page, "Running"), re.MULTILINE)
        screenshot(browser, "mlflow-running", tmp_path)
    finally:
        output = experiment.communicate(timeout=1200)[0]
    assert experiment.returncode == 0, output[-4000:]
    browser.get("about:blank")  # the same address again would not load the page anew
    assert re.search(r"^Status\s+Finished$", shown(browser, run_page, "Finished"), re.MULTILINE)


def test_dvc_plots_show_draws_every_chart_offline(repo, first_run, browser, tmp_path):
    """`dvc plots show` as the README gives it, opened in Chromium with no name resolving (no CDN): the four
    designed charts drawn, axes titled, scratch and warm_start in the report's colours; the report's two PNGs."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    run(["dvc", "plots", "show"], repo)
    browser.get((repo / "dvc_plots" / "index.html").as_uri())
    charts = browser.find_elements(By.CLASS_NAME, "vega-embed")
    assert len(charts) == 4
    WebDriverWait(browser, 30).until(lambda d: all(c.find_elements(By.TAG_NAME, "svg") for c in charts))
    text = browser.find_element(By.TAG_NAME, "body").text
    for title in ("acceptance by draft position", "share of verifications accepting it", "optimizer step",
                  "loss (TTT steps, weighted)", "simulated τ", "warm_start"):
        assert title in text, title
    strokes = {path.get_attribute("stroke") for path in browser.find_elements(By.CSS_SELECTOR, ".vega-embed path")}
    assert {COLORS[EvalDrafter.scratch], COLORS[EvalDrafter.warm_start]} <= strokes
    assert [image.get_attribute("naturalWidth") != "0" for image in browser.find_elements(By.TAG_NAME, "img")] == [
        True, True]
    screenshot(browser, "dvc-plots", tmp_path)


def test_online_training_on_the_zoo_is_the_offline_run(repo, first_run):
    """`dvc exp run` online, as docs/training.md gives it: no extract stage, train depending on the prepared data,
    and the same loss curves as the committed offline run (float32 on the CPU, to 1e-6)."""
    output = run(["dvc", "exp", "run", "-n", "online", "-S", "train.hidden_states=online", "-S", "pipeline.extract=[]",
                  "-S", "pipeline.hidden_states_dep=data/prepared"], repo)
    assert ran_stages(output)[:2] == ["train@scratch", "train@warm_start"] and "extract@offline" not in output
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]  # it keeps extract@offline's last entry
    assert "data/features" not in {dep["path"] for dep in lock["train@scratch"]["deps"]}
    for init in ("scratch", "warm_start"):
        offline = pd.read_csv(io.StringIO(dvc.api.read(f"plots/train-{init}.csv", repo=str(repo), rev="HEAD")))
        online = pd.read_csv(repo / "plots" / f"train-{init}.csv")
        assert list(online["step"]) == list(offline["step"])
        assert online["train/loss"].tolist() == pytest.approx(offline["train/loss"].tolist(), rel=1e-6), init
    summary = (repo / "reports" / "summary.md").read_text()  # no timing of the offline run's extract
    assert "| train-scratch " in summary and "| extract " not in summary
    experiment = next(p for p in pipelines(repo) if p.name == "online")
    assert "extract" not in experiment.stages  # no stage of this pipeline, though dvc.lock still lists it
    assert experiment.stages["train@scratch"].tags["eagle3ops.hidden_states"] == "online"
    assert experiment.stages["train@scratch"].params["train.hidden_states"] == "online"
    run(["git", "checkout", "--", "."], repo)
    run(["dvc", "checkout"], repo)


def test_serving_md_commands_run_as_pasted_into_a_fresh_shell_elsewhere(repo, first_run, tmp_path):
    """Each vLLM command SERVING.md prints, run by bash from another directory with a bare environment (no venv
    activated): the server comes up on the printed port, serves the export, and drafts with it."""
    serving = (repo / "models" / "SERVING.md").read_text()
    commands = [line for line in serving.splitlines() if "vllm.entrypoints.openai.api_server" in line]
    assert len(commands) == 2 and all("--port 8000" in command for command in commands)
    # the zoo's target.path is relative, and so the verifier the speculators export names: the command serving
    # the export alone changes to the repository first
    assert commands[1].startswith(f"cd {repo} && ")
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.skip("port 8000, the one SERVING.md prints, is taken on this machine")
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for command in commands:
        server = subprocess.Popen(["bash", "-c", command], cwd=tmp_path, env=bare, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            wait_for_http("http://127.0.0.1:8000/health", server, timeout_s=300)
            answer = json.loads(urlopen(Request("http://127.0.0.1:8000/v1/completions", json.dumps(
                {"prompt": "What is 12 + 7?", "max_tokens": 16, "temperature": 0}).encode(),
                {"Content-Type": "application/json"}), timeout=120).read())
            assert answer["usage"]["completion_tokens"] > 0
            metrics = urlopen("http://127.0.0.1:8000/metrics", timeout=30).read().decode()
            assert vllm_counters(metrics, "metrics").drafts > 0, command
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)


def test_a_drafter_the_engine_reads_differently_fails_its_eval(repo, first_run, monkeypatch, capsys):
    """The export vLLM serves, changed after its validation (each draft id mapped to its neighbour's target id):
    vLLM's acceptance departs from the decoder's, and the eval fails with the figures side by side."""
    import eagle3ops.decoding.served as served
    from eagle3ops.cli import main

    def misread(drafter_dir, out_dir, *args, **kwargs):
        report = export_drafter(drafter_dir, out_dir, *args, **kwargs)
        weights = load_file(str(Path(out_dir) / "model.safetensors"))
        ids = weights["d2t"] + torch.arange(len(weights["d2t"]))  # each draft id's target id, rotated by one
        weights["d2t"] = ids.roll(1) - torch.arange(len(ids))
        save_file(weights, str(Path(out_dir) / "model.safetensors"))
        return report

    monkeypatch.chdir(repo)
    monkeypatch.setattr(served, "export_drafter", misread)
    assert main(["eval", "--drafter", "scratch", "--set", "eval.engine_tolerance=0"]) != 0
    err = capsys.readouterr().err
    assert ("eagle3ops eval@scratch: error: vLLM's acceptance of the scratch drafter differs from the project's "
            "decoder's by more than eval.engine_tolerance = 0") in err
    assert re.search(r"\n  tau +\d\.\d{4} +\d\.\d{4} +[+-]\d\.\d{4}\n  a1 ", err)


def test_a_one_off_run_leaves_the_pipelines_metrics_and_champion_alone(repo, first_run):
    """Last in this file: it adds a pipeline run of its own to the store."""
    store = client(repo)
    champion = store.get_model_version_by_alias("eagle3-drafter", "champion").version
    versions = len(store.search_model_versions("name = 'eagle3-drafter'"))
    recorded = len(pipelines(repo))
    before = (repo / "metrics" / "eval-warm_start.json").read_bytes()
    output = run(["eagle3ops", "eval", "--drafter", "warm_start", "--set", "eval.max_prompts=1"], repo)
    assert "a one-off run (--set eval.max_prompts=1)" in output
    assert (repo / "metrics" / "eval-warm_start.json").read_bytes() == before
    one_off = json.loads((repo / ".eagle3ops" / "one-off" / "metrics" / "eval-warm_start.json").read_text())
    assert set(one_off["prompts_by_set"].values()) == {1}
    assert store.get_model_version_by_alias("eagle3-drafter", "champion").version == champion
    assert len(store.search_model_versions("name = 'eagle3-drafter'")) == versions
    tagged = store.search_runs([store.get_experiment_by_name("eagle3ops").experiment_id],
                               "tags.`eagle3ops.one_off` = '--set eval.max_prompts=1'")
    (stage_run,) = [r for r in tagged if r.data.tags["eagle3ops.role"] == "stage"]
    (parent,) = [r for r in tagged if r is not stage_run]
    assert parent.data.tags["eagle3ops.role"] == "one_off" and parent.info.run_name.startswith("one-off ")
    assert stage_run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert len(pipelines(repo)) == recorded  # compare and the other pipeline views leave it out
