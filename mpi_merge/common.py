"""Small helpers shared by the analyses, and the pools that deal their items over the merge ranks."""

from __future__ import annotations

import math
import os
import pickle
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
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


def open_scratch_for_reads(path: Path) -> h5py.File:
    """The merge's scratch tables (contiguous datasets) opened read-only with HDF5's sieve buffer off.

    A block of seqs across all ranks of a [rank x seq] table is one short run per rank, a row
    apart. With the sieve buffer (64 KiB by default) HDF5 reads 64 KiB from the file for every such
    run to use a few hundred bytes of it: 6.3 ms of kernel copying per field and block on a 1024-rank
    communicator, against 0.7 ms reading the runs alone, and on 2 merge ranks both cores copying at
    once slowed each by 1.7x (the reads were the largest cost the merge's ranks added)."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_sieve_buf_size(0)
    try:
        fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY, fapl=fapl)
    except OSError as e:
        raise OSError(f"{path}: cannot open the merge's scratch tables: {e}") from e
    return h5py.File(fid)


class Spread(Protocol):
    """Work items spread over the merge's ranks: `map(fn, n)` returns [fn(0), ..., fn(n-1)] on every
    rank, each item computed on one rank only. Items must not depend on which rank runs them, so the
    result is the same for every rank count."""

    size: int  # the ranks the items are spread over

    def map(self, fn: Callable[[int], T], n: int) -> list[T]: ...

    def ordered(self, fn: Callable[[int], T], n: int) -> Iterator[T]:
        """fn(0), ..., fn(n-1) in order, on rank 0 only, for a loop there that must take them in order
        (the other ranks compute items and get an empty iterator); rank 0 holds a bounded window of
        results, so an item may be as large as a block."""
        ...

    def share(self, obj: T) -> T:
        """Rank 0's obj on every rank (what rank 0 made of an ordered map)."""
        ...


class SerialSpread:
    """Everything on this process (one rank, library use)."""

    size = 1

    def map(self, fn: Callable[[int], T], n: int) -> list[T]:
        return [fn(i) for i in range(n)]

    def ordered(self, fn: Callable[[int], T], n: int) -> Iterator[T]:
        return (fn(i) for i in range(n))

    def share(self, obj: T) -> T:
        return obj


class _PointToPoint(Protocol):
    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...
    def bcast(self, obj: Any, root: int = 0) -> Any: ...
    def send(self, obj: Any, dest: int, tag: int = 0) -> None: ...
    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any: ...
    def isend(self, obj: Any, dest: int, tag: int = 0) -> Any: ...
    def iprobe(self, source: int = 0, tag: int = 0) -> bool: ...


TAG_POOL_ITEM = 31  # a worker's result of one item, to rank 0: (worker rank, item, result)
TAG_POOL_ASSIGN = 32  # rank 0's next item for a worker (an int), or None: no item left in this map
# Items a worker holds at once (the one it computes and two queued on it): its next item is
# there when it sends a result, even while rank 0 is busy with an item of its own.
DEAL_DEPTH = 3


def _any_source() -> int:
    from mpi4py import MPI  # only where there are other ranks: library use needs no MPI

    return int(MPI.ANY_SOURCE)


class ChoresComm:
    """An mpi4py communicator whose waits do work: while this rank waits for another rank's message
    (recv) or broadcast, it runs `chores()` one short step at a time until the message is there or
    the chores say there is nothing to do now (the merge's writer copies node tables into the job
    file then, one node a step: work that would otherwise wait for the end while rank 0 waits for
    it). A step takes milliseconds, so a message is taken at most one step late. So that a rank can
    work while it waits for a broadcast, every rank broadcasts in two parts: the pickled size by a
    nonblocking broadcast, which a waiting rank tests between steps, then the bytes; what each rank
    gets is what mpi4py's bcast gives. Every rank of the communicator must use this class (the two
    parts are the protocol); only a rank with chores set works in its waits."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.chores: Callable[[], bool] | None = None
        self.chore_seconds = 0.0

    def Get_rank(self) -> int:
        return int(self.comm.Get_rank())

    def Get_size(self) -> int:
        return int(self.comm.Get_size())

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.comm.send(obj, dest=dest, tag=tag)

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Any:
        return self.comm.isend(obj, dest=dest, tag=tag)

    def iprobe(self, source: int = 0, tag: int = 0) -> bool:
        return bool(self.comm.iprobe(source=source, tag=tag))

    def allgather(self, obj: Any) -> list[Any]:
        return list(self.comm.allgather(obj))

    def _work_until(self, arrived: Callable[[], bool]) -> None:
        while self.chores is not None and not arrived():
            t0 = time.monotonic()
            more = self.chores()
            self.chore_seconds += time.monotonic() - t0
            if not more:
                return

    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any:
        self._work_until(lambda: bool(self.comm.iprobe(source=source, tag=tag)))
        return self.comm.recv(buf, source=source, tag=tag)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        size = np.zeros(1, np.int64)
        if self.comm.Get_rank() == root:
            data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            size[0] = len(data)
            self.comm.Ibcast(size, root=root).Wait()
            self.comm.Bcast(data, root=root)
            return obj
        req = self.comm.Ibcast(size, root=root)
        self._work_until(lambda: bool(req.Test()))
        req.Wait()
        data = bytearray(int(size[0]))
        self.comm.Bcast(data, root=root)
        return pickle.loads(data)


@dataclass
class DealStats:
    """What rank 0's dealing did, over every map of a pool: the items each rank computed (a copy
    rank 0 made again counts on both), the items rank 0 computed again because their rank was late,
    and the most results rank 0 held at once (the window's bound, checked by the tests)."""

    items_by_rank: list[int]
    recomputed: int = 0
    most_held: int = 0


# A wanted item that a worker has been computing this many times rank 0's mean item time is computed
# again on rank 0 (the worker's copy is dropped when it comes): a rank that stalls costs the others
# at most about that long per item.
LATE_FACTOR = 2.0
POLL_S = 0.0005  # rank 0's sleep between looks for a result while it waits (leaves the core to others)


class WorkerQueues:
    """On rank 0: the items each worker holds, in the order it computes them ((map, item), over the
    maps of a pool: a late copy may still be in a worker's queue when the next map begins), and
    when the one it computes now began (its previous result came in, or it was handed out to an
    idle worker)."""

    def __init__(self, workers: range):
        self.held: dict[int, deque[tuple[int, int]]] = {w: deque() for w in workers}
        self.started: dict[int, float] = dict.fromkeys(workers, 0.0)

    def given(self, w: int, key: tuple[int, int]) -> None:
        if not self.held[w]:
            self.started[w] = time.monotonic()
        self.held[w].append(key)

    def taken(self, w: int) -> None:
        """Worker w's oldest item came back (a worker computes its items in the order given)."""
        self.held[w].popleft()
        self.started[w] = time.monotonic()

    def due(self, key: tuple[int, int], item_s: float) -> float:
        """When the item should be back if each item takes LATE_FACTOR x item_s: from the start of
        what its worker computes now, counting the items queued before it."""
        for w, q in self.held.items():
            if key in q:
                return self.started[w] + item_s * (list(q).index(key) + 1)
        return math.inf  # not held by a worker (it is on its way back)


class _Dealer:
    """Rank 0's side of one map: items handed out on demand, results taken in item order.

    Every worker holds up to DEAL_DEPTH items; when it returns one it gets the next item not yet
    handed out, so a rank slowed down by other load computes fewer items instead of holding the
    others back (a fixed round robin makes every rank wait for the slowest one's share). Rank 0
    computes items too, whenever the next one it needs is not there and no result is waiting. No
    item is handed out `window` or more items past the one rank 0 needs next: the results rank 0
    holds are bounded by `window`. When rank 0 can only wait for the item it needs (the window is
    full, or every item is handed out) and the worker holding it has been at it LATE_FACTOR times
    rank 0's mean item time (from when it began it, behind the items queued before it: WorkerQueues),
    rank 0 computes it itself (`recompute`); the late copy is dropped when it comes,
    in this map or a later one (WorkerQueues: what each worker still has to send, over all maps).
    Which rank computes an item changes nothing in it (Task), so the results are the same."""

    def __init__(self, comm: _PointToPoint, compute: Callable[[int], Any], n: int, window: int, stats: DealStats,
                 map_id: int, queues: WorkerQueues, recompute: bool):
        self.comm, self.compute, self.n, self.window, self.stats = comm, compute, n, max(window, 1), stats
        self.map_id, self.queues, self.recompute = map_id, queues, recompute
        self.any_source = _any_source()
        self.workers = range(1, comm.Get_size())
        self.told: set[int] = set()
        self.results: dict[int, Any] = {}
        self.next_free = 1 if n else 0  # item 0 is rank 0's own: it starts on it at once
        self.own: list[int] = [0] if n else []
        self.wanted = 0  # the item rank 0 yields next
        self.own_seconds, self.own_items = 0.0, 0

    def _give(self, w: int) -> bool:
        if self.next_free < self.n and self.next_free < self.wanted + self.window:
            self.comm.send((self.map_id, self.next_free), dest=w, tag=TAG_POOL_ASSIGN)
            self.queues.given(w, (self.map_id, self.next_free))
            self.next_free += 1
            return True
        return False

    def _top_up(self) -> None:
        # near the end of the map one item per worker: what is queued on a worker when nothing is left
        # to hand out is what rank 0 waits for (it cannot take those back)
        left = self.n - self.next_free
        most = DEAL_DEPTH if left > DEAL_DEPTH * len(self.workers) else 1
        for depth in range(1, most + 1):  # in rounds: every worker gets one before any gets two
            for w in self.workers:
                if len(self.queues.held[w]) < depth:
                    self._give(w)
        if self.next_free >= self.n:  # nothing left to hand out: every worker ends this map
            for w in self.workers:
                if w not in self.told:
                    self.comm.send(None, dest=w, tag=TAG_POOL_ASSIGN)
                    self.told.add(w)

    def _take(self, msg: tuple[int, int, int, Any]) -> None:
        w, map_id, item, result = msg
        self.queues.taken(w)
        self.stats.items_by_rank[w] += 1
        if map_id != self.map_id or item < self.wanted or item in self.results:
            return  # a late copy of an item rank 0 computed itself
        self.results[item] = result
        self.stats.most_held = max(self.stats.most_held, len(self.results))

    def _wait(self, k: int) -> bool:
        """Wait for a result; False when item k is late enough to compute it here instead."""
        deadline = math.inf
        if self.recompute and self.own_items:
            deadline = self.queues.due((self.map_id, k), LATE_FACTOR * self.own_seconds / self.own_items)
        while not self.comm.iprobe(source=self.any_source, tag=TAG_POOL_ITEM):
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        self._take(self.comm.recv(source=self.any_source, tag=TAG_POOL_ITEM))
        return True

    def _run(self, item: int) -> None:
        t0 = time.monotonic()
        self.results[item] = self.compute(item)
        self.own_seconds += time.monotonic() - t0
        self.own_items += 1
        self.stats.items_by_rank[0] += 1
        self.stats.most_held = max(self.stats.most_held, len(self.results))

    def __iter__(self) -> Iterator[Any]:
        self._top_up()
        for k in range(self.n):
            self.wanted = k
            while k not in self.results:
                while self.comm.iprobe(source=self.any_source, tag=TAG_POOL_ITEM):
                    self._take(self.comm.recv(source=self.any_source, tag=TAG_POOL_ITEM))
                self._top_up()
                if k in self.results:
                    break
                if self.own:
                    self._run(self.own.pop(0))
                elif self.next_free < self.n and self.next_free < k + self.window:
                    item = self.next_free
                    self.next_free += 1
                    self._top_up()  # the last item claimed: the workers are told before rank 0 computes it
                    self._run(item)
                elif not self._wait(k):
                    self.stats.recomputed += 1
                    self._run(k)
            # every worker was told before the last result came in: nothing is left to do after the last yield
            yield self.results.pop(k)


def _drain(comm: _PointToPoint, queues: WorkerQueues) -> None:
    """Take (and drop) every result the workers still owe (late copies of items rank 0 computed
    again): before the pool closes, so that no send is left unmatched."""
    any_source = _any_source()
    while any(queues.held.values()):
        while not comm.iprobe(source=any_source, tag=TAG_POOL_ITEM):
            time.sleep(POLL_S)
        queues.taken(comm.recv(source=any_source, tag=TAG_POOL_ITEM)[0])


def _serve_items(comm: _PointToPoint, compute: Callable[[int], Any], pending: list[Any]) -> None:
    """A worker's side of one map: compute the items rank 0 hands out until it says there are none
    left. A result goes out while the next item is computed (isend); `pending`: the sends not yet
    taken, over the maps (rank 0 takes every one, dropping late copies, before the pool closes)."""
    rank = comm.Get_rank()
    while True:
        msg = comm.recv(source=0, tag=TAG_POOL_ASSIGN)
        if msg is None:
            return
        map_id, item = msg
        result = compute(item)
        pending[:] = [r for r in pending if not r.test()[0]]
        pending.append(comm.isend((rank, map_id, item, result), dest=0, tag=TAG_POOL_ITEM))


class CommSpread:
    """Items dealt on demand over the ranks of an MPI communicator (rank 0 hands them out, _Dealer),
    every rank gets every result (rank 0's broadcast of the list). All ranks call map with the same
    function and n; a rank slowed down by other load computes fewer items. Every result is kept
    (the list is the answer), so the window bounds nothing here, and nothing is computed twice: a
    map ends with every result taken."""

    def __init__(self, comm: _PointToPoint):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stats = DealStats([0] * self.size)  # on rank 0
        self.queues = WorkerQueues(range(1, self.size))  # on rank 0
        self.maps = 0

    def map(self, fn: Callable[[int], T], n: int) -> list[T]:
        if self.size == 1:
            return [fn(i) for i in range(n)]
        self.maps += 1
        got: list[T] | None = None
        if self.rank == 0:
            got = list(_Dealer(self.comm, fn, n, n, self.stats, self.maps, self.queues, recompute=False))
        else:
            pending: list[Any] = []
            _serve_items(self.comm, fn, pending)
            for r in pending:
                r.wait()
        out = self.comm.bcast(got, root=0)
        assert out is not None
        return list(out)

    def ordered(self, fn: Callable[[int], T], n: int) -> Iterator[T]:
        if self.size == 1:
            return (fn(i) for i in range(n))
        self.maps += 1
        if self.rank == 0:
            # rank 0 computes an item itself only when the one its loop needs is not there yet
            return iter(_Dealer(self.comm, fn, n, max(12, 6 * self.size), self.stats, self.maps, self.queues,
                                recompute=False))
        pending: list[Any] = []
        _serve_items(self.comm, fn, pending)
        for r in pending:
            r.wait()
        return iter(())

    def share(self, obj: T) -> T:
        return obj if self.size == 1 else self.comm.bcast(obj, root=0)


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


class RankPool:
    """Items dealt on demand over the ranks of an MPI communicator: rank 0 calls map (bcast of the
    task), the other ranks run serve() until rank 0 calls close(). Rank 0 hands out the items as the
    ranks return their last ones and computes items itself in between (_Dealer), and yields the
    results in item order. It holds at most `window` results (6 per rank, at least 12), and a
    result may be as large as a block. stats: on rank 0, what the dealing did."""

    def __init__(self, comm: _PointToPoint, context: Any):
        self.comm = comm
        self.context = context
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.window = max(12, 6 * self.size)
        self.stats = DealStats([0] * self.size)
        self.queues = WorkerQueues(range(1, self.size))  # on rank 0: the results each worker still sends
        self.maps = 0

    def map(self, task: Task[Any, T], n: int) -> Iterator[T]:
        if self.rank != 0:
            raise RuntimeError("RankPool.map runs on rank 0; the other ranks serve()")
        if self.size == 1:
            for i in range(n):
                self.stats.items_by_rank[0] += 1
                yield task(self.context, i)
            return
        self.comm.bcast((task, n), root=0)
        self.maps += 1
        yield from _Dealer(self.comm, partial(task, self.context), n, self.window, self.stats, self.maps,
                           self.queues, recompute=True)

    def serve(self) -> None:
        """On the ranks other than 0: run the items rank 0 hands out, map after map, until close()."""
        pending: list[Any] = []
        while True:
            msg = self.comm.bcast(None, root=0)
            if msg is None:
                for r in pending:  # rank 0 took them all before it closed the pool
                    r.wait()
                return
            task, _n = msg
            _serve_items(self.comm, partial(task, self.context), pending)

    def close(self) -> None:
        if self.rank == 0 and self.size > 1:
            _drain(self.comm, self.queues)
            self.comm.bcast(None, root=0)
