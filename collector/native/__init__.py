"""Native hot paths of the collector, built by `make -C collector/native` (make setup) and loaded
with ctypes. Each user keeps its Python path for when the library is not built: the host source
records which ran (/host/procs attribute `reader`, docs/collector.md); the fast path's drain gives
the same rows either way (tests/test_fastpath.py runs both)."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np

LIBRARY = Path(__file__).resolve().parent / "build" / "libgpuprof_sampler.so"

# struct gp_proc_fds, gp_thread_fds and gp_proc_row of procsample.c
PROC_FDS_DTYPE = np.dtype([("pid", "<i4"), ("stat_fd", "<i4"), ("io_fd", "<i4"), ("first_thread", "<i4"),
                           ("n_threads", "<i4"), ("pad", "<i4")])
THREAD_FDS_DTYPE = np.dtype([("tid", "<i4"), ("status_fd", "<i4"), ("schedstat_fd", "<i4"), ("gone", "<i4"),
                             ("last_runtime_ns", "<u8"), ("last_vol", "<u8"), ("last_invol", "<u8")])
PROC_ROW_DTYPE = np.dtype([("cpu_ticks", "<u8"), ("rss_pages", "<u8"), ("vol_ctxsw", "<u8"), ("invol_ctxsw", "<u8"),
                           ("read_bytes", "<u8"), ("write_bytes", "<u8"), ("threads", "<u4"), ("threads_read", "<u4"),
                           ("status", "<i4"), ("pad", "<i4")])


class NativeUnavailable(Exception):
    """The library is not built, or was built from other sources than this Python expects."""


@lru_cache(maxsize=1)
def sampler() -> ctypes.CDLL:
    if not LIBRARY.exists():
        raise NativeUnavailable(f"{LIBRARY} not built (make -C collector/native)")
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError as e:
        raise NativeUnavailable(f"{LIBRARY}: {e}") from None
    sizes = [ctypes.c_int(), ctypes.c_int(), ctypes.c_int()]
    lib.gp_proc_layout(*(ctypes.byref(x) for x in sizes))
    want = [PROC_FDS_DTYPE.itemsize, THREAD_FDS_DTYPE.itemsize, PROC_ROW_DTYPE.itemsize]
    if [x.value for x in sizes] != want:
        raise NativeUnavailable(f"{LIBRARY}: struct sizes {[x.value for x in sizes]} differ from {want}: rebuild it")
    lib.gp_sample_procs.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.gp_sample_procs.restype = ctypes.c_int
    lib.gp_records_to_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_uint8, ctypes.c_uint8,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.gp_records_to_rows.restype = ctypes.c_long
    return lib


def check_ring_layout(lib: ctypes.CDLL, record_size: int, row_dtype: np.dtype) -> None:
    """ringrows.c was built from the ring and row layouts this Python uses (else NativeUnavailable)."""
    rec, row = ctypes.c_int(), ctypes.c_int()
    lib.gp_ring_layout(ctypes.byref(rec), ctypes.byref(row))
    if (rec.value, row.value) != (record_size, row_dtype.itemsize):
        raise NativeUnavailable(f"{LIBRARY}: ring record/row sizes {rec.value}/{row.value} differ from "
                                f"{record_size}/{row_dtype.itemsize}: rebuild it")
