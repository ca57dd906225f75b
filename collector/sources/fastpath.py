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

from gpuprof.collector import environment as env
from gpuprof.collector import native, schema
from gpuprof.collector.bpf_support import BPF_DIR
from gpuprof.collector.sources.base import Batch, Source, SourceContext, SourceUnavailable
from gpuprof.collector.sources.collective_calls import CALL_DTYPE, CommRegistry
from gpuprof.collector.sources.probe_table import PATH_CODES

BUILD_DIR = BPF_DIR / "fastpath" / "build"
LIBRARIES = {"mpi": BUILD_DIR / "libgpuprof_pmpi.so", "nccl": BUILD_DIR / "libgpuprof_nccl.so"}
LAYOUT = BUILD_DIR / "layout.json"
RING_DIR = "/dev/shm"
# A ring whose writer pid is not (yet) a job process is retried this long before it is refused:
# the process tracker picks up new processes once a second, the drain runs every 0.2 s.
PID_GRACE_S = 3.0


def job_ring_dir(job_id: str, node: str, base: str = RING_DIR) -> Path:
    """The per-job, per-node ring directory the prolog creates: /dev/shm/gpuprof-<job>@<node>.
    Per node because several virtual Slurm nodes of one host share /dev/shm, each with its own
    prolog, epilog and collector."""
    if not job_id or "/" in job_id or "/" in node or node in (".", ".."):
        raise ValueError(f"job id {job_id!r} / node {node!r} cannot name a ring directory")
    return Path(base) / f"gpuprof-{job_id}@{node}"


def built_libraries() -> dict[str, Path | None]:
    """The interposer libraries that are built (make -C bpf/fastpath), by library."""
    ok = LAYOUT.exists()
    return {lib: (p if ok and p.exists() else None) for lib, p in LIBRARIES.items()}


def resolve_paths(config: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per library: 'uprobe' or 'fastpath' (auto = fast path when its library is built)."""
    built = built_libraries()
    out = {}
    for lib in ("mpi", "nccl"):
        want = config.get("sources.collectives", {}).get(f"{lib}_path", "auto")
        if want == "auto":
            want = "fastpath" if built.get(lib) else "uprobe"
        out[lib] = want
    return out


def fastpath_exports(modes: tuple[str, ...], config: dict[str, dict[str, Any]], job_id: str | None = None,
                     existing_ld_preload: str | None = None, ring_dir: str | os.PathLike[str] | None = None,
                     node: str | None = None) -> list[str]:
    """`export NAME=value` lines for the TaskProlog: the interposers of the libraries whose path is
    'fastpath' for this job (sources.collectives.mpi_path / nccl_path; auto = fast path when built).
    Empty when mode `collectives` is off or no library uses the fast path. job_id and the task's
    LD_PRELOAD default to the TaskProlog's environment (SLURM_JOB_ID, LD_PRELOAD); ring_dir to the
    per-job directory of this node (`job_ring_dir`, node from SLURMD_NODENAME)."""
    if "collectives" not in modes:
        return []
    if job_id is None:
        job_id = env.get(env.SLURM_JOB_ID)
        if not job_id:
            return []  # no job to name the rings after: the uprobe path still sees the calls
    if existing_ld_preload is None:
        existing_ld_preload = env.get(env.LD_PRELOAD) or ""
    paths = resolve_paths(config)
    built = built_libraries()
    libs = [str(built[lib]) for lib in ("mpi", "nccl") if paths[lib] == "fastpath" and built[lib] is not None]
    if not libs:
        return []
    if ring_dir is None:
        try:
            ring_dir = job_ring_dir(job_id, node or env.get(env.SLURMD_NODENAME) or os.uname().nodename)
        except ValueError:
            return []
    preload = ":".join([*libs, *[p for p in existing_ld_preload.split(":") if p]])
    return [
        f"export LD_PRELOAD={preload}",
        f"export GPUPROF_FASTPATH_JOB={job_id}",
        f"export GPUPROF_FASTPATH_DIR={os.fspath(ring_dir)}",
    ]


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
        if not chunks:
            return np.zeros(0, dtype=CALL_DTYPE), []
        os.pwrite(self.fd, self.tail.to_bytes(8, "little"), self.tail_offset)
        buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        count = len(buf) // rs
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
    tables = (schema.COLLECTIVE_CALLS, schema.COMMUNICATORS)
    interval_s = 0.2

    def __init__(self, ring_dir: str | None = None) -> None:
        # ring_dir None: the job's directory, /dev/shm/gpuprof-<job>@<node> (tests name their own)
        self.ring_dir = ring_dir
        self.rings: dict[str, Ring] = {}
        self.pending: dict[str, tuple[Ring, float]] = {}  # writer pid not (yet) a job process
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

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        paths = resolve_paths(ctx.config)
        if not any(paths[lib] == "fastpath" for lib in ("mpi", "nccl")):
            raise SourceUnavailable("no library uses the fast path for this job (config)")
        self.lay = layout()
        if self.ring_dir is None:
            try:
                self.ring_dir = str(job_ring_dir(ctx.job_id, ctx.node))
            except ValueError as e:
                raise SourceUnavailable(str(e)) from None
        job = re.escape(ctx.job_id)
        self.pattern = re.compile(rf"^gpuprof-{job}-(\d+)(?:\.\d)?$")
        self.note_pattern = re.compile(rf"^gpuprof-{job}-(\d+)\.failed$")
        self.registry = CommRegistry(ctx.node)
        self._scan()

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

    def _scan(self, final: bool = False) -> None:
        for pid in self.ctx.pids() - self.job_pids:
            self.job_pids.add(pid)
            uid = _uid_of(pid)
            if uid is not None:
                self.job_uids.add(uid)
        dfd = self._open_dir()
        if dfd is None:
            return
        try:
            names = os.listdir(dfd)
        except OSError as e:
            self.ctx.report_error(self.name, f"ring directory {self.ring_dir}: {e.strerror}")
            return
        now = time.monotonic()
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
                    # Not yet initialized (magic is written last) is retried; anything else refused.
                    if "not initialized" not in str(e):
                        why = ("a symlink" if isinstance(e, OSError) and e.errno == errno.ELOOP
                               else (e.strerror if isinstance(e, OSError) else str(e)))
                        self._refuse(name, str(why))
                    continue
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
            if ring.pid not in self.job_pids and _descends_from(ring.pid, self.job_pids):
                self.job_pids.add(ring.pid)  # a child the tracker has not scanned yet (mpirun's ranks)
            if ring.pid not in self.job_pids:
                if not final and now - first_seen < self.pid_grace_s:
                    self.pending[name] = (ring, first_seen)  # the tracker may not have seen it yet
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

    def summary(self) -> dict[str, Any]:
        """What `status` and the file attribute fastpath_json say about the rings."""
        return {
            "dir": self.ring_dir or "",
            "dir_problem": self.dir_problem,
            "rings": self._ring_count,
            "refused": len(self.refused),
            "create_failed": len(self.failed),
            "refused_detail": [f"{n}: {w}" for n, w in list(self.refused.items())[:MAX_DETAIL]],
            "create_failed_detail": [f"{n}: {w}" for n, w in list(self.failed.items())[:MAX_DETAIL]],
        }

    def _rows(self, now_ns: int, final: bool) -> list[Batch]:
        self._scan(final)
        rows = []
        for ring in self.rings.values():
            try:
                calls, comms = ring.drain()
            except OSError as e:
                self.ctx.report_error(self.name, f"ring {ring.path}: {e}"[:230])
                continue
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
        calls_rows = (rows[0] if len(rows) == 1 else np.concatenate(rows)) if rows else schema.COLLECTIVE_CALLS.empty()
        return [(schema.COLLECTIVE_CALLS, calls_rows),
                (schema.COMMUNICATORS, self.registry.communicator_rows(now_ns, final))]

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
