"""What both collective paths share once a call is decoded: the call record (`CALL_DTYPE`) and
the communicator registry. `CommRegistry` turns communicator handles into job-wide ids (rules in
docs/probes.md); the uprobe path (bpf_collectives.py) and the fast path (fastpath.py) feed it the
same records, so both give the same ids and sequence numbers.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import read_environ, read_maps, symbol_address
from gpuprof.collector.schema import INTERNAL_COMM_OPS
from gpuprof.collector.sources.probe_table import (
    GP_F_SENDRECV_RECV,
    GP_SEQ_NONE,
    LIB_CODES,
    LIBRARY_PATTERNS,
    MPI_UNDEFINED,
    MPICH_COMM_NULL,
    MPICH_COMM_SELF,
    MPICH_COMM_WORLD,
    NCCL_SPLIT_NOCOLOR,
    PATH_CODES,
)


# --- ids -----------------------------------------------------------------------------------------
def stable_id(*parts: object) -> int:
    """64-bit id of a tuple of strings and integers: the same on every node (never 0)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    v = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return v or 1


def fnv1a64(data: bytes) -> int:
    """FNV-1a 64 of the ncclUniqueId: bpf/fastpath computes the same in C."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


_NAMESPACE_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def mpi_world_identity(env: dict[str, str]) -> tuple[str, int, int]:
    """(launch namespace, world rank, world size) from a rank's environment; -1 when not set."""
    ns = next((env[v] for v in _NAMESPACE_VARS if env.get(v)), "")
    if not ns and env.get("SLURM_JOB_ID"):
        ns = f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"

    def first_int(names: tuple[str, ...]) -> int:
        for n in names:
            try:
                return int(env[n])
            except (KeyError, ValueError):
                continue
        return -1

    return ns, first_int(_RANK_VARS), first_int(_SIZE_VARS)


# A batch of one process's calls is grouped by communicator handle with a pass per handle up to
# this many handles, by a sort beyond (CommRegistry._groups)
FEW_HANDLES = 8


@dataclass
class CommInfo:
    comm_id: int
    parent_id: int
    rank: int
    size: int
    library: int
    op: int  # COMMUNICATOR_OPS index of the row, -1 when no row is to be written
    t_ns: int
    pid: int
    handle: int
    written: bool = False


@dataclass
class _ProcComms:
    namespace: int = 0  # fnv1a64 of the launch namespace string
    world: tuple[int, int] | None = None  # (handle, size) once MPI_Init was seen
    predefined: dict[str, int] | None = None  # MPI_COMM_WORLD/SELF/NULL handles, once known
    handles: dict[int, list[CommInfo]] = field(default_factory=dict)  # by t_ns, latest last


class CommRegistry:
    """Communicator handles of each process -> job-wide ids, ranks and sizes (docs/probes.md).

    A handle can be freed and reused, so each handle keeps its history and a call is resolved to
    the communicator that was live at its entry time.
    """

    COMM_ROW_DELAY_NS = 5_000_000_000  # wait this long for rank/size queries before writing a row

    def __init__(self, node: str, environ: Callable[[int], dict[str, str]] = read_environ,
                 mpi_handles: Callable[[int], dict[str, int]] | None = None,
                 maps: Callable[[int], list[Any]] = read_maps) -> None:
        self.node = node
        self.environ = environ
        self.mpi_handles = mpi_handles or predefined_mpi_handles
        self.maps = maps
        self.procs: dict[int, _ProcComms] = {}
        self.pending: list[CommInfo] = []

    def _proc(self, pid: int) -> _ProcComms:
        p = self.procs.get(pid)
        if p is None:
            p = _ProcComms(namespace=fnv1a64(mpi_world_identity(self.environ(pid))[0].encode()))
            self.procs[pid] = p
        return p

    def _add(self, info: CommInfo) -> None:
        self._proc(info.pid).handles.setdefault(info.handle, []).append(info)
        if info.op >= 0:
            self.pending.append(info)

    def resolve_rows(self, rows: np.ndarray) -> np.ndarray:
        """/collectives/calls rows whose other columns are filled (the fast path's C drain): their
        communicator columns."""
        self._resolve_comms(rows, rows)
        return rows

    def _resolve_comms(self, calls: np.ndarray, rows: np.ndarray) -> None:
        """comm_id, comm_rank, comm_size of every row, as lookup() gives them, computed per
        (pid, handle) group rather than per row: at 10,000+ calls/s per process a per-row
        lookup was most of the collector's CPU time. The usual batch (one process, one
        communicator, every call on it) costs three slice assignments."""
        pids, handles = calls["pid"], calls["handle"]
        no_comm = (calls["seq"] == GP_SEQ_NONE) & (handles == 0)
        if no_comm.any():
            rows["comm_id"][no_comm], rows["comm_rank"][no_comm], rows["comm_size"][no_comm] = 0, -1, -1
            groups = self._groups(pids[~no_comm], handles[~no_comm], np.flatnonzero(~no_comm))
        else:
            groups = self._groups(pids, handles, slice(None))
        for pid, handle, sel in groups:
            first = 0 if isinstance(sel, slice) else int(sel[0])
            # The group's first call (in row order) goes through lookup(): it makes up or finds
            # the communicator exactly as a per-row loop would.
            self.lookup(pid, handle, int(calls["t_enter_ns"][first]), int(calls["library"][first]))
            hist = self._proc(pid).handles[handle]
            if len(hist) == 1:
                info = hist[0]
                rows["comm_id"][sel], rows["comm_rank"][sel], rows["comm_size"][sel] = info.comm_id, info.rank, info.size
                continue
            # Reused handle: the latest communicator created at or before each call's entry, else the first.
            sel = np.arange(len(calls))[sel]
            times = np.array([info.t_ns for info in hist], dtype=np.int64)
            by_time = np.argsort(times, kind="stable")  # appended in time order already, but cheap to be sure
            pos = np.searchsorted(times[by_time], calls["t_enter_ns"][sel].astype(np.int64), "right") - 1
            pick = np.where(pos >= 0, by_time[np.maximum(pos, 0)], 0)
            for j, info in enumerate(hist):
                mine = sel[pick == j]
                if len(mine):
                    rows["comm_id"][mine], rows["comm_rank"][mine], rows["comm_size"][mine] = \
                        info.comm_id, info.rank, info.size

    @staticmethod
    def _groups(pids: np.ndarray, handles: np.ndarray, where: np.ndarray | slice) -> list[tuple[int, int, Any]]:
        """(pid, handle, rows) per distinct pair, rows in batch order: `where` itself (a slice)
        when one pair covers it all, else indexes into the batch."""
        if not len(pids):
            return []
        one_pid = pids.min() == pids.max()
        if one_pid and handles.min() == handles.max():
            return [(int(pids[0]), int(handles[0]), where)]
        idx = np.arange(len(pids)) if isinstance(where, slice) else where
        if one_pid:
            # the fast path's batch: one process (its ring), its calls on a few communicators
            # (GROMACS: 15 000 calls on one, 23 on another, in 2 s): a pass per communicator, where
            # the sort below took 0.2-0.4 ms a batch
            groups: list[tuple[int, int, Any]] = []
            rest = np.arange(len(handles))
            while len(rest) and len(groups) < FEW_HANDLES:
                first = handles[rest[0]]
                mine = handles[rest] == first
                groups.append((int(pids[0]), int(first), idx[rest[mine]]))
                rest = rest[~mine]
            if not len(rest):
                return sorted(groups, key=lambda g: g[1])
        order = np.lexsort((handles, pids))  # stable: rows keep their order within a pair
        p, h = pids[order], handles[order]
        cuts = np.flatnonzero((p[1:] != p[:-1]) | (h[1:] != h[:-1])) + 1
        return [(int(pids[part[0]]), int(handles[part[0]]), idx[part]) for part in np.split(order, cuts)]

    def lookup(self, pid: int, handle: int, t_ns: int, library: int) -> CommInfo:
        """The communicator live at t_ns; one is made up from the handle when none was created
        while the collector watched (documented: matches across ranks only for predefined ones)."""
        p = self._proc(pid)
        hist = p.handles.get(handle)
        if hist:
            for info in reversed(hist):
                if info.t_ns <= t_ns:
                    return info
            return hist[0]
        if library == LIB_CODES["mpi"]:
            self._mpi_init(pid, t_ns, 0)  # inside MPI_Init, or MPI_Init ran before the probes were attached
            hist = p.handles.get(handle)
            if hist:
                return hist[0]
        info = CommInfo(stable_id("handle", library, p.namespace, _handle_key(self.maps(pid), handle)), 0, -1, -1,
                        library, -1, 0, pid, handle)
        self._add(info)
        return info

    def _predefined(self, pid: int) -> dict[str, int]:
        """MPI_COMM_WORLD, SELF and NULL of a process (from its MPI library's symbols, once)."""
        p = self._proc(pid)
        if p.predefined is None:
            found = self.mpi_handles(pid)
            if not found:
                return {}  # MPI not mapped yet: asked again at the next call
            p.predefined = found
        return p.predefined

    def _mpi_init(self, pid: int, t_ns: int, world_handle: int, rank: int = -1, size: int = -1,
                  ns_hash: int = 0, self_handle: int = 0, null_handle: int = 0) -> None:
        """MPI_COMM_WORLD (and SELF) of a process. The world id is made of the launch namespace
        (the fast path hashes it in the rank; the uprobe path reads the rank's environment) and
        the world size, the same on every rank of one mpirun/srun and different between two."""
        p = self._proc(pid)
        if p.world is not None:
            return
        _, env_rank, env_size = mpi_world_identity(self.environ(pid))
        if ns_hash:
            p.namespace = ns_hash
        rank = rank if rank >= 0 else env_rank
        size = size if size >= 0 else env_size
        if world_handle and self_handle:
            # the fast path's MPI_Init record names all three: no symbol lookup
            p.predefined = {"world": world_handle, "self": self_handle, "null": null_handle}
        handles = self._predefined(pid)
        world = world_handle or handles.get("world", 0)
        if not world:
            return
        p.world = (world, size)
        init_op = schema.COMMUNICATOR_OPS.index("MPI_Init")
        self._add(CommInfo(stable_id("mpi-world", p.namespace, size), 0, rank, size, 0, init_op, t_ns, pid, world))
        if handles.get("self"):
            self._add(CommInfo(stable_id("mpi-self", self.node, pid), 0, 0, 1, 0, -1, t_ns, pid, handles["self"]))

    def on_comm(self, ev: dict[str, Any]) -> None:
        """Apply one communicator record (a gp_comm as a dict)."""
        op, pid, t, h, lib = int(ev["op"]), int(ev["pid"]), int(ev["t_ns"]), int(ev["handle"]), int(ev["library"])
        name = comm_op_name(op)
        if name in ("MPI_Comm_rank", "MPI_Comm_size", "ncclCommCount", "ncclCommUserRank"):
            info = self.lookup(pid, h, t, lib)
            if name in ("MPI_Comm_rank", "ncclCommUserRank"):
                info.rank = int(ev["rank"])
            else:
                info.size = int(ev["size"])
            return
        if name == "MPI_Init":
            # fast path: parent = MPI_COMM_SELF, index = MPI_COMM_NULL (bpf/fastpath/gpuprof_pmpi.c)
            self._mpi_init(pid, t, h, int(ev["rank"]), int(ev["size"]), int(ev.get("uid_hash", 0)),
                           self_handle=int(ev["parent"]), null_handle=int(ev["index"]))
            return
        if int(ev["ret"]) != 0 and name not in ("MPI_Comm_free", "ncclCommDestroy", "ncclCommAbort"):
            return  # nothing was created
        if name in ("MPI_Comm_free", "ncclCommDestroy", "ncclCommAbort"):
            info = self.lookup(pid, h, t, lib)
            self._add(CommInfo(info.comm_id, info.parent_id, info.rank, info.size, lib, op, t, pid, h,
                               written=False))
            # A later communicator may get this handle: it starts a new history entry when created.
            return
        parent = self.lookup(pid, int(ev["parent"]), t, lib) if int(ev["parent"]) else None
        parent_id = parent.comm_id if parent else 0
        color, index = int(ev["color"]), int(ev["index"])
        if name == "MPI_Comm_split":
            if color == MPI_UNDEFINED:
                return
            cid = stable_id("mpi-split", parent_id, index, color)
        elif name == "MPI_Comm_dup":
            cid = stable_id("mpi-dup", parent_id, index)
        elif name == "MPI_Comm_create":
            if h in (0, MPICH_COMM_NULL) or h == self._predefined(pid).get("null"):
                return
            # disjoint groups of one call: the fast path records the parent rank of each group's first
            # member as the color (the uprobe path cannot read the group: 0, one id for all groups;
            # the group of parent rank 0 keeps the id without a color, which earlier files carry)
            cid = (stable_id("mpi-create", parent_id, index, color) if color > 0
                   else stable_id("mpi-create", parent_id, index))
        elif name == "ncclCommSplit":
            if color == NCCL_SPLIT_NOCOLOR or h == 0:
                return
            cid = stable_id("nccl-split", parent_id, index, color)
        elif name == "ncclCommInitAll":
            cid = stable_id("nccl-initall", self.node, pid, t)
        else:  # ncclCommInitRank, ncclCommInitRankConfig
            uid_hash = int(ev.get("uid_hash", 0)) or fnv1a64(bytes(ev["uid"]))
            cid = stable_id("nccl-uid", uid_hash)
        self._add(CommInfo(cid, parent_id, int(ev["rank"]), int(ev["size"]), lib, op, t, pid, h))

    def communicator_rows(self, now_ns: int, final: bool) -> np.ndarray:
        """Rows for /collectives/communicators whose rank and size are known (or waited for long
        enough: then -1 says they were not observed)."""
        ready, keep = [], []
        for info in self.pending:
            done = info.rank >= 0 and info.size >= 0
            if done or final or now_ns - info.t_ns > self.COMM_ROW_DELAY_NS:
                ready.append(info)
            else:
                keep.append(info)
        self.pending = keep
        rows = schema.COMMUNICATORS.empty(len(ready))
        for i, c in enumerate(ready):
            rows[i] = (c.t_ns, c.pid, c.library, c.op, c.comm_id, c.parent_id, c.handle, c.rank, c.size)
        return rows

    def call_rows(self, calls: np.ndarray, path: str) -> np.ndarray:
        """gp_call records (structured array with the C field names) -> /collectives/calls rows."""
        rows = schema.COLLECTIVE_CALLS.empty(len(calls))
        if len(calls) == 0:
            return rows
        for name in ("t_enter_ns", "t_exit_ns", "pid", "tid", "library", "op", "seq", "bytes", "ret", "handle"):
            rows[name] = calls[name]
        rows["root_or_peer"] = calls["peer"]
        rows["tag"] = calls["tag"]
        rows["path"] = PATH_CODES[path]
        recv_op = schema.COLLECTIVE_OPS.index("MPI_Recv")
        half = (calls["flags"] & GP_F_SENDRECV_RECV) != 0
        rows["op"][half] = recv_op  # the receive half of MPI_Sendrecv (docs/probes.md)
        self._resolve_comms(calls, rows)
        return rows


def comm_op_name(op: int) -> str:
    for name, code in INTERNAL_COMM_OPS.items():
        if code == op:
            return name
    return schema.COMMUNICATOR_OPS[op]


def _handle_key(maps: list[Any], handle: int) -> str:
    """A handle as the same string on every rank: its file and offset when it points into a mapped
    file (Open MPI's predefined objects), else its value (MPICH's integer handles)."""
    for m in maps:
        if m.start <= handle < m.end and m.path.startswith("/"):
            return f"{os.path.basename(m.path)}+{handle - m.start + m.offset:#x}"
    return f"{handle:#x}"


def system_libraries(pattern: re.Pattern[str]) -> list[str]:
    """Files of `ldconfig -p` whose name matches (real paths, each file once)."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found: dict[str, str] = {}
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        lib = name.split(" ")[0]
        if path and pattern.match(lib) and "x86-64" in name:
            found.setdefault(os.path.realpath(path), path)
    return sorted(found)


def predefined_mpi_handles(pid: int, maps: list[Any] | None = None) -> dict[str, int]:
    """MPI_COMM_WORLD, MPI_COMM_SELF and MPI_COMM_NULL of a process, by its MPI's ABI."""
    maps = read_maps(pid) if maps is None else maps
    for m in maps:
        base = os.path.basename(m.path)
        if LIBRARY_PATTERNS["mpi"].match(base) and "x" in m.perms:
            world = symbol_address(pid, m.path, "ompi_mpi_comm_world", maps)
            if world is not None:
                return {
                    "world": world,
                    "self": symbol_address(pid, m.path, "ompi_mpi_comm_self", maps) or 0,
                    "null": symbol_address(pid, m.path, "ompi_mpi_comm_null", maps) or 0,
                }
            return {"world": MPICH_COMM_WORLD, "self": MPICH_COMM_SELF, "null": MPICH_COMM_NULL}
    return {}


def ctypes_records(records: list[Any], fields: Iterable[str], dtype: np.dtype) -> np.ndarray:
    out = np.zeros(len(records), dtype=dtype)
    for name in fields:
        out[name] = [getattr(r, name) for r in records]
    return out


CALL_DTYPE = np.dtype([
    ("t_enter_ns", "<u8"), ("t_exit_ns", "<u8"), ("handle", "<u8"), ("seq", "<u8"), ("bytes", "<u8"),
    ("aux", "<u8"), ("pid", "<u4"), ("tid", "<u4"), ("peer", "<i4"), ("tag", "<i4"), ("ret", "<i4"),
    ("op", "<u2"), ("library", "u1"), ("flags", "u1"),
])  # the decoded form of struct gp_call (fields by name; the C layout is BCC's or layout.json's)
CALL_FIELDS: tuple[str, ...] = tuple(CALL_DTYPE.names or ())

