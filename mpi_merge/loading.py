"""Loading: node files -> per-node summaries (small, picklable), the only part that reads paths.

A summary holds what the job-wide analyses need of a node apart from its collective calls: the
binned series the straggler evidence and the HTML timelines use, per-GPU figures, diagnostics, and
the shape of each communicator the node took part in. Its size does not depend on how many nodes
the job had, so rank 0 can hold one per node. The calls themselves (`calls`) are filled for
library callers; the merge driver saves them to a file and drops them from the summary, and rank 0
loads them one node at a time. Bulk tables go from the node files to the job file by object copy on
the job file's writer (jobfile.py), never through a summary.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.errors import TraceFormatError
from gpuprof.collector.reader import NodeTrace, open_node_trace
from gpuprof.mpi_merge.matching import COLLECTIVE_SET

# The calls of one node, with times mapped to that node's CLOCK_REALTIME (ns since the epoch).
CALL_DTYPE = np.dtype(
    [
        ("comm_id", "<u8"), ("seq", "<u8"), ("comm_rank", "<i4"), ("comm_size", "<i4"), ("op", "u1"),
        ("bytes", "<u8"), ("root_or_peer", "<i4"), ("tag", "<i4"), ("pid", "<u4"),
        ("enter_rt", "<i8"), ("exit_rt", "<i8"), ("returned", "?"),
        # NCCL calls with device-side times (/collectives/device_times): enter/exit are then the
        # kernel's start and end on the GPU, and host_enter_rt the host's enqueue (else 0)
        ("device_timed", "?"), ("host_enter_rt", "<i8"),
    ]
)
# Tables a summary needs; the eBPF tables are added when the schema defines them.
SUMMARY_TABLES = (
    schema.CLOCK_PAIRS.path, schema.COLLECTIVE_CALLS.path, schema.GPU_DEVICES.path, schema.GPU_SAMPLES.path,
    schema.GPU_GPM.path, schema.HOST_PROCS.path, schema.HOST_NODE.path, schema.DIAG_ERRORS.path,
    schema.DIAG_MISSING.path, schema.DIAG_DROPS.path, schema.COMMUNICATORS.path, schema.DEVICE_TIMES.path,
)
MAX_BINS = 2000  # per series: enough for the HTML timelines and the straggler evidence
# The series the job-wide analysis reads (name suffixes): GPU activity for the straggler cause and
# the HTML timelines, the job's CPU use and run-queue time for the host cause. Other metrics stay in
# the node's tables in the job file; binning them would only grow every node's summary.
SUMMARY_SERIES = (":util_gpu", ":sm_activity", "host:cpu_cores", "offcpu/intervals:runnable_ns")
MAX_ERRORS = 20  # error messages a summary keeps (the report shows as many, and the total)


@dataclass
class Series:
    """A metric binned on the node's realtime clock: bin start times and bin means (NaN = no sample)."""

    name: str
    unit: str
    t_rt: np.ndarray  # int64 ns since the epoch, bin starts
    bin_ns: int
    values: np.ndarray  # float64


@dataclass
class ClockMap:
    """CLOCK_MONOTONIC -> CLOCK_REALTIME of one node, from its (monotonic, realtime) pairs, with the
    wall clock's steps taken out (clock_map_of)."""

    mono: np.ndarray  # int64
    offset: np.ndarray  # int64, realtime - monotonic at each pair, less the steps before it
    source: str  # "pairs" or "start attributes"
    steps: list[tuple[int, int]] = field(default_factory=list)  # (monotonic ns, step ns) removed

    def to_realtime(self, mono_ns: np.ndarray) -> np.ndarray:
        m = np.asarray(mono_ns).astype(np.int64)
        base = int(self.offset[0])
        if len(self.mono) == 1:
            return m + base
        # realtime - monotonic moves only at steps (taken out); the read noise and any slow change
        # left are interpolated between pairs
        delta = np.interp(m.astype(np.float64), self.mono.astype(np.float64), (self.offset - base).astype(np.float64))
        return m + base + np.round(delta).astype(np.int64)


def bins_overlapping(t_rt: np.ndarray, bin_ns: int, a: np.ndarray, b: np.ndarray, epoch_rt: int) -> np.ndarray:
    """[bins] bool: the bins (starts t_rt, realtime ns, each bin_ns long) that overlap any of the
    ranges [a, b) (aligned ns from epoch_rt; bins start on the node's realtime clock, whose error is
    nothing against a bin)."""
    t = (t_rt - epoch_rt).astype(np.float64)
    lo = np.searchsorted(t + bin_ns, a, side="right")
    hi = np.searchsorted(t, b, side="left")
    mark = np.zeros(len(t) + 1, np.int64)
    ok = hi > lo
    np.add.at(mark, lo[ok], 1)
    np.add.at(mark, hi[ok], -1)
    return np.cumsum(mark[:-1]) > 0


@dataclass
class OnCpuBins:
    """CPU samples of one process, binned like the node's series: per (bin, function) the samples
    whose innermost user frame is that function ("name (module)"); at most ON_CPU_TOP functions per
    bin, the rest counted under "(other)"."""

    t_rt: np.ndarray  # int64 bin starts, realtime ns
    bin_ns: int
    bin: np.ndarray  # [k] bin of each entry
    label: np.ndarray  # [k] index into labels
    count: np.ndarray  # [k] samples
    labels: list[str]

    def top(self, a: np.ndarray, b: np.ndarray, epoch_rt: int, n: int = 3) -> tuple[int, list[tuple[str, float]]]:
        """Samples in the bins overlapping any range [a, b) (aligned ns) and the n functions with the
        largest share of them."""
        in_bins = bins_overlapping(self.t_rt, self.bin_ns, a, b, epoch_rt)[self.bin]
        per = np.bincount(self.label[in_bins], weights=self.count[in_bins], minlength=len(self.labels))
        total = int(per.sum())
        order = np.argsort(-per, kind="stable")[:n]
        return total, [(self.labels[i], float(per[i]) / total) for i in order if total and per[i] > 0]


ON_CPU_TOP = 8


@dataclass
class NamedTimeBins:
    """Named intervals of one process, binned like the node's series: per (bin, name) the time in
    intervals of that name. NVTX ranges (`NodeSummary.phases`): a push/pop range counts exclusively
    (less the ranges nested in it, so a `step` around `forward` and `backward` holds only what is in
    neither), a start/end range (which may overlap anything) whole. CUDA kernels as they ran
    (`NodeSummary.kernels`): each execution's time on the GPU. An interval over several bins is
    shared among them by overlap. At most NAMED_TOP names per process, the longest; the rest under
    `other`."""

    t_rt: np.ndarray  # int64 bin starts, realtime ns
    bin_ns: int
    bin: np.ndarray  # [k] bin of each entry
    label: np.ndarray  # [k] index into labels
    ns: np.ndarray  # [k] time
    labels: list[str]
    left_out: int = 0  # intervals never closed (NVTX ranges still open at the end)

    def rates(self, a: np.ndarray, b: np.ndarray, epoch_rt: int) -> dict[str, float]:
        """ns per second of each name over the bins overlapping any range [a, b) (aligned ns)."""
        sel = bins_overlapping(self.t_rt, self.bin_ns, a, b, epoch_rt)
        n_bins = int(sel.sum())
        if not n_bins:
            return {}
        keep = sel[self.bin]
        per = np.bincount(self.label[keep], weights=self.ns[keep], minlength=len(self.labels))
        return {self.labels[i]: float(per[i]) / (n_bins * self.bin_ns / 1e9) for i in np.flatnonzero(per)}

    def totals_s(self) -> dict[str, float]:
        per = np.bincount(self.label, weights=self.ns, minlength=len(self.labels))
        return {self.labels[i]: float(per[i]) / 1e9 for i in np.flatnonzero(per)}


def named_time_bins(t0_rt: np.ndarray, t1_rt: np.ndarray, weight_ns: np.ndarray, names: list[str], other: str,
                    tb: np.ndarray, bin_ns: int, nb: int, left_out: int = 0) -> NamedTimeBins:
    """NamedTimeBins of intervals [t0_rt, t1_rt) (realtime ns) weighing weight_ns each (their own
    length, or less: an NVTX range's exclusive time), named `names`."""
    labels, label = np.unique(np.array(names, dtype=object), return_inverse=True)
    label = label.ravel().astype(np.int64)
    w = np.asarray(weight_ns, np.float64)
    tot = np.bincount(label, weights=w, minlength=len(labels))
    top = np.argsort(-tot, kind="stable")[:NAMED_TOP]
    remap = np.full(len(labels), len(top), np.int64)
    remap[top] = np.arange(len(top))
    label = remap[label]
    names_out = [str(labels[i]) for i in top] + [other]
    t0 = (np.asarray(t0_rt, np.int64) - tb[0]).astype(np.float64)
    t1 = (np.asarray(t1_rt, np.int64) - tb[0]).astype(np.float64)
    b0 = np.floor(t0 / bin_ns).astype(np.int64)
    b1 = np.floor(np.maximum(t1 - 1, t0) / bin_ns).astype(np.int64)
    span = np.maximum(t1 - t0, 1.0)
    cells_b, cells_l, cells_ns = [b0], [label], [w * (np.minimum(t1, (b0 + 1) * bin_ns) - t0).clip(0) / span]
    for k in range(1, int((b1 - b0).max()) + 1 if len(b0) else 0):
        more = b1 - b0 >= k
        bk = b0[more] + k
        lo = np.maximum(t0[more], bk * bin_ns)
        hi = np.minimum(t1[more], (bk + 1) * bin_ns)
        cells_b.append(bk)
        cells_l.append(label[more])
        cells_ns.append(w[more] * (hi - lo).clip(0) / span[more])
    bb, ll, ns = np.concatenate(cells_b), np.concatenate(cells_l), np.concatenate(cells_ns)
    ok = (bb >= 0) & (bb < nb)
    cell = bb[ok] * len(names_out) + ll[ok]
    u = np.unique(cell)
    tot_c = np.bincount(np.searchsorted(u, cell), weights=ns[ok], minlength=len(u))
    return NamedTimeBins(tb, bin_ns, (u // len(names_out)).astype(np.int64), (u % len(names_out)).astype(np.int64),
                         tot_c, names_out, left_out=left_out)


NAMED_TOP = 12


def exclusive_ns(r: np.ndarray) -> np.ndarray:
    """Per NVTX range row: its duration less its direct children's (push/pop ranges one level
    deeper on the same thread that start inside it); start/end ranges keep their duration."""
    dur = (r["t_end_ns"].astype(np.int64) - r["t_start_ns"].astype(np.int64)).clip(0)
    ex = dur.astype(np.float64)
    pp = np.flatnonzero(r["kind"] == schema.NVTX_RANGES.enums["kind"].index("push_pop"))
    if not len(pp):
        return ex
    key = (r["pid"][pp].astype(np.int64) << 32) | r["tid"][pp].astype(np.int64)
    for k in np.unique(key):
        rows = pp[key == k]
        depth = r["depth"][rows].astype(np.int64)
        for d in np.unique(depth[depth > 0]):
            parents = rows[depth == d - 1]
            kids = rows[depth == d]
            if not len(parents):
                continue
            order = np.argsort(r["t_start_ns"][parents], kind="stable")
            parents = parents[order]
            at = np.searchsorted(r["t_start_ns"][parents], r["t_start_ns"][kids], side="right") - 1
            ok = at >= 0
            np.subtract.at(ex, parents[at[ok]], dur[kids[ok]].astype(np.float64))
    return ex.clip(0)


@dataclass
class NodeSummary:
    file: str
    file_bytes: int
    node: str = ""
    job_id: str = ""
    hostname: str = ""
    boot_id: str = ""
    synthetic: bool = False
    sealed: bool = False
    partial_reasons: list[str] = field(default_factory=list)
    error: str | None = None  # the file could not be used at all (then nothing else is filled)
    attrs: dict[str, Any] = field(default_factory=dict)
    clock: ClockMap | None = None
    # steps of the wall clock read from the clock pairs and taken out: (realtime ns after it, step ns)
    clock_steps: list[tuple[int, int]] = field(default_factory=list)
    # The node's calls, on its realtime clock. Library callers get them here; the merge driver
    # saves them to a file and drops them from the summary (they are as many as the job's
    # instances): rank 0 loads them one node at a time when it builds the job-wide tables.
    calls: np.ndarray = field(default_factory=lambda: np.zeros(0, CALL_DTYPE))
    n_calls: int = 0
    # comm_id -> (largest comm_size, largest seq) of the node's collective calls: rank 0 sizes the
    # job-wide [seq x rank] tables from these before any call arrives
    comm_shapes: dict[int, tuple[int, int]] = field(default_factory=dict)
    # calls left out because a probe attached after the process started (_numbered_correctly)
    late_probe_notes: list[str] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)  # per GPU: index, name, uuid, stats
    series: dict[str, Series] = field(default_factory=dict)  # "gpu0:util_gpu", "host:cpu_cores", ...
    # per process that called MPI: where its threads were on CPU, per bin of the series (the straggler
    # evidence quotes the functions of the straggler's intervals against its peers')
    on_cpu: dict[int, OnCpuBins] = field(default_factory=dict)
    on_cpu_note: str = ""  # why there are none (no stacks mode, file not sealed: no frames)
    # per process with NVTX ranges: its time per range name, per bin of the series (phases)
    phases: dict[int, NamedTimeBins] = field(default_factory=dict)
    # per process whose kernels CUPTI recorded: GPU time per kernel name, per bin of the series
    kernels: dict[int, NamedTimeBins] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # the first MAX_ERRORS
    errors_total: int = 0
    missing_metrics: list[str] = field(default_factory=list)
    table_rows: dict[str, int] = field(default_factory=dict)
    span_rt: tuple[int, int] | None = None


def discover(directory: str | os.PathLike[str]) -> list[Path]:
    """Node files of a job directory, sorted by name (the order every rank agrees on)."""
    d = Path(directory)
    if not d.is_dir():
        raise TraceFormatError(f"{d}: not a directory of node files")
    return sorted(p for p in d.iterdir() if p.suffix == ".h5" and p.is_file() and not p.name.startswith("."))


def clock_map(trace: NodeTrace) -> ClockMap:
    return clock_map_of(trace.tables.get(schema.CLOCK_PAIRS.path), trace.attrs)


# Linux slews CLOCK_REALTIME and CLOCK_MONOTONIC alike (adjtimex frequency and offset): their
# difference moves only when the wall clock is stepped (settimeofday, ADJ_SETOFFSET: ntpd beyond
# 128 ms, chrony's makestep). A change between two pairs faster than any slew (the kernel's 500 ppm)
# and beyond the pairs' read noise is such a step: the events of the node stay on its continuous
# monotonic clock, and the step is reported instead of being spread between two pairs (where no
# clock model within the slew bound could follow it). Slower changes are kept, interpolated.
STEP_MIN_RATE = 500e-6
STEP_MIN_NS = 1_000  # and at least 10x the two pairs' uncertainty


def clock_map_of(pairs: np.ndarray | None, attrs: Any) -> ClockMap:
    """The ClockMap of a node file's /clock/pairs (None or empty: its start attributes)."""
    if pairs is not None and len(pairs):
        order = np.argsort(pairs["monotonic_ns"], kind="stable")
        mono = pairs["monotonic_ns"][order].astype(np.int64)
        off = pairs["realtime_ns"][order].astype(np.int64) - mono
        unc = pairs["uncertainty_ns"][order].astype(np.int64)
        d, dm = np.diff(off), np.diff(mono)
        noise = np.maximum(STEP_MIN_NS, 10 * np.maximum(unc[:-1], unc[1:]))
        step = (np.abs(d) > noise) & (np.abs(d) > STEP_MIN_RATE * dm)
        steps = [(int(mono[i + 1]), int(d[i])) for i in np.flatnonzero(step)]
        if steps:
            off = off - np.concatenate([[0], np.cumsum(np.where(step, d, 0))])
        return ClockMap(mono, off, "pairs", steps)
    # A file without pairs still has the pair read at collector start: a measurement, not a default.
    m = int(attrs["start_monotonic_ns"])
    r = int(attrs["start_realtime_ns"])
    return ClockMap(np.array([m], np.int64), np.array([r - m], np.int64), "start attributes")


def _bin(t_rt: np.ndarray, v: np.ndarray, t0: int, bin_ns: int, nbins: int) -> np.ndarray:
    idx = ((t_rt - t0) // bin_ns).astype(np.int64)
    ok = (idx >= 0) & (idx < nbins) & np.isfinite(v)
    s = np.bincount(idx[ok], weights=v[ok], minlength=nbins)
    n = np.bincount(idx[ok], minlength=nbins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def summarize_node(path: str | os.PathLike[str]) -> NodeSummary:
    """Read one node file into a summary. A file that cannot be used gives a summary with .error."""
    p = Path(path)
    size = p.stat().st_size if p.exists() else 0
    s = NodeSummary(file=str(p), file_bytes=size)
    # Of the eBPF tables the off-CPU one and the CPU samples feed the summary (straggler evidence,
    # binned here on the rank that reads the node); kernel launches can be large and go to the job
    # file through the node tables' copy, not through here.
    wanted = SUMMARY_TABLES + tuple(t.path for t in schema.BPF_TABLES if t.group == "offcpu") + (
        schema.STACK_SAMPLES.path, schema.STACK_FRAMES.path, schema.STACK_SYMBOLS.path, schema.NVTX_RANGES.path,
        schema.NVTX_STRINGS.path, schema.KERNEL_ACTIVITY.path, schema.KERNEL_ACTIVITY_NAMES.path)
    try:
        trace = open_node_trace(p, tables=wanted)
    except TraceFormatError as e:
        s.error = str(e)
        return s
    a = trace.attrs
    s.node, s.job_id = trace.node, trace.job_id
    s.hostname, s.boot_id = str(a.get("hostname", "")), str(a["boot_id"])
    s.synthetic, s.sealed, s.partial_reasons = trace.synthetic, trace.sealed, list(trace.partial_reasons)
    s.attrs = {k: v for k, v in a.items() if isinstance(v, (str, int, float, bool))}
    s.attrs["schema_version"] = a["schema_version"]
    s.table_rows = {k: len(v) for k, v in trace.tables.items()}
    s.drops = trace.drops()
    cm = clock_map(trace)
    s.clock = cm
    s.clock_steps = [(int(cm.to_realtime(np.array([t]))[0]), d) for t, d in cm.steps]
    if cm.source != "pairs":
        s.partial_reasons.append("no /clock/pairs: monotonic->realtime from the start attributes only")
    s.partial_reasons += unknown_row_windows(trace)

    calls = trace.tables.get(schema.COLLECTIVE_CALLS.path)
    if calls is not None and len(calls):
        keep, s.late_probe_notes = _numbered_correctly(calls, trace.tables.get(schema.COMMUNICATORS.path), a)
        calls = _one_nccl_path(calls[keep])
    if calls is not None and len(calls):
        s.calls = call_rows(calls, cm, trace.tables.get(schema.DEVICE_TIMES.path))
        s.n_calls = len(s.calls)
        s.comm_shapes = comm_shapes(s.calls)

    # span on the realtime clock, from start attributes to the last record we know of
    start = int(cm.to_realtime(np.array([int(a["start_monotonic_ns"])]))[0])
    ends = [start]
    if "end_monotonic_ns" in a:
        ends.append(int(cm.to_realtime(np.array([int(a["end_monotonic_ns"])]))[0]))
    for tp in (schema.GPU_SAMPLES.path, schema.HOST_PROCS.path, schema.CLOCK_PAIRS.path):
        rows = trace.tables.get(tp)
        if rows is not None and len(rows):
            col = "monotonic_ns" if tp == schema.CLOCK_PAIRS.path else "t_ns"
            ends.append(int(cm.to_realtime(np.array([int(rows[col].max())]))[0]))
    if len(s.calls):
        ends.append(int(s.calls["enter_rt"].max()))
    s.span_rt = (start, max(ends))
    _summarize_series(trace, s, cm)
    _summarize_diagnostics(trace, s)
    return s


def _numbered_correctly(calls: np.ndarray, comms: np.ndarray | None, attrs: Any) -> tuple[np.ndarray, list[str]]:
    """Which calls keep their (comm_id, seq), by the file's `attach_json` (docs/trace-format.md, "Late
    probes"): a uprobe that attached after process P had started numbers P's calls on every
    communicator that existed before it from the first call it saw, so those calls cannot be matched
    across ranks and are left out (the rank is then left out of those communicators' instances);
    communicators P was seen creating after the attach stay exact. Returns (mask, what was left out)."""
    keep = np.ones(len(calls), bool)
    raw = attrs.get("attach_json")
    if raw is None:
        return keep, []
    try:
        attach = json.loads(raw)
    except (TypeError, ValueError):
        return keep, [f"attach_json is not JSON ({str(raw)[:60]!r}): late probes cannot be checked"]
    info = attach.get("collectives_uprobe") if isinstance(attach, dict) else None
    if not isinstance(info, dict):
        return keep, []
    late: dict[int, int] = {}  # pid -> CLOCK_MONOTONIC from which its calls are complete
    if info.get("late") and info.get("attached_ns") is not None:
        for pid in info.get("pids_before", []):
            late[int(pid)] = int(info["attached_ns"])
    for lib in info.get("late_libraries", []) or []:
        for pid in lib.get("pids", []):
            late[int(pid)] = max(late.get(int(pid), 0), int(lib.get("attached_ns", 0)))
    if not late:
        return keep, []
    uprobe = calls["path"] == schema.COLLECTIVE_CALLS.enums["path"].index("uprobe")
    notes = []
    for pid, t_att in sorted(late.items()):
        created_after = set()
        if comms is not None and len(comms):
            mine = (comms["pid"] == pid) & (comms["t_ns"] >= t_att)
            created_after = {int(c) for c in comms["comm_id"][mine]}
        bad = uprobe & (calls["pid"] == pid) & ~np.isin(calls["comm_id"], list(created_after))
        if bad.any():
            keep &= ~bad
            notes.append(f"process {pid}: {int(bad.sum())} calls on communicators that existed before the "
                         f"uprobes attached (t_ns={t_att}) are left out: their sequence numbers count from the "
                         "first call seen, so they cannot be matched with the other ranks'")
    return keep, notes


def _one_nccl_path(calls: np.ndarray) -> np.ndarray:
    """A process whose NCCL calls NCCL's profiler plugin recorded keeps those rows only: with the
    interposer (or uprobes) in place as well, each operation is also there as a host call, under
    another communicator id (the interposer's is the ncclUniqueId's, the plugin's NCCL's commHash),
    and would make a second, host-timed communicator of the same collectives."""
    paths = schema.COLLECTIVE_CALLS.enums["path"]
    nccl = calls["library"] == schema.COLLECTIVE_CALLS.enums["library"].index("nccl")
    plugin = nccl & (calls["path"] == paths.index("nccl_profiler"))
    if not plugin.any():
        return calls
    twice = nccl & ~plugin & np.isin(calls["pid"], np.unique(calls["pid"][plugin]))
    return calls[~twice]


def call_rows(calls: np.ndarray, cm: ClockMap, device: np.ndarray | None = None) -> np.ndarray:
    """Rows of /collectives/calls -> CALL_DTYPE, times on the node's realtime clock. `device`: the
    node's /collectives/device_times; an NCCL call recorded by the profiler plugin that has both
    device-side times takes them as its enter and exit (docs/merge.md, "NCCL on device times")."""
    c = np.zeros(len(calls), CALL_DTYPE)
    for f in ("comm_id", "seq", "comm_rank", "comm_size", "op", "bytes", "root_or_peer", "tag", "pid"):
        c[f] = calls[f]
    c["enter_rt"] = cm.to_realtime(calls["t_enter_ns"])
    # t_exit_ns == 0: the call was entered and never returned (the job hung or was killed in it)
    c["returned"] = calls["t_exit_ns"] != 0
    c["exit_rt"] = np.where(c["returned"], cm.to_realtime(calls["t_exit_ns"]), -1)
    if device is not None and len(device):
        _apply_device_times(c, calls, device, cm)
    return c


def _apply_device_times(c: np.ndarray, calls: np.ndarray, device: np.ndarray, cm: ClockMap) -> None:
    """Give the plugin's calls their kernels' start and end (both known), keeping the host's
    enqueue in host_enter_rt. A device row without a call row, or with one time unknown, changes
    nothing: the call keeps its host times and stays out of the clock fit, as NCCL calls do."""
    plugin = calls["path"] == schema.COLLECTIVE_CALLS.enums["path"].index("nccl_profiler")
    known = device[(device["t_dev_start_ns"] != 0) & (device["t_dev_end_ns"] >= device["t_dev_start_ns"])]
    if not plugin.any() or not len(known):
        return
    # a point-to-point's seq counts per (peer, direction), so (pid, comm_id, seq) alone can name a
    # collective and a send at once: the op and the peer complete the key
    key = np.dtype([("pid", "<u8"), ("comm_id", "<u8"), ("seq", "<u8"), ("op", "<u2"), ("root_or_peer", "<i8")])

    def keys(rows: np.ndarray) -> np.ndarray:
        k = np.zeros(len(rows), key)
        for f in key.names or ():
            k[f] = rows[f]
        return k

    dk = keys(known)
    order = np.argsort(dk, kind="stable")
    dk, known = dk[order], known[order]
    idx = np.flatnonzero(plugin)
    ck = keys(calls[idx])
    pos = np.clip(np.searchsorted(dk, ck), 0, len(dk) - 1)
    hit = dk[pos] == ck
    rows, pos = idx[hit], pos[hit]
    c["host_enter_rt"][rows] = c["enter_rt"][rows]
    c["enter_rt"][rows] = cm.to_realtime(known["t_dev_start_ns"][pos])
    c["exit_rt"][rows] = cm.to_realtime(known["t_dev_end_ns"][pos])
    c["returned"][rows] = True
    c["device_timed"][rows] = True


def comm_shapes(calls: np.ndarray) -> dict[int, tuple[int, int]]:
    """comm_id -> (largest comm_size, largest seq) over the collective calls of one node."""
    coll = calls[np.isin(calls["op"], list(COLLECTIVE_SET))]
    out = {}
    for cid in np.unique(coll["comm_id"]):
        rows = coll[coll["comm_id"] == cid]
        out[int(cid)] = (int(rows["comm_size"].max()), int(rows["seq"].max()))
    return out


def _summarize_series(trace: NodeTrace, s: NodeSummary, cm: ClockMap) -> None:
    assert s.span_rt is not None
    t0, t1 = s.span_rt
    span = max(1, t1 - t0)
    bin_ns = max(1_000_000_000, -(-span // MAX_BINS))
    nb = int(span // bin_ns) + 1
    tb = t0 + np.arange(nb, dtype=np.int64) * bin_ns

    def add(name: str, unit: str, t_rt: np.ndarray, v: np.ndarray) -> None:
        if not name.endswith(SUMMARY_SERIES):
            return
        s.series[name] = Series(name, unit, tb, bin_ns, _bin(t_rt, v.astype(np.float64), t0, bin_ns, nb))

    devs = trace.tables.get(schema.GPU_DEVICES.path)
    names = {}
    if devs is not None:
        for d in devs:
            names[int(d["index"])] = (d["name"].decode(errors="replace"), d["uuid"].decode(errors="replace"))
    samples = _columns(trace.tables.get(schema.GPU_SAMPLES.path), ("gpu", "t_ns", "util_gpu", "mem_used_bytes"), cm)
    gpm = _columns(trace.tables.get(schema.GPU_GPM.path), ("gpu", "t_ns", "sm_activity"), cm)
    gpu_ids = set(names)
    if samples is not None:
        gpu_ids |= set(np.unique(samples["gpu"]).tolist())
    for g in sorted(gpu_ids):
        info: dict[str, Any] = {"gpu": g, "name": names.get(g, ("", ""))[0], "uuid": names.get(g, ("", ""))[1]}
        if samples is not None and len(samples["gpu"]):
            mine = samples["gpu"] == g
            u = samples["util_gpu"][mine].astype(np.float64)
            add(f"gpu{g}:util_gpu", "percent", samples["t_rt"][mine], u)
            info["samples"] = len(u)
            info["util_gpu_mean"] = float(np.nanmean(u)) if np.isfinite(u).any() else None
            m = samples["mem_used_bytes"][mine].astype(np.float64)
            info["mem_used_max_bytes"] = float(np.nanmax(m)) if np.isfinite(m).any() else None
        else:
            info["samples"] = 0
        if gpm is not None and len(gpm["gpu"]):
            mine = gpm["gpu"] == g
            v = gpm["sm_activity"][mine].astype(np.float64)
            add(f"gpu{g}:sm_activity", "percent", gpm["t_rt"][mine], v)
            info["sm_activity_mean"] = float(np.nanmean(v)) if np.isfinite(v).any() else None
        s.gpus.append(info)

    procs = trace.tables.get(schema.HOST_PROCS.path)
    if procs is not None and len(procs) > 1:
        # cumulative CPU time per pid -> cores used, summed over the job's processes
        t_all, v_all = [], []
        for pid in np.unique(procs["pid"]):
            r = np.sort(procs[procs["pid"] == pid], order="t_ns")
            if len(r) < 2:
                continue
            dt = np.diff(r["t_ns"].astype(np.int64)).astype(np.float64)
            dc = np.diff(r["cpu_time_ns"].astype(np.int64)).astype(np.float64)
            ok = dt > 0
            t_all.append(r["t_ns"][1:][ok])
            v_all.append(dc[ok] / dt[ok])
        if t_all:
            t = np.concatenate(t_all)
            v = np.concatenate(v_all)
            # bin means of per-pid rates, times the pid count, give the summed cores
            npid = len(t_all)
            add("host:cpu_cores", "cores", cm.to_realtime(t), v * npid)
    for tbl in schema.BPF_TABLES:
        rows = trace.tables.get(tbl.path)
        if rows is None or not len(rows) or "t_ns" not in (rows.dtype.names or ()):
            continue
        # a duration column (off-CPU, run-queue wait, kernel time) binned as ns per second of wall time
        for col in rows.dtype.names or ():
            name = f"{tbl.group}/{tbl.name}:{col}"
            if col.endswith("_ns") and col != "t_ns" and rows.dtype[col].kind in "uif" and name.endswith(SUMMARY_SERIES):
                per_s = bin_ns / 1e9
                idx = ((cm.to_realtime(rows["t_ns"]) - t0) // bin_ns).astype(np.int64)
                ok = (idx >= 0) & (idx < nb)
                tot = np.bincount(idx[ok], weights=rows[col][ok].astype(np.float64), minlength=nb)
                s.series[name] = Series(name, "ns/s", tb, bin_ns, tot / per_s)
    _rank_thread_offcpu(trace, s, cm, tb, bin_ns, nb)
    _on_cpu(trace, s, cm, tb, bin_ns, nb)
    _nvtx_phases(trace, s, cm, tb, bin_ns, nb)
    _kernel_time(trace, s, cm, tb, bin_ns, nb)


def _nvtx_phases(trace: NodeTrace, s: NodeSummary, cm: ClockMap, tb: np.ndarray, bin_ns: int, nb: int) -> None:
    """The phases (NVTX ranges, exclusive time) of every process with NVTX ranges on this node."""
    ranges = trace.tables.get(schema.NVTX_RANGES.path)
    if ranges is None or not len(ranges):
        return
    strings = trace.tables.get(schema.NVTX_STRINGS.path)
    text = {} if strings is None else {(int(p), int(i)): t.decode(errors="replace")
                                        for p, i, t in zip(strings["pid"], strings["string_id"], strings["text"])}
    closed = ranges["t_end_ns"] != 0
    ex = exclusive_ns(ranges)
    for pid in np.unique(ranges["pid"]):
        mine = ranges["pid"] == pid
        r, e = ranges[mine & closed], ex[mine & closed]
        if not len(r):
            continue
        names = [text.get((int(pid), int(i)), f"[range {int(i)}]") for i in r["name_id"]]
        s.phases[int(pid)] = named_time_bins(cm.to_realtime(r["t_start_ns"]), cm.to_realtime(r["t_end_ns"]), e, names,
                                             "(other ranges)", tb, bin_ns, nb, left_out=int((mine & ~closed).sum()))


def _kernel_time(trace: NodeTrace, s: NodeSummary, cm: ClockMap, tb: np.ndarray, bin_ns: int, nb: int) -> None:
    """GPU time per kernel name of every process whose kernels CUPTI recorded (/kernels/activity)."""
    execs = trace.tables.get(schema.KERNEL_ACTIVITY.path)
    if execs is None or not len(execs):
        return
    names_t = trace.tables.get(schema.KERNEL_ACTIVITY_NAMES.path)
    text = {} if names_t is None else {(int(p), int(i)): n.decode(errors="replace")
                                       for p, i, n in zip(names_t["pid"], names_t["name_id"], names_t["name"])}
    for pid in np.unique(execs["pid"]):
        r = execs[(execs["pid"] == pid) & (execs["t_end_ns"] >= execs["t_start_ns"])]
        if not len(r):
            continue
        names = [text.get((int(pid), int(i)), f"[kernel {int(i)}]") for i in r["name_id"]]
        t0, t1 = cm.to_realtime(r["t_start_ns"]), cm.to_realtime(r["t_end_ns"])
        s.kernels[int(pid)] = named_time_bins(t0, t1, (t1 - t0).astype(np.float64), names, "(other kernels)", tb,
                                              bin_ns, nb)


def _on_cpu(trace: NodeTrace, s: NodeSummary, cm: ClockMap, tb: np.ndarray, bin_ns: int, nb: int) -> None:
    """OnCpuBins of every process that called MPI on this node."""
    samples = trace.tables.get(schema.STACK_SAMPLES.path)
    frames = trace.tables.get(schema.STACK_FRAMES.path)
    symbols = trace.tables.get(schema.STACK_SYMBOLS.path)
    calls = trace.tables.get(schema.COLLECTIVE_CALLS.path)
    if samples is None or not len(samples):
        s.on_cpu_note = "no CPU samples (mode stacks off, or none taken)"
        return
    if frames is None or symbols is None or not len(frames):
        s.on_cpu_note = "CPU samples without frames (the file was not sealed: frames are written at seal)"
        return
    pids = np.unique(calls["pid"]) if calls is not None and len(calls) else np.zeros(0, np.uint32)
    samples = samples[np.isin(samples["pid"], pids)]
    if not len(samples):
        s.on_cpu_note = "no CPU samples of the processes that called MPI"
        return
    # innermost frame of each stack id; the user stack says where the program was, a sample without
    # one (in the kernel on its behalf) is named by its kernel leaf
    inner = frames[frames["depth"] == 0]
    leaf_of = dict(zip(inner["stack_id"].tolist(), inner["symbol_id"].tolist()))
    name_of = {int(i): f"{n.decode(errors='replace')} ({m.decode(errors='replace')})"
               for i, n, m in zip(symbols["symbol_id"], symbols["name"], symbols["module"])}
    user = [leaf_of.get(int(u)) for u in samples["user_stack"]]
    kern = [leaf_of.get(int(k)) for k in samples["kernel_stack"]]
    label_txt = [name_of.get(u if u is not None else (k if k is not None else -1), "[no frame]")
                 for u, k in zip(user, kern)]
    labels, label = np.unique(np.array(label_txt, dtype=object), return_inverse=True)
    label = label.ravel().astype(np.int64)
    idx = ((cm.to_realtime(samples["t_ns"]) - tb[0]) // bin_ns).astype(np.int64)
    ok = (idx >= 0) & (idx < nb)
    other = len(labels)
    names = [str(x) for x in labels] + ["(other)"]
    for pid in np.unique(samples["pid"][ok]):
        sel = ok & (samples["pid"] == pid)
        cell = idx[sel] * (other + 1) + label[sel]
        u = np.unique(cell)
        tot = np.bincount(np.searchsorted(u, cell), weights=samples["count"][sel].astype(np.float64), minlength=len(u))
        b, lab = u // (other + 1), u % (other + 1)
        # at most ON_CPU_TOP functions per bin: the rest into "(other)"
        order = np.lexsort((-tot, b))
        b, lab, tot = b[order], lab[order], tot[order]
        start = np.concatenate([[0], np.flatnonzero(np.diff(b)) + 1])
        rank_in = np.arange(len(b)) - np.repeat(start, np.diff(np.append(start, len(b))))
        lab = np.where(rank_in < ON_CPU_TOP, lab, other)
        cell2 = b * (other + 1) + lab
        u2 = np.unique(cell2)
        tot2 = np.bincount(np.searchsorted(u2, cell2), weights=tot, minlength=len(u2))
        s.on_cpu[int(pid)] = OnCpuBins(tb, bin_ns, (u2 // (other + 1)).astype(np.int64),
                                       (u2 % (other + 1)).astype(np.int64), tot2, names)


# A row of the stack tables counts the window from its t_ns to its source's next drain: the stacks
# source drains once a second, the off-CPU source every sources.offcpu.flush_interval_s (1 s by
# default, which a site may change). The node file's rates_json says each source's drain rate.
ROW_WINDOW_SOURCES = {schema.STACK_SAMPLES.path: "stacks", schema.OFFCPU_INTERVALS.path: "offcpu"}


def row_window_ns(attrs: Any, table_path: str) -> int | None:
    """ns a row of /stacks/samples or /offcpu/intervals counts from its t_ns: its source's drain
    period, from the file's rates_json. None where the file does not say: its rows cannot be placed
    in time then (the summary says so: unknown_row_windows)."""
    raw = attrs.get("rates_json")
    try:
        rate = json.loads(raw).get(ROW_WINDOW_SOURCES[table_path]) if raw is not None else None
    except (TypeError, ValueError, AttributeError):
        return None
    return round(1e9 / rate) if isinstance(rate, (int, float)) and rate > 0 else None


def unknown_row_windows(trace: NodeTrace) -> list[str]:
    """The node's partial reasons for stack tables with rows whose windows' length it does not say."""
    return [f"{path}: rates_json names no '{source}' drain rate, so the length of its windows is unknown: "
            f"its rows are left out of the findings' stack evidence and the off-CPU series"
            for path, source in ROW_WINDOW_SOURCES.items()
            if len(trace.tables.get(path, ())) and row_window_ns(trace.attrs, path) is None]


def _rank_thread_offcpu(trace: NodeTrace, s: NodeSummary, cm: ClockMap, tb: np.ndarray, bin_ns: int, nb: int) -> None:
    """Off-CPU time of the threads that called collectives, per process: blocked (sleeping, or
    stopped by a signal) and runnable (waiting for a CPU), ns per second, as series
    "pid<PID>:offcpu_blocked_ns" / "pid<PID>:offcpu_runnable_ns". The node's sums are dominated by
    the job's idle helper threads (progress, data loaders), which say nothing of a rank's lateness."""
    calls = trace.tables.get(schema.COLLECTIVE_CALLS.path)
    rows = trace.tables.get(schema.OFFCPU_INTERVALS.path)
    if calls is None or rows is None or not len(calls) or not len(rows):
        return
    callers = np.unique(calls["tid"])
    mine = np.isin(rows["tid"], callers)
    if not mine.any():
        return
    window_ns = row_window_ns(trace.attrs, schema.OFFCPU_INTERVALS.path)
    if window_ns is None:
        return  # unknown_row_windows: a partial reason of the node
    rows = rows[mine]
    t_rt = cm.to_realtime(rows["t_ns"])
    idx = ((t_rt - tb[0]) // bin_ns).astype(np.int64)
    ok = (idx >= 0) & (idx < nb)
    # a blocked episode is counted whole in the window its thread woke in: spread back from that
    # window's end over its length (flames.read_folded reads it so too); the run-queue time is the
    # kernel's counter read at each drain, the window's own
    end = (t_rt - tb[0]).astype(np.float64) + window_ns
    edges = np.arange(nb + 1, dtype=np.float64) * bin_ns
    per_s = bin_ns / 1e9
    for pid in np.unique(rows["pid"]):
        of_pid = rows["pid"] == pid
        sel = ok & of_pid
        blocked = _spread_in_bins(end[of_pid] - rows["blocked_ns"][of_pid].astype(np.float64), end[of_pid], edges)
        if not sel.any() and not blocked.any():
            continue  # all its rows outside the series' bins
        runnable = np.bincount(idx[sel], weights=rows["runnable_ns"][sel].astype(np.float64), minlength=nb)
        for key, tot in (("offcpu_blocked_ns", blocked), ("offcpu_runnable_ns", runnable)):
            name = f"pid{int(pid)}:{key}"
            s.series[name] = Series(name, "ns/s", tb, bin_ns, tot / per_s)



def _spread_in_bins(lo: np.ndarray, hi: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """[len(edges) - 1]: how much of the intervals [lo, hi) lies in each bin [edges[k], edges[k+1]),
    from the total covered up to each edge, F(x) = sum over lo < x of (x - lo) less the same of hi."""
    def covered(x: np.ndarray, ends: np.ndarray) -> np.ndarray:
        e = np.sort(ends)
        k = np.searchsorted(e, x, side="left")
        before = np.concatenate([[0.0], np.cumsum(e)])
        return k * x - before[k]

    F = covered(edges, lo) - covered(edges, hi)
    return np.diff(F)


def _columns(rows: np.ndarray | None, names: tuple[str, ...], cm: ClockMap) -> dict[str, np.ndarray] | None:
    """The named columns of a table (views, no copy) and "t_rt", its t_ns on the realtime clock.
    Selecting rows of single columns rather than of whole records (up to 84 bytes a row for GPU
    samples, read per GPU) is what keeps the summary cheap beside the file's decompression."""
    if rows is None:
        return None
    out = {n: rows[n] for n in names}
    out["t_rt"] = cm.to_realtime(rows["t_ns"])
    return out


def _summarize_diagnostics(trace: NodeTrace, s: NodeSummary) -> None:
    errs = trace.tables.get(schema.DIAG_ERRORS.path)
    if errs is not None:
        s.errors = [f"{r['source'].decode(errors='replace')}: {r['message'].decode(errors='replace')}"
                    for r in errs[:MAX_ERRORS]]
        s.errors_total = len(errs)
    miss = trace.tables.get(schema.DIAG_MISSING.path)
    if miss is not None:
        seen: set[str] = set()
        for r in miss:
            dev = int(r["device"])
            txt = (f"{r['source'].decode(errors='replace')} {'node' if dev < 0 else f'gpu{dev}'} "
                   f"{r['metric'].decode(errors='replace')}: {r['reason'].decode(errors='replace')}")
            if txt not in seen:
                seen.add(txt)
                s.missing_metrics.append(txt)


_HOSTLIST = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?")


def expand_hostlist(expr: str) -> list[str]:
    """Slurm hostlist 'node[001-004,007],gpu1' -> names (the subset of the syntax nodelists use)."""
    out: list[str] = []
    pos = 0
    expr = expr.strip()
    while pos < len(expr):
        m = _HOSTLIST.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot parse host list {expr!r} at {pos}")
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            out.append(prefix)
        else:
            for part in ranges.split(","):
                if "-" in part:
                    lo, hi = part.split("-", 1)
                    width = len(lo)
                    out.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
                else:
                    out.append(prefix + part)
        pos = m.end()
        if pos < len(expr) and expr[pos] == ",":
            pos += 1
    return out


def expected_nodes_from_attrs(summaries: list[NodeSummary]) -> list[str] | None:
    """The job's node list if a node file recorded one (attribute job_nodelist, or in config_json)."""
    for s in summaries:
        if s.error is not None:
            continue
        for key in ("job_nodelist", "nodelist"):
            if s.attrs.get(key):
                return expand_hostlist(str(s.attrs[key]))
        cfg = s.attrs.get("config_json")
        if cfg:
            try:
                doc = json.loads(cfg)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict) and doc.get("job_nodelist"):
                return expand_hostlist(str(doc["job_nodelist"]))
    return None
