"""The probe table of mode `collectives`: per MPI and NCCL entry point, which argument is the
communicator, the count, the datatype, the root or peer... The collector loads it into the BPF map
gp_descs and one generic decoder in C (bpf/collectives.c) serves every function; the BPF program is
compiled with `collectives_defines()`. Data only: both collective paths and bpf_support read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpuprof.collector import schema
from gpuprof.collector.schema import INTERNAL_COMM_OPS

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
    completion: int = 0  # 1 wait, 2 test, 3 waitall, 4 testall, 5 waitany, 6 waitsome
    flag: int = 0
    index: int = 0  # int* the call writes: the index of MPI_Waitany, the outcount of MPI_Waitsome
    indices: int = 0  # int* array of the indices MPI_Waitsome completed
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
    # Waitany and Waitsome block, so a probe's trap per call costs little against the call. Their
    # test forms are not probed: a polling loop (hpcc's RandomAccess calls MPI_Testany 700 000
    # times a second a rank) would trap at every poll, a microsecond or more each; the fast path,
    # the default, records them (docs/probes.md).
    _m("MPI_Waitany", count=1, request=2, index=3, completion=5),
    _m("MPI_Waitsome", count=1, request=2, index=3, indices=4, completion=6),
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
    """-D values for bpf/collectives.c: probe numbers and the entry programs to generate (the ring's
    size is the config's: bpf_support.defines_for_all)."""
    out = {f"GP_PROBE_{p.symbol}": str(i) for i, p in enumerate(PROBES)}
    out["GP_PROBE_LIST"] = " ".join(f"GP_ENTRY({p.symbol})" for p in PROBES)
    return out

