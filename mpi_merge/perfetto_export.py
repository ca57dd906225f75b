"""Perfetto's native protobuf trace of a merged job file (`gpuprof export --format perfetto-proto`).

Written packet by packet with the `perfetto` package's StreamingTraceProtoBuilder (and its protobuf
classes, perfetto_trace_pb2), one node or communicator block at a time, on the aligned clock
(ns since the Unix epoch on the reference node's realtime clock):

- a process per node (pid = the node's index + 1: real pids repeat across nodes), named after it;
- under it a track per (communicator, rank) of that node ("comm 0x... rank r"): one slice per
  collective call, enter to exit, with its seq, op, bytes and wait as arguments; ranks of different
  communicators never share a track;
- one top-level track per communicator with a slice per instance (first enter to last exit) whose
  flows end on each rank's slice of that instance (the arrows Perfetto draws between them);
- a counter track per metric and device (/gpu/samples, /gpu/gpm, /host/node columns), raw samples:
  one packet per sample row, its other columns' values as the event's extra counter values;
- NVTX ranges (/nvtx/ranges) on a track per thread and nesting depth, kernel launches
  (/kernels/launches) as instants on a "kernel launches" track, when the node recorded them;
- CPU stack samples (/stacks/samples) as PerfSample packets on the node's process (each sampled
  thread a thread of that process, its real tid in its name: tids repeat across nodes), with interned
  frames, mappings and callstacks (root first); a row counting n samples of a window becomes n
  samples spread over that window (at most MAX_SAMPLES_PER_ROW, the cap counted in the result).

Reading it back: tests/test_exports.py parses the file with the same package's Trace message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.errors import TraceFormatError
from gpuprof.mpi_merge.jobclock import node_time_mappers

SEQ_ID = 1  # one packet sequence: interned frames and callstacks are valid on it
MAX_SAMPLES_PER_ROW = 1000
FIRST_THREAD_ID = 1_000_000  # threads get ids of their own from here, named after their real tid
READ_ROWS = 4096
COUNTER_TABLES = {
    "gpu/samples": ("util_gpu", "util_mem", "mem_used_bytes", "power_w", "temp_c", "sm_clock_mhz", "mem_clock_mhz",
                    "pcie_tx_kbps", "pcie_rx_kbps", "nvlink_tx_kbps", "nvlink_rx_kbps"),
    "gpu/gpm": ("sm_activity", "sm_occupancy", "tensor_activity", "dram_bw_util"),
    "host/node": ("cpu_busy", "cpu_iowait", "mem_used_bytes", "load1"),
}


def _pb() -> tuple[Any, Any]:
    """The package's protobuf classes and its streaming trace builder."""
    try:
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2
        from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder
    except ImportError as e:
        raise TraceFormatError(f"the Perfetto protobuf export needs the 'perfetto' package (pip install perfetto): {e}") from None
    return perfetto_trace_pb2, StreamingTraceProtoBuilder


@dataclass
class ExportCounts:
    """What was written (the CLI prints `events`; the bench and the tests read the rest)."""

    slices: int = 0
    flows: int = 0
    counters: int = 0
    nvtx: int = 0
    kernels: int = 0
    samples: int = 0
    samples_capped: int = 0  # samples left out by MAX_SAMPLES_PER_ROW
    tracks: int = 0

    @property
    def events(self) -> int:
        return self.slices + self.counters + self.nvtx + self.kernels + self.samples


@dataclass
class _Out:
    builder: Any  # perfetto.trace_builder.proto_builder.StreamingTraceProtoBuilder
    pb: Any
    counts: ExportCounts = field(default_factory=ExportCounts)
    _uuid: int = 0
    _flow: int = 0
    _first: bool = True

    def uuid(self) -> int:
        self._uuid += 1
        return self._uuid

    def flow(self) -> int:
        self._flow += 1
        return self._flow

    def packet(self) -> Any:
        p = self.builder.create_packet()
        p.trusted_packet_sequence_id = SEQ_ID
        if self._first:
            p.sequence_flags = self.pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            self._first = False
        return p

    def write(self, p: Any) -> None:
        self.builder.write_packet(p)

    def track(self, name: str, parent: int | None = None, process: tuple[int, str] | None = None,
              counter_unit: str | None = None) -> int:
        u = self.uuid()
        p = self.packet()
        d = p.track_descriptor
        d.uuid = u
        if parent is not None:
            d.parent_uuid = parent
        if process is not None:
            d.process.pid, d.process.process_name = process
        else:
            d.name = name
        if counter_unit is not None:
            d.counter.unit_name = counter_unit
        self.write(p)
        self.counts.tracks += 1
        return u

    def event(self, track: int, ts: int, kind: str, name: str | None = None, **kw: Any) -> Any:
        p = self.packet()
        p.timestamp = int(ts)
        e = p.track_event
        e.track_uuid = track
        e.type = getattr(self.pb.TrackEvent, kind)
        if name is not None:
            e.name = name
        for k, v in kw.items():
            if k == "flow_ids":
                e.flow_ids.extend(v)
            elif k == "terminating_flow_ids":
                e.terminating_flow_ids.extend(v)
            elif k == "double_counter_value":
                e.double_counter_value = v
            elif k == "extra":
                e.extra_double_counter_track_uuids.extend(v[0])
                e.extra_double_counter_values.extend(v[1])
            elif k == "args":
                for an, av in v.items():
                    a = e.debug_annotations.add()
                    a.name = an
                    if isinstance(av, str):
                        a.string_value = av
                    elif isinstance(av, float):
                        a.double_value = av
                    else:
                        a.int_value = int(av)
        self.write(p)
        return p


def _s(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def _blocks(n: int) -> Iterator[tuple[int, int]]:
    for i0 in range(0, n, READ_ROWS):
        yield i0, min(n, i0 + READ_ROWS)


def _collectives(o: _Out, f: h5py.File, node_track: dict[str, int], epoch: int) -> None:
    ops = schema.COLLECTIVE_OPS
    for name in sorted(k for k in f.get("collectives", {}) if k.startswith("comm_")):
        g = f["collectives"][name]
        cid = f"{int(g.attrs['comm_id']):#x}"
        node_of: list[str | None] = json.loads(g.attrs["node_of_rank_json"])
        comm_track = o.track(f"communicator {cid} ({len(node_of)} ranks): instances")
        rank_track = {r: o.track(f"comm {cid} rank {r}", parent=node_track[n]) for r, n in enumerate(node_of)
                      if n is not None and n in node_track}
        E, X, OP, B, W = (g[k] for k in ("enter_aligned_ns", "exit_aligned_ns", "op", "bytes", "wait_ns"))
        for i0, i1 in _blocks(E.shape[0]):
            e, x, op, nb, w = E[i0:i1], X[i0:i1], OP[i0:i1], B[i0:i1], W[i0:i1]
            for k in range(i1 - i0):
                ok = [r for r in rank_track if e[k, r] >= 0 and x[k, r] >= e[k, r]]
                if not ok:
                    continue
                flows = {r: o.flow() for r in ok}
                seq = i0 + k
                first = min(int(e[k, r]) for r in ok)
                last = max(int(x[k, r]) for r in ok)
                op_name = ops[int(op[k, ok[0]])] if 0 <= int(op[k, ok[0]]) < len(ops) else f"op {int(op[k, ok[0]])}"
                o.event(comm_track, first, "TYPE_SLICE_BEGIN", f"{op_name} seq {seq}", flow_ids=list(flows.values()),
                        args={"seq": seq, "ranks": len(ok)})
                o.event(comm_track, last, "TYPE_SLICE_END")
                for r in ok:
                    args: dict[str, Any] = {"seq": seq, "bytes": int(nb[k, r])}
                    if w[k, r] >= 0:
                        args["wait_ns"] = int(w[k, r])
                    o.event(rank_track[r], int(e[k, r]), "TYPE_SLICE_BEGIN", op_name,
                            terminating_flow_ids=[flows[r]], args=args)
                    o.event(rank_track[r], int(x[k, r]), "TYPE_SLICE_END")
                o.counts.slices += len(ok)
                o.counts.flows += len(ok)


def _counters(o: _Out, g: h5py.Group, parent: int, conv: Callable[[np.ndarray], np.ndarray]) -> None:
    for table, cols in COUNTER_TABLES.items():
        if table not in g or not g[table].shape[0]:
            continue
        ds = g[table]
        spec = schema.TABLES_BY_PATH.get("/" + table)
        units = {c.name: c.unit for c in spec.columns} if spec is not None else {}
        rows = ds[()]
        t = conv(rows["t_ns"])
        devs = ([(f"gpu{int(d)} ", rows["gpu"] == d) for d in np.unique(rows["gpu"])] if "gpu" in (rows.dtype.names or ())
                else [("", np.ones(len(rows), bool))])
        for prefix, mine in devs:
            present = [c for c in cols if c in (rows.dtype.names or ())]
            V = np.stack([rows[c][mine].astype(np.float64) for c in present], axis=1) if present else np.zeros((0, 0))
            tt = t[mine]
            keep = [j for j in range(len(present)) if np.isfinite(V[:, j]).any()]
            tracks = {j: o.track(f"{prefix}{present[j]}", parent=parent, counter_unit=units.get(present[j]) or None)
                      for j in keep}
            # one packet per sample row: the first finite value on its track, the others as extra
            # counter values of the same event (TrackEvent.extra_double_counter_*), not a packet each
            for i in range(len(tt)):
                js = [j for j in keep if np.isfinite(V[i, j])]
                if not js:
                    continue
                o.event(tracks[js[0]], int(tt[i]), "TYPE_COUNTER", double_counter_value=float(V[i, js[0]]),
                        extra=([tracks[j] for j in js[1:]], [float(V[i, j]) for j in js[1:]]))
                o.counts.counters += len(js)


def _nvtx_and_kernels(o: _Out, g: h5py.Group, parent: int, conv: Callable[[np.ndarray], np.ndarray]) -> None:
    if "nvtx/ranges" in g and g["nvtx/ranges"].shape[0]:
        rows = g["nvtx/ranges"][()]
        text: dict[tuple[int, int], str] = {}
        if "nvtx/strings" in g:
            strs = g["nvtx/strings"][()]
            has_pid = "pid" in (strs.dtype.names or ())
            text = {(int(s["pid"]) if has_pid else -1, int(s["string_id"])): _s(s["text"]) for s in strs}
        t0, t1 = conv(rows["t_start_ns"]), conv(rows["t_end_ns"])
        tracks: dict[tuple[int, int], int] = {}
        for i in np.lexsort((-t1, t0)):
            key = (int(rows["tid"][i]), int(rows["depth"][i]))
            if key not in tracks:
                tracks[key] = o.track(f"NVTX tid {key[0]} depth {key[1]}", parent=parent)
            pid, sid = int(rows["pid"][i]), int(rows["name_id"][i])
            label = text.get((pid, sid), text.get((-1, sid), f"[string {sid}]"))
            o.event(tracks[key], int(t0[i]), "TYPE_SLICE_BEGIN", label, args={"pid": pid})
            o.event(tracks[key], int(max(t1[i], t0[i])), "TYPE_SLICE_END")
            o.counts.nvtx += 1
    if "kernels/launches" in g and g["kernels/launches"].shape[0]:
        rows = g["kernels/launches"][()]
        names = {}
        if "kernels/functions" in g:
            names = {(int(r["pid"]), int(r["function"])): _s(r["name"]) for r in g["kernels/functions"][()]}
        tr = o.track("kernel launches", parent=parent)
        t = conv(rows["t_ns"])
        for i in np.argsort(t, kind="stable"):
            key = (int(rows["pid"][i]), int(rows["function"][i]))
            o.event(tr, int(t[i]), "TYPE_INSTANT", names.get(key) or f"function {key[1]:#x}",
                    args={"pid": key[0], "tid": int(rows["tid"][i]),
                          "grid": int(rows["grid_x"][i]) * int(rows["grid_y"][i]) * int(rows["grid_z"][i])})
            o.counts.kernels += 1


@dataclass
class _Interner:
    strings: dict[str, int] = field(default_factory=dict)
    maps: dict[str, int] = field(default_factory=dict)
    frames: dict[tuple[int, int], int] = field(default_factory=dict)
    stacks: dict[tuple[int, ...], int] = field(default_factory=dict)
    # (node's pid in the trace, real tid) -> the thread's tid in the trace: real tids repeat across nodes
    threads: dict[tuple[int, int], int] = field(default_factory=dict)


def _stack_samples(o: _Out, g: h5py.Group, vpid: int, conv: Callable[[np.ndarray], np.ndarray], it: _Interner) -> None:
    if "stacks/samples" not in g or not g["stacks/samples"].shape[0] or "stacks/frames" not in g:
        return
    sym = {int(s["symbol_id"]): (_s(s["name"]), _s(s["module"])) for s in g["stacks/symbols"][()]}
    fr = g["stacks/frames"][()]
    order = np.lexsort((fr["depth"], fr["stack_id"]))
    by_stack: dict[int, list[int]] = {}
    for r in fr[order]:
        by_stack.setdefault(int(r["stack_id"]), []).append(int(r["symbol_id"]))
    rows = g["stacks/samples"][()]
    t = conv(rows["t_ns"])
    starts = np.unique(t)
    window = float(np.median(np.diff(starts))) if len(starts) > 1 else 1e9
    p = o.packet()
    p.sequence_flags = o.pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
    idata = p.interned_data
    new = False

    def frame_iid(symbol: int) -> int:
        nonlocal new
        name, module = sym.get(symbol, ("?", ""))
        if name not in it.strings:
            it.strings[name] = len(it.strings) + 1
            idata.function_names.add(iid=it.strings[name], str=name.encode())
            new = True
        if module not in it.maps:
            it.maps[module] = len(it.maps) + 1
            mp_path = len(it.maps)
            idata.mapping_paths.add(iid=mp_path, str=module.encode())
            idata.mappings.add(iid=it.maps[module], path_string_ids=[mp_path])
            new = True
        key = (it.strings[name], it.maps[module])
        if key not in it.frames:
            it.frames[key] = len(it.frames) + 1
            idata.frames.add(iid=it.frames[key], function_name_id=key[0], mapping_id=key[1])
            new = True
        return it.frames[key]

    stack_of_row = []
    for r in rows:
        # root first: user frames outermost to innermost, then the kernel's (as collapsed stacks)
        ids = [*reversed(by_stack.get(int(r["user_stack"]), [])), *reversed(by_stack.get(int(r["kernel_stack"]), []))]
        key = tuple(frame_iid(s) for s in ids)
        if key not in it.stacks:
            it.stacks[key] = len(it.stacks) + 1
            idata.callstacks.add(iid=it.stacks[key], frame_ids=list(key))
            new = True
        stack_of_row.append(it.stacks[key])
    if new:
        o.write(p)
    for tid in sorted({int(x) for x in rows["tid"]}):
        if (vpid, tid) not in it.threads:
            it.threads[(vpid, tid)] = FIRST_THREAD_ID + len(it.threads)
            p = o.packet()
            d = p.track_descriptor
            d.uuid = o.uuid()
            d.thread.pid, d.thread.tid, d.thread.thread_name = vpid, it.threads[(vpid, tid)], f"tid {tid}"
            o.write(p)
            o.counts.tracks += 1
    for i in np.argsort(t, kind="stable"):
        n = int(rows["count"][i])
        shown = min(n, MAX_SAMPLES_PER_ROW)
        o.counts.samples_capped += n - shown
        for j in range(shown):
            s = o.packet()
            s.timestamp = int(t[i] + window * j / max(shown, 1))
            s.perf_sample.pid = vpid
            s.perf_sample.tid = it.threads[(vpid, int(rows["tid"][i]))]
            s.perf_sample.cpu = int(rows["cpu"][i])
            s.perf_sample.callstack_iid = stack_of_row[i]
            o.write(s)
        o.counts.samples += shown


def export_perfetto_proto(f: h5py.File, out: Path) -> ExportCounts:
    pb, builder = _pb()
    nodes: list[str] = json.loads(f.attrs["nodes"])
    epoch = int(f.attrs["epoch_realtime_ns"])
    mappers = node_time_mappers(f)
    with out.open("wb") as fh:
        o = _Out(builder(fh), pb)
        node_track = {n: o.track(n, process=(i + 1, n)) for i, n in enumerate(nodes)}
        _collectives(o, f, node_track, epoch)
        it = _Interner()
        for i, node in enumerate(nodes):
            g = f[f"nodes/{node}"]
            conv = mappers[node]
            _counters(o, g, node_track[node], conv)
            _nvtx_and_kernels(o, g, node_track[node], conv)
            _stack_samples(o, g, i + 1, conv, it)
    return o.counts
