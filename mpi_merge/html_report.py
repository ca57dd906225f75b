"""The HTML report: one self-contained page built from a merged job file (docs/report.md).

The page is the vendored charting library (assets/echarts-*.min.js, Apache ECharts at a pinned
version, inlined), the page's own script and style (assets/report.js, report.css) and one JSON
payload this module builds from the job file: the summary (from /analysis's report), lanes and wait
heat maps per communicator (/collectives), metric timelines binned on one aligned time grid
(/nodes/*/gpu, host, offcpu), per node stack, off-CPU, NVTX and kernel rows for the flame graphs and
the drill-down, and the clock segments with their error intervals (/clock/segments).

Nothing is fetched: no <script src>, no <link>, no font. Every name from a trace reaches the page
inside the JSON payload (its '<', '>' and '&' written as \\u escapes, so no name can close the
script element) and the page's script puts names into the DOM as text nodes only, and into chart
tooltips escaped.

Large jobs are summarized, not dumped, each summary listed in the payload's `summarized` (the page
shows the list): at most MAX_COMMS communicators (the ones with the most waiting), lanes of at most
MAX_LANE_RANKS ranks over a window of instances, heat maps of at most HEAT_COLUMNS groups of
instances (and HEAT_CELLS cells), metric series on at most TIME_BINS bins, per metric every series
up to ALL_SERIES_NODES nodes and above that the across-node band (10th, 50th, 90th percentile per
bin) plus the TOP_SERIES series that deviate most (straggler nodes first), at most MAX_STACK_ROWS
stack rows and MAX_EVENT_ROWS NVTX ranges and kernel launches per node (docs/report.md has the table).

The node groups are read in two passes, node by node (JobNodes.facts: which tables a node has, their
rows, the span of its data; JobNodes.content, on the time grid of all spans: its series, rows and
names), every table opened at most once per pass. The merge deals the passes over its ranks
(PoolPasses; at 1024 nodes they are most of the page); the payload is put together in node order
from the per-node results whichever process computed them, so the page is the same on any number
of ranks and from `gpuprof report --html`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.errors import TraceFormatError
from gpuprof.mpi_merge import roofline
from gpuprof.mpi_merge.clock import NodeClockModel
from gpuprof.mpi_merge.common import Pool, row_blocks
from gpuprof.mpi_merge.export import open_job_file
from gpuprof.mpi_merge.jobclock import clock_model, segment_rows_by_node, time_mapper

ASSETS = Path(__file__).resolve().parent / "assets"
CHART_LIBRARY = "echarts-6.1.0.min.js"  # assets/README.md says where it comes from and why it was chosen
SYNTHETIC_BANNER = "SYNTHETIC DATA (gpuprof.mpi_merge.synthetic): not a measurement of any real job"

MAX_COMMS = 8
MAX_LANE_RANKS = 256
LANE_CELLS = 16_000  # ranks x instances of one communicator's time lanes
LANE_INSTANCES = 80
HEAT_COLUMNS = 200
HEAT_CELLS = 40_000  # ranks x groups of one heat map
TIME_BINS = 300
ALL_SERIES_NODES = 16
TOP_SERIES = 8
MAX_STACK_ROWS = 4000
MAX_EVENT_ROWS = 4000  # NVTX ranges and kernel launches per node
MAX_CLOCK_NODES = 32
MAX_CLOCK_POINTS = 120  # segments drawn per node
MAX_RANK_ROWS = 1024
SEQ_TIME_POINTS = 200  # (collective index, time) points per communicator: the stack lanes' axis
OFFCPU_SPREAD = 20  # points each off-CPU window's blocked time is spread over

COVERAGE = [("collectives/calls", "collective calls"), ("gpu/samples", "GPU metrics (NVML)"),
            ("gpu/gpm", "GPU activity (GPM)"), ("host/node", "host metrics"), ("stacks/samples", "CPU stacks"),
            ("offcpu/intervals", "off-CPU stacks"), ("nvtx/ranges", "NVTX ranges"), ("kernels/launches", "kernel launches")]

# (table, column, metric key, title, unit, scale): the metric timelines, in the page's order
GPU_METRICS = [
    ("gpu/samples", "util_gpu", "util_gpu", "GPU utilization", "%", 1.0),
    ("gpu/gpm", "sm_activity", "sm_activity", "SM activity", "%", 1.0),
    ("gpu/gpm", "tensor_activity", "tensor_activity", "Tensor activity", "%", 1.0),
    ("gpu/gpm", "dram_bw_util", "dram_bw_util", "DRAM bandwidth", "%", 1.0),
    ("gpu/samples", "util_mem", "util_mem", "Memory controller utilization", "%", 1.0),
    ("gpu/samples", "mem_used_bytes", "mem_used", "GPU memory used", "GiB", 1 / 2**30),
    ("gpu/samples", "power_w", "power_w", "Power", "W", 1.0),
    ("gpu/samples", "pcie_tx_kbps+pcie_rx_kbps", "pcie", "PCIe TX+RX", "MB/s", 1e-3),
    ("gpu/samples", "nvlink_tx_kbps+nvlink_rx_kbps", "nvlink", "NVLink TX+RX", "MB/s", 1e-3),
]
HOST_METRICS = [
    ("host/node", "cpu_busy", "cpu_busy", "Host CPU busy", "%", 100.0),
    ("host/node", "mem_used_bytes", "host_mem", "Host memory used", "GiB", 1 / 2**30),
]


def _s(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def _r(x: float, digits: int = 4) -> float | None:
    """A float for the payload: None for NaN, rounded to `digits` significant digits (the page
    draws pixels; full doubles would triple its size)."""
    if x is None or not np.isfinite(x):
        return None
    return float(f"{float(x):.{digits}g}")


def _name(n: bytes | str) -> str:
    """A node name as HDF5 gives it (bytes from a variable-length string column)."""
    return n.decode() if isinstance(n, bytes) else str(n)


def _rl(a: np.ndarray, digits: int = 4) -> list[float | None]:
    """_r of every value of `a`, by one %-format of them all: the same text as format() makes of
    each (both are Python's repr of a double to `digits` significant digits), parsed back, at a
    third of the cost of a call per value (the page rounds about a million values at 1024 nodes)."""
    v = np.asarray(a, np.float64).ravel()
    ok = np.isfinite(v)
    finite = v[ok].tolist()
    rounded: list[float | None] = list(map(float, ((f"%.{digits}g " * len(finite)) % tuple(finite)).split()))
    if len(finite) == len(v):
        return rounded
    out: list[float | None] = [None] * len(v)
    for i, x in zip(np.flatnonzero(ok).tolist(), rounded):
        out[i] = x
    return out


Series = tuple[str, int | None, np.ndarray]  # node, GPU (None: the host), values per time bin


@dataclass
class TimeGrid:
    """The page's one time axis: seconds since the job's epoch, on the reference clock."""

    t0: float
    t1: float
    bins: int

    @property
    def dt(self) -> float:
        return (self.t1 - self.t0) / self.bins

    def bin_of(self, t_s: np.ndarray) -> np.ndarray:
        return np.clip(((t_s - self.t0) / max(self.dt, 1e-9)).astype(np.int64), 0, self.bins - 1)

    def mean(self, t_s: np.ndarray, v: np.ndarray) -> np.ndarray:
        ok = np.isfinite(v) & (t_s >= self.t0) & (t_s <= self.t1)
        b = self.bin_of(t_s[ok])
        s = np.bincount(b, v[ok], self.bins)
        n = np.bincount(b, None, self.bins)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, s / np.maximum(n, 1), np.nan)


# --- one node's tables -------------------------------------------------------------------------
# The tables of a node group the page reads. A lookup by path in h5py (`path in group`,
# `group[path]`) costs about 0.1 ms, an HDF5 dataset open as much again, and the page used to ask
# about some 20 tables of every node, several times: at 1024 nodes that was most of the page.
# Now a first pass (JobNodes.facts) opens each table once and counts its rows, the second
# (JobNodes.content) opens only the tables it reads, and no table without rows is read at all.
SPAN_TABLES = (("host/node", "t_ns"), ("gpu/samples", "t_ns"), ("collectives/calls", "t_enter_ns"))
METRIC_TABLES = sorted({spec[0] for spec in GPU_METRICS + HOST_METRICS})
STACK_TABLES = (("stacks/samples", "count", "samples", 1.0), ("offcpu/intervals", "blocked_ns", "offcpu", 1e-6))
CLOCK_PAIRS = schema.CLOCK_PAIRS.path.lstrip("/")
# counted by the first pass: coverage's tables, and the stack frames (read only when there are some)
COUNTED = (*(p for p, _ in COVERAGE), "stacks/frames")
# whose presence alone the first pass notes: read only with the table they name
NAMES_TABLES = ("stacks/symbols", "nvtx/strings", "kernels/functions")
# looked up by opening them (the first pass opens each of them that is there)
OPENED = frozenset((*COUNTED, CLOCK_PAIRS))
SEG_BLOCK = 16  # nodes whose /clock/segments rows are read at once (JobNodes._clock_index)


class NodeTables:
    """One node's group as the page reads it, through h5py's low-level calls (its high-level path
    lookups and reads cost several times as much for these small tables: a compound dtype is
    converted at every read): each link looked up once, each table opened once and its rows
    counted; `known`: the first pass's facts (a table it found without rows is not opened again).
    What it opens is released with it (a node at a time: an open HDF5 dataset costs kilobytes)."""

    def __init__(self, open_group: Callable[[], h5py.h5g.GroupID], known: NodeFacts | None = None):
        self._open_group = open_group
        self._gid: h5py.h5g.GroupID | None = None  # opened when first needed (the known facts may answer all)
        self.known = known
        self._links: dict[str, bool] = {}
        self._objs: dict[str, h5py.h5o.ObjectID | None] = {}

    @property
    def gid(self) -> h5py.h5g.GroupID:
        if self._gid is None:
            self._gid = self._open_group()
        return self._gid

    @property
    def attrs(self) -> h5py.AttributeManager:
        """The node group's attributes (the collector's start clock reading, among others)."""
        return h5py.Group(self.gid).attrs

    def _link(self, path: str) -> bool:
        if path not in self._links:
            parent = path.rpartition("/")[0]
            self._links[path] = (not parent or self._link(parent)) and bool(self.gid.links.exists(path.encode()))
        return self._links[path]

    def _obj(self, path: str) -> h5py.h5o.ObjectID | None:
        if path not in self._objs:
            try:
                self._objs[path] = h5py.h5o.open(self.gid, path.encode())
            except KeyError:  # (HDF5's "component not found": no such link on the path)
                self._objs[path] = None
        return self._objs[path]

    def has(self, path: str) -> bool:
        """Whether the node has this object at all (a table without rows counts)."""
        if self.known is not None and (path in COUNTED or path in NAMES_TABLES):
            return path in self.known.present
        if path in OPENED:  # opened anyway when there: an open that fails costs what a lookup does
            return self._obj(path) is not None
        return self._link(path)

    def _id(self, path: str) -> h5py.h5d.DatasetID | None:
        obj = self._obj(path) if self.has(path) else None
        return obj if isinstance(obj, h5py.h5d.DatasetID) else None

    def dataset(self, path: str) -> h5py.Dataset | None:
        did = self._id(path)
        return h5py.Dataset(did) if did is not None else None

    def rows(self, path: str) -> int:
        """Rows of a table, 0 when the node has none (or the object is not a table)."""
        if self.known is not None and path in self.known.rows:
            return self.known.rows[path]
        did = self._id(path)
        return int(did.shape[0]) if did is not None else 0

    def read(self, path: str) -> np.ndarray:
        """The whole table, as `dataset[()]` reads it (the same conversion to the same dtype),
        without the high-level read's own cost (about 0.2 ms a table)."""
        did = self._id(path)
        assert did is not None, path
        out = np.empty(did.shape, did.dtype)
        if out.size:
            did.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
        return out

    def ends(self, path: str, col: str) -> tuple[int, int]:
        """Column `col` of a table's first and last row (it has rows), read alone: one member of
        the compound type, the two rows in one selection."""
        did = self._id(path)
        assert did is not None, path
        ftype = did.get_type()
        member = ftype.get_member_type(ftype.get_member_index(col.encode()))
        mtype = h5py.h5t.create(h5py.h5t.COMPOUND, member.get_size())
        mtype.insert(col.encode(), 0, member)
        space = did.get_space()
        n = space.shape[0]
        space.select_elements(np.array([[0], [n - 1]], np.uint64))
        out = np.zeros(2, np.dtype([(col, member.dtype)]))
        did.read(h5py.h5s.create_simple((2,)), space, out, mtype=mtype)
        return int(out[col][0]), int(out[col][1])


@dataclass
class NodeFacts:
    """The first pass over one node: what it has, and the span of its data (aligned seconds)."""

    rows: dict[str, int]  # rows of each COUNTED table the node has
    present: frozenset[str]  # every COUNTED and NAMES_TABLES object the node has, rows or not
    span: tuple[float, float] | None  # earliest and latest first/last row of SPAN_TABLES


@dataclass
class NodeContent:
    """The second pass over one node: its share of the payload. String ids in `rows` index the
    node's own `strings` (in the order it asked for them): the builder maps them to the payload's
    table node by node, in node order, which gives every name the id the serial page gave it."""

    series: list[tuple[str, int | None, np.ndarray]]  # (metric key, GPU or None, mean per time bin)
    gpu_means: dict[int, dict[str, float]]  # roofline means per GPU of the metric tables
    phases: dict[int, list[dict[str, Any]]]  # roofline classes per NVTX range, per GPU of the report
    offcpu: np.ndarray | None  # blocked threads per time bin
    rows: dict[str, Any]  # the node's entry of node_rows
    strings: list[str]
    notes: list[tuple[str, int]]  # (summary, rows the node had) in the order made: PayloadBuilder.per_node


def _seconds(to_s: Callable[[np.ndarray], np.ndarray], t_mono_ns: np.ndarray) -> np.ndarray:
    return to_s(t_mono_ns) if len(t_mono_ns) else np.zeros(0)


class JobNodes:
    """The node groups of an open job file and their clocks, as the page's two passes over the nodes
    read them (facts, content): on one process for the whole page, or on any merge rank for the
    nodes dealt to it; the same numbers wherever a node is computed."""

    def __init__(self, f: h5py.File):
        self.f = f
        self.nodes: list[str] = json.loads(f.attrs["nodes"])
        self.epoch = int(f.attrs["epoch_realtime_ns"])
        self._clock_rows: dict[str, np.void] | None = None  # /clock/nodes by node
        self._seg_rows: dict[str, np.ndarray] = {}  # /clock/segments by node, as read so far
        self._seg_blocks: list[list[tuple[str, int, int]]] | None = None  # (node, first row, end row)
        self._block_of: dict[str, int] = {}
        self._mappers: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        self._nodes_id: h5py.h5g.GroupID | None = None

    def _clock_index(self) -> dict[str, np.void]:
        """/clock/nodes, and where each node's rows of /clock/segments are: the job file has them
        node by node in the order of /clock/nodes, each node's count in its row (jobfile.segment_rows).
        Then a rank reads the rows of the nodes it maps, SEG_BLOCK nodes at a time, not the whole
        table (266,240 rows at 1024 nodes: a fifth of a second on every rank). A file that does not
        keep that order has its table read whole and grouped (segment_rows_by_node)."""
        if self._clock_rows is None:
            rows = self.f["clock/nodes"][()]
            names = [_name(n) for n in rows["node"]]
            self._clock_rows = dict(zip(names, rows))
            segs = self.f.get("clock/segments")
            if not isinstance(segs, h5py.Dataset) or "node" not in (segs.dtype.names or ()):
                self._seg_blocks = []  # no segments at all: every model is without
            elif "segments" in (rows.dtype.names or ()) and len(set(names)) == len(names) \
                    and int(rows["segments"].sum()) == segs.shape[0] and bool((rows["segments"] >= 0).all()):
                ends = np.cumsum(rows["segments"]).tolist()
                spans = [(n, e - int(k), e) for n, k, e in zip(names, rows["segments"].tolist(), ends)]
                self._seg_blocks = [spans[b:b + SEG_BLOCK] for b in range(0, len(spans), SEG_BLOCK)]
                self._block_of = {n: i // SEG_BLOCK for i, n in enumerate(names)}
            else:
                self._read_all_segments()
        return self._clock_rows

    def _read_all_segments(self) -> None:
        self._seg_rows = segment_rows_by_node(self.f["clock/segments"][()])
        self._seg_blocks = None

    def seg_rows(self, node: str) -> np.ndarray:
        """The node's rows of /clock/segments in file order (none: an empty array)."""
        self._clock_index()
        if node not in self._seg_rows and self._seg_blocks and node in self._block_of:
            block = self._seg_blocks[self._block_of[node]]
            lo, hi = block[0][1], block[-1][2]
            got: np.ndarray = self.f["clock/segments"][lo:hi]
            col = got["node"]
            # each node's rows where its count puts them: the name changes exactly there, to its own
            starts = [(n, a - lo) for n, a, b in block if b > a]
            runs = (np.flatnonzero(col[1:] != col[:-1]) + 1).tolist()
            if runs != [a for _, a in starts[1:]] or any(_name(col[a]) != n for n, a in starts):
                self._read_all_segments()  # not in the order its counts say: the whole table, grouped
            else:
                self._seg_rows.update((n, got[a - lo:b - lo]) for n, a, b in block)
        return self._seg_rows.get(node, np.zeros(0))

    def model(self, node: str) -> NodeClockModel:
        return clock_model(self._clock_index()[node], self.seg_rows(node), self.epoch)

    def tables(self, node: str, known: NodeFacts | None = None) -> NodeTables:
        # /nodes/NODE from /nodes: a path from the file's root walks /nodes, thousands of links
        if self._nodes_id is None:
            self._nodes_id = self.f["nodes"].id
        nodes_id = self._nodes_id
        return NodeTables(lambda: h5py.h5g.open(nodes_id, node.encode()), known)

    def to_s(self, node: str, t: NodeTables) -> Callable[[np.ndarray], np.ndarray]:
        """The node's CLOCK_MONOTONIC ns -> aligned seconds since the epoch (its clock pairs read
        from `t`, the first time only)."""
        if node not in self._mappers:
            model = self.model(node)
            pairs = t.read(CLOCK_PAIRS) if t.has(CLOCK_PAIRS) else None
            # (the attributes only where the pairs are not there: loading.clock_map_of)
            attrs = t.attrs if pairs is None or not len(pairs) else {}
            conv = time_mapper(pairs, attrs, model, self.epoch)
            epoch = self.epoch
            self._mappers[node] = lambda ns: (conv(ns.astype(np.int64)) - epoch) / 1e9
        return self._mappers[node]

    def facts(self, i: int) -> NodeFacts:
        node = self.nodes[i]
        t = self.tables(node)
        present = frozenset(p for p in (*COUNTED, *NAMES_TABLES) if t.has(p))
        rows = {p: t.rows(p) for p in COUNTED if p in present}
        ts: list[int] = []
        for table, col in SPAN_TABLES:
            n = rows.get(table, 0)
            if n:
                ts += t.ends(table, col)
        span = None
        if ts:
            s = self.to_s(node, t)(np.array(ts, np.int64))
            span = (float(s.min()), float(s.max()))
        return NodeFacts(rows, present, span)

    def content(self, i: int, facts: NodeFacts, grid: TimeGrid, gpus: list[tuple[int, str]]) -> NodeContent:
        """`gpus`: the node's GPUs in the report (index, name), for the roofline's classes per NVTX range."""
        node = self.nodes[i]
        t = self.tables(node, facts)

        def to_s(t_mono_ns: np.ndarray) -> np.ndarray:  # the clock pairs read only for a table with rows
            return self.to_s(node, t)(t_mono_ns)

        strings: dict[str, int] = {}
        notes: list[tuple[str, int]] = []

        def sid(s: str) -> int:
            return strings.setdefault(s, len(strings))

        series, gpu_means = _metric_series(t, to_s, grid, self.f, node)
        phases = {}
        if t.rows("nvtx/ranges") and t.rows("gpu/gpm"):  # (without both, roofline.phase_classes has none)
            phases = {gi: roofline.phase_classes(self.f, node, gi, name) for gi, name in gpus}
        rows = _node_rows(t, to_s, sid, notes)
        return NodeContent(series, gpu_means, phases, _offcpu_series(t, to_s, grid), rows, list(strings), notes)


def _metric_series(t: NodeTables, to_s: Callable[[np.ndarray], np.ndarray], grid: TimeGrid, f: h5py.File,
                   node: str) -> tuple[list[tuple[str, int | None, np.ndarray]], dict[int, dict[str, float]]]:
    """The node's binned series of every metric (each table read once), and the roofline's means
    of its GPUs from the same rows (gpus() would read both tables again per GPU)."""
    specs = GPU_METRICS + HOST_METRICS
    series: list[tuple[str, int | None, np.ndarray]] = []
    gpu_tables: dict[str, np.ndarray] = {}
    for table in METRIC_TABLES:
        if not t.rows(table):
            continue
        rows = t.read(table)
        if table in ("gpu/gpm", "gpu/samples"):
            gpu_tables[table] = rows
        ts = _seconds(to_s, rows["t_ns"])
        by_gpu = ([(int(gi), rows["gpu"] == gi) for gi in np.unique(rows["gpu"])]
                  if "gpu" in (rows.dtype.names or ()) else [(None, np.ones(len(rows), bool))])
        for spec in specs:
            if spec[0] != table:
                continue
            v = sum((rows[c].astype(np.float64) for c in spec[1].split("+")), np.zeros(len(rows)))
            for gi, mine in by_gpu:
                b = grid.mean(ts[mine], v[mine])
                if np.isfinite(b).any():
                    series.append((spec[2], gi, b))
    both = (gpu_tables.get("gpu/gpm"), gpu_tables.get("gpu/samples"))
    means = {gi: roofline.gpu_means(f, node, gi, both)
             for gi in sorted({int(x) for r in gpu_tables.values() for x in np.unique(r["gpu"])})}
    return series, means


def _offcpu_series(t: NodeTables, to_s: Callable[[np.ndarray], np.ndarray], grid: TimeGrid) -> np.ndarray | None:
    """Blocked time per bin / bin width: how many of the node's threads were asleep on average."""
    if not t.rows("offcpu/intervals"):
        return None
    rows = t.read("offcpu/intervals")
    ts = _seconds(to_s, rows["t_ns"])
    # a row covers its window (to the next window's start): spread its blocked time over it
    starts = np.unique(ts)
    window = float(np.median(np.diff(starts))) if len(starts) > 1 else grid.dt
    w = rows["blocked_ns"].astype(np.float64) / OFFCPU_SPREAD
    s = np.zeros(grid.bins)
    for j in range(OFFCPU_SPREAD):
        s += np.bincount(grid.bin_of(ts + (j + 0.5) * window / OFFCPU_SPREAD), w, grid.bins)
    return s / 1e9 / max(grid.dt, 1e-9)


def _node_rows(t: NodeTables, to_s: Callable[[np.ndarray], np.ndarray], sid: Callable[[str], int],
               notes: list[tuple[str, int]]) -> dict[str, Any]:
    """The node's stack, off-CPU, NVTX and kernel rows for the flame graphs and the drill-down.
    A table the node has without rows gives [] (None: it has no such table), as its read did."""
    # stacks: frame ids root first; user_frames: how many of them are the user part (the
    # rest the kernel's), so the drill-down can name the innermost function of the program
    d: dict[str, Any] = {"stacks": [], "user_frames": [], "samples": None, "offcpu": None, "nvtx": None,
                         "kernels": None}
    names = _stack_names(t, sid)
    stack_index: dict[tuple[int, int], int] = {}

    def stack_of(u: int, k: int) -> int:
        key = (u, k)
        if key not in stack_index:
            frames = [*reversed(names.get(u, [])), *reversed(names.get(k, []))] or [sid("[no stack]")]
            stack_index[key] = len(d["stacks"])
            d["stacks"].append(frames)
            d["user_frames"].append(len(names.get(u, [])))
        return stack_index[key]

    for table, weight, field, scale in STACK_TABLES:
        if not t.has(table):
            continue
        n = t.rows(table)
        if not n:
            d[field] = []
            continue
        rows = t.read(table)
        if len(rows) > MAX_STACK_ROWS:
            rows = np.sort(rows, order=weight)[::-1][:MAX_STACK_ROWS]
            notes.append((f"/{table}: the {MAX_STACK_ROWS} heaviest rows per node", n))
        ts = _rl(_seconds(to_s, rows["t_ns"]), 8)
        ws = _rl(rows[weight].astype(np.float64) * scale)
        d[field] = [[t_s, stack_of(u, k), w] for t_s, u, k, w in zip(ts, rows["user_stack"].tolist(),
                                                                     rows["kernel_stack"].tolist(), ws)]
    d["nvtx"] = _nvtx_rows(t, to_s, sid, notes)
    d["kernels"] = _kernel_rows(t, to_s, sid, notes)
    return d


def _nvtx_rows(t: NodeTables, to_s: Callable[[np.ndarray], np.ndarray], sid: Callable[[str], int],
               notes: list[tuple[str, int]]) -> list[list[Any]] | None:
    if not t.has("nvtx/ranges"):
        return None
    n = t.rows("nvtx/ranges")
    if not n:
        return []
    rows = t.read("nvtx/ranges")
    # string ids are per process (each registers its own strings)
    text: dict[tuple[int, int], str] = {}
    if t.has("nvtx/strings"):
        strs = t.read("nvtx/strings")
        has_pid = "pid" in (strs.dtype.names or ())
        text = {(int(x["pid"]) if has_pid else -1, int(x["string_id"])): _s(x["text"]) for x in strs}
        if not has_pid:
            text.update({(int(p), k[1]): v for k, v in list(text.items()) for p in np.unique(rows["pid"])})
    if len(rows) > MAX_EVENT_ROWS:
        dur = rows["t_end_ns"].astype(np.int64) - rows["t_start_ns"].astype(np.int64)
        rows = rows[np.argsort(-dur, kind="stable")[:MAX_EVENT_ROWS]]
        notes.append((f"NVTX ranges: the {MAX_EVENT_ROWS} longest per node", n))
    t0, t1 = _rl(_seconds(to_s, rows["t_start_ns"]), 9), _rl(_seconds(to_s, rows["t_end_ns"]), 9)
    return [[a, b, sid(text.get((pid, name), f"[string {name} of pid {pid}]")), depth, tid]
            for a, b, pid, name, depth, tid in zip(t0, t1, rows["pid"].tolist(), rows["name_id"].tolist(),
                                                   rows["depth"].tolist(), rows["tid"].tolist())]


def _kernel_rows(t: NodeTables, to_s: Callable[[np.ndarray], np.ndarray], sid: Callable[[str], int],
                 notes: list[tuple[str, int]]) -> list[list[Any]] | None:
    if not t.has("kernels/launches"):
        return None
    n = t.rows("kernels/launches")
    if not n:
        return []
    rows = t.read("kernels/launches")
    names = {}
    if t.has("kernels/functions"):
        names = {(int(r["pid"]), int(r["function"])): _s(r["name"]) for r in t.read("kernels/functions")}
    if len(rows) > MAX_EVENT_ROWS:
        rows = rows[np.linspace(0, len(rows) - 1, MAX_EVENT_ROWS).astype(np.int64)]
        notes.append((f"kernel launches: {MAX_EVENT_ROWS} evenly spaced per node", n))
    ts = _rl(_seconds(to_s, rows["t_ns"]), 9)
    return [[t_s, sid(names.get((pid, fn), "") or f"function {fn:#x}"), gx * gy * gz]  # (Python ints: no overflow)
            for t_s, pid, fn, gx, gy, gz in zip(ts, rows["pid"].tolist(), rows["function"].tolist(),
                                                rows["grid_x"].tolist(), rows["grid_y"].tolist(), rows["grid_z"].tolist())]


def _stack_names(t: NodeTables, sid: Callable[[str], int]) -> dict[int, list[int]]:
    """stack id -> frame names as ids of the payload's string table, innermost first (what
    collector/symbolize.stack_names gives as strings)."""
    if not t.has("stacks/frames") or not t.has("stacks/symbols") or not t.rows("stacks/frames"):
        return {}
    frames = t.read("stacks/frames")
    text = {int(s["symbol_id"]): _s(s["name"]) for s in t.read("stacks/symbols")}
    order = np.lexsort((frames["depth"], frames["stack_id"]))
    out: dict[int, list[int]] = {}
    for r in frames[order]:
        out.setdefault(int(r["stack_id"]), []).append(sid(text.get(int(r["symbol_id"]), "?")))
    return out


# --- communicators ----------------------------------------------------------------------------
def drawn_comms(collectives: h5py.Group, report: dict[str, Any]) -> tuple[list[h5py.Group], int]:
    """The /collectives/comm_* groups the page draws (the MAX_COMMS with the most waiting, then by
    id), and how many there are."""
    groups = [collectives[k] for k in sorted(collectives) if k.startswith("comm_")]
    by_id = {c["comm_id"]: c for c in report.get("communicators", [])}

    def waited(g: h5py.Group) -> float:
        c = by_id.get(f"{int(g.attrs['comm_id']):#x}", {})
        return sum(v["wait_ms_total"] for v in c.get("patterns", {}).values())

    groups.sort(key=lambda g: (-waited(g), int(g.attrs["comm_id"])))
    return groups[:MAX_COMMS], len(groups)


@dataclass
class CommPrep:
    """One communicator's part of the page that needs none of the nodes' rows: the lanes' ranks, the
    wait heat map, the arrival skew and first arrival of every instance (a pass over its largest
    tables). The merge computes it while it waits for the job file's node tables (prepare_comms);
    the page computes it itself otherwise: the same numbers from the same tables."""

    epoch: int
    straggler_nodes: list[str]
    cid: str
    size: int
    node_of: list[str | None]
    n_seq: int
    complete: np.ndarray  # [instances] bool
    ranks: np.ndarray  # the ranks given a lane
    cols: int  # heat map columns (groups of consecutive instances)
    edges: list[int]
    heat_ms: list[list[float | None]]  # per lane rank, the mean wait per group (ms, rounded)
    skew: np.ndarray  # [instances] arrival skew (ns)
    first_e: np.ndarray  # [instances] first arrival, aligned seconds since the epoch
    seq_t: list[list[Any]]  # (collective index, first arrival) points: the stack lanes' axis


def _lane_ranks(g: h5py.Group, size: int, straggler_nodes: list[str]) -> np.ndarray:
    if size <= MAX_LANE_RANKS:
        return np.arange(size)
    last = g["last_rank"][()]
    times_last = np.bincount(last[last >= 0], minlength=size)
    node_of = json.loads(g.attrs["node_of_rank_json"])
    keep = {r for r, n in enumerate(node_of) if n in straggler_nodes}
    for r in np.argsort(-times_last, kind="stable"):
        if len(keep) >= MAX_LANE_RANKS:
            break
        keep.add(int(r))
    return np.array(sorted(keep)[:MAX_LANE_RANKS])


def _lane_cells(ds: h5py.Dataset, s0: int, s1: int, ranks: np.ndarray) -> np.ndarray:
    """ds[s0:s1][:, ranks], read by blocks of rows of BLOCK_CELLS cells: the rows hold every rank
    of the communicator, the lanes only a few (80 rows of 32768 ranks were 21 MB a table)."""
    size = ds.shape[1]
    parts = [ds[s0 + a:s0 + b][:, ranks] for a, b in row_blocks(s1 - s0, size)]
    return np.concatenate(parts) if parts else ds[s0:s1][:, ranks]


def prepare_comm(g: h5py.Group, straggler_nodes: list[str], epoch: int) -> CommPrep:
    """The CommPrep of /collectives/comm_<id> group `g` (of the job file, or of a file with the same
    tables); `straggler_nodes`: the report's, whose ranks get lanes first."""
    size = int(g.attrs["size"])
    n_seq = int(g["complete"].shape[0])
    ranks = _lane_ranks(g, size, straggler_nodes)
    # heat map by collective index: mean wait per rank over groups of consecutive instances
    cols = max(1, min(HEAT_COLUMNS, max(20, HEAT_CELLS // max(1, len(ranks))), n_seq))
    edges = np.linspace(0, n_seq, cols + 1).astype(np.int64)
    group_of = np.searchsorted(edges, np.arange(n_seq), side="right") - 1
    sums = np.zeros((cols, len(ranks)))
    counts = np.zeros((cols, len(ranks)))
    skew = np.full(n_seq, np.nan)
    # the first arrival of each instance, for the lanes' window and the stack lanes' axis
    first_e = np.full(n_seq, np.nan)
    W, E = g["wait_ns"], g["enter_aligned_ns"]
    # each table read once, the page's largest reads: by blocks of rows of BLOCK_CELLS cells (the
    # tables' chunks), not of a fixed row count, whose reads grew with the ranks (200 rows of 32768
    # ranks, 115 MB of temporaries); every cell is summed in the same row order as before
    for i0, i1 in row_blocks(n_seq, size):
        w = W[i0:i1][:, ranks].astype(np.float64)
        e = E[i0:i1].astype(np.float64)
        e[e < 0] = np.nan
        with np.errstate(invalid="ignore"):
            skew[i0:i0 + len(e)] = np.nanmax(e, axis=1) - np.nanmin(e, axis=1) if e.shape[1] else np.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            first_e[i0:i0 + len(e)] = (np.nanmin(e, axis=1) - epoch) / 1e9
        ok = w >= 0
        gg = group_of[i0:i0 + len(w)]
        np.add.at(sums, gg, np.where(ok, w, 0.0))
        np.add.at(counts, gg, ok)
    with np.errstate(invalid="ignore", divide="ignore"):
        heat = np.where(counts > 0, sums / np.maximum(counts, 1) / 1e6, np.nan)
    # collective index against aligned time (the first arrival), for the stack lanes' axis
    known = np.flatnonzero(np.isfinite(first_e))
    pick = known[np.linspace(0, len(known) - 1, min(len(known), SEQ_TIME_POINTS)).astype(np.int64)] if len(known) else known
    return CommPrep(epoch, list(straggler_nodes), f"{int(g.attrs['comm_id']):#x}", size,
                    json.loads(g.attrs["node_of_rank_json"]), n_seq, g["complete"][()].astype(bool), ranks, cols,
                    edges.tolist(), [_rl(row, 3) for row in heat.T], skew, first_e,
                    [[k, t] for k, t in zip(pick.tolist(), _rl(first_e[pick], 8))])


def prepare_comms(collectives_file: Path, report: dict[str, Any], epoch: int) -> dict[str, CommPrep]:
    """CommPrep of the communicators the page of a job with this report draws, from a file whose
    /collectives is the job file's (the merge's own part, before it is copied in): for
    render_html_file's `comms`."""
    straggler_nodes = [s["node"] for s in report.get("stragglers", [])]
    with h5py.File(collectives_file, "r") as f:
        if "collectives" not in f:
            return {}
        groups, _ = drawn_comms(f["collectives"], report)
        return {g.name.rpartition("/")[2]: prepare_comm(g, straggler_nodes, epoch) for g in groups}


class NodePasses(Protocol):
    """The page's two passes over the nodes, each result in node order: here (SerialPasses) or dealt
    over the merge ranks (merge.py)."""

    def facts(self) -> Iterator[NodeFacts]: ...

    def contents(self, grid: TimeGrid, facts: list[NodeFacts],
                 gpus: list[list[tuple[int, str]]]) -> Iterator[NodeContent]: ...


class SerialPasses:
    """Every node on this process, in order."""

    def __init__(self, nodes: JobNodes):
        self.nodes = nodes

    def facts(self) -> Iterator[NodeFacts]:
        return (self.nodes.facts(i) for i in range(len(self.nodes.nodes)))

    def contents(self, grid: TimeGrid, facts: list[NodeFacts],
                 gpus: list[list[tuple[int, str]]]) -> Iterator[NodeContent]:
        return (self.nodes.content(i, facts[i], grid, gpus[i]) for i in range(len(self.nodes.nodes)))


class PageContext:
    """A merge rank's side of the page's passes (common.RankPool's context): the finished job file,
    opened read-only on the first item (every rank reads it, none writes it any more); rank 0's
    items use the file its page is drawn from (`use`)."""

    def __init__(self, job_file: Path):
        self.job_file = job_file
        self._f: h5py.File | None = None  # opened here (closed by close)
        self._nodes: JobNodes | None = None

    def use(self, nodes: JobNodes) -> None:
        self._nodes = nodes

    @property
    def nodes(self) -> JobNodes:
        if self._nodes is None:
            self._f = open_job_file(self.job_file)
            self._nodes = JobNodes(self._f)
        return self._nodes

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        self._f = self._nodes = None


# Nodes per item of the page's passes over the merge ranks, at most: a node's pass takes about a
# millisecond, about what dealing one item costs rank 0; fewer in a small job, so that every rank
# has some (ITEMS_PER_RANK items each)
NODES_PER_ITEM = 16
ITEMS_PER_RANK = 8


@dataclass
class FactsTask:
    """common.Task: the first pass of item i's nodes (`per_item` consecutive ones)."""

    per_item: int

    def __call__(self, ctx: PageContext, item: int) -> list[NodeFacts]:
        job = ctx.nodes
        return [job.facts(i) for i in range(item * self.per_item, min(len(job.nodes), (item + 1) * self.per_item))]


@dataclass
class ContentTask:
    """common.Task: the second pass of item i's nodes; it carries what the pass needs of every node
    (a few counts, the report's GPUs), not their data."""

    per_item: int
    grid: TimeGrid
    facts: list[NodeFacts]
    gpus: list[list[tuple[int, str]]]

    def __call__(self, ctx: PageContext, item: int) -> list[NodeContent]:
        job = ctx.nodes
        return [job.content(i, self.facts[i], self.grid, self.gpus[i])
                for i in range(item * self.per_item, min(len(job.nodes), (item + 1) * self.per_item))]


class PoolPasses:
    """The passes dealt over the merge ranks (a common.Pool of PageContext, every rank on the same
    finished job file); rank 0 takes the results in node order, which makes the page the same as
    drawn on one process (the payload is assembled in node order from the same per-node results)."""

    def __init__(self, pool: Pool, n_nodes: int):
        self.pool = pool
        self.per_item = max(1, min(NODES_PER_ITEM, n_nodes // (ITEMS_PER_RANK * pool.size)))
        self.n_items = -(-n_nodes // self.per_item)

    def facts(self) -> Iterator[NodeFacts]:
        for got in self.pool.map(FactsTask(self.per_item), self.n_items):
            yield from got

    def contents(self, grid: TimeGrid, facts: list[NodeFacts],
                 gpus: list[list[tuple[int, str]]]) -> Iterator[NodeContent]:
        for got in self.pool.map(ContentTask(self.per_item, grid, facts, gpus), self.n_items):
            yield from got


class PayloadBuilder:
    """Reads one job file into the page's payload (see the module doc for what is summarized).
    `passes`: where the per-node passes run (this process when None)."""

    def __init__(self, f: h5py.File, report: dict[str, Any], passes: NodePasses | None = None,
                 job: JobNodes | None = None, comms: dict[str, CommPrep] | None = None):
        self.f = f
        self.report = report
        self.prepared = comms or {}  # the communicators' CommPrep by group name, computed before
        self.job = job if job is not None else JobNodes(f)
        self.passes = passes if passes is not None else SerialPasses(self.job)
        self.nodes = self.job.nodes
        self.epoch = self.job.epoch
        self.summarized: list[str] = []
        self._per_node: dict[str, list[tuple[str, int]]] = {}
        self._gpu_means: dict[tuple[str, int], dict[str, float]] = {}
        self._phases: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self.strings: dict[str, int] = {}
        self.straggler_nodes = [s["node"] for s in report.get("stragglers", [])]
        self.stacks_from_s = -np.inf  # aligned time from which every node with stacks has some
        self._with_content: set[str] = set()  # the merged nodes, once their second pass is in

    def per_node(self, what: str, node: str, of: int) -> None:
        """A summary made node by node: one line per kind in the page, with the nodes and their totals."""
        self._per_node.setdefault(what, []).append((node, of))

    def per_node_lines(self) -> list[str]:
        out = []
        for what, nodes in self._per_node.items():
            shown = ", ".join(f"{n} ({of})" for n, of in nodes[:6]) + (f" and {len(nodes) - 6} more" if len(nodes) > 6 else "")
            out.append(f"{what}, on {len(nodes)} node(s) with more (total rows: {shown})")
        return out

    def sid(self, s: str) -> int:
        """Index of a name in the payload's string table (frames, kernels, NVTX names)."""
        return self.strings.setdefault(s, len(self.strings))

    # --- the time span ---------------------------------------------------------------------------
    def grid(self, facts: list[NodeFacts]) -> TimeGrid:
        """The span of the data: every node's first and last metric sample and call."""
        lo, hi = np.inf, -np.inf
        for fa in facts:
            if fa.span is not None:
                lo, hi = min(lo, fa.span[0]), max(hi, fa.span[1])
        if not np.isfinite(lo):
            lo, hi = 0.0, 1.0
        hi = max(hi, lo + 1e-3)
        # no bin narrower than the metrics' sampling interval: a bin without a sample is a gap in the line
        return TimeGrid(lo, hi, int(np.clip((hi - lo) / self.sample_interval_s(facts), 20, TIME_BINS)))

    def sample_interval_s(self, facts: list[NodeFacts]) -> float:
        """The median interval of the first node's metric samples that has any (one GPU's, or the host's)."""
        for node, fa in zip(self.nodes, facts):
            for tab in ("gpu/samples", "host/node"):
                if fa.rows.get(tab, 0) > 2:
                    ds = self.job.tables(node, fa).dataset(tab)
                    assert ds is not None
                    rows = ds[: min(ds.shape[0], 2000)]
                    t = rows["t_ns"][rows["gpu"] == rows["gpu"][0]] if "gpu" in (rows.dtype.names or ()) else rows["t_ns"]
                    if len(t) > 2:
                        return max(float(np.median(np.diff(t.astype(np.float64)))) / 1e9, 1e-3)
        return 0.1  # no metrics: the lanes alone use the grid

    # --- collectives -----------------------------------------------------------------------------
    def comms(self) -> list[dict[str, Any]]:
        if "collectives" not in self.f:
            return []
        groups, n_all = drawn_comms(self.f["collectives"], self.report)
        if n_all > MAX_COMMS:
            self.summarized.append(f"communicators: the {MAX_COMMS} with the most waiting of {n_all} are drawn")
        by_id = {c["comm_id"]: c for c in self.report.get("communicators", [])}
        out = []
        for g in groups:
            prep = self.prepared.get(g.name.rpartition("/")[2])
            if prep is None or prep.epoch != self.epoch or prep.straggler_nodes != self.straggler_nodes:
                prep = prepare_comm(g, self.straggler_nodes, self.epoch)
            out.append(self.comm(g, by_id.get(prep.cid, {}), prep))
        return out

    def comm(self, g: h5py.Group, rep: dict[str, Any], c: CommPrep) -> dict[str, Any]:
        cid, size, n_seq, ranks = c.cid, c.size, c.n_seq, c.ranks
        if len(ranks) < size:
            self.summarized.append(f"communicator {cid}: lanes of {len(ranks)} of its {size} ranks (the straggler "
                                   "nodes' ranks and those last most often)")
        if c.cols < n_seq:
            self.summarized.append(f"communicator {cid}: wait heat map of {n_seq} instances in {c.cols} groups "
                                   "(mean wait per group)")
        # time lanes: a window of consecutive instances around the one with the largest arrival skew
        n_win = max(1, min(LANE_INSTANCES, LANE_CELLS // max(1, len(ranks)), n_seq))
        sk = np.where(c.complete, c.skew, np.nan)
        # among the instances the drill-down has stacks for (probes can attach after the job began)
        covered = np.isfinite(sk) & (c.first_e >= self.stacks_from_s)
        if covered.any():
            sk = np.where(covered, sk, np.nan)
        worst = int(np.nanargmax(sk)) if np.isfinite(sk).any() else 0
        s0 = int(np.clip(worst - n_win // 2, 0, max(0, n_seq - n_win)))
        s1 = min(n_seq, s0 + n_win)
        if s1 - s0 < n_seq:
            self.summarized.append(f"communicator {cid}: time lanes of instances {s0}-{s1 - 1} of {n_seq} (around "
                                   f"the largest arrival skew, seq {worst})")
        ew = _lane_cells(g["enter_aligned_ns"], s0, s1, ranks).astype(np.int64)
        xw = _lane_cells(g["exit_aligned_ns"], s0, s1, ranks).astype(np.int64)
        ww = _lane_cells(g["wait_ns"], s0, s1, ranks).astype(np.float64)
        op = _lane_cells(g["op"], s0, s1, ranks)
        last = g["last_rank"][s0:s1]
        # a cell per (instance, lane) that has both ends, instance by instance (row-major order)
        keep = (ew >= 0) & (xw >= 0)
        jj, kk = np.nonzero(keep)
        wk = ww[keep]
        cells = [[k, s0 + j, te, tx, w, o, la] for j, k, te, tx, w, o, la in zip(
            jj.tolist(), kk.tolist(), _rl((ew[keep] - self.epoch) / 1e9, 10), _rl((xw[keep] - self.epoch) / 1e9, 10),
            _rl(np.where(wk >= 0, wk / 1e6, np.nan)), op[keep].tolist(),
            (last[jj] == ranks[kk]).astype(np.int64).tolist())]
        return {
            "seq_t": c.seq_t,
            "id": cid, "size": size, "instances": n_seq, "complete": int(c.complete.sum()),
            "ranks": ranks.tolist(), "rank_nodes": [c.node_of[int(r)] for r in ranks],
            "patterns": rep.get("patterns", {}), "skew_ms": rep.get("arrival_skew_ms", {}),
            "heat": {"edges": c.edges, "ms": c.heat_ms},
            "window": [s0, s1], "worst_seq": worst, "cells": cells,
        }

    # --- metrics ---------------------------------------------------------------------------------
    def metrics(self, per_metric: dict[str, list[Series]], off: list[Series]) -> list[dict[str, Any]]:
        specs = GPU_METRICS + HOST_METRICS
        out = [self.summarize_metric(spec, per_metric[spec[2]]) for spec in specs if per_metric[spec[2]]]
        if off:
            out.append(self.summarize_metric(("offcpu/intervals", "blocked_ns", "offcpu",
                                              "Off-CPU (blocked) time of the job's threads", "threads", 1.0), off))
        return out

    def summarize_metric(self, spec: tuple[str, str, str, str, str, float],
                         series: list[Series]) -> dict[str, Any]:
        table, column, key, title, unit, scale = spec
        n_nodes = len({s[0] for s in series})
        doc: dict[str, Any] = {"key": key, "title": title, "unit": unit, "source": f"/{table}:{column}",
                               "nodes": n_nodes, "band": None}
        if n_nodes <= ALL_SERIES_NODES:
            chosen = series
        else:
            M = np.array([s[2] for s in series]) * scale
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN bins (no sample there) stay NaN
                p10, p50, p90 = np.nanpercentile(M, [10, 50, 90], axis=0)
                dev = np.nanmean(np.abs(M - p50), axis=1)
            order = sorted(range(len(series)), key=lambda i: (series[i][0] not in self.straggler_nodes,
                                                              -(dev[i] if np.isfinite(dev[i]) else -1)))
            chosen = [series[i] for i in order[:TOP_SERIES]]
            doc["band"] = {"p10": _rl(p10, 3), "p50": _rl(p50, 3), "p90": _rl(p90, 3)}
            self.summarized.append(f"{title}: {len(series)} series of {n_nodes} nodes shown as their 10/50/90th "
                                   f"percentiles per time bin plus the {len(chosen)} that deviate most (straggler "
                                   "nodes first)")
        doc["series"] = [{"node": n, "gpu": gi, "v": _rl(v * scale, 3)} for n, gi, v in chosen]
        return doc

    # --- the nodes' share: node rows, metric series ------------------------------------------------
    def take_contents(self, contents: Iterator[NodeContent]) -> tuple[dict[str, dict[str, Any]], dict[str, list[Series]], list[Series]]:
        """The nodes' second pass, in node order: node_rows with the node's string ids mapped to the
        payload's (the names of node k get their ids after those of nodes 0..k-1, as when the page
        asked node by node), the series per metric, the off-CPU series."""
        rows_out: dict[str, dict[str, Any]] = {}
        series: dict[str, list[Series]] = {spec[2]: [] for spec in GPU_METRICS + HOST_METRICS}
        offcpu: list[Series] = []
        for node, c in zip(self.nodes, contents, strict=True):
            ids = [self.sid(s) for s in c.strings]
            d = c.rows
            d["stacks"] = [[ids[k] for k in frames] for frames in d["stacks"]]
            for r in d["nvtx"] or ():
                r[2] = ids[r[2]]
            for r in d["kernels"] or ():
                r[1] = ids[r[1]]
            rows_out[node] = d
            for what, of in c.notes:
                self.per_node(what, node, of)
            for key, gi, b in c.series:
                series[key].append((node, gi, b))
            for gi, means in c.gpu_means.items():
                self._gpu_means[(node, gi)] = means
            for gi, ph in c.phases.items():
                self._phases[(node, gi)] = ph
            self._with_content.add(node)
            if c.offcpu is not None:
                offcpu.append((node, None, c.offcpu))
        return rows_out, series, offcpu

    # --- clocks ----------------------------------------------------------------------------------
    def clocks(self) -> list[dict[str, Any]]:
        rep_nodes = {n["node"]: n["clock"] for n in self.report.get("nodes", [])}
        order = sorted(self.nodes, key=lambda n: -(rep_nodes.get(n, {}).get("uncertainty_us") or 0.0))
        if len(order) > MAX_CLOCK_NODES:
            self.summarized.append(f"clock offsets: the {MAX_CLOCK_NODES} nodes of {len(order)} with the widest "
                                   "error intervals are drawn (the table lists all)")
        out = []
        has_iv = "clock/segments" in self.f and "offset_lo_ns" in (self.f["clock/segments"].dtype.names or ())
        for node in order[:MAX_CLOCK_NODES]:
            pts = []
            mine = all_mine = self.job.seg_rows(node)
            if len(mine) > MAX_CLOCK_POINTS:
                mine = mine[np.linspace(0, len(mine) - 1, MAX_CLOCK_POINTS).astype(np.int64)]
                self.per_node(f"clock offsets: {MAX_CLOCK_POINTS} evenly spaced model segments per node", node,
                              len(all_mine))
            if len(mine):
                for r in mine:
                    pts.append([_r((int(r["t_start_ns"]) - self.epoch) / 1e9, 8), _r(float(r["offset_ns"]) / 1e3, 6),
                                _r(float(r["offset_lo_ns"]) / 1e3, 6) if has_iv else None,
                                _r(float(r["offset_hi_ns"]) / 1e3, 6) if has_iv else None,
                                _r(float(r["drift_ppm"]), 4)])
            out.append({"node": node, "points": pts})
        return out

    def finding_flames(self, n_findings: int) -> list[dict[str, Any] | None]:
        """The analysis's differential stacks of each finding (/analysis/flames/finding_<i>: folded
        stacks with the late processes' and the peers' per-process weights), None where absent."""
        out: list[dict[str, Any] | None] = []
        for i in range(n_findings):
            path = f"analysis/flames/finding_{i}"
            if path not in self.f:
                out.append(None)
                continue
            d: dict[str, Any] = {}
            for kind in ("cpu", "offcpu"):
                if kind not in self.f[path]:
                    d[kind] = None
                    continue
                rows = self.f[path][kind][()]
                d[kind] = [[[self.sid(x) for x in _s(r["stack"]).split(";")], _r(float(r["late"])), _r(float(r["peers"]))]
                           for r in rows]
            out.append(d)
        return out

    def coverage(self, facts: list[NodeFacts]) -> list[dict[str, Any]]:
        """Per source, the nodes that recorded rows of it (the summary's "missing data")."""
        out = []
        for path, what in COVERAGE:
            without = [n for n, fa in zip(self.nodes, facts) if not fa.rows.get(path, 0)]
            out.append({"source": what, "table": "/" + path, "nodes": len(self.nodes) - len(without),
                        "of": len(self.nodes), "without": without[:20]})
        missing = [(n["node"], m) for n in self.report.get("nodes", []) for m in n.get("missing_metrics", [])]
        if missing:
            out.append({"source": "metrics the collectors could not read", "table": "/diagnostics/missing",
                        "nodes": len({n for n, _ in missing}), "of": len(self.nodes),
                        "without": [f"{n}: {m}" for n, m in missing[:20]]})
        return out

    # --- tables ----------------------------------------------------------------------------------
    def gpus(self) -> list[dict[str, Any]]:
        rows = []
        for n in self.report.get("nodes", []):
            node = n["node"]
            for gpu in n.get("gpus", []):
                gi = int(gpu["gpu"])
                # the nodes' pass computed them while it had the tables; a GPU without rows there has
                # none (NaN, as its read of the tables found), a node not merged is read here
                means = self._gpu_means.get((node, gi)) or roofline.gpu_means(
                    self.f, node, gi, (None, None) if node in self._with_content else None)
                phases = (self._phases.get((node, gi), []) if node in self._with_content
                          else roofline.phase_classes(self.f, node, gi, gpu.get("name", "")))
                rows.append({"node": node, "gpu": gpu["gpu"], "name": gpu.get("name", ""),
                             "util": _r(gpu.get("util_gpu_mean") if gpu.get("util_gpu_mean") is not None else np.nan, 3),
                             "mem_gib": _r((gpu.get("mem_used_max_bytes") or np.nan) / 2**30, 3),
                             **{k: _r(v, 3) for k, v in means.items()},
                             **roofline.classify(gpu.get("name", ""), means),
                             "phases": phases})
        # the straggler nodes' GPUs first, then the flagged and underused ones: what a reader looks for
        rank = {"underused": 1, "unknown": 3}
        rows.sort(key=lambda x: (x["node"] not in self.straggler_nodes, not x["flags"], rank.get(x["roofline"], 2),
                                 x["node"], x["gpu"]))
        return rows

    def ranks(self) -> list[dict[str, Any]]:
        rows = sorted(self.report.get("ranks", []), key=lambda r: -float(r.get("wait_ns_total", 0.0)))
        if len(rows) > MAX_RANK_ROWS:
            self.summarized.append(f"rank table: the {MAX_RANK_ROWS} (communicator, rank) rows that waited most of "
                                   f"{len(rows)}")
        return [{"comm": r["comm_id"], "rank": r["rank"], "node": r.get("node"), "instances": r.get("instances"),
                 "last": r.get("times_last"), "wait_ms": _r(float(r.get("wait_ns_total", 0.0)) / 1e6)}
                for r in rows[:MAX_RANK_ROWS]]

    def build(self) -> dict[str, Any]:
        facts = list(self.passes.facts())  # every node's tables counted, and its span
        grid = self.grid(facts)
        r = self.report
        payload: dict[str, Any] = {
            "job_id": r.get("job_id"), "synthetic": bool(r.get("synthetic")), "synthetic_banner": SYNTHETIC_BANNER,
            "status": r.get("status"), "grid": {"t0": grid.t0, "dt": grid.dt, "bins": grid.bins},
            "summary": {
                "stragglers": [{k: s.get(k) for k in ("node", "ranks", "comm_id", "cause", "kind", "cost_ns",
                                                      "cost_share", "share_last", "expected_share", "first_s",
                                                      "last_s", "evidence", "propagated", "phase", "kernel", "stacks")}
                               for s in r.get("stragglers", [])],
                "straggler_summary": r.get("straggler_summary", {}), "clock": r.get("clock", {}),
                "partial_reasons": r.get("partial_reasons", []), "mismatches": r.get("mismatches", []),
                "idle_gpus": r.get("idle_or_underused_gpus", []), "p2p": r.get("p2p"),
                "nodes_merged": len(r.get("nodes_merged", [])), "missing_nodes": r.get("missing_nodes", []),
            },
            "clock_table": [{"node": n["node"], "host": n.get("hostname"), **{k: n["clock"].get(k) for k in (
                "aligned", "reference", "offset_us", "drift_ppm", "segments", "residual_us", "uncertainty_us",
                "interval_lo_us", "interval_hi_us", "n_points")}, "calls": n.get("collective_calls"),
                "drops": n.get("drops_total")} for n in r.get("nodes", [])],
            "op_names": r.get("op_names", []),
            # per node and process: seconds in each NVTX range (analysis), when the report has them
            "nvtx_phases": [{"node": n["node"], "pid": pid, "range": name, "s": sec}
                            for n in r.get("nodes", []) for pid, ph in sorted((n.get("nvtx_phases_s") or {}).items())
                            for name, sec in sorted(ph.items(), key=lambda kv: -kv[1])][:MAX_RANK_ROWS],
            # per node and process: GPU seconds per kernel (CUPTI), when recorded
            "kernel_time": [{"node": n["node"], "pid": pid, "kernel": name, "s": sec}
                            for n in r.get("nodes", []) for pid, kt in sorted((n.get("kernel_time_s") or {}).items())
                            for name, sec in sorted(kt.items(), key=lambda kv: -kv[1])][:MAX_RANK_ROWS],
            # the job's NCCL_DEBUG log, when one was found (mpi_merge/nccl_log.py)
            "nccl_log": r.get("nccl_log"),
        }
        payload["coverage"] = self.coverage(facts)
        payload["finding_flames"] = self.finding_flames(len(r.get("stragglers", [])))
        gpus_of: dict[str, list[tuple[int, str]]] = {}
        for n in r.get("nodes", []):
            gpus_of.setdefault(n["node"], []).extend((int(x["gpu"]), x.get("name", "")) for x in n.get("gpus", []))
        payload["node_rows"], series, offcpu = self.take_contents(
            self.passes.contents(grid, facts, [gpus_of.get(n, []) for n in self.nodes]))
        firsts = [min(r[0] for r in d["samples"]) for d in payload["node_rows"].values() if d["samples"]]
        self.stacks_from_s = max(firsts) if firsts else -np.inf
        payload["comms"] = self.comms()
        payload["metrics"] = self.metrics(series, offcpu)
        payload["clocks"] = self.clocks()
        payload["gpus"] = self.gpus()
        payload["ranks"] = self.ranks()
        payload["roofline_peaks"] = roofline.PEAKS_DOC
        payload["strings"] = list(self.strings)
        payload["summarized"] = self.summarized + self.per_node_lines()
        return payload


def payload_json(payload: dict[str, Any]) -> str:
    """JSON that is safe inside <script type="application/json">: no '<', '>' or '&' survives."""
    text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _asset(name: str) -> str:
    p = ASSETS / name
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise TraceFormatError(f"{p}: the HTML report's asset is missing ({e}); reinstall slurm-gpuprof") from None


def render_page(payload: dict[str, Any]) -> str:
    title = f"gpuprof job {payload.get('job_id')}"
    esc = title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    lib = _asset(CHART_LIBRARY).replace("</script", "<\\/script")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc}</title>\n'
            f'<meta name="generator" content="slurm-gpuprof (charts: Apache ECharts, {CHART_LIBRARY})">\n'
            f"<style>{_asset('report.css')}</style>\n"
            # errors are caught before anything else runs, so the page (and its browser test) shows them
            "<script>window.gpErrors=[];window.addEventListener('error',function(e){window.gpErrors.push(String("
            "e.message))});</script>\n"
            f'</head><body><div id="gp-app"></div>\n'
            f'<script type="application/json" id="gp-data">{payload_json(payload)}</script>\n'
            f"<script>{lib}</script>\n<script>{_asset('report.js')}</script>\n</body></html>\n")


def html_path_of(job_file: Path) -> Path:
    """STEM.gpuprof.html beside STEM.gpuprof.h5 (where the merge writes it)."""
    return job_file.with_suffix(".html")


def render_html_file(job_file: str | Path, pool: Pool | None = None, context: PageContext | None = None,
                     comms: dict[str, CommPrep] | None = None) -> str:
    """The page of a job file. For the merge, on rank 0: `pool`, its ranks, to deal the passes over
    the nodes over them (a common.RankPool whose context on this rank is `context`, a PageContext of
    the same file); `comms`, the communicators' sections computed before (prepare_comms). The same
    page as without them."""
    with open_job_file(Path(job_file)) as f:
        report = json.loads(f["analysis"].attrs["report_json"])
        job = JobNodes(f)
        passes = None
        if pool is not None:
            assert context is not None, "a pool's PageContext on this rank"
            context.use(job)  # rank 0's own items: the file and clocks it has open
            passes = PoolPasses(pool, len(job.nodes))
        return render_page(PayloadBuilder(f, report, passes, job, comms).build())
