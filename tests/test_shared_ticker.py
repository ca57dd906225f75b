"""The native ticks that share one thread (collector/native/ticker.c, gp_multi_tick), driven here
with ticks written in Python (ctypes callbacks of the C tick type)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gpuprof.collector import native


@contextmanager
def counting_tickers(*intervals_s: float) -> Iterator[tuple[list[native.SharedTicker], list[list[int]]]]:
    """One SharedTicker per interval, each tick appending the id of the thread it ran on to its
    list; all stopped (and their threads left) when the block ends."""
    seen: list[list[int]] = [[] for _ in intervals_s]

    def tick_into(out: list[int]) -> object:
        def tick(state: int | None, now_ns: int) -> None:
            out.append(threading.get_native_id())

        return native.TICK_FN(tick)

    fns = [tick_into(out) for out in seen]  # kept alive while the C thread may call them
    tickers = [native.SharedTicker(native.sampler(), fn, None, s) for fn, s in zip(fns, intervals_s, strict=True)]
    try:
        yield tickers, seen
    finally:
        for t in tickers:
            t.stop(2.0)


def comm(tid: int) -> str | None:
    try:
        return open(f"/proc/self/task/{tid}/comm").read().strip()
    except FileNotFoundError:
        return None


def test_ticks_of_one_interval_share_a_named_thread_and_leave_it_one_by_one() -> None:
    with counting_tickers(0.05, 0.05) as ((a, b), (a_seen, b_seen)):
        time.sleep(0.5)
        assert len(a_seen) >= 5 and len(b_seen) >= 5, (len(a_seen), len(b_seen))
        tids = set(a_seen) | set(b_seen)
        assert len(tids) == 1, tids  # one thread runs both
        tid = tids.pop()
        assert tid != threading.get_native_id() and comm(tid) == "gp-tick-50ms"
        assert a.stop(2.0)
        after_stop = len(a_seen)
        time.sleep(0.3)
        assert len(a_seen) == after_stop  # out of the rounds once stop returned
        n = len(b_seen)
        time.sleep(0.3)
        assert len(b_seen) > n  # the other tick goes on
    deadline = time.monotonic() + 2
    while comm(tid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert comm(tid) is None  # the last one out stopped the thread
    assert a.reap() and b.reap()


def test_a_stuck_tick_is_given_up_and_reaped_once_it_returns() -> None:
    lib = native.sampler()
    release, inside = threading.Event(), threading.Event()

    def stuck(state: int | None, now_ns: int) -> None:
        inside.set()
        release.wait(10)

    fn = native.TICK_FN(stuck)
    t = native.SharedTicker(lib, fn, None, 0.03)
    try:
        assert inside.wait(2)
        t0 = time.monotonic()
        assert not t.stop(0.2)  # the round does not end: given up after the timeout
        assert 0.15 <= time.monotonic() - t0 < 2
        assert not t.reap()  # still inside
        release.set()
        deadline = time.monotonic() + 2
        while not t.reap() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert t.reap()
    finally:
        release.set()
        t.stop(2.0)


def test_ticks_of_another_interval_run_on_a_thread_of_their_own() -> None:
    with counting_tickers(0.05, 0.07) as (_, (seen_a, seen_b)):
        time.sleep(0.4)
    assert seen_a and seen_b and set(seen_a).isdisjoint(seen_b)
