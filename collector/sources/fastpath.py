"""Fast path of mode `collectives`: drain the shared-memory rings that the LD_PRELOAD interposers
(bpf/fastpath/: PMPI wrapper, NCCL interposer) write in each job process.

The interposers write the same gp_call/gp_comm records as the uprobes (bpf/gpuprof_events.h) and
count sequence numbers the same way; this source feeds them to the same CommRegistry, so the rows
and ids do not depend on the path (column `path` says which one). The ring's byte layout comes from
the build (bpf/fastpath/build/layout.json, printed by a C program from the structs).

A ring file is written by the job's user, so it is read as untrusted input: opened without
following links, its header checked against the layout, read with pread (a truncated file gives a
short read, not a SIGBUS), and only rings of job processes (or files owned by a job process's
user) are read.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import stat
from functools import lru_cache
from pathlib import Path
from typing import Any

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
                     existing_ld_preload: str | None = None) -> list[str]:
    """`export NAME=value` lines for the TaskProlog: the interposers of the libraries whose path is
    'fastpath' for this job (sources.collectives.mpi_path / nccl_path; auto = fast path when built).
    Empty when mode `collectives` is off or no library uses the fast path. job_id and the task's
    LD_PRELOAD default to the TaskProlog's environment (SLURM_JOB_ID, LD_PRELOAD)."""
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
    preload = ":".join([*libs, *[p for p in existing_ld_preload.split(":") if p]])
    return [
        f"export LD_PRELOAD={preload}",
        f"export GPUPROF_FASTPATH_JOB={job_id}",
        f"export GPUPROF_FASTPATH_DIR={RING_DIR}",
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

    def __init__(self, path: str, lay: dict[str, Any]) -> None:
        self.path = path
        self.lay = lay
        self.fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
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


class FastpathSource(Source):
    """Drains /dev/shm/gpuprof-<job>-<pid> rings of the job's processes."""

    name = "collectives_fastpath"
    tables = (schema.COLLECTIVE_CALLS, schema.COMMUNICATORS)
    interval_s = 0.2

    def __init__(self, ring_dir: str = RING_DIR) -> None:
        self.ring_dir = ring_dir
        self.rings: dict[str, Ring] = {}
        self.bad: set[str] = set()
        self.job_pids: set[int] = set()
        self.job_uids: set[int] = set()
        self.dropped_total = 0  # records the interposers could not write (ring full), all rings
        self.keep_raw = False
        self.raw_calls: list[np.ndarray] = []
        self.events_comm: list[dict[str, Any]] = []

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        paths = resolve_paths(ctx.config)
        if not any(paths[lib] == "fastpath" for lib in ("mpi", "nccl")):
            raise SourceUnavailable("no library uses the fast path for this job (config)")
        self.lay = layout()
        self.pattern = re.compile(rf"^gpuprof-{re.escape(ctx.job_id)}-(\d+)$")
        self.registry = CommRegistry(ctx.node)
        self._scan()

    def _scan(self) -> None:
        for pid in self.ctx.pids():
            if pid not in self.job_pids:
                self.job_pids.add(pid)
                uid = _uid_of(pid)
                if uid is not None:
                    self.job_uids.add(uid)
        try:
            names = os.listdir(self.ring_dir)
        except OSError:
            return
        for name in names:
            m = self.pattern.match(name)
            path = os.path.join(self.ring_dir, name)
            if not m or path in self.rings or path in self.bad:
                continue
            try:
                ring = Ring(path, self.lay)
            except (OSError, ValueError) as e:
                # Not yet initialized (magic is written last) is retried; anything else is reported.
                if "not initialized" not in str(e):
                    self.bad.add(path)
                    self.ctx.report_error(self.name, f"ring {name} ignored: {e}"[:230])
                continue
            if ring.node and ring.node != self.ctx.node:
                # Another virtual node of this host (they share /dev/shm): its own collector drains it.
                ring.close()
                self.bad.add(path)
                continue
            ours = ring.pid in self.job_pids or ring.uid in self.job_uids
            if ring.pid != int(m[1]) or not ours:
                ring.close()
                self.bad.add(path)
                self.ctx.report_error(self.name, f"ring {name} ignored: not written by a job process")
                continue
            ring.keep_raw = self.keep_raw
            self.rings[path] = ring

    def _rows(self, now_ns: int, final: bool) -> list[Batch]:
        self._scan()
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

    def stop(self) -> None:
        """Close and remove the job's rings (their processes are done when the collector stops)."""
        self.dropped_total = self.drops()
        for path, ring in self.rings.items():
            ring.close()
            try:
                os.unlink(path)
            except OSError:
                continue
        self.rings.clear()


def ring_path(job_id: str, pid: int, ring_dir: str = RING_DIR) -> Path:
    return Path(ring_dir) / f"gpuprof-{job_id}-{pid}"
