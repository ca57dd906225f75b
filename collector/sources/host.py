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

import numpy as np

from collector import schema
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
    __slots__ = ("io", "io_missing", "pid", "stat", "status", "thread_status", "threads")

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
        self.thread_status: dict[int, _Fd] = {}

    def close(self) -> None:
        for f in (self.stat, self.status, self.io, *self.thread_status.values()):
            if f is not None:
                f.close()
        self.thread_status.clear()


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

    def start(self, ctx: SourceContext) -> None:
        self._ctx = ctx
        try:
            self._stat = _Fd("/proc/stat")
            self._meminfo = _Fd("/proc/meminfo")
            self._netdev = _Fd("/proc/net/dev")
            self._loadavg = _Fd("/proc/loadavg")
        except OSError as e:
            raise SourceUnavailable(f"/proc not readable: {e}") from None

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
