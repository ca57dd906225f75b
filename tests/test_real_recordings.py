"""The merge judged on real recordings of the local cluster (tests/recordings/README.md): what a user
gets on real jobs, in every test run, without the cluster."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from gpuprof.mpi_merge.merge import EXIT_COMPLETE, merge

RECORDINGS = Path(__file__).resolve().parent / "recordings"


def test_demo_recording_names_only_the_slow_rank(tmp_path: Path) -> None:
    d = tmp_path / "demo.gpuprof.d"
    shutil.copytree(RECORDINGS / "demo-4nodes", d)
    res = merge(str(d), output_stem=str(tmp_path / "demo"))
    assert res is not None and res.exit_code == EXIT_COMPLETE, res and res.partial_reasons
    report = json.loads(res.reports["json"].read_text())
    # one host: one clock, no correction, nothing out of order, and no note that contradicts it
    assert report["clock"]["causality_violations"] == 0
    assert all(n["clock"]["offset_us"] == 0.0 for n in report["nodes"])
    assert not any("shares no collective" in n for n in report["clock"]["notes"])
    # world rank 2 (node3) burns 30 ms more CPU per step: the one root cause, with its cost; the
    # waits on the 2-rank sub-communicators are not findings of their own
    assert [(f["node"], f["ranks"], f["cause"]) for f in report["stragglers"]] == [("node3", [2], "host")]
    world = next(c["comm_id"] for c in report["communicators"] if c["size"] == 4)
    f = report["stragglers"][0]
    assert f["comm_id"] == world and f["cost_share"] > 0.3 and f["q_value"] < 1e-6
    assert "node3" in res.reports["txt"].read_text()
    # it held the others back far longer than any other node, and its evidence names the CPU time
    # and where it was on CPU against the other ranks
    assert f["held_share"] > 2 * f["next_held_share"] and any("CPU" in e for e in f["evidence"])
    assert any(e.startswith("on CPU in the flagged windows") and "the other ranks" in e for e in f["evidence"])


def test_offcpu_of_the_mpi_threads_per_process() -> None:
    """The straggler evidence reads the off-CPU time of the threads that called MPI, per process, not
    the node's sum (dominated by the job's idle helper threads)."""
    from gpuprof.mpi_merge.loading import discover, summarize_node

    for p in discover(RECORDINGS / "demo-4nodes"):
        s = summarize_node(p)
        pids = {k.split(":")[0] for k in s.series if k.startswith("pid")}
        calls = {f"pid{int(x)}" for x in set(s.calls["pid"].tolist())} if s.calls is not None else set()
        assert pids and pids <= calls, (s.node, pids, calls)
        for pid in pids:
            blocked = s.series[f"{pid}:offcpu_blocked_ns"]
            assert blocked.unit == "ns/s" and np.isfinite(blocked.values).all()
            # a rank polls inside MPI: its MPI thread is hardly ever blocked, and never more than wall time
            assert 0 <= float(np.mean(blocked.values)) < 1e9


def test_offcpu_windows_are_as_long_as_the_file_says(tmp_path: Path) -> None:
    """A row of /offcpu/intervals counts its source's window (sources.offcpu.flush_interval_s, in
    the file's rates_json), not a fixed second: with the same rows read as 2 s windows each sleep is
    spread back over the 2 s before its window's end, so the same total lies later. A file that does
    not say the length is partial, with the table named, and its off-CPU rows are not used."""
    from gpuprof.mpi_merge.loading import summarize_node

    src = RECORDINGS / "demo-4nodes" / "node1.h5"
    series = {}
    for name, rates in (("as recorded", None), ("2 s", {"offcpu": 0.5}), ("unsaid", {"offcpu": None})):
        p = tmp_path / f"{name}.h5"
        shutil.copy(src, p)
        if rates is not None:
            with h5py.File(p, "r+") as f:
                r = json.loads(f.attrs["rates_json"]) | rates
                f.attrs["rates_json"] = json.dumps({k: v for k, v in r.items() if v is not None})
        s = summarize_node(p)
        assert s.error is None
        series[name] = ({k: v.values for k, v in s.series.items() if k.endswith(":offcpu_blocked_ns")},
                        s.partial_reasons)
    (one, one_reasons), (two, two_reasons), (unsaid, unsaid_reasons) = series.values()
    assert one and one.keys() == two.keys() and not unsaid
    assert not [r for r in one_reasons + two_reasons if "rates_json" in r]
    assert [r for r in unsaid_reasons if r.startswith("/offcpu/intervals: rates_json names no 'offcpu'")]
    moved = False
    for k in one:
        assert np.nansum(two[k]) == pytest.approx(np.nansum(one[k]), rel=0.05, abs=1e6)
        moved |= not np.allclose(one[k], two[k], equal_nan=True)
    assert moved


def test_where_each_mpi_process_was_on_cpu() -> None:
    """CPU samples binned per process that called MPI, by innermost frame: the demo's ranks spend
    their CPU in its busy loop and in MPI's polling, and the shares of a range sum to at most 1."""
    from gpuprof.mpi_merge.loading import discover, summarize_node

    for p in discover(RECORDINGS / "demo-4nodes"):
        s = summarize_node(p)
        assert s.on_cpu, (s.node, s.on_cpu_note)
        for o in s.on_cpu.values():
            n, top = o.top(np.array([0.0]), np.array([4e18]), 0, n=len(o.labels))
            assert n > 0 and top and abs(sum(x for _, x in top) - 1.0) < 1e-9
            assert all(" (" in name or name in ("[no frame]", "(other)") for name, _ in top)  # "function (module)"


@pytest.mark.parametrize("seed", [1, 2, 4, 6, 7])
def test_retimed_hpcc_recording_is_aligned_without_violations(tmp_path: Path, seed: int) -> None:
    """A real HPCC recording (one host) re-timed with known offsets, drifts and NTP-like slews per node
    (distinct hostnames and boot ids): its matched messages pin the clocks to microseconds, so the
    pieces' constants joined linearly leave messages out of order (106 of them before the exact last
    step). After alignment: none out of order, no node called inconsistent and no model drifting
    beyond the slew limit (the injected errors are physical: the true clocks keep every instance in
    order), never worse than the wall clock, and the truth inside the reported interval. Seeds 2, 4,
    6 and 7 failed before the exact step freed the nodes that bound the culprits and bounded the
    rounds' steep drifts: two nodes called inconsistent, 4 and 10 instances left out of order, a
    model drifting beyond 500 ppm."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from realapps import retime

    rt = tmp_path / "retimed.gpuprof.d"
    retime.retime_recording(RECORDINGS / "hpcc-4nodes", rt, seed=seed)
    res = merge(str(rt), output_stem=str(tmp_path / "hpcc"))
    assert res is not None and res.exit_code == EXIT_COMPLETE, res and res.partial_reasons
    report = json.loads(res.reports["json"].read_text())
    assert report["clock"]["causality_violations"] == 0
    for n in report["nodes"]:
        assert not n["clock"]["inconsistent"], (n["node"], n["clock"]["inconsistent"])
        assert not n["clock"]["drift_note"], (n["node"], n["clock"]["drift_note"])
        assert abs(n["clock"]["drift_ppm"]) <= 500.0
    s = retime.clock_errors(RECORDINGS / "hpcc-4nodes", rt, res.reports["json"].with_suffix(".h5"), report)
    assert s.rms_error_us is not None and s.raw_wall_clock_us is not None
    # ms injected (2-6 ms RMS over these seeds), ~0.2 ms left where the collectives pin little (1 ms
    # intervals), a few us where they pin the clock to 20 us or less
    assert s.rms_error_us < s.raw_wall_clock_us / 5
    assert s.pinned["calls"] and s.pinned["rms_error_us"] <= 10.0
    assert s.interval_coverage is not None and s.interval_coverage >= 0.95


def test_exit_delay_behind_a_stopped_peer_is_not_the_network(tmp_path: Path) -> None:
    """A real HPCC recording with node3's rank stopped 30 % of every 200 ms from outside (SIGSTOP /
    SIGCONT): node3 is the one root cause (host: its MPI threads off CPU and not runnable). Node4's
    collectives also return late in one window, because the collective needs data from the stopped
    rank: a wait inside the collective, listed with that reason, not a NETWORK finding of its own
    (which the report made before the peers' off-CPU time was read)."""
    d = tmp_path / "sigstop.gpuprof.d"
    shutil.copytree(RECORDINGS / "hpcc-sigstop-4nodes", d)
    res = merge(str(d), output_stem=str(tmp_path / "sigstop"))
    # partial only for 4 messages whose partner's record is missing (the collectors stopped at the end)
    assert res is not None and all(r.startswith("point to point: 4 ") for r in res.partial_reasons), res
    report = json.loads(res.reports["json"].read_text())
    assert [(f["node"], f["cause"]) for f in report["stragglers"]] == [("node3", "host")]
    assert any("stopped" in e or "not runnable" in e for e in report["stragglers"][0]["evidence"])
    explained = [i for i in report["straggler_summary"]["imbalance_without_straggler"] if i.get("node") == "node4"]
    assert explained and "rank 2 (node3) was not running" in explained[0]["why"]
    # the stacks behind it: its process was blocked (stopped) where the peers were not, and the
    # differential flame graph of the flagged windows is in the job file
    st = report["stragglers"][0]["stacks"]
    assert st["offcpu"]["late_processes"] == 1 and st["offcpu"]["peer_processes"] == 3
    # ns/s of its MPI thread: stopped 30 % of the time. Its idle helper threads, woken by every stop,
    # are not read (all its threads were, 2448 ms/s "blocked" against nothing for the peers' helpers)
    assert 2e8 < st["offcpu"]["late_per_s"] < 4e8 and st["offcpu"]["peers_per_s"] < 1e7
    assert st["offcpu"]["share_of_extra"] > 0.5 and st["offcpu"]["path"]
    assert st["offcpu"]["asleep_in"]["frame"] == "do_signal_stop" and st["offcpu"]["asleep_in"]["share_of_extra"] > 0.9
    with h5py.File(res.job_file, "r") as f:
        rows = f["analysis/flames/finding_0/offcpu"][()]
        assert len(rows) and rows["late"].sum() > 10 * rows["peers"].sum()


def test_wall_clock_stepped_on_one_node_mid_job(tmp_path: Path) -> None:
    """The real HPCC recording with node3's wall clock stepped by +5 ms at t = 20 s (its clock pairs
    rewritten, as an NTP step leaves them: CLOCK_MONOTONIC runs on, CLOCK_REALTIME jumps; the nodes
    cannot be stepped for real here, they share one kernel clock). The step is read from the pairs
    (realtime - monotonic jumped faster than any slew) and taken out: node3 is aligned like the
    others with no instance out of order, the step is reported on node3 alone, and the injected
    straggler is still named (node4, a co-runner beside its rank). Before, the step was spread
    between two pairs, no clock within the slew bound followed it, and node3 (and the nodes it
    could not be told apart from) was called inconsistent with 500 ppm."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from realapps import retime

    errors = {f"node{i}": retime.ClockError(0.0, 0.0) for i in range(1, 5)}
    errors["node3"] = retime.ClockError(0.0, 0.0, [retime.Slew(20.0, 0.001, 5e6)])  # 5 ms in 1 ms
    d = tmp_path / "stepped.gpuprof.d"
    retime.retime_recording(RECORDINGS / "hpcc-4nodes", d, errors=errors)
    res = merge(str(d), output_stem=str(tmp_path / "stepped"))
    assert res is not None and res.exit_code == EXIT_COMPLETE, res and res.partial_reasons
    report = json.loads(res.reports["json"].read_text())
    clocks = {n["node"]: n["clock"] for n in report["nodes"]}
    steps = {n: c["wall_clock_steps"] for n, c in clocks.items() if c["wall_clock_steps"]}
    assert list(steps) == ["node3"] and len(steps["node3"]) == 1
    assert steps["node3"][0]["step_ms"] == pytest.approx(5.0, abs=0.001)
    assert 19.0 < steps["node3"][0]["t_s"] < 22.0
    assert not any(c["inconsistent"] for c in clocks.values())
    assert report["clock"]["causality_violations"] == 0
    assert [(f["node"], f["cause"]) for f in report["stragglers"]] == [("node4", "host")]


def test_gromacs_sendrecv_waits_are_counted_once_and_the_stopped_rank_found(tmp_path: Path) -> None:
    """A real GROMACS recording (4 ranks exchanging domain halos with MPI_Sendrecv, PME grids with
    MPI_Alltoall) with node3's rank stopped 30 % of every 200 ms from outside. A Sendrecv blocks
    once: what its two halves count as Late Sender and Late Receiver together never exceeds how
    long the call lasted (each wait was counted twice before, 6497 ms as both on 2 ranks). And the
    one root cause is node3, its host: its messages came late."""
    from gpuprof.mpi_merge.loading import discover, summarize_node
    from gpuprof.mpi_merge.matching import match_p2p
    from gpuprof.mpi_merge.waitstates import compute_p2p_waits

    calls = [summarize_node(p).calls for p in discover(RECORDINGS / "gromacs-sigstop-4nodes")]
    epoch = min(int(c["enter_rt"].min()) for c in calls if c is not None and len(c))
    p = match_p2p([c for c in calls if c is not None], epoch)  # one host: one clock, no alignment
    w = compute_p2p_waits(p, p.send_enter, p.send_exit, p.recv_enter, p.recv_wait, p.recv_exit)
    half = np.flatnonzero(p.same_call_recv >= 0)
    assert len(half) > 0.9 * len(p.src)  # GROMACS's messages are Sendrecv's
    counted = w.late_receiver_ns[half] + w.late_sender_ns[p.same_call_recv[half]]
    lasted = p.send_exit[half] - p.send_enter[half]
    assert np.all(counted <= lasted + 1.0)
    assert w.late_sender_ns.sum() > 0 and w.late_receiver_ns.sum() > 0  # the ring shift still has both

    d = tmp_path / "gromacs.gpuprof.d"
    shutil.copytree(RECORDINGS / "gromacs-sigstop-4nodes", d)
    res = merge(str(d), output_stem=str(tmp_path / "gromacs"))
    assert res is not None and res.exit_code == EXIT_COMPLETE, res and res.partial_reasons
    report = json.loads(res.reports["json"].read_text())
    # its sends held the other ranks' receives back (Late Sender), while it was stopped
    assert [(f["node"], f["cause"], f["kind"]) for f in report["stragglers"]] == [("node3", "host", "late sender")]
    assert any("not runnable" in e for e in report["stragglers"][0]["evidence"])
    # the report names its cost as its receivers' waits, not as "0% of the job's waits" at collectives
    line = next(x for x in res.reports["txt"].read_text().splitlines() if x.startswith("  node3 ("))
    assert line.startswith("  node3 (point to point): cause HOST (late sender)") and "of its receivers' waits" in line
    # its stacks in the flagged windows, against the other nodes' ranks, as for a collective finding
    # (a point-to-point finding had none): its process blocked where theirs ran, the report says where
    st = report["stragglers"][0]["stacks"]
    assert st["offcpu"]["late_processes"] == 1 and st["offcpu"]["peer_processes"] == 3
    assert 2e8 < st["offcpu"]["late_per_s"] < 4e8 and st["offcpu"]["peers_per_s"] < 1e7  # stopped 30 % of the time
    # where it was stopped: in its own computation (the stop lands where it runs), not in its idle
    # progress threads ("__clone3 -> start_thread", woken by every stop, before they were left out)
    assert "start_thread" not in st["offcpu"]["path"] and "gmx_pme_do(" in st["offcpu"]["path"][-1]
    assert st["offcpu"]["asleep_in"] == {"frame": "do_signal_stop", "share_of_extra": 1.0}  # stopped, by a signal
    assert st["cpu"]["late_per_s"] < st["cpu"]["peers_per_s"]  # and sampled less on CPU
    assert "where the time went: on CPU" in res.reports["txt"].read_text()
    with h5py.File(res.job_file, "r") as f:
        assert len(f["analysis/flames/finding_0/offcpu"])
