"""Clock alignment: the minimal correction on real recordings (one host read as separate hosts, the
same with known offsets injected), on the generator's ground truth (labelled synthetic), bad input
(contradicting constraints, drift beyond the slew limit, a node with no collective for a while), and
the other methods for comparison."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.clock import ClockParams, fit_clocks, segment_fit
from gpuprof.mpi_merge.loading import discover, summarize_node
from gpuprof.mpi_merge.matching import NodeInstances, build_comms, node_instances


def fit(d: Path, method: str = "minimal") -> tuple[Any, Any, list[str], int]:
    S = [summarize_node(p) for p in discover(d)]
    names = [s.node for s in S]
    epoch = min(s.span_rt[0] for s in S if s.span_rt)
    inst = node_instances(build_comms([s.calls for s in S], epoch), len(S))
    return fit_clocks(inst, names, names[0], ClockParams(method=method)), inst, names, epoch


def rms_error_us(d: Path, method: str = "minimal") -> float:
    import json

    truth = json.loads((d / "ground_truth.json").read_text())
    f, inst, names, epoch = fit(d, method)
    errs = []
    for a, n in enumerate(names[1:], start=1):
        x = inst.exit_med[:, a]
        x = x[np.isfinite(x)]
        est = f.model(n).offset_ns(x)
        tru = syn.true_relative_offset_ns(truth, n, (x + epoch - syn.EPOCH_NS) / 1e9)
        errs.append(est - tru)
    e = np.concatenate(errs)
    return float(np.sqrt(np.mean(e**2)) / 1e3)


@pytest.fixture(scope="module")
def drifting(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("drift")
    # offsets +-10 ms, drift +-50 ppm, NTP-like rate changes every ~40 s over 2 minutes
    syn.generate(syn.SynthConfig(nodes=6, duration_s=120, drift_ppm=50, ntp_interval_s=40, seed=11,
                                 write_bulk=False), d)
    return d


def test_offsets_recovered_within_their_intervals(drifting: Path) -> None:
    """SYNTHETIC. The minimal correction stops at the edge of what the collectives allow, so its error
    is bounded by the interval's width (tens of us here: the collectives' own duration), and the
    truth lies inside the reported interval."""
    import json

    f, inst, names, epoch = fit(drifting)
    truth = json.loads((drifting / "ground_truth.json").read_text())
    half = []
    for a, n in enumerate(names[1:], start=1):
        x = inst.exit_med[:, a]
        x = x[np.isfinite(x)]
        lo, hi = f.model(n).interval_ns(x)
        tru = syn.true_relative_offset_ns(truth, n, (x + epoch - syn.EPOCH_NS) / 1e9)
        assert ((tru >= lo - 1) & (tru <= hi + 1)).mean() >= 0.99, n
        half.append(f.model(n).uncertainty_ns / 1e3)
    assert rms_error_us(drifting) < float(np.median(half))
    assert f.causality_violations == 0


def test_naive_methods_are_worse(drifting: Path) -> None:
    ours = rms_error_us(drifting)
    assert rms_error_us(drifting, "none") > 1000
    assert rms_error_us(drifting, "constant") > 20 * ours
    assert rms_error_us(drifting, "start_end") > 1.5 * ours


def test_model_reports_drift_residual_points(drifting: Path) -> None:
    f, _, names, _ = fit(drifting)
    ref = f.model(names[0])
    assert ref.is_reference and ref.offset_ns(np.array([1e9]))[0] == 0
    for n in names[1:]:
        m = f.model(n)
        assert m.aligned and m.n_points > 1000 and len(m.seg_start) >= 1 and not m.inconsistent
        assert np.all(np.abs(m.seg_drift_ppm) <= 500.0 + 1e-9)  # the kernel's slew limit
        assert abs(m.mean_drift_ppm) < 110 and 0 < m.uncertainty_ns < 100e3
    assert f.causality_violations == 0


def test_same_host_offsets_zero(tmp_path: Path) -> None:
    syn.generate(syn.SynthConfig(nodes=4, duration_s=30, same_host=True, write_bulk=False), tmp_path)
    f, inst, names, _ = fit(tmp_path)
    t = np.linspace(np.nanmin(inst.exit_med), np.nanmax(inst.exit_med), 50)
    for n in names:
        # one clock, fitted as if each node had its own: the prior satisfies every constraint
        assert np.max(np.abs(f.model(n).offset_ns(t))) == 0.0


def test_biased_exits_bounded(tmp_path: Path) -> None:
    # ranks leave up to 20 us apart along the ring: no method sees all of it (docs/merge.md)
    syn.generate(syn.SynthConfig(nodes=6, duration_s=60, exit_bias_us=20, write_bulk=False, seed=4), tmp_path)
    assert rms_error_us(tmp_path) <= 40.0


def test_disjoint_communicators_not_aligned(tmp_path: Path) -> None:
    syn.generate(syn.SynthConfig(nodes=4, duration_s=5, disjoint_comms=2, write_bulk=False), tmp_path)
    f, _, _names, _ = fit(tmp_path)
    assert f.components == [["node000", "node001"], ["node002", "node003"]]
    assert f.model("node001").aligned
    assert not f.model("node002").aligned and "disjoint" in f.model("node002").reason


def test_segment_fit_finds_kink() -> None:
    t = np.arange(0, 400e9, 2e9)
    y = np.where(t < 200e9, 5e-6 * t, 5e-6 * 200e9 + 7e-6 * (t - 200e9))
    starts, _offs, drifts, resid = segment_fit(t, y, 0.5)
    assert len(starts) == 2 and abs(starts[1] - 200e9) <= 2e9
    assert drifts == pytest.approx([5.0, 7.0], abs=0.01) and resid < 100


def test_nodes_of_one_host_share_one_clock() -> None:
    """Virtual nodes on one host read the same clock: zero offset between them by construction, and
    the offset between hosts estimated from all their ranks together, even when exits are noisy."""
    rng = np.random.default_rng(7)
    k, true_ms = 400, 1.5
    t = np.arange(k) * 10e6  # a collective every 10 ms
    host_of = [0, 0, 1, 1]
    enter = t[:, None] + rng.uniform(0, 2e6, (k, 4))  # ranks arrive within 2 ms
    last = enter.max(axis=1)
    exit_ = last[:, None] + 5e3 + rng.exponential(3e5, (k, 4))  # oversubscribed: ms-scale exit noise
    off = np.array([true_ms * 1e6 * h for h in host_of])
    inst = NodeInstances(enter + off, exit_ + off, exit_ + off, np.zeros(k, np.uint64), np.arange(k, dtype=np.uint64))
    names = ["node1", "node2", "node3", "node4"]
    fit = fit_clocks(inst, names, "node1", clock_domains=["a", "a", "b", "b"])
    o = {m.node: float(m.offset_ns(np.array([t[k // 2]]))[0]) for m in fit.models}
    assert o["node1"] == 0.0 and o["node2"] == 0.0
    assert o["node3"] == o["node4"]
    assert abs(o["node3"] - true_ms * 1e6) < 200e3  # within the exit noise of the data
    assert any("same host and boot id" in n and "agree" in n for n in fit.notes)
    assert fit.model("node2").n_points == k


# --- real recordings ---------------------------------------------------------------------------
DEMO = Path(__file__).resolve().parent / "recordings" / "demo-4nodes"


def _demo_instances() -> tuple[NodeInstances, list[str]]:
    S = [summarize_node(p) for p in discover(DEMO)]
    epoch = min(s.span_rt[0] for s in S if s.span_rt)
    return node_instances(build_comms([s.calls for s in S], epoch), len(S)), [s.node for s in S]


def _shifted(inst: NodeInstances, offsets_ns: np.ndarray, drift_ppm: np.ndarray) -> NodeInstances:
    """The recording as if each node's clock read true time + offset + drift x time."""
    t = np.nanmedian(inst.exit_med, axis=1)[:, None]
    o = offsets_ns[None, :] + drift_ppm[None, :] * 1e-6 * t
    return NodeInstances(inst.enter_max + o, inst.exit_min + o, inst.exit_med + o, inst.comm_id, inst.seq)


def test_real_one_host_read_as_separate_hosts_keeps_the_wall_clock() -> None:
    """Four virtual nodes of one host (true offsets exactly zero), fitted as four hosts: nothing in the
    data asks for a correction, so none is made; the previous method invented milliseconds."""
    inst, names = _demo_instances()
    t = np.linspace(np.nanmin(inst.exit_med), np.nanmax(inst.exit_med), 200)
    f = fit_clocks(inst, names, names[0])
    assert f.causality_violations == 0
    for n in names:
        m = f.model(n)
        assert np.max(np.abs(m.offset_ns(t))) == 0.0 and not m.inconsistent
        lo, hi = m.interval_ns(t)
        assert np.all(lo <= 0) and np.all(hi >= 0)  # the truth (0) inside the interval
    old = fit_clocks(inst, names, names[0], ClockParams(method="bounds"))
    assert max(np.max(np.abs(old.model(n).offset_ns(t))) for n in names) > 1e6


def test_real_recording_with_injected_offsets_is_never_worse_than_the_wall_clock() -> None:
    inst, names = _demo_instances()
    off = np.array([0.0, 3e6, -8e6, 20e6])  # node clocks 3 ms ahead, 8 ms behind, 20 ms ahead
    drift = np.array([0.0, 20.0, -35.0, 0.0])
    shifted = _shifted(inst, off, drift)
    f = fit_clocks(shifted, names, names[0])
    assert f.causality_violations == 0
    t_true = np.nanmedian(inst.exit_med, axis=1)
    for a, n in enumerate(names[1:], start=1):
        ok = np.isfinite(shifted.exit_med[:, a])
        x = shifted.exit_med[ok, a]
        truth = off[a] + drift[a] * 1e-6 * t_true[ok]
        m = f.model(n)
        est = m.offset_ns(x)
        assert np.all(np.abs(est - truth) <= np.abs(truth) + 1.0), n  # moved towards the truth, never past
        lo, hi = m.interval_ns(x)
        assert ((truth >= lo) & (truth <= hi)).mean() >= 0.95, n
        # the data are consistent (20-35 ppm): never said otherwise; where the model had to drift
        # faster to keep two loosely pinned nodes in order, it says so
        assert not m.inconsistent
        assert np.all(np.abs(m.seg_drift_ppm) <= 500.0 + 1e-9) or "slew limit" in m.drift_note


# --- bad input ---------------------------------------------------------------------------------
def _tight_instances(k: int, n: int, offsets_ns: np.ndarray, period_ns: float = 10e6, seed: int = 3,
                     drift_ppm: np.ndarray | None = None) -> NodeInstances:
    """All n nodes in every instance: arrivals within 50 us, all leave 5-10 us after the last."""
    rng = np.random.default_rng(seed)
    t = np.arange(k) * period_ns + 1e9
    enter = t[:, None] + rng.uniform(0, 50e3, (k, n))
    exit_ = enter.max(axis=1)[:, None] + rng.uniform(5e3, 10e3, (k, n))
    o = offsets_ns[None, :] + (0 if drift_ppm is None else drift_ppm[None, :] * 1e-6 * t[:, None])
    return NodeInstances(enter + o, exit_ + o, exit_ + o, np.zeros(k, np.uint64), np.arange(k, dtype=np.uint64))


def test_tight_collectives_pin_the_offset() -> None:
    """SYNTHETIC. Where every node is last now and then, the offset is recovered within 10 us, and
    the interval at each model point holds the truth and is tens of us wide: the instances of the
    few ms around the point (a clock may drift by the 500 ppm bound between them, 5 us per 10 ms)."""
    off = np.array([0.0, 2e6, -1e6])
    f = fit_clocks(_tight_instances(2000, 3, off), ["a", "b", "c"], "a")
    for j, n in ((1, "b"), (2, "c")):
        m = f.model(n)
        assert abs(float(m.offset_ns(np.array([5e9]))[0]) - off[j]) < 10e3
        assert np.all((m.point_lo <= off[j] + 1) & (off[j] - 1 <= m.point_hi))
        assert m.uncertainty_ns < 20e3
    assert f.causality_violations == 0


def test_contradicting_constraints_are_reported_not_fitted() -> None:
    """Node b's timestamps say it left one instance before a entered, and another before a entered
    by the other sign: no clock correction explains both, within one window."""
    inst = _tight_instances(40, 2, np.zeros(2))
    E, X = inst.enter_max.copy(), inst.exit_min.copy()
    E[10, 1] = X[10, 0] + 5e6  # b entered 5 ms after a left (b's clock 5 ms ahead, at least)
    X[10, 1] = E[10, 1] + 1e3
    E[11, 0] = X[11, 1] + 5e6  # ... and a entered 5 ms after b left (b's clock 5 ms behind)
    X[11, 0] = E[11, 0] + 1e3
    bad = NodeInstances(E, X, X.copy(), inst.comm_id, inst.seq)
    f = fit_clocks(bad, ["a", "b"], "a")
    m = f.model("b")
    # split apart, each instance is satisfiable, but only by a clock that jumps 10 ms in 10 ms
    assert "inconsistent" in m.inconsistent and "500 ppm" in m.inconsistent
    assert f.causality_violations >= 1  # counted, not hidden
    assert np.isfinite(m.offset_ns(np.array([1.2e9]))).all()


def test_drift_beyond_the_slew_limit_is_said_to_be_inconsistent() -> None:
    f = fit_clocks(_tight_instances(3000, 2, np.zeros(2), drift_ppm=np.array([0.0, 900.0])), ["a", "b"], "a")
    m = f.model("b")
    assert "500 ppm" in m.inconsistent


def test_node_without_collectives_for_a_while_keeps_the_prior_there() -> None:
    inst = _tight_instances(3000, 3, np.array([0.0, 0.0, 4e6]))  # 30 s, node c 4 ms ahead
    E, Xn, Xm = inst.enter_max.copy(), inst.exit_min.copy(), inst.exit_med.copy()
    gap = slice(1000, 2000)  # node c takes part in no collective from 11 s to 21 s
    for arr in (E, Xn, Xm):
        arr[gap, 2] = np.nan
    f = fit_clocks(NodeInstances(E, Xn, Xm, inst.comm_id, inst.seq), ["a", "b", "c"], "a")
    m = f.model("c")
    assert len(m.unconstrained_spans) == 1
    s0, s1 = m.unconstrained_spans[0]
    assert 10.5e9 < s0 < 12e9 and 19.5e9 < s1 < 21.5e9
    assert abs(float(m.offset_ns(np.array([5e9]))[0]) - 4e6) < 20e3  # pinned before the gap
    assert not f.model("b").unconstrained_spans
    # in the gap the offset may only move back towards the prior at the slew limit
    mid = float(m.offset_ns(np.array([16e9]))[0])
    assert 4e6 - 500e-6 * 5.5e9 - 1 <= mid <= 4e6 + 1



def test_per_node_reductions_are_those_of_each_node_alone() -> None:
    """matching._per_node (all nodes at once) against nanmax / nanmin / nanmedian_rows node by node,
    bit for bit: ranks of no node, nodes without ranks, NaN cells, ties, one node, uneven nodes."""
    from gpuprof.mpi_merge.common import nanmedian_rows
    from gpuprof.mpi_merge.matching import _per_node

    rng = np.random.default_rng(1)
    for trial in range(300):
        R, N, n = int(rng.integers(1, 40)), int(rng.integers(1, 12)), int(rng.integers(0, 6))
        nor = rng.integers(-1, N, R)
        if trial % 7 == 0:
            nor[:] = 0
        if trial % 11 == 0:
            nor[: R // 2 + 1] = N - 1  # one node with most ranks: the unpadded path
        enter, exit_ = rng.normal(size=(n, R)), rng.normal(size=(n, R))
        enter[rng.random((n, R)) < 0.3] = np.nan
        exit_[rng.random((n, R)) < 0.3] = np.nan
        if trial % 5 == 0:
            exit_ = np.round(exit_, 1)
        want = [np.full((n, N), np.nan) for _ in range(3)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: NaN, as wanted
            for ni in np.unique(nor[nor >= 0]):
                c = np.flatnonzero(nor == ni)
                want[0][:, ni] = np.nanmax(enter[:, c], axis=1)
                want[1][:, ni] = np.nanmin(exit_[:, c], axis=1)
                want[2][:, ni] = nanmedian_rows(exit_[:, c])
        for got, w in zip(_per_node(enter, exit_, nor, N), want):
            assert np.array_equal(got, w, equal_nan=True), trial


class _TwoRanksHere:
    """Test double of the merge's CommSpread: every item computed here, in order, but `size` says 2,
    so the fit does what it does when other ranks compute its items (the repair's solves ahead)."""

    size = 2

    def map(self, fn: Any, n: int) -> list[Any]:
        return [fn(i) for i in range(n)]

    def ordered(self, fn: Any, n: int) -> Any:
        return (fn(i) for i in range(n))

    def share(self, obj: Any) -> Any:
        return obj


def test_repair_solves_ahead_give_the_serial_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With other ranks, the repair loop's per-piece solve is done ahead within the piece's tube box
    and used where the drift bound from the last point binds no node; elsewhere the loop solves
    again. Drifting clocks and a node absent for 10 s (its tube wide there: the bound binds) give
    both cases; the models must be those of the serial fit, bit for bit."""
    from gpuprof.mpi_merge import clock

    where = {"_repair_item": 0, "_fit_minimal": 0}
    solve = clock._repair_point

    def counted(*a: Any) -> Any:
        where[sys._getframe(1).f_code.co_name] += 1
        return solve(*a)

    monkeypatch.setattr(clock, "_repair_point", counted)
    inst = _tight_instances(4000, 4, np.array([0.0, 2e6, -1e6, 4e6]), drift_ppm=np.array([0.0, 120, -200, 60]))
    E, Xn, Xm = inst.enter_max.copy(), inst.exit_min.copy(), inst.exit_med.copy()
    for arr in (E, Xn, Xm):
        arr[1500:2500, 3] = np.nan
    inst = NodeInstances(E, Xn, Xm, inst.comm_id, inst.seq)
    serial = fit_clocks(inst, list("abcd"), "a")
    assert where == {"_repair_item": 0, "_fit_minimal": where["_fit_minimal"]} and where["_fit_minimal"] > 100
    loop_serial = where["_fit_minimal"]
    where.update(_repair_item=0, _fit_minimal=0)
    spread = fit_clocks(inst, list("abcd"), "a", spread=_TwoRanksHere())
    assert where["_repair_item"] == loop_serial  # every piece solved ahead ...
    assert 0 < where["_fit_minimal"] < loop_serial // 2  # ... and some solved again by the loop
    for a, b in zip(serial.models, spread.models):
        for field in ("seg_start", "seg_offset", "seg_drift_ppm", "point_lo", "point_hi"):
            assert np.array_equal(getattr(a, field), getattr(b, field), equal_nan=True), (a.node, field)
        assert (a.inconsistent, a.drift_note) == (b.inconsistent, b.drift_note)
        assert np.array_equal(a.uncertainty_ns, b.uncertainty_ns, equal_nan=True)
    assert serial.causality_violations == spread.causality_violations
