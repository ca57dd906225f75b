"""Where a straggler's extra time went: the walk down the differential of folded stacks
(mpi_merge/flames.py), on hand-made stacks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from gpuprof.collector import schema
from gpuprof.mpi_merge import flames
from gpuprof.mpi_merge.flames import excess_path, peer_nodes, summarize


def test_a_busy_polling_peer_has_as_many_samples_but_elsewhere() -> None:
    """Peers poll MPI while the late rank computes: equal totals, the extra is in the compute."""
    peers = Counter({"main;step;compute": 60.0, "main;step;MPI_Allreduce;opal_progress": 40.0})
    late = Counter({"main;step;compute;load_batch;read": 30.0, "main;step;compute": 62.0,
                    "main;step;MPI_Allreduce;opal_progress": 8.0})
    path, share, extra = excess_path(late, peers)
    assert path == ["main", "step", "compute", "load_batch", "read"]
    assert extra == 32.0 and share == 30.0 / 32.0


def test_the_walk_stops_where_the_extra_splits() -> None:
    late = Counter({"main;a;x": 10.0, "main;a;y": 10.0, "main;b": 2.0})
    path, share, _ = excess_path(late, Counter())
    assert path == ["main", "a"] and share == 20.0 / 22.0


def test_no_extra_says_so() -> None:
    same = Counter({"main;f": 5.0})
    assert excess_path(same, same) == ([], 0.0, 0.0)
    s = summarize(same, same, 1, 3, 10.0)
    assert s["path"] == [] and s["late_per_s"] == s["peers_per_s"] == 0.5


def test_peer_nodes_are_spread_and_exclude_the_late_ones() -> None:
    assert peer_nodes([0, 1, 2], {1}) == [0, 2]
    chosen = peer_nodes(list(range(100)), {5})
    assert len(chosen) == 8 and 5 not in chosen and chosen[0] == 0 and chosen[-1] == 99


def test_gil_shares_of_late_processes_against_peers() -> None:
    """Per process the Python samples by GIL state (unknown left out), then the late processes'
    share held against their peers', said in the evidence."""
    rows = schema.STACK_SAMPLES.empty(5)
    rows["pid"] = [10, 10, 10, 20, 20]
    rows["gil"] = [schema.GIL_HELD, schema.GIL_NOT_HELD, schema.GIL_UNKNOWN, schema.GIL_HELD, schema.GIL_NOT_HELD]
    rows["count"] = [3, 7, 50, 9, 1]
    got = flames._gil_counts(rows)
    assert got == {10: Counter(held=3, not_held=7), 20: Counter(held=9, not_held=1)}
    g = flames.gil_summary(got[10], got[20])
    assert g is not None
    assert (g["late_held_share"], g["peers_held_share"]) == (0.3, 0.9)
    assert "held the GIL in 30% of their CPU samples, their peers in 90%" in flames.gil_line(g)
    # no Python sample of the late processes: nothing to say
    assert flames.gil_summary(Counter(), got[20]) is None


def test_the_peers_of_a_late_rank_include_the_other_ranks_of_its_own_node() -> None:
    """A communicator of 3 ranks, two on node 0 (rank 1 late), one on node 1: the late process is
    rank 1's, the peers ranks 0's and 2's. Before, ranks 0 were left out, and a job on one node had
    no peer at all. The reads are answered by a pool standing in for the merge ranks."""
    from types import SimpleNamespace

    import numpy as np

    pids = [100, 101, 200]
    comm = SimpleNamespace(comm_id=7, size=3, node_of_rank=np.array([0, 0, 1]), pid_of_rank=np.array(pids))
    finding = SimpleNamespace(kind="own compute", comm_id=7, ranks=[1], evidence_spans=[(0.0, 2e9)],
                              kernel="", stacks={}, evidence=[])
    stacks = {100: Counter({"main;MPI_Wait": 10.0}), 101: Counter({"main;compute": 10.0}),
              200: Counter({"main;MPI_Wait": 10.0})}

    class Pool:
        def map(self, task: flames.FlameReads, n: int) -> list[dict[str, dict[int, Counter[str]]]]:
            return [{"cpu": {p: stacks[p] for p in it.pids}, "offcpu": {}} for it in task.items[:n]]

    flames.stack_evidence([finding], [comm], ["n0.h5", "n1.h5"], ["node0", "node1"], 0, Pool())
    cpu = finding.stacks["cpu"]
    assert (cpu["late_processes"], cpu["peer_processes"]) == (1, 2)
    assert cpu["path"] == ["main", "compute"] and cpu["share_of_extra"] == 1.0


def test_an_extra_too_small_to_matter_names_no_stack() -> None:
    """A late process that blocks far less than its peers, with a trace more than them in one stack,
    is told as having no such stack, not as "82 % in __futex_wait" of 0.04 ms/s (the demo's report
    said so); an extra of weight is still named with its path."""
    late = Counter({"main;MPI_Allreduce;__futex_wait": 0.05, "main;compute": 3.75})
    peers = Counter({"main;MPI_Allreduce;__futex_wait": 0.01, "main;compute": 2000.0})
    small = flames.summarize(late, peers, 1, 3, 1.0)
    # the JSON (and so the report's "where the time went") names no path either, not only the line
    assert small["path"] == [] and small["share_of_extra"] == 0 and small["extra_per_s"] > 0, small
    line = flames.evidence_line("offcpu", {k: v * 1e6 if k.endswith("per_s") else v for k, v in small.items()})
    assert "no stack where it has more than the peers by 5% of its own" in line and "__futex_wait" not in line, line
    late["main;compute"] = 0.0
    line = flames.evidence_line("offcpu", {k: v * 1e6 if k.endswith("per_s") else v
                                           for k, v in flames.summarize(late, peers, 1, 3, 1.0).items()})
    assert "100% in main → MPI_Allreduce → __futex_wait" in line, line


def test_cpp_frames_are_named_without_their_parameter_lists() -> None:
    """GROMACS's report named where a stopped rank's time went as "gmx::LegacySimulator::do_md() ->
    do_force(_IO_FILE*, t_commrec const*, gmx_multisim_t const*, t_inputrec const&, ... -> gmx_pme_do(
    gmx_pme_t*, gmx::ArrayRef<gmx::BasicVector<float> const>, ...": the path a reader wants is the
    functions'. Scopes, templates, operators and lambdas stay; C, Fortran and Python names are as
    they were."""
    cases = {
        "gmx::LegacySimulator::do_md()": "gmx::LegacySimulator::do_md",
        "do_force(_IO_FILE*, t_commrec const*, gmx::ArrayRef<float cons...": "do_force",  # cut by the table
        "Foo::operator()(int) const": "Foo::operator()",
        "bool operator<<(std::ostream&, X const&)": "bool operator<<",
        "std::vector<int, std::allocator<int> >::push_back(int const&)":
            "std::vector<int, std::allocator<int> >::push_back",
        "(anonymous namespace)::worker(void*)": "(anonymous namespace)::worker",
        "foo()::{lambda(int)#1}::operator()(int) const": "foo()::{lambda(int)#1}::operator()",
        "f(int (*)(int))": "f",
        "MPI_Allreduce": "MPI_Allreduce", "matmul_": "matmul_", "train_step": "train_step",
    }
    assert {name: flames.short_frame(name) for name in cases} == cases
    late = Counter({"main;gmx::LegacySimulator::do_md();gmx_pme_do(gmx_pme_t*, float const*)": 900.0})
    peers = Counter({"main;poll": 900.0})
    line = flames.evidence_line("cpu", flames.summarize(late, peers, 1, 3, 1.0))
    assert line.endswith("100% in main → gmx::LegacySimulator::do_md → gmx_pme_do"), line


@pytest.mark.parametrize(("offcpu_rate_hz", "in_span_s"), [(1.0, 1.0), (0.5, 0.5), (None, None)])
def test_offcpu_rows_are_read_where_the_caller_threads_slept(tmp_path: Path, offcpu_rate_hz: float | None,
                                                             in_span_s: float | None) -> None:
    """The off-CPU table counts an episode whole in the window its thread woke in: a span gets the
    part of it that lies inside (spread back from that window's end), and only the threads that
    called collectives or messages are read where a process has such threads (its idle helpers,
    woken unevenly, are left out). A 3 s sleep of the main thread that woke in the window from 5 s
    gives a span at 3.5-4.5 s 1 s of it with 1 s windows (it slept 3-6 s), 0.5 s with 2 s windows
    (sources.offcpu.flush_interval_s = 2: it slept 4-7 s); the helper's sleep in that span is not
    read. A file whose rates_json does not say the windows' length has its rows left out."""
    import h5py

    path = tmp_path / "node1.h5"
    s = 1_000_000_000
    with h5py.File(path, "w") as f:
        f.attrs["start_monotonic_ns"], f.attrs["start_realtime_ns"] = 0, 0
        f.attrs["rates_json"] = json.dumps({"stacks": 1.0} | ({"offcpu": offcpu_rate_hz} if offcpu_rate_hz else {}))
        sym = np.zeros(2, schema.STACK_SYMBOLS.dtype)
        sym["symbol_id"], sym["name"] = [1, 2], [b"MPI_Recv", b"helper_poll"]
        fr = np.zeros(2, schema.STACK_FRAMES.dtype)
        fr["stack_id"], fr["depth"], fr["symbol_id"] = [1, 2], [0, 0], [1, 2]
        off = np.zeros(3, schema.OFFCPU_INTERVALS.dtype)
        off["t_ns"], off["pid"], off["tid"] = [5 * s, 3 * s, 9 * s], 100, [100, 101, 100]
        off["user_stack"], off["blocked_ns"], off["count"] = [1, 2, 1], [3 * s, s // 2, s // 10], 1
        calls = np.zeros(1, schema.COLLECTIVE_CALLS.dtype)
        calls["pid"], calls["tid"] = 100, 100
        for t, rows in ((schema.STACK_SYMBOLS, sym), (schema.STACK_FRAMES, fr), (schema.OFFCPU_INTERVALS, off),
                        (schema.COLLECTIVE_CALLS, calls)):
            f.create_dataset(t.path, data=rows)
    item = flames.NodeRead(str(path), "node1", [100], np.array([[3.5 * s, 4.5 * s]]))
    got = flames.read_folded(item, None, 0)["offcpu"]
    assert got == ({100: Counter({"MPI_Recv": pytest.approx(in_span_s * s)})} if in_span_s else {}), got


def test_offcpu_series_spread_each_sleep_over_the_bins_it_covered() -> None:
    """The per-process off-CPU series (loading._rank_thread_offcpu, the straggler cause's evidence)
    spread a sleep counted where it woke back over the bins it covered, as read_folded does: a
    2.5 s sleep ending at 4 s puts 0.5, 1 and 1 s in the bins 1-2, 2-3 and 3-4 s, not 2.5 s in one;
    the total is kept, and what lies outside the bins is not counted."""
    from gpuprof.mpi_merge.loading import _spread_in_bins

    edges = np.arange(6, dtype=np.float64)
    got = _spread_in_bins(np.array([1.5, 3.0, -2.0]), np.array([4.0, 3.5, 0.5]), edges)
    assert got.tolist() == [0.5, 0.5, 1.0, 1.5, 0.0]
    rng = np.random.default_rng(3)
    lo = rng.uniform(0, 50, 200)
    hi = lo + rng.uniform(0, 5, 200)
    assert _spread_in_bins(lo, hi, np.arange(0, 61, dtype=np.float64)).sum() == pytest.approx((hi - lo).sum())


def test_the_reason_a_late_process_slept_is_its_innermost_frame_outside_the_scheduler() -> None:
    """The off-CPU extra split over the places a stop landed still names one reason: the innermost
    frame of each extra stack outside the scheduler's own (do_signal_stop here, not __schedule),
    weighted by the extra; a stack the peers have as much of counts for nothing."""
    stop = "entry_SYSCALL_64;do_syscall_64;get_signal;do_signal_stop;schedule;__schedule"
    late = Counter({f"main;compute;{stop}": 60.0, f"main;MPI_Recv;poll;{stop}": 30.0,
                    "main;MPI_Recv;futex_wait_queue;schedule;__schedule": 10.0,
                    "helper;do_epoll_wait;schedule_hrtimeout_range_clock;schedule;__schedule": 500.0})
    peers = Counter({"helper;do_epoll_wait;schedule_hrtimeout_range_clock;schedule;__schedule": 500.0})
    assert flames.asleep_in(late, peers) == {"frame": "do_signal_stop", "share_of_extra": 0.9}
    assert flames.asleep_in(peers, peers) is None
    s = flames.summarize(late, peers, 1, 3, 1.0)
    s["asleep_in"] = flames.asleep_in(late, peers)
    line = flames.evidence_line("offcpu", s)
    assert line.endswith("asleep in do_signal_stop (90% of it)"), line
