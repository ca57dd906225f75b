"""Matching: calls of all nodes -> collective instances (comm_id, seq) and point-to-point pairs,
plus the mismatch analysis a flight recorder's analyzer does for a hung job.

Takes arrays (the calls of each node on its own realtime clock), never paths. Times here are
float64 ns relative to the job epoch, raw (not yet aligned); alignment is applied by the caller.

The job-wide [seq x rank] tables of the merge live in a CommStore: filled node by node, read back
by blocks of sequence numbers, either in memory (library use) or in an HDF5 scratch file (the merge
driver on rank 0, whose memory then holds one block at a time, whatever the node count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import h5py
import numpy as np

from gpuprof.collector.schema import COLLECTIVE_OPS
from gpuprof.mpi_merge.common import ArrayLike2D, nanmedian_rows, read_rows, row_blocks

OPS = COLLECTIVE_OPS
_I = {name: i for i, name in enumerate(OPS)}
# Every rank's output depends on every rank's input: no rank can leave before the last one entered.
NXN_OPS = frozenset(_I[n] for n in (
    "MPI_Allreduce", "MPI_Allgather", "MPI_Allgatherv", "MPI_Alltoall", "MPI_Alltoallv",
    "MPI_Reduce_scatter", "MPI_Reduce_scatter_block", "ncclAllReduce", "ncclAllGather", "ncclReduceScatter",
))
BARRIER_OPS = frozenset({_I["MPI_Barrier"]})
ONE_TO_N_OPS = frozenset(_I[n] for n in ("MPI_Bcast", "MPI_Scatter", "MPI_Scatterv", "ncclBroadcast"))
N_TO_ONE_OPS = frozenset(_I[n] for n in ("MPI_Reduce", "MPI_Gather", "MPI_Gatherv", "ncclReduce"))
OTHER_BLOCKING = frozenset({_I["MPI_Scan"]})
COLLECTIVE_SET = NXN_OPS | BARRIER_OPS | ONE_TO_N_OPS | N_TO_ONE_OPS | OTHER_BLOCKING
# Point to point: the send half of MPI_Sendrecv is a row of op MPI_Sendrecv, its receive half a row of
# op MPI_Recv with the same times (docs/probes.md). Non-blocking ones complete in an MPI_Wait/Test row
# that carries the communicator, seq, peer and tag of the call that started the request.
BLOCKING_SEND_OPS = frozenset({_I["MPI_Send"], _I["MPI_Sendrecv"], _I["ncclSend"]})
SEND_OPS = BLOCKING_SEND_OPS | {_I["MPI_Isend"]}
RECV_OPS = frozenset({_I["MPI_Recv"], _I["MPI_Irecv"], _I["ncclRecv"]})
NONBLOCKING_P2P_OPS = frozenset({_I["MPI_Isend"], _I["MPI_Irecv"]})
COMPLETION_OPS = frozenset(_I[n] for n in ("MPI_Wait", "MPI_Waitall", "MPI_Test", "MPI_Testall", "MPI_Waitany",
                                            "MPI_Waitsome", "MPI_Testany", "MPI_Testsome"))
P2P_OPS = SEND_OPS | RECV_OPS | COMPLETION_OPS
SEQ_NONE = 0xFFFFFFFFFFFFFFFF  # a call without a sequence number (bpf/gpuprof_events.h GP_SEQ_NONE)
NCCL_OPS = frozenset(i for i, n in enumerate(OPS) if n.startswith("nccl"))
# Ops whose buffers must have the same size on every rank (v-variants legitimately differ).
SAME_SIZE_OPS = frozenset(_I[n] for n in (
    "MPI_Allreduce", "MPI_Bcast", "MPI_Reduce", "MPI_Allgather", "MPI_Alltoall", "MPI_Reduce_scatter_block",
    "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
))
# NCCL calls return once the work is queued on the stream: host-side exit is not completion, so the
# causality bound does not hold for them. The clock fit uses blocking MPI N-to-N calls by default.
CLOCK_OPS_DEFAULT = frozenset((NXN_OPS | BARRIER_OPS) - NCCL_OPS)
# ... but on the GPU an N-to-N NCCL kernel cannot end on any rank before every rank's kernel began
# (each needs every other's data), so where the profiler plugin gave device-side times for every rank
# of an instance, the instance joins the fit like a blocking MPI one.
DEVICE_CLOCK_OPS = frozenset(NXN_OPS & NCCL_OPS)


@dataclass
class CommTable:
    comm_id: int
    size: int
    node_of_rank: np.ndarray  # [size] index into the job's node list, -1 when no calls were seen
    pid_of_rank: np.ndarray  # [size]
    enter: np.ndarray  # [n_seq, size] float64 ns, NaN = no call
    exit: np.ndarray  # [n_seq, size] float64 ns, NaN = no call or never returned
    op: np.ndarray  # [n_seq, size] int16, -1 = no call
    nbytes: np.ndarray  # [n_seq, size] int64
    root: np.ndarray  # [n_seq, size] int32
    seq0: int = 0  # seq of the first row: a CommStore block holds rows seq0 .. seq0 + n_seq - 1
    # [size] seq from which a rank is left out (its node's file ends there, or it has no file at
    # all): the instances it misses are judged on the other ranks instead of being lost for all.
    # None: every rank takes part in every instance.
    excluded_from: np.ndarray | None = None
    # [n_seq, size] float64 ns: the host's enqueue of an NCCL call whose enter/exit are its kernel's
    # device-side start and end; NaN where the times are the host's (every MPI call). None: no
    # device-timed call in the table.
    host_enter: np.ndarray | None = None

    @property
    def n_seq(self) -> int:
        return int(self.enter.shape[0])

    def active(self) -> np.ndarray:
        """[n_seq, size] bool: the rank is expected in the instance (not excluded there)."""
        if self.excluded_from is None:
            return np.ones(self.op.shape, bool)
        seqs = self.seq0 + np.arange(self.n_seq)
        return seqs[:, None] < self.excluded_from[None, :]

    def complete(self) -> np.ndarray:
        """Instances every expected rank entered and left, with one op, and at least two of them:
        the ones wait states are computed on."""
        act = self.active()
        present = np.where(act, (self.op >= 0) & np.isfinite(self.exit), True).all(axis=1)
        first = np.argmax(act, axis=1)  # the first expected rank's op is the one all must have called
        ref_op = self.op[np.arange(self.n_seq), first]
        same = np.where(act, self.op == ref_op[:, None], True).all(axis=1)
        return present & same & (act.sum(axis=1) >= 2)


@dataclass
class Mismatch:
    comm_id: int
    first_seq: int
    kind: str  # "missing_rank", "op_differs", "size_differs", "not_returned", "rank_never_seen"
    missing_ranks: list[int]
    culprit_ranks: list[int]
    culprit_nodes: list[str]
    detail: str
    instances_affected: int


@dataclass
class P2PPairs:
    """Matched messages: one entry per send matched with its receive. Times raw float ns from the
    epoch, on the sending or receiving node's clock; NaN where a call never returned or a
    non-blocking request has no completion row."""

    comm_id: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    tag: np.ndarray
    send_node: np.ndarray
    recv_node: np.ndarray
    send_enter: np.ndarray  # the send started (Send/Sendrecv/Isend entry)
    send_exit: np.ndarray  # the send completed (its return, or its request's Wait/Test return)
    recv_enter: np.ndarray  # the receive was posted (Recv/Irecv entry)
    recv_exit: np.ndarray  # the receive completed (its return, or its request's Wait/Test return)
    unmatched: int = 0
    # the receiver began to wait for the message: Recv entry, or its request's Wait entry
    recv_wait: np.ndarray = field(default_factory=lambda: np.zeros(0))
    send_blocking: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # Send/Sendrecv, not Isend
    # the send half of a Sendrecv: the pair of the same call's receive half (-1: none paired, or not
    # a Sendrecv). The call waits once, for whichever came last (waitstates.compute_p2p_waits).
    same_call_recv: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # calls with no partner recorded at all (data lost, or a partner without a file), by reason
    unmatched_reasons: dict[str, int] = field(default_factory=dict)
    # calls that have a partner but cannot be paired or timed from what the probes record, by reason
    unpaired_reasons: dict[str, int] = field(default_factory=dict)


@dataclass
class Matched:
    comms: list[CommTable]
    p2p: P2PPairs
    mismatches: list[Mismatch]
    notes: list[str] = field(default_factory=list)


def build_comms(calls_by_node: list[np.ndarray], epoch_rt: int) -> list[CommTable]:
    """One table per communicator, rows = seq, columns = comm_rank. Rows of a node missing from the
    job simply stay NaN: they are reported, never filled in."""
    per_comm: dict[int, list[tuple[int, np.ndarray]]] = {}
    for ni, calls in enumerate(calls_by_node):
        if not len(calls):
            continue
        coll = _where(calls, np.isin(calls["op"], list(COLLECTIVE_SET)))
        for cid in np.unique(coll["comm_id"]):
            per_comm.setdefault(int(cid), []).append((ni, coll[coll["comm_id"] == cid]))
    tables = []
    for cid in sorted(per_comm):
        parts = per_comm[cid]
        size = max(int(p["comm_size"].max()) for _, p in parts)
        n_seq = max(int(p["seq"].max()) for _, p in parts) + 1
        t = CommTable(
            comm_id=cid, size=size, node_of_rank=np.full(size, -1, np.int64), pid_of_rank=np.zeros(size, np.int64),
            enter=np.full((n_seq, size), np.nan), exit=np.full((n_seq, size), np.nan),
            op=np.full((n_seq, size), -1, np.int16), nbytes=np.zeros((n_seq, size), np.int64),
            root=np.full((n_seq, size), -1, np.int32),
        )
        for ni, p in parts:
            r = p["comm_rank"].astype(np.int64)
            s = p["seq"].astype(np.int64)
            ok = (r >= 0) & (r < size)
            r, s, p = r[ok], s[ok], p[ok]
            t.node_of_rank[np.unique(r)] = ni
            for rr in np.unique(r):
                t.pid_of_rank[rr] = int(p["pid"][r == rr][0])
            t.enter[s, r] = (p["enter_rt"] - epoch_rt).astype(np.float64)
            t.exit[s, r] = np.where(p["returned"], (p["exit_rt"] - epoch_rt).astype(np.float64), np.nan)
            t.op[s, r] = p["op"]
            t.nbytes[s, r] = p["bytes"].astype(np.int64)
            t.root[s, r] = p["root_or_peer"]
            if p["device_timed"].any():
                if t.host_enter is None:
                    t.host_enter = np.full((n_seq, size), np.nan)
                dev = p["device_timed"]
                t.host_enter[s[dev], r[dev]] = (p["host_enter_rt"][dev] - epoch_rt).astype(np.float64)
        tables.append(t)
    return tables


# The fields of a communicator's [seq x rank] table: name, dtype, value where a rank made no call.
STORE_FIELDS: tuple[tuple[str, str, float], ...] = (
    ("enter", "<f8", np.nan), ("exit", "<f8", np.nan), ("op", "<i2", -1), ("nbytes", "<i8", 0), ("root", "<i4", -1),
    ("host_enter", "<f8", np.nan),
)


def job_comm_shapes(per_node: list[dict[int, tuple[int, int]]]) -> dict[int, tuple[int, int]]:
    """comm_id -> (size, number of seqs) of the job-wide tables, from each node's
    {comm_id: (largest comm_size, largest seq)} (loading.comm_shapes): what build_comms would size."""
    out: dict[int, tuple[int, int]] = {}
    for shapes in per_node:
        for cid, (size, last_seq) in shapes.items():
            old = out.get(cid, (0, 0))
            out[cid] = (max(old[0], size), max(old[1], last_seq + 1))
    return out


def _runs(sorted_ints: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) positions of the runs of consecutive values in a sorted array of distinct ints."""
    if not len(sorted_ints):
        return []
    cut = np.flatnonzero(np.diff(sorted_ints) != 1) + 1
    edges = [0, *cut.tolist(), len(sorted_ints)]
    return list(pairwise(edges))


@dataclass
class StoredComm:
    """One communicator of a CommStore. Tables are rank-major, [size, n_seq]: a node writes its
    ranks as whole rows, and a block of seqs is read across all ranks."""

    comm_id: int
    size: int
    n_seq: int
    node_of_rank: np.ndarray  # [size], -1 when no calls were seen
    pid_of_rank: np.ndarray  # [size]
    data: dict[str, ArrayLike2D]  # STORE_FIELDS name -> [size, n_seq]
    written: np.ndarray  # [size] bool: a node has filled this rank's row
    last_seq: np.ndarray  # [size] the last seq a rank called, -1 when none
    excluded_from: np.ndarray  # [size] CommTable.excluded_from (n_seq: never excluded)
    device_timed: bool = False  # some call has device-side times (its host_enter field is filled)


def _where(a: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """a[keep], without the copy when every row is kept (a node's calls are usually all collectives
    of one communicator: copying 14 fields of every call three times was most of add_node)."""
    return a if keep.all() else a[keep]


class CommStore:
    """The job-wide tables of every communicator (what build_comms makes), filled one node at a time
    and read back by blocks of seqs. `scratch`: an HDF5 group to keep them in instead of memory."""

    def __init__(self, shapes: dict[int, tuple[int, int]], epoch_rt: int, scratch: h5py.Group | None = None):
        self.epoch_rt = epoch_rt
        self.comms: list[StoredComm] = []
        for ci, cid in enumerate(sorted(shapes)):
            size, n_seq = shapes[cid]
            data: dict[str, ArrayLike2D] = {}
            for name, dtype, fill in STORE_FIELDS:
                if scratch is None:
                    data[name] = np.full((size, n_seq), fill, dtype)
                else:
                    data[name] = scratch.create_dataset(f"comm{ci}/{name}", shape=(size, n_seq), dtype=dtype,
                                                        fillvalue=fill)
            self.comms.append(StoredComm(cid, size, n_seq, np.full(size, -1, np.int64), np.zeros(size, np.int64),
                                         data, np.zeros(size, bool), np.full(size, -1, np.int64),
                                         np.full(size, n_seq, np.int64)))
        self._index = {c.comm_id: ci for ci, c in enumerate(self.comms)}

    def add_node(self, ni: int, calls: np.ndarray) -> None:
        """The collective calls of node `ni` (its index in the job's node list) into the tables, as
        build_comms does: rows of a rank outside the communicator are dropped, and a rank that a
        later node claims too keeps the earlier node's entries where the later one has none."""
        coll = _where(calls, np.isin(calls["op"], list(COLLECTIVE_SET)))
        for cid in np.unique(coll["comm_id"]):
            if int(cid) not in self._index:
                raise ValueError(f"node {ni}: communicator {int(cid):#x} is not in the job's shapes "
                                 "(its summary did not list it)")
            c = self.comms[self._index[int(cid)]]
            p = _where(coll, coll["comm_id"] == cid)
            r = p["comm_rank"].astype(np.int64)
            s = p["seq"].astype(np.int64)
            ok = (r >= 0) & (r < c.size)
            r, s, p = _where(r, ok), _where(s, ok), _where(p, ok)
            ranks = np.unique(r)
            c.node_of_rank[ranks] = ni
            values = {
                "enter": (p["enter_rt"] - self.epoch_rt).astype(np.float64),
                "exit": np.where(p["returned"], (p["exit_rt"] - self.epoch_rt).astype(np.float64), np.nan),
                "op": p["op"], "nbytes": p["bytes"].astype(np.int64), "root": p["root_or_peer"],
                "host_enter": np.where(p["device_timed"], (p["host_enter_rt"] - self.epoch_rt).astype(np.float64),
                                       np.nan),
            }
            if p["device_timed"].any():
                c.device_timed = True
            for rr in ranks:
                mine = r == rr
                c.pid_of_rank[rr] = int(p["pid"][mine][0])
                c.last_seq[rr] = max(int(c.last_seq[rr]), int(s[mine].max()))
            # the node's ranks as one [ranks, n_seq] array per field, written at once: one write per run
            # of consecutive ranks (a node's ranks usually are one run) instead of one per rank, the
            # rows read back first only for a rank an earlier node has written too
            slot = np.searchsorted(ranks, r)
            for name, dtype, fill in STORE_FIELDS:
                if name == "host_enter" and not c.device_timed:
                    continue  # all NaN, the fill value: an MPI communicator never writes it
                rows = np.full((len(ranks), c.n_seq), fill, dtype)
                for j in np.flatnonzero(c.written[ranks]):
                    rows[j] = c.data[name][int(ranks[j])]
                rows[slot, s] = values[name]
                for a, b in _runs(ranks):
                    c.data[name][int(ranks[a]):int(ranks[b - 1]) + 1] = rows[a:b]
            c.written[ranks] = True

    def exclude_cut_ranks(self, cut_nodes: set[int]) -> list[tuple[int, list[int], int]]:
        """Leave out, from the instances they miss, the ranks of nodes whose file was cut short (from
        the seq after their last call) and ranks no node file has (from the start), instead of
        making those instances incomplete for every rank. Returns (comm index, ranks, from seq) per
        group left out, for the report."""
        out = []
        for ci, c in enumerate(self.comms):
            unseen = np.flatnonzero(c.node_of_rank < 0)
            if len(unseen) and len(unseen) < c.size:
                c.excluded_from[unseen] = 0
                out.append((ci, [int(r) for r in unseen], 0))
            for ni in sorted(cut_nodes):
                ranks = np.flatnonzero(c.node_of_rank == ni)
                if not len(ranks):
                    continue
                start = int(c.last_seq[ranks].max()) + 1
                if start < c.n_seq:
                    c.excluded_from[ranks] = start
                    out.append((ci, [int(r) for r in ranks], start))
        return out

    def blocks(self, ci: int) -> list[tuple[int, int]]:
        """(first seq, end seq) of the blocks a pass over communicator ci reads."""
        c = self.comms[ci]
        return row_blocks(c.n_seq, c.size)

    def block(self, ci: int, s0: int, s1: int) -> CommTable:
        """Seqs s0 .. s1-1 of communicator ci as a CommTable (rows = seq, columns = rank)."""
        c = self.comms[ci]
        d = {name: np.ascontiguousarray(c.data[name][:, s0:s1].T) for name, _, _ in STORE_FIELDS}
        return CommTable(c.comm_id, c.size, c.node_of_rank, c.pid_of_rank, d["enter"], d["exit"], d["op"],
                         d["nbytes"], d["root"], seq0=s0,
                         excluded_from=c.excluded_from if (c.excluded_from < c.n_seq).any() else None,
                         host_enter=d["host_enter"] if c.device_timed else None)

    def read(self, ci: int, name: str, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        """One field at the given seqs (any order) and ranks: [len(seqs), ranks]."""
        return np.ascontiguousarray(read_rows(self.comms[ci].data[name], seqs, axis=1, other=ranks).T)


@dataclass
class MismatchRows:
    """Per seq of one communicator, over the ranks seen on it: what find_mismatches looks at. Kept
    as vectors (one flag per instance) so the tables themselves are read once, block by block."""

    any_present: np.ndarray  # some rank entered
    missing: np.ndarray  # some rank did not
    op_diff: np.ndarray  # a rank called another op than the majority
    size_diff: np.ndarray  # a rank passed another byte count where all must agree
    not_returned: np.ndarray  # a rank entered and never returned

    @classmethod
    def concat(cls, parts: list[MismatchRows]) -> MismatchRows:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) if parts else np.zeros(0, bool)
                     for f in ("any_present", "missing", "op_diff", "size_diff", "not_returned")))


def _seen_view(t: CommTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(seen columns, present, ops, majority op, sizes, majority size) of a block, seen ranks only."""
    cols = np.flatnonzero(t.node_of_rank >= 0)
    P = t.op[:, cols] >= 0
    ops = t.op[:, cols]
    maj = _row_mode(ops)
    sizes = t.nbytes[:, cols]
    smaj = _row_mode(np.where(P, sizes, -1))
    return cols, P, ops, maj, sizes, smaj


def mismatch_rows(t: CommTable) -> MismatchRows:
    """The per-row flags of a block of a communicator's table (rows are independent)."""
    cols, P, ops, maj, sizes, smaj = _seen_view(t)
    size_rows = np.isin(maj, list(SAME_SIZE_OPS))
    return MismatchRows(
        # a seq nobody has a row for is not a rank missing: a non-blocking collective's initiation (same
        # counter, another table) or records lost on every rank
        any_present=np.asarray(P.any(axis=1)), missing=np.asarray(P.any(axis=1) & ~P.all(axis=1)),
        op_diff=(P & (ops != maj[:, None])).any(axis=1),
        size_diff=size_rows & (P & (sizes != smaj[:, None])).any(axis=1),
        not_returned=(P & ~np.isfinite(t.exit[:, cols])).any(axis=1),
    )


def find_mismatches(
    store: CommStore, flags: list[MismatchRows], node_names: list[str], partial_nodes: set[str],
    excluded_nodes: dict[str, str], lossy_nodes: dict[str, int] | None = None,
) -> list[Mismatch]:
    """First mismatched instance per communicator, with the missing ranks and the likely culprit.

    `flags`: mismatch_rows of each communicator of the store, over all its rows. The culprit of a
    hang is the rank that did not reach the instance the others are waiting in; at a differing op
    or size, the ranks that differ from the majority. A node whose file was cut off is named as
    such, so a collector crash is not mistaken for a hang."""
    out = []
    for ci, (c, fl) in enumerate(zip(store.comms, flags)):
        seen = c.node_of_rank >= 0
        never = [int(r) for r in np.flatnonzero(~seen)]
        if never:
            miss_nodes = sorted(excluded_nodes)
            out.append(Mismatch(
                c.comm_id, 0, "rank_never_seen", never, never, [],
                f"ranks {_ranks(never)} of {c.size} have no calls on this communicator"
                + (f" (node files missing or excluded: {', '.join(miss_nodes)})" if miss_nodes else ""),
                c.n_seq,
            ))
        if not seen.any():
            continue
        # rows past the last one any rank entered are the job's end, not ranks missing
        last_any = int(np.flatnonzero(fl.any_present).max())
        missing = fl.missing.copy()
        missing[last_any + 1:] = False
        bad = missing | fl.op_diff | fl.size_diff | fl.not_returned
        if not bad.any():
            continue
        s = int(np.flatnonzero(bad)[0])
        out.append(_describe_first(store.block(ci, s, s + 1), node_names, partial_nodes, int(bad.sum()),
                                   c.last_seq, lossy_nodes or {}))
    return out


def _describe_first(t: CommTable, node_names: list[str], partial_nodes: set[str], affected: int,
                    last_seq: np.ndarray | None = None, lossy_nodes: dict[str, int] | None = None) -> Mismatch:
    """The Mismatch of the one-row block `t` (the first mismatched seq of its communicator)."""
    s = t.seq0
    cols, P, ops, maj, sizes, smaj = _seen_view(t)
    P, ops, maj, sizes, smaj, exits = P[0], ops[0], maj[0], sizes[0], smaj[0], t.exit[0, cols]
    missing = [int(cols[j]) for j in np.flatnonzero(~P)]
    if (P & (ops != maj)).any():
        kind = "op_differs"
        culprits = [int(cols[j]) for j in np.flatnonzero(P & (ops != maj))]
        detail = (f"seq {s}: ranks {_ranks(culprits)} called "
                  f"{', '.join(sorted({OPS[int(t.op[0, r])] for r in culprits}))} while the others called "
                  f"{OPS[int(maj)]}")
    elif missing and last_seq is not None and all(int(last_seq[r]) > s for r in missing):
        # the ranks called later collectives of this communicator: no hang, a record is missing
        kind = "records_lost"
        culprits = missing
        nodes = sorted({node_names[int(t.node_of_rank[r])] for r in missing if t.node_of_rank[r] >= 0})
        dropped = {n: (lossy_nodes or {}).get(n, 0) for n in nodes}
        why = ", ".join(f"{n} dropped {d} call records" for n, d in dropped.items() if d)
        detail = (f"seq {s}: no record of ranks {_ranks(missing)}, which called later collectives of this "
                  "communicator: their records were lost, the job did not hang here"
                  + (f" ({why}: the collector's ring was full)" if why else ""))
    elif missing:
        kind = "missing_rank"
        culprits = missing
        cut = sorted({node_names[int(t.node_of_rank[r])] for r in missing} & partial_nodes)
        detail = (f"seq {s}: ranks {_ranks(missing)} never entered while {int(P.sum())} ranks did"
                  + (f"; node files cut off (partial): {', '.join(cut)}" if cut else "; the job likely hung here"))
    elif int(maj) in SAME_SIZE_OPS and (P & (sizes != smaj)).any():
        kind = "size_differs"
        culprits = [int(cols[j]) for j in np.flatnonzero(P & (sizes != smaj))]
        detail = f"seq {s}: ranks {_ranks(culprits)} passed a different byte count ({OPS[int(maj)]})"
    else:
        kind = "not_returned"
        stuck = [int(cols[j]) for j in np.flatnonzero(P & ~np.isfinite(exits))]
        culprits = [int(c) for c in cols if int(c) not in stuck] if len(stuck) < len(cols) else []
        detail = (f"seq {s}: ranks {_ranks(stuck)} entered and never returned"
                  + (f"; ranks {_ranks(culprits)} left or never came" if culprits else ""))
    return Mismatch(
        t.comm_id, s, kind, missing, culprits,
        sorted({node_names[int(t.node_of_rank[r])] for r in culprits if t.node_of_rank[r] >= 0}),
        detail, affected,
    )


def _row_mode(a: np.ndarray) -> np.ndarray:
    """Most common value per row (ties: the smallest), ignoring -1."""
    out = np.full(a.shape[0], -1, dtype=a.dtype)
    if a.shape[1] == 0:
        return out
    srt = np.sort(a, axis=1)
    # fast path: rows where every entry is equal
    eq = (srt == srt[:, :1]).all(axis=1)
    out[eq] = srt[eq, 0]
    for i in np.flatnonzero(~eq):
        v = a[i][a[i] != -1]
        if len(v):
            vals, counts = np.unique(v, return_counts=True)
            out[i] = vals[np.argmax(counts)]
    return out


def _ranks(rs: list[int]) -> str:
    return ",".join(str(r) for r in rs[:20]) + ("..." if len(rs) > 20 else "")


_P2P_DT = np.dtype([("comm", "<u8"), ("src", "<i8"), ("dst", "<i8"), ("tag", "<i8"), ("seq", "<u8"),
                    ("node", "<i8"), ("pid", "<u8"), ("op", "<i8"), ("enter", "<f8"), ("exit", "<f8"),
                    ("wait_enter", "<f8"), ("done", "<f8")])


def _p2p_side(c: np.ndarray, ni: int, epoch_rt: int, is_send: bool) -> np.ndarray:
    p = c[np.isin(c["op"], list(SEND_OPS if is_send else RECV_OPS))]
    a = np.zeros(len(p), _P2P_DT)
    a["comm"] = p["comm_id"]
    a["src"] = p["comm_rank"] if is_send else p["root_or_peer"]
    a["dst"] = p["root_or_peer"] if is_send else p["comm_rank"]
    a["tag"], a["seq"], a["node"], a["pid"], a["op"] = p["tag"], p["seq"], ni, p["pid"], p["op"]
    a["enter"] = (p["enter_rt"] - epoch_rt).astype(np.float64)
    a["exit"] = np.where(p["returned"], (p["exit_rt"] - epoch_rt).astype(np.float64), np.nan)
    a["wait_enter"], a["done"] = a["enter"], a["exit"]
    nb = np.isin(a["op"], list(NONBLOCKING_P2P_OPS))
    if nb.any():
        _complete_requests(a, nb, c, epoch_rt)
    return a


def _complete_requests(a: np.ndarray, nb: np.ndarray, c: np.ndarray, epoch_rt: int) -> None:
    """Isend/Irecv rows get the times of their completion: the first Wait/Test row after them in the
    same process with the same communicator, seq, peer and tag (what the probes copy from the
    request into the completion). A completion is used once; none found leaves NaN.

    Vectorized (MEEP's 4-rank run has 2.9 million requests): per key the requests in order of entry
    take, each, the earliest unused completion that entered at or after them, so the k-th request
    of a key gets completion j_k = max(j_(k-1) + 1, lb_k), lb_k = how many of the key's completions
    entered before it; that is j_k = k + max over m <= k of (lb_m - m), a running maximum."""
    done = c[np.isin(c["op"], list(COMPLETION_OPS))]
    idx = np.flatnonzero(nb)
    a["wait_enter"][idx] = np.nan
    a["done"][idx] = np.nan
    if not len(done) or not len(idx):
        return
    d_enter = (done["enter_rt"] - epoch_rt).astype(np.float64)
    d_exit = np.where(done["returned"], (done["exit_rt"] - epoch_rt).astype(np.float64), np.nan)
    peer = np.where(a["op"][idx] == _I["MPI_Isend"], a["dst"][idx], a["src"][idx])
    cols = [np.concatenate([a["pid"][idx].astype(np.int64), done["pid"].astype(np.int64)]),
            np.concatenate([a["comm"][idx], done["comm_id"]]),
            np.concatenate([a["seq"][idx], done["seq"]]),
            np.concatenate([peer.astype(np.int64), done["root_or_peer"].astype(np.int64)]),
            np.concatenate([a["tag"][idx].astype(np.int64), done["tag"].astype(np.int64)])]
    n_req = len(idx)
    t = np.concatenate([a["enter"][idx], d_enter])
    is_done = np.arange(len(t)) >= n_req
    # by key, then time; at equal times a request before a completion (one that entered at the same
    # ns is eligible)
    order = np.lexsort((is_done, t, *cols[::-1]))
    new_key = np.zeros(len(order), bool)
    new_key[0] = True
    for col in cols:
        srt = col[order]
        new_key[1:] |= srt[1:] != srt[:-1]
    g_o = np.cumsum(new_key) - 1
    d_o = is_done[order]
    start = np.maximum.accumulate(np.where(new_key, np.arange(len(order)), 0))
    dones_before: np.ndarray = np.cumsum(d_o) - d_o  # completions strictly before, in the whole order
    lb: np.ndarray = dones_before - dones_before[start]  # ... of the same key
    reqs_before: np.ndarray = np.cumsum(~d_o) - (~d_o)
    k: np.ndarray = reqs_before - reqs_before[start]  # the request's index among its key's requests
    req_pos = np.flatnonzero(~d_o)
    big = len(order) + 1
    v = (lb[req_pos] - k[req_pos]) + g_o[req_pos] * big  # running maximum within each key
    j = k[req_pos] + (np.maximum.accumulate(v) - g_o[req_pos] * big)
    n_done_of = np.bincount(g_o[d_o], minlength=int(g_o[-1]) + 1)
    ok = j < n_done_of[g_o[req_pos]]
    # the key's completions in time order: their positions in `order`, by key then rank
    done_pos = np.flatnonzero(d_o)
    done_first = np.searchsorted(g_o[done_pos], g_o[req_pos], side="left")
    pick = order[done_pos[np.minimum(done_first + j, len(done_pos) - 1)]] - n_req
    req_row = idx[order[req_pos]]
    a["wait_enter"][req_row[ok]] = d_enter[pick[ok]]
    a["done"][req_row[ok]] = d_exit[pick[ok]]


def _with_order(a: np.ndarray) -> np.ndarray:
    """Append the occurrence index of each message within its (comm, src, dst, tag) channel."""
    out = np.zeros(len(a), a.dtype.descr + [("order", "<i8")])
    for n in a.dtype.names or ():
        out[n] = a[n]
    if not len(a):
        return out
    idx = np.lexsort((a["enter"], a["tag"], a["dst"], a["src"], a["comm"]))
    srt = out[idx]
    keys = np.stack([srt["comm"].astype(np.int64), srt["src"], srt["dst"], srt["tag"]], axis=1)
    new = np.ones(len(srt), bool)
    new[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    grp_start = np.maximum.accumulate(np.where(new, np.arange(len(srt)), 0))
    srt["order"] = np.arange(len(srt)) - grp_start
    out[idx] = srt
    return out


def _channel_keys(a: np.ndarray) -> np.ndarray:
    """(comm, src, dst, tag, n) per message: n is its seq when recorded (the probes count per
    channel and direction, so it survives a lost record), else its order of entry in the channel."""
    ordered = _with_order(a)
    n = np.where(a["seq"] != SEQ_NONE, a["seq"].astype(np.int64), ordered["order"])
    k = np.zeros(len(a), [("comm", "<u8"), ("src", "<i8"), ("dst", "<i8"), ("tag", "<i8"), ("n", "<i8")])
    for f in ("comm", "src", "dst", "tag"):
        k[f] = a[f]
    k["n"] = n
    return k


def match_p2p(calls_by_node: list[np.ndarray], epoch_rt: int) -> P2PPairs:
    """Sends and receives (blocking, Sendrecv halves, Isend/Irecv with their completions) matched by
    (comm, src, dst, tag, n-th message in that channel), as MPI orders them: a sort-merge join of
    the two sides, no dictionary of every call. What stays unmatched is counted by reason."""
    sends = [_p2p_side(c, ni, epoch_rt, True) for ni, c in enumerate(calls_by_node) if len(c)]
    recvs = [_p2p_side(c, ni, epoch_rt, False) for ni, c in enumerate(calls_by_node) if len(c)]
    S = np.concatenate(sends) if sends else np.zeros(0, _P2P_DT)
    R = np.concatenate(recvs) if recvs else np.zeros(0, _P2P_DT)
    # MPI_ANY_SOURCE / MPI_ANY_TAG (negative in every MPI): the probes do not read the status, so the
    # real source or tag is unknown and the message cannot be paired by its channel
    any_source = (R["src"] < 0) | (R["tag"] < 0)
    Rk = R[~any_source]
    sk, rk = _channel_keys(S), _channel_keys(Rk)
    si_sorted = np.argsort(sk, order=("comm", "src", "dst", "tag", "n"), kind="stable")
    pos = np.searchsorted(sk[si_sorted], rk) if len(S) else np.zeros(len(rk), np.int64)
    pos_c = np.clip(pos, 0, max(len(S) - 1, 0))
    hit = (pos < len(S)) & (sk[si_sorted][pos_c] == rk) if len(S) else np.zeros(len(rk), bool)
    si = si_sorted[pos_c[hit]]
    ri = np.flatnonzero(hit)
    _, first = np.unique(si, return_index=True)  # a send matches one receive (duplicate keys: the first)
    si, ri = si[first], ri[first]
    R_m = Rk[ri]
    reasons: dict[str, int] = {}
    unpaired: dict[str, int] = {}
    if any_source.any():
        unpaired["receives from MPI_ANY_SOURCE or with MPI_ANY_TAG (the status is not recorded, so they "
                 "cannot be paired)"] = int(any_source.sum())
    wildcard_dst = set(zip(R["comm"][any_source].tolist(), R["dst"][any_source].tolist()))
    paired_s = np.zeros(len(S), bool)
    paired_s[si] = True
    paired_r = np.zeros(len(Rk), bool)
    paired_r[ri] = True
    lone_s, lone_r = np.flatnonzero(~paired_s), np.flatnonzero(~paired_r)
    # (comm, rank) of every rank that recorded point to point: a partner outside it has no node file
    ranks_seen: set[tuple[int, int]] = set()
    if len(lone_s) or len(lone_r):
        for rows_of_side, col in ((S, "src"), (R, "dst")):
            for comm in np.unique(rows_of_side["comm"]):
                ranks_seen |= {(int(comm), int(r)) for r in np.unique(rows_of_side[col][rows_of_side["comm"] == comm])}
    if wildcard_dst and len(lone_s):
        # a send to a rank that posts wildcard receives may well be one of those: unpaired, not lost
        to_wild = np.array([k in wildcard_dst for k in zip(S["comm"][lone_s].tolist(), S["dst"][lone_s].tolist())],
                           bool)
        if to_wild.any():
            unpaired["sends to ranks that post MPI_ANY_SOURCE/MPI_ANY_TAG receives (possibly received by one "
                     "of those)"] = int(to_wild.sum())
            lone_s = lone_s[~to_wild]
    for side, rows, peer_f in (("send", S[lone_s], "dst"), ("receive", Rk[lone_r], "src")):
        absent = np.array([k not in ranks_seen for k in zip(rows["comm"].tolist(), rows[peer_f].tolist())], bool)
        if absent.any():
            reasons[f"{side}s whose partner rank has no node file (or recorded no point to point)"] = int(absent.sum())
        if (~absent).any():
            reasons[f"{side}s with no matching call recorded on the partner rank"] = int((~absent).sum())
    unmatched = int(sum(reasons.values()))
    nb_open = int(np.isnan(S["done"][si]).sum() + np.isnan(R_m["done"]).sum())
    if nb_open:
        unpaired["matched messages whose non-blocking request has no completion (MPI_Wait/Test) row"] = nb_open
    return P2PPairs(
        comm_id=S["comm"][si], src=S["src"][si], dst=S["dst"][si], tag=S["tag"][si], send_node=S["node"][si],
        recv_node=R_m["node"], send_enter=S["enter"][si], send_exit=S["done"][si], recv_enter=R_m["enter"],
        recv_exit=R_m["done"], unmatched=unmatched, recv_wait=R_m["wait_enter"],
        send_blocking=np.isin(S["op"][si], list(BLOCKING_SEND_OPS)), unmatched_reasons=reasons,
        unpaired_reasons=unpaired, same_call_recv=_same_call_recv(S[si], R_m),
    )


_CALL_KEY_DT = np.dtype([("node", "<i8"), ("pid", "<u8"), ("comm", "<u8"), ("enter", "<f8")])


def _same_call_recv(sends: np.ndarray, recvs: np.ndarray) -> np.ndarray:
    """For each matched send that is the send half of a Sendrecv, the index of the matched pair whose
    receive is that call's receive half, else -1. The probes write the two halves as two rows with
    the same process, communicator and times (docs/probes.md); no other receive of that process
    enters at the same nanosecond."""
    out = np.full(len(sends), -1, np.int64)
    halves = np.flatnonzero(sends["op"] == _I["MPI_Sendrecv"])
    recv_rows = np.flatnonzero(recvs["op"] == _I["MPI_Recv"])
    if not len(halves) or not len(recv_rows):
        return out

    def keys(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
        k = np.zeros(len(rows), _CALL_KEY_DT)
        for f in _CALL_KEY_DT.names or ():
            k[f] = a[f][rows]
        return k

    rk = keys(recvs, recv_rows)
    order = np.argsort(rk, order=list(_CALL_KEY_DT.names or ()), kind="stable")
    sk = keys(sends, halves)
    pos = np.clip(np.searchsorted(rk[order], sk), 0, len(order) - 1)
    hit = rk[order][pos] == sk
    out[halves[hit]] = recv_rows[order[pos[hit]]]
    return out


@dataclass
class NodeInstances:
    """Per N-to-N instance and node: the latest enter, earliest exit and median exit of the node's
    ranks (raw times, float ns from the epoch). The clock fit's only input."""

    enter_max: np.ndarray  # [n_inst, n_nodes], NaN = node not in the instance
    exit_min: np.ndarray
    exit_med: np.ndarray
    comm_id: np.ndarray  # [n_inst]
    seq: np.ndarray
    # [n_inst]: True where the exits are synchronous by construction (clock.InstanceRows.synchronous);
    # None: no such instance (MPI calls, messages)
    exit_sync: np.ndarray | None = None

    # clock.InstanceRows: what the clock fit reads
    @property
    def n_rows(self) -> int:
        return int(self.enter_max.shape[0])

    @property
    def n_cols(self) -> int:
        return int(self.enter_max.shape[1])

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.enter_max[rows], self.exit_min[rows], self.exit_med[rows]

    def synchronous(self, rows: np.ndarray) -> np.ndarray:
        if self.exit_sync is None:
            return np.zeros(len(rows), bool)
        return self.exit_sync[rows]


class InstanceTable:
    """NodeInstances appended block by block (the rows of one block of a CommStore pass at a time)
    and read back by rows: clock.InstanceRows. In memory, or in an HDF5 scratch group sized for
    `max_rows` (the merge driver), so the clock fit's input is never whole in rank 0's memory."""

    FIELDS = ("enter_max", "exit_min", "exit_med")

    def __init__(self, n_nodes: int, max_rows: int, scratch: h5py.Group | None = None):
        self._n_cols = n_nodes
        self._n_rows = 0
        self.data: dict[str, ArrayLike2D] = {}
        for name in self.FIELDS:
            if scratch is None:
                self.data[name] = np.full((max_rows, n_nodes), np.nan)
            else:
                self.data[name] = scratch.create_dataset(f"instances/{name}", shape=(max_rows, n_nodes),
                                                         dtype="<f8", fillvalue=np.nan)
        # one column, so that read_rows reads it as it reads the others
        self.sync: ArrayLike2D = (np.zeros((max_rows, 1), bool) if scratch is None else
                                  scratch.create_dataset("instances/exit_sync", shape=(max_rows, 1), dtype="?",
                                                         fillvalue=False))
        self._any_sync = False  # no row is: synchronous() reads nothing (an MPI job's fit, every piece)

    @classmethod
    def existing(cls, group: h5py.Group, n_rows: int) -> InstanceTable:
        """A table another process wrote into `group` (read only), its first n_rows rows filled."""
        self = cls.__new__(cls)
        self.data = {name: group[f"instances/{name}"] for name in cls.FIELDS}
        self.sync = group["instances/exit_sync"]
        self._any_sync = bool(group["instances/exit_sync"].attrs.get("any", False))
        self._n_cols = int(self.data["enter_max"].shape[1])
        self._n_rows = n_rows
        return self

    def append(self, inst: NodeInstances) -> None:
        k0, k1 = self._n_rows, self._n_rows + inst.n_rows
        if k1 > self.data["enter_max"].shape[0]:
            raise ValueError(f"instance table holds {self.data['enter_max'].shape[0]} rows, {k1} appended")
        if k1 > k0:
            for name in self.FIELDS:
                self.data[name][k0:k1] = getattr(inst, name)
            if inst.exit_sync is not None and inst.exit_sync.any():
                self.sync[k0:k1] = inst.exit_sync[:, None]
                if not self._any_sync and isinstance(self.sync, h5py.Dataset):
                    self.sync.attrs["any"] = True  # for the other ranks' InstanceTable.existing
                self._any_sync = True
        self._n_rows = k1

    @property
    def n_rows(self) -> int:
        return self._n_rows

    @property
    def n_cols(self) -> int:
        return self._n_cols

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self._n_rows):
            raise IndexError(f"instance rows {rows.min()}..{rows.max()} outside 0..{self._n_rows - 1}")
        E, Xn, Xm = (read_rows(self.data[name], rows) for name in self.FIELDS)
        return E, Xn, Xm

    def synchronous(self, rows: np.ndarray) -> np.ndarray:
        if not self._any_sync:
            return np.zeros(len(rows), bool)
        return read_rows(self.sync, np.asarray(rows, dtype=np.int64))[:, 0]


def p2p_instances(p: P2PPairs, n_nodes: int) -> NodeInstances:
    """Matched messages between two nodes as rows of the clock fit's input: the sender's node has only
    an enter (the send started), the receiver's only an exit (the receive completed), so the one
    constraint of a row is the message's own: no receive completes before its send started."""
    ok = (p.send_node != p.recv_node) & np.isfinite(p.send_enter) & np.isfinite(p.recv_exit)
    k = int(ok.sum())
    E, X = np.full((k, n_nodes), np.nan), np.full((k, n_nodes), np.nan)
    rows = np.arange(k)
    E[rows, p.send_node[ok]] = p.send_enter[ok]
    X[rows, p.recv_node[ok]] = p.recv_exit[ok]
    return NodeInstances(E, X, X.copy(), p.comm_id[ok].astype(np.uint64), np.zeros(k, np.int64))


def _per_node(enter: np.ndarray, exit_: np.ndarray, node_of_rank: np.ndarray, n_nodes: int,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row and node, over the node's ranks: the latest enter, the earliest exit and the median
    exit, NaN-aware ([rows, ranks] -> [rows, n_nodes], NaN for a node without ranks or values).
    All nodes at once: the ranks grouped by node, reduceat for the extremes, and the medians from one
    sort of the groups laid side by side (padded with NaN, which sorts last and is not counted), the
    same numbers as nanmax, nanmin and nanmedian_rows node by node (a per-node loop was most of the
    scan at 1024 nodes)."""
    n = enter.shape[0]
    E, Xmin, Xmed = (np.full((n, n_nodes), np.nan) for _ in range(3))
    cols = np.flatnonzero(node_of_rank >= 0)
    if not len(cols) or not n:
        return E, Xmin, Xmed
    cols = cols[np.argsort(node_of_rank[cols], kind="stable")]
    nodes, starts, counts = np.unique(node_of_rank[cols], return_index=True, return_counts=True)
    en, ex = enter[:, cols], exit_[:, cols]
    E[:, nodes] = np.fmax.reduceat(en, starts, axis=1)  # fmax/fmin skip NaN; all-NaN stays NaN
    Xmin[:, nodes] = np.fmin.reduceat(ex, starts, axis=1)
    width = int(counts.max())
    if len(nodes) * width > 4 * len(cols):  # very uneven nodes: padding would cost more than a loop
        for k, ni in enumerate(nodes):
            Xmed[:, ni] = nanmedian_rows(ex[:, starts[k]:starts[k] + counts[k]])
        return E, Xmin, Xmed
    group = np.repeat(np.arange(len(nodes)), counts)
    pos = np.arange(len(cols)) - starts[group]
    padded = np.full((n, len(nodes), width), np.nan)
    padded[:, group, pos] = ex
    cnt = np.isfinite(padded).sum(axis=2)
    srt = np.sort(padded, axis=2)
    lo = np.clip((cnt - 1) // 2, 0, None)[:, :, None]
    hi = np.clip(cnt // 2, 0, None)[:, :, None]
    med = (np.take_along_axis(srt, lo, axis=2) + np.take_along_axis(srt, hi, axis=2))[:, :, 0] / 2
    Xmed[:, nodes] = np.where(cnt > 0, med, np.nan)
    return E, Xmin, Xmed


def node_instances(comms: list[CommTable], n_nodes: int, ops: frozenset[int] = CLOCK_OPS_DEFAULT) -> NodeInstances:
    """The clock fit's rows: the N-to-N instances of `ops` (host times), and N-to-N NCCL instances
    whose every call has its kernels' device times (exit_sync: a kernel of such a collective ends
    when the last data reached its rank, at about the same instant on every rank)."""
    Es, Xn, Xm, cids, seqs, syncs = [], [], [], [], [], []
    for t in comms:
        maj = _row_mode(t.op)
        rows = np.isin(maj, list(ops))
        device = np.zeros(len(maj), bool)
        if t.host_enter is not None:
            called = t.op >= 0
            on_device = np.where(called, np.isfinite(t.host_enter), True).all(axis=1) & called.any(axis=1)
            device = np.isin(maj, list(DEVICE_CLOCK_OPS)) & on_device
            rows |= device
        if not rows.any():
            continue
        syncs.append(device[rows])
        ok = (t.op[rows] == maj[rows][:, None]) & np.isfinite(t.exit[rows])
        enter = np.where(ok, t.enter[rows], np.nan)
        exit_ = np.where(ok, t.exit[rows], np.nan)
        E, Xmin, Xmed = _per_node(enter, exit_, t.node_of_rank, n_nodes)
        Es.append(E)
        Xn.append(Xmin)
        Xm.append(Xmed)
        cids.append(np.full(len(E), t.comm_id, np.uint64))
        seqs.append(np.flatnonzero(rows) + t.seq0)
    if not Es:
        z = np.zeros((0, n_nodes))
        return NodeInstances(z, z.copy(), z.copy(), np.zeros(0, np.uint64), np.zeros(0, np.int64))
    sync = np.concatenate(syncs)
    return NodeInstances(np.vstack(Es), np.vstack(Xn), np.vstack(Xm), np.concatenate(cids), np.concatenate(seqs),
                         sync if sync.any() else None)


def describe(m: Mismatch) -> dict[str, Any]:
    return {
        "comm_id": f"{m.comm_id:#x}", "first_seq": m.first_seq, "kind": m.kind, "missing_ranks": m.missing_ranks,
        "culprit_ranks": m.culprit_ranks, "culprit_nodes": m.culprit_nodes, "detail": m.detail,
        "instances_affected": m.instances_affected,
    }
