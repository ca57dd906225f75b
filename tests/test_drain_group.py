"""Sources of one interval sampled on one thread (collector/daemon.py _DrainGroup): the drains of
the default modes that run once a second (clock, host, stacks, off-CPU) wake one thread a tick
instead of one each. What must hold: each member is sampled every tick on the group's thread, a
failing member backs off alone, a flush request samples every member at once, and at the stop each
member's final rows and stop run once; a source that starts after the stop finishes itself."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import h5py

from gpuprof.collector import config as config_mod
from gpuprof.collector.daemon import Collector, CollectorOptions
from gpuprof.collector.sources.base import Batch, Source, SourceContext

INTERVAL_S = 0.2


class Shared(Source):
    """A source that shares the drain thread and records on which thread each call ran; it fails
    its first `fails` samples; its start waits for `start_gate` when one is given."""

    shares_drain_thread = True
    interval_s = INTERVAL_S

    def __init__(self, name: str, fails: int = 0, start_gate: threading.Event | None = None) -> None:
        self.name = name
        self.fails = fails
        self.start_gate = start_gate
        self.start_thread: int | None = None
        self.samples: list[tuple[float, int]] = []  # (monotonic, thread id)
        self.finals: list[int] = []
        self.stops: list[int] = []

    def start(self, ctx: SourceContext) -> None:
        self.start_thread = threading.get_ident()
        if self.start_gate is not None:
            self.start_gate.wait(30)

    def sample(self, now_ns: int) -> list[Batch]:
        self.samples.append((time.monotonic(), threading.get_ident()))
        if len(self.samples) <= self.fails:
            raise OSError("a failure on purpose")
        return []

    def final(self, now_ns: int) -> list[Batch]:
        self.finals.append(threading.get_ident())
        return []

    def stop(self) -> None:
        self.stops.append(threading.get_ident())


def collector(tmp_path: Path, pid: int, sources: list[Source]) -> Collector:
    return Collector(CollectorOptions(output=tmp_path / "n.h5", modes=("metrics",), config=config_mod.defaults(),
                                      pid=pid, use_scontrol=False), sources=sources)


def wait_recording(c: Collector) -> None:
    deadline = time.monotonic() + 10
    while c.state != "recording" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert c.state == "recording", c.status()


def test_members_share_one_thread_and_fail_alone(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    a, b, failing = Shared("a"), Shared("b"), Shared("failing", fails=2)
    c = collector(tmp_path, sleeper.pid, [a, b, failing])
    c.start()
    try:
        wait_recording(c)
        time.sleep(12 * INTERVAL_S)
        before = {s.name: len(s.samples) for s in (a, b, failing)}
        t0 = time.monotonic()
        assert c.request_flush(5.0)
        flush_s = time.monotonic() - t0
        after = {s.name: len(s.samples) for s in (a, b, failing)}
    finally:
        c.request_stop("test")
        c.shutdown()
    threads = {t for s in (a, b, failing) for _, t in s.samples} | {t for s in (a, b, failing) for t in s.finals}
    assert len(threads) == 1, "every sample and final on one thread"
    (group,) = threads
    assert group not in {a.start_thread, b.start_thread, failing.start_thread}  # each started on its own
    for s in (a, b):
        # every tick (the first sample at the join, then one a tick; the first tick may be missed)
        assert len(s.samples) >= 12, (s.name, len(s.samples))
        gaps = [t1 - t0 for (t0, _), (t1, _) in zip(s.samples[1:], s.samples[2:], strict=False)]
        assert max(gaps) < 2 * INTERVAL_S, (s.name, gaps)
    # the failing member backed off (the interval, then twice it) and came back; the others did not wait
    assert 2 < len(failing.samples) < len(a.samples), (len(failing.samples), len(a.samples))
    assert any("sample failed: OSError: a failure on purpose" in e["message"] for e in c.status()["errors"])
    # a flush request samples every member at once, not at the next tick
    assert all(after[n] > before[n] for n in before), (before, after)
    assert flush_s < INTERVAL_S + 0.5, flush_s
    for s in (a, b, failing):
        assert s.finals == [group] and s.stops == [group], s.name
    with h5py.File(tmp_path / "n.h5", "r") as f:
        cpu = json.loads(f.attrs["collector_cpu_json"])
    assert {"a", "b", "failing"} <= set(cpu["drain_s"]), cpu
    assert f"drains-{round(INTERVAL_S * 1000)}ms" in cpu["by_thread_s"], cpu


def test_a_source_started_after_the_stop_finishes_on_its_own(tmp_path: Path,
                                                            sleeper: subprocess.Popen[bytes]) -> None:
    gate = threading.Event()
    early, late = Shared("early"), Shared("late", start_gate=gate)
    c = collector(tmp_path, sleeper.pid, [early, late])
    c.start()
    try:
        deadline = time.monotonic() + 10
        while len(early.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(early.samples) >= 3
        c.request_stop("test")
        stopper = threading.Thread(target=c.shutdown)
        stopper.start()
        deadline = time.monotonic() + 10
        while not early.stops and time.monotonic() < deadline:
            time.sleep(0.02)
        gate.set()  # late's start returns now: its join is refused, its own thread finishes it
        stopper.join(30)
        assert not stopper.is_alive()
    finally:
        gate.set()
        if not c.finished_event.is_set():
            c.request_stop("test")
            c.shutdown()
    assert early.stops and early.stops[0] != early.start_thread
    assert late.samples == [] and late.finals == [late.start_thread] and late.stops == [late.start_thread]
