"""Point to point, complete: Sendrecv (both halves), Isend/Irecv with their Wait, blocking Send/Recv;
Late Sender / Late Receiver; what cannot be paired is counted with its reason. Calls are built in the
layout the loader gives (loading.CALL_DTYPE), as the probes record them (docs/probes.md)."""

from __future__ import annotations

import numpy as np
import pytest

from gpuprof.collector.schema import COLLECTIVE_OPS
from gpuprof.mpi_merge.loading import CALL_DTYPE
from gpuprof.mpi_merge.matching import match_p2p
from gpuprof.mpi_merge.waitstates import compute_p2p_waits

OP = {n: i for i, n in enumerate(COLLECTIVE_OPS)}
COMM = 0xC0FFEE
MS = 1_000_000


def row(op: str, rank: int, peer: int, enter_ms: float, exit_ms: float, seq: int, tag: int = 7,
        pid: int | None = None) -> tuple:
    r = np.zeros(1, CALL_DTYPE)[0]
    r["comm_id"], r["seq"], r["comm_rank"], r["comm_size"], r["op"] = COMM, seq, rank, 3, OP[op]
    r["root_or_peer"], r["tag"], r["pid"] = peer, tag, 100 + rank if pid is None else pid
    r["enter_rt"], r["exit_rt"], r["returned"] = int(enter_ms * MS), int(exit_ms * MS), True
    return r


def node(*rows: tuple) -> np.ndarray:
    return np.array(list(rows), CALL_DTYPE)


def waits(calls: list[np.ndarray]):  # type: ignore[no-untyped-def]
    p = match_p2p(calls, 0)
    return p, compute_p2p_waits(p, p.send_enter, p.send_exit, p.recv_enter, p.recv_wait, p.recv_exit)


def test_sendrecv_halo_both_halves_matched_and_late_sender_found() -> None:
    """A halo step: each rank Sendrecv's with the other; rank 1 arrives 5 ms late, so rank 0's
    receive half waits 5 ms for rank 1's send (Late Sender); nothing is left unmatched."""
    n0, n1 = [], []
    for step in range(10):
        t = step * 20.0
        # rank 0: Sendrecv(dest 1, source 1) at t, returns once rank 1's data arrived (t + 5)
        n0 += [row("MPI_Sendrecv", 0, 1, t, t + 5.1, step), row("MPI_Recv", 0, 1, t, t + 5.1, step)]
        n1 += [row("MPI_Sendrecv", 1, 0, t + 5, t + 5.2, step), row("MPI_Recv", 1, 0, t + 5, t + 5.2, step)]
    p, w = waits([node(*n0), node(*n1)])
    assert len(p.src) == 20 and p.unmatched == 0 and not p.unmatched_reasons
    into0 = p.dst == 0
    assert np.allclose(w.late_sender_ns[into0], 5 * MS, atol=1e3)
    assert np.all(w.late_sender_ns[~into0] == 0)
    # rank 0's call waited once, 5 ms, for rank 1 (which posted its receive as it sent): not also a
    # Late Receiver of its send half (GROMACS's halo exchange reported each wait twice)
    assert np.all(w.late_receiver_ns == 0)
    assert abs((w.late_sender_ns.sum() + w.late_receiver_ns.sum()) - 10 * 5 * MS) < 1e4


def test_sendrecv_shift_counts_the_send_halfs_wait_beyond_its_receive() -> None:
    """A shift: rank 0 Sendrecv's to rank 1 and from rank 2. Rank 2 sends 1 ms after rank 0 entered,
    rank 1 posts its receive (its own Sendrecv from rank 0) 4 ms after: rank 0's call waited 4 ms,
    1 ms of it for rank 2's data (Late Sender) and the other 3 for rank 1's receive (Late Receiver
    of its send half, as with a message too large to go out before it is received)."""
    n = node(row("MPI_Sendrecv", 0, 1, 0.0, 4.1, 0), row("MPI_Recv", 0, 2, 0.0, 4.1, 0),
             row("MPI_Sendrecv", 1, 2, 4.0, 4.2, 0), row("MPI_Recv", 1, 0, 4.0, 4.2, 0),
             row("MPI_Sendrecv", 2, 0, 1.0, 1.1, 0), row("MPI_Recv", 2, 1, 1.0, 4.3, 0))
    p, w = waits([n])
    assert len(p.src) == 3 and p.unmatched == 0
    pair = {(int(a), int(b)): i for i, (a, b) in enumerate(zip(p.src, p.dst, strict=True))}
    assert abs(w.late_sender_ns[pair[2, 0]] - 1 * MS) < 1e3
    assert abs(w.late_receiver_ns[pair[0, 1]] - 3 * MS) < 1e3
    # rank 2's call: its receive from rank 1 waited 3 ms (Late Sender); its send to rank 0 was
    # received at once (rank 0's receive was posted before)
    assert abs(w.late_sender_ns[pair[1, 2]] - 3 * MS) < 1e3 and w.late_receiver_ns[pair[2, 0]] == 0


@pytest.mark.parametrize("completion", ["MPI_Wait", "MPI_Waitall", "MPI_Waitany", "MPI_Waitsome", "MPI_Testsome"])
def test_isend_irecv_completed_by_their_wait(completion: str) -> None:
    """rank 0 posts Irecv at 0 and waits from 1 ms; rank 1's Isend starts at 6 ms: the receiver
    waited 5 ms in its completion call (Late Sender); the Isend itself never blocks (no Late
    Receiver). Every completion call the fast path records times the message alike."""
    n0 = node(row("MPI_Irecv", 0, 1, 0.0, 0.01, 0), row(completion, 0, 1, 1.0, 6.2, 0))
    n1 = node(row("MPI_Isend", 1, 0, 6.0, 6.01, 0), row(completion, 1, 0, 6.02, 6.1, 0))
    p, w = waits([n0, n1])
    assert len(p.src) == 1 and p.unmatched == 0
    assert p.recv_wait[0] == 1.0 * MS and p.recv_exit[0] == 6.2 * MS and p.send_exit[0] == 6.1 * MS
    assert abs(w.late_sender_ns[0] - 5 * MS) < 1e3 and w.late_receiver_ns[0] == 0


def test_blocking_send_waiting_for_its_receive_is_late_receiver() -> None:
    n0 = node(row("MPI_Send", 0, 1, 0.0, 4.1, 0))  # rendezvous: blocked until rank 1 posts at 4 ms
    n1 = node(row("MPI_Recv", 1, 0, 4.0, 4.2, 0))
    p, w = waits([n0, n1])
    assert len(p.src) == 1 and abs(w.late_receiver_ns[0] - 4 * MS) < 1e3 and w.late_sender_ns[0] == 0


def test_unmatched_only_when_there_is_no_partner_with_the_reason() -> None:
    n0 = node(row("MPI_Send", 0, 1, 0.0, 0.1, 0),
              row("MPI_Send", 0, 2, 1.0, 1.1, 0),  # rank 2 has no node file
              row("MPI_Recv", 0, -1, 2.0, 3.0, 0))  # MPI_ANY_SOURCE
    n1 = node(row("MPI_Recv", 1, 0, 0.0, 0.2, 0),
              row("MPI_Recv", 1, 0, 5.0, 6.0, 1))  # a second receive with no second send
    p, _ = waits([n0, n1])
    assert len(p.src) == 1
    assert p.unmatched_reasons == {
        "sends whose partner rank has no node file (or recorded no point to point)": 1,
        "receives with no matching call recorded on the partner rank": 1,
    }
    # it has a partner, the probes only cannot tell which: not "unmatched", which makes a merge partial
    assert p.unpaired_reasons == {
        "receives from MPI_ANY_SOURCE or with MPI_ANY_TAG (the status is not recorded, so they cannot be "
        "paired)": 1}
    assert p.unmatched == 2


def test_sends_to_a_wildcard_receiver_are_unpaired_not_lost() -> None:
    n0 = node(row("MPI_Send", 0, 1, 0.0, 0.1, 0), row("MPI_Send", 0, 1, 1.0, 1.1, 0, tag=9))
    n1 = node(row("MPI_Recv", 1, -1, 0.0, 0.2, 0, tag=-1), row("MPI_Recv", 1, 0, 1.0, 1.2, 0, tag=9))
    p, _ = waits([n0, n1])
    assert len(p.src) == 1 and p.unmatched == 0 and not p.unmatched_reasons
    assert sum(p.unpaired_reasons.values()) == 2  # the wildcard receive and the tag-7 send


def test_lost_record_does_not_shift_the_pairing() -> None:
    """The probes number messages per channel: a send lost in the ring leaves a gap, and the later
    messages still pair with their own receives (by number, not by order of arrival)."""
    n0 = node(*[row("MPI_Send", 0, 1, 10.0 * i, 10.0 * i + 0.1, i) for i in range(5) if i != 2])
    n1 = node(*[row("MPI_Recv", 1, 0, 10.0 * i + 3, 10.0 * i + 3.2, i) for i in range(5)])
    p, w = waits([n0, n1])
    assert len(p.src) == 4 and np.allclose(p.recv_enter - p.send_enter, 3 * MS)
    assert np.all(w.late_sender_ns == 0)
    assert p.unmatched_reasons == {"receives with no matching call recorded on the partner rank": 1}


def test_messages_alone_pin_the_clocks() -> None:
    """A job with only point to point: two nodes exchange messages both ways (100 us latency), node
    b's clock reads 3 ms ahead. No receive may complete before its send started, so the messages
    bound the offset from both sides: it is recovered within the latency, with no violation left."""
    from gpuprof.mpi_merge.clock import fit_clocks
    from gpuprof.mpi_merge.matching import p2p_instances

    skew = 3.0  # ms, node b ahead
    n0, n1 = [], []
    for i in range(400):
        t = i * 10.0
        n0.append(row("MPI_Send", 0, 1, t, t + 0.05, i))
        n1.append(row("MPI_Recv", 1, 0, t - 1 + skew, t + 0.1 + skew, i))  # posted early, done at +100 us
        n1.append(row("MPI_Send", 1, 0, t + 5 + skew, t + 5.05 + skew, i))
        n0.append(row("MPI_Recv", 0, 1, t + 4, t + 5.1, i))
    p = match_p2p([node(*n0), node(*n1)], 0)
    assert len(p.src) == 800
    f = fit_clocks(p2p_instances(p, 2), ["a", "b"], "a")
    m = f.model("b")
    off = m.offset_ns(np.array([2000.0 * MS]))[0]
    assert abs(off - skew * MS) <= 0.1 * MS and f.causality_violations == 0
    lo, hi = m.interval_ns(np.array([2000.0 * MS]))
    assert lo[0] <= skew * MS <= hi[0]


def test_request_completion_matches_the_first_unused_later_completion() -> None:
    """The vectorized completion of requests against the rule, one request at a time: per key
    (process, communicator, seq, peer, tag), in order of entry, each request takes the earliest
    unused completion that entered at or after it. Random rows with repeated keys, equal times,
    completions before their request and requests without one."""
    from gpuprof.mpi_merge.matching import _complete_requests, _p2p_side

    rng = np.random.default_rng(5)
    rows = []
    for _ in range(3000):
        op = str(rng.choice(["MPI_Isend", "MPI_Irecv", "MPI_Wait", "MPI_Waitsome", "MPI_Send"]))
        t = float(rng.integers(0, 400)) / 10
        rows.append(row(op, 0, int(rng.integers(1, 3)), t, t + 0.05, int(rng.integers(0, 4)), tag=int(rng.integers(0, 2)),
                        pid=int(rng.integers(100, 102))))
    c = node(*rows)
    a = _p2p_side(c, 0, 0, True)
    nb = np.isin(a["op"], [OP["MPI_Isend"], OP["MPI_Irecv"]])
    assert nb.any()
    _complete_requests(a, nb, c, 0)
    done = c[np.isin(c["op"], [OP["MPI_Wait"], OP["MPI_Waitsome"]])]
    used = np.zeros(len(done), bool)
    want_enter = np.full(len(a), np.nan)
    d_order = np.argsort(done["enter_rt"], kind="stable")
    for i in np.flatnonzero(nb)[np.argsort(a["enter"][nb], kind="stable")]:
        peer = a["dst"][i] if a["op"][i] == OP["MPI_Isend"] else a["src"][i]
        for j in d_order:
            if (not used[j] and done["pid"][j] == a["pid"][i] and done["comm_id"][j] == a["comm"][i]
                    and done["seq"][j] == a["seq"][i] and done["root_or_peer"][j] == peer and done["tag"][j] == a["tag"][i]
                    and done["enter_rt"][j] >= a["enter"][i]):
                used[j] = True
                want_enter[i] = float(done["enter_rt"][j])
                break
    got = a["wait_enter"]
    assert np.array_equal(np.isnan(got[nb]), np.isnan(want_enter[nb]))
    assert np.array_equal(got[nb][~np.isnan(got[nb])], want_enter[nb][~np.isnan(want_enter[nb])])
    assert 0 < int(np.isnan(got[nb]).sum()) < int(nb.sum())  # both cases occur
