"""The node file writer's appends (collector/writer.py): rows reach the file byte for byte."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from gpuprof.collector import native, schema, writer
from gpuprof.collector.writer import BUSY_CHUNK_ROWS, CHUNK_ROWS, NodeMeta, NodeTraceWriter


def random_rows(t: schema.Table, n: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of t with every byte of every column random (bytes columns: printable, NUL-padded
    at random lengths, as strings are)."""
    rows = np.zeros(n, t.dtype)
    for name in t.dtype.names or ():
        dt = t.dtype[name]
        if dt.kind == "S":
            for i in range(n):
                rows[name][i] = bytes(rng.integers(33, 127, rng.integers(0, dt.itemsize + 1)).astype(np.uint8))
        elif dt.kind == "f":
            rows[name] = rng.standard_normal(n) * 1e6
        else:
            rows[name] = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt)
    return rows


def assert_file_holds(path: Path, tables: tuple[schema.Table, ...], written: dict[str, list[np.ndarray]]) -> None:
    """Each table of the file is exactly its written rows, in order, in the table's dtype."""
    with h5py.File(path, "r") as f:
        for t in tables:
            got = f[t.path][()]
            assert got.dtype == t.dtype, t.path
            assert got.tobytes() == np.concatenate(written[t.path]).tobytes(), t.path


def test_every_table_appended_in_pieces_reads_back_identical(tmp_path: Path) -> None:
    """Every table of the schema, appended in five pieces of different sizes (crossing the 64 row
    chunks, and the busy tables' 512 row ones), then sealed: h5py reads back exactly the rows given, in order. The appends write
    the rows' bytes with the file's own type as the memory type, so a table whose dtype h5py would
    store in another layout would show here."""
    rng = np.random.default_rng(7)
    tables = schema.ALL_TABLES
    assert not any(t.dtype.hasobject for t in tables)
    meta = NodeMeta(job_id="1", node="n1", modes=("metrics",), rates={}, config=None, job_nodelist="")
    path = tmp_path / "n1.h5"
    w = NodeTraceWriter(path, meta, tables)
    written: dict[str, list[np.ndarray]] = {}
    for size in (1, 100, 37, 600, 1100):
        for t in tables:
            rows = random_rows(t, size, rng)
            w.append(t.path, rows)
            written.setdefault(t.path, []).append(rows)
        w.flush()
    w.seal(drops={})
    assert_file_holds(path, tables, written)


def test_batches_appended_as_parts_read_back_in_order(tmp_path: Path) -> None:
    """append_parts: a busy table's batches go into its chunks one by one, another table's as one
    array; either way the file holds every batch's rows in order."""
    rng = np.random.default_rng(5)
    tables = (schema.COLLECTIVE_CALLS, schema.HOST_PROCS)
    meta = NodeMeta(job_id="1", node="n1", modes=("metrics", "collectives"), rates={}, config=None, job_nodelist="")
    path = tmp_path / "n1.h5"
    w = NodeTraceWriter(path, meta, tables)
    written: dict[str, list[np.ndarray]] = {}
    for sizes in ((300, 0, 700), (5,), (BUSY_CHUNK_ROWS * 2 + 3, 17)):
        for t in tables:
            parts = [random_rows(t, n, rng) for n in sizes]
            w.append_parts(t.path, parts)
            written.setdefault(t.path, []).extend(parts)
        w.flush()
    w.seal(drops={})
    assert_file_holds(path, tables, written)


def test_the_tables_of_one_row_per_call_or_kernel_have_larger_chunks(tmp_path: Path) -> None:
    """The tables that reach thousands of rows a second (calls, CUDA kernels and launches) are
    chunked at BUSY_CHUNK_ROWS, every other at CHUNK_ROWS (writer.py says why)."""
    meta = NodeMeta(job_id="1", node="n1", modes=("metrics",), rates={}, config=None, job_nodelist="")
    path = tmp_path / "n1.h5"
    NodeTraceWriter(path, meta, schema.ALL_TABLES).seal(drops={})
    busy = {schema.COLLECTIVE_CALLS.path, schema.KERNEL_ACTIVITY.path, schema.KERNEL_ACTIVITY_LAUNCHES.path}
    with h5py.File(path, "r") as f:
        chunks = {t.path: f[t.path].chunks for t in schema.ALL_TABLES}
    assert {p: c for p, c in chunks.items() if p in busy} == {p: (BUSY_CHUNK_ROWS,) for p in busy}
    assert all(c == (CHUNK_ROWS,) for p, c in chunks.items() if p not in busy), chunks


def test_busy_tables_are_deflated_here_and_readers_see_only_rows_in_the_file(tmp_path: Path) -> None:
    """With gzip, the busy tables' chunks are shuffled and deflated by the writer (ISA-L) and
    written whole: each stored chunk is zlib's format under the dataset's own filters (mask 0), so
    any HDF5 reads it. Rows short of a chunk wait for the next flush, and until then the table's
    extent leaves them out (a SWMR reader or a recovery never reads a chunk not written yet); a
    flush with nothing new rewrites nothing."""
    import zlib

    rng = np.random.default_rng(11)
    t = schema.COLLECTIVE_CALLS
    meta = NodeMeta(job_id="1", node="n1", modes=("collectives",), rates={}, config=None, job_nodelist="")
    path = tmp_path / "n1.h5"
    w = NodeTraceWriter(path, meta, [t])
    first = random_rows(t, BUSY_CHUNK_ROWS + 10, rng)
    w.append(t.path, first)
    assert w.rows(t.path) == BUSY_CHUNK_ROWS + 10  # accepted, counted
    with h5py.File(path, "r", swmr=True) as f:
        assert f[t.path].shape == (BUSY_CHUNK_ROWS,)  # the whole chunk only: the 10 are not in the file yet
        assert f[t.path][()].tobytes() == first[:BUSY_CHUNK_ROWS].tobytes()
    w.flush()
    size = path.stat().st_size
    w.flush()
    assert path.stat().st_size == size
    with h5py.File(path, "r", swmr=True) as f:
        ds = f[t.path]
        assert ds.shape == (BUSY_CHUNK_ROWS + 10,)
        assert ds[()].tobytes() == first.tobytes()
        mask, stored = ds.id.read_direct_chunk((0,))
        assert mask == 0
        shuffled = np.frombuffer(zlib.decompress(stored), np.uint8).reshape(t.dtype.itemsize, BUSY_CHUNK_ROWS)
        assert shuffled.T.tobytes() == first[:BUSY_CHUNK_ROWS].tobytes()
    # the waiting chunk grows in place, then fills
    second = random_rows(t, BUSY_CHUNK_ROWS, rng)
    w.append(t.path, second)
    w.seal(drops={})
    with h5py.File(path, "r") as f:
        assert f[t.path].compression == "gzip" and f[t.path].shuffle
        assert f[t.path][()].tobytes() == np.concatenate([first, second]).tobytes()


def test_native_shuffle_is_hdf5s_byte_shuffle() -> None:
    """collector/native/shuffle.c puts byte k of every row together, as HDF5's shuffle filter
    does (numpy's transpose of the rows' bytes): rows of 1 to 40 bytes (its byte loop below 16,
    an overlapping last block above when not a multiple of 16), the tables' own sizes, and row
    counts on and off its blocks of 16."""
    shuffle = writer.native_shuffle()
    assert shuffle is not None, "built by make setup: its absence is a failure here"
    rng = np.random.default_rng(5)
    sizes = [*range(1, 41), 64, schema.COLLECTIVE_CALLS.dtype.itemsize, schema.KERNEL_ACTIVITY.dtype.itemsize]
    for size in sizes:
        for n in (1, 15, 16, 17, 48, BUSY_CHUNK_ROWS + 3):
            rows = rng.integers(0, 256, n * size, dtype=np.uint8)
            out = np.full(n * size, 0xAA, np.uint8)
            shuffle(rows.ctypes.data, out.ctypes.data, n, size)
            assert out.tobytes() == rows.reshape(n, size).T.tobytes(), (size, n)


def test_busy_table_files_are_the_same_without_the_native_shuffle(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy table's stored chunks are the same bytes whether the writer shuffled them in C or
    with numpy (where the library is not built)."""
    rng = np.random.default_rng(8)
    t = schema.COLLECTIVE_CALLS
    meta = NodeMeta(job_id="1", node="n1", modes=("collectives",), rates={}, config=None, job_nodelist="")
    rows = random_rows(t, 3 * BUSY_CHUNK_ROWS + 77, rng)
    stored = []
    for name, shuffle in (("native", writer.native_shuffle()), ("numpy", None)):
        assert name == "numpy" or shuffle is not None
        monkeypatch.setattr(writer, "native_shuffle", lambda s=shuffle: s)
        path = tmp_path / f"{name}.h5"
        w = NodeTraceWriter(path, meta, [t])
        w.append(t.path, rows[:BUSY_CHUNK_ROWS + 10])
        w.append(t.path, rows[BUSY_CHUNK_ROWS + 10:])
        w.seal(drops={})
        with h5py.File(path, "r") as f:
            ds = f[t.path]
            assert ds[()].tobytes() == rows.tobytes()
            stored.append([ds.id.read_direct_chunk((k,))[1] for k in range(0, len(rows), BUSY_CHUNK_ROWS)])
    assert stored[0] == stored[1]


def test_a_library_without_the_shuffle_is_unavailable_and_numpy_shuffles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A native library built from older sources (a function this Python calls missing) is
    NativeUnavailable, not an AttributeError in whatever loads it first: the writer then shuffles
    with numpy."""
    def older(lib: object) -> None:
        raise AttributeError("libgpuprof_sampler.so: undefined symbol: gp_shuffle")

    monkeypatch.setattr(native, "_declare", older)
    native.sampler.cache_clear()
    try:
        with pytest.raises(native.NativeUnavailable, match="gp_shuffle.*rebuild"):
            native.sampler()
        assert writer.native_shuffle() is None
    finally:
        native.sampler.cache_clear()  # loaded again, whole, by the next user


def test_other_compressions_keep_hdf5s_own_filters(tmp_path: Path) -> None:
    """lzf and none go through HDF5's filters for every table, the busy ones too."""
    rng = np.random.default_rng(3)
    t = schema.COLLECTIVE_CALLS
    meta = NodeMeta(job_id="1", node="n1", modes=("collectives",), rates={}, config=None, job_nodelist="")
    for name in ("lzf", "none"):
        path = tmp_path / f"{name}.h5"
        w = NodeTraceWriter(path, meta, [t], compression=name)
        rows = random_rows(t, 700, rng)
        w.append(t.path, rows)
        with h5py.File(path, "r", swmr=True) as f:
            assert f[t.path].shape == (700,)  # HDF5's path extends at every append
        w.seal(drops={})
        with h5py.File(path, "r") as f:
            assert f[t.path].compression == (None if name == "none" else name)
            assert f[t.path][()].tobytes() == rows.tobytes()


def test_sort_rows_orders_by_the_fields_and_keeps_ties_in_order() -> None:
    """schema.sort_rows (the stacks and off-CPU drains' sort, a lexsort of the columns) orders as
    np.sort(order=fields) does, and rows equal on the fields keep their order (np.sort's quicksort
    would not promise it)."""
    rng = np.random.default_rng(7)
    rows = schema.STACK_SAMPLES.empty(500)
    rows["pid"], rows["tid"], rows["cpu"] = rng.integers(1, 4, 500), rng.integers(1, 4, 500), rng.integers(0, 2, 500)
    rows["user_stack"] = np.arange(500)  # the drain's order
    got = schema.sort_rows(rows, "pid", "tid", "cpu")
    keys = got[["pid", "tid", "cpu"]]
    assert (keys == np.sort(rows, order=("pid", "tid", "cpu"))[["pid", "tid", "cpu"]]).all()
    same = (keys[1:] == keys[:-1])
    assert same.any() and (got["user_stack"][1:][same] > got["user_stack"][:-1][same]).all()


def test_concat_rows_is_numpys_concatenate_for_table_rows() -> None:
    """schema.concat_rows (the writer's and the fast path's concatenation, done as bytes) gives
    exactly np.concatenate's rows: parts of one table, a strided part among them, empty parts,
    one part alone (returned as it is), and parts of two dtypes (left to numpy)."""
    rng = np.random.default_rng(5)
    t = schema.COLLECTIVE_CALLS
    a, b = random_rows(t, 300, rng), random_rows(t, 41, rng)
    strided = random_rows(t, 90, rng)[::3]
    parts = [a, t.empty(), strided, b]
    got = schema.concat_rows(parts)
    assert got.dtype == t.dtype and got.tobytes() == np.concatenate(parts).tobytes()
    assert schema.concat_rows([a]) is a
    other = schema.PROCESS_EVENTS.empty(2)
    with np.testing.assert_raises(TypeError):  # as np.concatenate: no common dtype
        schema.concat_rows([a, other])
