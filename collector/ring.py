"""A bounded, per-source ring of record batches between a source's thread and the writer thread.

Why batches and not rows: a source produces one numpy structured array per table per sample, and the
writer appends whole arrays; keeping them as arrays means no per-row Python work on either side.
Why drop the oldest: when the writer falls behind (slow disk, stalled filesystem), the newest data is
the most useful for the end of the job, and the producer must never wait (it may be on a hot path).
Every dropped row is counted per table so the file can say what it lost.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from gpuprof.collector.schema import Table, concat_rows

MIN_CAPACITY_BYTES = 64 * 1024


@dataclass
class Drained:
    """What one drain returns: rows per table path (each one array), and the drop totals so far."""

    batches: dict[str, tuple[Table, np.ndarray]]
    dropped_total: int


@dataclass
class DrainedParts:
    """What one drain returns, batch by batch: per table path, its batches in arrival order."""

    batches: dict[str, tuple[Table, list[np.ndarray]]]
    dropped_total: int


class Ring:
    """Bounded FIFO of (table, rows) batches, capacity in bytes of row data.

    Thread-safe for one or more producers and one consumer; `push` holds the lock only for a few
    list operations, so it never waits on the writer.
    """

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"ring {name}: capacity must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self._lock = threading.Lock()
        self._q: deque[tuple[Table, np.ndarray]] = deque()
        self._bytes = 0
        self._dropped = 0
        self._dropped_by_table: dict[str, int] = {}
        self._pushed = 0
        self._high_water = 0

    def push(self, table: Table, rows: np.ndarray) -> int:
        """Add rows; returns how many rows (old or, for an oversized batch, its own oldest) were dropped."""
        n = len(rows)
        if n == 0:
            return 0
        dropped = 0
        with self._lock:
            self._pushed += n
            if rows.nbytes > self.capacity_bytes:
                # A batch larger than the ring: keep its newest rows that fit, after emptying the ring.
                keep = max(1, self.capacity_bytes // max(1, rows.itemsize))
                dropped += self._drop_rows(table, n - keep)
                rows = rows[n - keep:]
            self._q.append((table, rows))
            self._bytes += rows.nbytes
            while self._bytes > self.capacity_bytes and len(self._q) > 1:
                dropped += self._evict_oldest()
            if len(self._q) == 1 and self._bytes > self.capacity_bytes:
                dropped += self._evict_oldest()
            self._high_water = max(self._high_water, self._bytes)
        return dropped

    def _drop_rows(self, table: Table, k: int) -> int:
        self._dropped += k
        self._dropped_by_table[table.path] = self._dropped_by_table.get(table.path, 0) + k
        return k

    def _evict_oldest(self) -> int:
        """Drop rows from the oldest batch until the ring fits (the lock is held)."""
        table, rows = self._q[0]
        excess = self._bytes - self.capacity_bytes
        per_row = max(1, rows.itemsize)
        k = min(len(rows), -(-excess // per_row))  # ceil: drop just enough whole rows
        if k >= len(rows):
            self._q.popleft()
        else:
            self._q[0] = (table, rows[k:])
        self._bytes -= k * rows.itemsize
        return self._drop_rows(table, k)

    def drain(self) -> Drained:
        """Take everything queued, concatenated per table, in arrival order."""
        parts = self.drain_parts()
        return Drained({p: (table, concat_rows(rows)) for p, (table, rows) in parts.batches.items()},
                       parts.dropped_total)

    def drain_parts(self) -> DrainedParts:
        """Take everything queued, the batches of each table as they were pushed, in arrival order
        (the writer appends the busy tables' batches one by one rather than copy them together)."""
        with self._lock:
            items = list(self._q)
            self._q.clear()
            self._bytes = 0
            dropped = self._dropped
        grouped: dict[str, tuple[Table, list[np.ndarray]]] = {}
        for table, rows in items:
            grouped.setdefault(table.path, (table, []))[1].append(rows)
        return DrainedParts(grouped, dropped)

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    def dropped_by_table(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped_by_table)

    @property
    def pushed(self) -> int:
        with self._lock:
            return self._pushed

    @property
    def queued_bytes(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def high_water_bytes(self) -> int:
        with self._lock:
            return self._high_water


def split_capacity(memory_limit_mb: int, shares: dict[str, int]) -> dict[str, int]:
    """Split collector.memory_limit_mb over the rings in proportion to their shares (each at least
    MIN_CAPACITY_BYTES).

    A split is deliberate: a source that floods its ring loses its own oldest rows and cannot take
    memory from the others. The shares are not even: the sources of calls take a share of
    CALL_SOURCE_SHARE (Source.ring_share), since a call-intensive code (MEEP, 250k calls a second
    on a node of 2 ranks: 20 MB of rows a second) filled an even share (7.1 MB of 64 with the
    default modes) between two drains of a late writer: a call source now holds 17 MB, the others
    4.3 MB each."""
    if memory_limit_mb <= 0:
        raise ValueError(f"collector.memory_limit_mb must be positive, got {memory_limit_mb}")
    if not shares:
        return {}
    if any(share <= 0 for share in shares.values()):
        raise ValueError(f"ring shares must be positive: {shares}")
    total = sum(shares.values())
    budget = memory_limit_mb * 1024 * 1024
    return {name: max(MIN_CAPACITY_BYTES, budget * share // total) for name, share in shares.items()}
