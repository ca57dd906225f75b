"""Reads node traces for `gpuprof inspect` and mpi_merge/. Every problem names the file and field."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.errors import TraceFormatError

REQUIRED_ATTRS = ("schema", "schema_version", "job_id", "node", "boot_id", "modes", "start_monotonic_ns",
                  "start_realtime_ns")


@dataclass
class NodeTrace:
    path: Path
    attrs: dict[str, Any]
    tables: dict[str, np.ndarray]
    enums: dict[str, dict[str, tuple[str, ...]]]
    partial_reasons: list[str] = field(default_factory=list)

    @property
    def node(self) -> str:
        return str(self.attrs["node"])

    @property
    def job_id(self) -> str:
        return str(self.attrs["job_id"])

    @property
    def sealed(self) -> bool:
        return bool(self.attrs.get("sealed", False))

    @property
    def synthetic(self) -> bool:
        return bool(self.attrs.get("synthetic", False))

    @property
    def partial(self) -> bool:
        return bool(self.partial_reasons)

    def table(self, path: str) -> np.ndarray:
        """A table's rows; a table the file's modes did not include is an error naming both."""
        if path not in self.tables:
            raise TraceFormatError(f"{self.path}: no table {path} (modes: {self.attrs.get('modes')})")
        return self.tables[path]

    def has(self, path: str) -> bool:
        return path in self.tables

    def enum_names(self, table_path: str, column: str) -> tuple[str, ...]:
        return self.enums.get(table_path, {}).get(column, ())

    def drops(self) -> dict[str, int]:
        if "drops_json" in self.attrs:
            return {k: int(v) for k, v in json.loads(self.attrs["drops_json"]).items()}
        # unsealed: the last running total per source
        d: dict[str, int] = {}
        if self.has(schema.DIAG_DROPS.path):
            for row in self.table(schema.DIAG_DROPS.path):
                d[row["source"].decode()] = int(row["dropped_total"])
        return d


def _decode(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.generic):
        return v.item()
    return v


def _open(path: Path) -> tuple[h5py.File, list[str]]:
    if not path.exists():
        raise TraceFormatError(f"{path}: node file does not exist")
    if not h5py.is_hdf5(path):
        raise TraceFormatError(f"{path}: not an HDF5 file")
    try:
        return h5py.File(path, "r"), []
    except OSError as first:
        # A collector that died mid-job leaves the SWMR writer flag set; SWMR-read opens it. Only
        # that case is retried: HDF5's SWMR open of a truncated file retries its metadata reads for
        # minutes (measured: > 2 min with libhdf5 1.14), so any other error is final at once.
        if "already open for write" not in str(first):
            raise TraceFormatError(f"{path}: HDF5 file cannot be opened (truncated or damaged): {first}") from None
        try:
            return h5py.File(path, "r", swmr=True), ["collector did not seal the file (died mid-job?)"]
        except OSError:
            raise TraceFormatError(f"{path}: HDF5 file cannot be opened (truncated or damaged): {first}") from None


def open_node_trace(path: str | os.PathLike[str], *, tables: tuple[str, ...] | None = None) -> NodeTrace:
    """Open and check a node file; load the given tables (all known ones when None)."""
    p = Path(path)
    f, partial = _open(p)
    with f:
        attrs = {k: _decode(v) for k, v in f.attrs.items()}
        for a in REQUIRED_ATTRS:
            if a not in attrs:
                raise TraceFormatError(f"{p}: root attribute '{a}' missing: not a slurm-gpuprof node file?")
        if attrs["schema"] != schema.SCHEMA_NAME:
            raise TraceFormatError(f"{p}: schema is '{attrs['schema']}', expected '{schema.SCHEMA_NAME}'")
        version = attrs["schema_version"]
        if not isinstance(version, int) or version > schema.SCHEMA_VERSION:
            raise TraceFormatError(
                f"{p}: schema_version {version!r} is newer than this reader supports ({schema.SCHEMA_VERSION})"
            )
        if not attrs.get("sealed", False) and "collector did not seal" not in " ".join(partial):
            partial.append(str(attrs.get("partial_reason", "collector did not seal the file")))
        out: dict[str, np.ndarray] = {}
        enums: dict[str, dict[str, tuple[str, ...]]] = {}
        wanted = tables if tables is not None else tuple(schema.TABLES_BY_PATH)
        for tpath in wanted:
            if tpath not in f:
                continue
            ds = f[tpath]
            spec = schema.TABLES_BY_PATH.get(tpath)
            added: list[schema.Column] = []
            if spec is not None:
                absent = [c for c in spec.columns if c.name not in (ds.dtype.names or ())]
                missing = [c.name for c in absent if c.absent_reads_as is None]
                if missing:
                    raise TraceFormatError(f"{p}: table {tpath} lacks column(s) {', '.join(missing)}")
                added = absent  # columns newer than the file: read as what their doc says
            try:
                out[tpath] = ds[()]
            except OSError as e:
                raise TraceFormatError(f"{p}: table {tpath} cannot be read: {e}") from None
            if added and spec is not None:
                full = spec.empty(len(out[tpath]))
                for name in full.dtype.names or ():
                    if name in (ds.dtype.names or ()):
                        full[name] = out[tpath][name]
                for c in added:
                    full[c.name] = c.absent_reads_as
                out[tpath] = full
            enums[tpath] = {
                k[: -len("_names")]: tuple(_decode(x) for x in ds.attrs[k])
                for k in ds.attrs
                if k.endswith("_names")
            }
    return NodeTrace(p, attrs, out, enums, partial)


def _emulated(trace: NodeTrace) -> bool:
    """GPU values from the NVML test double (sealed files say so in an attribute; unsealed ones
    by the double's device names), so that they are never shown as a measurement."""
    if trace.attrs.get("emulated_gpus", False):
        return True
    if trace.has(schema.GPU_DEVICES.path):
        return any(b"test double" in bytes(n).lower() for n in trace.table(schema.GPU_DEVICES.path)["name"])
    return False


def summarize(trace: NodeTrace) -> dict[str, Any]:
    """What `gpuprof inspect` prints: sources, rates, span, counts, drops, errors."""
    a = trace.attrs
    counts = {path: len(rows) for path, rows in trace.tables.items()}
    errors = []
    if trace.has(schema.DIAG_ERRORS.path):
        errors = [
            {"t_ns": int(r["t_ns"]), "source": r["source"].decode(), "message": r["message"].decode()}
            for r in trace.table(schema.DIAG_ERRORS.path)
        ]
    missing = []
    if trace.has(schema.DIAG_MISSING.path):
        seen = set()
        for r in trace.table(schema.DIAG_MISSING.path):
            key = (r["source"].decode(), int(r["device"]), r["metric"].decode(), r["reason"].decode())
            if key not in seen:
                seen.add(key)
                missing.append(dict(zip(("source", "device", "metric", "reason"), key)))
    start = int(a["start_monotonic_ns"])
    end = a.get("end_monotonic_ns")
    span_s = (int(end) - start) / 1e9 if end is not None else None
    return {
        "file": str(trace.path),
        "schema": f"{a['schema']} v{a['schema_version']}",
        "job_id": trace.job_id,
        "node": trace.node,
        "hostname": a.get("hostname"),
        "modes": a["modes"],
        "rates_hz": json.loads(a.get("rates_json", "{}")),
        "synthetic": trace.synthetic,
        "emulated": _emulated(trace),
        "sealed": trace.sealed,
        "partial_reasons": trace.partial_reasons,
        "span_s": span_s,
        "records": counts,
        "drops": trace.drops(),
        "errors": errors,
        "missing_metrics": missing,
        "late_sources": _json_attr(a, "late_sources", []),
        "attach": _json_attr(a, "attach_json", {}),
        "fastpath": _json_attr(a, "fastpath_json", None),
    }


def _json_attr(attrs: Any, name: str, default: Any) -> Any:
    """A JSON root attribute written at seal (absent in unsealed and older files: default)."""
    raw = attrs.get(name)
    if raw is None:
        return default
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return default
