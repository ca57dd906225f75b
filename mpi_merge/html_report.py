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
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gpuprof.collector.errors import TraceFormatError
from gpuprof.mpi_merge import roofline
from gpuprof.mpi_merge.export import open_job_file
from gpuprof.mpi_merge.jobclock import node_time_mappers, segment_rows_by_node

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
READ_ROWS = 4096  # rows of a [seq x rank] table read at once

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


def _rl(a: np.ndarray, digits: int = 4) -> list[float | None]:
    return [_r(v, digits) for v in a.tolist()]


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


class PayloadBuilder:
    """Reads one job file into the page's payload (see the module doc for what is summarized)."""

    def __init__(self, f: h5py.File, report: dict[str, Any]):
        self.f = f
        self.report = report
        self.nodes: list[str] = json.loads(f.attrs["nodes"])
        self.epoch = int(f.attrs["epoch_realtime_ns"])
        self.summarized: list[str] = []
        self._per_node: dict[str, list[tuple[str, int]]] = {}
        self._gpu_means: dict[tuple[str, int], dict[str, float]] = {}
        self.strings: dict[str, int] = {}
        self._mappers: dict[str, Callable[[np.ndarray], np.ndarray]] | None = None
        self.straggler_nodes = [s["node"] for s in report.get("stragglers", [])]
        self.stacks_from_s = -np.inf  # aligned time from which every node with stacks has some
        self._groups: dict[str, h5py.Group] = {}
        self._rows: dict[tuple[str, str], int] = {}  # (node, table) -> rows, once looked up

    def group(self, node: str) -> h5py.Group:
        """/nodes/NODE, opened once (a path from the file's root walks /nodes, thousands of links)."""
        if node not in self._groups:
            self._groups[node] = self.f["nodes"][node]
        return self._groups[node]

    def table(self, node: str, path: str) -> h5py.Dataset | None:
        """A node's table, None when the node has none or it has no rows. Whether it has rows is
        remembered (the sections ask about the same tables of every node); the dataset itself is
        opened again each time: an open HDF5 dataset costs kilobytes, and there are nodes x tables."""
        key = (node, path)
        if self._rows.get(key, 1) == 0:
            return None
        ds = self.group(node).get(path)
        n = ds.shape[0] if isinstance(ds, h5py.Dataset) else 0
        self._rows[key] = n
        return ds if n else None

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

    def to_s(self, node: str, t_mono_ns: np.ndarray) -> np.ndarray:
        """A node's CLOCK_MONOTONIC ns -> aligned seconds since the epoch."""
        if self._mappers is None:
            self._mappers = node_time_mappers(self.f)
        if not len(t_mono_ns):
            return np.zeros(0)
        return (self._mappers[node](t_mono_ns.astype(np.int64)) - self.epoch) / 1e9

    # --- the time span ---------------------------------------------------------------------------
    def grid(self) -> TimeGrid:
        """The span of the data: every node's first and last metric sample and call."""
        lo, hi = np.inf, -np.inf
        for node in self.nodes:
            ts = []
            for tab in ("host/node", "gpu/samples", "collectives/calls"):
                ds = self.table(node, tab)
                if ds is not None:
                    col = "t_ns" if tab != "collectives/calls" else "t_enter_ns"
                    ts += [int(ds[0][col]), int(ds[ds.shape[0] - 1][col])]
            if ts:
                t = self.to_s(node, np.array(ts, np.int64))
                lo, hi = min(lo, float(t.min())), max(hi, float(t.max()))
        if not np.isfinite(lo):
            lo, hi = 0.0, 1.0
        hi = max(hi, lo + 1e-3)
        # no bin narrower than the metrics' sampling interval: a bin without a sample is a gap in the line
        return TimeGrid(lo, hi, int(np.clip((hi - lo) / self.sample_interval_s(), 20, TIME_BINS)))

    def sample_interval_s(self) -> float:
        """The median interval of the first node's metric samples that has any (one GPU's, or the host's)."""
        for node in self.nodes:
            for tab in ("gpu/samples", "host/node"):
                ds = self.table(node, tab)
                if ds is not None and ds.shape[0] > 2:
                    rows = ds[: min(ds.shape[0], 2000)]
                    t = rows["t_ns"][rows["gpu"] == rows["gpu"][0]] if "gpu" in (rows.dtype.names or ()) else rows["t_ns"]
                    if len(t) > 2:
                        return max(float(np.median(np.diff(t.astype(np.float64)))) / 1e9, 1e-3)
        return 0.1  # no metrics: the lanes alone use the grid

    # --- collectives -----------------------------------------------------------------------------
    def comms(self) -> list[dict[str, Any]]:
        if "collectives" not in self.f:
            return []
        groups = [self.f["collectives"][k] for k in sorted(self.f["collectives"]) if k.startswith("comm_")]
        by_id = {c["comm_id"]: c for c in self.report.get("communicators", [])}

        def waited(g: h5py.Group) -> float:
            c = by_id.get(f"{int(g.attrs['comm_id']):#x}", {})
            return sum(v["wait_ms_total"] for v in c.get("patterns", {}).values())

        groups.sort(key=lambda g: (-waited(g), int(g.attrs["comm_id"])))
        if len(groups) > MAX_COMMS:
            self.summarized.append(f"communicators: the {MAX_COMMS} with the most waiting of {len(groups)} are drawn")
        return [self.comm(g, by_id.get(f"{int(g.attrs['comm_id']):#x}", {})) for g in groups[:MAX_COMMS]]

    def _lane_ranks(self, g: h5py.Group, size: int) -> np.ndarray:
        if size <= MAX_LANE_RANKS:
            return np.arange(size)
        last = g["last_rank"][()]
        times_last = np.bincount(last[last >= 0], minlength=size)
        node_of = json.loads(g.attrs["node_of_rank_json"])
        keep = {r for r, n in enumerate(node_of) if n in self.straggler_nodes}
        for r in np.argsort(-times_last, kind="stable"):
            if len(keep) >= MAX_LANE_RANKS:
                break
            keep.add(int(r))
        return np.array(sorted(keep)[:MAX_LANE_RANKS])

    def comm(self, g: h5py.Group, rep: dict[str, Any]) -> dict[str, Any]:
        cid = f"{int(g.attrs['comm_id']):#x}"
        size = int(g.attrs["size"])
        node_of = json.loads(g.attrs["node_of_rank_json"])
        n_seq = int(g["complete"].shape[0])
        complete = g["complete"][()].astype(bool)
        ranks = self._lane_ranks(g, size)
        if len(ranks) < size:
            self.summarized.append(f"communicator {cid}: lanes of {len(ranks)} of its {size} ranks (the straggler "
                                   "nodes' ranks and those last most often)")
        # heat map by collective index: mean wait per rank over groups of consecutive instances
        cols = max(1, min(HEAT_COLUMNS, max(20, HEAT_CELLS // max(1, len(ranks))), n_seq))
        edges = np.linspace(0, n_seq, cols + 1).astype(np.int64)
        group_of = np.searchsorted(edges, np.arange(n_seq), side="right") - 1
        sums = np.zeros((cols, len(ranks)))
        counts = np.zeros((cols, len(ranks)))
        skew = np.full(n_seq, np.nan)
        W, E = g["wait_ns"], g["enter_aligned_ns"]
        for i0 in range(0, n_seq, READ_ROWS):
            w = W[i0:i0 + READ_ROWS][:, ranks].astype(np.float64)
            e = E[i0:i0 + READ_ROWS].astype(np.float64)
            e[e < 0] = np.nan
            with np.errstate(invalid="ignore"):
                skew[i0:i0 + len(e)] = np.nanmax(e, axis=1) - np.nanmin(e, axis=1) if e.shape[1] else np.nan
            ok = w >= 0
            gg = group_of[i0:i0 + len(w)]
            np.add.at(sums, gg, np.where(ok, w, 0.0))
            np.add.at(counts, gg, ok)
        with np.errstate(invalid="ignore", divide="ignore"):
            heat = np.where(counts > 0, sums / np.maximum(counts, 1) / 1e6, np.nan)
        if cols < n_seq:
            self.summarized.append(f"communicator {cid}: wait heat map of {n_seq} instances in {cols} groups "
                                   "(mean wait per group)")
        # time lanes: a window of consecutive instances around the one with the largest arrival skew
        n_win = max(1, min(LANE_INSTANCES, LANE_CELLS // max(1, len(ranks)), n_seq))
        sk = np.where(complete, skew, np.nan)
        # among the instances the drill-down has stacks for (probes can attach after the job began)
        first_e = np.full(n_seq, np.nan)
        for i0 in range(0, n_seq, READ_ROWS):
            e = E[i0:i0 + READ_ROWS].astype(np.float64)
            e[e < 0] = np.nan
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                first_e[i0:i0 + len(e)] = (np.nanmin(e, axis=1) - self.epoch) / 1e9
        covered = np.isfinite(sk) & (first_e >= self.stacks_from_s)
        if covered.any():
            sk = np.where(covered, sk, np.nan)
        worst = int(np.nanargmax(sk)) if np.isfinite(sk).any() else 0
        s0 = int(np.clip(worst - n_win // 2, 0, max(0, n_seq - n_win)))
        s1 = min(n_seq, s0 + n_win)
        if s1 - s0 < n_seq:
            self.summarized.append(f"communicator {cid}: time lanes of instances {s0}-{s1 - 1} of {n_seq} (around "
                                   f"the largest arrival skew, seq {worst})")
        ew = g["enter_aligned_ns"][s0:s1][:, ranks].astype(np.int64)
        xw = g["exit_aligned_ns"][s0:s1][:, ranks].astype(np.int64)
        ww = g["wait_ns"][s0:s1][:, ranks].astype(np.float64)
        op = g["op"][s0:s1][:, ranks]
        last = g["last_rank"][s0:s1]
        cells = []
        for j in range(s1 - s0):
            for k, r in enumerate(ranks):
                if ew[j, k] < 0 or xw[j, k] < 0:
                    continue
                cells.append([k, s0 + j, _r((ew[j, k] - self.epoch) / 1e9, 10), _r((xw[j, k] - self.epoch) / 1e9, 10),
                              _r(ww[j, k] / 1e6 if ww[j, k] >= 0 else np.nan), int(op[j, k]), int(last[j] == r)])
        # collective index against aligned time (the first arrival), for the stack lanes' axis
        known = np.flatnonzero(np.isfinite(first_e))
        pick = known[np.linspace(0, len(known) - 1, min(len(known), SEQ_TIME_POINTS)).astype(np.int64)] if len(known) else known
        return {
            "seq_t": [[int(k), _r(float(first_e[k]), 8)] for k in pick],
            "id": cid, "size": size, "instances": n_seq, "complete": int(complete.sum()),
            "ranks": ranks.tolist(), "rank_nodes": [node_of[int(r)] for r in ranks],
            "patterns": rep.get("patterns", {}), "skew_ms": rep.get("arrival_skew_ms", {}),
            "heat": {"edges": edges.tolist(), "ms": [_rl(row, 3) for row in heat.T]},
            "window": [s0, s1], "worst_seq": worst, "cells": cells,
        }

    # --- metrics ---------------------------------------------------------------------------------
    def metrics(self, grid: TimeGrid) -> list[dict[str, Any]]:
        specs = GPU_METRICS + HOST_METRICS
        per_metric = self.metric_series(grid, specs)
        out = [self.summarize_metric(spec, per_metric[spec[2]]) for spec in specs if per_metric[spec[2]]]
        off = self.offcpu_series(grid)
        if off:
            out.append(self.summarize_metric(("offcpu/intervals", "blocked_ns", "offcpu",
                                              "Off-CPU (blocked) time of the job's threads", "threads", 1.0), off))
        return out

    def metric_series(self, grid: TimeGrid, specs: list[tuple[str, str, str, str, str, float]]) -> dict[str, list[Series]]:
        """Binned series of every metric: each node's table read once, one node at a time."""
        series: dict[str, list[Series]] = {spec[2]: [] for spec in specs}
        tables = sorted({spec[0] for spec in specs})
        for node in self.nodes:
            gpu_tables: dict[str, np.ndarray] = {}
            for table in tables:
                ds = self.table(node, table)
                if ds is None:
                    continue
                rows = ds[()]
                if table in ("gpu/gpm", "gpu/samples"):
                    gpu_tables[table] = rows
                t = self.to_s(node, rows["t_ns"])
                by_gpu = ([(int(gi), rows["gpu"] == gi) for gi in np.unique(rows["gpu"])]
                          if "gpu" in (rows.dtype.names or ()) else [(None, np.ones(len(rows), bool))])
                for spec in specs:
                    if spec[0] != table:
                        continue
                    v = sum((rows[c].astype(np.float64) for c in spec[1].split("+")), np.zeros(len(rows)))
                    for gi, mine in by_gpu:
                        b = grid.mean(t[mine], v[mine])
                        if np.isfinite(b).any():
                            series[spec[2]].append((node, gi, b))
            # the roofline's means from the same rows (gpus() would read both tables again per GPU)
            both = (gpu_tables.get("gpu/gpm"), gpu_tables.get("gpu/samples"))
            for gi in sorted({int(x) for r in gpu_tables.values() for x in np.unique(r["gpu"])}):
                self._gpu_means[(node, gi)] = roofline.gpu_means(self.f, node, gi, both)
        return series

    def offcpu_series(self, grid: TimeGrid) -> list[Series]:
        """Blocked time per bin / bin width: how many of the job's threads were asleep on average."""
        out: list[Series] = []
        for node in self.nodes:
            ds = self.table(node, "offcpu/intervals")
            if ds is None:
                continue
            rows = ds[()]
            t = self.to_s(node, rows["t_ns"])
            # a row covers its window (to the next window's start): spread its blocked time over it
            starts = np.unique(t)
            window = float(np.median(np.diff(starts))) if len(starts) > 1 else grid.dt
            w = rows["blocked_ns"].astype(np.float64) / OFFCPU_SPREAD
            s = np.zeros(grid.bins)
            for j in range(OFFCPU_SPREAD):
                s += np.bincount(grid.bin_of(t + (j + 0.5) * window / OFFCPU_SPREAD), w, grid.bins)
            out.append((node, None, s / 1e9 / max(grid.dt, 1e-9)))
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

    # --- per node rows for the flame graphs and the drill-down ------------------------------------
    def node_rows(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for node in self.nodes:
            g = self.group(node)
            # stacks: frame ids root first; user_frames: how many of them are the user part (the
            # rest the kernel's), so the drill-down can name the innermost function of the program
            d: dict[str, Any] = {"stacks": [], "user_frames": [], "samples": None, "offcpu": None, "nvtx": None,
                                 "kernels": None}
            names = _stack_names(g, self.sid)
            stack_index: dict[tuple[int, int], int] = {}

            def stack_of(u: int, k: int, names: dict[int, list[int]] = names,
                         stack_index: dict[tuple[int, int], int] = stack_index, d: dict[str, Any] = d) -> int:
                key = (u, k)
                if key not in stack_index:
                    frames = [*reversed(names.get(u, [])), *reversed(names.get(k, []))] or [self.sid("[no stack]")]
                    stack_index[key] = len(d["stacks"])
                    d["stacks"].append(frames)
                    d["user_frames"].append(len(names.get(u, [])))
                return stack_index[key]

            for table, weight, field, scale in (("stacks/samples", "count", "samples", 1.0),
                                                ("offcpu/intervals", "blocked_ns", "offcpu", 1e-6)):
                if table not in g:
                    continue
                rows = g[table][()]
                if len(rows) > MAX_STACK_ROWS:
                    rows = np.sort(rows, order=weight)[::-1][:MAX_STACK_ROWS]
                    self.per_node(f"/{table}: the {MAX_STACK_ROWS} heaviest rows per node", node, g[table].shape[0])
                t = self.to_s(node, rows["t_ns"])
                d[field] = [[_r(float(t[i]), 8), stack_of(int(rows["user_stack"][i]), int(rows["kernel_stack"][i])),
                             _r(float(rows[weight][i]) * scale)] for i in range(len(rows))]
            d["nvtx"] = self.nvtx_rows(node, g)
            d["kernels"] = self.kernel_rows(node, g)
            out[node] = d
        return out

    def nvtx_rows(self, node: str, g: h5py.Group) -> list[list[Any]] | None:
        if "nvtx/ranges" not in g:
            return None
        rows = g["nvtx/ranges"][()]
        # string ids are per process (each registers its own strings)
        text: dict[tuple[int, int], str] = {}
        if "nvtx/strings" in g:
            strs = g["nvtx/strings"][()]
            has_pid = "pid" in (strs.dtype.names or ())
            text = {(int(x["pid"]) if has_pid else -1, int(x["string_id"])): _s(x["text"]) for x in strs}
            if not has_pid:
                text.update({(int(p), k[1]): v for k, v in list(text.items()) for p in np.unique(rows["pid"])})
        if len(rows) > MAX_EVENT_ROWS:
            dur = rows["t_end_ns"].astype(np.int64) - rows["t_start_ns"].astype(np.int64)
            rows = rows[np.argsort(-dur, kind="stable")[:MAX_EVENT_ROWS]]
            self.per_node(f"NVTX ranges: the {MAX_EVENT_ROWS} longest per node", node, g["nvtx/ranges"].shape[0])
        t0, t1 = self.to_s(node, rows["t_start_ns"]), self.to_s(node, rows["t_end_ns"])
        return [[_r(float(t0[i]), 9), _r(float(t1[i]), 9),
                 self.sid(text.get((int(rows["pid"][i]), int(rows["name_id"][i])),
                                   f"[string {int(rows['name_id'][i])} of pid {int(rows['pid'][i])}]")),
                 int(rows["depth"][i]), int(rows["tid"][i])] for i in range(len(rows))]

    def kernel_rows(self, node: str, g: h5py.Group) -> list[list[Any]] | None:
        if "kernels/launches" not in g:
            return None
        rows = g["kernels/launches"][()]
        names = {}
        if "kernels/functions" in g:
            names = {(int(r["pid"]), int(r["function"])): _s(r["name"]) for r in g["kernels/functions"][()]}
        if len(rows) > MAX_EVENT_ROWS:
            rows = rows[np.linspace(0, len(rows) - 1, MAX_EVENT_ROWS).astype(np.int64)]
            self.per_node(f"kernel launches: {MAX_EVENT_ROWS} evenly spaced per node", node, g["kernels/launches"].shape[0])
        t = self.to_s(node, rows["t_ns"])
        return [[_r(float(t[i]), 9),
                 self.sid(names.get((int(rows["pid"][i]), int(rows["function"][i])), "")
                          or f"function {int(rows['function'][i]):#x}"),
                 int(rows["grid_x"][i]) * int(rows["grid_y"][i]) * int(rows["grid_z"][i])] for i in range(len(rows))]

    # --- clocks ----------------------------------------------------------------------------------
    def clocks(self) -> list[dict[str, Any]]:
        segs = self.f["clock/segments"][()] if "clock/segments" in self.f else None
        rep_nodes = {n["node"]: n["clock"] for n in self.report.get("nodes", [])}
        order = sorted(self.nodes, key=lambda n: -(rep_nodes.get(n, {}).get("uncertainty_us") or 0.0))
        if len(order) > MAX_CLOCK_NODES:
            self.summarized.append(f"clock offsets: the {MAX_CLOCK_NODES} nodes of {len(order)} with the widest "
                                   "error intervals are drawn (the table lists all)")
        out = []
        by_node = segment_rows_by_node(segs) if segs is not None and "node" in (segs.dtype.names or ()) else {}
        has_iv = segs is not None and "offset_lo_ns" in (segs.dtype.names or ())
        for node in order[:MAX_CLOCK_NODES]:
            pts = []
            mine = by_node.get(node, np.zeros(0))
            if len(mine) > MAX_CLOCK_POINTS:
                mine = mine[np.linspace(0, len(mine) - 1, MAX_CLOCK_POINTS).astype(np.int64)]
                self.per_node(f"clock offsets: {MAX_CLOCK_POINTS} evenly spaced model segments per node", node,
                              len(by_node[node]))
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

    def coverage(self) -> list[dict[str, Any]]:
        """Per source, the nodes that recorded rows of it (the summary's "missing data")."""
        out = []
        for path, what in COVERAGE:
            without = [n for n in self.nodes if self.table(n, path) is None]
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
                # metric_series computed them while it had the tables; a GPU without rows has none
                means = self._gpu_means.get((node, int(gpu["gpu"]))) or roofline.gpu_means(self.f, node, int(gpu["gpu"]))
                rows.append({"node": node, "gpu": gpu["gpu"], "name": gpu.get("name", ""),
                             "util": _r(gpu.get("util_gpu_mean") if gpu.get("util_gpu_mean") is not None else np.nan, 3),
                             "mem_gib": _r((gpu.get("mem_used_max_bytes") or np.nan) / 2**30, 3),
                             **{k: _r(v, 3) for k, v in means.items()},
                             **roofline.classify(gpu.get("name", ""), means),
                             "phases": roofline.phase_classes(self.f, node, int(gpu["gpu"]), gpu.get("name", ""))})
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
        grid = self.grid()
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
        payload["coverage"] = self.coverage()
        payload["finding_flames"] = self.finding_flames(len(r.get("stragglers", [])))
        payload["node_rows"] = self.node_rows()
        firsts = [min(r[0] for r in d["samples"]) for d in payload["node_rows"].values() if d["samples"]]
        self.stacks_from_s = max(firsts) if firsts else -np.inf
        payload["comms"] = self.comms()
        payload["metrics"] = self.metrics(grid)
        payload["clocks"] = self.clocks()
        payload["gpus"] = self.gpus()
        payload["ranks"] = self.ranks()
        payload["roofline_peaks"] = roofline.PEAKS_DOC
        payload["strings"] = list(self.strings)
        payload["summarized"] = self.summarized + self.per_node_lines()
        return payload


def _stack_names(g: h5py.Group, sid: Callable[[str], int]) -> dict[int, list[int]]:
    """stack id -> frame names as ids of the payload's string table, innermost first (what
    collector/symbolize.stack_names gives as strings)."""
    if "stacks/frames" not in g or "stacks/symbols" not in g:
        return {}
    frames = g["stacks/frames"][()]
    text = {int(s["symbol_id"]): _s(s["name"]) for s in g["stacks/symbols"][()]}
    order = np.lexsort((frames["depth"], frames["stack_id"]))
    out: dict[int, list[int]] = {}
    for r in frames[order]:
        out.setdefault(int(r["stack_id"]), []).append(sid(text.get(int(r["symbol_id"]), "?")))
    return out


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


def render_html_job(f: h5py.File, report: dict[str, Any]) -> str:
    """The page of an open job file, with its report dict (from /analysis or the merge's analysis)."""
    return render_page(PayloadBuilder(f, report).build())


def html_path_of(job_file: Path) -> Path:
    """STEM.gpuprof.html beside STEM.gpuprof.h5 (where the merge writes it)."""
    return job_file.with_suffix(".html")


def render_html_file(job_file: str | Path) -> str:
    with open_job_file(Path(job_file)) as f:
        report = json.loads(f["analysis"].attrs["report_json"])
        return render_html_job(f, report)
