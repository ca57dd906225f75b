"""Host metrics from /proc: node CPU, memory, network, load; per job process CPU, RSS, threads,
context switches and I/O bytes.

Why file descriptors are kept open: /proc files regenerate their text on every read at offset 0,
so one `pread` on a descriptor opened once costs a fraction of open+read+close; at 10 Hz over
dozens of processes this is most of the source's cost. A descriptor of a process that exited
fails with ESRCH, which is how we notice it is gone.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from gpuprof.collector import native, schema
from gpuprof.collector.sources.base import Batch, Source, SourceContext, SourceUnavailable

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
STOP_TIMEOUT_S = 2.0  # a /proc read does not hang; this only bounds the wait for the thread


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


# A native-threaded host source hands its rows over this often (the daemon calls sample() at
# this interval); its C buffers hold BUFFER_S seconds of ticks, beyond which rows are counted as
# dropped (drops()), never grown.
DRAIN_INTERVAL_S = 1.0
BUFFER_S = 8.0
# The native reader reads each process's threads' run times at every tick (its CPU time) and
# its stat, io and threads' statuses (resident set, threads, I/O bytes, context switches) this
# often, repeating them in the ticks between (collector/native/procsample.c says why); and the
# node's memory, network bytes and load average as often (hosttick.c, node_row). The Python
# path reads everything at every tick.
FULL_READ_INTERVAL_S = 1.0


class HostSource(Source):
    """threaded=True (what the collector runs): the ticks run in a native thread at rate_hz
    (collector/native/hosttick.c on ticker.c) and sample() drains their rows every
    DRAIN_INTERVAL_S. threaded=False: each sample() is one tick, on the caller's thread. Without
    the native library, sample() is one tick in Python at rate_hz either way."""

    name = "host"
    tables = (schema.HOST_NODE, schema.HOST_PROCS)
    shares_drain_thread = True  # its sample drains the native tick's buffers (or reads /proc in Python)

    def __init__(self, rate_hz: float = 10.0, threaded: bool = False) -> None:
        self.sample_interval_s = 1.0 / rate_hz
        self.interval_s = self.sample_interval_s
        self.threaded = threaded
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
        # call per tick instead of Python parsing /proc text for every process; the whole tick
        # (hosttick.c) when native: node row included.
        self._native: Any = None
        self._host: int | None = None  # struct gp_host *
        self._ticker: native.SharedTicker | None = None
        self._stuck = False  # the thread did not stop: its state is never touched again
        self._ticks_cap = max(4, math.ceil(BUFFER_S / self.sample_interval_s))
        self._max_procs = 0  # the most processes ever handed to the C side: its row buffer's size
        self._dropped = 0
        self.proc_reader = ""
        self._fds = np.zeros(0, native.PROC_FDS_DTYPE)
        self._threads = np.zeros(0, native.THREAD_FDS_DTYPE)

    def start(self, ctx: SourceContext) -> None:
        self._ctx = ctx
        try:
            lib = native.sampler()
        except native.NativeUnavailable as e:
            self.proc_reader = f"python ({e})"
        else:
            h = lib.gp_host_new(self._ticks_cap, round(FULL_READ_INTERVAL_S * 1e9))
            if not h:
                raise SourceUnavailable(f"/proc not readable: {os.strerror(ctypes.get_errno())}")
            self._native, self._host, self.proc_reader = lib, h, "native"
            if self.threaded:
                self._ticker = native.SharedTicker(lib, "gp_host_tick", h, self.sample_interval_s)
                self.interval_s = DRAIN_INTERVAL_S
            return
        try:
            self._stat = _Fd("/proc/stat")
            self._meminfo = _Fd("/proc/meminfo")
            self._netdev = _Fd("/proc/net/dev")
            self._loadavg = _Fd("/proc/loadavg")
        except OSError as e:
            raise SourceUnavailable(f"/proc not readable: {e}") from None

    def drops(self) -> int:
        """Rows the native ticks could not keep because sample() did not drain them in time."""
        return self._dropped

    # --- node (Python path) ---------------------------------------------------------------------
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
        """Open the processes of `pids` not followed yet, close those no longer in it (native:
        with the C side's lock held)."""
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
        """Hand the descriptors of _procs and their threads to the C side (with its lock held),
        rebuilt when a process or thread comes or goes; what the reader keeps per thread, its last
        run time and switch counts, carries over."""
        if self._native is None:
            return
        # the thread entries lie in process order, n_threads of each
        owners = np.repeat(self._fds["pid"], self._fds["n_threads"])
        last = {(int(pid), int(t["tid"])): t for pid, t in zip(owners, self._threads)}
        last_proc = {int(f["pid"]): f for f in self._fds}
        fds = np.zeros(len(self._procs), native.PROC_FDS_DTYPE)
        threads = np.zeros(sum(len(p.thread_fds) for p in self._procs.values()), native.THREAD_FDS_DTYPE)
        k = 0
        for i, p in enumerate(self._procs.values()):
            f = fds[i]
            f["pid"], f["stat_fd"], f["io_fd"] = p.pid, p.stat.fd, p.io.fd if p.io is not None else -1
            f["first_thread"], f["n_threads"] = k, len(p.thread_fds)
            prev_p = last_proc.get(p.pid)
            if prev_p is not None:
                for name in native.PROC_FDS_KEPT:
                    f[name] = prev_p[name]
            for tid, (status, schedstat) in p.thread_fds.items():
                t = threads[k]
                t["tid"] = tid
                t["status_fd"] = status.fd if status is not None else -1
                t["schedstat_fd"] = schedstat.fd if schedstat is not None else -1
                prev = last.pop((p.pid, tid), None)
                if prev is not None:
                    for name in native.THREAD_FDS_KEPT:
                        t[name] = prev[name]
                else:
                    t["last_runtime_ns"] = t["first_runtime_ns"] = t["status_runtime_ns"] = native.NO_RUNTIME
                k += 1
        # threads of a process still followed that exited before the C side saw them gone: what
        # they had counted stays in their process's sums (procsample.c's thread_exited)
        row_of = {int(pid): i for i, pid in enumerate(fds["pid"])}
        for (pid, _tid), t in last.items():
            row = row_of.get(pid)
            if row is not None and not t["gone"]:
                if t["first_runtime_ns"] != native.NO_RUNTIME:
                    fds[row]["unlisted_runtime_ns"] += t["last_runtime_ns"] - t["first_runtime_ns"]
                fds[row]["exited_vol"] += t["last_vol"]
                fds[row]["exited_invol"] += t["last_invol"]
        if self._native.gp_host_set_procs(self._host, fds.ctypes.data, len(fds), threads.ctypes.data) != 0:
            raise MemoryError(f"host sampler: no memory for the rows of {len(fds)} processes")
        # the C side reads these arrays until the next call: they stay referenced here until then
        self._fds, self._threads = fds, threads
        self._max_procs = max(self._max_procs, len(fds))

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

    def _python_proc_rows(self, now_ns: int) -> np.ndarray:
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
                    self._report_io_missing(p)
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

    def _report_io_missing(self, p: _Proc) -> None:
        if p.io_missing and "io_bytes" not in self._missing_reported:
            assert self._ctx is not None
            self._missing_reported.add("io_bytes")
            self._ctx.report_missing(self.name, -1, "read_bytes", p.io_missing[:96])
            self._ctx.report_missing(self.name, -1, "write_bytes", p.io_missing[:96])

    # --- the native path --------------------------------------------------------------------------
    def _native_sample(self, now_ns: int) -> list[Batch]:
        lib, h = self._native, self._host
        assert self._ctx is not None
        pids = self._ctx.pids()
        if self._ticker is None:  # one tick here and now, on the pid set as it is now
            lib.gp_host_lock(h)
            try:
                self._sync_procs(pids)
            finally:
                lib.gp_host_unlock(h)
            lib.gp_host_tick(h, now_ns)
        lib.gp_host_lock(h)
        try:
            out = self._drain_locked()
            self._sync_procs(pids)  # threaded: the processes the next ticks read
        finally:
            lib.gp_host_unlock(h)
        return out

    def _drain_locked(self) -> list[Batch]:
        """The rows of the ticks since the last drain, as table rows; what the ticks flagged
        (threads to relist, processes gone, failed reads) is acted on before the next tick."""
        assert self._ctx is not None
        n = len(self._fds)
        node = np.empty(self._ticks_cap, native.HOST_NODE_ROW_DTYPE)
        rows = np.empty(self._ticks_cap * max(1, self._max_procs), native.HOST_PROC_ROW_DTYPE)
        flags = np.zeros(max(1, n), np.int32)
        errors = np.zeros(max(1, n), np.int32)
        counts = np.zeros(3, np.uint64)
        self._native.gp_host_drain(self._host, node.ctypes.data, rows.ctypes.data, flags.ctypes.data,
                                   errors.ctypes.data, counts.ctypes.data)
        node, rows = node[: int(counts[0])], rows[: int(counts[1])]
        self._dropped = int(counts[2])
        flags, errors = flags[:n], errors[:n]
        changed = False
        for i in np.flatnonzero(errors).tolist():
            e = -int(errors[i])
            self._ctx.report_error(self.name, f"reading /proc/{int(self._fds['pid'][i])}: {os.strerror(e)}")
        for i in np.flatnonzero(flags).tolist():
            pid = int(self._fds["pid"][i])
            if flags[i] & native.HOST_PROC_GONE:
                self._procs.pop(pid).close()
            elif flags[i] & native.HOST_PROC_STALE:
                self._procs[pid].list_threads()  # threads came or went since they were listed
            changed = True
        if changed:
            self._native_fds()
        for p in self._procs.values():
            if p.io is None:
                self._report_io_missing(p)
                break
        bad = node["status"] != 0
        if bad.any():
            e = -int(node["status"][np.argmax(bad)])
            self._ctx.report_error(self.name, f"reading /proc/stat, meminfo, net/dev or loadavg: {os.strerror(e)}")
            node = node[~bad]
        out: list[Batch] = []
        if len(node):
            nr = np.empty(len(node), _NODE_DT)
            nr["t_ns"] = node["t_ns"]
            nr["cpu_busy"] = node["cpu_busy"]
            nr["cpu_iowait"] = node["cpu_iowait"]
            nr["mem_used_bytes"] = node["mem_used_kb"] * 1024
            nr["mem_total_bytes"] = node["mem_total_kb"] * 1024
            nr["net_rx_bytes"] = node["net_rx"]
            nr["net_tx_bytes"] = node["net_tx"]
            nr["load1"] = node["load1"]
            out.append((schema.HOST_NODE, nr))
        if len(rows):
            pr = np.empty(len(rows), _PROCS_DT)
            pr["t_ns"] = rows["t_ns"]
            pr["pid"] = rows["pid"]
            pr["cpu_time_ns"] = rows["cpu_ns"]
            pr["rss_bytes"] = rows["rss_pages"] * _PAGE
            pr["num_threads"] = rows["threads"]
            pr["voluntary_ctxsw"] = rows["vol_ctxsw"]
            pr["involuntary_ctxsw"] = rows["invol_ctxsw"]
            pr["read_bytes"] = rows["read_bytes"]
            pr["write_bytes"] = rows["write_bytes"]
            out.append((schema.HOST_PROCS, pr))
        return out

    def at_seal(self, f: Any) -> None:
        if schema.HOST_PROCS.path in f:
            f[schema.HOST_PROCS.path].attrs["reader"] = self.proc_reader

    def sample(self, now_ns: int) -> Iterable[Batch]:
        if self._native is not None:
            return self._native_sample(now_ns)
        out: list[Batch] = [(schema.HOST_NODE, self._node_row(now_ns))]
        procs = self._python_proc_rows(now_ns)
        if len(procs):
            out.append((schema.HOST_PROCS, procs))
        return out

    def _stop_ticker(self) -> None:
        if self._ticker is not None:
            self._stuck = not self._ticker.stop(STOP_TIMEOUT_S)
            self._ticker = None

    def final(self, now_ns: int) -> Iterable[Batch]:
        """The ticks not drained yet and one more at `now_ns` (threaded: the thread stopped first)."""
        self._stop_ticker()
        if self._stuck:
            return []  # a tick that never returned holds the state's lock: leave it alone
        return self.sample(now_ns)

    def stop(self) -> None:
        self._stop_ticker()
        if self._host is not None and not self._stuck:  # a stuck tick still uses its state: never freed
            self._native.gp_host_free(self._host)
        self._host = None
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
