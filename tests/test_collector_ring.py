"""The bounded ring: drop-oldest accounting, oversized batches, producers never blocked."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpuprof.collector import schema
from gpuprof.collector.ring import MIN_CAPACITY_BYTES, Ring, split_capacity

T = schema.CLOCK_PAIRS  # 20-byte rows


def rows(start: int, n: int) -> np.ndarray:
    r = T.empty(n)
    r["monotonic_ns"] = np.arange(start, start + n)
    return r


def test_drops_oldest_and_counts() -> None:
    item = T.dtype.itemsize
    ring = Ring("t", 10 * item)
    assert ring.push(T, rows(0, 6)) == 0
    assert ring.push(T, rows(6, 6)) == 2  # 12 rows, room for 10: the 2 oldest go
    d = ring.drain()
    kept = d.batches[T.path][1]["monotonic_ns"]
    assert list(kept) == list(range(2, 12))
    assert d.dropped_total == 2 and ring.dropped_by_table() == {T.path: 2}
    assert ring.queued_bytes == 0


def test_oversized_batch_keeps_its_newest_rows() -> None:
    item = T.dtype.itemsize
    ring = Ring("t", 4 * item)
    ring.push(T, rows(0, 2))
    assert ring.push(T, rows(100, 10)) == 6 + 2
    kept = ring.drain().batches[T.path][1]["monotonic_ns"]
    assert list(kept) == [106, 107, 108, 109]
    assert ring.dropped == 8 and ring.pushed == 12


def test_tables_kept_apart_and_in_order() -> None:
    ring = Ring("t", 1 << 20)
    ring.push(T, rows(0, 3))
    e = schema.DIAG_ERRORS.empty(1)
    ring.push(schema.DIAG_ERRORS, e)
    ring.push(T, rows(3, 2))
    d = ring.drain()
    assert list(d.batches[T.path][1]["monotonic_ns"]) == [0, 1, 2, 3, 4]
    assert len(d.batches[schema.DIAG_ERRORS.path][1]) == 1


def test_concurrent_producers_lose_nothing_but_counted() -> None:
    item = T.dtype.itemsize
    ring = Ring("t", 1000 * item)
    drained: list[int] = []
    stop = threading.Event()

    def consumer() -> None:
        while not stop.is_set():
            d = ring.drain()
            drained.extend(len(r) for _, r in d.batches.values())
        d = ring.drain()
        drained.extend(len(r) for _, r in d.batches.values())

    def producer() -> None:
        for i in range(2000):
            ring.push(T, rows(i, 5))

    c = threading.Thread(target=consumer)
    c.start()
    ps = [threading.Thread(target=producer) for _ in range(4)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    stop.set()
    c.join()
    assert sum(drained) + ring.dropped == 4 * 2000 * 5
    assert ring.high_water_bytes <= ring.capacity_bytes


def test_split_capacity() -> None:
    caps = split_capacity(64, {k: 1 for k in "abcd"})
    assert caps == {k: 16 * 1024 * 1024 for k in "abcd"}
    caps = split_capacity(64, {"calls": 4, "a": 1, "b": 1, "c": 1, "d": 1})  # a source of calls: 4 shares
    assert caps["calls"] == 32 * 1024 * 1024 and caps["a"] == 8 * 1024 * 1024
    assert split_capacity(1, {f"s{i}": 1 for i in range(100)})["s7"] >= MIN_CAPACITY_BYTES
    with pytest.raises(ValueError):
        split_capacity(0, {"a": 1})
    with pytest.raises(ValueError):
        split_capacity(64, {"a": 0})
    with pytest.raises(ValueError):
        Ring("x", 0)


def test_drain_parts_keeps_each_tables_batches_as_pushed() -> None:
    """drain_parts gives each table its batches in arrival order, uncopied (the writer appends the
    busy tables' batches one by one); drain gives the same rows concatenated."""
    ring = Ring("t", 1 << 20)
    a, b, c = rows(0, 3), rows(3, 2), rows(5, 4)
    ring.push(T, a)
    ring.push(schema.DIAG_ERRORS, schema.DIAG_ERRORS.empty(1))
    ring.push(T, b)
    ring.push(T, c)
    parts = ring.drain_parts()
    table, got = parts.batches[T.path]
    assert table is T and [p is q for p, q in zip(got, (a, b, c), strict=True)] == [True, True, True]
    assert len(parts.batches[schema.DIAG_ERRORS.path][1]) == 1
    assert ring.drain_parts().batches == {}  # taken
    for r in (a, b, c):
        ring.push(T, r)
    assert list(ring.drain().batches[T.path][1]["monotonic_ns"]) == list(range(9))
