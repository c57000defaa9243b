"""Stages on one CPU take turns for its cores (cpu_share.py): a second stage waits for a slot, names who holds it,
and gets it the moment the holder's process ends, however it ends."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HOLD = """
import sys, time
from eagle3ops.cpu_share import cpu_slot
with cpu_slot(sys.argv[1], threads=int(sys.argv[2]), cores=2) as number:
    print(number, flush=True)
    time.sleep(float(sys.argv[3]))
"""


def _start(tmp_path: Path, label: str, threads: int, hold_s: float) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, "-c", HOLD, label, str(threads), str(hold_s)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_second_stage_waits_for_the_cores_and_gets_them_when_the_first_dies(tmp_path: Path) -> None:
    first = _start(tmp_path, "eagle3ops train@scratch", threads=2, hold_s=60)
    assert first.stdout.readline().strip() == "0"  # two threads on two cores: the one slot
    second = _start(tmp_path, "eagle3ops train@warm_start", threads=2, hold_s=0)
    time.sleep(2.5)
    assert second.poll() is None, "the second stage computed beside the first"
    first.kill()  # no clean exit: the slot is freed by the process ending
    first.wait()
    out, err = second.communicate(timeout=30)
    assert out.strip() == "0"
    assert f"waiting for a CPU slot: 1 stage(s) of 2 thread(s) fit this machine's 2 cores, and {first.pid} " \
           f"eagle3ops train@scratch hold them" in err
    assert "eagle3ops train@warm_start: got a CPU slot after" in err


def test_stages_of_one_thread_share_two_cores_side_by_side(tmp_path: Path) -> None:
    first = _start(tmp_path, "eagle3ops eval@scratch", threads=1, hold_s=30)
    assert first.stdout.readline().strip() == "0"
    second = _start(tmp_path, "eagle3ops eval@warm_start", threads=1, hold_s=0)
    out, err = second.communicate(timeout=30)
    first.kill()
    first.wait()
    assert out.strip() == "1" and "waiting" not in err


def test_torchrun_ranks_take_no_slot(monkeypatch) -> None:
    """The ranks of one launch must run together: none of them waits for another."""
    from eagle3ops.cpu_share import cpu_slot

    monkeypatch.setenv("WORLD_SIZE", "2")
    with cpu_slot("eagle3ops train@scratch", threads=64, cores=2) as number:
        assert number is None


def test_a_stage_run_in_process_frees_its_slot_when_it_ends(tmp_path, monkeypatch) -> None:
    """A process that runs stages one after another (a test, a notebook) holds a slot only while each runs."""
    from eagle3ops.cpu_share import cpu_slot

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    for _ in range(2):
        with cpu_slot("eagle3ops eval@scratch", threads=2, cores=2) as number:
            assert number == 0  # the one slot, free again each time
    waiter = _start(tmp_path, "eagle3ops eval@warm_start", threads=2, hold_s=0)
    out, err = waiter.communicate(timeout=30)
    assert out.strip() == "0" and "waiting" not in err


def test_a_stage_on_the_cpu_waits_while_other_stages_hold_every_core(tmp_path: Path) -> None:
    """The stage runner takes a slot before the stage computes: with every slot held (one holder process per core,
    a thread each, as the tests' stages run), `eagle3ops zoo` waits and says so. Starts 2+ small Python
    processes and one CLI process that never gets to compute: about 10 s."""
    from eagle3ops.cpu_share import usable_cores

    project = tmp_path / "project"
    project.mkdir()
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(Path(__file__).parents[1] / name, project / name)
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    holders = [subprocess.Popen([sys.executable, "-c", HOLD.replace("cores=2", "cores=None"), f"holder {i}", "1",
                                 "120"], env=env, text=True, stdout=subprocess.PIPE) for i in range(usable_cores())]
    try:
        assert sorted(int(h.stdout.readline()) for h in holders) == list(range(usable_cores()))
        stage = subprocess.Popen([sys.executable, "-m", "eagle3ops.cli", "zoo"], cwd=project, env=env, text=True,
                                 stderr=subprocess.PIPE)
        line, began = "", time.monotonic()
        while "waiting for a CPU slot" not in line and time.monotonic() - began < 60:
            line = stage.stderr.readline()
            assert line or stage.poll() is None, "the stage ended without waiting for the cores"
        assert "eagle3ops zoo: waiting for a CPU slot" in line and "holder 0" in line
        assert not (project / "models").exists()  # nothing computed while it waited
        stage.kill()
        stage.wait()
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def test_every_stage_that_computes_takes_a_slot_by_its_dvc_name() -> None:
    from eagle3ops.stages.runner import computes

    assert all(computes(name) for name in ("zoo", "generate", "target_speed", "extract@offline", "train@scratch",
                                           "train@warm_start", "eval@baseline", "eval@scratch"))
    assert not any(computes(name) for name in ("prepare", "report", "export"))
