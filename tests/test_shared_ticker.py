"""The native ticks that share one thread (collector/native/ticker.c, gp_multi_tick), driven here
with ticks written in Python (ctypes callbacks of the C tick type)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpuprof.collector import native


def counting_tick(seen: list[int]) -> tuple[object, Callable[[], int]]:
    def tick(state: int | None, now_ns: int) -> None:
        seen.append(threading.get_native_id())

    fn = native.TICK_FN(tick)
    return fn, lambda: len(seen)


def comm(tid: int) -> str | None:
    try:
        return open(f"/proc/self/task/{tid}/comm").read().strip()
    except FileNotFoundError:
        return None


def test_ticks_of_one_interval_share_a_named_thread_and_leave_it_one_by_one() -> None:
    lib = native.sampler()
    a_seen: list[int] = []
    b_seen: list[int] = []
    a_fn, a_count = counting_tick(a_seen)
    b_fn, b_count = counting_tick(b_seen)
    a = native.SharedTicker(lib, a_fn, None, 0.05)
    b = native.SharedTicker(lib, b_fn, None, 0.05)
    try:
        time.sleep(0.5)
        assert a_count() >= 5 and b_count() >= 5, (a_count(), b_count())
        tids = set(a_seen) | set(b_seen)
        assert len(tids) == 1, tids  # one thread runs both
        tid = tids.pop()
        assert tid != threading.get_native_id() and comm(tid) == "gp-tick-50ms"
        assert a.stop(2.0)
        after_stop = a_count()
        time.sleep(0.3)
        assert a_count() == after_stop  # out of the rounds once stop returned
        n = b_count()
        time.sleep(0.3)
        assert b_count() > n  # the other tick goes on
    finally:
        a.stop(2.0)
        b.stop(2.0)
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
    lib = native.sampler()
    seen_a: list[int] = []
    seen_b: list[int] = []
    a_fn, _ = counting_tick(seen_a)
    b_fn, _ = counting_tick(seen_b)
    a = native.SharedTicker(lib, a_fn, None, 0.05)
    b = native.SharedTicker(lib, b_fn, None, 0.07)
    try:
        time.sleep(0.4)
    finally:
        a.stop(2.0)
        b.stop(2.0)
    assert seen_a and seen_b and set(seen_a).isdisjoint(seen_b)
