"""Host metrics from /proc: node CPU, memory, network, load; per job process CPU, RSS, threads,
context switches and I/O bytes.

Why file descriptors are kept open: /proc files regenerate their text on every read at offset 0,
so one `pread` on a descriptor opened once costs a fraction of open+read+close; at 10 Hz over
dozens of processes this is most of the source's cost. A descriptor of a process that exited
fails with ESRCH, which is how we notice it is gone.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from collector import native, schema
from collector.sources.base import Batch, Source, SourceContext, SourceUnavailable

# /proc/PID/io is readable only by the owner or root; an unreadable counter is this value (the
# column is an unsigned integer, so it cannot hold NaN) and a /diagnostics/missing row says why.
UNAVAILABLE_U64 = np.iinfo(np.uint64).max

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_NS_PER_TICK = 1_000_000_000 // _CLK_TCK
# Table.dtype builds a numpy dtype on every access (~4 us): taken once here.
_NODE_DT = schema.HOST_NODE.dtype
_PROCS_DT = schema.HOST_PROCS.dtype
_EMPTY_PROCS = np.zeros(0, dtype=_PROCS_DT)


class _Fd:
    """A /proc file opened once and re-read with pread."""

    __slots__ = ("fd",)

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def read(self, size: int = 4096) -> bytes:
        return os.pread(self.fd, size, 0)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class _Proc:
    __slots__ = ("io", "io_missing", "pid", "stat", "status", "thread_fds", "thread_status", "threads")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stat = _Fd(f"/proc/{pid}/stat")
        self.status = _Fd(f"/proc/{pid}/status")
        self.io: _Fd | None
        self.io_missing = ""
        try:
            self.io = _Fd(f"/proc/{pid}/io")
        except PermissionError:
            self.io = None
            self.io_missing = "EACCES reading /proc/PID/io (collector not root?)"
        except FileNotFoundError:
            self.io = None
            self.io_missing = "kernel without task I/O accounting (/proc/PID/io absent)"
        self.threads = 0
        self.thread_status: dict[int, _Fd] = {}  # Python path: each thread's status
        # C path: (status, schedstat) of each thread, None where it could not be opened
        self.thread_fds: dict[int, tuple[_Fd | None, _Fd | None]] = {}

    def list_threads(self) -> None:
        """(Re)open the descriptors of the C path for the threads /proc/PID/task lists now."""
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{self.pid}/task")}
        except OSError:
            tids = set()
        for tid in [t for t in self.thread_fds if t not in tids]:
            for f in self.thread_fds.pop(tid):
                if f is not None:
                    f.close()
        for tid in tids - self.thread_fds.keys():
            self.thread_fds[tid] = (_open_or_none(f"/proc/{self.pid}/task/{tid}/status"),
                                    _open_or_none(f"/proc/{self.pid}/task/{tid}/schedstat"))

    def close(self) -> None:
        for f in (self.stat, self.status, self.io, *self.thread_status.values(),
                  *(x for pair in self.thread_fds.values() for x in pair)):
            if f is not None:
                f.close()
        self.thread_status.clear()
        self.thread_fds.clear()


def _open_or_none(path: str) -> _Fd | None:
    """None when the file cannot be opened: out of descriptors (the C reader then opens the status
    by path at each read), a kernel without schedstat, or a thread that just exited."""
    try:
        return _Fd(path)
    except OSError:
        return None


def _ctxsw(status: bytes) -> tuple[int, int]:
    i = status.find(b"\nvoluntary_ctxt_switches:")
    j = status.find(b"\nnonvoluntary_ctxt_switches:")
    if i < 0 or j < 0:
        return 0, 0
    v = int(status[i + 25: status.find(b"\n", i + 1)])
    n = int(status[j + 28: status.find(b"\n", j + 1)])
    return v, n


class HostSource(Source):
    name = "host"
    tables = (schema.HOST_NODE, schema.HOST_PROCS)

    def __init__(self, rate_hz: float = 10.0) -> None:
        self.interval_s = 1.0 / rate_hz
        self._procs: dict[int, _Proc] = {}
        self._prev_cpu: tuple[int, int, int] | None = None
        self._ctx: SourceContext | None = None
        self._stat: _Fd | None = None
        self._meminfo: _Fd | None = None
        self._netdev: _Fd | None = None
        self._loadavg: _Fd | None = None
        self._missing_reported: set[str] = set()
        self._synced: frozenset[int] | None = None  # the pid set _procs was last synced to
        # The per-process reads run in C (collector/native/procsample.c) when it is built: one
        # call per tick instead of Python parsing /proc text for every process.
        self._native: Any = None
        self.proc_reader = ""
        self._fds = np.zeros(0, native.PROC_FDS_DTYPE)
        self._threads = np.zeros(0, native.THREAD_FDS_DTYPE)
        self._out = np.zeros(0, native.PROC_ROW_DTYPE)

    def start(self, ctx: SourceContext) -> None:
        self._ctx = ctx
        try:
            self._stat = _Fd("/proc/stat")
            self._meminfo = _Fd("/proc/meminfo")
            self._netdev = _Fd("/proc/net/dev")
            self._loadavg = _Fd("/proc/loadavg")
        except OSError as e:
            raise SourceUnavailable(f"/proc not readable: {e}") from None
        try:
            self._native = native.sampler()
            self.proc_reader = "native"
        except native.NativeUnavailable as e:
            self.proc_reader = f"python ({e})"

    # --- node ---------------------------------------------------------------------------------
    def _node_row(self, now_ns: int) -> np.ndarray:
        assert self._stat and self._meminfo and self._netdev and self._loadavg
        line = self._stat.read(512).split(b"\n", 1)[0].split()
        vals = [int(x) for x in line[1:9]]  # user nice system idle iowait irq softirq steal
        total = sum(vals)
        idle, iowait = vals[3], vals[4]
        busy_frac = iowait_frac = math.nan
        if self._prev_cpu is not None:
            dt = total - self._prev_cpu[0]
            if dt > 0:
                busy_frac = ((total - idle - iowait) - (self._prev_cpu[0] - self._prev_cpu[1] - self._prev_cpu[2])) / dt
                iowait_frac = (iowait - self._prev_cpu[2]) / dt
        self._prev_cpu = (total, idle, iowait)
        mem = self._meminfo.read(4096)
        mt = _meminfo_kb(mem, b"MemTotal:")
        ma = _meminfo_kb(mem, b"MemAvailable:")
        rx = tx = 0
        for ln in self._netdev.read(65536).split(b"\n")[2:]:
            if b":" not in ln:
                continue
            ifname, data = ln.split(b":", 1)
            if ifname.strip() == b"lo":
                continue
            f = data.split()
            rx += int(f[0])
            tx += int(f[8])
        load1 = float(self._loadavg.read(128).split()[0])
        return np.array([(now_ns, busy_frac, iowait_frac, (mt - ma) * 1024, mt * 1024, rx, tx, load1)], _NODE_DT)

    # --- processes ------------------------------------------------------------------------------
    def _sync_procs(self, pids: frozenset[int]) -> None:
        if pids is self._synced:
            return  # the tracker hands out the same frozenset until the job's processes change
        self._synced = pids
        for pid in [p for p in self._procs if p not in pids]:
            self._procs.pop(pid).close()
        for pid in pids:
            if pid not in self._procs:
                try:
                    self._procs[pid] = _Proc(pid)
                except OSError:
                    continue  # exited before we could open it
                if self._native is not None:
                    self._procs[pid].list_threads()
        self._native_fds()

    def _native_fds(self) -> None:
        """The descriptors of _procs and their threads as the C reader takes them (rebuilt when a
        process or thread comes or goes; what the reader keeps per thread, its last run time and
        switch counts, carries over)."""
        if self._native is None:
            return
        # the thread entries lie in process order, n_threads of each
        owners = np.repeat(self._fds["pid"], self._fds["n_threads"])
        last = {(int(pid), int(t["tid"])): t for pid, t in zip(owners, self._threads)}
        fds = np.zeros(len(self._procs), native.PROC_FDS_DTYPE)
        threads = np.zeros(sum(len(p.thread_fds) for p in self._procs.values()), native.THREAD_FDS_DTYPE)
        k = 0
        for i, p in enumerate(self._procs.values()):
            fds[i] = (p.pid, p.stat.fd, p.io.fd if p.io is not None else -1, k, len(p.thread_fds), 0)
            for tid, (status, schedstat) in p.thread_fds.items():
                prev = last.get((p.pid, tid))
                threads[k] = (tid, status.fd if status is not None else -1,
                              schedstat.fd if schedstat is not None else -1, 0,
                              int(prev["last_runtime_ns"]) if prev is not None else np.iinfo(np.uint64).max,
                              int(prev["last_vol"]) if prev is not None else 0,
                              int(prev["last_invol"]) if prev is not None else 0)
                k += 1
        self._fds, self._threads = fds, threads
        self._out = np.zeros(len(fds), native.PROC_ROW_DTYPE)

    def _thread_ctxsw(self, p: _Proc) -> tuple[int, int]:
        """Context switches summed over all threads (status of the leader counts only itself)."""
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
        except OSError:
            return _ctxsw(p.status.read())
        for tid in [t for t in p.thread_status if t not in tids]:
            p.thread_status.pop(tid).close()
        v = n = 0
        for tid in tids:
            fd = p.thread_status.get(tid)
            try:
                if fd is None:
                    fd = p.thread_status[tid] = _Fd(f"/proc/{p.pid}/task/{tid}/status")
                a, b = _ctxsw(fd.read())
            except OSError:
                continue  # thread exited between listdir and read
            v += a
            n += b
        return v, n

    def _proc_rows(self, now_ns: int) -> np.ndarray:
        assert self._ctx is not None
        self._sync_procs(self._ctx.pids())
        if self._native is not None:
            return self._native_rows(now_ns)
        rows = []
        gone: list[int] = []
        pread = os.pread
        for pid, p in self._procs.items():
            try:
                stat = pread(p.stat.fd, 1024, 0)
                # fields after "(comm) ": state is rest[0]; utime 11, stime 12, num_threads 17, rss 21
                rest = stat[stat.rfind(b")") + 2:].split(None, 22)
                threads = int(rest[17])
                if threads > 1:
                    vol, invol = self._thread_ctxsw(p)
                else:
                    vol, invol = _ctxsw(pread(p.status.fd, 4096, 0))
                if p.io is not None:
                    io = pread(p.io.fd, 512, 0)
                    rb = _kv_int(io, b"read_bytes:")
                    wb = _kv_int(io, b"\nwrite_bytes:")
                else:
                    rb = wb = UNAVAILABLE_U64
                    if p.io_missing and "io_bytes" not in self._missing_reported:
                        self._missing_reported.add("io_bytes")
                        self._ctx.report_missing(self.name, -1, "read_bytes", p.io_missing[:96])
                        self._ctx.report_missing(self.name, -1, "write_bytes", p.io_missing[:96])
            except OSError as e:
                if e.errno in (errno.ESRCH, errno.ENOENT):
                    gone.append(pid)
                    continue
                raise
            rows.append((now_ns, pid, (int(rest[11]) + int(rest[12])) * _NS_PER_TICK, int(rest[21]) * _PAGE, threads,
                         vol, invol, rb, wb))
        if gone:
            for pid in gone:
                self._procs.pop(pid).close()
        return np.array(rows, _PROCS_DT) if rows else _EMPTY_PROCS

    def _native_rows(self, now_ns: int) -> np.ndarray:
        assert self._ctx is not None
        n = len(self._fds)
        if n == 0:
            return _EMPTY_PROCS
        self._native.gp_sample_procs(self._fds.ctypes.data, n, self._threads.ctypes.data, self._out.ctypes.data)
        out, fds = self._out, self._fds
        # Threads came or went since they were listed: relist those processes for the next tick
        # (this tick's sums cover the listed threads that are still alive).
        stale = np.flatnonzero((out["status"] == 0) & (out["threads_read"] != out["threads"]))
        if len(stale):
            for pid in fds["pid"][stale].tolist():
                self._procs[pid].list_threads()
            relist = True
        else:
            relist = False
        status = out["status"]
        if status.any():
            gone = status == -errno.ESRCH
            gone |= status == -errno.ENOENT
            bad = np.flatnonzero(~gone & (status != 0))
            if len(bad):
                i = int(bad[0])
                raise OSError(-int(status[i]), f"reading /proc/{int(fds['pid'][i])}: {os.strerror(-int(status[i]))}")
            for pid in fds["pid"][gone].tolist():
                self._procs.pop(pid).close()
            keep = ~gone
            relist = True
            out, fds = out[keep], fds[keep]
        if "io_bytes" not in self._missing_reported and (fds["io_fd"] < 0).any():
            p = self._procs[int(fds["pid"][np.argmax(fds["io_fd"] < 0)])]
            self._missing_reported.add("io_bytes")
            self._ctx.report_missing(self.name, -1, "read_bytes", p.io_missing[:96])
            self._ctx.report_missing(self.name, -1, "write_bytes", p.io_missing[:96])
        rows = np.empty(len(out), _PROCS_DT)
        rows["t_ns"] = now_ns
        rows["pid"] = fds["pid"]
        rows["cpu_time_ns"] = out["cpu_ticks"] * _NS_PER_TICK
        rows["rss_bytes"] = out["rss_pages"] * _PAGE
        rows["num_threads"] = out["threads"]
        rows["voluntary_ctxsw"] = out["vol_ctxsw"]
        rows["involuntary_ctxsw"] = out["invol_ctxsw"]
        rows["read_bytes"] = out["read_bytes"]
        rows["write_bytes"] = out["write_bytes"]
        if relist:
            self._native_fds()
        return rows

    def at_seal(self, f: Any) -> None:
        if schema.HOST_PROCS.path in f:
            f[schema.HOST_PROCS.path].attrs["reader"] = self.proc_reader

    def sample(self, now_ns: int) -> Iterable[Batch]:
        out: list[Batch] = [(schema.HOST_NODE, self._node_row(now_ns))]
        procs = self._proc_rows(now_ns)
        if len(procs):
            out.append((schema.HOST_PROCS, procs))
        return out

    def stop(self) -> None:
        for p in self._procs.values():
            p.close()
        self._procs.clear()
        for f in (self._stat, self._meminfo, self._netdev, self._loadavg):
            if f is not None:
                f.close()


def _meminfo_kb(text: bytes, key: bytes) -> int:
    i = text.find(key)
    if i < 0:
        return 0
    return int(text[i + len(key): text.find(b"kB", i)])


def _kv_int(text: bytes, key: bytes) -> int:
    i = text.find(key)
    if i < 0:
        return int(UNAVAILABLE_U64)
    j = text.find(b"\n", i + len(key))
    return int(text[i + len(key): j if j >= 0 else None])
