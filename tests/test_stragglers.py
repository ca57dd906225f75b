"""Stragglers of each cause found with their evidence; a balanced job yields none at any size; root
causes with their cost and the lateness they propagated; the exact test and the FDR control."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from gpuprof.mpi_merge import rootcause as rc
from gpuprof.mpi_merge import simjob
from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.analysis import JobAnalysis, analyze
from gpuprof.mpi_merge.loading import Series, discover, summarize_node
from gpuprof.mpi_merge.stragglers import Finding, StragglerParams, find_stragglers
from gpuprof.mpi_merge.stragglers import P2PLateness as StragglerLateness


def run(d: Path, cfg: syn.SynthConfig) -> JobAnalysis:
    syn.generate(cfg, d)
    return analyze([summarize_node(p) for p in discover(d)])


@pytest.mark.parametrize("cause,severity", [("gpu", 0.3), ("host", 0.3), ("network", 1.0)])
def test_straggler_and_cause_found(tmp_path: Path, cause: str, severity: float) -> None:
    cfg = syn.SynthConfig(nodes=8, duration_s=40, seed=7,
                          stragglers=[syn.Straggler(3, cause, 10.0, 30.0, severity)])
    a = run(tmp_path, cfg)
    assert [f.node for f in a.findings] == ["node003"]
    f = a.findings[0]
    assert f.cause == cause
    assert f.share_last > 2 * f.expected_share and f.evidence
    # the finding is persistent in the episode, not all over the job
    assert 5.0 <= f.first_s <= 15.0 and f.windows_flagged < f.windows_judged
    if cause == "gpu":
        assert any("SM activity" in e for e in f.evidence)
    if cause == "host":
        assert any("CPU cores" in e for e in f.evidence)
    if cause == "network":
        assert any("returned" in e and "later" in e for e in f.evidence)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_balanced_job_has_no_straggler(tmp_path: Path, seed: int) -> None:
    a = run(tmp_path, syn.SynthConfig(nodes=8, duration_s=40, seed=seed))
    assert a.findings == []
    assert a.report["stragglers"] == []


def test_algorithm_is_a_parameter(tmp_path: Path) -> None:
    syn.generate(syn.SynthConfig(nodes=6, duration_s=30, seed=9,
                                 stragglers=[syn.Straggler(2, "network", 5.0, 25.0, 1.0)]), tmp_path)
    S = [summarize_node(p) for p in discover(tmp_path)]
    # a network straggler hardly moves the median-ratio score; the last-arrival share finds it
    by_score = analyze(S, straggler_params=StragglerParams(algorithm="score"))
    by_last = analyze(S, straggler_params=StragglerParams(algorithm="last_share"))
    assert by_score.findings == []
    assert [f.node for f in by_last.findings] == ["node002"]


def test_wait_states_named_and_summed(tmp_path: Path) -> None:
    a = run(tmp_path, syn.SynthConfig(nodes=4, duration_s=10, seed=2))
    pats = a.report["communicators"][0]["patterns"]
    assert set(pats) == {"Wait at NxN", "Wait at Barrier", "Late Broadcast"}
    w = a.waits[0]
    k = int(w.complete.nonzero()[0][5])
    assert w.waits[k, w.last_rank[k]] == 0.0 and (w.waits[k][w.pattern[k] == 0] >= 0).all()
    assert 0 < w.own_time[k] < 200_000


# --- statistics ----------------------------------------------------------------------------------
def _exact_tail(k: int, n: int, p: Fraction) -> Fraction:
    return sum((Fraction(math.comb(n, i)) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)), Fraction(0))


@pytest.mark.parametrize("k,n,p", [(8, 10, Fraction(1, 2)), (5, 20, Fraction(1, 10)), (50, 50, Fraction(1, 2)),
                                   (3, 240, Fraction(1, 2048)), (0, 7, Fraction(1, 3)), (1, 1, Fraction(1, 16384)),
                                   (30, 100, Fraction(1, 8)), (200, 1000, Fraction(1, 8))])
def test_binomial_tail_is_exact(k: int, n: int, p: Fraction) -> None:
    want = float(_exact_tail(k, n, p))
    got = rc.binom_sf(k, n, float(p))
    assert got == pytest.approx(want, rel=1e-9, abs=0.0)
    many = rc.binom_sf_many(np.array([k, k]), np.array([n, n]), np.array([float(p)] * 2))
    assert many == pytest.approx([want, want], rel=1e-9, abs=0.0)
    # textbook values
    assert rc.binom_sf(8, 10, 0.5) == pytest.approx(56 / 1024, rel=1e-12)
    assert rc.binom_sf(50, 50, 0.5) == pytest.approx(2.0**-50, rel=1e-9)


def test_benjamini_hochberg_on_known_p_values() -> None:
    # Benjamini & Hochberg (1995), section 4: 15 p-values, q = 0.05 rejects the 4 smallest
    p = np.array([0.0201, 0.0001, 0.0004, 0.0019, 0.0095, 0.0278, 0.0298, 0.0344, 0.0459, 0.3240, 0.4262,
                  0.5719, 0.6528, 0.7590, 1.0])
    rej, q = rc.benjamini_hochberg(p, 0.05)
    assert sorted(p[rej].tolist()) == [0.0001, 0.0004, 0.0019, 0.0095]
    assert q[1] == pytest.approx(0.0001 * 15) and (q <= 1).all()
    # step-up: a p-value above its own threshold is rejected when a larger one passes
    rej, _ = rc.benjamini_hochberg(np.array([0.012, 0.011]), 0.02)
    assert rej.all()
    # tests known to be above q only count in m
    rej_m, _ = rc.benjamini_hochberg(np.array([0.001, 0.004]), 0.01, m=10)
    assert rej_m.tolist() == [True, False]
    with pytest.raises(ValueError):
        rc.benjamini_hochberg(np.array([0.1, 0.2]), 0.05, m=1)


def test_benjamini_hochberg_controls_false_discoveries() -> None:
    rng = np.random.default_rng(3)
    null = rng.random(9000)
    alt = rng.random(1000) * 1e-5
    rej, _ = rc.benjamini_hochberg(np.concatenate([null, alt]), 0.01)
    false = int(rej[:9000].sum())
    assert rej[9000:].mean() > 0.9 and false <= 0.02 * max(1, int(rej.sum()))


def _judge(sim: simjob.SimResult, **kw: object) -> tuple[list[Finding], dict[str, object]]:
    params = StragglerParams(**{"window_s": 0.5, **kw})  # type: ignore[arg-type]
    return find_stragglers(sim.comms, sim.times, sim.node_names, sim.node_series, 0, 0.0, params, sim.clock_error_ns)


def test_fdr_over_1000_pure_noise_windows() -> None:
    """1000 windows of a balanced 8-rank job: the exact test at 0.01 alone flags some windows (what the
    old detector did at scale), Benjamini-Hochberg over all of them flags at most q x 1000."""
    job = simjob.SimJob(8, [np.arange(8)], [simjob.Step(1.0, [0])], iterations=30_000, sigma=0.05, seed=11)
    sim = simjob.simulate(job)
    span_s = float(sim.comms[0].last_enter[-1] - sim.comms[0].last_enter[0]) / 1e9
    findings, m = _judge(sim, window_s=span_s / 1000, min_instances=10, min_effect=0.0)
    s = m["_summary"]
    assert isinstance(s, dict)
    assert 990 <= s["windows_judged"] <= 1001
    assert s["candidates"] >= 3  # raw p <= 0.01 happens in pure noise
    assert s["rejected"] <= 0.01 * 1000 and findings == []


# --- simulated jobs --------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 64, 2048])
def test_balanced_simulated_job_has_no_finding(ranks: int) -> None:
    findings, m = _judge(simjob.simulate(simjob.balanced_job(ranks)))
    assert findings == []
    s = m["_summary"]
    assert isinstance(s, dict) and s["windows_judged"] > 0 and s["tests"] > 0


def test_slow_rank_found_with_cause_and_cost() -> None:
    job = simjob.balanced_job(8)
    job.slow = {5: 1.3}
    findings, _ = _judge(simjob.simulate(job))
    assert [(f.node, f.ranks, f.kind) for f in findings] == [("sim00001", [5], "own compute")]
    f = findings[0]
    assert f.cause == "host"  # no GPU metrics anywhere: the longer compute ran on the host
    assert f.cost_ns > 0 and f.cost_share > 0.8 and f.direct_cost_ns <= f.cost_ns
    assert f.q_value <= 0.01 and f.score_min is not None and 0 <= f.score_min < 0.9
    assert any("cost:" in e for e in f.evidence) and any("binomial" in e for e in f.evidence)


def _propagation_job(slow: dict[int, float]) -> simjob.SimJob:
    """World (0..3), then T={2,3} and U={0,1}, then S={1,2} and V={0,3}: a slow rank 3 makes rank 2 wait
    at T, so rank 2 arrives late at S and rank 1 waits there for lateness that is not rank 2's."""
    comms = [np.arange(4), np.array([2, 3]), np.array([0, 1]), np.array([1, 2]), np.array([0, 3])]
    return simjob.SimJob(4, comms, [simjob.Step(5.0, [0]), simjob.Step(5.0, [1, 2]), simjob.Step(0.5, [3, 4])],
                         iterations=200, slow=slow, sigma=0.03)


def test_propagated_lateness_is_listed_under_the_root_cause() -> None:
    sim = simjob.simulate(_propagation_job({3: 1.3}))
    findings, _ = _judge(sim)
    assert [(f.node, f.ranks) for f in findings] == [("sim00003", [3])]
    f = findings[0]
    s_comm = f"{sim.comms[3].comm_id:#x}"
    prop = {p["comm_id"]: p for p in f.propagated}
    # rank 2 of the world is rank 1 of S = {1, 2}
    assert s_comm in prop and prop[s_comm]["ranks"] == [1] and prop[s_comm]["nodes"] == ["sim00002"]
    assert prop[s_comm]["wait_ns"] > 0.1 * f.cost_ns
    assert f.cost_ns > f.direct_cost_ns
    # The old detector (who arrived last, per communicator) also reported rank 2 on S as a straggler of
    # its own: that lateness was propagated from rank 3, which is why it is no finding any more.
    naive, _ = _judge(sim, algorithm="last_share")
    assert ("sim00002", s_comm) in {(x.node, f"{x.comm_id:#x}") for x in naive}


def test_exit_asymmetry_of_a_small_communicator_is_no_finding() -> None:
    """Two ranks, a world Allreduce and a 2-rank sub-communicator whose second rank always leaves 2 ms
    later (the algorithm): rank 1 is last at every world Allreduce, yet nobody is slow."""
    comms = [np.arange(2), np.array([0, 1])]
    job = simjob.SimJob(2, comms, [simjob.Step(5.0, [0]), simjob.Step(1.0, [1])], iterations=200,
                        exit_asym_us={1: np.array([0.0, 2000.0])}, sigma=0.01)
    sim = simjob.simulate(job)
    findings, m = _judge(sim)
    assert findings == []
    s = m["_summary"]
    assert isinstance(s, dict)
    split = s["wait_ns_by_split"]
    assert split["exit asymmetry"] > 10 * (split["own compute"] + split["exit delay"])
    # the old reading (arrived last more often than chance) flags it
    naive, _ = _judge(sim, algorithm="last_share")
    assert [x.ranks for x in naive] == [[1]]


def test_network_straggler_needs_exit_delay_beyond_the_clock_error() -> None:
    """Rank 3's collectives return 2 ms late in half the instances, its compute is normal: found as
    network; told of a clock error larger than the delay, it is not."""
    job = simjob.SimJob(8, [np.arange(8)], [simjob.Step(5.0, [0])], iterations=400, sigma=0.01, seed=5,
                        slow_exit={3: (0.5, 2000.0)})
    sim = simjob.simulate(job)
    findings, _ = _judge(sim)
    assert [(f.ranks, f.cause, f.kind) for f in findings] == [([3], "network", "exit delay")]
    assert any("returned" in e and "later" in e for e in findings[0].evidence)
    sim.clock_error_ns[:] = 5e6
    assert _judge(sim)[0] == []


def test_blocks_and_spans_do_not_change_the_result() -> None:
    """The sweep reads spans of instances; their size changes nothing in the numbers."""
    sim = simjob.simulate(_propagation_job({3: 1.3}))
    a = rc.delay_analysis(sim.comms, sim.times)
    b = rc.delay_analysis(sim.comms, sim.times, span_cells=8)
    for name in ("wait_ns", "f_own", "f_exit", "f_asym", "f_prop", "ptr", "waitee"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_ranges_dealt_over_ranks_do_not_change_the_result() -> None:
    """The sweep's ranges (one per merge rank, each from a ring warmed up just before it) give the
    same numbers bit for bit as one sweep from the start, whatever the number of ranges and spans."""
    from dataclasses import fields

    from gpuprof.mpi_merge.common import SerialPool

    sim = simjob.simulate(_propagation_job({3: 1.3}))
    a = rc.delay_analysis(sim.comms, sim.times)
    for size, span in ((2, None), (3, 8), (7, 64), (40, None)):
        b = rc.delay_analysis(sim.comms, span_cells=span, pool=SerialPool(rc.GivenTimes(sim.times), size))
        for fl in fields(rc.Blame):
            x, y = getattr(a, fl.name), getattr(b, fl.name)
            if isinstance(x, list):
                assert all(np.array_equal(u, v) for u, v in zip(x, y)), (size, fl.name)
            else:
                assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), (size, fl.name)


def test_sweep_ranges_shrink_so_the_last_ones_dealt_are_short() -> None:
    """The ranges are dealt in order on demand: the last ones set how long the other ranks wait for
    the rank that took the last one, so they are the shortest (cells shrink from the first range)."""
    sim = simjob.simulate(_propagation_job({3: 1.3}))
    gcomm = rc._instance_order(sim.comms)[0]
    cuts = rc.sweep_cuts(sim.comms, gcomm, 16)
    sizes = np.array([c.size for c in sim.comms])[gcomm]
    cells = np.array([sizes[a:b].sum() for a, b in itertools.pairwise(cuts)])
    assert len(cells) == 16 and cells.sum() == sizes.sum()
    assert np.all(np.diff(cells) <= max(sizes)), cells  # shrinking, to one instance's cells
    assert cells[-1] < cells[0] / 4, cells
    assert rc.sweep_cuts(sim.comms, gcomm, 1).tolist() == [0, len(gcomm)]


def test_scores_are_in_the_unit_interval_or_none() -> None:
    job = simjob.balanced_job(8)
    job.slow = {2: 1.3}
    findings, m = _judge(simjob.simulate(job))
    for key, v in m.items():
        if key.startswith("_"):
            continue
        assert isinstance(v, dict)
        assert all(x is None or 0.0 <= x <= 1.0 for x in v["score_min"])
    assert findings and all(f.score_min is None or 0 <= f.score_min <= 1 for f in findings)


# --- held-back time, dominance, point to point --------------------------------------------------------
def test_two_slow_ranks_of_four_are_an_imbalance_not_a_finding() -> None:
    """Seen on every balanced run of the training program on 2 cores: two of four ranks share a core
    and are 30 % slower. Neither held the others back more than the other: no finding, and the summary
    names the imbalance. One slow rank of four is found."""
    job = simjob.SimJob(4, [np.arange(4)], [simjob.Step(6.0, [0])], iterations=1500, sigma=0.05,
                        slow={2: 1.3, 3: 1.3})
    findings, m = _judge(simjob.simulate(job), window_s=5.0)
    assert findings == []
    s = m["_summary"]
    assert isinstance(s, dict)
    imb = s["imbalance_without_straggler"]
    assert imb and all(set(x["ranks"]) <= {2, 3} for x in imb)
    assert any(x["why"] == "not a minority" for x in imb)
    job.slow = {2: 1.3}
    found, _ = _judge(simjob.simulate(job), window_s=5.0)
    assert [(f.node, f.ranks) for f in found] == [("sim00002", [2])]
    assert found[0].held_share > 2 * found[0].next_held_share


def test_rarely_but_long_late_rank_is_found_by_the_magnitude_test() -> None:
    """Rank 1 of 4 is stopped for 60 ms in 1 step of 15 (as SIGSTOP for 30 % of every 200 ms does to a
    6 ms loop) and is otherwise as fast as the others: it is last hardly more often than chance, yet it
    held the others back far longer than anyone."""
    job = simjob.SimJob(4, [np.arange(4)], [simjob.Step(6.0, [0])], iterations=3000, sigma=0.05, seed=4,
                        stall={1: (1 / 15, 60.0)})
    sim = simjob.simulate(job)
    last = np.bincount(sim.comms[0].last_rank[sim.comms[0].last_rank >= 0], minlength=4) / 3000
    assert last[1] < 0.4  # hardly more than chance (0.25) ...
    findings, _ = _judge(sim, window_s=5.0)
    assert [(f.node, f.ranks) for f in findings] == [("sim00001", [1])]  # ... found all the same


def _p2p(late_node: int, n: int = 20_000, every: int = 400, stop_ms: float = 50.0,
         seed: int = 3) -> StragglerLateness:
    """A ping-pong of two nodes, 20 us Late Sender waits both ways; every `every`-th message of
    `late_node` waits stop_ms (its sender was stopped)."""
    rng = np.random.default_rng(seed)
    send = np.arange(n) % 2
    wait = rng.exponential(20_000.0, n)
    if late_node >= 0:
        hit = np.flatnonzero(send == late_node)[::every]
        wait[hit] += stop_ms * 1e6
    t = np.cumsum(wait + 30_000.0)
    return StragglerLateness(send, 1 - send, t, wait)


def test_late_sender_of_point_to_point_is_found() -> None:
    names = ["node1", "node2"]
    findings, _ = find_stragglers([], [], names, [{}, {}], 0, 0.0, StragglerParams(window_s=5.0), [0.0, 0.0],
                                  p2p=_p2p(1))
    assert [(f.node, f.kind, f.cause) for f in findings] == [("node2", "late sender", "host")]
    assert findings[0].as_dict()["comm_id"] == "point to point"
    assert any("Late Sender" in e for e in findings[0].evidence)
    balanced, _ = find_stragglers([], [], names, [{}, {}], 0, 0.0, StragglerParams(window_s=5.0), [0.0, 0.0],
                                  p2p=_p2p(-1))
    assert balanced == []


def test_collective_returning_late_on_a_stopped_process_is_host_not_network() -> None:
    """The same late exits as the network straggler above, but the eBPF off-CPU time of rank 3's MPI
    thread says it was not running (stopped or blocked 300 ms/s, the others 1 ms/s): host."""
    job = simjob.SimJob(8, [np.arange(8)], [simjob.Step(5.0, [0])], iterations=400, sigma=0.01, seed=5,
                        slow_exit={3: (0.5, 2000.0)})
    sim = simjob.simulate(job)
    t = np.arange(0, 5, dtype=np.int64) * 1_000_000_000
    for ni, series in enumerate(sim.node_series):
        blocked = 300e6 if ni == 3 else 1e6
        for key, v in (("offcpu_blocked_ns", blocked), ("offcpu_runnable_ns", 5e6)):
            series[f"pid{1000 + ni}:{key}"] = Series(f"pid{1000 + ni}:{key}", "ns/s", t, 1_000_000_000,
                                                     np.full(len(t), v))
    findings, _ = _judge(sim)
    assert [(f.ranks, f.cause, f.kind) for f in findings] == [([3], "host", "exit delay")]
    assert any("not running" in e for e in findings[0].evidence)
    assert findings[0].metrics["blocked_ns_per_s"] == 300e6


def test_threshold_counts_are_valid_under_the_null_and_see_rare_long_waits() -> None:
    """2000 windows of 60 instances, 4 exchangeable units, heavy-tailed held-back times (lognormal,
    sigma 2): the p-value (smallest over the thresholds, Bonferroni) is <= 0.01 in at most 1 % of
    the tests (valid), while a unit stopped now and then is flagged in most of its windows."""
    from gpuprof.mpi_merge.stragglers import _unit_tests

    rng = np.random.default_rng(8)
    nw, per, units = 2000, 60, 4
    win = np.repeat(np.arange(nw), per)
    held = rng.lognormal(0.0, 2.0, nw * per)
    unit = rng.integers(0, units, nw * per)
    ok = np.ones(nw * per, bool)
    share = np.full((nw, units), 1 / units)
    judged = np.ones(nw, bool)
    params = StragglerParams()
    floor = np.full(nw * per, float(np.median(held)))
    null = _unit_tests(0, win, unit, held, floor, ok, share, judged, params)
    assert len(null) <= 0.01 * nw * units
    # unit 2 stopped now and then: 10 instances of each window where it held the others back 50x
    # the usual (its count, 10 + 50 / 4 of 60, alone is weak: p ~ 0.05)
    stopped = (rng.random((nw, per)).argsort(axis=1)[:, :10] + np.arange(nw)[:, None] * per).ravel()
    unit[stopped] = 2
    held[stopped] = 50 * np.median(held)
    alt = _unit_tests(0, win, unit, held, floor, ok, share, judged, params)
    assert sum(1 for t in alt if t.u == 2) > 0.8 * nw
