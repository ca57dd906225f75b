"""Wait states on aligned times, with Scalasca's names. Takes arrays, never paths.

Per collective instance: who arrived last, each rank's wait, and the collective's own time after
the last arrival. Per point-to-point pair: Late Sender (the receiver waited for the send) and Late
Receiver (a blocking send waited for the receive to be posted).

compute_waits works on any block of instances (rows are independent); BlockWaits is what the reports
need of a block (computed on the merge rank that read it), CommSummary gathers the blocks of a
communicator in order, so the [instance x rank] waits never have to be whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuprof.mpi_merge.common import quiet_nan
from gpuprof.mpi_merge.matching import (
    BARRIER_OPS,
    N_TO_ONE_OPS,
    NXN_OPS,
    ONE_TO_N_OPS,
    CommTable,
    P2PPairs,
    _row_mode,
)

PATTERNS = ("Wait at NxN", "Wait at Barrier", "Late Broadcast", "Early Reduce", "Other collective")
P2P_PATTERNS = ("Late Sender", "Late Receiver")


def pattern_of(op: int) -> int:
    if op in NXN_OPS:
        return 0
    if op in BARRIER_OPS:
        return 1
    if op in ONE_TO_N_OPS:
        return 2
    if op in N_TO_ONE_OPS:
        return 3
    return 4


@dataclass
class CommWaits:
    comm_id: int
    complete: np.ndarray  # [n_seq] bool: every rank entered and left, one op
    pattern: np.ndarray  # [n_seq] int8 index into PATTERNS, -1 when incomplete
    last_rank: np.ndarray  # [n_seq] int32, -1 when incomplete
    last_enter: np.ndarray  # [n_seq] aligned ns of the last arrival
    own_time: np.ndarray  # [n_seq] ns: median exit - last arrival (the collective's own time)
    waits: np.ndarray  # [n_seq, size] ns each rank waited (0 for the one it waited for), NaN incomplete


def compute_waits(t: CommTable, enter: np.ndarray, exit_: np.ndarray) -> CommWaits:
    """`enter`/`exit_` are t.enter/t.exit already aligned to the reference clock."""
    comp = t.complete()
    n, size = enter.shape
    maj = _row_mode(t.op)
    pattern = np.full(n, -1, np.int8)
    pattern[comp] = [pattern_of(int(o)) for o in maj[comp]] if comp.any() else []
    E = np.where(comp[:, None], enter, np.nan)
    X = np.where(comp[:, None], exit_, np.nan)
    with quiet_nan():
        last = np.nanmax(E, axis=1)
        last_rank = np.where(comp, np.nanargmax(np.where(np.isfinite(E), E, -np.inf), axis=1), -1).astype(np.int32)
        own = np.nanmedian(X, axis=1) - last
    waits = np.full((n, size), np.nan)
    nxn = np.isin(pattern, (0, 1))
    waits[nxn] = last[nxn, None] - E[nxn]
    # rooted: only the root's side creates a wait
    roots = np.clip(t.root[:, 0].astype(np.int64), 0, size - 1)
    r_enter = E[np.arange(n), roots]
    bc = pattern == 2
    if bc.any():
        # Late Broadcast: non-root ranks that entered before the root waited for it
        w = np.clip(r_enter[bc, None] - E[bc], 0, None)
        w[np.arange(int(bc.sum())), roots[bc]] = 0.0
        waits[bc] = w
    red = pattern == 3
    if red.any():
        # Early Reduce: the root entered before the last sender and waited for it
        others = E[red].copy()
        others[np.arange(int(red.sum())), roots[red]] = np.nan
        with quiet_nan():
            w_root = np.clip(np.nanmax(others, axis=1) - r_enter[red], 0, None)
        w = np.zeros((int(red.sum()), size))
        w[np.arange(int(red.sum())), roots[red]] = w_root
        waits[red] = w
    return CommWaits(t.comm_id, comp, pattern, last_rank, last, own, waits)


@dataclass
class P2PWaits:
    late_sender_ns: np.ndarray  # per pair, receiver's wait (0 when none)
    late_receiver_ns: np.ndarray  # per pair, sender's wait (0 when none)


def compute_p2p_waits(p: P2PPairs, send_enter: np.ndarray, send_exit: np.ndarray, recv_enter: np.ndarray,
                      recv_wait: np.ndarray | None = None, recv_exit: np.ndarray | None = None) -> P2PWaits:
    """Aligned times in (matching.P2PPairs' fields, on the reference clock).

    Late Sender: the receiver waited (from Recv's entry, or its request's Wait entry) for a send that
    started later, at most until the receive completed. Late Receiver: a blocking send (Send, the
    send half of Sendrecv) waited for the receive to be posted, only while it was still blocked. A
    Sendrecv blocks once, for whichever of its halves finishes last: its send half counts only what
    it waited beyond its receive half's Late Sender (in a halo exchange, where each rank Sendrecv's
    with the same peer, a late peer posts its receive and sends at the same time, and the one wait
    was counted twice: GROMACS's 2 ranks showed 6497 ms of each)."""
    wait_from = recv_enter if recv_wait is None else recv_wait
    ls = send_enter - wait_from
    if recv_exit is not None:
        ls = np.fmin(ls, recv_exit - wait_from)
    ls = np.clip(ls, 0, None)
    lr = np.clip(np.fmin(recv_enter, send_exit) - send_enter, 0, None)
    if len(p.send_blocking) == len(lr):
        lr = np.where(p.send_blocking, lr, 0.0)  # an Isend does not block: its Wait is not counted here
    ls, lr = np.nan_to_num(ls), np.nan_to_num(lr)
    if len(p.same_call_recv) == len(lr):
        half = np.flatnonzero(p.same_call_recv >= 0)
        lr[half] = np.clip(lr[half] - ls[p.same_call_recv[half]], 0, None)
    return P2PWaits(ls, lr)


@dataclass
class BlockWaits:
    """What CommSummary keeps of one block of instances s0 .. s0 + n - 1: its per-instance vectors and
    the block's sums (per pattern: instances, waits, waits per rank; waits per rank). Computed where
    the block is read, added on rank 0 in block order, so every rank count gives the same sums."""

    s0: int
    complete: np.ndarray
    pattern: np.ndarray
    last_rank: np.ndarray
    last_enter: np.ndarray
    own_time: np.ndarray
    first_enter: np.ndarray  # complete instances, else NaN
    pattern_sums: list[tuple[int, int, float, np.ndarray]]  # (pattern, instances, wait total, wait per rank)
    rank_wait_total_ns: np.ndarray

    @classmethod
    def of(cls, s0: int, w: CommWaits, enter: np.ndarray) -> BlockWaits:
        """The waits of instances s0 .. s0 + len(w.complete) - 1 and their aligned enter times."""
        first = np.full(len(w.complete), np.nan)
        if w.complete.any():
            first[w.complete] = np.nanmin(enter[w.complete], axis=1)
        sums = []
        for pi in range(len(PATTERNS)):
            sel = w.pattern == pi
            if sel.any():
                sums.append((pi, int(sel.sum()), float(np.nansum(w.waits[sel])), np.nansum(w.waits[sel], axis=0)))
        return cls(s0, w.complete, w.pattern, w.last_rank, w.last_enter, w.own_time, first, sums,
                   np.nansum(w.waits, axis=0))


@dataclass
class CommSummary:
    """One communicator after the wait-state pass: per-instance vectors and per-rank sums, nothing of
    size instances x ranks. Filled block by block (add, or add_block of a BlockWaits computed on
    another rank), in block order, so the sums are the same whichever rank count the merge ran with."""

    comm_id: int
    size: int
    n_seq: int
    node_of_rank: np.ndarray  # [size] index into the job's node list, -1 when no calls were seen
    pid_of_rank: np.ndarray  # [size]
    complete: np.ndarray  # [n_seq] bool
    pattern: np.ndarray  # [n_seq] int8, -1 when incomplete
    last_rank: np.ndarray  # [n_seq] int32, -1 when incomplete
    last_enter: np.ndarray  # [n_seq] aligned ns of the last arrival
    first_enter: np.ndarray  # [n_seq] aligned ns of the first arrival (complete instances, else NaN)
    own_time: np.ndarray  # [n_seq] ns
    pattern_instances: np.ndarray  # [len(PATTERNS)] complete instances of each pattern
    pattern_wait_ns: np.ndarray  # [len(PATTERNS)] waits summed over instances and ranks
    rank_wait_ns: np.ndarray  # [len(PATTERNS), size] waits of each rank, per pattern
    rank_wait_total_ns: np.ndarray  # [size]

    @classmethod
    def empty(cls, comm_id: int, size: int, n_seq: int, node_of_rank: np.ndarray,
              pid_of_rank: np.ndarray) -> CommSummary:
        return cls(
            comm_id, size, n_seq, node_of_rank, pid_of_rank, np.zeros(n_seq, bool), np.full(n_seq, -1, np.int8),
            np.full(n_seq, -1, np.int32), np.full(n_seq, np.nan), np.full(n_seq, np.nan), np.full(n_seq, np.nan),
            np.zeros(len(PATTERNS), np.int64), np.zeros(len(PATTERNS)), np.zeros((len(PATTERNS), size)),
            np.zeros(size),
        )

    def add(self, s0: int, w: CommWaits, enter: np.ndarray) -> None:
        """The waits of instances s0 .. s0 + len(w.complete) - 1 and their aligned enter times."""
        self.add_block(BlockWaits.of(s0, w, enter))

    def add_block(self, part: BlockWaits) -> None:
        """One block's instances and sums (BlockWaits.of, wherever it was computed), in seq order."""
        s0, s1 = part.s0, part.s0 + len(part.complete)
        self.complete[s0:s1] = part.complete
        self.pattern[s0:s1] = part.pattern
        self.last_rank[s0:s1] = part.last_rank
        self.last_enter[s0:s1] = part.last_enter
        self.own_time[s0:s1] = part.own_time
        self.first_enter[s0:s1] = part.first_enter
        for pi, n, total, per_rank in part.pattern_sums:
            self.pattern_instances[pi] += n
            self.pattern_wait_ns[pi] += total
            self.rank_wait_ns[pi] += per_rank
        self.rank_wait_total_ns += part.rank_wait_total_ns

    def skew(self) -> np.ndarray:
        """Per complete instance: last arrival - first arrival (aligned ns)."""
        return self.last_enter[self.complete] - self.first_enter[self.complete]


def concat_waits(parts: list[CommWaits]) -> CommWaits:
    """The blocks of one communicator's waits, in order, as one CommWaits (library use)."""
    return CommWaits(
        parts[0].comm_id, *(np.concatenate([getattr(p, f) for p in parts])
                            for f in ("complete", "pattern", "last_rank", "last_enter", "own_time", "waits")),
    )


def rank_summary(comms: list[CommSummary], node_names: list[str]) -> list[dict[str, object]]:
    """Per (communicator, rank): wait per pattern, times last, instances."""
    rows: list[dict[str, object]] = []
    for c in comms:
        times_last = np.bincount(c.last_rank[c.last_rank >= 0], minlength=c.size)
        for r in range(c.size):
            ni = int(c.node_of_rank[r])
            d: dict[str, object] = {
                "comm_id": f"{c.comm_id:#x}", "rank": r, "node": node_names[ni] if ni >= 0 else None,
                "instances": int(c.complete.sum()), "times_last": int(times_last[r]),
            }
            for pi, name in enumerate(PATTERNS):
                if c.pattern_instances[pi]:
                    d[f"wait_ns:{name}"] = float(c.rank_wait_ns[pi, r])
            d["wait_ns_total"] = float(c.rank_wait_total_ns[r])
            rows.append(d)
    return rows
