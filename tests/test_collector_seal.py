"""The seal survives a source whose counters go away as it stops.

Seen in CI and `make test` (2026-12-05): the stacks source's drop counter read its BPF map after the
object was freed (the source stopping in its own thread while the writer sealed), an IndexError
went up through the writer's seal and then through the control socket's status, and the epilog got
an empty reply: the node file stayed unsealed and reached the user as partial. Here a source does
the same on purpose, and the collector is sealed through its real control socket.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import h5py
import pytest

from gpuprof.collector import config as config_mod
from gpuprof.collector.control import request
from gpuprof.collector.daemon import Collector, CollectorOptions
from gpuprof.collector.sources.base import Batch, Source, SourceContext
from gpuprof.collector.sources.bpf_collectives import BpfCollectivesSource
from gpuprof.collector.sources.bpf_kernels import BpfKernelsSource
from gpuprof.collector.sources.bpf_offcpu import BpfOffcpuSource
from gpuprof.collector.sources.bpf_stacks import BpfStacksSource
from gpuprof.collector.sources.clock import ClockSource


class CounterGoesAway(Source):
    """Counts 3 drops while running; once stopping, its counter raises as a freed map's read did."""

    name = "goesaway"
    interval_s = 0.1

    def __init__(self) -> None:
        self.stopping = False

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx

    def sample(self, now_ns: int) -> list[Batch]:
        return []

    def stop(self) -> None:
        self.stopping = True

    def drops(self) -> int:
        if self.stopping:
            raise IndexError("list index out of range")  # as read_ring_drops(...)[0] on a freed map
        return 3


def test_a_counter_that_fails_at_stop_does_not_cost_the_seal(tmp_path: Path,
                                                            sleeper: subprocess.Popen[bytes]) -> None:
    sock = tmp_path / "c.sock"
    out = tmp_path / "n.h5"
    source = CounterGoesAway()
    c = Collector(CollectorOptions(output=out, modes=("metrics",), config=config_mod.defaults(), pid=sleeper.pid,
                                   control_socket=sock, use_scontrol=False),
                  sources=[ClockSource(1.0), source])
    c.start()
    try:
        deadline = time.monotonic() + 10
        while request(str(sock), "status", timeout_s=2.0)["state"] != "recording" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert request(str(sock), "status", timeout_s=2.0)["drops"]["goesaway"] == 3
        source.stopping = True  # its map freed, as when its stop ran first
        st = request(str(sock), "status", timeout_s=2.0)  # the counter raises now: answered all the same
        assert st["drops"]["goesaway"] == 3  # its last value, kept
        c.request_stop("test")
        shutdown_error: list[BaseException] = []
        try:
            c.shutdown()
        except BaseException as e:  # noqa: BLE001 - asserted below
            shutdown_error.append(e)
        assert not shutdown_error and c.state == "sealed", (shutdown_error, c.status())
    finally:
        if not c.finished_event.is_set():
            c.request_stop("test")
            c.shutdown()
    with h5py.File(out, "r") as f:
        assert f.attrs["sealed"] and json.loads(f.attrs["drops_json"])["goesaway"] == 3
    assert not os.path.exists(sock)


class Retrying(Source):
    """Samples every 60 s, but asks to be sampled again after 20 ms (retry_s) for its first 5."""

    name = "retrying"
    interval_s = 60.0

    def __init__(self) -> None:
        self.samples = 0
        self.retry_s = 0.02

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx

    def sample(self, now_ns: int) -> list[Batch]:
        self.samples += 1
        if self.samples >= 5:
            self.retry_s = None
        return []


def test_a_source_that_waits_for_something_is_sampled_again_soon(tmp_path: Path,
                                                                 sleeper: subprocess.Popen[bytes]) -> None:
    """Source.retry_s shortens the wait to the next sample (the fast path, for a ring whose header
    is being written); None: back to the interval."""
    source = Retrying()
    c = Collector(CollectorOptions(output=tmp_path / "n.h5", modes=("metrics",), config=config_mod.defaults(),
                                   pid=sleeper.pid, control_socket=tmp_path / "c.sock", use_scontrol=False),
                  sources=[ClockSource(1.0), source])
    c.start()
    try:
        deadline = time.monotonic() + 10
        while source.samples < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert source.samples == 5
        time.sleep(0.5)
        assert source.samples == 5  # the 60 s interval again
    finally:
        c.request_stop("test")
        c.shutdown()


class FreedWithHubDouble:
    """A test double of BpfHub for the drop counters: its per-CPU counter table reads as BCC's and
    our own Table do ((key, [per-CPU values]) items), and raises once the hub is released, as a read
    of a freed map did."""

    class Counter:
        def __init__(self, hub: FreedWithHubDouble, per_cpu: list[int]) -> None:
            self.hub, self.per_cpu = hub, per_cpu

        def items(self) -> list[tuple[Any, list[int]]]:
            if self.hub.released:
                raise IndexError("list index out of range")
            return [(ctypes.c_int(0), self.per_cpu)]

    def __init__(self, counter: bytes, per_cpu: list[int]) -> None:
        self.released = False
        self.bpf = {counter: self.Counter(self, per_cpu)}

    def release(self) -> None:
        self.released = True


class WithoutSwitchHubDouble:
    """A test double of BpfHub compiled without any source's switch: it has none of their maps
    (any read raises KeyError, as BCC's and our object's do) and counts its releases."""

    def __init__(self) -> None:
        self.releases = 0
        self.bpf: dict[bytes, Any] = {}

    def has(self, switch: str) -> bool:
        return False

    def release(self) -> None:
        self.releases += 1


@pytest.mark.parametrize("make", [
    lambda: BpfStacksSource(unwinder="frame_pointers"),
    lambda: BpfOffcpuSource(),
    lambda: BpfKernelsSource(),
    lambda: BpfCollectivesSource(("mpi",)),
], ids=["stacks", "offcpu", "kernels", "collectives"])
def test_a_bpf_source_lets_go_an_object_compiled_without_its_part(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's BPF object was compiled for other modes: the source says it is unavailable and
    lets the object go at once (the last user frees it), reading none of the maps it lacks."""
    from types import SimpleNamespace

    from gpuprof.collector import bpf_support
    from gpuprof.collector.sources.base import SourceUnavailable

    hub = WithoutSwitchHubDouble()
    monkeypatch.setattr(bpf_support, "acquire_hub", lambda modes, config, unwinder=None: hub)
    src = make()
    ctx = SimpleNamespace(modes=("metrics",), config=config_mod.defaults(), pids=lambda: set())
    with pytest.raises(SourceUnavailable, match="compiled without"):
        src.start(ctx)
    assert hub.releases == 1 and src.hub is None
    src.stop()  # the daemon stops every source it started or tried: nothing more to let go
    assert hub.releases == 1 and src.drops() == 0


@pytest.mark.parametrize("make, counter", [
    (lambda: BpfStacksSource(), b"gp_cpu_drops"),
    (lambda: BpfOffcpuSource(), b"gp_off_drops"),
    (lambda: BpfKernelsSource(), b"gp_launch_drops"),
    (lambda: BpfCollectivesSource(), b"gp_coll_drops"),
], ids=["stacks", "offcpu", "kernels", "collectives"])
def test_a_bpf_source_keeps_its_drops_after_stop(make: Any, counter: bytes) -> None:
    """Each BPF source's drop counter lives in its BPF object, which goes at stop: the count read
    at stop is what drops() answers after it (the seal's drops_json), not 0 and not an error."""
    src = make()
    src.hub = FreedWithHubDouble(counter, [2, 0, 5])
    assert src.drops() == 7
    src.stop()
    assert src.drops() == 7
