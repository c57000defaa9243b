"""Where a run's time went, printed at its end: each test file's wall time (first setup to last teardown, module
fixtures included: under `--dist loadfile` one worker runs a whole file) beside the budget, and the vLLM servers
started, seen as processes (a stage's, a fixture's or a pasted SERVING.md command alike).

Registered by conftest.py in the process that reports (the xdist controller, or pytest itself without -n)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil
import pytest

FILE_BUDGET_S = 15 * 60
SUITE_BUDGET_S = 45 * 60
FAST_TIER_BUDGET_S = 3 * 60
VLLM_SERVER = "vllm.entrypoints.openai.api_server"


@dataclass
class FileTime:
    start: float = float("inf")
    stop: float = 0.0
    tests: set[str] = field(default_factory=set)
    worker: str = "-"


class VllmWatch:
    """A thread that looks for vLLM server processes every `every_s` (a start on a CPU takes tens of seconds,
    so none slips between two looks); `started` is how many it saw, `alive_s` how long they lived together."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s, self.since = every_s, time.time()  # servers already running before are not this run's
        self.first_seen: dict[tuple[int, float], float] = {}
        self.last_seen: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vllm-watch", daemon=True)

    def __enter__(self) -> VllmWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for process in psutil.process_iter(["cmdline", "create_time"]):
                if (VLLM_SERVER in " ".join(process.info["cmdline"] or ())
                        and (process.info["create_time"] or 0) >= self.since):
                    key = (process.pid, process.info["create_time"])
                    self.first_seen.setdefault(key, process.info["create_time"])
                    self.last_seen[key] = now
            self._stop.wait(self.every_s)

    @property
    def started(self) -> int:
        return len(self.first_seen)

    @property
    def alive_s(self) -> float:
        return sum(self.last_seen[key] - self.first_seen[key] for key in self.first_seen)


class SuiteClock:
    def __init__(self, slow_tier: bool, whole: bool) -> None:
        self.slow_tier, self.whole = slow_tier, whole
        self.files: dict[str, FileTime] = {}
        self.began = time.time()
        self.vllm = VllmWatch().__enter__()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.files.setdefault(report.nodeid.split("::")[0], FileTime())
        entry.start, entry.stop = min(entry.start, report.start), max(entry.stop, report.stop)
        entry.tests.add(report.nodeid)
        entry.worker = getattr(report, "node", None) and report.node.gateway.id or entry.worker

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        self.vllm.__exit__(None, None, None)
        wall = time.time() - self.began
        write = terminalreporter.write_line
        if not self.slow_tier:
            if self.whole:
                write(f"fast tier in {wall:.0f} s (budget {FAST_TIER_BUDGET_S} s on the 2-core CI machine)",
                      red=wall > FAST_TIER_BUDGET_S)
            return
        terminalreporter.section("time by test file (wall, module fixtures included)")
        write(f"{'file':<40} {'tests':>5} {'wall s':>7} {'min':>6}  worker")
        for name, entry in sorted(self.files.items(), key=lambda item: item[1].start - item[1].stop):
            seconds = entry.stop - entry.start
            over = "  over the 15-minute budget" if seconds > FILE_BUDGET_S else ""
            write(f"{name.removeprefix('tests/'):<40} {len(entry.tests):>5} {seconds:>7.0f} {seconds / 60:>6.1f}  "
                  f"{entry.worker}{over}", red=bool(over))
        busy = sum(entry.stop - entry.start for entry in self.files.values())
        write(f"whole run {wall:.0f} s ({wall / 60:.1f} min, budget {SUITE_BUDGET_S // 60}); the files' wall times "
              f"add up to {busy:.0f} s", red=wall > SUITE_BUDGET_S)
        write(f"vLLM servers started: {self.vllm.started}, alive {self.vllm.alive_s:.0f} s in all")
