"""A job file's clocks: each node's CLOCK_MONOTONIC to the aligned job clock, as the merge mapped it
(the node's clock pairs, wall clock steps taken out: loading.clock_map_of; then its clock model
from /clock/segments). What every reader of a job file's node tables uses (exports, the HTML page)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.mpi_merge.clock import NodeClockModel
from gpuprof.mpi_merge.loading import clock_map_of


def segment_rows_by_node(segs: np.ndarray) -> dict[str, np.ndarray]:
    """/clock/segments rows per node name, in file order."""
    col = segs["node"]
    if not len(col):
        return {}
    # the merge writes each node's segments together (jobfile.segment_rows): then the runs of one
    # name are the nodes, found without sorting the name column (a quarter of a second at 266,240 rows)
    starts = np.flatnonzero(np.concatenate([[True], col[1:] != col[:-1]]))
    if len({col[i] for i in starts}) == len(starts):
        ends = np.append(starts[1:], len(col))
        runs = {_name(col[a]): segs[a:b] for a, b in zip(starts, ends)}
        return {n: runs[n] for n in sorted(runs)}  # the order np.unique gives below
    names, inv = np.unique(col, return_inverse=True)
    order = np.argsort(inv, kind="stable")
    bounds = np.searchsorted(inv[order], np.arange(len(names) + 1))
    return {_name(n): segs[order[bounds[i]:bounds[i + 1]]] for i, n in enumerate(names)}


def _name(n: bytes | str) -> str:
    return n.decode() if isinstance(n, bytes) else str(n)


def clock_models(f: h5py.File) -> dict[str, NodeClockModel]:
    """Clock models back from /clock/nodes and /clock/segments (times relative to the epoch)."""
    epoch = int(f.attrs["epoch_realtime_ns"])
    nodes = f["clock/nodes"][()]
    segs = f["clock/segments"][()] if "node" in (f["clock/segments"].dtype.names or ()) else None
    out = {}
    # the node column grouped once (a job file of 256 nodes holds millions of segment rows)
    seg_rows = segment_rows_by_node(segs) if segs is not None else {}
    for row in nodes:
        name = _name(row["node"])
        out[name] = clock_model(row, seg_rows.get(name, np.zeros(0)), epoch)
    return out


def clock_model(row: np.void, rs: np.ndarray, epoch: int) -> NodeClockModel:
    """One node's model from its /clock/nodes row and its /clock/segments rows (clock_models)."""
    return NodeClockModel(
        _name(row["node"]), bool(row["aligned"]), "",
        (rs["t_start_ns"] - epoch).astype(np.float64) if len(rs) else np.zeros(0),
        rs["offset_ns"].astype(np.float64) if len(rs) else np.zeros(0),
        rs["drift_ppm"].astype(np.float64) if len(rs) else np.zeros(0),
    )


def _mapper(f: h5py.File, node: str, model: NodeClockModel, epoch: int) -> Callable[[np.ndarray], np.ndarray]:
    g = f[f"nodes/{node}"]
    pairs = g[schema.CLOCK_PAIRS.path.lstrip("/")][()] if schema.CLOCK_PAIRS.path.lstrip("/") in g else None
    return time_mapper(pairs, g.attrs, model, epoch)


def time_mapper(pairs: np.ndarray | None, attrs: Any, model: NodeClockModel,
                epoch: int) -> Callable[[np.ndarray], np.ndarray]:
    """node_time_mapper from the node's /clock/pairs (None: it has none) and its group's attributes,
    for a reader that has them at hand."""
    cm = clock_map_of(pairs, attrs)

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
