"""Small helpers shared by the analyses, and the pools that deal their items over the merge ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeAlias, TypeVar

import h5py
import numpy as np

# A 2-D table that is either in memory or in an HDF5 file (the merge driver's scratch file).
ArrayLike2D: TypeAlias = np.ndarray | h5py.Dataset
T = TypeVar("T")


@contextmanager
def quiet_nan() -> Iterator[None]:
    """Silence numpy's all-NaN warnings: a node absent from an instance is NaN there by design."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _lerp(a: np.ndarray, b: np.ndarray, g: np.ndarray) -> np.ndarray:
    """numpy's own interpolation between order statistics (exact at both ends)."""
    d = b - a
    return np.where(g >= 0.5, b - d * (1 - g), a + d * g)


def nanquantile_cols(blk: np.ndarray, q: float) -> np.ndarray:
    """np.nanquantile(blk, q, axis=0) (linear method), vectorized over the columns: one sort of the
    block instead of numpy's per-column loop. All-NaN columns give NaN."""
    if blk.ndim != 2 or not blk.shape[0]:
        return np.full(blk.shape[1:], np.nan)
    s = np.sort(blk, axis=0)  # NaN sort last
    n = np.isfinite(blk).sum(axis=0)
    vi = q * (n - 1).astype(np.float64)
    lo = np.floor(vi).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    g = vi - lo
    cols = np.arange(blk.shape[1])
    lo_c, hi_c = np.clip(lo, 0, None), np.clip(hi, 0, None)
    out = _lerp(s[lo_c, cols], s[hi_c, cols], g)
    return np.where(n > 0, out, np.nan)


def nanquantile_groups(vals: np.ndarray, bounds: np.ndarray, q: float) -> np.ndarray | None:
    """nanquantile_cols of each group of rows bounds[i]:bounds[i+1], for all groups with one sort:
    the groups are laid side by side, padded with NaN (which sorts last and is not counted), so
    every group and column gives the same numbers as nanquantile_cols. None when the padding would
    exceed a few blocks (very uneven groups); the caller then goes group by group."""
    sizes = np.diff(bounds)
    n_groups, n_cols = len(sizes), vals.shape[1]
    longest = int(sizes.max()) if n_groups else 0
    if not longest or n_groups * longest * n_cols > 4 * max(BLOCK_CELLS, vals.size):
        return None
    group = np.repeat(np.arange(n_groups), sizes)
    pad = np.full((n_groups, longest, n_cols), np.nan)
    pad[group, np.arange(bounds[0], bounds[-1]) - bounds[group]] = vals[bounds[0]:bounds[-1]]
    s = np.sort(pad, axis=1)  # NaN sort last
    n = np.isfinite(pad).sum(axis=1)  # [groups, cols]
    vi = q * (n - 1).astype(np.float64)
    lo = np.floor(vi).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    g = vi - lo
    lo_c, hi_c = np.clip(lo, 0, None), np.clip(hi, 0, None)
    a = np.take_along_axis(s, lo_c[:, None, :], axis=1)[:, 0, :]
    b = np.take_along_axis(s, hi_c[:, None, :], axis=1)[:, 0, :]
    return np.where(n > 0, _lerp(a, b, g), np.nan)


def nanmedian_rows(m: np.ndarray) -> np.ndarray:
    """np.nanmedian(m, axis=1), vectorized (mean of the two middle values for an even count)."""
    if m.ndim != 2 or not m.shape[1]:
        return np.full(m.shape[0], np.nan)
    s = np.sort(m, axis=1)
    n = np.isfinite(m).sum(axis=1)
    rows = np.arange(m.shape[0])
    lo = np.clip((n - 1) // 2, 0, None)
    hi = np.clip(n // 2, 0, None)
    out = (s[rows, lo] + s[rows, hi]) / 2
    return np.where(n > 0, out, np.nan)


# Cells (instances x nodes or ranks) of one block of the job-wide analyses: every pass over the
# [instance x node] and [seq x rank] tables holds one block at a time, so its temporaries have the
# same size at 16 and at 1024 nodes (docs/merge.md, "Rank 0's memory").
BLOCK_CELLS = 1 << 16


def block_rows(n_cols: int) -> int:
    """Rows per block for a table of n_cols columns (at least one row)."""
    return max(1, BLOCK_CELLS // max(1, n_cols))


def row_blocks(n_rows: int, n_cols: int) -> list[tuple[int, int]]:
    """(first row, end row) of consecutive blocks of about BLOCK_CELLS cells."""
    step = block_rows(n_cols)
    return [(k, min(n_rows, k + step)) for k in range(0, n_rows, step)]


def read_rows(arr: ArrayLike2D, idx: np.ndarray, axis: int = 0, other: slice = slice(None)) -> np.ndarray:
    """arr[idx] along `axis` (0 or 1), restricted to `other` along the other axis, for a numpy
    array or an h5py dataset; idx in any order, repeats allowed.

    h5py reads only increasing slices, so the distinct indices are read as contiguous runs (one run
    in the usual case of consecutive instances) and then put in the order asked for."""
    idx = np.asarray(idx, dtype=np.int64)
    if isinstance(arr, np.ndarray):
        return arr[idx, other] if axis == 0 else arr[other, idx]
    if not len(idx):
        n_other = len(range(*other.indices(arr.shape[1 - axis])))
        return np.zeros((0, n_other) if axis == 0 else (n_other, 0), arr.dtype)
    uniq, inverse = np.unique(idx, return_inverse=True)  # idx == uniq[inverse]
    starts = np.flatnonzero(np.diff(uniq, prepend=uniq[0] - 2) != 1)
    ends = np.append(starts[1:], len(uniq))
    cut = [slice(int(uniq[a]), int(uniq[b - 1]) + 1) for a, b in zip(starts, ends)]
    got = np.concatenate([arr[c, other] if axis == 0 else arr[other, c] for c in cut], axis=axis)
    return got[inverse] if axis == 0 else got[:, inverse]


class Spread(Protocol):
    """Work items spread over the merge's ranks: `map(fn, n)` returns [fn(0), ..., fn(n-1)] on every
    rank, each item computed on one rank only. Items must not depend on which rank runs them, so the
    result is the same for every rank count."""

    def map(self, fn: Callable[[int], T], n: int) -> list[T]: ...


class SerialSpread:
    """Everything on this process (one rank, library use)."""

    def map(self, fn: Callable[[int], T], n: int) -> list[T]:
        return [fn(i) for i in range(n)]


class _AllGather(Protocol):
    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...
    def allgather(self, obj: Any) -> list[Any]: ...


class CommSpread:
    """Items dealt round robin over the ranks of an MPI communicator (mpi4py's allgather of the
    results). Consecutive items (windows of the job) have about the same cost, so a round robin
    balances them."""

    def __init__(self, comm: _AllGather):
        self.comm = comm

    def map(self, fn: Callable[[int], T], n: int) -> list[T]:
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        mine = {i: fn(i) for i in range(rank, n, size)}
        out: dict[int, T] = {}
        for part in self.comm.allgather(mine):
            out.update(part)
        return [out[i] for i in range(n)]


class _PointToPoint(Protocol):
    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...
    def bcast(self, obj: Any, root: int = 0) -> Any: ...
    def send(self, obj: Any, dest: int, tag: int = 0) -> None: ...
    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any: ...


C_contra = TypeVar("C_contra", contravariant=True)
R_co = TypeVar("R_co", covariant=True)


class Task(Protocol[C_contra, R_co]):
    """One step of rank 0's analysis cut into items: `task(context, i)` computes item i from what the
    task carries (pickled to every rank once per map) and the rank's own context (the job-wide tables
    it reads). An item's result must not depend on the rank that computes it."""

    def __call__(self, context: C_contra, item: int, /) -> R_co: ...


class Pool(Protocol):
    """Rank 0's view of the merge ranks: `map(task, n)` yields task(context, 0 .. n-1) in item
    order, each item computed on one rank."""

    size: int

    def map(self, task: Task[Any, T], n: int) -> Iterator[T]: ...


class SerialPool:
    """Every item on this process (one merge rank, library use). `size`: the number of ranks the work
    is cut for, as a RankPool of that size would (tests check that the cuts change no number)."""

    def __init__(self, context: Any, size: int = 1):
        self.context = context
        self.size = size

    def map(self, task: Task[Any, T], n: int) -> Iterator[T]:
        for i in range(n):
            yield task(self.context, i)


TAG_POOL_ITEM = 31  # a worker's result of one item, to rank 0


class RankPool:
    """Items dealt round robin over the ranks of an MPI communicator: rank 0 calls map (bcast of the
    task), the other ranks run serve() until rank 0 calls close(). Rank 0 takes the results in item
    order, one message per item as it needs it, so it never holds more than one result per rank
    and a result may be as large as a block: a worker's next item waits until rank 0 took its last.
    Rank 0 computes its own items (0, size, 2 size, ...) in between."""

    def __init__(self, comm: _PointToPoint, context: Any):
        self.comm = comm
        self.context = context
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def map(self, task: Task[Any, T], n: int) -> Iterator[T]:
        if self.rank != 0:
            raise RuntimeError("RankPool.map runs on rank 0; the other ranks serve()")
        self.comm.bcast((task, n), root=0)
        for i in range(n):
            owner = i % self.size
            yield task(self.context, i) if owner == 0 else self.comm.recv(source=owner, tag=TAG_POOL_ITEM)

    def serve(self) -> None:
        """On the ranks other than 0: run the items of every map until close()."""
        while True:
            msg = self.comm.bcast(None, root=0)
            if msg is None:
                return
            task, n = msg
            for i in range(self.rank, n, self.size):
                self.comm.send(task(self.context, i), dest=0, tag=TAG_POOL_ITEM)

    def close(self) -> None:
        if self.rank == 0 and self.size > 1:
            self.comm.bcast(None, root=0)
