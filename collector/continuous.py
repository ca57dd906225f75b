"""Continuous mode: the always-on node collector (docs/continuous.md).

The same Collector (collector/daemon.py: sources -> bounded rings -> one writer thread) runs with
the node's every Slurm job as its process set, at the lower rates of config [continuous], and its
writer thread feeds a `Retention` instead of a node file:

  * the last `retention_min` minutes, cut into segments of `segment_s`; a closed segment is
    written to the spill directory (root-only, node-local; a collector restarted on the same boot
    finds it again) and kept in memory while the segments in memory stay under `memory_limit_mb`;
    past that the spill alone holds it. The spill is capped at `spill_limit_mb`; the oldest
    segments go first, and a spill write that fails (the disk full) is counted and leaves the
    segment in memory only (then memory's cap evicts it: counted as lost).
  * an export writes a v1 node file of a window (collector/writer.py, the job mode's writer), all
    of the node or one job's processes (`--job`: pids the job's cgroup held in the window); the
    ordinary merge reads it. A window larger than what is retained is exported with what there is,
    and the file and the reply say so (attribute window_json).
  * exports are asked for on the local API (a unix socket, authenticated by SO_PEERCRED: root, or
    the owner of the job for an export of that job only), or fired by metric rules (config
    [continuous] rules), each rate-limited: a storm of triggers is counted, not obeyed.
  * the output file of an API export is opened by the client as itself and its descriptor passed
    over the socket (SCM_RIGHTS): the root collector never opens a path a user named.

Why segments and not one ring of rows: eviction by time and by bytes is then a list operation, a
segment is the unit the spill writes and deletes, and an export of 5 minutes reads a few arrays.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import math
import os
import re
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.control import CLIENT_READ_TIMEOUT_S, MAX_REQUEST_BYTES, ControlServer, exchange
from gpuprof.collector.daemon import Collector, CollectorOptions, monotonic_ns
from gpuprof.collector.errors import CollectorError, ConfigError
from gpuprof.collector.proctrack import pids_in_cgroups, read_proc_info
from gpuprof.collector.schema import Table
from gpuprof.collector.writer import NodeMeta, NodeTraceWriter, read_boot_id

log = logging.getLogger("gpuprof.collector")

SEGMENT_PREFIX = "seg-"
SPILL_SUFFIX = ".npz"
EXPORT_WAIT_S = 120.0
MAX_RETAINED_JOBS = 4096  # jobs whose pid history is kept (bounded memory on a busy node)
CONTINUOUS_COMMANDS = ("status", "flush", "seal", "export", "trigger", "summary", "job_begin", "job_end")


class ContinuousError(CollectorError):
    """A continuous-mode request that cannot be done (bad window, no such job, refused)."""


def time_column(table: Table) -> str | None:
    """The column an export window cuts on; None for tables without one (written once: devices)."""
    names = [c.name for c in table.columns]
    for name in ("t_ns", "t_enter_ns", "monotonic_ns"):
        if name in names:
            return name
    return None


def has_pid(table: Table) -> bool:
    return any(c.name == "pid" for c in table.columns)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*$")


def parse_duration(text: str) -> float:
    """'5m', '300s', '300', '1.5h' -> seconds; ValueError naming the text otherwise."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 300s, 5m, 1h)")
    value = float(m.group(1))
    unit = m.group(2) or "s"
    seconds = value * {"s": 1, "m": 60, "min": 60, "h": 3600}[unit]
    if seconds <= 0:
        raise ValueError(f"duration must be positive: {text!r}")
    return seconds


# --- retention ----------------------------------------------------------------------------------
@dataclass
class Segment:
    t0_ns: int  # CLOCK_MONOTONIC: the segment holds what was appended from t0 to t1
    t1_ns: int
    nbytes: int
    tables: dict[str, np.ndarray] | None  # None: only in the spill
    path: Path | None  # None: not spilled (no spill directory, or the write failed)
    rows: dict[str, int] = field(default_factory=dict)


@dataclass
class RetentionCounters:
    segments_spilled: int = 0
    spill_errors: int = 0
    last_spill_error: str = ""
    evicted_by_age: int = 0  # segments older than the retention window
    evicted_from_memory: int = 0  # dropped from memory, still in the spill
    evicted_from_spill: int = 0  # deleted from the spill by its size cap
    lost_segments: int = 0  # gone before their time: neither in memory nor in the spill
    lost_rows: int = 0
    restored_segments: int = 0  # found in the spill at start (a restarted collector)
    discarded_other_boot: int = 0  # spilled before a reboot: their monotonic times mean nothing now


def check_private_dir(d: Path, what: str) -> None:
    """Create `d` (0700) if absent; refuse one that anyone but root/us could write or read, since
    it holds every job's records of this node."""
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
    except OSError as e:
        raise CollectorError(f"{d}: {what} unusable: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CollectorError(f"{d}: {what} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise CollectorError(f"{d}: {what} owned by uid {st.st_uid}; refusing")
    if st.st_mode & 0o077:
        raise CollectorError(f"{d}: {what} is reachable by others ({stat.filemode(st.st_mode)}); "
                             "it must be 0700 (chmod 700)")


class Retention:
    """The last `retention_s` of every table, bounded in memory and in the spill (module doc)."""

    def __init__(
        self,
        tables: tuple[Table, ...] | list[Table],
        *,
        retention_s: float,
        memory_limit_bytes: int,
        segment_s: float,
        spill_dir: Path | None,
        spill_limit_bytes: int,
        boot_id: str | None = None,
    ) -> None:
        if retention_s <= 0 or segment_s <= 0 or memory_limit_bytes <= 0 or spill_limit_bytes < 0:
            raise ConfigError("continuous: retention_min, segment_s and memory_limit_mb must be positive")
        self.tables = {t.path: t for t in tables}
        self.retention_ns = int(retention_s * 1e9)
        self.segment_ns = int(segment_s * 1e9)
        self.memory_limit_bytes = int(memory_limit_bytes)
        self.spill_dir = spill_dir
        self.spill_limit_bytes = int(spill_limit_bytes)
        self.boot_id = boot_id or read_boot_id()
        self.counters = RetentionCounters()
        self._lock = threading.Lock()
        self._segments: list[Segment] = []
        self._static: dict[str, list[np.ndarray]] = {}
        self._open: dict[str, list[np.ndarray]] = {}
        self._open_bytes = 0
        self._open_t0: int | None = None
        if spill_dir is not None:
            check_private_dir(spill_dir, "continuous spill directory")
            self._restore()

    # spill ---------------------------------------------------------------------------------------
    def _restore(self) -> None:
        assert self.spill_dir is not None
        now = monotonic_ns()
        for p in sorted(self.spill_dir.iterdir()):
            if p.name.startswith(".tmp-"):
                _unlink(p)  # a write cut short by a crash
                continue
            parsed = _parse_segment_name(p.name)
            if parsed is None:
                continue
            boot, t0, t1 = parsed
            if boot != self.boot_id:
                self.counters.discarded_other_boot += 1
                _unlink(p)
                continue
            if t1 < now - self.retention_ns:
                self.counters.evicted_by_age += 1
                _unlink(p)
                continue
            try:
                size = p.stat().st_size
                with np.load(p, allow_pickle=False) as z:
                    rows = {_path_of_key(k): int(z[k].shape[0]) for k in z.files if _path_of_key(k) in self.tables}
            except (OSError, ValueError, KeyError) as e:
                log.warning("continuous: spilled segment %s unreadable (%s); removed", p, e)
                _unlink(p)
                continue
            self._segments.append(Segment(t0, t1, size, None, p, rows))
            self.counters.restored_segments += 1
        self._segments.sort(key=lambda s: s.t0_ns)

    def _spill(self, seg: Segment) -> None:
        if self.spill_dir is None or seg.tables is None:
            return
        name = f"{SEGMENT_PREFIX}{self.boot_id}-{seg.t0_ns}-{seg.t1_ns}{SPILL_SUFFIX}"
        final = self.spill_dir / name
        tmp = self.spill_dir / f".tmp-{name}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                arrays: dict[str, Any] = {_key_of_path(p): rows for p, rows in seg.tables.items()}
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            seg.path = final
            seg.nbytes = final.stat().st_size
            self.counters.segments_spilled += 1
        except OSError as e:
            _unlink(tmp)
            self.counters.spill_errors += 1
            self.counters.last_spill_error = f"{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror}"
            log.warning("continuous: cannot spill a segment to %s: %s (kept in memory only)", self.spill_dir,
                        self.counters.last_spill_error)

    # appending (the writer thread) ---------------------------------------------------------------
    def append(self, path: str, rows: np.ndarray, now_ns: int | None = None) -> None:
        table = self.tables.get(path)
        if table is None:
            raise CollectorError(f"continuous: table {path} is not retained")
        if len(rows) == 0:
            return
        if time_column(table) is None:
            with self._lock:
                self._static.setdefault(path, []).append(rows.copy())
            return
        with self._lock:
            if self._open_t0 is None:
                self._open_t0 = monotonic_ns() if now_ns is None else now_ns
            self._open.setdefault(path, []).append(rows.copy())
            self._open_bytes += rows.nbytes
            full = self._open_bytes * 2 > self.memory_limit_bytes
        if full:
            self.rotate(force=True, now_ns=now_ns)  # a burst: close early rather than pass the cap

    def rotate(self, *, force: bool = False, now_ns: int | None = None) -> None:
        """Close the open segment when it is `segment_s` old (or now, with force); evict."""
        now = monotonic_ns() if now_ns is None else now_ns
        with self._lock:
            seg = None
            if self._open_t0 is not None and (force or now - self._open_t0 >= self.segment_ns):
                tables = {p: schema.concat_rows(parts) for p, parts in self._open.items()}
                seg = Segment(self._open_t0, now, self._open_bytes, tables, None,
                              {p: len(r) for p, r in tables.items()})
                self._open = {}
                self._open_bytes = 0
                self._open_t0 = None
        if seg is not None:
            self._spill(seg)  # outside the lock: a slow disk must not hold up appends
            with self._lock:
                self._segments.append(seg)
        self._evict(now)

    def _evict(self, now: int) -> None:
        doomed: list[Path] = []
        with self._lock:
            cutoff = now - self.retention_ns
            keep: list[Segment] = []
            for seg in self._segments:
                if seg.t1_ns < cutoff:
                    self.counters.evicted_by_age += 1
                    if seg.path is not None:
                        doomed.append(seg.path)
                else:
                    keep.append(seg)
            self._segments = keep
            in_memory = [s for s in keep if s.tables is not None]
            mem = sum(_table_bytes(s.tables) for s in in_memory)
            for seg in in_memory:  # oldest first
                if mem <= self.memory_limit_bytes:
                    break
                mem -= _table_bytes(seg.tables)
                seg.tables = None
                if seg.path is not None:
                    self.counters.evicted_from_memory += 1
                else:
                    self._lose(seg)
            if self.spill_dir is not None:
                disk = sum(s.nbytes for s in self._segments if s.path is not None)
                for seg in list(self._segments):
                    if disk <= self.spill_limit_bytes:
                        break
                    if seg.path is None:
                        continue
                    disk -= seg.nbytes
                    doomed.append(seg.path)
                    seg.path = None
                    self.counters.evicted_from_spill += 1
                    if seg.tables is None:
                        self._lose(seg)
            self._segments = [s for s in self._segments if s.tables is not None or s.path is not None]
        for p in doomed:
            _unlink(p)

    def _lose(self, seg: Segment) -> None:
        self.counters.lost_segments += 1
        self.counters.lost_rows += sum(seg.rows.values())

    # reading (any thread) ------------------------------------------------------------------------
    def span(self) -> tuple[int, int] | None:
        """(oldest, newest) CLOCK_MONOTONIC time retained, None when nothing is."""
        with self._lock:
            starts = [s.t0_ns for s in self._segments] + ([self._open_t0] if self._open_t0 is not None else [])
            if not starts:
                return None
            end = monotonic_ns() if self._open_t0 is not None else max(s.t1_ns for s in self._segments)
            return min(starts), end

    def rows(self, path: str) -> int:
        with self._lock:
            n = sum(s.rows.get(path, 0) for s in self._segments)
            n += sum(len(r) for r in self._open.get(path, ()))
            n += sum(len(r) for r in self._static.get(path, ()))
        return n

    def memory_bytes(self) -> int:
        with self._lock:
            return self._open_bytes + sum(_table_bytes(s.tables) for s in self._segments if s.tables is not None) \
                + sum(r.nbytes for parts in self._static.values() for r in parts)

    def spill_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._segments if s.path is not None)

    def window(self, t_from_ns: int, t_to_ns: int, pids: set[int] | None = None) -> dict[str, np.ndarray]:
        """Every table's rows with their time in [t_from, t_to] (clock pairs: also the last one
        before, so the window maps to realtime from its first row); with pids, the rows of tables
        with a pid column only for those pids. Tables without a time column come whole."""
        with self._lock:
            segs = [s for s in self._segments if s.t1_ns >= t_from_ns and s.t0_ns <= t_to_ns]
            parts: list[dict[str, np.ndarray] | Path] = []
            for seg in segs:
                if seg.tables is not None:
                    parts.append(seg.tables)
                elif seg.path is not None:
                    parts.append(seg.path)
            if self._open_t0 is not None and self._open_t0 <= t_to_ns:
                parts.append({p: schema.concat_rows(v) for p, v in self._open.items()})
            static = {p: schema.concat_rows(v) for p, v in self._static.items()}
            all_pairs = [s.tables.get(schema.CLOCK_PAIRS.path) for s in self._segments if s.tables is not None]
        collected: dict[str, list[np.ndarray]] = {}
        before_pair: np.ndarray | None = None
        for part in parts:
            tables = part if isinstance(part, dict) else _load_segment(part, self.tables)
            for path, rows in tables.items():
                table = self.tables.get(path)
                if table is None:
                    continue
                col = time_column(table)
                assert col is not None
                t = rows[col]
                keep = (t >= t_from_ns) & (t <= t_to_ns)
                if path == schema.CLOCK_PAIRS.path:
                    earlier = rows[t < t_from_ns]
                    if len(earlier):
                        before_pair = earlier[-1:]
                if pids is not None and has_pid(table):
                    keep &= np.isin(rows["pid"], np.fromiter(pids, dtype=np.int64, count=len(pids)))
                if keep.any():
                    collected.setdefault(path, []).append(rows[keep])
        if before_pair is None:
            for pairs in all_pairs:
                if pairs is not None and len(pairs) and int(pairs["monotonic_ns"][0]) < t_from_ns:
                    before_pair = pairs[:1]
        out = {p: schema.concat_rows(v) for p, v in collected.items()}
        if before_pair is not None:
            cp = schema.CLOCK_PAIRS.path
            out[cp] = schema.concat_rows([before_pair, out[cp]]) if cp in out else before_pair
        for path, rows in static.items():
            table = self.tables[path]
            if pids is not None and has_pid(table):
                rows = rows[np.isin(rows["pid"], np.fromiter(pids, dtype=np.int64, count=len(pids)))]
            out[path] = np.unique(rows) if rows.dtype.names else rows
        return out

    def status(self) -> dict[str, Any]:
        span = self.span()
        c = self.counters
        return {
            "retention_s": self.retention_ns / 1e9,
            "retained_s": round((span[1] - span[0]) / 1e9, 3) if span else 0.0,
            "segments": len(self._segments),
            "memory_bytes": self.memory_bytes(),
            "memory_limit_bytes": self.memory_limit_bytes,
            "spill_dir": str(self.spill_dir) if self.spill_dir else "",
            "spill_bytes": self.spill_bytes(),
            "spill_limit_bytes": self.spill_limit_bytes,
            **{k: getattr(c, k) for k in c.__dataclass_fields__},
        }


def _table_bytes(tables: dict[str, np.ndarray] | None) -> int:
    return sum(r.nbytes for r in tables.values()) if tables else 0


def _key_of_path(path: str) -> str:
    return path.strip("/").replace("/", "__")


def _path_of_key(key: str) -> str:
    return "/" + key.replace("__", "/")


def _parse_segment_name(name: str) -> tuple[str, int, int] | None:
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SPILL_SUFFIX)):
        return None
    body = name[len(SEGMENT_PREFIX):-len(SPILL_SUFFIX)]
    try:
        boot, t0, t1 = body.rsplit("-", 2)
        return boot, int(t0), int(t1)
    except ValueError:
        return None


def _load_segment(path: Path, tables: dict[str, Table]) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {_path_of_key(k): z[k] for k in z.files if _path_of_key(k) in tables}
    except (OSError, ValueError) as e:
        log.warning("continuous: spilled segment %s unreadable: %s", path, e)
        return {}


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("continuous: cannot remove %s: %s", p, e.strerror)


class RetentionWriter(NodeTraceWriter):
    """What the Collector's writer thread feeds in continuous mode: the Retention, in the place of
    a node file (same calls: append, rows, flush, seal). Observers see every batch (the rules'
    metrics, Prometheus); `on_flush` runs after each flush on the writer thread."""

    def __init__(self, retention: Retention, tables: tuple[Table, ...], *,
                 observers: list[Callable[[str, np.ndarray], None]],
                 on_flush: Callable[[], None]) -> None:
        # No NodeTraceWriter.__init__: there is no HDF5 file; only the interface is shared.
        self.path = retention.spill_dir or Path("/dev/null")
        self.tables = {t.path: t for t in tables}
        self.retention = retention
        self.observers = observers
        self.on_flush = on_flush
        self._file = None

    def append(self, table_path: str, rows: np.ndarray) -> None:
        self.retention.append(table_path, rows)
        for observe in self.observers:
            try:
                observe(table_path, rows)
            except (ValueError, KeyError, TypeError, FloatingPointError) as e:
                log.warning("continuous: observer failed on %s: %s", table_path, e)

    def append_parts(self, table_path: str, parts: Sequence[np.ndarray]) -> None:
        if parts:  # one array, as the observers and the retention's segments take them
            self.append(table_path, schema.concat_rows(parts))

    def rows(self, table_path: str) -> int:
        return self.retention.rows(table_path)

    def flush(self) -> None:
        self.retention.rotate()
        self.on_flush()

    def seal(self, *, drops: dict[str, int], extra: Callable[[Any], None] | None = None) -> None:
        # the collector stops: spill what is open, so that a restarted collector still has it
        self.retention.rotate(force=True)

    def close_unsealed(self) -> None:
        self.retention.rotate(force=True)


# --- the node's jobs ----------------------------------------------------------------------------
@dataclass
class _JobRecord:
    uid: int | None
    first_ns: int
    last_ns: int
    pids: dict[int, tuple[int, int]] = field(default_factory=dict)  # pid -> (first seen, last seen)


class NodeJobsTracker:
    """Every Slurm job's processes on this node, by their cgroups (the ProcessTracker's interface,
    so the Collector and its sources use it unchanged), and which job each pid belonged to when:
    an export `--job J` keeps J's pids of its window, also those that have ended since."""

    def __init__(self, *, node: str | None, cgroup_root: str = "/sys/fs/cgroup", history_s: float = 600.0,
                 use_scontrol: bool = True) -> None:
        self.node = node
        self.cgroup_root = cgroup_root
        self.history_ns = int(history_s * 1e9)
        self.use_scontrol = use_scontrol
        self.method = "none"
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._pids: frozenset[int] = frozenset()
        self._job_dirs: tuple[str, ...] = ()
        self._jobs: dict[str, _JobRecord] = {}
        self._info: dict[int, tuple[int, str]] = {}  # pid -> (ppid, comm) for the 'gone' rows
        self._job_of_pid: dict[int, str] = {}  # pids of the jobs seen within the history

    def _bases(self) -> list[tuple[str, bool]]:
        """(directory holding uid_*/job_* (v1) or job_* (v2), is_v1)."""
        root = self.cgroup_root
        node = self.node
        cands: list[tuple[str, bool]] = []
        for sd in ([f"slurm_{node}"] if node else []) + ["slurm"]:
            cands.append((f"{root}/freezer/{sd}", True))
        for sc in ([f"{node}_slurmstepd.scope"] if node else []) + ["slurmstepd.scope"]:
            cands.append((f"{root}/system.slice/{sc}", False))
            cands.append((f"{root}/unified/system.slice/{sc}", False))
        return [(d, v1) for d, v1 in cands if os.path.isdir(d)]

    def _job_cgroups(self) -> dict[str, tuple[str, int | None]]:
        """job id -> (its cgroup directory, owner uid when the path says it)."""
        out: dict[str, tuple[str, int | None]] = {}
        for base, v1 in self._bases():
            try:
                entries = os.listdir(base)
            except OSError:
                continue
            if v1:
                for u in entries:
                    if not u.startswith("uid_"):
                        continue
                    try:
                        uid: int | None = int(u[4:])
                        jobs = os.listdir(f"{base}/{u}")
                    except (ValueError, OSError):
                        continue
                    for j in jobs:
                        if j.startswith("job_"):
                            out.setdefault(j[4:], (f"{base}/{u}/{j}", uid))
            else:
                for j in entries:
                    if j.startswith("job_"):
                        out.setdefault(j[4:], (f"{base}/{j}", None))
            if out:
                self.method = "cgroup"
                break  # the first base with jobs is this node's (one slurmd's hierarchy)
        return out

    def pids(self) -> frozenset[int]:
        with self._lock:
            return self._pids

    def recent_pids(self) -> frozenset[int]:
        """Every pid of the jobs seen within the history (the ProcessTracker's interface)."""
        with self._lock:
            return frozenset(self._job_of_pid)

    def cgroup_dirs(self) -> tuple[str, ...]:
        return self._job_dirs

    def scan(self, now_ns: int) -> np.ndarray:
        with self._scan_lock:
            jobs = self._job_cgroups()
            by_job = {j: pids_in_cgroups((d,)) for j, (d, _u) in jobs.items()}
        me = os.getpid()
        current = {p for ps in by_job.values() for p in ps} - {me}
        with self._lock:
            before = self._pids
            if current != before:
                self._pids = frozenset(current)
            self._job_dirs = tuple(d for d, _u in jobs.values())
            for j, ps in by_job.items():
                rec = self._jobs.get(j)
                if rec is None:
                    rec = self._jobs[j] = _JobRecord(jobs[j][1], now_ns, now_ns)
                rec.last_ns = now_ns
                for p in ps:
                    first = rec.pids.get(p, (now_ns, now_ns))[0]
                    rec.pids[p] = (first, now_ns)
            cutoff = now_ns - self.history_ns
            for j in [j for j, r in self._jobs.items() if r.last_ns < cutoff]:
                del self._jobs[j]
            while len(self._jobs) > MAX_RETAINED_JOBS:
                del self._jobs[min(self._jobs, key=lambda k: self._jobs[k].last_ns)]
            self._job_of_pid = {p: j for j, r in self._jobs.items() for p in r.pids}
        appeared = sorted(current - before)
        gone = sorted(before - current)
        rows = schema.PROCESS_EVENTS.empty(len(appeared) + len(gone))
        i = 0
        for pid in appeared:
            info = read_proc_info(pid)
            if info is None:
                continue
            self._info[pid] = (info.ppid, info.comm)
            rows[i] = (now_ns, pid, info.ppid, 0, info.comm.encode()[:16], info.cmdline.encode()[:128])
            i += 1
        for pid in gone:
            ppid, comm = self._info.pop(pid, (0, ""))
            rows[i] = (now_ns, pid, ppid, 1, comm.encode()[:16], b"")
            i += 1
        return rows[:i]

    def close(self) -> None:
        pass

    def jobs(self) -> dict[str, dict[str, Any]]:
        """Jobs seen within the history: {job: {uid, running, pids}}."""
        with self._lock:
            live = self._pids
            return {j: {"uid": r.uid, "running": any(p in live for p in r.pids), "pids": len(r.pids),
                        "first_ns": r.first_ns, "last_ns": r.last_ns} for j, r in self._jobs.items()}

    def job_pids(self, job: str, t_from_ns: int, t_to_ns: int) -> set[int] | None:
        """The job's pids seen here within the window (None: job not seen within the history)."""
        with self._lock:
            rec = self._jobs.get(job)
            if rec is None:
                return None
            return {p for p, (a, b) in rec.pids.items() if b >= t_from_ns - 2_000_000_000 and a <= t_to_ns}

    def job_owner(self, job: str) -> int | None:
        with self._lock:
            rec = self._jobs.get(job)
            uid = rec.uid if rec else None
        if uid is not None or not self.use_scontrol:
            return uid
        uid = scontrol_job_uid(job)
        if uid is not None:
            with self._lock:
                if job in self._jobs:
                    self._jobs[job].uid = uid
        return uid

    def job_of(self, pid: int) -> str | None:
        with self._lock:
            return self._job_of_pid.get(pid)

    def any_job_running(self) -> bool:
        return bool(self.pids())


_USERID = re.compile(r"(?:^|\s)UserId=[^(\s]*\((\d+)\)")


def scontrol_job_uid(job: str, timeout_s: float = 5.0) -> int | None:
    """The job's owner as Slurm says (cgroup v2 paths do not name the uid)."""
    import shutil
    import subprocess

    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        p = subprocess.run([exe, "show", "job", "-o", job], capture_output=True, text=True, timeout=timeout_s,
                           check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = _USERID.search(p.stdout) if p.returncode == 0 else None
    return int(m.group(1)) if m else None


# --- rules and rate limits ----------------------------------------------------------------------
METRICS = {
    "gpu_util_percent": "mean GPU utilization over the node's watched GPUs (/gpu/samples util_gpu)",
    "gpu_power_watts": "mean GPU power (/gpu/samples power_w)",
    "cpu_busy_ratio": "node CPU busy fraction (/host/node cpu_busy)",
    "collective_seconds": "mean duration of the collective calls that completed since the previous flush",
}
_RULE = re.compile(r"^\s*([a-z_]+)\s*(<|>)\s*(-?\d+(?:\.\d+)?)\s+for\s+(\d+(?:\.\d+)?)\s*s\s*$")


@dataclass
class Rule:
    text: str
    metric: str
    op: str
    threshold: float
    for_s: float
    holding_since: float | None = None  # CLOCK_MONOTONIC seconds
    fired: int = 0

    def holds(self, value: float) -> bool:
        return value < self.threshold if self.op == "<" else value > self.threshold


def parse_rule(text: str) -> Rule:
    """'<metric> <|> <number> for <seconds> s', evaluated only while a job runs on the node."""
    if not isinstance(text, str):
        raise ConfigError(f"continuous.rules: each rule must be a string, got {text!r}")
    m = _RULE.match(text)
    if m is None:
        raise ConfigError(f"continuous.rules: cannot parse {text!r}; form: '<metric> <|> <number> for <N> s', "
                          f"metrics: {', '.join(METRICS)}")
    metric, op, thr, for_s = m.group(1), m.group(2), float(m.group(3)), float(m.group(4))
    if metric not in METRICS:
        raise ConfigError(f"continuous.rules: unknown metric {metric!r} in {text!r}; known: {', '.join(METRICS)}")
    return Rule(text, metric, op, thr, for_s)


class RateLimiter:
    """At most one per `min_interval_s` per key; the rest are counted (a storm is not obeyed)."""

    def __init__(self, min_interval_s: float) -> None:
        self.min_interval_s = float(min_interval_s)
        self._last: dict[str, float] = {}
        self.refused: dict[str, int] = {}
        self._lock = threading.Lock()

    def allow(self, key: str, now: float | None = None) -> bool:
        t = time.monotonic() if now is None else now
        with self._lock:
            last = self._last.get(key)
            if last is not None and t - last < self.min_interval_s:
                self.refused[key] = self.refused.get(key, 0) + 1
                return False
            self._last[key] = t
            return True

    def refused_total(self) -> int:
        with self._lock:
            return sum(self.refused.values())


class MetricState:
    """The latest value of each rule metric, from the batches the writer thread sees."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[float, float]] = {}  # metric -> (value, CLOCK_MONOTONIC s)
        self.gpu_latest: dict[int, np.void] = {}  # per GPU index: its last /gpu/samples row
        self.host_latest: np.void | None = None
        self.gpu_pids: dict[int, set[int]] = {}  # per GPU index: the pids of its last /gpu/processes rows
        self._coll_sum = 0.0
        self._coll_n = 0

    def observe(self, path: str, rows: np.ndarray) -> None:
        now = time.monotonic()
        if path == schema.GPU_SAMPLES.path and len(rows):
            util = rows["util_gpu"].astype(np.float64)
            if np.isfinite(util).any():
                self.values["gpu_util_percent"] = (float(np.nanmean(util)), now)
            power = rows["power_w"].astype(np.float64)
            if np.isfinite(power).any():
                self.values["gpu_power_watts"] = (float(np.nanmean(power)), now)
            for r in rows:
                self.gpu_latest[int(r["gpu"])] = r
        elif path == schema.GPU_PROCESSES.path and len(rows):
            for g in np.unique(rows["gpu"]):
                self.gpu_pids[int(g)] = {int(p) for p in rows["pid"][rows["gpu"] == g]}
        elif path == schema.HOST_NODE.path and len(rows):
            self.values["cpu_busy_ratio"] = (float(rows["cpu_busy"][-1]), now)
            self.host_latest = rows[-1]
        elif path == schema.COLLECTIVE_CALLS.path and len(rows):
            done = rows[rows["t_exit_ns"] > rows["t_enter_ns"]]
            self._coll_sum += float((done["t_exit_ns"] - done["t_enter_ns"]).sum()) / 1e9
            self._coll_n += len(done)

    def end_of_flush(self) -> None:
        if self._coll_n:
            self.values["collective_seconds"] = (self._coll_sum / self._coll_n, time.monotonic())
        self._coll_sum, self._coll_n = 0.0, 0

    def current(self, metric: str, stale_s: float) -> float | None:
        v = self.values.get(metric)
        if v is None or time.monotonic() - v[1] > stale_s:
            return None
        return v[0]


# --- the continuous collector -------------------------------------------------------------------
def continuous_config(cfg: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The job mode's config with continuous mode's rates in place of the sources' own."""
    c = cfg["continuous"]
    out = copy.deepcopy(cfg)
    out["sources.nvml"]["rate_hz"] = float(c["nvml_rate_hz"])
    out["sources.host"]["rate_hz"] = float(c["host_rate_hz"])
    out["sources.stacks"]["rate_hz"] = int(c["stacks_rate_hz"])
    out["collector"]["process_scan_interval_s"] = float(c["process_scan_interval_s"])
    out["collector"]["job_check_interval_s"] = 0.0  # no one job to watch: always on
    out["sources.nvml"]["gpus"] = "all"  # the node's GPUs, whichever job has them
    for key in ("mpi_path", "nccl_path"):
        # the fast path's rings live in a directory per job that the TaskProlog names; the always-on
        # collector has no job of its own, so its collectives come from the uprobes (every pid)
        if out["sources.collectives"][key] == "auto":
            out["sources.collectives"][key] = "uprobe"
    for r in c["rules"]:
        parse_rule(r)  # a bad rule is a start failure, named
    return out


class ContinuousCollector(Collector):
    """The Collector with the node's jobs as its process set and a Retention as its output."""

    def __init__(self, opts: CollectorOptions, sources: list[Any] | None = None, *,
                 socket_path: Path | None = None) -> None:
        super().__init__(opts, sources)
        c = opts.config["continuous"]
        self.ccfg = c
        # the node's every job in the place of the one job's tracker (same interface for the sources)
        self.jobs_tracker = NodeJobsTracker(node=opts.node, cgroup_root=opts.cgroup_root,
                                            history_s=float(c["retention_min"]) * 60 + 60,
                                            use_scontrol=opts.use_scontrol)
        self.tracker = self.jobs_tracker  # type: ignore[assignment]
        spill = str(c["spill_dir"])
        self.retention = Retention(
            self.tables,
            retention_s=float(c["retention_min"]) * 60,
            memory_limit_bytes=int(c["memory_limit_mb"]) * 1024 * 1024,
            segment_s=float(c["segment_s"]),
            spill_dir=Path(spill) if spill else None,
            spill_limit_bytes=int(c["spill_limit_mb"]) * 1024 * 1024,
        )
        self.rules = [parse_rule(r) for r in c["rules"]]
        self.metrics = MetricState()
        self.trigger_limiter = RateLimiter(float(c["trigger_min_interval_s"]))
        self.request_limiter = RateLimiter(float(c["request_min_interval_s"]))
        self.export_dir = Path(str(c["export_dir"]))
        self.exports: list[dict[str, Any]] = []  # the last few exports' replies, for status
        self.triggers_fired = 0
        self.auth_refused = 0
        self.profiled_jobs: dict[str, int] = {}  # job -> CLOCK_MONOTONIC ns of its job_begin
        self._export_lock = threading.Lock()
        self.flush_hooks: list[Callable[[], None]] = []  # run on the writer thread after each flush
        self._socket_path = socket_path
        self._observers: list[Callable[[str, np.ndarray], None]] = [self.metrics.observe]
        if socket_path is not None:
            self._control = ContinuousControlServer(self, socket_path)

    def _open_writer(self, meta: NodeMeta, start: tuple[int, int, int]) -> NodeTraceWriter:
        self._meta_at_start = meta
        return RetentionWriter(self.retention, self.tables, observers=self._observers,
                               on_flush=self._after_flush)

    def retention_observers_add(self, observe: Callable[[str, np.ndarray], None]) -> None:
        """Another consumer of every batch the writer thread retains (Prometheus' rank totals)."""
        self._observers.append(observe)

    def metrics_gpu_jobs(self) -> dict[int, str]:
        """GPU index -> the job whose processes used it last ('' when none or several)."""
        out: dict[int, str] = {}
        for g, pids in self.metrics.gpu_pids.items():
            jobs = {j for j in (self.jobs_tracker.job_of(p) for p in pids) if j is not None}
            out[g] = jobs.pop() if len(jobs) == 1 else ""
        return out

    def _after_flush(self) -> None:
        self.metrics.end_of_flush()
        self.evaluate_rules()
        for hook in self.flush_hooks:
            try:
                hook()
            except (OSError, ValueError, RuntimeError) as e:
                self.report_error("continuous", f"flush hook failed: {type(e).__name__}: {e}")

    def evaluate_rules(self, now: float | None = None) -> list[threading.Thread]:
        """Fire the rules that held for their time while a job ran; returns the export threads
        started (an export flushes the writer, so it cannot run on the writer thread, where this is)."""
        t = time.monotonic() if now is None else now
        done: list[threading.Thread] = []
        running = self.jobs_tracker.any_job_running()
        stale_s = max(10.0, 3.0 / max(1e-3, float(self.ccfg["nvml_rate_hz"])))
        for rule in self.rules:
            value = self.metrics.current(rule.metric, stale_s) if running else None
            if value is None or not rule.holds(value):
                rule.holding_since = None
                continue
            if rule.holding_since is None:
                rule.holding_since = t
            if t - rule.holding_since < rule.for_s:
                continue
            rule.holding_since = t  # held again for its time before it fires again
            if not self.trigger_limiter.allow("rules", t):
                continue
            rule.fired += 1
            self.triggers_fired += 1
            th = threading.Thread(target=self.export_to_dir, args=(f"rule: {rule.text} (value {value:.3g})",),
                                  kwargs={"tag": "rule"}, name="rule-export", daemon=True)
            th.start()
            done.append(th)
        return done

    def export_to_dir(self, reason: str, *, tag: str, job: str | None = None) -> dict[str, Any]:
        """An export of the last trigger_window_min into export_dir (root-only), for a trigger."""
        check_private_dir(self.export_dir, "continuous export directory")
        now = monotonic_ns()
        name = f"{tag}-{time.strftime('%Y%m%dT%H%M%S')}-{now}" + (f"-job{job}" if job else "") + ".h5"
        path = self.export_dir / name
        try:
            return self.export(now - int(float(self.ccfg["trigger_window_min"]) * 60e9), now, path=path, job=job,
                               reason=reason)
        except (CollectorError, OSError) as e:
            self.report_error("continuous", f"triggered export failed: {e}")
            return {"ok": False, "error": str(e)}

    def export(self, t_from_ns: int, t_to_ns: int, *, path: Path | None = None, fd: int | None = None,
               job: str | None = None, reason: str = "", nodelist: str = "") -> dict[str, Any]:
        """Write a v1 node file of the window (to `path`, or to the open descriptor `fd`)."""
        if t_to_ns <= t_from_ns:
            raise ContinuousError("export window is empty")
        if not self.request_flush(timeout_s=10.0):
            raise ContinuousError(f"collector not recording (state {self.state})")
        pids: set[int] | None = None
        if job is not None:
            pids = self.jobs_tracker.job_pids(job, t_from_ns, t_to_ns)
            if pids is None:
                raise ContinuousError(f"job {job} has not run on this node within the retention "
                                      f"({self.ccfg['retention_min']} min)")
        with self._export_lock:
            return write_export(self, t_from_ns, t_to_ns, pids=pids, job=job, path=path, fd=fd, reason=reason,
                                nodelist=nodelist)

    def wait_for_exports(self, timeout_s: float) -> bool:
        """Until the export being written (a trigger's, on a daemon thread) is done, at most
        timeout_s: the process then leaves without finalization. False: one is still writing."""
        if not self._export_lock.acquire(timeout=timeout_s):
            return False
        self._export_lock.release()
        return True

    def status(self) -> dict[str, Any]:
        s = super().status()
        s["continuous"] = {
            "retention": self.retention.status(),
            "jobs": self.jobs_tracker.jobs(),
            "rules": [{"rule": r.text, "fired": r.fired, "holding_since": r.holding_since} for r in self.rules],
            "triggers_fired": self.triggers_fired,
            "triggers_refused": self.trigger_limiter.refused_total(),
            "requests_refused": self.request_limiter.refused_total(),
            "auth_refused": self.auth_refused,
            "exports": self.exports[-10:],
            "profiled_jobs": sorted(self.profiled_jobs),
        }
        return s


def write_export(c: ContinuousCollector, t_from_ns: int, t_to_ns: int, *, pids: set[int] | None,
                 job: str | None, path: Path | None, fd: int | None, reason: str,
                 nodelist: str = "") -> dict[str, Any]:
    t_start = time.monotonic()
    span = c.retention.span()
    asked_s = (t_to_ns - t_from_ns) / 1e9
    have_from = max(t_from_ns, span[0]) if span else t_to_ns
    have_s = max(0.0, (t_to_ns - have_from) / 1e9)
    complete = span is not None and span[0] <= t_from_ns
    note = "" if complete else (
        f"asked for {asked_s:.0f} s, this node retains {have_s:.0f} s"
        + (f" (from {(t_to_ns - have_from) / 1e9:.0f} s before the end of the window)" if span else " (nothing yet)"))
    data = c.retention.window(t_from_ns, t_to_ns, pids)
    pairs = data.get(schema.CLOCK_PAIRS.path)
    if pairs is None or not len(pairs):
        raise ContinuousError("no clock pair retained for this window: nothing to export")
    start_rt = int(pairs["realtime_ns"][-1]) - (int(pairs["monotonic_ns"][-1]) - have_from)
    meta0 = c._meta()
    meta = NodeMeta(job_id=job or "", node=meta0.node, modes=meta0.modes, rates=meta0.rates,
                    config=meta0.config, job_nodelist=nodelist)
    target = path
    tmp: Path | None = None
    if fd is not None:
        base = c.retention.spill_dir or c.export_dir
        check_private_dir(base, "continuous export scratch directory")
        tmp = base / f".export-{os.getpid()}-{monotonic_ns()}.h5"
        target = tmp
    assert target is not None
    window = {"asked_from_ns": t_from_ns, "asked_to_ns": t_to_ns, "from_ns": have_from, "asked_s": asked_s,
              "have_s": round(have_s, 3), "complete": complete, "note": note, "job": job or "",
              "pids": sorted(pids) if pids is not None else None, "reason": reason}
    try:
        w = NodeTraceWriter(target, meta, c.tables, compression=str(c.cfg["compression"]),
                            start_monotonic_ns=have_from, start_realtime_ns=start_rt)
        try:
            for p, rows in data.items():
                if p in w.tables:
                    w.append(p, rows)
            now_pair = schema.CLOCK_PAIRS.empty(1)
            from gpuprof.collector.sources.clock import clock_pair

            now_pair[0] = clock_pair()
            w.append(schema.CLOCK_PAIRS.path, now_pair)

            def extra(f: Any) -> None:
                c._at_seal(f)
                f.attrs["continuous_window_json"] = json.dumps(window, sort_keys=True)
                f.attrs["continuous"] = True
                if not complete:
                    f.attrs["window_incomplete"] = note

            w.seal(drops=c.drops(), extra=extra)
        except BaseException:
            w.close_unsealed()
            raise
        size = target.stat().st_size
        if fd is not None:
            _copy_to_fd(target, fd)
    finally:
        if tmp is not None:
            _unlink(tmp)
    reply: dict[str, Any] = {"ok": True, "file": str(path) if path else "(your descriptor)", "bytes": size,
             "seconds": round(time.monotonic() - t_start, 3), "window": window}
    reply["window"] = {k: v for k, v in window.items() if k != "pids"}
    reply["window"]["pids"] = len(pids) if pids is not None else None
    c.exports.append({k: reply[k] for k in ("file", "bytes", "seconds")} | {"reason": reason})
    del c.exports[:-10]
    log.info("continuous: exported %.0f s%s (%d bytes) %s", have_s, f" of job {job}" if job else "", size, reason)
    return reply


def _copy_to_fd(src: Path, fd: int) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        # a pipe or a socket could block the collector's API thread until its reader reads
        raise ContinuousError("the descriptor passed is not a regular file")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    with open(src, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                n = os.write(fd, view)
                view = view[n:]


# --- the local API ------------------------------------------------------------------------------
def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED: the kernel's, not the client's word)."""
    data = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return pid, uid, gid


class ContinuousControlServer(ControlServer):
    """The control socket of continuous mode: mode 0666 (any local user may connect), every request
    checked against the peer's credentials (module doc; docs/continuous.md, "Local API")."""

    def __init__(self, collector: ContinuousCollector, path: Path) -> None:
        super().__init__(collector, path, mode=0o666)
        self.cc = collector

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(CLIENT_READ_TIMEOUT_S)
        data = b""
        fds: list[int] = []
        try:
            while b"\n" not in data and len(data) < MAX_REQUEST_BYTES:
                msg, got, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST_BYTES, 2)
                fds.extend(got)
                if not msg:
                    break
                data += msg
        except TimeoutError:
            pass
        try:
            _pid, uid, _gid = peer_credentials(conn)
            reply = self.dispatch_as(data.split(b"\n", 1)[0], uid, fds[0] if fds else None)
        finally:
            for f in fds:
                os.close(f)
        conn.sendall(json.dumps(reply, sort_keys=True).encode() + b"\n")

    def refuse(self, why: str) -> dict[str, Any]:
        self.cc.auth_refused += 1
        log.warning("continuous: request refused: %s", why)
        return {"ok": False, "refused": True, "error": why}

    def dispatch_as(self, line: bytes, uid: int, fd: int | None) -> dict[str, Any]:
        try:
            req = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {"ok": False, "error": "request is not one line of JSON"}
        if not isinstance(req, dict):
            return {"ok": False, "error": "request is not a JSON object"}
        cmd = req.get("cmd")
        c = self.cc
        job = req.get("job")
        if job is not None and not (isinstance(job, str) and job.isdigit()):
            return {"ok": False, "error": f"job must be a job id (digits), got {job!r}"}
        if cmd in ("status", "flush", "seal", "job_begin", "job_end") and uid != 0:
            return self.refuse(f"uid {uid}: '{cmd}' is root's only")
        if cmd in ("status", "flush", "seal"):
            return self.dispatch(json.dumps({"cmd": cmd}).encode())
        if cmd in ("export", "trigger", "summary"):
            if uid != 0:
                if job is None:
                    return self.refuse(f"uid {uid}: only root may export the whole node; give a job of yours")
                owner = c.jobs_tracker.job_owner(job)
                if owner != uid:
                    return self.refuse(f"uid {uid}: job {job} is not yours"
                                       + (" (owner unknown)" if owner is None else ""))
                if cmd != "summary" and not c.request_limiter.allow(f"uid:{uid}"):
                    return {"ok": False, "rate_limited": True,
                            "error": f"at most one export per {c.request_limiter.min_interval_s:g} s per user"}
            try:
                if cmd == "summary":
                    return summary(c, job)
                last_s = float(req.get("last_s", float(c.ccfg["trigger_window_min"]) * 60))
                if not math.isfinite(last_s) or last_s <= 0:
                    return {"ok": False, "error": f"last_s must be a positive number, got {req.get('last_s')!r}"}
                now = monotonic_ns()
                if cmd == "trigger":
                    return c.export_to_dir(f"trigger from uid {uid}: {str(req.get('reason', ''))[:200]}",
                                           tag="api", job=job)
                if fd is None:
                    return {"ok": False, "error": "export needs the output file's descriptor (SCM_RIGHTS)"}
                return c.export(now - int(last_s * 1e9), now, fd=fd, job=job,
                                reason=f"export by uid {uid}: last {last_s:g} s")
            except (CollectorError, OSError, ValueError) as e:
                return {"ok": False, "error": str(e)}
        if cmd == "job_begin":
            if job is None:
                return {"ok": False, "error": "job_begin needs a job"}
            c.profiled_jobs[job] = monotonic_ns()
            return {"ok": True, "job": job, "retention_s": c.retention.retention_ns / 1e9}
        if cmd == "job_end":
            if job is None or fd is None:
                return {"ok": False, "error": "job_end needs a job and the node file's descriptor"}
            began = c.profiled_jobs.pop(job, None)
            now = monotonic_ns()
            if began is None:
                return {"ok": False, "error": f"job {job}: no job_begin seen by this collector"}
            nodelist = req.get("nodelist", "")
            if not isinstance(nodelist, str):
                return {"ok": False, "error": "nodelist must be a Slurm host list string"}
            try:
                return c.export(began, now, fd=fd, job=job, reason=f"--profile-gpu job {job} ended",
                                nodelist=nodelist)
            except (CollectorError, OSError) as e:
                return {"ok": False, "error": str(e)}
        return {"ok": False, "error": f"unknown cmd {cmd!r}; known: {', '.join(CONTINUOUS_COMMANDS)}"}


def summary(c: ContinuousCollector, job: str | None) -> dict[str, Any]:
    """Per communicator of the job's (or the node's) retained collective calls: the last instances
    seen and each rank's arrival (t_enter) there, for `gpuprof watch` (collector/watch.py)."""
    from gpuprof.collector.watch import node_summary

    c.request_flush(timeout_s=5.0)  # the last seconds are in the rings until the writer drains them
    now = monotonic_ns()
    t_from = now - int(60e9)
    pids = c.jobs_tracker.job_pids(job, t_from, now) if job else None
    if job and pids is None:
        return {"ok": False, "error": f"job {job} has not run on this node within the retention"}
    data = c.retention.window(t_from, now, pids)
    return node_summary(data, node=c.opts.node or os.uname().nodename)


def client_request(socket_path: str | os.PathLike[str], req: dict[str, Any], *, fd: int | None = None,
                   timeout_s: float = EXPORT_WAIT_S) -> dict[str, Any]:
    """One request to a continuous collector (with a descriptor, for export/job_end)."""
    return exchange(socket_path, req, fd=fd, timeout_s=timeout_s, who="continuous collector",
                    absent="is gpuprof-continuous running?")


def export_to_file(socket_path: str | os.PathLike[str], output: Path, *, last_s: float,
                   job: str | None = None) -> dict[str, Any]:
    """`gpuprof export --last`: open OUTPUT as the calling user, hand its descriptor to the collector."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        reply = client_request(socket_path, {"cmd": "export", "last_s": last_s, **({"job": job} if job else {})},
                               fd=fd)
    finally:
        os.close(fd)
    if not reply.get("ok"):
        _unlink(output)
    return reply


# --- a --profile-gpu job on a node that runs continuous mode (the prolog's and epilog's side) -----
def running_collector(socket_path: str | os.PathLike[str], timeout_s: float = 2.0) -> bool:
    """True when a continuous collector answers on the socket (then the prolog starts no second one)."""
    try:
        return client_request(socket_path, {"cmd": "status"}, timeout_s=timeout_s).get("state") == "recording"
    except CollectorError:
        return False


def join_job(socket_path: str | os.PathLike[str], job: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Prolog (root): the running collector records the job from now on, for job_end's node file."""
    reply = client_request(socket_path, {"cmd": "job_begin", "job": job}, timeout_s=timeout_s)
    if not reply.get("ok"):
        raise ContinuousError(f"continuous collector refused job_begin of job {job}: {reply.get('error')}")
    return reply


def end_job(socket_path: str | os.PathLike[str], job: str, node_file: Path, *, nodelist: str = "",
            timeout_s: float = EXPORT_WAIT_S) -> dict[str, Any]:
    """Epilog (root): the job's node file (its pids, from job_begin to now) written to node_file,
    the same v1 file a per-job collector seals, for the usual placement and merge."""
    fd = os.open(node_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        reply = client_request(socket_path, {"cmd": "job_end", "job": job, "nodelist": nodelist}, fd=fd,
                               timeout_s=timeout_s)
    finally:
        os.close(fd)
    if not reply.get("ok"):
        _unlink(node_file)
        raise ContinuousError(f"continuous collector could not write job {job}'s node file: {reply.get('error')}")
    return reply
