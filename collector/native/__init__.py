"""Native hot paths of the collector, built by `make -C collector/native` (make setup) and loaded
with ctypes. Each user keeps its Python path for when the library is not built: the host source
records which ran (/host/procs attribute `reader`, docs/collector.md); the fast path's drain gives
the same rows either way (tests/test_fastpath.py runs both)."""

from __future__ import annotations

import ctypes
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

LIBRARY = Path(__file__).resolve().parent / "build" / "libgpuprof_sampler.so"

# struct gp_proc_fds, gp_thread_fds and gp_proc_row of procsample.c
PROC_FDS_DTYPE = np.dtype([("pid", "<i4"), ("stat_fd", "<i4"), ("io_fd", "<i4"), ("first_thread", "<i4"),
                           ("n_threads", "<i4"), ("last_threads", "<u4"), ("last_full_ns", "<u8"),
                           ("last_cpu_ns", "<u8"), ("last_rss_pages", "<u8"), ("last_read_bytes", "<u8"),
                           ("last_write_bytes", "<u8"), ("unlisted_runtime_ns", "<u8"), ("exited_vol", "<u8"),
                           ("exited_invol", "<u8")])
# what the reader keeps per process between calls: carried over when the caller relists
PROC_FDS_KEPT = ("last_threads", "last_full_ns", "last_cpu_ns", "last_rss_pages", "last_read_bytes",
                 "last_write_bytes", "unlisted_runtime_ns", "exited_vol", "exited_invol")
THREAD_FDS_DTYPE = np.dtype([("tid", "<i4"), ("status_fd", "<i4"), ("schedstat_fd", "<i4"), ("gone", "<i4"),
                             ("last_runtime_ns", "<u8"), ("first_runtime_ns", "<u8"), ("status_runtime_ns", "<u8"),
                             ("last_vol", "<u8"), ("last_invol", "<u8"), ("moved_ns", "<u8")])
THREAD_FDS_KEPT = ("last_runtime_ns", "first_runtime_ns", "status_runtime_ns", "last_vol", "last_invol", "moved_ns")
NO_RUNTIME = np.iinfo(np.uint64).max  # a thread's run time not read yet (procsample.h)
PROC_ROW_DTYPE = np.dtype([("cpu_ns", "<u8"), ("rss_pages", "<u8"), ("vol_ctxsw", "<u8"), ("invol_ctxsw", "<u8"),
                           ("read_bytes", "<u8"), ("write_bytes", "<u8"), ("threads", "<u4"), ("threads_read", "<u4"),
                           ("status", "<i4"), ("pad", "<i4")])
# struct gp_host_node_row and gp_host_proc_row of hosttick.c: what a tick leaves for the drain
HOST_NODE_ROW_DTYPE = np.dtype([("t_ns", "<u8"), ("cpu_busy", "<f8"), ("cpu_iowait", "<f8"), ("mem_used_kb", "<u8"),
                                ("mem_total_kb", "<u8"), ("net_rx", "<u8"), ("net_tx", "<u8"), ("load1", "<f8"),
                                ("status", "<i4"), ("pad", "<i4")])
HOST_PROC_ROW_DTYPE = np.dtype([("t_ns", "<u8"), ("pid", "<i4"), ("threads", "<u4"), ("cpu_ns", "<u8"),
                                ("rss_pages", "<u8"), ("vol_ctxsw", "<u8"), ("invol_ctxsw", "<u8"),
                                ("read_bytes", "<u8"), ("write_bytes", "<u8")])
HOST_PROC_STALE, HOST_PROC_GONE = 1, 2  # hosttick.c's per-process flags
# struct gp_ringwatch_ring of ringwatch.c: one ring the fast path's watch looks at
RINGWATCH_DTYPE = np.dtype([("fd", "<i4"), ("pad", "<u4"), ("threshold", "<u8")])
# ringwatch.c's and mapwatch.c's wake(): called on the ticker's thread (ctypes takes the GIL for it)
WAKE_FN = ctypes.CFUNCTYPE(None)
# ticker.c's gp_tick_fn: void tick(void *state, uint64_t now_ns)
TICK_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64)
# nvmltick.c's rows: /gpu/samples values in schema column order, GPM, events, failed calls
NVML_COLS, NVML_GPM_COLS, NVML_FIELDS = 14, 4, 6
NVML_SAMPLE_ROW_DTYPE = np.dtype([("t_ns", "<u8"), ("gpu", "<i4"), ("pad", "<i4"), ("v", "<f8", (NVML_COLS,))])
NVML_GPM_ROW_DTYPE = np.dtype([("t_ns", "<u8"), ("gpu", "<i4"), ("pad", "<i4"), ("interval_ns", "<u8"),
                               ("v", "<f8", (NVML_GPM_COLS,))])
NVML_EVENT_ROW_DTYPE = np.dtype([("t_ns", "<u8"), ("gpu", "<i4"), ("kind", "<u4"), ("value", "<u8")])
NVML_ERROR_ROW_DTYPE = np.dtype([("t_ns", "<u8"), ("gpu", "<i4"), ("metric", "<i4"), ("code", "<i4"),
                                 ("pad", "<i4")])
# struct gp_nvml_fns, in order
NVML_FUNCTIONS = ("util", "memory", "power", "temperature", "clock", "reasons", "fields", "gpm_sample_get",
                  "gpm_metrics_get", "event_wait")
NVML_METRIC_COUNT = 21  # nvmltick.c's N_METRICS


class NativeUnavailable(Exception):
    """The library is not built, or was built from other sources than this Python expects."""


@lru_cache(maxsize=1)
def sampler() -> ctypes.CDLL:
    if not LIBRARY.exists():
        raise NativeUnavailable(f"{LIBRARY} not built (make -C collector/native)")
    try:
        lib = ctypes.CDLL(str(LIBRARY), use_errno=True)
    except OSError as e:
        raise NativeUnavailable(f"{LIBRARY}: {e}") from None
    sizes = [ctypes.c_int(), ctypes.c_int(), ctypes.c_int()]
    lib.gp_proc_layout(*(ctypes.byref(x) for x in sizes))
    want = [PROC_FDS_DTYPE.itemsize, THREAD_FDS_DTYPE.itemsize, PROC_ROW_DTYPE.itemsize]
    if [x.value for x in sizes] != want:
        raise NativeUnavailable(f"{LIBRARY}: struct sizes {[x.value for x in sizes]} differ from {want}: rebuild it")
    host = [ctypes.c_int(), ctypes.c_int()]
    lib.gp_host_layout(*(ctypes.byref(x) for x in host))
    if [x.value for x in host] != [HOST_NODE_ROW_DTYPE.itemsize, HOST_PROC_ROW_DTYPE.itemsize]:
        raise NativeUnavailable(f"{LIBRARY}: host row sizes {[x.value for x in host]} differ: rebuild it")
    nv = (ctypes.c_int * 7)()
    lib.gp_nvml_layout(nv)
    want_nv = [8 * len(NVML_FUNCTIONS), NVML_FIELDS, NVML_SAMPLE_ROW_DTYPE.itemsize, NVML_GPM_ROW_DTYPE.itemsize,
               NVML_EVENT_ROW_DTYPE.itemsize, NVML_ERROR_ROW_DTYPE.itemsize, NVML_METRIC_COUNT]
    if list(nv) != want_nv:
        raise NativeUnavailable(f"{LIBRARY}: NVML layout {list(nv)} differs from {want_nv}: rebuild it")
    try:
        _declare(lib)
    except AttributeError as e:  # a function this Python calls is not in it
        raise NativeUnavailable(f"{LIBRARY}: {e}: built from older sources, rebuild it") from None
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The argument and result types of the library's functions."""
    vp, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    lib.gp_ticker_start.argtypes = [i64, vp, vp, ctypes.c_char_p]
    lib.gp_ticker_start.restype = vp
    lib.gp_ticker_stop.argtypes = [vp, i64]
    lib.gp_ticker_stop.restype = ctypes.c_int
    lib.gp_ticker_reap.argtypes = [vp]
    lib.gp_ticker_reap.restype = ctypes.c_int
    lib.gp_multi_new.argtypes = []
    lib.gp_multi_new.restype = vp
    lib.gp_multi_free.argtypes = [vp]
    lib.gp_multi_free.restype = None
    lib.gp_multi_add.argtypes = [vp, vp, vp]
    lib.gp_multi_add.restype = vp
    lib.gp_multi_remove.argtypes = [vp, vp, i64]
    lib.gp_multi_remove.restype = ctypes.c_int
    lib.gp_multi_reap.argtypes = [vp, vp]
    lib.gp_multi_reap.restype = ctypes.c_int
    lib.gp_multi_empty.argtypes = [vp]
    lib.gp_multi_empty.restype = ctypes.c_int
    lib.gp_host_new.argtypes = [ctypes.c_int, u64]
    lib.gp_host_new.restype = vp
    lib.gp_host_tick.argtypes = [vp, u64]
    lib.gp_host_tick.restype = None
    for name in ("gp_host_lock", "gp_host_unlock", "gp_host_free"):
        getattr(lib, name).argtypes = [vp]
        getattr(lib, name).restype = None
    lib.gp_host_set_procs.argtypes = [vp, vp, ctypes.c_int, vp]
    lib.gp_host_set_procs.restype = ctypes.c_int
    lib.gp_host_drain.argtypes = [vp, vp, vp, vp, vp, vp]
    lib.gp_host_drain.restype = None
    lib.gp_nvml_new.argtypes = [vp, ctypes.c_int, vp, ctypes.c_int, vp, ctypes.c_int, ctypes.c_int32]
    lib.gp_nvml_new.restype = vp
    lib.gp_nvml_set_gpu.argtypes = [vp, ctypes.c_int, vp, ctypes.c_int32, vp, vp, vp, vp, vp, vp, ctypes.c_uint32]
    lib.gp_nvml_set_gpu.restype = None
    lib.gp_nvml_skip_gpu.argtypes = [vp, ctypes.c_int, u64]
    lib.gp_nvml_skip_gpu.restype = None
    lib.gp_nvml_current_call.argtypes = [vp, vp, vp]
    lib.gp_nvml_current_call.restype = u64
    lib.gp_nvml_tick.argtypes = [vp, u64]
    lib.gp_nvml_tick.restype = None
    lib.gp_nvml_drain.argtypes = [vp, vp, vp, vp, vp, vp]
    lib.gp_nvml_drain.restype = None
    lib.gp_nvml_capacities.argtypes = [vp, vp]
    lib.gp_nvml_capacities.restype = None
    for name in ("gp_nvml_abandon", "gp_nvml_free"):
        getattr(lib, name).argtypes = [vp]
        getattr(lib, name).restype = None
    lib.gp_ringwatch_new.argtypes = [ctypes.c_int, WAKE_FN]
    lib.gp_ringwatch_new.restype = vp
    lib.gp_ringwatch_set.argtypes = [vp, vp, ctypes.c_int, ctypes.c_int]
    lib.gp_ringwatch_set.restype = ctypes.c_int
    lib.gp_ringwatch_counts.argtypes = [vp, vp]
    lib.gp_ringwatch_counts.restype = None
    lib.gp_ringwatch_free.argtypes = [vp]
    lib.gp_ringwatch_free.restype = None
    lib.gp_mapwatch_new.argtypes = [ctypes.c_int, WAKE_FN]
    lib.gp_mapwatch_new.restype = vp
    for name in ("gp_mapwatch_ack", "gp_mapwatch_free"):
        getattr(lib, name).argtypes = [vp]
        getattr(lib, name).restype = None
    lib.gp_mapwatch_wakes.argtypes = [vp]
    lib.gp_mapwatch_wakes.restype = u64
    lib.gp_stacks_take.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long, vp, ctypes.c_long, vp, ctypes.c_long,
                                   vp, ctypes.c_long, vp, vp]
    lib.gp_stacks_take.restype = ctypes.c_long
    lib.gp_cfi_stacks_take.argtypes = [ctypes.c_int, ctypes.c_long, vp, ctypes.c_long, vp, ctypes.c_long, vp, vp, vp]
    lib.gp_cfi_stacks_take.restype = ctypes.c_long
    lib.gp_records_to_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_uint8, ctypes.c_uint8,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.gp_records_to_rows.restype = ctypes.c_long
    lib.gp_shuffle.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_size_t]
    lib.gp_shuffle.restype = None


def check_ring_layout(lib: ctypes.CDLL, record_size: int, row_dtype: np.dtype) -> None:
    """ringrows.c was built from the ring and row layouts this Python uses (else NativeUnavailable)."""
    rec, row = ctypes.c_int(), ctypes.c_int()
    lib.gp_ring_layout(ctypes.byref(rec), ctypes.byref(row))
    if (rec.value, row.value) != (record_size, row_dtype.itemsize):
        raise NativeUnavailable(f"{LIBRARY}: ring record/row sizes {rec.value}/{row.value} differ from "
                                f"{record_size}/{row_dtype.itemsize}: rebuild it")


def check_ringwatch_layout(lib: ctypes.CDLL, head_offset: int, tail_offset: int) -> None:
    """ringwatch.c was built from the ring header this Python reads (else NativeUnavailable)."""
    got = [ctypes.c_int(), ctypes.c_int(), ctypes.c_int()]
    lib.gp_ringwatch_layout(*(ctypes.byref(x) for x in got))
    want = [RINGWATCH_DTYPE.itemsize, head_offset, tail_offset]
    if [x.value for x in got] != want:
        raise NativeUnavailable(f"{LIBRARY}: ring watch layout {[x.value for x in got]} differs from {want}: "
                                "rebuild it")


class NativeTick:
    """The stop/reap contract of a C tick function run by a native thread (Ticker, SharedTicker):
    stop() takes the tick out within a timeout; when its thread is stuck inside the tick (a wedged
    driver call), the tick is left detached, its state must not be freed, and reap() says when it
    has left. Subclasses say how a handle is released and reaped."""

    def __init__(self, lib: ctypes.CDLL, handle: int) -> None:
        self._lib = lib
        self._handle: int | None = handle
        self._detached: int | None = None  # stopped while stuck in a tick: reaped once it left

    def _release(self, handle: int, timeout_ns: int) -> bool:
        """Take the tick out; False when its thread did not leave the tick within the timeout."""
        raise NotImplementedError

    def _reap(self, handle: int) -> bool:
        """Whether a detached tick's thread has left it (then it is released)."""
        raise NotImplementedError

    def _released(self) -> None:
        """After the tick is out for good (its state is the caller's again)."""

    def stop(self, timeout_s: float) -> bool:
        """True when the tick is out (its thread exited or left the rounds); False when it is stuck
        in a tick (then detached: its state must not be freed before reap() says it has left)."""
        if self._handle is None:
            return True
        handle, self._handle = self._handle, None
        if not self._release(handle, int(timeout_s * 1e9)):
            self._detached = handle
            return False
        self._released()
        return True

    def reap(self) -> bool:
        """After a stop() that returned False: True once the stuck tick has been left (its state
        may then be freed)."""
        if self._detached is None:
            return True
        if not self._reap(self._detached):
            return False
        self._detached = None
        self._released()
        return True


class Ticker(NativeTick):
    """A native thread calling a C tick function of this library on the collector's tick grid
    (ticker.c): the 10 Hz loop of a source without Python wake-ups."""

    def __init__(self, lib: ctypes.CDLL, tick: str, state: int, interval_s: float, name: str) -> None:
        """`name`: the thread's kernel name, as top -H and perf show it (collector/osthread.py)."""
        fn = ctypes.cast(getattr(lib, tick), ctypes.c_void_p).value
        ptr = lib.gp_ticker_start(round(interval_s * 1e9), fn, state, name.encode())
        if not ptr:
            err = ctypes.get_errno()
            raise NativeUnavailable(f"cannot start the {tick} thread: {os.strerror(err) if err else 'failed'}")
        super().__init__(lib, ptr)

    def _release(self, handle: int, timeout_ns: int) -> bool:
        return int(self._lib.gp_ticker_stop(handle, timeout_ns)) == 0  # the thread exited

    def _reap(self, handle: int) -> bool:
        return int(self._lib.gp_ticker_reap(handle)) == 0


# The shared rounds (SharedTicker): interval in ns -> [its gp_multi, the Ticker running it]
_rounds: dict[int, list[Any]] = {}
_rounds_lock = threading.Lock()
ROUND_STOP_TIMEOUT_S = 2.0


class SharedTicker(NativeTick):
    """A C tick function of this library run with the others of the same interval on one native
    thread, `gp-tick-<ms>ms` (ticker.c, gp_multi_tick): the host tick, the fast path's ring watch
    and the CFI map watch, all at 10 Hz, wake one thread instead of three (docs/collector.md,
    "Wake-ups, idle threads and the writer's appends"). The stop/reap contract of NativeTick:
    out of the rounds, and the last tick out stops the thread. A tick that can wedge (an NVML call) gets a Ticker of its own instead, so that it
    never holds the others back."""

    def __init__(self, lib: ctypes.CDLL, tick: str | Any, state: int | None, interval_s: float) -> None:
        """tick: the name of a C tick function of lib, or a ctypes function of the same type
        (TICK_FN; the tests' ticks)."""
        self._key = round(interval_s * 1e9)
        fn = ctypes.cast(getattr(lib, tick) if isinstance(tick, str) else tick, ctypes.c_void_p).value
        with _rounds_lock:
            r = _rounds.get(self._key)
            if r is None:
                m = lib.gp_multi_new()
                if not m:
                    raise NativeUnavailable("cannot allocate the shared tick rounds")
                try:
                    ticker = Ticker(lib, "gp_multi_tick", m, interval_s, f"gp-tick-{self._key // 1_000_000}ms")
                except NativeUnavailable:
                    lib.gp_multi_free(m)
                    raise
                r = _rounds[self._key] = [m, ticker]
            entry = lib.gp_multi_add(r[0], fn, state)
            if not entry:
                raise NativeUnavailable(f"cannot add {tick} to the shared tick thread")
        self._m: int = r[0]
        super().__init__(lib, entry)

    def _release(self, handle: int, timeout_ns: int) -> bool:
        return int(self._lib.gp_multi_remove(self._m, handle, timeout_ns)) == 0  # the round ended in time

    def _reap(self, handle: int) -> bool:
        return int(self._lib.gp_multi_reap(self._m, handle)) == 0

    def _released(self) -> None:
        """The last tick out of a round stops its thread and frees the round."""
        with _rounds_lock:
            r = _rounds.get(self._key)
            if r is None or r[0] != self._m or not self._lib.gp_multi_empty(self._m):
                return
            del _rounds[self._key]
            if r[1].stop(ROUND_STOP_TIMEOUT_S):
                self._lib.gp_multi_free(self._m)
            # else the thread did not stop in time (stuck in a round: not with no entries) and
            # keeps m, never freed
