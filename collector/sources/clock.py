"""(CLOCK_MONOTONIC, CLOCK_REALTIME) pairs: at start, every clock_interval_s, and at the end.

Why the two reads are bracketed by monotonic reads: the realtime read is known to lie between
them, so half their distance is an honest bound on how well the pair ties the two clocks; on an
idle core it is tens of nanoseconds, and a pair taken across a preemption says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from gpuprof.collector import schema
from gpuprof.collector.sources.base import Batch, Source, SourceContext

_ATTEMPTS = 3


def clock_pair() -> tuple[int, int, int]:
    """(monotonic_ns, realtime_ns, uncertainty_ns): the tightest of a few bracketed reads."""
    best: tuple[int, int, int] | None = None
    for _ in range(_ATTEMPTS):
        m0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        r = time.clock_gettime_ns(time.CLOCK_REALTIME)
        m1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        cand = ((m0 + m1) // 2, r, (m1 - m0 + 1) // 2)
        if best is None or cand[2] < best[2]:
            best = cand
    assert best is not None
    return best


class ClockSource(Source):
    name = "clock"
    tables = (schema.CLOCK_PAIRS,)
    shares_drain_thread = True

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s

    def start(self, ctx: SourceContext) -> None:
        pass

    def sample(self, now_ns: int) -> Iterable[Batch]:
        rows = schema.CLOCK_PAIRS.empty(1)
        rows[0] = clock_pair()
        return [(schema.CLOCK_PAIRS, rows)]
