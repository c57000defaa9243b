"""The micro pipeline as `dvc repro` builds it (the built_pipeline fixture: run once for the whole test run, read
through copies by this module, test_pipeline_reproduce.py, test_pipeline_experiments.py and test_dvc_remotes.py).

Checks what users rely on after the README's first command: every stage ran and measured its drafter on the
decoder and on vLLM; a second run does nothing; which params and code make which stages stale; every stage run is in
MLflow, grouped under one parent per pipeline run, with its lineage tags, and the trained drafters are registered
with a champion; the commands SERVING.md prints work as pasted; an eval fails where vLLM reads the drafter
differently; a one-off run leaves the pipeline's results alone.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from urllib.request import Request, urlopen

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3ops.decoding.engines import vllm_counters
from eagle3ops.formats.export import export_drafter
from helpers import (
    ALL_STAGES,
    RECORDED,
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
    """This module's copy of the built pipeline, its tests changing it in their order."""
    return copy_workspace(built_pipeline[0], tmp_path_factory.mktemp("pipeline") / "repo")


@pytest.fixture(scope="module")
def first_run(built_pipeline) -> str:
    """What the README's first command printed: `dvc repro` (its results then committed as the baseline)."""
    return built_pipeline[1]


def test_repro_builds_every_stage(repo, first_run, built_pipeline):
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
    # the target alone, a stage of its own, on the prompts the evals send, on the same hardware
    alone = json.loads((repo / "metrics" / "target_speed.json").read_text())
    assert alone["measured"] is True and alone["tokens_per_s"] > 0 and alone["vllm"] == {
        "version": served["version"], "hardware": served["hardware"]}
    assert alone["prompts"] == metrics["prompts"] and alone["engine_starts"] == 1
    checkpoint = repo / "models" / "drafters" / "scratch"
    assert {"config.json", "model.safetensors", "training_state.pt"} <= {p.name for p in checkpoint.iterdir()}
    manifest = json.loads((repo / "data" / "features" / "train" / "manifest.json").read_text())
    assert manifest["aux_layers"] == [2, 4, 5] and manifest["samples"] > 0
    summary = (repo / "reports" / "summary.md").read_text()
    assert "warm_start" in summary and "baseline" in summary and "mlflow ui" in summary
    assert str(built_pipeline[0]) not in summary and "--backend-store-uri sqlite:///mlflow.db` in the repository" in summary
    assert "## Served on vLLM" in summary and "tok/s target alone" in summary
    headline = json.loads((repo / "metrics.json").read_text())
    assert set(headline["tau_vllm"]) == set(headline["speedup_vllm"]) == {"baseline", "scratch", "warm_start"}
    export = json.loads((repo / "metrics" / "export.json").read_text())
    assert export["served_drafts"] > 0  # vLLM drafted with the export's weights
    # engine sessions: target_speed started the target alone, the baseline's eval the target with a drafter; the
    # other evals and the export found the latter and swapped their drafters in
    starts = {d: json.loads((repo / "metrics" / f"eval-{d}.json").read_text())["vllm"]["engine_starts"]
              for d in ("baseline", "scratch", "warm_start")}
    assert starts == {"baseline": 1, "scratch": 0, "warm_start": 0} and export["engine_started"] == 0
    assert re.search(r"vLLM engines started for these results: 2 \(by target_speed 1 in \d+\.\d s, eval@baseline 1 "
                     r"in \d+\.\d s\); found running \(engine sessions\): eval@scratch, eval@warm_start, export\.",
                     summary), summary
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
    store = pipeline_store(repo)
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
        alone = json.loads((repo / "metrics" / "target_speed.json").read_text())["tokens_per_s"]
        assert parent.data.metrics[f"speedup_vllm/{drafter}"] == round(recorded["vllm"]["tokens_per_s"] / alone, 3)
    assert parent.data.params["train.lr"] == "0.003" and parent.data.params["overrides"] == "none"
    assert parent.data.metrics["vllm/engine_starts"] == 2  # the target with a drafter, the target alone
    assert parent.data.tags["mlflow.note.content"].startswith("# eagle3ops report")
    assert json.loads((repo / "metrics.json").read_text())["tau"]["scratch"] == parent.data.metrics["tau/scratch"]
    experiment = store.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on its runs table
    assert {a.path for a in store.list_artifacts(first.run_id, "lineage")} == {
        "lineage/dvc.yaml", "lineage/params.yaml", "lineage/dvc.lock"}


def test_trained_drafters_are_logged_models_registered_with_a_champion(repo, first_run, tmp_path):
    store = pipeline_store(repo)
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


def test_serving_md_commands_run_as_pasted_into_a_fresh_shell_elsewhere(repo, built_pipeline, tmp_path):
    """Each vLLM command SERVING.md prints, run by bash from another directory with a bare environment (no venv
    activated): the server comes up on the printed port, serves the export, and drafts with it."""
    serving = (repo / "models" / "SERVING.md").read_text()
    commands = [line for line in serving.splitlines() if "vllm.entrypoints.openai.api_server" in line]
    assert len(commands) == 2 and all("--port 8000" in command for command in commands)
    # the zoo's target.path is relative, and so the verifier the speculators export names: the command serving
    # the export alone changes to the repository where the pipeline ran first
    assert commands[1].startswith(f"cd {built_pipeline[0]} && ")
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
    store = pipeline_store(repo)
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
