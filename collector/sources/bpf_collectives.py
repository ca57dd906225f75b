"""Mode `collectives` through uprobes: MPI and NCCL calls of the job's processes (bpf/collectives.c).

The probe table below is the one place that says, per entry point, which argument is the
communicator, the count, the datatype, the root or peer...; the collector loads it into the BPF
map gp_descs and one generic decoder in C serves every function. `CommRegistry` turns communicator
handles into job-wide ids (rules in docs/probes.md); the fast path (collector/sources/fastpath.py)
feeds it the same records, so both paths give the same ids and sequence numbers.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collector import schema
from collector.bpf_support import (
    INTERNAL_COMM_OPS,
    BpfHub,
    attach_symbols,
    defined_functions,
    defines_for_all,
    detach_symbols,
    mapped_libraries,
    read_environ,
    read_maps,
    read_ring_drops,
    symbol_address,
)
from collector.sources.base import Batch, Source, SourceContext, SourceUnavailable

GP_BYTES_UNKNOWN = 0xFFFFFFFFFFFFFFFF
GP_SEQ_NONE = 0xFFFFFFFFFFFFFFFF
GP_F_SENDRECV_RECV = 1
LIB_CODES = {"mpi": 0, "nccl": 1}
PATH_CODES = {"uprobe": 0, "fastpath": 1}
MPI_UNDEFINED = -32766  # color of MPI_Comm_split that yields MPI_COMM_NULL (Open MPI and MPICH)
NCCL_SPLIT_NOCOLOR = -1
MPICH_COMM_WORLD, MPICH_COMM_SELF, MPICH_COMM_NULL = 0x44000000, 0x44000001, 0x04000000

LIBRARY_PATTERNS = {
    "mpi": re.compile(r"^lib(mpi|mpich|mpi_mpifh)\.so(\.\d+)*$"),
    "nccl": re.compile(r"^libnccl\.so(\.\d+)*$"),
}


@dataclass(frozen=True)
class Probe:
    """Where the decoder finds each thing among the function's arguments (1-based, 0 = absent)."""

    symbol: str
    library: str
    op: str  # a name of schema.COLLECTIVE_OPS (calls) or COMMUNICATOR_OPS/INTERNAL_COMM_OPS (comm)
    kind: str = "call"
    comm: int = 0
    comm_ptr: int = 0
    count: int = 0
    count_array: int = 0
    dtype: int = 0
    peer: int = 0
    tag: int = 0
    request: int = 0
    stream: int = 0
    p2p: int = 0  # 1 send, 2 receive, 3 sendrecv
    count2: int = 0
    dtype2: int = 0
    peer2: int = 0
    tag2: int = 0
    completion: int = 0  # 1 wait, 2 test, 3 waitall, 4 testall
    flag: int = 0
    newcomm: int = 0
    color: int = 0
    key: int = 0
    rank: int = 0
    size: int = 0
    out_int: int = 0
    uid: int = 0
    ndev: int = 0
    noseq: int = 0

    @property
    def op_code(self) -> int:
        if self.kind == "call":
            return schema.COLLECTIVE_OPS.index(self.op)
        if self.op in INTERNAL_COMM_OPS:
            return INTERNAL_COMM_OPS[self.op]
        return schema.COMMUNICATOR_OPS.index(self.op)


def _m(sym: str, **kw: Any) -> Probe:
    return Probe(sym, "mpi", kw.pop("op", sym), **kw)


def _n(sym: str, **kw: Any) -> Probe:
    return Probe(sym, "nccl", kw.pop("op", sym), **kw)


PROBES: tuple[Probe, ...] = (
    # MPI blocking collectives
    _m("MPI_Allreduce", count=3, dtype=4, comm=6),
    _m("MPI_Reduce", count=3, dtype=4, peer=6, comm=7),
    _m("MPI_Bcast", count=2, dtype=3, peer=4, comm=5),
    _m("MPI_Barrier", comm=1),
    _m("MPI_Allgather", count=2, dtype=3, comm=7),
    _m("MPI_Allgatherv", count=2, dtype=3, comm=8),
    _m("MPI_Alltoall", count=2, dtype=3, comm=7),
    _m("MPI_Alltoallv", count=2, count_array=1, dtype=4, comm=9),
    _m("MPI_Reduce_scatter", count=3, count_array=1, dtype=4, comm=6),
    _m("MPI_Reduce_scatter_block", count=3, dtype=4, comm=6),
    _m("MPI_Gather", count=2, dtype=3, peer=7, comm=8),
    _m("MPI_Gatherv", count=2, dtype=3, peer=8, comm=9),
    _m("MPI_Scatter", count=5, dtype=6, peer=7, comm=8),  # receive side: send args are root-only
    _m("MPI_Scatterv", count=6, dtype=7, peer=8, comm=9),
    _m("MPI_Scan", count=3, dtype=4, comm=6),
    # MPI non-blocking collectives (completed by MPI_Wait/Test rows)
    _m("MPI_Iallreduce", count=3, dtype=4, comm=6, request=7),
    _m("MPI_Ireduce", count=3, dtype=4, peer=6, comm=7, request=8),
    _m("MPI_Ibcast", count=2, dtype=3, peer=4, comm=5, request=6),
    _m("MPI_Ibarrier", comm=1, request=2),
    _m("MPI_Iallgather", count=2, dtype=3, comm=7, request=8),
    _m("MPI_Ialltoall", count=2, dtype=3, comm=7, request=8),
    _m("MPI_Ireduce_scatter", count=3, count_array=1, dtype=4, comm=6, request=7),
    _m("MPI_Igather", count=2, dtype=3, peer=7, comm=8, request=9),
    _m("MPI_Iscatter", count=5, dtype=6, peer=7, comm=8, request=9),
    _m("MPI_Iscan", count=3, dtype=4, comm=6, request=7),
    # MPI point to point and completions
    _m("MPI_Send", count=2, dtype=3, peer=4, tag=5, comm=6, p2p=1),
    _m("MPI_Recv", count=2, dtype=3, peer=4, tag=5, comm=6, p2p=2),
    _m("MPI_Isend", count=2, dtype=3, peer=4, tag=5, comm=6, request=7, p2p=1),
    _m("MPI_Irecv", count=2, dtype=3, peer=4, tag=5, comm=6, request=7, p2p=2),
    _m("MPI_Sendrecv", count=2, dtype=3, peer=4, tag=5, count2=7, dtype2=8, peer2=9, tag2=10, comm=11, p2p=3),
    _m("MPI_Wait", request=1, completion=1),
    _m("MPI_Test", request=1, flag=2, completion=2),
    _m("MPI_Waitall", count=1, request=2, completion=3),
    _m("MPI_Testall", count=1, request=2, flag=3, completion=4),
    # MPI communicators
    _m("MPI_Init", op="MPI_Init", kind="comm"),
    _m("MPI_Init_thread", op="MPI_Init", kind="comm"),
    _m("MPI_Comm_split", kind="comm", comm=1, color=2, key=3, newcomm=4),
    _m("MPI_Comm_dup", kind="comm", comm=1, newcomm=2),
    _m("MPI_Comm_create", kind="comm", comm=1, newcomm=3),
    _m("MPI_Comm_free", kind="comm", comm=1, comm_ptr=1),
    _m("MPI_Comm_rank", kind="comm", comm=1, out_int=2),
    _m("MPI_Comm_size", kind="comm", comm=1, out_int=2),
    # NCCL collectives and point to point (args 7.. on the stack: stream, comm of ncclReduce)
    _n("ncclAllReduce", count=3, dtype=4, comm=6, stream=7),
    _n("ncclAllGather", count=3, dtype=4, comm=5, stream=6),
    _n("ncclReduceScatter", count=3, dtype=4, comm=6, stream=7),
    _n("ncclBroadcast", count=3, dtype=4, peer=5, comm=6, stream=7),
    _n("ncclReduce", count=3, dtype=4, peer=6, comm=7, stream=8),
    _n("ncclSend", count=2, dtype=3, peer=4, comm=5, stream=6, p2p=1),
    _n("ncclRecv", count=2, dtype=3, peer=4, comm=5, stream=6, p2p=2),
    _n("ncclGroupStart", noseq=1),
    _n("ncclGroupEnd", noseq=1),
    # NCCL communicators (the 128-byte ncclUniqueId is passed by value: first stack slot)
    _n("ncclCommInitRank", kind="comm", newcomm=1, size=2, rank=3, uid=1),
    _n("ncclCommInitRankConfig", kind="comm", newcomm=1, size=2, rank=3, uid=1),
    _n("ncclCommInitAll", kind="comm", newcomm=1, ndev=2),
    _n("ncclCommSplit", kind="comm", comm=1, color=2, key=3, newcomm=4),
    _n("ncclCommDestroy", kind="comm", comm=1),
    _n("ncclCommAbort", kind="comm", comm=1),
    _n("ncclCommCount", kind="comm", comm=1, out_int=2),
    _n("ncclCommUserRank", kind="comm", comm=1, out_int=2),
)
PROBE_IDS = {p.symbol: i for i, p in enumerate(PROBES)}


def collectives_defines() -> dict[str, str]:
    """-D values for bpf/collectives.c: probe numbers, the entry programs to generate, ring size."""
    out = {f"GP_PROBE_{p.symbol}": str(i) for i, p in enumerate(PROBES)}
    out["GP_PROBE_LIST"] = " ".join(f"GP_ENTRY({p.symbol})" for p in PROBES)
    out.setdefault("GP_CALLS_PAGES", "256")
    return out


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
        if pids.min() == pids.max() and handles.min() == handles.max():
            return [(int(pids[0]), int(handles[0]), where)]
        idx = np.arange(len(pids)) if isinstance(where, slice) else where
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
        name = _comm_op_name(op)
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
            cid = stable_id("mpi-create", parent_id, index)
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


def _comm_op_name(op: int) -> str:
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


def resolve_paths(config: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per library: 'uprobe' or 'fastpath' (auto = fast path when its library is built)."""
    from collector.sources.fastpath import built_libraries

    built = built_libraries()
    out = {}
    for lib in ("mpi", "nccl"):
        want = config.get("sources.collectives", {}).get(f"{lib}_path", "auto")
        if want == "auto":
            want = "fastpath" if built.get(lib) else "uprobe"
        out[lib] = want
    return out


class BpfCollectivesSource(Source):
    """Uprobes on the MPI and NCCL libraries mapped into the job's processes."""

    name = "collectives_uprobe"
    tables = (schema.COLLECTIVE_CALLS, schema.COMMUNICATORS)
    interval_s = 0.2

    def __init__(self, libraries: tuple[str, ...] | None = None) -> None:
        # libraries: which to probe; None = those the config routes to uprobes.
        self.libraries = libraries
        self.hub: BpfHub | None = None
        self.attached: set[tuple[str, str]] = set()
        self.missing: dict[str, set[str]] = {}
        self._calls: list[Any] = []
        self._comms: list[Any] = []
        # Decoded records as they came, kept only when asked (tests check fields not stored in
        # the file, like the NCCL stream, and the raw communicator records).
        self.keep_raw = False
        self.raw_calls: list[np.ndarray] = []
        self.events_comm: list[dict[str, Any]] = []

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        if self.libraries is None:
            paths = resolve_paths(ctx.config)
            self.libraries = tuple(lib for lib in ("mpi", "nccl") if paths[lib] == "uprobe")
        if not self.libraries:
            raise SourceUnavailable("collectives of every library go through the fast path (config)")
        pages = int(ctx.config.get("sources.collectives", {}).get("ring_pages", 256)) * (os.cpu_count() or 1)

        def defines(switches: tuple[str, ...]) -> dict[str, str]:
            d = defines_for_all(switches)
            d["GP_CALLS_PAGES"] = str(1 << max(0, pages - 1).bit_length())  # a power of two
            return d

        self.hub = BpfHub.acquire(ctx.modes if "collectives" in ctx.modes else (*ctx.modes, "collectives"),
                                  defines)
        if not self.hub.has("GP_WITH_COLLECTIVES"):
            raise SourceUnavailable("the shared BPF object was compiled without collectives")
        b = self.hub.bpf
        descs = b[b"gp_descs"]
        for i, p in enumerate(PROBES):
            leaf = descs.Leaf()
            for f in Probe.__dataclass_fields__:
                if f in ("symbol", "library", "op", "kind"):
                    continue
                setattr(leaf, f, getattr(p, f))
            leaf.op = p.op_code
            leaf.kind = 0 if p.kind == "call" else 1
            leaf.library = LIB_CODES[p.library]
            descs[descs.Key(i)] = leaf
        self.environs: dict[int, dict[str, str]] = {}
        self.maps: dict[int, list[Any]] = {}
        self.handles: dict[int, dict[str, int]] = {}
        self.registry = CommRegistry(ctx.node, environ=self._environ, mpi_handles=self._mpi_handles,
                                     maps=self._maps)
        b[b"gp_calls"].open_ring_buffer(self._on_call)
        b[b"gp_comms"].open_ring_buffer(self._on_comm)
        # Libraries the system linker knows are probed from the start, so that calls a rank makes
        # before the collector's next process scan (MPI_Init, communicator splits) are seen.
        for lib in self.libraries:
            for path in system_libraries(LIBRARY_PATTERNS[lib]):
                self.attach_library(lib, path)
        self._refresh(set(ctx.pids()))

    def _on_call(self, _cpu: int, data: Any, _size: int) -> None:
        ev = self.hub.bpf[b"gp_calls"].event(data)  # type: ignore[union-attr]
        self._calls.append(tuple(getattr(ev, f) for f in CALL_FIELDS))

    def _on_comm(self, _cpu: int, data: Any, _size: int) -> None:
        ev = self.hub.bpf[b"gp_comms"].event(data)  # type: ignore[union-attr]
        d = {f: getattr(ev, f) for f, _ in ev._fields_}
        d["uid"] = bytes(ev.uid)
        self._comms.append(d)

    def _environ(self, pid: int) -> dict[str, str]:
        """A rank's environment (launch namespace, world rank and size), read while it is alive."""
        env = self.environs.get(pid)
        if env is None:
            env = read_environ(pid)
            if env:
                self.environs[pid] = env
        return env

    def _maps(self, pid: int) -> list[Any]:
        """The process's mappings as last seen alive (handles are resolved after it exited)."""
        return self.maps.get(pid) or read_maps(pid)

    def _mpi_handles(self, pid: int) -> dict[str, int]:
        h = self.handles.get(pid)
        if h is None:
            h = predefined_mpi_handles(pid, self._maps(pid))
            if h:
                self.handles[pid] = h
        return h

    def _refresh(self, pids: set[int]) -> None:
        """Put new job pids into the kernel's set; for every job process (the kernel's set also
        holds the children it saw forked) keep its environment and attach to libraries it maps."""
        assert self.hub is not None
        self.hub.set_pids(pids)
        pids = pids | {k.value for k in self.hub.job_pids if os.path.isdir(f"/proc/{k.value}/task")}
        mpich = self.hub.bpf[b"gp_mpich"]
        for pid in pids:
            self._environ(pid)
            maps = read_maps(pid)
            for lib in self.libraries or ():
                for path in mapped_libraries(pid, LIBRARY_PATTERNS[lib], maps):
                    self.maps[pid] = maps
                    if lib == "mpi" and self._mpi_handles(pid).get("world") == MPICH_COMM_WORLD:
                        mpich[mpich.Key(pid)] = mpich.Leaf(1)
                    self.attach_library(lib, path)

    def attach_library(self, lib: str, path: str) -> list[str]:
        """Attach entry and return probes to every probed symbol the file defines (all processes
        mapping it trap; only job processes are recorded). Returns the symbols attached now."""
        assert self.hub is not None
        wanted = [p.symbol for p in PROBES if p.library == lib]
        have = defined_functions(path, wanted)
        self.missing[path] = set(wanted) - have
        def attach(bpf: Any, name: bytes, sym: bytes) -> None:
            bpf.attach_uprobe(name=name, sym=sym, fn_name=b"gp_enter_" + sym)
            bpf.attach_uretprobe(name=name, sym=sym, fn_name=b"gp_return")

        return attach_symbols(self.hub, path, [s for s in wanted if s in have], self.attached, attach,
                              lambda msg: self.ctx.report_error(self.name, msg))

    def _drain(self) -> tuple[np.ndarray, list[dict[str, Any]]]:
        assert self.hub is not None
        # Calls first, then communicators: a communicator created before a call entered is already
        # in its ring when the call is read, so it is applied first (CommRegistry.lookup).
        # One BPF object serves every eBPF source, and consuming runs all their callbacks: take the
        # hub's lock so another source's drain cannot append while this one swaps its lists.
        with self.hub.ring_lock:
            self.hub.bpf.ring_buffer_consume()
            calls = np.array(self._calls, dtype=CALL_DTYPE)
            comms = self._comms
            self._calls, self._comms = [], []
        return calls, comms

    def sample(self, now_ns: int) -> list[Batch]:
        self._refresh(set(self.ctx.pids()))
        return self._rows(now_ns, final=False)

    def _rows(self, now_ns: int, final: bool) -> list[Batch]:
        calls, comms = self._drain()
        for ev in comms:
            self.registry.on_comm(ev)
        if self.keep_raw:
            self.events_comm.extend(comms)
            self.raw_calls.append(calls)
        rows = self.registry.call_rows(calls, "uprobe")
        return [(schema.COLLECTIVE_CALLS, rows),
                (schema.COMMUNICATORS, self.registry.communicator_rows(now_ns, final))]

    def final(self, now_ns: int) -> list[Batch]:
        return self._rows(now_ns, final=True)

    def drops(self) -> int:
        return sum(read_ring_drops(self.hub.bpf[b"gp_coll_drops"])) if self.hub else 0

    def stop(self) -> None:
        if self.hub is not None:
            def detach(bpf: Any, path: bytes, sym: bytes) -> None:
                bpf.detach_uretprobe(name=path, sym=sym)
                bpf.detach_uprobe(name=path, sym=sym)

            detach_symbols(self.hub, self.attached, detach)
            self.hub.release()
            self.hub = None


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)
