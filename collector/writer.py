"""Writes a node trace (schema in collector/schema.py, description in docs/trace-format.md).

Crash safety: every table is created at start, then the file switches to SWMR mode. From then on
the writer only appends rows and flushes; HDF5's SWMR ordering keeps the file readable after each
flush, so a collector killed mid-job leaves a file holding everything up to its last flush (open it
with `h5py.File(path, "r", swmr=True)`, or let `gpuprof epilog` recover it into a plain file).
Attributes cannot change under SWMR, so what is known only at the end (end times, drop totals,
`sealed`) is written at seal, after the SWMR session is closed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from isal import isal_zlib

from gpuprof.collector import __version__, native, schema
from gpuprof.collector.errors import TraceFormatError
from gpuprof.collector.schema import Table

# Small chunks on purpose: every flush rewrites the partial last chunk of each table, and HDF5 does
# not reuse the space of the replaced compressed chunk, so large chunks bloat the file (measured in
# docs/trace-format.md: 4096 rows 3.2 MB/min, 256 rows 0.56, 64 rows 0.39 with gzip).
CHUNK_ROWS = 64
# ...except in the tables of one row per call or kernel, which reach thousands of rows a second:
# there each chunk's deflate set-up (zlib's state, a few hundred kB, for 5 kB of rows) made most
# of the writer's time (hpcc's 13 000 calls a second: 11 ms of CPU a second in 64-row chunks,
# 4.9 in 512-row ones, and a file 25 % smaller); the price is ~32 kB a minute of rewritten
# partial chunks when such a table stays slow (docs/trace-format.md, "Chunks of the busy tables").
# 1024 rows were tried with ISA-L level 0: 0 to 10 % less CPU a row (two runs of the
# writer_busy_chunks bench line), for 35 to 80 % more file at 1 to 100 calls a second.
BUSY_CHUNK_ROWS = 512
BUSY_TABLES = frozenset({schema.COLLECTIVE_CALLS.path, schema.KERNEL_ACTIVITY.path, schema.KERNEL_ACTIVITY_LAUNCHES.path})
GZIP_LEVEL = 2
# With gzip, the busy tables' chunks are deflated here by ISA-L (isal: zlib's format, any HDF5
# reads it) and written whole (DirectChunks), not by HDF5's filter on the writer thread: at hpcc's
# 13 000 calls a second zlib's deflate was most of the writer's CPU, and on a node whose every core
# runs a rank each of its milliseconds is one the job waits. Level 0, not 1 (until 2026-12-07): on
# hpcc's real call rows the writer spends a third less CPU a row (78 ns against 115, deflate and
# HDF5's write included) for a calls table 20 % larger (bench_collector.py --chunks, the
# writer_busy_chunks line; docs/trace-format.md, "ISA-L level 0").
ISAL_LEVEL = 0


def native_shuffle() -> Callable[[int, int, int, int], None] | None:
    """collector/native/shuffle.c's gp_shuffle(src, dst, rows, row bytes), or None where the
    library is not built."""
    try:
        return native.sampler().gp_shuffle  # type: ignore[no-any-return]
    except native.NativeUnavailable:
        return None


def numpy_shuffle(rows: np.ndarray) -> np.ndarray:
    """HDF5's shuffle of contiguous rows (byte k of every row together) by numpy's transpose: what
    the writer uses where collector/native is not built."""
    return np.ascontiguousarray(rows.view(np.uint8).reshape(len(rows), rows.dtype.itemsize).T)


def chunk_rows(table_path: str) -> int:
    """Rows per chunk of a node file's table."""
    return BUSY_CHUNK_ROWS if table_path in BUSY_TABLES else CHUNK_ROWS


@dataclass
class NodeMeta:
    job_id: str
    node: str
    modes: tuple[str, ...]
    rates: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    synthetic: bool = False
    job_nodelist: str = ""  # the job's nodes (Slurm hostlist), so the merge knows who is missing
    hostname: str = field(default_factory=lambda: os.uname().nodename)
    boot_id: str = field(default_factory=lambda: read_boot_id())


def read_boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def compression_kwargs(name: str) -> dict[str, Any]:
    """HDF5 filter settings; docs/trace-format.md has the measurements behind the default."""
    if name == "gzip":
        # level 2: zlib's fast deflate (levels 1-3); on a real hpcc node file it wrote the same
        # bytes as level 4 (its lazy matching) with 28 % less CPU per flush
        return {"compression": "gzip", "compression_opts": GZIP_LEVEL, "shuffle": True}
    if name == "lzf":
        return {"compression": "lzf", "shuffle": True}
    if name == "none":
        return {}
    raise ValueError(f"unknown compression {name!r}: use gzip, lzf or none")


class DirectChunks:
    """One busy table of a gzip file, written a whole chunk at a time: the rows shuffled (HDF5's
    shuffle filter: byte k of every row together) and deflated here, then handed to HDF5 as the
    chunk's stored bytes (H5Dwrite_chunk), which readers undo through the dataset's own filters.
    Rows short of a whole chunk wait in memory and are written, padded, at each flush that has new
    ones, to the same chunk again once it is full. The table's extent covers the rows whose chunk
    is in the file, never those still waiting: a reader, or the recovery of a killed collector,
    sees only rows that are there."""

    def __init__(self, ds_id: h5py.h5d.DatasetID, dtype: np.dtype, rows_per_chunk: int,
                 level: int = ISAL_LEVEL) -> None:
        self.level = level  # ISA-L's (the benches compare levels)
        self.ds_id = ds_id
        self.dtype = dtype
        self.rows_per_chunk = rows_per_chunk
        self._shuffle = native_shuffle()  # None: numpy's transpose, the same bytes at 1.8 times the CPU
        self._shuffled = np.empty(rows_per_chunk * dtype.itemsize, np.uint8)
        self.whole = 0  # rows in whole chunks written
        self.pending = np.zeros(0, dtype)  # rows after them, fewer than a chunk
        self.pending_written = True  # the padded chunk of `pending` is in the file as it is now
        self.extent = 0

    @property
    def rows(self) -> int:
        return self.whole + len(self.pending)

    def _chunk(self, rows: np.ndarray) -> bytes:
        if len(rows) < self.rows_per_chunk:
            padded = np.zeros(self.rows_per_chunk, self.dtype)
            padded[: len(rows)] = rows
            rows = padded
        rows = np.ascontiguousarray(rows)  # a batch's slice already is: no copy
        if self._shuffle is None:
            shuffled = numpy_shuffle(rows)
        else:
            self._shuffle(rows.ctypes.data, self._shuffled.ctypes.data, self.rows_per_chunk, self.dtype.itemsize)
            shuffled = self._shuffled
        return isal_zlib.compress(shuffled.data, self.level)

    def _extend(self, rows: int) -> None:
        if rows > self.extent:
            self.ds_id.set_extent((rows,))
            self.extent = rows

    def append(self, rows: np.ndarray) -> None:
        c = self.rows_per_chunk
        chunks: list[np.ndarray] = []
        if len(self.pending):
            # only the rows that complete the waiting chunk are copied to it, not the whole batch
            # behind it (every call row was copied once more so)
            fill = c - len(self.pending)
            head = schema.concat_rows((self.pending, rows[:fill]))
            rows = rows[fill:]
            if len(head) < c:
                self.pending = head
                self.pending_written = False
                return
            chunks.append(head)
        full = len(rows) // c * c
        chunks.extend(rows[k:k + c] for k in range(0, full, c))
        if chunks:
            self._extend(self.whole + len(chunks) * c)
            for chunk in chunks:
                self.ds_id.write_direct_chunk((self.whole,), self._chunk(chunk))
                self.whole += c
        self.pending = rows[full:].copy()
        self.pending_written = len(self.pending) == 0

    def flush(self) -> None:
        if not self.pending_written:
            self._extend(self.rows)
            self.ds_id.write_direct_chunk((self.whole,), self._chunk(self.pending))
            self.pending_written = True
        self.ds_id.flush()  # the chunk index: its write error raised here (NodeTraceWriter.flush)


class NodeTraceWriter:
    """Append-only writer of one node file. Not thread-safe: the collector's writer thread owns it."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: NodeMeta,
        tables: Iterable[Table],
        *,
        compression: str = "gzip",
        start_monotonic_ns: int | None = None,
        start_realtime_ns: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.tables = {t.path: t for t in tables}
        self._rows = {p: 0 for p in self.tables}
        self._sealed = False
        # per table: the dataset (low-level id) and its file type, used as the memory type of the
        # writes (append)
        self._datasets: dict[str, tuple[h5py.h5d.DatasetID, h5py.h5t.TypeID]] = {}
        self._direct: dict[str, DirectChunks] = {}  # the busy tables, when the file is gzip's
        filters = compression_kwargs(compression)
        f = h5py.File(self.path, "w", libver="latest")
        try:
            f.attrs["schema"] = schema.SCHEMA_NAME
            f.attrs["schema_version"] = schema.SCHEMA_VERSION
            f.attrs["job_id"] = meta.job_id
            f.attrs["node"] = meta.node
            f.attrs["hostname"] = meta.hostname
            f.attrs["boot_id"] = meta.boot_id
            f.attrs["collector_version"] = __version__
            f.attrs["modes"] = ",".join(meta.modes)
            f.attrs["rates_json"] = json.dumps(meta.rates, sort_keys=True)
            f.attrs["config_json"] = json.dumps(meta.config, sort_keys=True)
            f.attrs["start_monotonic_ns"] = np.uint64(
                time.clock_gettime_ns(time.CLOCK_MONOTONIC) if start_monotonic_ns is None else start_monotonic_ns
            )
            f.attrs["start_realtime_ns"] = np.int64(
                time.clock_gettime_ns(time.CLOCK_REALTIME) if start_realtime_ns is None else start_realtime_ns
            )
            f.attrs["synthetic"] = bool(meta.synthetic)
            f.attrs["job_nodelist"] = meta.job_nodelist
            f.attrs["compression"] = compression
            for t in self.tables.values():
                ds = f.create_dataset(
                    t.path, shape=(0,), maxshape=(None,), dtype=t.dtype, chunks=(chunk_rows(t.path),), **filters
                )
                ds.attrs["doc"] = t.doc
                for c in t.columns:
                    ds.attrs[f"unit:{c.name}"] = c.unit
                for col, names in t.enums.items():
                    ds.attrs[f"{col}_names"] = np.array(names, dtype=h5py.string_dtype())
                if compression == "gzip" and t.path in BUSY_TABLES:
                    self._direct[t.path] = DirectChunks(ds.id, t.dtype, chunk_rows(t.path))
            f.swmr_mode = True
        except BaseException:
            f.close()
            raise
        self._file: h5py.File | None = f

    def append(self, table_path: str, rows: np.ndarray) -> None:
        """Append rows (a structured array of the table's dtype) to a table."""
        if self._file is None:
            raise TraceFormatError(f"{self.path}: append to {table_path} after seal")
        if len(rows) == 0:
            return
        t = self.tables.get(table_path)
        if t is None:
            raise TraceFormatError(f"{self.path}: table {table_path} is not in this file's modes")
        if rows.dtype != t.dtype:
            rows = rows.astype(t.dtype)
        direct = self._direct.get(table_path)
        if direct is not None:
            direct.append(rows)
            self._rows[table_path] = direct.rows
            return
        opened = self._datasets.get(table_path)
        if opened is None:
            # kept open: closing a dataset writes its cached chunks, and an error there (ENOSPC) is
            # only printed by h5py's deallocator, never raised; flush() below raises it instead
            ds_id = self._file[table_path].id
            opened = self._datasets[table_path] = (ds_id, ds_id.get_type())
        ds_id, file_type = opened
        # Through h5py's low-level calls, with the file's own type as the memory type: the rows'
        # dtype is the one the dataset was created from (packed, little-endian numbers and fixed
        # bytes, no variable-length fields: tests/test_writer.py checks every table), so the bytes
        # go as they are. The high-level `ds[n:] = rows` built the compound type from the dtype and
        # a selection again at every append: 2/3 of the writer's append time (0.3 ms a table).
        n, k = self._rows[table_path], len(rows)
        ds_id.set_extent((n + k,))
        file_space = ds_id.get_space()
        file_space.select_hyperslab((n,), (k,))
        ds_id.write(h5py.h5s.create_simple((k,)), file_space, np.ascontiguousarray(rows), mtype=file_type)
        self._rows[table_path] = n + k

    def append_parts(self, table_path: str, parts: Sequence[np.ndarray]) -> None:
        """append() of the rows of several batches, in order: a busy table's batches one by one
        (its chunks take rows in pieces, so they are not copied together first), any other table's
        as one array (one HDF5 write)."""
        if table_path in self._direct:
            for rows in parts:
                self.append(table_path, rows)
        elif parts:
            self.append(table_path, schema.concat_rows(parts))

    def rows(self, table_path: str) -> int:
        return self._rows[table_path]

    def flush(self) -> None:
        """Write every table's cached chunks (H5Dflush raises a write error such as ENOSPC, which a
        plain file flush in SWMR mode may leave unreported), then the file's metadata."""
        if self._file is not None:
            for direct in self._direct.values():
                direct.flush()
            for ds_id, _ in self._datasets.values():
                ds_id.flush()
            self._file.flush()

    def seal(
        self,
        *,
        drops: dict[str, int],
        extra: Callable[[h5py.File], None] | None = None,
    ) -> None:
        """Final flush, close the SWMR session, then write the end attributes and `extra` data
        (string tables that are only known at the end, e.g. symbolized stacks)."""
        if self._file is None:
            return
        self.flush()
        self._datasets.clear()
        self._direct.clear()
        self._file.close()
        self._file = None
        with h5py.File(self.path, "r+") as f:
            if extra is not None:
                extra(f)
            f.attrs["end_monotonic_ns"] = np.uint64(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
            f.attrs["end_realtime_ns"] = np.int64(time.clock_gettime_ns(time.CLOCK_REALTIME))
            f.attrs["drops_json"] = json.dumps(drops, sort_keys=True)
            f.attrs["sealed"] = True
        self._sealed = True

    def close_unsealed(self) -> None:
        """Close without sealing (the file stays readable as partial)."""
        if self._file is not None:
            self._datasets.clear()
            try:
                for direct in self._direct.values():
                    direct.flush()
                self._file.flush()
            finally:
                self._direct.clear()
                self._file.close()
                self._file = None


def is_sealed(path: str | os.PathLike[str]) -> bool:
    """Whether the node file on disk was sealed (its writer finished): False when it cannot be
    opened plainly, as a file still or last open for write cannot."""
    try:
        with h5py.File(path, "r") as f:
            return bool(f.attrs.get("sealed", False))
    except OSError:
        return False


def recover(src: str | os.PathLike[str], dst: str | os.PathLike[str], reason: str) -> None:
    """Copy what an unsealed node file holds (a dead collector's) into a plain, closed file that any
    HDF5 tool opens, marked partial with the reason. The source is left as it was."""
    try:
        fin = h5py.File(src, "r")
    except OSError as first:
        # only a file left open for write by a dead writer is SWMR-opened: on a truncated file the
        # SWMR open retries metadata reads for minutes (see collector/reader.py)
        if "already open for write" not in str(first):
            raise TraceFormatError(f"{src}: cannot open node file to recover it: {first}") from None
        try:
            fin = h5py.File(src, "r", swmr=True)
        except OSError as e:
            raise TraceFormatError(f"{src}: cannot open unsealed node file to recover it: {e}") from None
    with fin, h5py.File(dst, "w", libver="latest") as fout:
        for k, v in fin.attrs.items():
            fout.attrs[k] = v
        for name in fin:
            fin.copy(fin[name], fout, name=name)
        fout.attrs["sealed"] = False
        fout.attrs["partial_reason"] = reason
