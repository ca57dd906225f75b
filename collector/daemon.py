"""The collector process: source threads -> bounded rings -> one writer thread -> node HDF5 file.

Threads and why:
  * one per source, so a slow or hung source (an NVML call stuck in the driver) delays only itself;
  * the process tracker, which keeps the job's pid set current for the sources;
  * the writer, the only thread that touches HDF5 (h5py serialises all calls on one global lock,
    so a second writer thread would only contend);
  * the control socket server (collector/control.py);
  * the main thread, which waits for SIGINT/SIGTERM, the duration or a `seal` request, then runs
    the shutdown: final samples, last drain, seal.
Every failure is recorded (log, /diagnostics/errors, `status`) and none reaches the job: the job
does not know we exist. Output trouble (missing directory, read-only, disk full) turns the state
to "error"; what was flushed before stays readable.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

# numpy.ma loaded now, as the collector starts (before the prolog lets the job run): numpy 2.x's
# np.unique loads it at its first call (np.ma.is_masked), which was a stacks drain's inside the
# job, 10-55 ms of CPU on a rank's core
import numpy as np
import numpy.ma

from gpuprof.collector import environment as env
from gpuprof.collector import schema
from gpuprof.collector.catchup import CatchUp, autogroup_nice, parse_autogroup
from gpuprof.collector.errors import CollectorError
from gpuprof.collector.osthread import named_thread
from gpuprof.collector.ring import Ring, split_capacity
from gpuprof.collector.schema import Table
from gpuprof.collector.sources.base import Batch, Source, SourceContext, SourceUnavailable
from gpuprof.collector.sources.clock import ClockSource, clock_pair
from gpuprof.collector.writer import NodeMeta, NodeTraceWriter

log = logging.getLogger("gpuprof.collector")

MAX_STATUS_ERRORS = 20
ERROR_REPEAT_S = 10.0  # the same (source, message) is recorded at most once per this interval
MAX_BACKOFF_S = 30.0
JOB_CHECK_MAX_S = 600.0  # longest wait between two questions to Slurm about the job (_watch_job)
SOURCE_STOP_TIMEOUT_S = 3.0
TRACKER_RING = "processes"
DIAG_RING = "diagnostics"


def monotonic_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def lower_priority(nice: int, proc_self: Path = Path("/proc/self")) -> list[str]:
    """Lower this process to `nice` (never raise it), before its threads start (they inherit it),
    and its autogroup with it when it leads its own session: what failed, in words.

    Why the autogroup: with kernel.sched_autogroup_enabled (Debian's kernels, and this VM), every
    session is a scheduling group of its own, and a nice value only weighs threads against others
    of the same session. The prolog starts the collector in a session of its own, so its nice
    alone gave it the same share as the job's ranks: measured with two busy loops pinned to one
    core in two sessions, 49.7 % against 50.3 % at nice 10; with the group's nice at 10, 9.8 %
    against 90.3 %. The group's nice (/proc/self/autogroup) is written only by a session leader:
    anyone else would lower the session it was started from (an operator's shell). Where the
    process sits in a cgroup with the cpu controller the kernel does not use the autogroup, and
    the write changes nothing."""
    problems: list[str] = []
    try:
        if nice > os.getpriority(os.PRIO_PROCESS, 0):
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        problems.append(f"cannot set nice {nice}: {e}")
    if os.getsid(0) != os.getpid():
        return problems
    group = proc_self / "autogroup"
    try:
        text = group.read_text()  # "/autogroup-123 nice 0"
    except FileNotFoundError:
        return problems  # a kernel without CONFIG_SCHED_AUTOGROUP
    except OSError as e:
        return [*problems, f"{group}: unreadable: {e}"]
    current = parse_autogroup(text)
    if current is None:
        return [*problems, f"{group}: unexpected contents {text.strip()!r}"]
    if nice > current:
        try:
            group.write_text(str(nice))
        except OSError as e:
            problems.append(f"{group}: cannot set the session's nice to {nice}: {e}")
    return problems


def run_as_batch() -> list[str]:
    """Put this thread under SCHED_BATCH (its nice kept), before the collector's threads start
    (they inherit it): what failed, in words.

    Why: the kernel never lets a SCHED_BATCH thread that wakes preempt the task running on its CPU
    (check_preempt_wakeup_fair); it runs when that task yields, blocks or ends its slice. On a node
    whose every core runs a rank, about a third of the collector's CPU preempted a computing rank
    (bench_slowdown --displaced), and the job loses all of that; under SCHED_BATCH the collector
    runs mostly while a rank polls in sched_yield. Measured on GROMACS, 6 interleaved pairs
    (docs/collector.md, "SCHED_BATCH"): the time taken from computing ranks halved, from 0.33 to
    0.16 % of the run, and the upper bound of what the ranks lost (that, and what ran while a rank
    polled that then had work) fell in every pair."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as e:
        return [f"cannot run under SCHED_BATCH: {e}"]
    return []


def next_tick(now: float, interval: float) -> float:
    """The next multiple of `interval` on the monotonic clock after `now`.

    Every source ticks on the same grid, so sources of the same rate wake at the same instants
    (their rows share timestamps, and slower rates fall on the same instants too). Why: on the
    VMs measured a wake-up with cold caches costs several times the work it does, and the
    collector's CPU time followed the number of distinct wake-ups more than the work; one wake
    for all sources instead of one each cut it (docs/collector.md). A source that fell behind
    skips the missed ticks instead of bursting."""
    return (math.floor(now / interval) + 1) * interval


def next_backoff(backoff: float, interval: float) -> float:
    """A failing source's wait before its next sample: its interval, then doubled, at most
    MAX_BACKOFF_S."""
    return min(MAX_BACKOFF_S, max(interval, backoff * 2))


@dataclass
class CollectorOptions:
    output: Path
    modes: tuple[str, ...]
    config: dict[str, dict[str, Any]]
    job_id: str | None = None
    node: str | None = None
    uid: int | None = None
    pid: int | None = None
    duration_s: float | None = None
    control_socket: Path | None = None
    socket_mode: int = 0o600
    nice: int | None = None
    use_scontrol: bool = True
    cgroup_root: str = "/sys/fs/cgroup"


class _Wake(threading.Event):
    """A source's wake-up. Once the source has joined a drain group, setting it also wakes the
    group's thread, which samples the members whose own wake-up is set."""

    def __init__(self) -> None:
        super().__init__()
        self.also: threading.Event | None = None

    def set(self) -> None:
        super().set()
        also = self.also
        if also is not None:
            also.set()


@dataclass
class _DrainGroup:
    """Sources sampled one after the other on one thread (`drains-1s`), every interval_s on
    the tick grid: those whose class says `shares_drain_thread` and whose interval (known once
    started) is the group's. Why: on the VMs measured each Python thread's wake-up costs about
    0.1 ms of CPU beside its work (cold caches on cores the job keeps busy, the GIL handed
    over), as much as the clock's or the host's whole drain; the four drains of the default modes
    that run once a second then wake once instead of four times (docs/collector.md, "The
    collector's CPU a second: five cuts"). Members are started in their own threads (attaching goes on
    in parallel) and join when started; a member's failure is its own (its back-off, its
    errors), but a member stuck in a call holds the others back, so only sources whose sample
    cannot wedge share (not NVML's, not the fast path's, which is woken by its rings)."""

    interval_s: float
    wake: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    members: list[_SourceState] = field(default_factory=list)
    closed: bool = False  # the thread is finishing: a source started later runs its own loop
    thread: threading.Thread | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)  # thread CPU of each member's samples so far


@dataclass
class _SourceState:
    source: Source
    ring: Ring
    thread: threading.Thread | None = None
    status: str = "starting"
    stopped: threading.Event = field(default_factory=threading.Event)
    # set to end the wait before the next sample early: at stop, and at a flush request, so that a
    # source drained once a second (a native sampling thread's rows) hands over what it holds
    wake: _Wake = field(default_factory=_Wake)
    passes: int = 0  # samples completed (under Collector._pass_cond)
    attached_ns: int | None = None  # CLOCK_MONOTONIC when start() returned (the probe is in place)
    late: dict[str, Any] | None = None  # set when a probe source attached after the job's first process


# Sources each mode brings beyond the clock: (module, class). Constructed without arguments, or by
# the class's from_config(config) where it has one (for what must be known before they start: the
# node file's rates_json is written as the collector starts); their start() reads the config.
# Importing a module may fail (no BCC): that source is then reported unavailable and the others run.
MODE_SOURCES: dict[str, tuple[tuple[str, str], ...]] = {
    "metrics": (),  # built below: they take their rates from the config at construction
    "collectives": (
        ("gpuprof.collector.sources.bpf_collectives", "BpfCollectivesSource"),
        ("gpuprof.collector.sources.fastpath", "FastpathSource"),
    ),
    "stacks": (
        ("gpuprof.collector.sources.bpf_stacks", "BpfStacksSource"),
        ("gpuprof.collector.sources.bpf_offcpu", "BpfOffcpuSource"),
    ),
    "kernels": (
        ("gpuprof.collector.sources.bpf_kernels", "BpfKernelsSource"),
        # CUPTI's kernel times cross the fast path's rings (one source drains them for both modes)
        ("gpuprof.collector.sources.fastpath", "FastpathSource"),
    ),
}


def default_sources(modes: tuple[str, ...], config: dict[str, dict[str, Any]]) -> list[Source]:
    """The sources the modes ask for (MODE_SOURCES), in a stable order."""
    sources: list[Source] = [ClockSource(float(config["collector"]["clock_interval_s"]))]
    if "metrics" in modes:
        from gpuprof.collector.sources.host import HostSource
        from gpuprof.collector.sources.nvml import NvmlSource

        sources.append(HostSource(float(config["sources.host"]["rate_hz"]), threaded=True))
        sources.append(NvmlSource(config["sources.nvml"], threaded=True))
    seen: set[tuple[str, str]] = set()
    for mode in modes:
        for module_name, class_name in MODE_SOURCES.get(mode, ()):
            if (module_name, class_name) in seen:
                continue
            seen.add((module_name, class_name))
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                sources.append(UnavailableSource(f"{module_name}.{class_name}", f"cannot import: {e}"))
                continue
            cls = getattr(module, class_name)
            sources.append(cls.from_config(config) if hasattr(cls, "from_config") else cls())
    return sources


def _source_drops(source: Source) -> int:
    counter = getattr(source, "drops", None)
    if counter is None:
        return 0
    try:
        return int(counter())
    except Exception as e:  # noqa: BLE001 - a counter read as its source stops (its BPF object freed) must not cost the seal
        # 0 here; Collector.drops keeps the running maximum, so the last value read stays
        log.warning("drop counter of %s unreadable: %s: %s", source.name, type(e).__name__, e)
        return 0


class UnavailableSource(Source):
    """Stands for a source whose module cannot even be imported, so the reason reaches the file."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name.rsplit(".", 1)[-1]
        self.reason = reason

    def start(self, ctx: SourceContext) -> None:
        raise SourceUnavailable(self.reason)

    def sample(self, now_ns: int) -> list[Batch]:
        return []


class Collector:
    """One node's collector for one job (or one process tree)."""

    def __init__(self, opts: CollectorOptions, sources: list[Source] | None = None) -> None:
        from gpuprof.collector.proctrack import ProcessTracker

        self.opts = opts
        self.cfg = opts.config["collector"]
        self.catch_up = CatchUp(0, None)  # lifts the lowered priority while falling behind (_lower_priority)
        self.sources = sources if sources is not None else default_sources(opts.modes, opts.config)
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise CollectorError(f"two sources share a name: {names}")
        shares = {s.name: s.ring_share for s in self.sources} | {TRACKER_RING: 1, DIAG_RING: 1}
        caps = split_capacity(int(self.cfg["memory_limit_mb"]), shares)
        self._states = {s.name: _SourceState(s, Ring(s.name, caps[s.name])) for s in self.sources}
        self._groups: dict[float, _DrainGroup] = {}  # by interval (_join_group)
        self._groups_lock = threading.Lock()
        self._tracker_ring = Ring(TRACKER_RING, caps[TRACKER_RING])
        self._diag_ring = Ring(DIAG_RING, caps[DIAG_RING])
        self.tracker = ProcessTracker(
            job_id=opts.job_id,
            node=opts.node,
            uid=opts.uid,
            root_pid=opts.pid,
            cgroup_root=opts.cgroup_root,
            use_scontrol=opts.use_scontrol,
        )
        tables: list[Table] = list(schema.tables_for_modes(opts.modes))
        for s in self.sources:
            tables.extend(t for t in s.tables if t not in tables)
        self.tables = tuple(tables)

        self._lock = threading.Lock()
        self.state = "starting"  # starting -> recording -> sealed, or -> error
        self._errors: list[dict[str, Any]] = []
        self._last_error_at: dict[tuple[str, str], float] = {}
        self._records: dict[str, int] = {}
        self._drops_written: dict[str, int] = {}
        self._source_drops_max: dict[str, int] = {}
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self._sources_stop = threading.Event()
        self._writer_wake = threading.Event()
        self._writer_seal = threading.Event()
        self._flush_cond = threading.Condition()
        self._pass_cond = threading.Condition()
        self._flush_seq = 0
        self._flush_requested = 0
        self.sealed_event = threading.Event()
        self.finished_event = threading.Event()  # writer thread done (sealed or error)
        self._writer: NodeTraceWriter | None = None
        self._threads: list[threading.Thread] = []
        self._control: Any = None
        self._fatal = ""
        self._abandoned_writer: NodeTraceWriter | None = None
        self._first_process_ns: int | None = None  # start of the job's first process seen (monotonic)
        self._startup_cpu_s: float | None = None  # the CPU used until no source was starting (_note_started)
        self._cpu_at_stop: dict[str, float] = {}  # thread_cpu_s() when the sources were told to stop
        self._no_process_since: float | None = None  # monotonic, while the job has no process here
        self._last_job_check: float | None = None
        self._slurm_live_at: float | None = None  # monotonic, Slurm's last 'the job runs'
        self._live_answers = 0  # 'the job runs' answers since the job last had a process here
        # Test hook (collector.test_slow_attach_s): every source but the clock starts this much later.
        self._slow_attach_s = float(self.cfg.get("test_slow_attach_s", 0.0))

    # --- reporting (any thread) -------------------------------------------------------------------
    def report_error(self, source: str, message: str) -> None:
        now = time.monotonic()
        key = (source, message)
        with self._lock:
            last = self._last_error_at.get(key)
            if last is not None and now - last < ERROR_REPEAT_S:
                return
            self._last_error_at[key] = now
            t_ns = monotonic_ns()
            self._errors.append({"t_ns": t_ns, "source": source, "message": message})
            del self._errors[:-MAX_STATUS_ERRORS]
        log.warning("%s: %s", source, message)
        row = schema.DIAG_ERRORS.empty(1)
        row[0] = (t_ns, source.encode()[:32], message.encode("utf-8", "replace")[:240])
        self._diag_ring.push(schema.DIAG_ERRORS, row)

    def report_missing(self, source: str, device: int, metric: str, reason: str) -> None:
        row = schema.DIAG_MISSING.empty(1)
        row[0] = (monotonic_ns(), source.encode()[:32], device, metric.encode()[:32], reason.encode()[:96])
        self._diag_ring.push(schema.DIAG_MISSING, row)

    def _set_error(self, message: str) -> None:
        log.error("%s", message)
        self.report_error("writer", message)
        with self._lock:
            self.state = "error"
            self._fatal = message
        self._stop_sources()  # nothing can be written: stop costing the job anything

    # --- status (control socket) ------------------------------------------------------------------
    def drops(self) -> dict[str, int]:
        # Records lost before they reached our rings (a full BPF ring buffer, a full interposer
        # ring) count as well: a source that can lose data says how much through drops().
        # Kept as a running maximum: a source's counter goes away with it (rings removed at stop).
        for name, st in self._states.items():
            self._source_drops_max[name] = max(self._source_drops_max.get(name, 0), _source_drops(st.source))
        d = {name: st.ring.dropped + self._source_drops_max[name] for name, st in self._states.items()}
        d[TRACKER_RING] = self._tracker_ring.dropped
        d[DIAG_RING] = self._diag_ring.dropped
        return d

    @property
    def output(self) -> Path:
        """The node file this collector writes."""
        return self.opts.output

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "state": self.state,
                "file": str(self.opts.output),
                "records": dict(self._records),
                "drops": self.drops(),
                "errors": list(self._errors),
                "sources": {n: st.status for n, st in self._states.items()},
                "attach": self.attach_state(),
                "attached": all(st.status != "starting" for st in self._states.values()),
                "late_sources": sorted(n for n, st in self._states.items() if st.late),
                "source_info": self._source_info(),
                "pids": len(self.tracker.pids()),
                "process_tracking": self.tracker.method,
                "pid": os.getpid(),
                "thread_cpu_s": thread_cpu_s(),
                "drain_cpu_s": self.drain_cpu_s(),
                "catch_up": self.catch_up.summary(),
                **({"error": self._fatal} if self.state == "error" else {}),
            }

    def attach_state(self) -> dict[str, dict[str, Any]]:
        """Per source: whether it is in place yet ("pending" while it starts), since when, and
        whether it came too late to see the job's first processes (docs/trace-format.md attach_json)."""
        out: dict[str, dict[str, Any]] = {}
        for n, st in self._states.items():
            state = ("pending" if st.status == "starting" else "attached" if st.attached_ns is not None
                     else st.status.split(":", 1)[0])
            out[n] = {"state": state, "attached_ns": st.attached_ns, "probe": bool(st.source.attaches),
                      "late": st.late is not None, **(st.late or {})}
            late_libs = st.source.late_attachments()
            if late_libs:
                out[n]["late_libraries"] = late_libs[:64]
        return out

    def _source_info(self) -> dict[str, Any]:
        out = {}
        for n, st in self._states.items():
            try:
                info = st.source.summary()
            except (OSError, ValueError, AttributeError, RuntimeError) as e:  # a source's state mid-change
                info = {"error": f"{type(e).__name__}: {e}"}
            if info is not None:
                out[n] = info
        return out

    def _note_started(self) -> None:
        """Once no source is starting any more: the collector's CPU so far is its start-up's
        (imports, the BPF compile, the attaches), kept for collector_cpu_json at seal."""
        with self._lock:
            if self._startup_cpu_s is None and all(st.status != "starting" for st in self._states.values()):
                self._startup_cpu_s = process_cpu_s()

    def _mark_attached(self, st: _SourceState) -> None:
        """The source's probes are in place now; a probe source that missed job processes is late."""
        st.attached_ns = monotonic_ns()
        if not st.source.attaches:
            return
        pids = sorted(self.tracker.pids())
        first = self._first_process_ns
        if first is None and pids:
            first = self._note_first_process(pids)
        if first is None:
            return  # no job process yet: in place before the job runs
        st.late = {
            "first_process_ns": first,
            "late_by_s": round((st.attached_ns - first) / 1e9, 6),
            "pids_before": pids[:64],
            "may_have_missed": MISSED.get(st.source.name, "what the job did before attached_ns"),
        }
        self.report_error(st.source.name, f"attached late at t_ns={st.attached_ns}, "
                          f"{st.late['late_by_s']:.3f} s after the job's first process: "
                          f"{st.late['may_have_missed']}"[:240])

    def _note_first_process(self, pids: list[int]) -> int | None:
        starts = [t for t in (process_start_ns(p) for p in pids) if t is not None]
        self._first_process_ns = min(starts) if starts else monotonic_ns()
        return self._first_process_ns

    def request_flush(self, timeout_s: float = 10.0) -> bool:
        """Ask the sources for what they hold, then the writer for a drain+flush; True once the
        flush happened."""
        deadline = time.monotonic() + timeout_s
        self._sample_all_now(min(SOURCE_STOP_TIMEOUT_S, timeout_s / 2))
        timeout_s = max(0.0, deadline - time.monotonic())
        with self._flush_cond:
            if self.state != "recording":
                return False
            self._flush_requested += 1
            target = self._flush_requested
            self._writer_wake.set()
            return self._flush_cond.wait_for(
                lambda: self._flush_seq >= target or self.state != "recording", timeout_s
            ) and self._flush_seq >= target

    def _sample_all_now(self, timeout_s: float) -> None:
        """Every running source takes one more sample now (a source that samples on a native
        thread hands over its rows); waits for each at most until timeout_s (a stuck source is
        not waited for)."""
        running = [st for st in self._states.values() if st.status == "running"]
        with self._pass_cond:
            before = {id(st): st.passes for st in running}
        for st in running:
            st.wake.set()
        with self._pass_cond:
            self._pass_cond.wait_for(lambda: all(st.passes > before[id(st)] or st.stopped.is_set()
                                                 for st in running), timeout_s)

    def _stop_sources(self) -> None:
        # the threads' CPU before the sources' threads (and their native ticks) end and leave /proc
        self._cpu_at_stop = thread_cpu_s()
        self._sources_stop.set()
        for st in self._states.values():
            st.wake.set()

    def request_stop(self, reason: str) -> None:
        if not self.stop_event.is_set():
            self.stop_reason = reason
            log.info("stopping: %s", reason)
        self.stop_event.set()

    # --- threads ------------------------------------------------------------------------------------
    def _ctx(self, st: _SourceState) -> SourceContext:
        return SourceContext(
            job_id=self.opts.job_id or "",
            node=self.opts.node or "",
            modes=self.opts.modes,
            config=self.opts.config,
            pids=self.tracker.pids,
            recent_pids=self.tracker.recent_pids,
            cgroup_dirs=self.tracker.cgroup_dirs,
            report_error=self.report_error,
            report_missing=self.report_missing,
            uid=self.opts.uid,
            request_sample=st.wake.set,
        )

    def _push(self, st: _SourceState, batches: Any) -> None:
        for table, rows in batches:
            st.ring.push(table, rows)
        if st.ring.queued_bytes * 2 > st.ring.capacity_bytes:
            self._writer_wake.set()  # half full: drain early rather than drop
        self.catch_up.observe(max(st.source.fill, st.ring.queued_bytes / st.ring.capacity_bytes))

    def _source_loop(self, st: _SourceState) -> None:
        src = st.source
        # test hook: a deliberately slow attach (tests/test_security.py, test_hooks_e2e.py)
        if (self._slow_attach_s > 0 and not isinstance(src, ClockSource)
                and self._sources_stop.wait(self._slow_attach_s)):
            st.status = "stopped"
            st.stopped.set()
            return
        try:
            src.start(self._ctx(st))
        except SourceUnavailable as e:
            st.status = f"unavailable: {e}"
            self.report_error(src.name, f"unavailable: {e}")
            self._note_started()
            st.stopped.set()
            return
        except Exception as e:  # noqa: BLE001 - a broken source must not take the collector down
            st.status = f"failed: {type(e).__name__}: {e}"
            self.report_error(src.name, f"start failed: {type(e).__name__}: {e}")
            self._note_started()
            st.stopped.set()
            return
        self._mark_attached(st)
        st.status = "running"
        self._note_started()
        if getattr(src, "shares_drain_thread", False) and self._join_group(st):
            return  # sampled, finished and stopped by the group's thread from now on
        interval = max(0.001, float(src.interval_s))
        backoff = 0.0
        while not self._sources_stop.is_set():
            st.wake.clear()  # before the sample: a wake during it means one more sample after it
            if self._sample_once(st):
                backoff = 0.0
            else:
                backoff = next_backoff(backoff, interval)
            now = time.monotonic()
            wait_s = next_tick(now + backoff, interval) - now
            if src.retry_s is not None and not backoff:
                wait_s = min(wait_s, src.retry_s)
            st.wake.wait(wait_s)
        self._finish_source(st)

    def _sample_once(self, st: _SourceState) -> bool:
        """One sample of the source into its ring (False: it failed, reported), counted as a pass."""
        ok = True
        try:
            self._push(st, st.source.sample(monotonic_ns()))
        except Exception as e:  # noqa: BLE001 - record, back off, go on
            ok = False
            self.report_error(st.source.name, f"sample failed: {type(e).__name__}: {e}")
        with self._pass_cond:
            st.passes += 1
            self._pass_cond.notify_all()
        return ok

    def _finish_source(self, st: _SourceState) -> None:
        """The source's final rows (unless the collector failed), then its stop."""
        src = st.source
        if self.state != "error":
            try:
                self._push(st, src.final(monotonic_ns()))
            except Exception as e:  # noqa: BLE001
                self.report_error(src.name, f"final sample failed: {type(e).__name__}: {e}")
        try:
            src.stop()
        except Exception as e:  # noqa: BLE001
            self.report_error(src.name, f"stop failed: {type(e).__name__}: {e}")
        st.status = "stopped"
        st.stopped.set()

    def _join_group(self, st: _SourceState) -> bool:
        """Hand a started source to the drain group of its interval (made, and its thread started,
        by the first); False when the sources are stopping: the caller finishes it itself."""
        interval = max(0.001, float(st.source.interval_s))
        with self._groups_lock:
            g = self._groups.get(interval)
            if g is None:
                g = self._groups[interval] = _DrainGroup(interval)
            with g.lock:
                if g.closed or self._sources_stop.is_set():
                    return False
                g.members.append(st)
                st.wake.also = g.wake
            if g.thread is None:
                ms = round(interval * 1000)  # the kernel's name keeps 15 characters: gp-drains-1s
                g.thread = self._spawn(self._group_loop, f"drains-{ms // 1000}s" if ms % 1000 == 0 else f"drains-{ms}ms", g)
        st.wake.set()  # its first sample now, as on a thread of its own
        return True

    def _group_loop(self, g: _DrainGroup) -> None:
        """A drain group's thread: at each tick every member not backing off, between ticks the
        members whose wake-up was set (a flush request, the stop); then each member's final rows
        and stop, in the order they joined."""
        backoff: dict[str, float] = {}  # a failing member's back-off, as _source_loop's
        not_before: dict[str, float] = {}  # and the tick it waits for
        next_at = next_tick(time.monotonic(), g.interval_s)
        while not self._sources_stop.is_set():
            g.wake.clear()
            timed = time.monotonic() >= next_at
            with g.lock:
                members = list(g.members)
            for st in members:
                name = st.source.name
                if not (st.wake.is_set() or (timed and time.monotonic() >= not_before.get(name, 0.0))):
                    continue
                st.wake.clear()  # before the sample: a wake during it means one more sample after it
                t0 = time.thread_time()
                ok = self._sample_once(st)
                g.cpu_s[name] = g.cpu_s.get(name, 0.0) + time.thread_time() - t0
                if ok:
                    backoff.pop(name, None)
                    not_before.pop(name, None)
                else:
                    b = backoff[name] = next_backoff(backoff.get(name, 0.0), g.interval_s)
                    not_before[name] = next_tick(time.monotonic() + b, g.interval_s)
            if timed:
                next_at = next_tick(time.monotonic(), g.interval_s)
            g.wake.wait(max(0.0, next_at - time.monotonic()))
        with g.lock:
            g.closed = True
            members = list(g.members)
        for st in members:
            self._finish_source(st)

    def drain_cpu_s(self) -> dict[str, float]:
        """CPU seconds of each grouped source's samples so far (their thread's is the group's)."""
        with self._groups_lock:
            groups = list(self._groups.values())
        return {name: round(v, 4) for g in groups for name, v in sorted(g.cpu_s.items())}

    def _tracker_loop(self) -> None:
        interval = float(self.cfg["process_scan_interval_s"])
        while True:
            self._scan_processes()
            self._watch_job()
            # on stop_event, not on the sources' stop: after a write error (disk full) the sources
            # stop but the collector stays to tell the epilog why, and still watches its job
            if self.stop_event.wait(interval):
                return

    def _watch_job(self) -> None:
        """Stop (and seal) when the job is over but no epilog came (docs/collector.md, "When the
        job is gone"). Slurm is asked only while the job has no process on this node, at most
        every collector.job_check_interval_s; in doubt (Slurm unreachable) the collector goes on,
        up to collector.orphan_timeout_s without a process and without an answer."""
        check_s = float(self.cfg.get("job_check_interval_s", 0.0))
        if not self.opts.job_id or not self.opts.use_scontrol or check_s <= 0 or self.stop_event.is_set():
            return
        now = time.monotonic()
        if self.tracker.pids():
            self._no_process_since = None
            self._live_answers = 0
            return
        if self._no_process_since is None:
            self._no_process_since = now
        # each 'still running' doubles the wait, up to JOB_CHECK_MAX_S: thousands of idle nodes of
        # one job (no PrologFlags=Contain, a long serial phase on its first node) must not flood
        # slurmctld; a job that ended is still noticed within that bound
        wait_s = min(check_s * 2 ** self._live_answers, max(check_s, JOB_CHECK_MAX_S))
        if self._last_job_check is not None and now - self._last_job_check < wait_s:
            return
        self._last_job_check = now
        from gpuprof.collector.jobwatch import job_state

        verdict, why = job_state(self.opts.job_id)
        if verdict == "gone":
            self.report_error("job", f"{why} and no epilog sealed this collector: sealing and stopping")
            self.request_stop(f"{why} (no epilog came)")
            return
        if verdict == "live":
            self._slurm_live_at = now
            self._live_answers += 1
            return
        orphan_s = float(self.cfg.get("orphan_timeout_s", 0.0))
        since = max(self._no_process_since, self._slurm_live_at or 0.0)
        if orphan_s > 0 and now - since >= orphan_s:
            self.report_error("job", f"no job process on this node for {orphan_s:.0f} s and Slurm cannot say "
                              f"whether the job runs ({why}): sealing and stopping")
            self.request_stop("orphaned: no job process and no answer from Slurm")

    def _scan_processes(self) -> None:
        try:
            rows = self.tracker.scan(monotonic_ns())
            if len(rows):
                self._tracker_ring.push(schema.PROCESS_EVENTS, rows)
            if self._first_process_ns is None:
                pids = sorted(self.tracker.pids())
                if pids:
                    self._note_first_process(pids)
        except Exception as e:  # noqa: BLE001 - a failed scan must not end the tracker; it is recorded
            self.report_error("processes", f"scan failed: {type(e).__name__}: {e}")

    def _rings(self) -> list[Ring]:
        return [st.ring for st in self._states.values()] + [self._tracker_ring, self._diag_ring]

    def _drain_into_writer(self, w: NodeTraceWriter) -> None:
        for ring in self._rings():
            drained = ring.drain_parts()
            for path, (_table, parts) in drained.batches.items():
                if path not in w.tables:
                    self.report_error(ring.name, f"table {path} is not in this file; rows dropped")
                    continue
                w.append_parts(path, parts)
        drops = self.drops()
        changed = [(s, n) for s, n in drops.items() if n != self._drops_written.get(s, 0)]
        if changed:
            rows = schema.DIAG_DROPS.empty(len(changed))
            now = monotonic_ns()
            for i, (s, n) in enumerate(changed):
                rows[i] = (now, s.encode()[:32], n)
                self._drops_written[s] = n
            w.append(schema.DIAG_DROPS.path, rows)
        with self._lock:
            self._records = {p: w.rows(p) for p in w.tables}

    def _open_writer(self, meta: NodeMeta, start: tuple[int, int, int]) -> NodeTraceWriter:
        """The writer the writer thread feeds: the node file; continuous mode (collector/continuous.py)
        puts its retention in its place."""
        return NodeTraceWriter(
            self.opts.output,
            meta,
            self.tables,
            compression=str(self.cfg["compression"]),
            start_monotonic_ns=start[0],
            start_realtime_ns=start[1],
        )

    def _writer_loop(self, meta: NodeMeta, start: tuple[int, int, int]) -> None:
        opts = self.opts
        try:
            w = self._open_writer(meta, start)
        except (OSError, RuntimeError, ValueError) as e:
            self._set_error(f"cannot create node file {opts.output}: {_reason(e)}")
            self.finished_event.set()
            return
        self._writer = w
        try:
            first = schema.CLOCK_PAIRS.empty(1)
            first[0] = start
            w.append(schema.CLOCK_PAIRS.path, first)
            w.flush()
            with self._lock:
                self.state = "recording"
                self._records = {p: w.rows(p) for p in w.tables}
            log.info("recording to %s", opts.output)
            flush_every = min(5.0, float(self.cfg["flush_interval_s"]))
            while not self._writer_seal.is_set():
                self._writer_wake.wait(flush_every)
                self._writer_wake.clear()
                with self._flush_cond:
                    target = self._flush_requested
                self._drain_into_writer(w)
                w.flush()
                with self._flush_cond:
                    self._flush_seq = target
                    self._flush_cond.notify_all()
            # shutdown: sources have pushed their final rows
            self._drain_into_writer(w)
            w.seal(drops=self.drops(), extra=self._at_seal)
            with self._lock:
                self.state = "sealed"
            self.sealed_event.set()
            log.info("sealed %s", opts.output)
        except (OSError, RuntimeError, ValueError) as e:
            self._set_error(f"writing {opts.output} failed: {_reason(e)}; data up to the last flush is kept")
            # No close: after a failed write HDF5's close tries the same writes again and, on a full
            # disk, crashes the process (measured: SIGSEGV in libhdf5 1.14). The file on disk holds
            # everything up to the last good flush, readable with SWMR; we only keep the handle.
            self._abandoned_writer = w
        finally:
            with self._flush_cond:
                self._flush_cond.notify_all()
            self.finished_event.set()

    def _at_seal(self, f: Any) -> None:
        with self._lock:
            attach = self.attach_state()
        f.attrs["attach_json"] = json.dumps(attach, sort_keys=True)
        f.attrs["late_sources"] = json.dumps(sorted(n for n, a in attach.items()
                                                    if a["late"] or a.get("late_libraries")))
        # what profiling cost this node: the collector's own CPU, for the report and the operator
        total = process_cpu_s()
        by_thread = dict(self._cpu_at_stop)  # the threads that ended since, as they were then
        by_thread.update(thread_cpu_s())
        f.attrs["collector_cpu_json"] = json.dumps({
            "total_s": round(total, 3),
            "startup_s": None if self._startup_cpu_s is None else round(self._startup_cpu_s, 3),
            "after_startup_s": None if self._startup_cpu_s is None else round(total - self._startup_cpu_s, 3),
            "by_thread_s": {n: round(v, 4) for n, v in sorted(by_thread.items()) if v > 0},
            # the sources sampled on a shared drain thread (by_thread_s counts them as that thread)
            "drain_s": self.drain_cpu_s(),
            "catch_up": self.catch_up.summary(),
        }, sort_keys=True)
        for st in self._states.values():
            try:
                st.source.at_seal(f)
            except Exception as e:  # noqa: BLE001 - one source's end data must not cost the seal
                log.error("%s: at_seal failed: %s: %s", st.source.name, type(e).__name__, e)

    # --- lifecycle ----------------------------------------------------------------------------------
    def _lower_priority(self) -> None:
        """The nice, the autogroup's and the scheduling policy, before any thread starts; only in
        a collector process (the CLI always gives a nice): a collector run inside another program
        (tests') leaves that program's priority alone, as its calling thread is the program's."""
        if self.opts.nice is None:
            return
        for problem in lower_priority(self.opts.nice):
            log.warning("%s", problem)
        group = Path("/proc/self/autogroup")
        if os.getsid(0) == os.getpid() and autogroup_nice(group) == self.opts.nice:
            self.catch_up = CatchUp(self.opts.nice, group)
        for problem in run_as_batch() if self.cfg["sched_batch"] else []:
            log.warning("%s", problem)

    @staticmethod
    def _raise_fd_limit() -> None:
        """Soft RLIMIT_NOFILE up to the hard one: the host source keeps two descriptors per job
        thread open (collector/sources/host.py), and a job of 8 processes of 100 threads passes
        the usual soft limit of 1024. Past whatever limit remains, it reads by path instead."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            except (OSError, ValueError) as e:
                log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)

    def _meta(self) -> NodeMeta:
        # a source sampling on a native thread is drained less often than it samples: its rate is
        # the sampling one (sample_interval_s)
        rates = {s.name: round(1.0 / getattr(s, "sample_interval_s", s.interval_s), 6)
                 for s in self.sources if s.interval_s > 0}
        rates["processes"] = round(1.0 / float(self.cfg["process_scan_interval_s"]), 6)
        return NodeMeta(
            job_id=self.opts.job_id or (f"pid:{self.opts.pid}" if self.opts.pid else ""),
            node=self.opts.node or os.uname().nodename,
            modes=self.opts.modes,
            rates=rates,
            config=self.opts.config,
            job_nodelist=(env.get(env.SLURM_JOB_NODELIST) or env.get(env.SLURM_NODELIST) or "")
            if self.opts.job_id else "",
        )

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        t = named_thread(target, name, args)
        t.start()
        self._threads.append(t)
        return t

    def start(self) -> None:
        """Start every thread; returns at once. `run` is start + wait + shutdown."""
        self._lower_priority()
        self._raise_fd_limit()
        if self.opts.control_socket is not None:
            from gpuprof.collector.control import ControlServer

            # bound first: a socket that cannot be created is a start failure, before any file exists
            self._control = ControlServer(self, self.opts.control_socket, mode=self.opts.socket_mode)
        start = clock_pair()
        self._spawn(self._writer_loop, "writer", self._meta(), start)
        # the tracker's first scan runs before the sources start, so their first sample sees the pids
        self._scan_processes()
        self._spawn(self._tracker_loop, "tracker")
        for st in self._states.values():
            st.thread = self._spawn(self._source_loop, f"source-{st.source.name}", st)
        if self._control is not None:
            self._control.start()

    def shutdown(self) -> None:
        """Final samples, last drain, seal. Safe to call once the stop event is set."""
        self._stop_sources()
        deadline = time.monotonic() + SOURCE_STOP_TIMEOUT_S
        for st in self._states.values():
            if not st.stopped.wait(max(0.0, deadline - time.monotonic())):
                # stuck in a call we cannot interrupt (a hung driver): seal without its final rows
                self.report_error(st.source.name, "did not stop in time; its final samples are missing")
        try:
            rows = self.tracker.scan(monotonic_ns())
            if len(rows):
                self._tracker_ring.push(schema.PROCESS_EVENTS, rows)
        except Exception as e:  # noqa: BLE001
            self.report_error("processes", f"final scan failed: {type(e).__name__}: {e}")
        self.tracker.close()
        self._writer_seal.set()
        self._writer_wake.set()
        self.finished_event.wait()
        if self._control is not None:
            self._control.close()

    def run(self) -> int:
        """Run until SIGINT/SIGTERM, the duration, or a `seal` request. 0 when sealed, 1 on error."""
        installed = self._install_signals()
        try:
            self.start()
            self.stop_event.wait(self.opts.duration_s)
            if not self.stop_event.is_set():
                self.request_stop(f"duration {self.opts.duration_s} s reached")
            self.shutdown()
        finally:
            for sig, old in installed.items():
                signal.signal(sig, old)
        return 0 if self.state == "sealed" else 1

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, _frame: FrameType | None) -> None:
            self.request_stop(signal.Signals(signum).name)

        old: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handler)
        return old


# What a probe source that attached late cannot have seen (attach_json "may_have_missed").
MISSED = {
    "collectives_uprobe": "calls before attached_ns are missing; the sequence numbers of communicators that "
                          "existed before it count from the first call seen (exclude their early instances)",
    "stacks": "CPU samples before attached_ns",
    "offcpu": "off-CPU episodes before attached_ns",
    "kernels": "CUDA launches and kernel names (module loads) before attached_ns",
}


def process_cpu_s() -> float:
    """CPU seconds (user + system) of this process, every thread, and of the children it waited for
    (the BPF compile's, the CFI table compiler's), so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each thread of this process, by thread name: the Python threads by their
    name (source-<name>, writer, tracker, ...), the native samplers by their kernel name
    (gp-tick-100ms, gp-nvml-tick; collector/osthread.py), others (BCC's) by their comm and id. For the
    benchmark's account of where the collector's time goes: the run time in ns from schedstat
    where the kernel has it (stat's utime + stime come in 10 ms clock ticks, too coarse for
    threads that use a few ms a second)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # the thread ended
        comm = data[data.find(b"(") + 1:data.rfind(b")")].decode(errors="replace")
        rest = data[data.rfind(b")") + 2:].split()
        cpu_s = (int(rest[11]) + int(rest[12])) / tick
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                cpu_s = int(f.read().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            pass  # no schedstat (CONFIG_SCHED_INFO off), or the thread ended: stat's clock ticks
        name = names.get(int(tid)) or (comm if comm.startswith("gp-") else f"{comm}/{tid}")
        out[name] = out.get(name, 0.0) + cpu_s
    return out


def process_start_ns(pid: int) -> int | None:
    """When a process started, on CLOCK_MONOTONIC (from /proc/PID/stat starttime, which counts from
    boot: CLOCK_BOOTTIME, equal to MONOTONIC but for time suspended since the process started)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    try:
        ticks = int(fields[19])
    except (IndexError, ValueError):
        return None
    boot_offset = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - monotonic_ns()
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK") - boot_offset


def _reason(e: BaseException) -> str:
    """A one-line reason from an OSError (strerror and errno name) or anything else."""
    if isinstance(e, OSError) and e.errno is not None:
        import errno as _errno

        return f"{_errno.errorcode.get(e.errno, e.errno)} ({e.strerror})"
    text = str(e)
    # h5py wraps ENOSPC and friends in messages like "Unable to ... (file write failed: ... errno = 28 ...)"
    if "errno = 28" in text or "No space left" in text:
        return f"ENOSPC (No space left on device): {text[:200]}"
    return f"{type(e).__name__}: {text[:240]}"


def rows_of(table: Table, items: list[tuple[Any, ...]]) -> np.ndarray:
    """A table's rows from tuples (helper for sources)."""
    return np.array(items, dtype=table.dtype) if items else table.empty(0)
