"""The collector lifts its lowered priority while it falls behind (collector/catchup.py).

The autogroup here is a file of the test's own: the real one (/proc/self/autogroup) is written only
by a session leader, and lowering the test runner's session would slow every test after it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import h5py
import pytest

from gpuprof.collector import config as config_mod
from gpuprof.collector.catchup import BEHIND_FILL, HOLD_S, CatchUp, autogroup_nice
from gpuprof.collector.daemon import Collector, CollectorOptions
from gpuprof.collector.sources.base import Batch, Source, SourceContext
from gpuprof.collector.sources.clock import ClockSource


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lifted_while_a_buffer_is_past_half_and_lowered_again_after_the_hold(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 10\n")
    assert autogroup_nice(group) == 10
    clock = Clock()
    c = CatchUp(10, group, clock)
    c.observe(BEHIND_FILL)  # half full is not behind
    assert group.read_text().startswith("/autogroup-7") and c.summary()["lifts"] == 0
    c.observe(0.9)
    assert group.read_text() == "0"
    clock.now += 1
    c.observe(0.7)  # still behind: no second lift
    clock.now += HOLD_S / 2
    c.observe(0.1)  # caught up, but not for HOLD_S yet
    assert group.read_text() == "0"
    clock.now += HOLD_S
    c.observe(0.1)
    assert group.read_text() == "10"
    s = c.summary()
    assert s["lifts"] == 1 and s["lifted_s"] == pytest.approx(1 + 1.5 * HOLD_S) and s["active"]


def test_nothing_to_lift_at_nice_0_or_without_an_autogroup(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 0\n")
    CatchUp(0, group).observe(1.0)
    assert group.read_text() == "/autogroup-7 nice 0\n"
    CatchUp(10, None).observe(1.0)
    assert autogroup_nice(tmp_path / "missing") is None


def test_a_lift_refused_is_said_once_and_not_tried_again(tmp_path: Path) -> None:
    c = CatchUp(10, tmp_path / "no-such-dir" / "autogroup")
    c.observe(1.0)
    s = c.summary()
    assert not s["active"] and s["lifts"] == 0 and "cannot set the session's nice to 0" in s["problem"]


class Behind(Source):
    """A source whose buffer is always three quarters full."""

    name = "behind"
    interval_s = 0.05
    fill = 0.75

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx

    def sample(self, now_ns: int) -> list[Batch]:
        return []


def test_the_collector_lifts_its_priority_when_a_source_falls_behind(tmp_path: Path,
                                                                      sleeper: subprocess.Popen[bytes]) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 10\n")
    out = tmp_path / "n.h5"
    c = Collector(CollectorOptions(output=out, modes=("metrics",), config=config_mod.defaults(), pid=sleeper.pid,
                                   control_socket=tmp_path / "c.sock", use_scontrol=False),
                  sources=[ClockSource(1.0), Behind()])
    c.catch_up = CatchUp(10, group)  # as _lower_priority sets it in a collector that leads its session
    c.start()
    try:
        deadline = time.monotonic() + 10
        while group.read_text() != "0" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group.read_text() == "0"
        assert c.status()["catch_up"]["lifts"] == 1
    finally:
        c.request_stop("test")
        c.shutdown()
    with h5py.File(out, "r") as f:
        cpu = json.loads(f.attrs["collector_cpu_json"])
    assert cpu["catch_up"]["lifts"] == 1 and cpu["catch_up"]["lifted_s"] > 0
