"""The job file (schema in docs/job-format.md): one HDF5 file per job.

Bulk per-node data never passes through rank 0's memory: the job file's writer (the last rank; rank 0
when alone) copies each selected node file's groups into the job file with HDF5's object copy, which
moves stored chunks without holding a whole table, whenever it would otherwise wait for rank 0;
then it copies in each node's aligned call times, which the node's rank wrote into a small file of
their own (write_aligned_times, JobFileCopies). Rank 0 writes the [seq x rank] tables of
/collectives into a part file of its own block by block as the analysis produces them
(CollectivesWriter, one chunk per block), and at the end adds them, /clock, /analysis and the root
attributes to the job file (finish_job_file). The job file is written under a temporary name and
renamed into place, so a reader sees the old result or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gpuprof.collector import __version__, schema
from gpuprof.collector.errors import MergeError
from gpuprof.mpi_merge.analysis import JobAnalysis
from gpuprof.mpi_merge.clock import NodeClockModel
from gpuprof.mpi_merge.common import block_rows
from gpuprof.mpi_merge.matching import CommTable, StoredComm
from gpuprof.mpi_merge.waitstates import PATTERNS, CommSummary, CommWaits

JOB_SCHEMA = "slurm-gpuprof.job"
JOB_SCHEMA_VERSION = 1
# Root attributes that describe the merge run rather than the job: they differ between runs and
# between rank counts, and comparisons of job files ignore them.
RUN_ATTRS = ("merged_at_realtime_ns", "merge_ranks", "merge_tool_version")
ALIGNED_DTYPE = np.dtype([("t_enter_aligned_ns", "<i8"), ("t_exit_aligned_ns", "<i8")])
CHUNK = 1 << 16
FILTERS: dict[str, Any] = {"compression": "gzip", "compression_opts": 4, "shuffle": True}


# HDF5's metadata cache of a job file: its size fixed (bytes of the entries as stored), not grown
# as HDF5 does by default (see export.open_job_file for what growth cost the page).
METADATA_CACHE_BYTES = 2 << 20


def bound_metadata_cache(f: h5py.File, size: int = METADATA_CACHE_BYTES) -> None:
    """Fix the metadata cache of `f`'s file at `size` bytes (no flash or adaptive increase). HDF5
    shares one cache between every handle of the same file in a process, so this bounds them all."""
    cfg = f.id.get_mdc_config()
    cfg.set_initial_size = True
    cfg.initial_size = size
    cfg.min_size = size
    cfg.max_size = size
    # HDF5's enums (H5Cpublic.h), which h5py does not name: H5C_incr__off, H5C_flash_incr__off,
    # H5C_decr__off (min == max leaves nothing to decrease)
    cfg.incr_mode = 0
    cfg.flash_incr_mode = 0
    cfg.decr_mode = 0
    f.id.set_mdc_config(cfg)


def write_aligned_times(out: str | os.PathLike[str], calls: np.ndarray, model: NodeClockModel, epoch_rt: int) -> None:
    """A small file with /collectives/calls_aligned for one node: reference-clock realtime ns of the
    enter and exit of each row of the node's /collectives/calls (-1 where the call never returned),
    from `calls`, those rows on the node's own realtime clock (loading.call_rows), chunk by chunk.
    The node's rank writes it; the job file's writer copies it in (JobFileCopies)."""
    with h5py.File(out, "w", libver="latest") as dst:
        al_ds = dst.create_dataset(
            "/collectives/calls_aligned", shape=(len(calls),), maxshape=(None,), dtype=ALIGNED_DTYPE,
            chunks=(min(CHUNK, max(1, len(calls))),), **FILTERS,
        )
        al_ds.attrs["doc"] = ("enter/exit of each row of calls on the reference node's realtime clock "
                              "(ns since the epoch); -1 = never returned")
        al_ds.attrs["aligned"] = model.aligned
        for i in range(0, len(calls), CHUNK):
            rows = calls[i:i + CHUNK]
            blk = np.zeros(len(rows), ALIGNED_DTYPE)
            for col, dcol in (("enter_rt", "t_enter_aligned_ns"), ("exit_rt", "t_exit_aligned_ns")):
                rel = (rows[col] - epoch_rt).astype(np.float64)
                al = np.round(model.align(rel)).astype(np.int64) + epoch_rt
                blk[dcol] = np.where(rows["returned"], al, -1) if col == "exit_rt" else al
            al_ds[i:i + len(rows)] = blk


def _table(g: h5py.Group, name: str, rows: list[dict[str, Any]], doc: str) -> None:
    """A list of flat dicts as a compound dataset (strings as UTF-8 variable length)."""
    if not rows:
        ds = g.create_dataset(name, shape=(0,), dtype=np.dtype([("empty", "u1")]))
        ds.attrs["doc"] = doc
        return
    cols = list(rows[0])
    dts = []
    for c in cols:
        v = rows[0][c]
        if isinstance(v, bool):
            dts.append((c, "?"))
        elif isinstance(v, (int, np.integer)):
            dts.append((c, "<i8"))
        elif isinstance(v, (float, np.floating)) or v is None:
            dts.append((c, "<f8"))
        else:
            dts.append((c, h5py.string_dtype()))
    arr = np.zeros(len(rows), np.dtype(dts))
    for i, r in enumerate(rows):
        for c, dt in dts:
            v = r.get(c)
            if dt == "<f8":
                arr[c][i] = np.nan if v is None else float(v)
            elif dt in ("<i8", "?"):
                arr[c][i] = v
            else:
                arr[c][i] = v if isinstance(v, str) else json.dumps(v)
    ds = g.create_dataset(name, data=arr)
    ds.attrs["doc"] = doc


# /clock/segments: one row per model segment, the nodes in the fit's order (what _table made of one
# dict per segment, field for field)
SEGMENT_DTYPE = np.dtype([("node", h5py.string_dtype()), ("segment", "<i8"), ("t_start_ns", "<i8"),
                          ("offset_ns", "<f8"), ("drift_ppm", "<f8"), ("offset_lo_ns", "<f8"), ("offset_hi_ns", "<f8")])


def segment_rows(models: list[NodeClockModel], epoch_rt: int) -> np.ndarray:
    """The rows of /clock/segments, a node's segments at once: a row per segment built in Python
    took seconds at 1024 nodes (266,240 segments), serial on rank 0 at the end of the merge. The
    values are those of the row-by-row table: start rounded half to even as round() does, the
    floats as they are (NaN bounds where the method keeps no intervals)."""
    out = np.zeros(sum(len(m.seg_start) for m in models), SEGMENT_DTYPE)
    i = 0
    for m in models:
        k = len(m.seg_start)
        if not k:
            continue
        start = np.asarray(m.seg_start, np.float64)
        if not np.isfinite(start).all():  # round() refused these; a silent cast would write garbage
            raise MergeError(f"node {m.node}: clock model segment starts that are not finite")
        rows = out[i:i + k]
        rows["node"] = m.node
        rows["segment"] = np.arange(k)
        rows["t_start_ns"] = np.round(start).astype(np.int64) + epoch_rt
        rows["offset_ns"] = np.asarray(m.seg_offset, np.float64)
        rows["drift_ppm"] = np.asarray(m.seg_drift_ppm, np.float64)
        has_iv = len(m.point_lo) == k
        rows["offset_lo_ns"] = np.asarray(m.point_lo, np.float64) if has_iv else np.nan
        rows["offset_hi_ns"] = np.asarray(m.point_hi, np.float64) if has_iv else np.nan
        i += k
    return out


def _ns(v: np.ndarray, epoch_rt: int) -> np.ndarray:
    """Float ns from the epoch -> int64 ns since the Unix epoch, -1 where absent."""
    return np.where(np.isfinite(v), np.round(v) + epoch_rt, -1).astype(np.int64)


def _rounded(v: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(v), np.round(v), -1).astype(np.int64)


# /collectives/comm_*: the [seq x rank] datasets, in the order they are written, and their dtypes
COMM_MATRICES = (("enter_aligned_ns", "<i8"), ("exit_aligned_ns", "<i8"), ("enter_raw_ns", "<i8"),
                 ("exit_raw_ns", "<i8"), ("op", "<i2"), ("bytes", "<i8"), ("wait_ns", "<i8"))


class CollectivesWriter:
    """analysis.CommSink that writes /collectives/comm_<id> of `f` block by block.

    A chunk is one block of seqs across all ranks, so every chunk is compressed and written once
    and nothing of a communicator is held beyond the block being written."""

    def __init__(self, f: h5py.File, node_names: list[str], epoch_rt: int):
        self.col = f.create_group("collectives")
        self.col.attrs["patterns"] = json.dumps(PATTERNS)
        self.node_names = node_names
        self.epoch_rt = epoch_rt
        self.g: h5py.Group | None = None

    def begin(self, c: StoredComm) -> None:
        g = self.col.create_group(f"comm_{c.comm_id:016x}")
        g.attrs["comm_id"] = np.uint64(c.comm_id)
        g.attrs["size"] = c.size
        g.attrs["node_of_rank_json"] = json.dumps([self.node_names[int(n)] if n >= 0 else None for n in c.node_of_rank])
        g.attrs["pid_of_rank"] = c.pid_of_rank
        shape = (c.n_seq, c.size)
        for name, dtype in COMM_MATRICES:
            if c.n_seq * c.size:
                g.create_dataset(name, shape=shape, dtype=dtype, chunks=(min(block_rows(c.size), c.n_seq), c.size),
                                 **FILTERS)
            else:
                g.create_dataset(name, data=np.zeros(shape, dtype))
        self.g = g

    def block(self, blk: CommTable, enter_al: np.ndarray, exit_al: np.ndarray, w: CommWaits) -> None:
        if self.g is None:
            raise RuntimeError("CollectivesWriter.block before begin")
        rows = slice(blk.seq0, blk.seq0 + blk.n_seq)
        e = self.epoch_rt
        for name, data in (
            ("enter_aligned_ns", _ns(enter_al, e)), ("exit_aligned_ns", _ns(exit_al, e)),
            ("enter_raw_ns", _ns(blk.enter, e)), ("exit_raw_ns", _ns(blk.exit, e)), ("op", blk.op),
            ("bytes", blk.nbytes), ("wait_ns", _rounded(w.waits)),
        ):
            self.g[name][rows] = data

    def end(self, cs: CommSummary) -> None:
        if self.g is None:
            raise RuntimeError("CollectivesWriter.end before begin")
        for name, data in (
            ("complete", cs.complete), ("pattern", cs.pattern), ("last_rank", cs.last_rank),
            ("last_enter_aligned_ns", _ns(cs.last_enter, self.epoch_rt)), ("own_time_ns", _rounded(cs.own_time)),
        ):
            chunks = (min(4096, max(1, data.shape[0])),) if data.size else None
            self.g.create_dataset(name, data=data, chunks=chunks, **(FILTERS if data.size else {}))
        self.g = None


class JobFileCopies:
    """The writer's copies into the job file, one node a step (`step`): every selected node's tables,
    then, once `aligned_ready()` says every rank has written its nodes' aligned call times, those.
    A node's tables are its node file's root group (attributes and every group), copied by one HDF5
    object copy straight from the node file: stored chunks move as they are, nothing is decompressed
    or held in memory (one copy of the root is about half the cost of a copy per group plus the
    attributes rewritten). The merge's writer runs the steps while it would otherwise wait for rank 0
    (common.ChoresComm) and the rest at the end (`finish`), so every rank count writes the same file
    in the same order. The job file stays open between steps with its metadata cache bounded (each
    copied object would otherwise grow it with the node count); `finish` closes it."""

    def __init__(self, job_tmp: Path, nodes: list[tuple[str, Path]], aligned: list[tuple[str, Path]],
                 aligned_ready: Callable[[], bool]):
        self.nodes = nodes
        self.aligned = aligned
        self.aligned_ready = aligned_ready
        self.nodes_done = 0
        self.aligned_done = 0
        self.f: h5py.File | None = h5py.File(job_tmp, "w", libver="latest")
        bound_metadata_cache(self.f)
        self.f.create_group("nodes")

    def step(self) -> bool:
        """Copy one node's tables or aligned times; False when there is nothing to copy now (all done,
        or the aligned times are not all written yet)."""
        if self.f is None:
            return False
        if self.nodes_done < len(self.nodes):
            name, node_file = self.nodes[self.nodes_done]
            if not node_file.exists():
                raise MergeError(f"node {name}: its node file {node_file} is missing (was it removed during the merge?)")
            with h5py.File(node_file, "r") as src:
                h5py.h5o.copy(src.id, b"/", self.f["nodes"].id, name.encode())
            self.nodes_done += 1
            return True
        if self.aligned_done < len(self.aligned) and self.aligned_ready():
            name, path = self.aligned[self.aligned_done]
            self.aligned_done += 1
            if f"nodes/{name}/{schema.COLLECTIVE_CALLS.path.lstrip('/')}" not in self.f:
                return True  # a node without calls has no aligned times
            if not path.exists():
                raise MergeError(f"node {name}: no aligned call times at {path} (its rank did not write them)")
            with h5py.File(path, "r") as src:
                src.copy(src["collectives/calls_aligned"], self.f[f"nodes/{name}/collectives"], name="calls_aligned")
            return True
        return False

    def finish(self, wait_aligned: Callable[[], None]) -> None:
        """Copy what is left (`wait_aligned()` returns once every rank's aligned times are written), then
        close the job file."""
        while self.nodes_done < len(self.nodes):
            self.step()
        wait_aligned()
        while self.step():
            pass
        if self.f is not None:
            self.f.close()
            self.f = None


def finish_job_file(job_tmp: Path, a: JobAnalysis, collectives_part: Path, *, merge_ranks: int,
                    merged_at_ns: int) -> None:
    """Root attributes, /clock, /collectives (copied from rank 0's part) and /analysis into the job file."""
    with h5py.File(job_tmp, "a", libver="latest") as f:
        f.attrs["schema"] = JOB_SCHEMA
        f.attrs["schema_version"] = JOB_SCHEMA_VERSION
        f.attrs["job_id"] = a.job_id
        f.attrs["synthetic"] = a.synthetic
        f.attrs["status"] = "partial" if a.partial else "complete"
        f.attrs["partial_reasons_json"] = json.dumps(a.partial_reasons)
        f.attrs["nodes"] = json.dumps(a.node_names)
        f.attrs["reference_node"] = a.clock.reference
        f.attrs["epoch_realtime_ns"] = np.int64(a.epoch_rt)
        f.attrs["merged_at_realtime_ns"] = np.int64(merged_at_ns)
        f.attrs["merge_ranks"] = merge_ranks
        f.attrs["merge_tool_version"] = __version__
        clk = f.create_group("clock")
        clk.attrs["method"] = a.clock.method
        clk.attrs["reference"] = a.clock.reference
        clk.attrs["causality_violations"] = a.clock.causality_violations
        clk.attrs["components_json"] = json.dumps(a.clock.components)
        node_rows = []
        for m in a.clock.models:
            node_rows.append({
                "node": m.node, "aligned": m.aligned, "reason": m.reason, "is_reference": m.is_reference,
                "offset_ns_at_start": float(m.seg_offset[0]) if len(m.seg_offset) else None,
                "drift_ppm_mean": m.mean_drift_ppm if m.aligned else None, "segments": len(m.seg_start),
                "residual_ns": m.residual_ns, "uncertainty_ns": m.uncertainty_ns, "n_points": m.n_points,
                "inconsistent": m.inconsistent, "drift_note": m.drift_note,
                "unconstrained_spans_json": json.dumps([[int(s0) + a.epoch_rt, int(s1) + a.epoch_rt]
                                                        for s0, s1 in m.unconstrained_spans]),
            })
        _table(clk, "nodes", node_rows, "per node: clock model summary against the reference node")
        segs = segment_rows(a.clock.models, a.epoch_rt)
        seg_doc = ("piecewise linear offset (node realtime - reference realtime) from t_start_ns (node realtime, "
                   "ns since the epoch) until the next segment: offset_ns + drift_ppm*1e-6*(t - t_start_ns); "
                   "offset_lo_ns..offset_hi_ns: the offsets the causality constraints allow at t_start_ns "
                   "(-inf/+inf: unconstrained; NaN: the method keeps no intervals)")
        if len(segs):
            clk.create_dataset("segments", data=segs).attrs["doc"] = seg_doc
        else:
            _table(clk, "segments", [], seg_doc)  # the same empty table as any other
        with h5py.File(collectives_part, "r") as src:
            src.copy(src["collectives"], f, name="collectives")
        an = f.create_group("analysis")
        _table(an, "mismatches", a.report["mismatches"], "first mismatch per communicator (flight recorder style)")
        _table(an, "stragglers", [{**s, "evidence": " | ".join(s["evidence"]), "ranks": json.dumps(s["ranks"]),
                                   "metrics": json.dumps(s["metrics"])} for s in a.report["stragglers"]],
               "straggler findings with their cause and evidence")
        _table(an, "excluded", a.report["excluded"], "node files left out of the merge, and why")
        fl = an.create_group("flames")
        fl.attrs["doc"] = ("per finding (index in stragglers) and stack table (cpu: samples, offcpu: blocked ns), "
                           "the folded stacks of its flagged windows: stack (root first, ';'), late (mean over "
                           "its processes), peers (mean over the peer processes read)")
        for fi, tables in sorted(a.flames.items()):
            for name, rows in sorted(tables.items()):
                arr = np.zeros(len(rows), np.dtype([("stack", h5py.string_dtype()), ("late", "<f8"), ("peers", "<f8")]))
                for i, (stack, late, peers) in enumerate(rows):
                    arr[i] = (stack, late, peers)
                fl.create_dataset(f"finding_{fi}/{name}", data=arr)
        an.attrs["report_json"] = json.dumps(a.report, sort_keys=True, default=_json_default)


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def compare_job_files(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> list[str]:
    """Differences between two job files, ignoring the attributes of the merge run (RUN_ATTRS).
    Empty when every group, attribute and dataset is identical."""
    diffs: list[str] = []
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:

        def attrs(name: str, oa: h5py.HLObject, ob: h5py.HLObject) -> None:
            ka = {k for k in oa.attrs if not (name == "/" and k in RUN_ATTRS)}
            kb = {k for k in ob.attrs if not (name == "/" and k in RUN_ATTRS)}
            if ka != kb:
                diffs.append(f"{name}: attributes differ: {sorted(ka ^ kb)}")
            for k in sorted(ka & kb):
                va, vb = oa.attrs[k], ob.attrs[k]
                if not np.array_equal(np.asarray(va), np.asarray(vb)):
                    diffs.append(f"{name}: attribute {k} differs")

        attrs("/", fa, fb)
        names_a: list[str] = []
        names_b: list[str] = []
        fa.visit(names_a.append)
        fb.visit(names_b.append)
        if sorted(names_a) != sorted(names_b):
            diffs.append(f"objects differ: {sorted(set(names_a) ^ set(names_b))[:10]}")
        for n in sorted(set(names_a) & set(names_b)):
            oa, ob = fa[n], fb[n]
            attrs(n, oa, ob)
            if isinstance(oa, h5py.Dataset):
                da, db = oa[()], ob[()]
                if da.dtype != db.dtype or da.shape != db.shape:
                    diffs.append(f"{n}: dtype or shape differs")
                elif not all(_same(da[c], db[c]) for c in da.dtype.names) if da.dtype.names else not _same(da, db):
                    diffs.append(f"{n}: values differ")
    return diffs


def _same(x: np.ndarray, y: np.ndarray) -> bool:
    if x.dtype.kind == "f":
        return bool(np.array_equal(x, y, equal_nan=True))
    return bool(np.array_equal(x, y))
