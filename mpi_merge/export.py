"""Exports of a merged job file: Perfetto/Chrome trace JSON of the aligned timelines, collapsed
stacks and speedscope JSON for flame graphs, and CSV of one series across nodes (what Slurm's
sh5util -E / -I give for its own profiles).

Everything streams: events are written as they are read, one communicator or node at a time.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

import h5py

from gpuprof.collector import schema
from gpuprof.collector.errors import TraceFormatError
from gpuprof.mpi_merge.jobclock import node_time_mapper
from gpuprof.mpi_merge.jobfile import JOB_SCHEMA, bound_metadata_cache

# perfetto = chrome-json (Chrome trace event JSON, which Perfetto opens too); perfetto-proto is
# Perfetto's native protobuf (perfetto_export.py), otf2 an OTF2 archive directory (otf2_export.py)
FORMATS = ("perfetto", "chrome-json", "perfetto-proto", "otf2", "collapsed", "speedscope", "csv")


# HDF5's metadata cache of a job file opened for reading: its size (bytes of the entries as stored)
# fixed, not grown. HDF5 grows it by default: at once by 1.4x any entry larger than a quarter of it
# (a "flash increase"; the report's attribute, 14 MB at 32768 ranks, is one), and in steps up to
# 32 MB while the hit rate is low. The page then fills that cache with the object headers of the
# node groups it walks, each several times its stored size once decoded in memory: reading the
# report grew the page's memory at 4096 nodes by 230 MB. 2 MB is HDF5's initial size, which the
# page's passes never grow: the same reads, hence the same speed, in a bounded cache.
def open_job_file(path: Path) -> h5py.File:
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot open job file: {e}") from None
    bound_metadata_cache(f)
    found = f.attrs.get("schema")
    if found != JOB_SCHEMA:
        f.close()  # (read before closing: the message names what the file says it is)
        raise TraceFormatError(f"{path}: not a slurm-gpuprof job file (schema {found!r})")
    return f


_open = open_job_file


def load_report(path: str | Path) -> dict[str, Any]:
    with _open(Path(path)) as f:
        return dict(json.loads(f["analysis"].attrs["report_json"]))


def export_perfetto(f: h5py.File, out: Path) -> int:
    """Chrome trace event JSON (opens in Perfetto UI and chrome://tracing): one process per node,
    one thread per (communicator, rank) (tid = communicator index * TID_STRIDE + rank: ranks of two
    communicators never share a track), one complete event per collective call on the aligned
    clock (us)."""
    nodes = json.loads(f.attrs["nodes"])
    epoch = int(f.attrs["epoch_realtime_ns"])
    ops = schema.COLLECTIVE_OPS
    n = 0
    with out.open("w") as fh:
        fh.write('{"displayTimeUnit":"ns","otherData":' + json.dumps({
            "job_id": str(f.attrs["job_id"]), "synthetic": bool(f.attrs["synthetic"]),
            "clock": "aligned to the reference node's realtime clock"}) + ',"traceEvents":[\n')
        first = True

        def emit(ev: dict[str, Any]) -> None:
            nonlocal first
            fh.write(("" if first else ",\n") + json.dumps(ev))
            first = False

        for i, node in enumerate(nodes):
            emit({"ph": "M", "name": "process_name", "pid": i, "args": {"name": node}})
        for ci, name in enumerate(sorted(f["collectives"])):
            g = f["collectives"][name]
            node_of = json.loads(g.attrs["node_of_rank_json"])
            tid0 = ci * TID_STRIDE
            E, X, OP = g["enter_aligned_ns"], g["exit_aligned_ns"], g["op"]
            W = g["wait_ns"]
            for r, node in enumerate(node_of):
                if node is None:
                    continue
                pid = nodes.index(node)
                emit({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid0 + r, "args": {"name": f"{name} rank {r}"}})
            for i0 in range(0, E.shape[0], 4096):
                e, x, op, w = E[i0:i0 + 4096], X[i0:i0 + 4096], OP[i0:i0 + 4096], W[i0:i0 + 4096]
                for k in range(e.shape[0]):
                    for r, node in enumerate(node_of):
                        if node is None or e[k, r] < 0 or x[k, r] < 0:
                            continue
                        emit({"ph": "X", "name": ops[int(op[k, r])], "cat": "collective", "pid": nodes.index(node),
                              "tid": tid0 + r, "ts": (int(e[k, r]) - epoch) / 1e3, "dur": (int(x[k, r]) - int(e[k, r])) / 1e3,
                              "args": {"seq": i0 + k, "wait_us": (int(w[k, r]) / 1e3) if w[k, r] >= 0 else None}})
                        n += 1
        fh.write("\n]}\n")
    return n


TID_STRIDE = 1 << 20  # above any communicator size (MPI ranks are int, jobs here stay below 2^20 ranks)


def _stack_rows(f: h5py.File, table: str = "stacks/samples", weight: str = "count") -> Counter[str]:
    """Folded stacks of every node from the eBPF stack tables (stack ids resolved through the node's
    /stacks/frames and /stacks/symbols), the node name as the root frame."""
    from gpuprof.collector.symbolize import folded_stacks

    folded: Counter[str] = Counter()
    found = False
    for node in json.loads(f.attrs["nodes"]):
        g = f[f"nodes/{node}"]
        if table not in g:
            continue
        found = True
        for stack, n in folded_stacks(g, table, weight).items():
            folded[f"{node};{stack}"] += int(n)
    if not found:
        raise TraceFormatError(
            "no CPU stack table in this job file: the job ran without the 'stacks' mode, or its collector "
            "wrote no stacks table"
        )
    return folded


def export_collapsed(f: h5py.File, out: Path) -> int:
    folded = _stack_rows(f)
    with out.open("w") as fh:
        for k in sorted(folded):
            fh.write(f"{k} {folded[k]}\n")
    return len(folded)


def export_speedscope(f: h5py.File, out: Path) -> int:
    folded = _stack_rows(f)
    frames: dict[str, int] = {}
    samples, weights = [], []
    for k in sorted(folded):
        samples.append([frames.setdefault(fr, len(frames)) for fr in k.split(";")])
        weights.append(folded[k])
    doc = {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": [{"name": n} for n in frames]},
        "profiles": [{"type": "sampled", "name": f"job {f.attrs['job_id']}", "unit": "none", "startValue": 0,
                      "endValue": int(sum(weights)), "samples": samples, "weights": weights}],
        "name": f"gpuprof job {f.attrs['job_id']}", "exporter": "slurm-gpuprof",
    }
    out.write_text(json.dumps(doc))
    return len(samples)


def export_csv(f: h5py.File, out: Path, series: str) -> int:
    """One series across nodes: node, device, aligned time, value. SERIES is TABLE:COLUMN with the
    table as in the node format (gpu/samples, gpu/gpm, host/node, host/procs); gpuN:col is
    gpu/samples:col for GPU N."""
    table, _, column = series.partition(":")
    dev_filter: int | None = None
    if table.startswith("gpu") and table[3:].isdigit():
        dev_filter, table = int(table[3:]), "gpu/samples"
    spec = schema.TABLES_BY_PATH.get("/" + table)
    if spec is None or column not in [c.name for c in spec.columns] or "t_ns" not in [c.name for c in spec.columns]:
        raise TraceFormatError(f"unknown series {series!r}: use TABLE:COLUMN of a timed table, e.g. gpu/samples:util_gpu")
    n = 0
    with out.open("w", newline="") as fh:
        w = csv.writer(fh)
        cols = spec.dtype.names or ()
        dev_col = "gpu" if "gpu" in cols else ("pid" if "pid" in cols else None)
        w.writerow(["node", dev_col or "device", "t_aligned_ns", column])
        for node in json.loads(f.attrs["nodes"]):
            path = f"nodes/{node}/{table}"
            if path not in f:
                continue
            conv = node_time_mapper(f, node)
            ds = f[path]
            for i in range(0, ds.shape[0], 65536):
                rows = ds[i:i + 65536]
                if dev_filter is not None:
                    rows = rows[rows["gpu"] == dev_filter]
                t = conv(rows["t_ns"])
                for j in range(len(rows)):
                    w.writerow([node, int(rows[dev_col][j]) if dev_col else "", int(t[j]), rows[column][j].item()])
                n += len(rows)
    return n


def export(job_file: Path, fmt: str, out: Path, *, series: str = "gpu0:util_gpu") -> int:
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown export format {fmt!r}; one of {FORMATS}")
    if fmt != "otf2" and out.is_dir():
        raise TraceFormatError(f"{out}: is a directory; {fmt} is written to a file")
    with _open(job_file) as f:
        if fmt in ("perfetto", "chrome-json"):
            return export_perfetto(f, out)
        if fmt == "perfetto-proto":
            from gpuprof.mpi_merge.perfetto_export import export_perfetto_proto

            return export_perfetto_proto(f, out).events
        if fmt == "otf2":
            from gpuprof.mpi_merge.otf2_export import export_otf2

            return export_otf2(f, out).events
        if fmt == "collapsed":
            return export_collapsed(f, out)
        if fmt == "speedscope":
            return export_speedscope(f, out)
        return export_csv(f, out, series)
