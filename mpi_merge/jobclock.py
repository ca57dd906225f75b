"""A job file's clocks: each node's CLOCK_MONOTONIC to the aligned job clock, as the merge mapped it
(the node's clock pairs, wall clock steps taken out: loading.clock_map_of; then its clock model
from /clock/segments). What every reader of a job file's node tables uses (exports, the HTML page)."""

from __future__ import annotations

import json
from collections.abc import Callable

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.mpi_merge.clock import NodeClockModel
from gpuprof.mpi_merge.loading import clock_map_of


def segment_rows_by_node(segs: np.ndarray) -> dict[str, np.ndarray]:
    """/clock/segments rows per node name, in file order."""
    names, inv = np.unique(segs["node"], return_inverse=True)
    order = np.argsort(inv, kind="stable")
    bounds = np.searchsorted(inv[order], np.arange(len(names) + 1))
    return {(n.decode() if isinstance(n, bytes) else str(n)): segs[order[bounds[i]:bounds[i + 1]]]
            for i, n in enumerate(names)}


def clock_models(f: h5py.File) -> dict[str, NodeClockModel]:
    """Clock models back from /clock/nodes and /clock/segments (times relative to the epoch)."""
    epoch = int(f.attrs["epoch_realtime_ns"])
    nodes = f["clock/nodes"][()]
    segs = f["clock/segments"][()] if "node" in (f["clock/segments"].dtype.names or ()) else None
    out = {}
    # the node column grouped once (a job file of 256 nodes holds millions of segment rows)
    seg_rows = segment_rows_by_node(segs) if segs is not None else {}
    for row in nodes:
        name = row["node"].decode() if isinstance(row["node"], bytes) else str(row["node"])
        rs = seg_rows.get(name, np.zeros(0))
        out[name] = NodeClockModel(
            name, bool(row["aligned"]), "",
            (rs["t_start_ns"] - epoch).astype(np.float64) if len(rs) else np.zeros(0),
            rs["offset_ns"].astype(np.float64) if len(rs) else np.zeros(0),
            rs["drift_ppm"].astype(np.float64) if len(rs) else np.zeros(0),
        )
    return out


def _mapper(f: h5py.File, node: str, model: NodeClockModel, epoch: int) -> Callable[[np.ndarray], np.ndarray]:
    g = f[f"nodes/{node}"]
    pairs = g[schema.CLOCK_PAIRS.path.lstrip("/")][()] if schema.CLOCK_PAIRS.path.lstrip("/") in g else None
    cm = clock_map_of(pairs, g.attrs)

    def conv(t: np.ndarray) -> np.ndarray:
        rel = (cm.to_realtime(t) - epoch).astype(np.float64)
        return np.round(model.align(rel)).astype(np.int64) + epoch

    return conv


def node_time_mapper(f: h5py.File, node: str) -> Callable[[np.ndarray], np.ndarray]:
    """A node's CLOCK_MONOTONIC ns -> aligned ns since the epoch on the reference clock."""
    return _mapper(f, node, clock_models(f)[node], int(f.attrs["epoch_realtime_ns"]))


def node_time_mappers(f: h5py.File) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """node_time_mapper of every merged node, reading the clock models once (not once per node)."""
    epoch = int(f.attrs["epoch_realtime_ns"])
    models = clock_models(f)
    return {node: _mapper(f, node, models[node], epoch) for node in json.loads(f.attrs["nodes"])}
