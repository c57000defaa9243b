"""Experiments on the built micro pipeline (a copy of the built_pipeline fixture's), and the views users compare them
in: `dvc exp run` with another lr re-runs only what reads it; a stage that fails under `dvc repro` loses nothing;
the README's `dvc exp show` views fit a terminal; the MLflow UI and `dvc plots show` in Chromium; the online
experiment gives the offline run's losses."""
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import dvc.api
import pandas as pd
import pytest
import yaml

from eagle3ops.config import EvalDrafter
from eagle3ops.reporting.summary import COLORS
from eagle3ops.serving.server import free_port
from helpers import (
    RECORDED,
    ROOT,
    command_env,
    copy_workspace,
    lock_md5,
    pipeline_store,
    pipelines,
    ran_stages,
    run,
    wait_for_http,
    write_params,
)

pytestmark = [pytest.mark.pipeline, pytest.mark.service]


@pytest.fixture(scope="module")
def repo(built_pipeline, tmp_path_factory) -> Path:
    """This module's copy of the built pipeline: the lr experiment first, the views of it after."""
    return copy_workspace(built_pipeline[0], tmp_path_factory.mktemp("pipeline") / "repo")


def test_changing_lr_reruns_only_train_eval_report(repo):
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
    assert cached == {"zoo", "generate", "target_speed", "prepare", "extract", "eval@baseline"}
    original = next(p for p in pipelines(repo) if "eagle3ops.reproduces" not in p.tags and p.name != "lr-1e-3")
    assert experiment.stages["extract"].run_id == original.stages["extract"].run_id
    # the target alone's speed, what the experiment's speed-ups divide by, is the first run's, from DVC's cache
    assert experiment.stages["target_speed"].run_id == original.stages["target_speed"].run_id
    assert experiment.stages["train@scratch"].params["train.lr"] == "0.001"
    assert pipeline_store(repo).get_run(experiment.run_id).data.params["overrides"] == "train.lr=0.001"
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


def test_the_documented_views_of_the_experiments_fit_a_terminal(repo):
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


def test_a_stage_that_fails_under_dvc_repro_loses_nothing(repo):
    """DVC removes a stage's outputs before it runs it. A bad value then fails train@scratch: its metrics are
    put back at once, and its drafter and curves come back with `dvc checkout`, as the message says. A missing
    drafter fails train@warm_start before its command starts: with the change undone, `dvc repro` brings back
    the last run's outputs from DVC's run cache without re-running the stage."""
    cached = ("models/drafters/scratch", "plots/train-scratch.csv", "plots/sim-scratch.csv",
              "models/compile-cache/train-scratch")
    kept = {"metrics/train-scratch.json": (repo / "metrics" / "train-scratch.json").read_bytes()}
    curves = (repo / "plots" / "train-scratch.csv").read_bytes()
    drafter = lock_md5(repo, "train@scratch", "models/drafters/scratch")
    try:
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
    finally:  # a failure here leaves no bad value for the file's later tests
        write_params(repo, [])


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


def test_the_mlflow_ui_shows_what_a_user_compares(repo, mlflow_ui, browser, tmp_path):
    """After the first run and the lr experiment, in Chromium against `mlflow ui`: the link the report gives opens
    the experiment's runs table; a pipeline run's page shows tau per drafter; the compare view of two pipeline runs
    shows the param that differs; the model page shows the champion with its tau; an experiment's pipeline run is
    "Running" while its stages run and "Finished" after its report."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    store = pipeline_store(repo)
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


def test_dvc_plots_show_draws_every_chart_offline(repo, browser, tmp_path):
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


def test_online_training_on_the_zoo_is_the_offline_run(repo):
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

