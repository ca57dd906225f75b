"""Fast path of mode `collectives`: drain the shared-memory rings that the LD_PRELOAD interposers
(bpf/fastpath/: PMPI wrapper, NCCL interposer) write in each job process.

The interposers write the same gp_call/gp_comm records as the uprobes (bpf/gpuprof_events.h) and
count sequence numbers the same way; this source feeds them to the same CommRegistry, so the rows
and ids do not depend on the path (column `path` says which one). The ring's byte layout comes from
the build (bpf/fastpath/build/layout.json, printed by a C program from the structs).

A ring file is written by the job's user, so it is read as untrusted input (docs/probes.md, "Who
may write a ring"): rings live in a per-job directory that the prolog creates as root for the job's
uid (mode 0700, `job_ring_dir`), which the collector opens without following a link and accepts only
when nobody but that uid (and root) can write into it; a ring is opened relative to that directory
with O_NOFOLLOW, must be a regular file with one link owned by the job's uid, and its writer pid
(named in the file name and in the header) must be a process of the job. Its header is checked
against the layout and it is read with pread (a truncated file gives a short read, not a SIGBUS).
Every ring refused, and every `.failed` note an interposer left when it could not create its ring,
is counted and reported (/diagnostics/errors, `status`, the file attribute `fastpath_json`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import stat
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gpuprof.collector import native, schema
from gpuprof.collector.bpf_support import read_environ
from gpuprof.collector.fastpath_env import (
    CUDA_INJECTION64_PATH,
    CUPTI_INJECTION,
    GPUPROF_NVTX,
    LAYOUT,
    NCCL_PROFILER,
    NCCL_PROFILER_PLUGIN,
    NVTX_INJECTION,
    NVTX_INJECTION64_PATH,
    cupti_on,
    job_ring_dir,
    nccl_profiler_on,
    nvtx_on,
    resolve_paths,
)
from gpuprof.collector.proctrack import in_cgroups
from gpuprof.collector.sources.base import CALL_SOURCE_SHARE, Batch, Source, SourceContext, SourceUnavailable
from gpuprof.collector.sources.collective_calls import CALL_DTYPE, CommRegistry, stable_id
from gpuprof.collector.sources.probe_table import GP_BYTES_UNKNOWN, LIB_CODES, PATH_CODES

# A ring whose writer pid is not (yet) a job process is retried this long before it is refused:
# the process tracker picks up new processes once a second (and remembers gone ones for a minute:
# ProcessTracker.recent_pids), the drain runs every DRAIN_INTERVAL_S.
PID_GRACE_S = 5.0
# The drain's rate. Python drains every DRAIN_INTERVAL_S while the native watch
# (collector/native/ringwatch.c) looks at every ring each WATCH_INTERVAL_S and asks for a drain at
# once when one holds more than capacity / WATCH_FILL records or a file appears in the directory:
# a Python wake-up costs more than the reads (docs/collector.md, "Cost"). A ring of 65536 records
# then fills only above (65536 - 16384) / 0.1 s, ~490k calls/s in one process, where the 5 Hz
# Python drain it replaces filled above ~330k/s. Without the watch (library not built, or a caller
# that samples by hand), Python drains every PYTHON_DRAIN_INTERVAL_S, as before.
# Every 2 s rather than every second: a drain's cost is almost all per ring and per table, not per
# record (16 rings of ~30 calls/s each: 0.27 % of a core drained each second, 0.13 % every 2 s,
# docs/collector.md), the rings are the buffer and the watch drains a filling one early, and the
# writer puts rows in the file only every collector.flush_interval_s (4 s) anyway.
DRAIN_INTERVAL_S = 2.0
WATCH_INTERVAL_S = 0.1
WATCH_FILL = 4
PYTHON_DRAIN_INTERVAL_S = 0.2
# A ring listed before its process finished writing its header, or whose writer the tracker has not
# seen yet, is looked at again this soon, not at the next drain: the directory does not change
# again to wake the watch, and a rank making 130k calls a second (MEEP) fills its ring in 0.5 s,
# well before the next drain 2 s later (measured: 371k records lost at a job's start).
RING_RETRY_S = 0.05
# Ring watches whose thread did not stop (stuck in a wake-up): they and their callback are kept
# alive for good, since that thread may still use them.
_STUCK_WATCHES: list[Any] = []


@lru_cache(maxsize=1)
def layout() -> dict[str, Any]:
    try:
        return json.loads(LAYOUT.read_text())
    except FileNotFoundError:
        raise SourceUnavailable(f"fast path not built: {LAYOUT} missing (make -C bpf/fastpath)") from None


def _dtype(fields: list[list[Any]], base: int, itemsize: int) -> np.dtype:
    return np.dtype({"names": [f[0] for f in fields], "formats": [f[2] for f in fields],
                     "offsets": [base + f[1] for f in fields], "itemsize": itemsize})


class Ring:
    """One process's ring: header checked, records read with pread, tail advanced with pwrite."""

    def __init__(self, path: str, lay: dict[str, Any], dir_fd: int | None = None,
                 owner: int | None = None) -> None:
        """Opens path (relative to dir_fd when given) without following a symlink or blocking on
        a FIFO; ValueError when it is not a regular file with one link, or (owner given) not owned
        by that uid."""
        self.path = path
        self.lay = lay
        name = os.path.basename(path) if dir_fd is not None else path
        self.fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            if st.st_nlink != 1:
                raise ValueError(f"has {st.st_nlink} links (a hard link to another file)")
            if owner is not None and st.st_uid != owner:
                raise ValueError(f"owned by uid {st.st_uid}, not by the job's uid {owner}")
            self.uid = st.st_uid
            self.hdr_dtype = _dtype(lay["header"], 0, lay["header_size"])
            raw = os.pread(self.fd, lay["header_size"], 0)
            if len(raw) < lay["header_size"]:
                raise ValueError("not initialized yet (short header)")
            h = np.frombuffer(raw, dtype=self.hdr_dtype)[0]
            if int(h["magic"]) != lay["magic"] or int(h["version"]) != lay["version"]:
                raise ValueError("not a gpuprof ring of this version (or not initialized yet)")
            if int(h["record_size"]) != lay["record_size"]:
                raise ValueError("record size differs from this build")
            cap = int(h["capacity"])
            if cap < 64 or cap > 1 << 24 or cap & (cap - 1):
                raise ValueError(f"bad capacity {cap}")
            self.capacity = cap
            # The writer's node ($SLURMD_NODENAME), '' when it ran outside a Slurm step.
            self.node = bytes(h["node"]).split(b"\0", 1)[0].decode("utf-8", "replace")
            self.pid = int(h["pid"])
            self.tail = int(h["tail"])
        except BaseException:
            os.close(self.fd)
            raise
        rs = lay["record_size"]
        self.rec_dtype = _dtype(lay["record"], 0, rs)
        self.call_dtype = _dtype(lay["call"], lay["call_offset"], rs)
        self.comm_dtype = _dtype(lay["comm"], lay["call_offset"], rs)
        self.native = _native_ring_rows()
        self.writer_uid: int | None = None
        self.keep_raw = False
        self.raw = np.zeros(0, dtype=CALL_DTYPE)
        self.seq_dtype = _dtype([f for f in lay["record"] if f[0] == "seq"], 0, rs)
        self.head_offset = next(f[1] for f in lay["header"] if f[0] == "head")
        self.tail_offset = next(f[1] for f in lay["header"] if f[0] == "tail")
        self.dropped_offset = next(f[1] for f in lay["header"] if f[0] == "dropped")
        # the plugin's and NVTX's record kinds (layout.json of a build that has them), by kind number
        self.extra_dtypes = {lay[f"rec_{k}"]: _dtype(lay[k], lay["call_offset"], rs)
                             for k in EXTRA_KINDS if f"rec_{k}" in lay and k in lay}
        if "rec_cuda_name" in lay:  # kernel names travel as string records
            self.extra_dtypes[lay["rec_cuda_name"]] = _dtype(lay["nvtx_string"], lay["call_offset"], rs)
        self.extra: dict[int, np.ndarray] = {}
        self.last_read = 0  # records the last drain read (collector/catchup.py)

    def dropped(self) -> int:
        raw = os.pread(self.fd, 8, self.dropped_offset)
        return int.from_bytes(raw, "little") if len(raw) == 8 else 0

    def drain(self) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """Complete records from tail on, in order; stops at the first slot not yet written.
        Returns the calls, as /collectives/calls rows short of their communicator columns when the
        C conversion is built (self.native), else as a view of the ring's bytes with the gp_call
        field names; and the communicator records as dicts. At 10,000 calls/s per rank this is
        the collector's hot path: nothing is copied field by field."""
        rs, hs, mask = self.lay["record_size"], self.lay["header_size"], self.capacity - 1
        self.raw = self.raw[:0]
        self.last_read = 0
        # head (written by the producers) is only a hint of how much to read: every record is
        # still checked by its own seq before it is taken.
        raw_head = os.pread(self.fd, 8, self.head_offset)
        head = int.from_bytes(raw_head, "little") if len(raw_head) == 8 else self.tail
        want_total = min(max(head - self.tail, 1), self.capacity)
        chunks: list[bytes] = []
        while want_total > 0:
            start = self.tail & mask
            n = min(want_total, self.capacity - start)
            raw = os.pread(self.fd, n * rs, hs + start * rs)
            got = len(raw) // rs
            if got == 0:
                break
            seq = np.frombuffer(raw, dtype=self.seq_dtype, count=got)["seq"]
            ok = seq == np.arange(self.tail + 1, self.tail + 1 + got, dtype=np.uint64)
            k = got if ok.all() else int(np.argmin(ok))
            if k:
                chunks.append(raw if k == got else raw[: k * rs])
                self.tail += k
                want_total -= k
            if k < n:
                break
        self.extra = {}
        # records read, not the header's head: a fill the job's user writes in the header must not
        # lift the collector's priority (collector/catchup.py)
        self.last_read = sum(len(c) for c in chunks) // rs
        if not chunks:
            return np.zeros(0, dtype=CALL_DTYPE), []
        os.pwrite(self.fd, self.tail.to_bytes(8, "little"), self.tail_offset)
        buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        count = len(buf) // rs
        if self.extra_dtypes:
            # plugin and NVTX records (copied out: the calls' conversion below does not see them)
            kinds = np.frombuffer(buf, dtype=self.rec_dtype, count=count)["kind"]
            if (kinds > self.lay["rec_comm"]).any():
                self.extra = {k: np.frombuffer(buf, dtype=dt, count=count)[kinds == k]
                              for k, dt in self.extra_dtypes.items() if (kinds == k).any()}
        if self.native is not None:
            return self._native_rows(buf, count)
        kinds = np.frombuffer(buf, dtype=self.rec_dtype, count=count)["kind"]
        is_call = kinds == self.lay["rec_call"]
        calls = np.frombuffer(buf, dtype=self.call_dtype, count=count)
        if not is_call.all():
            calls = calls[is_call]
        return calls, self._comms(buf, count, kinds == self.lay["rec_comm"])

    def _comms(self, buf: bytes, count: int, which: np.ndarray) -> list[dict[str, Any]]:
        comms_v = np.frombuffer(buf, dtype=self.comm_dtype, count=count)[which]
        return [{name: (bytes(r[name]) if name == "uid" else int(r[name])) for name in self.comm_dtype.names or ()}
                for r in comms_v]

    def _native_rows(self, buf: bytes, count: int) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """The records as /collectives/calls rows straight away (collector/native/ringrows.c);
        their communicator columns are filled by the registry."""
        rows = schema.COLLECTIVE_CALLS.empty(count)
        slots = np.empty(count, np.int64)
        n_comm = ctypes.c_long()
        n = self.native.gp_records_to_rows(buf, count, PATH_CODES["fastpath"], RECV_OP, rows.ctypes.data,
                                           slots.ctypes.data, ctypes.byref(n_comm))
        which = np.zeros(count, bool)
        which[slots[: n_comm.value]] = True
        if self.keep_raw:  # tests: the decoded records too (fields the rows do not keep, as aux)
            kinds = np.frombuffer(buf, dtype=self.rec_dtype, count=count)["kind"]
            self.raw = np.frombuffer(buf, dtype=self.call_dtype, count=count)[kinds == self.lay["rec_call"]]
        return rows[:n], self._comms(buf, count, which) if n_comm.value else []

    def close(self) -> None:
        os.close(self.fd)


RECV_OP = schema.COLLECTIVE_OPS.index("MPI_Recv")
EXTRA_KINDS = ("nccl_op", "nccl_dev", "nccl_comm", "nvtx_range", "nvtx_string", "cuda_kernel", "cuda_launch")


@lru_cache(maxsize=1)
def _native_ring_rows() -> Any:
    """The C conversion of ring records to rows, or None (then numpy does it, column by column)."""
    try:
        lib = native.sampler()
        native.check_ring_layout(lib, layout()["record_size"], schema.COLLECTIVE_CALLS.dtype)
    except native.NativeUnavailable:
        return None
    return lib


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _descends_from(pid: int, ancestors: set[int], depth: int = 64) -> bool:
    """True when a live process pid has one of ancestors as parent, grandparent, ..."""
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid in ancestors:
            return True
        if pid <= 1:
            return False
    return False


MAX_DETAIL = 20  # refused rings and failure notes named in status and fastpath_json (all are counted)
NOTE_MAX_BYTES = 256


class FastpathSource(Source):
    """Drains the rings of the job's processes in the job's ring directory (`job_ring_dir`)."""

    name = "collectives_fastpath"
    ring_share = CALL_SOURCE_SHARE  # calls come fast: collector/ring.py split_capacity
    tables = (schema.COLLECTIVE_CALLS, schema.COMMUNICATORS, schema.DEVICE_TIMES, schema.NVTX_RANGES,
              schema.NVTX_STRINGS, schema.KERNEL_ACTIVITY, schema.KERNEL_ACTIVITY_NAMES,
              schema.KERNEL_ACTIVITY_LAUNCHES)
    interval_s = PYTHON_DRAIN_INTERVAL_S  # DRAIN_INTERVAL_S once the native watch runs (start)

    def __init__(self, ring_dir: str | None = None) -> None:
        # ring_dir None: the job's directory, /dev/shm/gpuprof-<job>@<node> (tests name their own)
        self.ring_dir = ring_dir
        self.rings: dict[str, Ring] = {}
        self.pending: dict[str, tuple[Ring, float]] = {}  # writer pid not (yet) a job process
        self.uninitialized: dict[str, float] = {}  # ring name -> when first listed with no header yet
        self.refused: dict[str, str] = {}  # ring name -> why it was not read (every one counted)
        self.failed: dict[str, str] = {}  # `.failed` note -> what the interposer says went wrong
        self.others: set[str] = set()  # rings of another virtual node of this host (not ours to read)
        self.dir_problem = ""
        self.pid_grace_s = PID_GRACE_S
        self.job_pids: set[int] = set()
        self.job_uids: set[int] = set()
        self.dropped_total = 0  # records the interposers could not write (ring full), all rings
        self.keep_raw = False
        self.raw_calls: list[np.ndarray] = []
        self.events_comm: list[dict[str, Any]] = []
        self._dir_fd: int | None = None
        self._ring_count = 0
        self.plugin_on = self.nvtx_on = self.cupti_on = False
        self.gpu: GpuRecords | None = None  # made at start (its part size is the build's layout)
        self.env_checked: set[int] = set()
        self.stepped_aside: set[tuple[str, str]] = set()  # (variable, the job's value) reported
        # the native watch (collector/native/ringwatch.c) and its thread; None: Python drains at 5 Hz
        self._watch: int | None = None
        self._watch_lib: Any = None
        self._watch_ticker: native.SharedTicker | None = None
        self._watch_wake: Any = None  # the ctypes callback: kept alive as long as the watch
        self._watch_rings = np.zeros(0, native.RINGWATCH_DTYPE)
        self.drain_how = ""
        self._early_at_stop: dict[str, int] = {}
        self._watch_failed = False

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        paths = resolve_paths(ctx.config)
        try:
            self.plugin_on = nccl_profiler_on(ctx.config)
            # sources.nvtx.inject = job: the job's processes decide (any may have GPUPROF_NVTX=1)
            self.nvtx_on = nvtx_on(ctx.config, {GPUPROF_NVTX: "1"})
            self.cupti_on = cupti_on(ctx.modes, ctx.config)
        except ValueError as e:
            raise SourceUnavailable(str(e)) from None
        if "collectives" not in ctx.modes:  # mode kernels alone: the rings carry CUPTI's records only
            paths = {lib: "uprobe" for lib in paths}
            self.plugin_on = self.nvtx_on = False
        if (not any(paths[lib] == "fastpath" for lib in ("mpi", "nccl")) and not self.plugin_on
                and not self.nvtx_on and not self.cupti_on):
            raise SourceUnavailable("no library uses the fast path for this job (config)")
        self.lay = layout()
        self.gpu = GpuRecords(int(self.lay.get("nvtx_part_bytes", 60)))
        if self.ring_dir is None:
            try:
                self.ring_dir = str(job_ring_dir(ctx.job_id, ctx.node))
            except ValueError as e:
                raise SourceUnavailable(str(e)) from None
        job = re.escape(ctx.job_id)
        self.pattern = re.compile(rf"^gpuprof-{job}-(\d+)(?:\.\d)?$")
        self.note_pattern = re.compile(rf"^gpuprof-{job}-(\d+)\.failed$")
        self.registry = CommRegistry(ctx.node)
        self._start_watch(ctx)  # before the first scan: its view of the directory precedes the listing
        self._scan()

    def _start_watch(self, ctx: SourceContext) -> None:
        """Drain every DRAIN_INTERVAL_S, early when the native watch asks; where it cannot
        run, every PYTHON_DRAIN_INTERVAL_S, and drain_how says why."""
        python = f"python every {PYTHON_DRAIN_INTERVAL_S} s"
        if ctx.request_sample is None:
            self.drain_how = f"{python} (the caller cannot be asked for an early drain)"
            return
        head = next(f[1] for f in self.lay["header"] if f[0] == "head")
        tail = next(f[1] for f in self.lay["header"] if f[0] == "tail")
        try:
            lib = native.sampler()
            native.check_ringwatch_layout(lib, head, tail)
        except native.NativeUnavailable as e:
            self.drain_how = f"{python} ({e})"
            return
        wake = native.WAKE_FN(ctx.request_sample)
        w = lib.gp_ringwatch_new(-1, wake)
        if not w:
            self.drain_how = f"{python} (ring watch: {os.strerror(ctypes.get_errno())})"
            return
        try:
            ticker = native.SharedTicker(lib, "gp_ringwatch_tick", w, WATCH_INTERVAL_S)
        except native.NativeUnavailable as e:
            lib.gp_ringwatch_free(w)
            self.drain_how = f"{python} ({e})"
            return
        self._watch, self._watch_lib, self._watch_ticker, self._watch_wake = w, lib, ticker, wake
        self.interval_s = DRAIN_INTERVAL_S
        self.drain_how = (f"native watch every {WATCH_INTERVAL_S} s, python every {DRAIN_INTERVAL_S} s "
                          f"or when a ring is 1/{WATCH_FILL} full or the directory changed")

    def _watch_set(self, dfd: int | None) -> None:
        """Hand the rings to watch to the native watch; also tells it a drain is under way (it may
        ask for the next one). Called before the listing, and again when rings were added."""
        if self._watch is None:
            return
        # Rings are only added while the source runs (closed at stop, after the watch stopped), so
        # the list changed when its length did.
        if len(self._watch_rings) != len(self.rings):
            arr = np.zeros(len(self.rings), native.RINGWATCH_DTYPE)
            arr["fd"] = [r.fd for r in self.rings.values()]
            arr["threshold"] = [r.capacity // WATCH_FILL for r in self.rings.values()]
            rc = self._watch_lib.gp_ringwatch_set(self._watch, arr.ctypes.data, len(arr), -1 if dfd is None else dfd)
            if rc == 0:
                self._watch_rings = arr
            elif not self._watch_failed:  # said once: it is tried again at each drain
                self._watch_failed = True
                self.ctx.report_error(self.name, f"ring watch: {os.strerror(-rc)}: rings added since are drained "
                                      f"every {DRAIN_INTERVAL_S} s only")
            return
        self._watch_lib.gp_ringwatch_set(self._watch, self._watch_rings.ctypes.data, len(self._watch_rings),
                                         -1 if dfd is None else dfd)

    def _stop_watch(self) -> None:
        if self._watch_ticker is None:
            return
        ticker, self._watch_ticker = self._watch_ticker, None
        if ticker.stop(2.0):
            self._early_at_stop = self.early_drains()  # for fastpath_json, written after stop
            self._watch_lib.gp_ringwatch_free(self._watch)
        else:
            _STUCK_WATCHES.append((ticker, self._watch, self._watch_wake))
        self._watch = None

    def early_drains(self) -> dict[str, int]:
        """Drains the native watch asked for before their tick: a ring filled, a file appeared."""
        if self._watch is None:
            return self._early_at_stop
        counts = (ctypes.c_uint64 * 2)()
        self._watch_lib.gp_ringwatch_counts(self._watch, counts)
        return {"ring_full": int(counts[0]), "directory": int(counts[1])}

    # --- which rings are read ---------------------------------------------------------------------
    def _open_dir(self) -> int | None:
        """The ring directory, opened once without following a symlink, and accepted only when no
        one but the job's uid and root can write into it; None (reported once) otherwise."""
        if self._dir_fd is not None:
            return self._dir_fd
        assert self.ring_dir is not None
        problem = ""
        try:
            fd = os.open(self.ring_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            problem = f"ring directory {self.ring_dir} missing (the prolog creates it): no fast-path record"
        except OSError as e:
            why = "is a symlink or not a directory" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
            problem = f"ring directory {self.ring_dir} refused: {why}"
        else:
            st = os.fstat(fd)
            allowed = {0, os.geteuid()} | ({self.ctx.uid} if self.ctx.uid is not None else set())
            if st.st_uid not in allowed:
                problem = f"ring directory {self.ring_dir} refused: owned by uid {st.st_uid}"
            elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                problem = f"ring directory {self.ring_dir} refused: writable by others (mode {st.st_mode & 0o7777:o})"
            if problem:
                os.close(fd)
            else:
                self._dir_fd = fd
                self.dir_problem = ""
                return fd
        if problem != self.dir_problem:
            self.dir_problem = problem
            self.ctx.report_error(self.name, problem[:240])
        return None

    def _refuse(self, name: str, why: str, ring: Ring | None = None) -> None:
        if ring is not None:
            ring.close()
        self.refused[name] = why
        self.ctx.report_error(self.name, f"ring {name} refused: {why} ({len(self.refused)} refused so far)"[:240])

    def _note(self, dfd: int, name: str) -> None:
        """An interposer's `.failed` note: read (no symlink, no FIFO, at most 256 bytes) and counted."""
        text = "?"
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            text = f"unreadable note: {e.strerror}"
        else:
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    text = os.read(fd, NOTE_MAX_BYTES).decode("utf-8", "replace").strip() or "?"
            finally:
                os.close(fd)
        m = self.note_pattern.match(name)
        self.failed[name] = text
        self.ctx.report_error(self.name, f"process {m[1] if m else '?'} could not create its ring ({text}): its "
                              f"calls are not recorded ({len(self.failed)} such processes so far)"[:240])

    def _check_job_env(self, pid: int) -> None:
        """A job process whose environment names its own NCCL profiler plugin, NVTX or CUDA
        injection has ours stepped aside (the TaskProlog did not set it): said once per value."""
        self.env_checked.add(pid)
        wanted = (([(NCCL_PROFILER_PLUGIN, NCCL_PROFILER)] if self.plugin_on else [])
                  + ([(NVTX_INJECTION64_PATH, NVTX_INJECTION)] if self.nvtx_on else [])
                  + ([(CUDA_INJECTION64_PATH, CUPTI_INJECTION)] if self.cupti_on else []))
        if not wanted:
            return
        job_env = read_environ(pid)
        if self.ctx.config.get("sources.nvtx", {}).get("inject") == "job" and job_env.get(GPUPROF_NVTX) != "1":
            wanted = [w for w in wanted if w[0] != NVTX_INJECTION64_PATH]  # it did not ask for ours
        for var, ours in wanted:
            theirs = job_env.get(var, "")
            if theirs and theirs != str(ours) and (var, theirs) not in self.stepped_aside:
                self.stepped_aside.add((var, theirs))
                self.ctx.report_error(self.name, f"process {pid} sets {var}={theirs[:120]} itself: gpuprof's "
                                      "stepped aside, nothing is recorded through it"[:240])

    def _scan(self, final: bool = False) -> None:
        # recent, not current: a process may have come and gone between two drains (2 s apart)
        # while the tracker (1 s scans) saw it, and its ring is read after it ended
        for pid in self.ctx.recent_pids() - self.job_pids:
            self.job_pids.add(pid)
            uid = _uid_of(pid)
            if uid is not None:
                self.job_uids.add(uid)
            if pid not in self.env_checked:
                self._check_job_env(pid)
        dfd = self._open_dir()
        self._watch_set(dfd)  # before the listing: a file added after it asks for one more drain
        if dfd is None:
            return
        try:
            names = os.listdir(dfd)
        except OSError as e:
            self.ctx.report_error(self.name, f"ring directory {self.ring_dir}: {e.strerror}")
            return
        now = time.monotonic()
        self.retry_s = None
        for name in names:
            if name in self.rings or name in self.refused or name in self.failed or name in self.others:
                continue
            if self.note_pattern.match(name):
                self._note(dfd, name)
                continue
            m = self.pattern.match(name)
            if not m:
                continue
            pending = self.pending.pop(name, None)
            if pending is not None:
                ring, first_seen = pending
            else:
                try:
                    ring = Ring(os.path.join(self.ring_dir or "", name), self.lay, dir_fd=dfd, owner=self.ctx.uid)
                except (OSError, ValueError) as e:
                    # Not yet initialized (magic is written last) is retried soon, for PID_GRACE_S;
                    # anything else refused.
                    if "not initialized" in str(e):
                        first = self.uninitialized.setdefault(name, now)
                        if now - first < self.pid_grace_s:
                            self.retry_s = RING_RETRY_S
                        elif not final:
                            del self.uninitialized[name]
                            self._refuse(name, f"{e} after {self.pid_grace_s:g} s")
                    else:
                        why = ("a symlink" if isinstance(e, OSError) and e.errno == errno.ELOOP
                               else (e.strerror if isinstance(e, OSError) else str(e)))
                        self._refuse(name, str(why))
                    continue
                self.uninitialized.pop(name, None)
                first_seen = now
                ring.writer_uid = _uid_of(ring.pid)  # while it lives (a ring may be read after it exited)
                if ring.node and ring.node != self.ctx.node:
                    # Another virtual node of this host (a shared directory): its own collector drains it.
                    ring.close()
                    self.others.add(name)
                    continue
                if ring.pid != int(m[1]):
                    self._refuse(name, f"header names pid {ring.pid}, the file name pid {m[1]}", ring)
                    continue
            if ring.pid not in self.job_pids and (_descends_from(ring.pid, self.job_pids)
                                                  or in_cgroups(ring.pid, self.ctx.cgroup_dirs())):
                # a child the tracker has not scanned yet (mpirun's ranks), or a process in the
                # job's cgroup the tracker has not scanned yet (it may end before the next scan)
                self.job_pids.add(ring.pid)
            if ring.pid not in self.job_pids:
                if not final and now - first_seen < self.pid_grace_s:
                    self.pending[name] = (ring, first_seen)  # the tracker may not have seen it yet
                    self.retry_s = RING_RETRY_S
                else:
                    self._refuse(name, f"writer pid {ring.pid} is not a process of the job", ring)
                continue
            # the job's uid; by hand (no --uid): the writer's, else that of the job's processes
            owners = ({self.ctx.uid} if self.ctx.uid is not None
                      else {ring.writer_uid} if ring.writer_uid is not None else self.job_uids)
            owner = next(iter(owners), None) if len(owners) == 1 else owners
            if ring.uid not in owners:
                self._refuse(name, f"owned by uid {ring.uid}, not by its writer's uid {owner}", ring)
                continue
            ring.keep_raw = self.keep_raw
            self.rings[name] = ring
            self._ring_count += 1
        if len(self._watch_rings) != len(self.rings):
            self._watch_set(dfd)

    def summary(self) -> dict[str, Any]:
        """What `status` and the file attribute fastpath_json say about the rings."""
        return {
            "nccl_profiler": self.plugin_on,
            "nvtx": self.nvtx_on,
            "cupti": self.cupti_on,
            "gpu_records": dict(self.gpu.counts) if self.gpu is not None else {},
            "stepped_aside": sorted(f"{var}={value[:120]}" for var, value in self.stepped_aside),
            "dir": self.ring_dir or "",
            "dir_problem": self.dir_problem,
            "rings": self._ring_count,
            "refused": len(self.refused),
            "create_failed": len(self.failed),
            "refused_detail": [f"{n}: {w}" for n, w in list(self.refused.items())[:MAX_DETAIL]],
            "create_failed_detail": [f"{n}: {w}" for n, w in list(self.failed.items())[:MAX_DETAIL]],
            "drain": self.drain_how,
            "early_drains": self.early_drains(),
        }

    def _rows(self, now_ns: int, final: bool) -> list[Batch]:
        self._scan(final)
        rows: list[np.ndarray] = []
        comm_rows: list[np.ndarray] = []
        device_rows: list[np.ndarray] = []
        nvtx_rows: list[np.ndarray] = []
        string_rows: list[np.ndarray] = []
        kernel_rows: list[np.ndarray] = []
        name_rows: list[np.ndarray] = []
        launch_rows: list[np.ndarray] = []
        self.fill = 0.0
        for ring in self.rings.values():
            try:
                calls, comms = ring.drain()
            except OSError as e:
                self.ctx.report_error(self.name, f"ring {ring.path}: {e}"[:230])
                continue
            self.fill = max(self.fill, ring.last_read / ring.capacity)
            # One ring is one process: its communicator records precede its calls on them, and
            # other processes' records do not matter to it (each has its own handles).
            for ev in comms:
                self.registry.on_comm(ev)
            if self.keep_raw:
                self.raw_calls.append(ring.raw if ring.native is not None else calls)
                self.events_comm.extend(comms)
            if len(calls):
                if ring.native is not None:  # already rows: only the communicator columns to fill
                    rows.append(self.registry.resolve_rows(calls))
                else:
                    rows.append(self.registry.call_rows(calls, "fastpath"))
            self._gpu_rows(ring, final, rows, comm_rows, device_rows, nvtx_rows, string_rows)
            self._kernel_rows(ring, final, kernel_rows, name_rows, launch_rows)
        comm_rows.insert(0, self.registry.communicator_rows(now_ns, final))

        def cat(table: schema.Table, parts: list[np.ndarray]) -> np.ndarray:
            return schema.concat_rows(parts) if parts else table.empty()

        # the calls one batch per ring, as drained: concatenated here they were copied once more
        # on their way to the writer, which takes batches in pieces (meep: 84 000 calls a second)
        call_batches = ([(schema.COLLECTIVE_CALLS, r) for r in rows]
                        or [(schema.COLLECTIVE_CALLS, schema.COLLECTIVE_CALLS.empty())])
        return [*call_batches,
                (schema.COMMUNICATORS, cat(schema.COMMUNICATORS, comm_rows)),
                (schema.DEVICE_TIMES, cat(schema.DEVICE_TIMES, device_rows)),
                (schema.NVTX_RANGES, cat(schema.NVTX_RANGES, nvtx_rows)),
                (schema.NVTX_STRINGS, cat(schema.NVTX_STRINGS, string_rows)),
                (schema.KERNEL_ACTIVITY, cat(schema.KERNEL_ACTIVITY, kernel_rows)),
                (schema.KERNEL_ACTIVITY_NAMES, cat(schema.KERNEL_ACTIVITY_NAMES, name_rows)),
                (schema.KERNEL_ACTIVITY_LAUNCHES, cat(schema.KERNEL_ACTIVITY_LAUNCHES, launch_rows))]

    def _kernel_rows(self, ring: Ring, final: bool, kernels: list[np.ndarray], names: list[np.ndarray],
                     launches: list[np.ndarray]) -> None:
        """One ring's CUPTI records (Ring.extra) -> /kernels/activity and its names."""
        lay, extra = self.lay, ring.extra
        if "rec_cuda_kernel" not in lay or self.gpu is None:
            return
        text = self.gpu.kernel_names.rows(ring.pid, extra.get(lay["rec_cuda_name"]), final)
        if len(text):
            names.append(text)
        if lay["rec_cuda_kernel"] in extra:
            kernels.append(self.gpu.kernel_rows(ring.pid, extra[lay["rec_cuda_kernel"]]))
        if lay.get("rec_cuda_launch") in extra:
            launches.append(self.gpu.launch_rows(ring.pid, extra[lay["rec_cuda_launch"]]))

    def _gpu_rows(self, ring: Ring, final: bool, calls: list[np.ndarray], comms: list[np.ndarray],
                  device: list[np.ndarray], nvtx: list[np.ndarray], strings: list[np.ndarray]) -> None:
        """One ring's plugin and NVTX records (Ring.extra) -> rows (GpuRecords)."""
        lay, extra, pid = self.lay, ring.extra, ring.pid
        if "rec_nccl_op" not in lay or self.gpu is None:
            return
        if lay["rec_nccl_comm"] in extra:
            comms.append(self.gpu.comm_rows(pid, extra[lay["rec_nccl_comm"]]))
        if lay["rec_nccl_op"] in extra:
            calls.append(self.gpu.call_rows(pid, extra[lay["rec_nccl_op"]]))
        device.extend(self.gpu.device_rows(pid, extra.get(lay["rec_nccl_dev"]), final))
        text = self.gpu.string_rows(pid, extra.get(lay["rec_nvtx_string"]), final)
        if len(text):
            strings.append(text)
        if lay["rec_nvtx_range"] in extra:
            nvtx.append(self.gpu.range_rows(pid, extra[lay["rec_nvtx_range"]]))

    def sample(self, now_ns: int) -> list[Batch]:
        return self._rows(now_ns, final=False)

    def final(self, now_ns: int) -> list[Batch]:
        return self._rows(now_ns, final=True)

    def drops(self) -> int:
        total = 0
        for ring in self.rings.values():
            try:
                total += ring.dropped()
            except OSError:
                continue
        return total

    def at_seal(self, f: h5py.File) -> None:
        f.attrs["fastpath_json"] = json.dumps(self.summary(), sort_keys=True)

    def stop(self) -> None:
        """Close and remove the job's rings (their processes are done when the collector stops);
        the directory itself, with any refused file in it, is the epilog's to remove."""
        self._stop_watch()  # first: its thread reads the rings' descriptors closed below
        self.dropped_total = self.drops()
        for ring, _ in self.pending.values():
            ring.close()
        self.pending.clear()
        for name, ring in self.rings.items():
            ring.close()
            if self._dir_fd is None:
                continue
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except OSError:
                continue
        self.rings.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


def ring_path(job_id: str, pid: int, ring_dir: str | os.PathLike[str]) -> Path:
    return Path(ring_dir) / f"gpuprof-{job_id}-{pid}"


# --- NCCL profiler plugin and NVTX records (bpf/fastpath/gpuprof_nccl_profiler.c, gpuprof_nvtx.c) ---
NCCL_LIB = LIB_CODES["nccl"]
PLUGIN_PATH = schema.COLLECTIVE_CALLS.enums["path"].index("nccl_profiler")
INIT_RANK_OP = schema.COMMUNICATOR_OPS.index("ncclCommInitRank")
TIMING_GPU_TIMER = schema.DEVICE_TIMES.enums["timing"].index("kernel_channel_gpu_timer")
# bytes of one element per NCCL datatype, in the schema's datatype order (0 for 'unknown')
DATATYPE_BYTES = np.array([1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1, 0], dtype=np.uint64)
NVTX_TEXT_BYTES = schema.NVTX_STRINGS.dtype["text"].itemsize - 1  # 127: "cut at 127 bytes"
NVTX_LOST_TEXT = b"[lost: the ring was full]"


def nccl_comm_id(comm_hash: int) -> int:
    """The job-wide id of a communicator the plugin names by NCCL's commHash: NCCL derives the hash
    from the communicator's unique id, so every rank has the same (docs/probes.md)."""
    return stable_id("nccl-hash", comm_hash)


class DeviceClock:
    """One process's GPU timer (NCCL's kernel-channel pTimer, the GPU's globaltimer) -> its node's
    CLOCK_MONOTONIC, from the (GPU time, host time) pairs the plugin reports with each operation.

    A pair is a GPU timestamp and the host time at which NCCL's proxy thread saw it, so
    host - gpu = offset(gpu) + a delay that is never negative: every pair lies on or above the
    true offset curve. Per SUB_NS of GPU time the pair with the smallest difference is kept; a GPU
    time is mapped with the lower convex hull of the kept pairs within NEIGHBOR_NS of it (the
    lower envelope, as NTP-like filters do), interpolated linearly, extrapolated along the end
    segments: a drift between the two clocks is followed, and the error left is the delay of the
    least delayed pairs around it, not their average. A row waits until pairs NEIGHBOR_NS after it
    are in (or the final drain), so its hull has pairs on both sides (docs/probes.md)."""

    SUB_NS = 50_000_000
    NEIGHBOR_NS = 500_000_000

    def __init__(self) -> None:
        self.points: dict[int, tuple[int, int]] = {}  # sub-window -> (gpu_ns, host - gpu) of its best pair

    def add(self, pair_host: np.ndarray, pair_delta: np.ndarray) -> None:
        for host, delta in zip(pair_host.tolist(), pair_delta.tolist()):
            if not host:
                continue
            gpu = host - delta
            w = gpu // self.SUB_NS
            best = self.points.get(w)
            if best is None or delta < best[1]:
                self.points[w] = (gpu, delta)

    def settled_before(self) -> int:
        """GPU times before this have their neighbourhood's pairs on both sides."""
        return max(self.points) * self.SUB_NS - self.NEIGHBOR_NS if self.points else 0

    @staticmethod
    def _lower_hull(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vertices of the lower convex hull of points sorted by x (monotone chain)."""
        hx: list[float] = []
        hy: list[float] = []
        for px, py in zip(x.tolist(), y.tolist()):
            while len(hx) >= 2 and (hx[-1] - hx[-2]) * (py - hy[-2]) - (hy[-1] - hy[-2]) * (px - hx[-2]) <= 0:
                hx.pop()
                hy.pop()
            hx.append(px)
            hy.append(py)
        return np.array(hx), np.array(hy)

    @staticmethod
    def _interp(g: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        delta = np.interp(g, x, y)
        if len(x) >= 2:
            lo, hi = g < x[0], g > x[-1]
            delta[lo] = y[0] + (g[lo] - x[0]) * (y[1] - y[0]) / (x[1] - x[0])
            delta[hi] = y[-1] + (g[hi] - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
        return delta

    def to_host(self, gpu: np.ndarray) -> np.ndarray:
        """GPU ns -> CLOCK_MONOTONIC ns (uint64; 0 stays 0: not known)."""
        out = np.zeros(len(gpu), np.int64)
        if not self.points or not len(gpu):
            return out.astype(np.uint64)
        pts = sorted(self.points.values())
        x = np.array([p[0] for p in pts], np.float64)
        y = np.array([p[1] for p in pts], np.float64)
        g = gpu.astype(np.float64)
        block = gpu // self.SUB_NS
        for b in np.unique(block).tolist():
            rows = block == b
            lo, hi = b * self.SUB_NS - self.NEIGHBOR_NS, (b + 1) * self.SUB_NS + self.NEIGHBOR_NS
            near = (x >= lo) & (x < hi)
            if near.sum() < 2:
                near = np.ones(len(x), bool)  # few pairs around it: the whole run's
            hx, hy = self._lower_hull(x[near], y[near])
            out[rows] = gpu[rows].astype(np.int64) + np.rint(self._interp(g[rows], hx, hy)).astype(np.int64)
        return np.where(gpu == 0, 0, np.maximum(out, 0)).astype(np.uint64)


class GpuRecords:
    """The plugin's and NVTX's ring records of every ring -> rows of /collectives/calls,
    /collectives/communicators, /collectives/device_times, /nvtx/ranges and /nvtx/strings."""

    MAX_PENDING = 200_000  # GPU-timed rows held for a later point per process; beyond, mapped now

    def __init__(self, part_bytes: int) -> None:
        self.part_bytes = part_bytes  # text bytes of one string record (layout.json nvtx_part_bytes)
        self.clocks: dict[int, DeviceClock] = {}
        self.pending: dict[int, list[np.ndarray]] = {}  # pid -> nccl_dev records waiting for a point
        self.nvtx_strings = StringAssembler(schema.NVTX_STRINGS, "string_id", "text", part_bytes)
        self.kernel_names = StringAssembler(schema.KERNEL_ACTIVITY_NAMES, "name_id", "name", part_bytes)
        self.counts = {"nccl_ops": 0, "nccl_device_times": 0, "nccl_comms": 0, "nvtx_ranges": 0,
                       "nvtx_strings": 0, "nvtx_strings_lost": 0, "cuda_kernels": 0, "cuda_launches": 0}

    # --- NCCL ----------------------------------------------------------------------------------
    def call_rows(self, pid: int, ops: np.ndarray) -> np.ndarray:
        rows = schema.COLLECTIVE_CALLS.empty(len(ops))
        rows["t_enter_ns"], rows["t_exit_ns"] = ops["t_start_ns"], ops["t_stop_ns"]
        rows["pid"], rows["tid"], rows["library"] = pid, ops["tid"], NCCL_LIB
        rows["op"], rows["seq"] = ops["op"], ops["seq"]
        rows["comm_id"] = [nccl_comm_id(int(h)) for h in ops["comm_hash"]]
        rows["comm_rank"], rows["comm_size"] = ops["rank"], ops["nranks"]
        size = DATATYPE_BYTES[np.minimum(ops["datatype"], len(DATATYPE_BYTES) - 1)]
        rows["bytes"] = np.where(size > 0, ops["count"] * size, GP_BYTES_UNKNOWN)
        rows["root_or_peer"], rows["tag"], rows["ret"] = ops["peer"], -1, 0
        rows["path"], rows["handle"] = PLUGIN_PATH, ops["context"]
        self.counts["nccl_ops"] += len(ops)
        return rows

    def comm_rows(self, pid: int, comms: np.ndarray) -> np.ndarray:
        rows = schema.COMMUNICATORS.empty(len(comms))
        rows["t_ns"], rows["pid"], rows["library"], rows["op"] = comms["t_ns"], pid, NCCL_LIB, INIT_RANK_OP
        rows["comm_id"] = [nccl_comm_id(int(h)) for h in comms["comm_hash"]]
        rows["parent_id"], rows["handle"] = 0, comms["context"]
        rows["comm_rank"], rows["comm_size"] = comms["rank"], comms["nranks"]
        self.counts["nccl_comms"] += len(comms)
        return rows

    def _device_rows(self, pid: int, dev: np.ndarray) -> np.ndarray:
        rows = schema.DEVICE_TIMES.empty(len(dev))
        rows["pid"] = pid
        rows["comm_id"] = [nccl_comm_id(int(h)) for h in dev["comm_hash"]]
        for f in ("seq", "timing", "algorithm", "protocol", "n_channels", "count", "datatype", "op"):
            rows[f] = dev[f]
        rows["root_or_peer"] = dev["peer"]
        gpu = dev["timing"] == TIMING_GPU_TIMER
        rows["t_dev_start_ns"], rows["t_dev_end_ns"] = dev["dev_start"], dev["dev_end"]
        if gpu.any():
            clock = self.clocks[pid]
            rows["t_dev_start_ns"][gpu] = clock.to_host(dev["dev_start"][gpu])
            rows["t_dev_end_ns"][gpu] = clock.to_host(dev["dev_end"][gpu])
        self.counts["nccl_device_times"] += len(rows)
        return rows

    def device_rows(self, pid: int, dev: np.ndarray | None, final: bool) -> list[np.ndarray]:
        """Host-timed rows at once; GPU-timed rows once their clock mapping has a later point."""
        out = []
        if dev is not None and len(dev):
            gpu = dev["timing"] == TIMING_GPU_TIMER
            if (~gpu).any():
                out.append(self._device_rows(pid, dev[~gpu]))
            if gpu.any():
                self.clocks.setdefault(pid, DeviceClock()).add(dev["pair_host"][gpu], dev["pair_delta"][gpu])
                self.pending.setdefault(pid, []).append(dev[gpu])
        held = self.pending.get(pid)
        if held:
            waiting = schema.concat_rows(held)
            if final or len(waiting) > self.MAX_PENDING:
                ready = np.ones(len(waiting), bool)
            else:
                ready = waiting["dev_end"] < self.clocks[pid].settled_before()
            if ready.any():
                out.append(self._device_rows(pid, waiting[ready]))
            self.pending[pid] = [waiting[~ready]] if (~ready).any() else []
        return out

    # --- NVTX ----------------------------------------------------------------------------------
    def range_rows(self, pid: int, ranges: np.ndarray) -> np.ndarray:
        rows = schema.NVTX_RANGES.empty(len(ranges))
        for f in ("t_start_ns", "t_end_ns", "tid", "domain_id", "name_id", "category", "kind", "depth", "color"):
            rows[f] = ranges[f]
        rows["pid"] = pid
        self.counts["nvtx_ranges"] += len(ranges)
        return rows

    def string_rows(self, pid: int, parts: np.ndarray | None, final: bool) -> np.ndarray:
        rows = self.nvtx_strings.rows(pid, parts, final)
        self.counts["nvtx_strings"] += len(rows)
        self.counts["nvtx_strings_lost"] += int((rows["truncated"] == 2).sum())
        return rows

    # --- CUPTI -----------------------------------------------------------------------------------
    def kernel_rows(self, pid: int, kernels: np.ndarray) -> np.ndarray:
        rows = schema.KERNEL_ACTIVITY.empty(len(kernels))
        rows["t_start_ns"], rows["t_end_ns"], rows["pid"] = kernels["t_start_ns"], kernels["t_end_ns"], pid
        for f in ("device", "stream", "correlation_id", "name_id"):
            rows[f] = kernels[f]
        for i, axis in enumerate("xyz"):
            rows[f"grid_{axis}"] = kernels["grid"][:, i]
            rows[f"block_{axis}"] = kernels["block"][:, i]
        rows["dynamic_shared_bytes"], rows["static_shared_bytes"] = kernels["dynamic_shared"], kernels["static_shared"]
        rows["registers"] = kernels["registers"]
        rows["clock"] = (kernels["flags"] & 1) != 0  # GP_CUDA_F_REALTIME_CONVERTED
        self.counts["cuda_kernels"] += len(rows)
        return rows

    def launch_rows(self, pid: int, launches: np.ndarray) -> np.ndarray:
        rows = schema.KERNEL_ACTIVITY_LAUNCHES.empty(len(launches))
        rows["t_ns"], rows["pid"] = launches["t_ns"], pid
        for f in ("tid", "correlation_id", "domain", "cbid"):
            rows[f] = launches[f]
        self.counts["cuda_launches"] += len(rows)
        return rows


class StringAssembler:
    """String records (gp_nvtx_string: NVTX texts and kernel names) -> rows of a (pid, id, text,
    truncated) table: parts gathered per (pid, id) until all are in; at the final drain one still
    missing a part is written as lost (a full ring dropped it), so every id in use has a row. Texts
    longer than the column are cut on a UTF-8 boundary and end in '...' (truncated = 1)."""

    def __init__(self, table: schema.Table, id_col: str, text_col: str, part_bytes: int) -> None:
        self.table, self.id_col, self.text_col, self.part_bytes = table, id_col, text_col, part_bytes
        self.width = table.dtype[text_col].itemsize - 1  # "cut at 127 bytes" for S128
        self.parts: dict[tuple[int, int], dict[int, bytes]] = {}
        self.total: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, id) -> (length, flags)
        self.written: set[tuple[int, int]] = set()

    def rows(self, pid: int, parts: np.ndarray | None, final: bool) -> np.ndarray:
        done: list[tuple[int, bytes, int]] = []
        if parts is not None:
            for p in parts:
                key = (pid, int(p["string_id"]))
                if key in self.written:
                    continue
                got = self.parts.setdefault(key, {})
                got[int(p["part"])] = bytes(p["text"])
                self.total[key] = (int(p["total_len"]), int(p["flags"]))
                length = self.total[key][0]
                need = max(1, -(-length // self.part_bytes))
                if len(got) == need:
                    text = b"".join(got[i] for i in range(need))[:length]
                    done.append((key[1], text, self.total[key][1] & 1))
                    self._forget(key)
        if final:
            for key in [k for k in self.parts if k[0] == pid]:
                done.append((key[1], NVTX_LOST_TEXT, 2))
                self._forget(key)
        rows = self.table.empty(len(done))
        for i, (sid, text, truncated) in enumerate(done):
            if len(text) > self.width:
                text, truncated = _cut_utf8(text, self.width - 3) + b"...", truncated or 1
            rows["pid"][i], rows[self.id_col][i], rows[self.text_col][i], rows["truncated"][i] = \
                pid, sid, text, truncated
        return rows

    def _forget(self, key: tuple[int, int]) -> None:
        self.parts.pop(key, None)
        self.total.pop(key, None)
        self.written.add(key)


def _cut_utf8(text: bytes, n: int) -> bytes:
    """At most n bytes of UTF-8 text, cut before a continuation byte (never inside a character)."""
    if len(text) <= n:
        return text
    while n > 0 and (text[n] & 0xC0) == 0x80:
        n -= 1
    return text[:n]
