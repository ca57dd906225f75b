"""Stragglers as root causes: the delay analysis (rootcause.py) splits every wait, then an exact test
per rank and window, false-discovery-rate control across the whole job, a minimum effect size, and
the cause from the evidence. Takes arrays; the detection algorithm is a parameter.

Units. A communicator that spans several nodes is judged per node (its ranks share the node's CPUs,
network and clock: a slow node is one straggler however many of its ranks arrive last), one on a
single node per rank (rootcause.comm_units).

Held-back time. At a synchronizing instance the last unit held the others back by h = its last
arrival - the last arrival of any other unit: how much earlier the instance would have begun had it
been as late as the next one. Only the part the delay analysis puts on the unit itself counts (own
compute, exit delay); what was propagated to it, and the algorithm's usual exit offsets, do not.

Tests, per communicator, window of window_s (stretched so a window holds min_instances on average)
and unit, exact and one-sided under the null of a balanced job, where the units are exchangeable
(which one is the culprit does not depend on how long it held the others back): at each of LEVELS
thresholds (floor x 4^k; the floor is min_effect x the typical compute interval), given how many
instances held the others back by more, the unit's count among them is Binomial(n, ranks of the
unit / size); the smallest p-value of the thresholds, Bonferroni-corrected (_unit_tests). The low
thresholds see a unit late a little nearly every time, the high ones a unit late rarely but long
(a process stopped for 60 ms now and then). Held-back time counts beyond the clock error except the
part the waitee's own-clock compute excess accounts for. Benjamini-Hochberg at fdr_q runs once over
every test of the job (units x windows x communicators, point to point included).

Effect and dominance. In each window, the smallest set of the units that held the others back
longest, at most a minority (max(1, units // 4): two slow nodes of four are an imbalance, not a node
that held the others back), whose last member held them back >= min_held_share of the
communicator's time in use and >= dominance x as long as the next unit, every member with a
rejected test, are the stragglers. A window with rejected tests but no such set is listed in the
summary as an imbalance without a straggler, not as a finding. Findings are grouped per node;
each names its root ranks, the held-back time, its cost (the waiting time of others it caused,
directly and propagated, and the share of the job's waits), the lateness it propagated into other
communicators (under "propagated"), and its evidence; the cause comes from that evidence (the rank's
GPU, the host's CPU, the off-CPU time of the rank's MPI threads; "network" only for a collective that
returned late on a rank that was running).

Score (NVIDIA's straggler detector, median ratio): min over ranks of the median compute interval
(enter[k] - exit[k-1] on the same rank: one node's clock, never negative) over this rank's median, in
[0, 1], 1 = as fast as the fastest; None with a reason where a window is not judged or the rank has
no compute interval (median 0). Arrival times since the previous instance's *median* exit are not
used: they can be <= 0, and a ratio of them is meaningless.

The aligned times are read through AlignedRows: by spans of instances in time order (the delay
analysis), by windows a few ranks at a time (the scores), never as an [instances x ranks] table.
Those reads are the tasks dealt over the merge ranks (`pool`: the delay analysis's ranges, the
groups of windows of every communicator in one map); what they return is per instance or per
window and rank, and the tests, on those, run once on the leading rank (one Benjamini-Hochberg).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuprof.mpi_merge.common import Pool, SerialPool, block_rows, quiet_nan
from gpuprof.mpi_merge.loading import NamedTimeBins, OnCpuBins, Series, bins_overlapping
from gpuprof.mpi_merge.rootcause import (
    AlignedRows,
    Blame,
    GivenTimes,
    TimesContext,
    benjamini_hochberg,
    binom_sf_many,
    comm_units,
    delay_analysis,
)
from gpuprof.mpi_merge.waitstates import CommSummary

__all__ = [
    "DEFAULT_STRAGGLER_PARAMS",
    "AlignedRows",
    "Finding",
    "P2PLateness",
    "StragglerParams",
    "find_stragglers",
    "stretched_window_s",
    "window_scores",
]

ALGORITHMS = ("rootcause", "last_share", "score")
MAX_DRIFT = 500e-6  # the kernel's slew limit: a clock's error over one compute interval
PROPAGATED_MIN_COST = 0.01  # a communicator is listed under "propagated" with >= this share of the cost
PROPAGATED_MIN_WAIT = 0.2  # ... and >= this share of that communicator's own waits

# the "communicator" of a point-to-point finding (a node's sends) in the report and the job file
P2P_COMM = "point to point"


@dataclass(frozen=True)
class StragglerParams:
    window_s: float = 10.0
    score_threshold: float = 0.9  # algorithm "score": the score must also be below this
    # windows with fewer attributed instances are not judged; a short job's windows are stretched to
    # hold this many
    min_instances: int = 20
    fdr_q: float = 0.01  # Benjamini-Hochberg false discovery rate over every test of the job
    min_effect: float = 0.05  # an event: held the others back >= this share of the typical compute interval
    min_held_share: float = 0.01  # a straggler held the others back >= this share of the time in a window
    dominance: float = 2.0  # ... and >= this many times as long as any unit that is not a straggler
    gpu_delta_points: float = 5.0  # SM activity this much above peers = GPU-bound evidence
    cpu_ratio: float = 1.25  # CPU use this much above peers = host-bound evidence
    offcpu_ratio: float = 1.5  # run-queue time (node) or blocked time (MPI threads) this much above peers
    runnable_ratio: float = 1.1  # the MPI threads' run-queue time this much above peers = host-bound evidence
    p2p_min_wait_ns: float = 20_000.0  # a Late Sender wait shorter than this is no event
    offcpu_min_ns_per_s: float = 50e6  # ... and at least this much more per second (5 % of the time)
    peer_on_cpu_ratio: float = 0.6  # a peer on CPU at most this share of the others' time was held off it
    # NCCL on device times: an enqueue at least this share as late as the kernel start = host
    enqueue_share: float = 0.5
    # "rootcause": the rank was the origin (own compute or exit delay) of the waits it ended;
    # "last_share": the rank arrived last (no root-cause split; for comparison);
    # "score": arrived last and median-ratio score below score_threshold
    algorithm: str = "rootcause"


DEFAULT_STRAGGLER_PARAMS = StragglerParams()


@dataclass
class Finding:
    node: str
    comm_id: int  # the widest communicator where it was found the origin (then the most significant)
    ranks: list[int]  # root ranks in that communicator
    cause: str  # "gpu", "host", "network", "compute (unattributed)"
    kind: str  # "own compute" or "exit delay": what made the rank late
    windows_flagged: int
    windows_judged: int
    first_s: float
    last_s: float
    times_last: int
    share_last: float
    expected_share: float
    lateness_when_last_ns: float
    score_min: float | None  # in [0, 1]; None with score_reason
    score_reason: str
    p_value: float  # smallest exact binomial p-value among its tests
    q_value: float  # its Benjamini-Hochberg adjusted p-value (fdr_q is the threshold)
    cost_ns: float  # waiting time of others it caused, direct + propagated
    direct_cost_ns: float
    cost_share: float  # of all waiting time in synchronizing collectives of the job
    held_ns: float  # the time it alone held its communicator back in the flagged windows (origin part)
    held_share: float  # the largest share of a flagged window's time in use it held the others back
    next_held_share: float  # the same share of the next unit that is no straggler, in that window
    propagated: list[dict[str, Any]] = field(default_factory=list)  # {comm_id, ranks, wait_ns}
    evidence: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    # an exit delay that a peer not running at the time explains: why it is no finding ('' otherwise)
    explained_by_peer: str = ""
    # global instance ids (Blame order) of its late arrivals in the flagged windows: where the
    # device-time evidence of NCCL is read (not reported)
    evidence_gids: np.ndarray | None = field(default=None, repr=False)
    # the NVTX range (phase) its processes spent the most extra time in, against the other ranks ('' = none)
    phase: str = ""
    # the CUDA kernel its processes' GPUs spent the most extra time in (CUPTI; '' = none recorded or no excess)
    kernel: str = ""
    # its flagged windows on its widest communicator, [k, 2] aligned ns (where flames.py reads stacks)
    evidence_spans: np.ndarray | None = field(default=None, repr=False)
    # per stack table ("cpu", "offcpu"): where its processes' extra time went (flames.summarize)
    stacks: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("explained_by_peer")
        d.pop("evidence_gids")
        d.pop("evidence_spans")
        d["comm_id"] = P2P_COMM if self.kind == "late sender" else f"{self.comm_id:#x}"
        d["propagated"] = [dict(p) for p in self.propagated]
        return d


def stretched_window_s(tk: np.ndarray, window_s: float, min_instances: int) -> float:
    """The window, made long enough to hold min_instances on average (a short or slow job would
    otherwise never be judged)."""
    if len(tk) < 2:
        return window_s
    span_s = float(tk.max() - tk.min()) / 1e9
    per_window = len(tk) * window_s / max(span_s, 1e-9)
    if per_window >= min_instances:
        return window_s
    return max(window_s, span_s * min_instances / len(tk) * 1.0001)


@dataclass
class _WindowMedians:
    """Task: per rank, the median compute interval of each window of a group (item: the communicator,
    its size, the instances k of the group's windows in window order, the windows' bounds among them)."""

    items: list[tuple[int, int, np.ndarray, np.ndarray]]  # (ci, size, k, bounds)

    def __call__(self, ctx: TimesContext, i: int) -> np.ndarray:
        ci, size, k, bounds = self.items[i]
        tm = ctx.times[ci]
        med = np.full((len(bounds) - 1, size), np.nan)
        step = block_rows(len(k))
        for r0 in range(0, size, step):
            ranks = slice(r0, min(size, r0 + step))
            intervals = tm.enter(k, ranks) - tm.exit(k - 1, ranks)
            for w in range(len(bounds) - 1):
                if bounds[w + 1] > bounds[w]:
                    med[w, ranks] = np.median(intervals[bounds[w]:bounds[w + 1]], axis=0)
        return med


def _window_groups(ci: int, c: CommSummary, win_of_seq: np.ndarray, nw: int
                   ) -> list[tuple[tuple[int, int], tuple[int, int, np.ndarray, np.ndarray]]]:
    """The reads of window_scores for one communicator: ((first window, end window), _WindowMedians
    item) per group of windows read together (up to a block; a window longer than a block alone, its
    ranks a few at a time)."""
    size = c.size
    prev_ok = np.concatenate([[False], c.complete[:-1]])
    k = np.flatnonzero(c.complete & prev_ok)
    win = win_of_seq[k]
    order = np.argsort(win, kind="stable")
    bounds = np.searchsorted(win[order], np.arange(nw + 1))
    out = []
    w0 = 0
    while w0 < nw:
        w1 = w0 + 1
        while w1 < nw and bounds[w1 + 1] - bounds[w0] <= block_rows(size):
            w1 += 1
        if bounds[w1] > bounds[w0]:
            out.append(((w0, w1), (ci, size, k[order[bounds[w0]:bounds[w1]]], bounds[w0:w1 + 1] - bounds[w0])))
        w0 = w1
    return out


def _scores_of_medians(med: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with quiet_nan(), np.errstate(divide="ignore", invalid="ignore"):
        fastest = np.nanmin(np.where(med > 0, med, np.nan), axis=1)
        score = np.where(med > 0, fastest[:, None] / med, np.nan)
        typical = np.nanmedian(med, axis=1)
    return np.clip(score, 0.0, 1.0), typical


def _all_window_scores(comms: Sequence[CommSummary], windows: dict[int, tuple[np.ndarray, int]], pool: Pool
                       ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """window_scores of every communicator in `windows` (ci -> (window of each seq, windows)), all
    groups of windows of all communicators dealt over the pool's ranks at once."""
    groups = [(ci, g) for ci, (win_of_seq, nw) in windows.items() for g in _window_groups(ci, comms[ci], win_of_seq, nw)]
    meds = {ci: np.full((nw, comms[ci].size), np.nan) for ci, (_, nw) in windows.items()}
    for (ci, ((w0, w1), _)), med in zip(groups, pool.map(_WindowMedians([item for _, (_, item) in groups]),
                                                         len(groups))):
        meds[ci][w0:w1] = med
    return {ci: _scores_of_medians(med) for ci, med in meds.items()}


def window_scores(c: CommSummary, times: AlignedRows, win_of_seq: np.ndarray, nw: int) -> tuple[np.ndarray, np.ndarray]:
    """Per window and rank, the median compute interval enter[k] - exit[k-1] (instances k complete
    after a complete one) and the median-ratio score; windows read together up to a block, a window
    longer than a block a few ranks at a time. Returns (score [nw, size] NaN where undefined,
    typical interval [nw]: the median over ranks of the per-rank medians)."""
    return _all_window_scores([c], {0: (win_of_seq, nw)}, SerialPool(GivenTimes([times])))[0]


@dataclass
class _CommStats:
    ci: int
    window_s: float
    win: np.ndarray  # window of each complete seq (blame.seqs[ci] order)
    n: np.ndarray  # [nw] attributed instances
    judged: np.ndarray  # [nw]
    score: np.ndarray  # [nw, size]
    typical: np.ndarray  # [nw]
    clock_floor: np.ndarray  # [size] ns
    unit: np.ndarray  # [size] the unit (0 .. n_units - 1) of each rank
    held: np.ndarray  # per complete seq: the origin part of the time the last unit held the others back
    event: np.ndarray  # per complete seq: held above the floor (an event of the test)
    active_ns: np.ndarray  # [nw] how long the communicator was in use in each window
    span_lo: np.ndarray  # [nw] its first and last instance in each window (aligned ns)
    span_hi: np.ndarray
    culprit: np.ndarray  # per instance: the rank that held the others back (the last arrival), -1 none
    culprit_unit: np.ndarray  # ... and its unit, -1 none
    name: str  # the communicator's id (hex), or "point to point"


@dataclass
class _Test:
    ci: int
    w: int
    u: int  # unit (comm_units), 0 .. n_units - 1
    ranks: list[int]  # its ranks that arrived last in the events
    k: int
    n: int
    p: float
    p0: float  # the chance that the unit arrives last in a balanced job: its ranks / size
    q: float = 1.0
    held_ns: float = 0.0  # H: the time it held the others back in the window (origin part)
    held_share: float = 0.0  # H over the communicator's active time in the window
    next_held_ns: float = 0.0  # the largest H of a unit that is not a candidate
    effect_ns: float = 0.0  # median held time per event
    floor_ns: float = 0.0  # the event threshold
    level_ns: float = 0.0  # the threshold of the count that gave p

    @property
    def r(self) -> int:
        return self.ranks[0]


def _origin_weight(blame: Blame, gids: np.ndarray, algorithm: str) -> np.ndarray:
    """The part of each instance's hold-back that counts against its last unit: "rootcause" counts the
    shares the delay analysis put on the waitee itself (own compute, exit delay), not what was
    propagated to it or the algorithm's usual exit offsets; the algorithms without the split count all."""
    att = blame.attributed[gids]
    if algorithm == "rootcause":
        return np.where(att, blame.f_own[gids] + blame.f_exit[gids], 0.0)
    return att.astype(np.float64)


LEVEL_STEP = 4.0  # the thresholds of the count test: floor x LEVEL_STEP^k, k = 0 .. LEVELS - 1
LEVELS = 6


def _unit_tests(ci: int, win: np.ndarray, unit: np.ndarray, held: np.ndarray, floor: np.ndarray, ok: np.ndarray,
                share: np.ndarray, judged: np.ndarray, params: StragglerParams) -> list[_Test]:
    """The tests of one communicator that pass fdr_q on their own (BH then runs over all of them),
    per judged window w and unit u with share[w, u], its chance to be the culprit of an instance
    in a balanced job. At each of LEVELS thresholds (floor, 4 floor, 16 floor, ... 1024 floor, per
    instance) the instances that held the others back by more are counted: which unit was the
    culprit does not depend on how long it held them back when the units are exchangeable, so given
    how many instances exceed a threshold, u's count among them is Binomial(n, share): an exact
    one-sided p-value at every threshold, the smallest of them Bonferroni-corrected (x LEVELS).
    The low thresholds see a unit late by a little nearly every time, the high ones a unit late
    rarely but long (a process stopped for 60 ms in one step of 15: last hardly more often than
    chance, but nearly the only culprit of the waits above 16 floors). Returns tests whose k, n and
    level_ns are those of the threshold that gave the smallest p-value."""
    nw, n_units = share.shape
    sel = ok & (unit >= 0)
    best_p = np.ones((nw, n_units))
    best = np.zeros((3, nw, n_units))  # k, n, threshold of the best level
    for lv in range(LEVELS):
        thr = floor * LEVEL_STEP ** lv
        above = sel & (held > thr)
        if not above.any():
            break
        n = np.bincount(win[above], minlength=nw)
        cnt = np.bincount(win[above] * n_units + unit[above], minlength=nw * n_units).reshape(nw, n_units)
        wi, ui = np.nonzero(judged[:, None] & (cnt > 0))
        if not len(wi):
            continue
        pv = binom_sf_many(cnt[wi, ui], n[wi], share[wi, ui])
        better = pv < best_p[wi, ui]
        wi, ui, pv = wi[better], ui[better], pv[better]
        best_p[wi, ui] = pv
        best[0, wi, ui] = cnt[wi, ui]
        best[1, wi, ui] = n[wi]
        med_thr = np.zeros(nw)
        for w in np.unique(wi):
            med_thr[w] = float(np.median(thr[above & (win == w)]))
        best[2, wi, ui] = med_thr[wi]
    p_all = np.minimum(1.0, LEVELS * best_p)
    wi, ui = np.nonzero(judged[:, None] & (p_all <= params.fdr_q))
    return [_Test(ci, int(w), int(u), [], int(best[0, w, u]), int(best[1, w, u]), float(p_all[w, u]),
                  float(share[w, u]), level_ns=float(best[2, w, u])) for w, u in zip(wi, ui)]


def find_stragglers(
    comms: list[CommSummary], times: Sequence[AlignedRows], node_names: list[str], node_series: list[dict[str, Series]],
    epoch_rt: int, t0: float, params: StragglerParams = DEFAULT_STRAGGLER_PARAMS,
    clock_error_ns: np.ndarray | Sequence[float] | None = None, p2p: P2PLateness | None = None,
    node_on_cpu: Sequence[dict[int, OnCpuBins]] | None = None, pool: Pool | None = None,
    node_phases: Sequence[dict[int, NamedTimeBins]] | None = None,
    node_kernels: Sequence[dict[int, NamedTimeBins]] | None = None,
) -> tuple[list[Finding], dict[str, Any]]:
    """Findings (root causes) and the per-communicator metrics. `clock_error_ns`: per node (index of
    node_names), the clock model's error; NaN or missing counts as 0. `p2p`: the matched messages'
    Late Sender waits, judged per sending node like one more communicator. `node_on_cpu`: per node,
    where each MPI process was on CPU (loading.OnCpuBins), quoted in the evidence; `node_phases`: per
    node, each process's time in its NVTX ranges (loading.NamedTimeBins), the phase named; `node_kernels`:
    per node, each process's GPU time per kernel (CUPTI), the kernel named. `pool`: the merge
    ranks the reads of the aligned times are dealt over (the delay analysis's ranges, the window
    scores); by default this process reads `times`."""
    if params.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown straggler algorithm {params.algorithm!r}")
    err = np.zeros(len(node_names))
    if clock_error_ns is not None and len(node_names):
        e = np.asarray(clock_error_ns, np.float64)[:len(node_names)]
        err[:len(e)] = np.where(np.isfinite(e) & (e > 0), e, 0.0)
    if pool is None:
        pool = SerialPool(GivenTimes(times))
    blame = delay_analysis(comms, times, pool=pool)
    stats: dict[int, _CommStats] = {}
    cands: list[_Test] = []
    m_total = 0
    per_comm: dict[str, Any] = {}
    windows: dict[int, tuple[np.ndarray, int]] = {}
    window_len: dict[int, float] = {}
    for ci, c in enumerate(comms):
        seqs = blame.seqs[ci]
        if c.size < 2 or len(seqs) < 2:
            continue
        tk = c.last_enter[seqs]
        window_len[ci] = stretched_window_s(tk, params.window_s, params.min_instances)
        win_of_seq = np.zeros(c.n_seq, np.int64)
        win_of_seq[seqs] = np.floor((tk - t0) / (window_len[ci] * 1e9)).astype(np.int64)
        win_of_seq = np.maximum(win_of_seq, 0)
        windows[ci] = (win_of_seq, int(win_of_seq[seqs].max()) + 1)
    scores = _all_window_scores(comms, windows, pool)
    for ci, (win_of_seq, nw) in windows.items():
        c = comms[ci]
        seqs, gids = blame.seqs[ci], blame.gids[ci]
        tk = c.last_enter[seqs]
        window_s = window_len[ci]
        win = win_of_seq[seqs]
        att = blame.attributed[gids]
        n_w = np.bincount(win[att], minlength=nw)
        judged = n_w >= params.min_instances
        score, typical = scores[ci]
        node = np.asarray(c.node_of_rank, np.int64)
        e_rank = np.where(node >= 0, err[np.clip(node, 0, max(len(err) - 1, 0))] if len(err) else 0.0, 0.0)
        clock_floor = e_rank + float(np.median(e_rank))
        _, unit = np.unique(comm_units(c), return_inverse=True)
        unit = unit.ravel()
        n_units = int(unit.max()) + 1
        per_unit = np.bincount(unit, minlength=n_units)
        L = blame.waitee[gids]
        uL = np.where(L >= 0, unit[np.maximum(L, 0)], -1)
        held = np.clip(blame.held_ns[gids], 0, None) * _origin_weight(blame, gids, params.algorithm)
        typ_w = np.where(np.isfinite(typical), typical, 0.0)
        # an event: the last unit held the others back by more than min_effect of the typical compute
        # interval, beyond the clock error between it and the others
        floor_unit = np.zeros(n_units)
        np.maximum.at(floor_unit, unit, clock_floor)
        clock_inst = np.where(uL >= 0, floor_unit[np.maximum(uL, 0)], 0.0)
        # Arrivals compared across nodes carry both nodes' clock errors; the waitee's compute excess
        # (its compute interval against the others', each on its own clock) does not. What it held
        # the others back by is judged beyond the clock error, except the part its compute excess
        # accounts for (drift over one interval is below min_effect).
        clock_free = np.minimum(held, np.clip(np.nan_to_num(blame.compute_excess_ns[gids]), 0, None))
        held = np.clip(np.maximum(clock_free, held - clock_inst), 0, None)
        floor = params.min_effect * typ_w[win]
        event = att & (uL >= 0) & (held > floor)
        # the communicator's time in use per window: from its first to its last instance there, plus
        # one typical interval
        lo = np.full(nw, np.inf)
        hi = np.full(nw, -np.inf)
        np.minimum.at(lo, win, tk)
        np.maximum.at(hi, win, tk)
        active = np.where(np.isfinite(lo), hi - lo + typ_w, 0.0)
        st = _CommStats(ci, window_s, win, n_w, judged, score, typical, clock_floor, unit, held, event, active,
                        lo, hi + typ_w, L, uL, f"{c.comm_id:#x}")
        stats[ci] = st
        share = np.broadcast_to(per_unit / c.size, (nw, n_units))
        cands += _unit_tests(ci, win, uL, held, floor, att & (uL >= 0), share, judged, params)
        m_total += int(judged.sum()) * n_units
        with quiet_nan():
            judged_scores = score[judged]
            smin = np.nanmin(judged_scores, axis=0) if judged.any() else np.full(c.size, np.nan)
        origin = np.bincount(L[event], minlength=c.size) if event.any() else np.zeros(c.size, np.int64)
        held_rank = np.bincount(L[att & (L >= 0)], weights=held[att & (L >= 0)], minlength=c.size)
        per_comm[f"{c.comm_id:#x}"] = {
            "score_min": [None if not np.isfinite(x) else float(x) for x in smin],
            "times_last": np.bincount(c.last_rank[c.last_rank >= 0], minlength=c.size).tolist(),
            "times_origin": origin.tolist(),
            "held_others_ns": held_rank.round().tolist(),
            "windows_judged": int(judged.sum()), "window_s": window_s,
        }
    if p2p is not None and np.isfinite(p2p.t_ns).any() and len(node_names) >= 2:
        pst, ptests, pm = _p2p_tests(p2p, len(comms), len(node_names), err, t0, params)
        stats[pst.ci] = pst
        cands += ptests
        m_total += pm
    rejected, qv = benjamini_hochberg(np.array([t.p for t in cands]), params.fdr_q, max(m_total, len(cands)))
    kept, imbalance = _effect_and_dominance(
        [t for t, rej in zip(cands, rejected) if rej], [float(q) for q, rej in zip(qv, rejected) if rej], stats, params)
    kept, explained = _explained_by_wider(kept, comms, stats)
    imbalance += explained
    total_wait = float(blame.wait_ns.sum())
    by_node: dict[tuple[int, int], list[_Test]] = {}
    p2p_kept: dict[int, list[_Test]] = {}
    for t in kept:
        if t.ci == len(comms):  # point to point: the unit is the sending node
            p2p_kept.setdefault(t.u, []).append(t)
            continue
        ni = int(comms[t.ci].node_of_rank[t.r])
        key = (ni, -1) if ni >= 0 else (len(node_names), int(blame.procs[t.ci][t.r]))
        by_node.setdefault(key, []).append(t)
    findings = [_finding(tests, comms, blame, stats, node_names, node_series, epoch_rt, t0, total_wait, params)
                for _, tests in sorted(by_node.items())]
    if node_on_cpu is not None:
        for f, (_, tests) in zip(findings, sorted(by_node.items())):
            _on_cpu_evidence(f, tests, comms, stats, node_on_cpu, epoch_rt)
    for what, per_node in (("phase", node_phases), ("kernel", node_kernels)):
        if per_node is not None:
            for f, (_, tests) in zip(findings, sorted(by_node.items())):
                _named_time_evidence(f, tests, comms, stats, per_node, epoch_rt, what)
    for f in findings:
        _device_time_evidence(f, blame, times, params)
    for f in findings:
        if f.explained_by_peer:
            imbalance.append({"comm_id": f"{f.comm_id:#x}", "node": f.node, "ranks": f.ranks,
                              "held_share": [round(f.held_share, 4)], "next_held_share": round(f.next_held_share, 4),
                              "why": f.explained_by_peer})
    findings = [f for f in findings if not f.explained_by_peer]
    named = {f.node for f in findings}
    for ni, tests in sorted(p2p_kept.items()):
        if node_names[ni] in named:  # also late at collectives: that finding says more
            next(f for f in findings if f.node == node_names[ni]).evidence.append(
                f"also the late sender of point-to-point messages ({sum(t.held_ns for t in tests) / 1e6:.1f} ms "
                "of its receivers' Late Sender waits in the flagged windows)")
            continue
        findings.append(_p2p_finding(tests, stats[len(comms)], node_names, node_series, epoch_rt, params))
    metrics: dict[str, Any] = dict(per_comm)
    shares = {name: float((blame.wait_ns * getattr(blame, f)).sum()) for name, f in
              (("own compute", "f_own"), ("exit delay", "f_exit"), ("exit asymmetry", "f_asym"), ("propagated", "f_prop"))}
    metrics["_summary"] = {
        "algorithm": params.algorithm, "fdr_q": params.fdr_q, "tests": m_total, "candidates": len(cands),
        "rejected": int(rejected.sum()), "kept_after_effect_size": len(kept), "findings": len(findings),
        "wait_ns_total": total_wait, "wait_ns_by_split": shares,
        "windows_judged": int(sum(int(s.judged.sum()) for s in stats.values())),
        "imbalance_without_straggler": imbalance[:20],
    }
    return findings, metrics


def _explained_by_wider(kept: list[_Test], comms: list[CommSummary], stats: dict[int, _CommStats]
                        ) -> tuple[list[_Test], list[dict[str, Any]]]:
    """A straggler of a sub-communicator whose window overlaps that of a straggler of a wider
    communicator on another node that held the others back longer is taken as the wider one's
    consequence (a collective's exit order follows its last arrival, and the sub-communicator's
    next collective inherits it), not as a finding of its own; the summary lists it. Point to point
    counts as narrower than every communicator."""
    def size(t: _Test) -> int:
        return comms[t.ci].size if t.ci < len(comms) else 0

    def span(t: _Test) -> tuple[float, float]:
        st = stats[t.ci]
        return float(st.span_lo[t.w]), float(st.span_hi[t.w])

    def node(t: _Test) -> int:
        return int(comms[t.ci].node_of_rank[t.r]) if t.ci < len(comms) else t.u

    out: list[_Test] = []
    dropped: list[dict[str, Any]] = []
    for t in kept:
        a0, a1 = span(t)
        by = next((o for o in kept if size(o) > size(t) and node(o) != node(t) and o.held_ns > t.held_ns
                   and span(o)[0] < a1 and a0 < span(o)[1]), None)
        if by is None:
            out.append(t)
            continue
        dropped.append({"comm_id": stats[t.ci].name, "window": t.w, "units": 1, "ranks": t.ranks,
                        "held_share": [round(t.held_share, 4)],
                        "next_held_share": round(t.held_share * t.next_held_ns / max(t.held_ns, 1.0), 4),
                        "why": f"explained by the straggler of the wider communicator {stats[by.ci].name}"})
    return out, dropped


def _effect_and_dominance(tests: list[_Test], q_values: list[float], stats: dict[int, _CommStats],
                          params: StragglerParams) -> tuple[list[_Test], list[dict[str, Any]]]:
    """The tests that survived the FDR control and are stragglers, per (communicator, window): the
    smallest set of the units that held the others back longest, at most a minority (max(1, units //
    4): two slow nodes of four are an imbalance, not a straggler that held the others back), whose
    last member held them back >= min_held_share of the communicator's time in use there and >=
    dominance x as long as the next unit, every member with a rejected test. A window with
    significant units but no such set is listed as an imbalance without a straggler (the summary
    says so; it is not a finding)."""
    groups: dict[tuple[int, int], list[_Test]] = {}
    for t, q in zip(tests, q_values):
        t.q = q
        groups.setdefault((t.ci, t.w), []).append(t)
    kept: list[_Test] = []
    imbalance: list[dict[str, Any]] = []
    for (ci, w), ts in sorted(groups.items()):
        st = stats[ci]
        in_w = st.win == w
        L, uL = st.culprit, st.culprit_unit
        n_units = int(st.unit.max()) + 1
        sel = in_w & (uL >= 0)
        H = np.bincount(uL[sel], weights=st.held[sel], minlength=n_units)
        active = max(float(st.active_ns[w]), 1.0)
        big = [t for t in ts if H[t.u] >= params.min_held_share * active]
        if not big:
            continue
        # the stragglers: the smallest set of the units that held the others back longest whose last
        # member held them back >= dominance x as long as the next unit, at most a minority
        by_h = np.sort(H)[::-1]
        limit = min(max(1, n_units // 4), n_units)
        split = next((m for m in range(1, limit + 1)
                      if by_h[m - 1] >= params.min_held_share * active
                      and by_h[m - 1] >= params.dominance * (by_h[m] if m < n_units else 0.0)), 0)
        tested = {t.u: t for t in big}
        top_units = [int(u) for u in np.argsort(-H, kind="stable")[:split]]
        next_h = float(by_h[split]) if 0 < split < n_units else (float(by_h[len(big)]) if len(big) < n_units else 0.0)
        if not split or any(u not in tested for u in top_units):
            why = "not dominant" if len(big) <= limit else "not a minority"
            if split:
                why = "the units that held the others back longest are not all significant"
            imbalance.append({"comm_id": st.name, "window": w, "units": len(big),
                              "ranks": sorted({int(r) for t in big for r in np.flatnonzero(st.unit == t.u)})[:16],
                              "held_share": [round(float(H[t.u]) / active, 4) for t in big],
                              "next_held_share": round(next_h / active, 4), "why": why})
            continue
        big = [tested[u] for u in top_units]
        for t in big:
            ev = in_w & st.event & (uL == t.u)
            t.ranks = sorted({int(r) for r in L[ev]}) or [int(np.flatnonzero(st.unit == t.u)[0])]
            t.held_ns = float(H[t.u])
            t.held_share = float(H[t.u]) / active
            t.next_held_ns = next_h
            t.effect_ns = float(np.median(st.held[ev])) if ev.any() else 0.0
            typ = float(st.typical[w]) if np.isfinite(st.typical[w]) else 0.0
            t.floor_ns = max(params.min_effect * typ, float(st.clock_floor[t.ranks].max()))
            if params.algorithm == "score":
                sc = st.score[w, t.ranks]
                if not (np.isfinite(sc).any() and np.nanmin(sc) < params.score_threshold):
                    continue
            kept.append(t)
    return kept, imbalance


@dataclass
class P2PLateness:
    """Matched point-to-point messages (matching.P2PPairs) with their Late Sender wait, aligned."""

    send_node: np.ndarray  # node index of the sender
    recv_node: np.ndarray
    t_ns: np.ndarray  # the send started (aligned ns)
    late_sender_ns: np.ndarray  # the receiver waited this long for the send to start
    comm_id: np.ndarray | None = None  # with src, dst, recv_wait and recv_exit: who waited in which
    src: np.ndarray | None = None  # call, and when each process's waits ended (propagation)
    dst: np.ndarray | None = None
    recv_wait: np.ndarray | None = None  # the receiver began to wait (aligned ns)
    recv_exit: np.ndarray | None = None  # its receive completed (aligned ns)


def _p2p_instances(p: P2PLateness) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The waits of point to point as instances: (time, culprit node, receiving node, held-back ns).

    One instance per receiving call (a Recv, or a Wait/Waitall/Waitsome that completed several
    requests at once: their waits overlap, and the call waited for the latest sender only), held
    back by its longest Late Sender wait, whose sender is the culprit. Only the sender's own part
    counts: the time since the message it last received (before the send) was sent to it. A rank
    that waited for a stopped neighbour and then sent at once passes that lateness on, it did not
    cause it (Scalasca's propagation of Late Sender waits); a rank stopped inside its own receive,
    after the message had been sent, returns late by its own fault and keeps it."""
    n = len(p.t_ns)
    ls = np.clip(np.nan_to_num(p.late_sender_ns), 0, None)
    if p.comm_id is None or p.src is None or p.dst is None or p.recv_wait is None or p.recv_exit is None:
        return p.t_ns, p.send_node.astype(np.int64), p.recv_node.astype(np.int64), ls
    comm = p.comm_id.astype(np.uint64)
    # own part: send start - the sender process's last receive completion before it (same communicator)
    key_node = np.concatenate([p.recv_node, p.send_node]).astype(np.int64)
    key_comm = np.concatenate([comm, comm])
    key_rank = np.concatenate([p.dst, p.src]).astype(np.int64)
    tt = np.concatenate([np.nan_to_num(p.recv_exit, nan=np.inf), p.t_ns])
    is_send = np.arange(2 * n) >= n
    order = np.lexsort((is_send, tt, key_rank, key_comm, key_node))
    new = np.zeros(2 * n, bool)
    new[:1] = True
    for k in (key_node, key_comm, key_rank):
        ks = k[order]
        new[1:] |= ks[1:] != ks[:-1]
    start = np.maximum.accumulate(np.where(new, np.arange(2 * n), 0))
    last_recv = np.maximum.accumulate(np.where(~is_send[order], np.arange(2 * n), -1))
    has_prev = last_recv >= start
    # the sender stopped waiting for someone else when the message it last received was sent, not
    # when its receive returned: a process stopped inside its Recv returns late by its own fault
    free_from = np.concatenate([np.fmin(np.nan_to_num(p.recv_exit, nan=np.inf), p.t_ns), p.t_ns])
    prev_end = np.where(has_prev, free_from[order][np.maximum(last_recv, 0)], -np.inf)
    own = np.full(n, np.inf)
    sends = is_send[order]
    own[order[sends] - n] = (tt[order] - prev_end)[sends]
    own_held = np.minimum(ls, np.clip(own, 0, None))
    # one instance per receiving call: (node, communicator, rank, when it began to wait)
    wait_t = np.nan_to_num(p.recv_wait, nan=-1.0)
    order = np.lexsort((-ls, wait_t, p.dst, comm, p.recv_node))
    new = np.zeros(n, bool)
    new[:1] = True
    for k in (p.recv_node, comm, p.dst, wait_t):
        ks = k[order]
        new[1:] |= ks[1:] != ks[:-1]
    first = order[new]  # the longest wait of each call comes first
    first = first[np.isfinite(p.recv_wait[first])]  # a request never completed: no receiving call to judge
    return p.recv_wait[first], p.send_node[first].astype(np.int64), p.recv_node[first].astype(np.int64), own_held[first]


def _p2p_tests(p: P2PLateness, ci: int, n_nodes: int, err: np.ndarray, t0: float,
               params: StragglerParams) -> tuple[_CommStats, list[_Test], int]:
    """Point to point as one more communicator whose units are the nodes and whose instances are
    the receiving calls (_p2p_instances): a call held its receiver back by its longest Late Sender
    wait, the own part of its sender's lateness; the sending node is the culprit. The same tests as
    for collectives, against the node's share of the messages sent in the window."""
    t_i, sn_i, rn_i, ls_i = _p2p_instances(p)
    keep = np.isfinite(t_i)
    t_i, sn_i, rn_i, ls_i = t_i[keep], sn_i[keep], rn_i[keep], ls_i[keep]
    order = np.argsort(t_i, kind="stable")
    t, sn, rn, ls = t_i[order], sn_i[order], rn_i[order], ls_i[order]
    window_s = stretched_window_s(t, params.window_s, params.min_instances)
    win = np.maximum(np.floor((t - t0) / (window_s * 1e9)).astype(np.int64), 0)
    nw = int(win.max()) + 1
    # messages of the window by sender, for the chance of each node to be the culprit
    m_win = np.clip(np.floor((p.t_ns - t0) / (window_s * 1e9)).astype(np.int64), 0, nw - 1)
    m_ok = (p.send_node >= 0) & (p.recv_node >= 0) & (p.send_node != p.recv_node)
    ok = (sn >= 0) & (rn >= 0) & (sn != rn)  # messages inside one node say nothing of nodes
    n_w = np.bincount(win[ok], minlength=nw)
    judged = n_w >= params.min_instances
    clock = np.where(ok, err[np.clip(sn, 0, n_nodes - 1)] + err[np.clip(rn, 0, n_nodes - 1)], 0.0)
    floor = np.maximum(clock, params.p2p_min_wait_ns)
    event = ok & (ls > floor)
    lo = np.full(nw, np.inf)
    hi = np.full(nw, -np.inf)
    np.minimum.at(lo, win, t)
    np.maximum.at(hi, win, t)
    active = np.where(np.isfinite(lo), hi - lo, 0.0)
    unit = np.arange(n_nodes)
    culprit = np.where(ok & (ls > 0), sn, -1)
    st = _CommStats(ci, window_s, win, n_w, judged, np.full((nw, n_nodes), np.nan), np.full(nw, np.nan),
                    err.copy(), unit, ls, event, active, lo, hi, culprit, culprit, P2P_COMM)
    # the chance that a message with a long wait came from a node: its share of the messages sent
    sm = p.send_node[m_ok].astype(np.int64)
    sent = np.bincount(m_win[m_ok] * n_nodes + sm, minlength=nw * n_nodes).reshape(nw, n_nodes)
    share = sent / np.maximum(sent.sum(axis=1), 1)[:, None]
    # beyond the clock error between sender and receiver, and at least p2p_min_wait_ns
    tests = _unit_tests(ci, win, culprit, np.clip(ls - clock, 0, None), np.full(len(ls), params.p2p_min_wait_ns),
                        ok, share, judged, params)
    return st, tests, int(judged.sum()) * n_nodes


def _p2p_finding(tests: list[_Test], st: _CommStats, node_names: list[str], node_series: list[dict[str, Series]],
                 epoch_rt: int, p: StragglerParams) -> Finding:
    """A node whose messages held their receivers back (Late Sender) and that is no straggler at
    collectives. Its cause from the off-CPU time of its MPI threads against the other nodes'."""
    ni = tests[0].u
    ms = 1e6
    flagged = sorted({t.w for t in tests})
    wins = [(t.w * st.window_s, (t.w + 1) * st.window_s) for t in tests]
    most = max(tests, key=lambda t: (t.held_share, -t.w))
    ev = st.event & np.isin(st.win, flagged) & (st.culprit_unit == ni)
    f = Finding(
        node=node_names[ni], comm_id=0, ranks=[], cause="", kind="late sender", windows_flagged=len(flagged),
        windows_judged=int(st.judged.sum()), first_s=min(a for a, _ in wins), last_s=max(b for _, b in wins),
        times_last=int(ev.sum()), share_last=float(sum(t.k for t in tests) / max(1, sum(t.n for t in tests))),
        expected_share=float(np.mean([t.p0 for t in tests])),
        lateness_when_last_ns=float(np.median(st.held[ev])) if ev.any() else 0.0, score_min=None,
        score_reason="point to point: no compute interval between collectives", p_value=min(t.p for t in tests),
        q_value=min(t.q for t in tests), cost_ns=float(sum(t.held_ns for t in tests)),
        direct_cost_ns=float(sum(t.held_ns for t in tests)), cost_share=0.0,
        held_ns=float(sum(t.held_ns for t in tests)), held_share=most.held_share,
        next_held_share=most.held_share * (most.next_held_ns / most.held_ns) if most.held_ns > 0 else 0.0,
    )
    f.evidence.append(
        f"its messages held their receivers back (Late Sender) for {f.held_ns / ms:.1f} ms in {len(flagged)} of "
        f"{f.windows_judged} windows (up to {f.held_share:.1%} of a window's time in point to point, against "
        f"{f.next_held_share:.1%} for any other node), between t={f.first_s:.1f} s and t={f.last_s:.1f} s")
    best = min(tests, key=lambda t: t.p)
    f.evidence.append(
        f"sender of the longest wait in {best.k} of the {best.n} receiving calls that waited more than "
        f"{best.level_ns / ms:.3f} ms (its share of the messages sent: {best.p0:.1%}); exact binomial "
        f"p={_p(f.p_value)} (the smallest over {LEVELS} thresholds, x{LEVELS}), Benjamini-Hochberg q={_p(f.q_value)} "
        f"(threshold {p.fdr_q:g} over all units, windows and communicators); the own part of its lateness counts "
        f"(since the message it last received was sent): median {f.lateness_when_last_ns / ms:.3f} ms")
    a = np.array([st.span_lo[w] for w in flagged])
    b = np.array([st.span_hi[w] for w in flagged])
    f.evidence_spans = np.column_stack([a, b]).astype(np.float64).reshape(-1, 2)  # its stacks' windows
    rates: dict[str, list[float]] = {}
    for key in ("offcpu_blocked_ns", "offcpu_runnable_ns"):
        per_node = []
        for series in node_series:
            v = [_bins_mean(x, a, b, epoch_rt) for k, x in series.items() if k.startswith("pid") and k.endswith(key)]
            v = [x for x in v if np.isfinite(x)]
            per_node.append(float(np.mean(v)) if v else float("nan"))
        rates[key] = per_node
    blk = rates["offcpu_blocked_ns"][ni]
    rq = rates["offcpu_runnable_ns"][ni]
    peers_blk = [x for j, x in enumerate(rates["offcpu_blocked_ns"]) if j != ni and np.isfinite(x)]
    peers_rq = [x for j, x in enumerate(rates["offcpu_runnable_ns"]) if j != ni and np.isfinite(x)]
    blk_p = float(np.median(peers_blk)) if peers_blk else float("nan")
    rq_p = float(np.median(peers_rq)) if peers_rq else float("nan")
    f.metrics.update({k: v for k, v in (("blocked_ns_per_s", blk), ("blocked_ns_per_s_peers", blk_p),
                                        ("runnable_ns_per_s", rq), ("runnable_ns_per_s_peers", rq_p)) if np.isfinite(v)})
    stopped = np.isfinite(blk) and np.isfinite(blk_p) and blk - blk_p >= p.offcpu_min_ns_per_s and blk >= p.offcpu_ratio * blk_p
    starved = np.isfinite(rq) and np.isfinite(rq_p) and rq - rq_p >= p.offcpu_min_ns_per_s and rq >= p.runnable_ratio * rq_p
    gpus = any(k.startswith("gpu") for series in node_series for k in series)
    if stopped or starved:
        f.cause = "host"
        if stopped:
            f.evidence.append(f"its MPI threads were off CPU and not runnable (sleeping, or stopped by a signal) "
                              f"{blk / ms:.0f} ms/s vs other nodes {blk_p / ms:.0f} ms/s in the flagged windows")
        if starved:
            f.evidence.append(f"its MPI threads waited for a CPU (runnable, not running) {rq / ms:.0f} ms/s vs other "
                              f"nodes {rq_p / ms:.0f} ms/s in the flagged windows")
    elif not gpus:
        f.cause = "host"
        f.evidence.append("no GPU metrics on any node: the time before its sends was spent on the host")
    else:
        f.cause = "compute (unattributed)"
        f.evidence.append("no off-CPU or host metric differs from the other nodes enough to name a cause")
    return f


def _finding(tests: list[_Test], comms: list[CommSummary], blame: Blame, stats: dict[int, _CommStats],
             node_names: list[str], node_series: list[dict[str, Series]], epoch_rt: int, t0: float,
             total_wait: float, p: StragglerParams) -> Finding:
    # named in its widest communicator (the world where it is one), then by significance
    main = min(tests, key=lambda t: (-comms[t.ci].size, t.p, t.ci, t.w, t.r))
    ci, c, st = main.ci, comms[main.ci], stats[main.ci]
    ni = int(c.node_of_rank[main.r])
    on_main = [t for t in tests if t.ci == ci]
    ranks = sorted({r for t in on_main for r in t.ranks})
    most = max(on_main, key=lambda t: (t.held_share, -t.w))
    gids = blame.gids[ci]
    L = blame.waitee[gids]
    flagged = sorted({t.w for t in on_main})
    in_win = np.isin(st.win, flagged)
    mine = np.isin(L, ranks)
    ev = st.event & in_win & mine
    g_ev = gids[ev]
    # what made it late: the larger of the two parts the delay analysis put on it in its events
    own = float((st.held[ev] * blame.f_own[g_ev]).sum())
    kind = "exit delay" if float((st.held[ev] * blame.f_exit[g_ev]).sum()) > own else "own compute"
    roots = np.zeros(int(max(int(x.max()) for x in blame.procs if len(x))) + 1, bool)
    for t in tests:
        roots[blame.procs[t.ci][t.ranks]] = True
    direct, d = blame.propagate(roots)
    w = blame.wait_ns
    cost, direct_cost = float((w * d).sum()), float((w * direct).sum())
    prop_w = w * (d - direct)
    propagated: list[dict[str, Any]] = []
    hit = np.flatnonzero(prop_w > 0)
    for cj in np.unique(blame.comm[hit]):
        h = hit[blame.comm[hit] == cj]
        tot = float(prop_w[h].sum())
        # listed where it explains a part of that communicator's waiting (not the noise that the
        # split hands to every earlier wait) and of this root's cost
        comm_wait = float(w[blame.comm == cj].sum())
        if tot < PROPAGATED_MIN_COST * max(cost, 1e-9) or tot < PROPAGATED_MIN_WAIT * comm_wait:
            continue
        per_rank = np.bincount(blame.waitee[h], weights=prop_w[h], minlength=comms[int(cj)].size)
        top = [int(r) for r in np.argsort(-per_rank, kind="stable")[:8] if per_rank[r] > 0.01 * tot]
        nodes = [int(comms[int(cj)].node_of_rank[r]) for r in top]
        propagated.append({"comm_id": f"{comms[int(cj)].comm_id:#x}", "ranks": top,
                           "nodes": [node_names[x] if 0 <= x < len(node_names) else "?" for x in nodes],
                           "wait_ns": tot, "instances": len(h)})
    propagated.sort(key=lambda e: (-float(e["wait_ns"]), str(e["comm_id"])))
    wins = [(t.w * stats[t.ci].window_s, (t.w + 1) * stats[t.ci].window_s) for t in tests]
    sc = st.score[np.ix_(flagged, ranks)]
    finite = sc[np.isfinite(sc)]
    score_min = float(finite.min()) if len(finite) else None
    score_reason = "" if len(finite) else "no compute interval between this communicator's collectives on these ranks"
    f = Finding(
        node=node_names[ni] if 0 <= ni < len(node_names) else "?", comm_id=c.comm_id, ranks=ranks, cause="",
        kind=kind, windows_flagged=len(flagged), windows_judged=int(st.judged.sum()),
        first_s=min(a for a, _ in wins), last_s=max(b for _, b in wins),
        times_last=int(np.isin(c.last_rank, ranks).sum()),
        share_last=float(mine[in_win].mean()) if in_win.any() else 0.0, expected_share=len(ranks) / c.size,
        lateness_when_last_ns=float(np.median(blame.late_ns[g_ev])) if len(g_ev) else 0.0,
        score_min=score_min, score_reason=score_reason, p_value=min(t.p for t in tests),
        q_value=min(t.q for t in tests), cost_ns=cost, direct_cost_ns=direct_cost,
        cost_share=cost / total_wait if total_wait > 0 else 0.0,
        held_ns=float(sum(t.held_ns for t in on_main)), held_share=most.held_share,
        next_held_share=most.held_share * (most.next_held_ns / most.held_ns) if most.held_ns > 0 else 0.0,
        propagated=propagated, evidence_gids=g_ev,
        evidence_spans=np.array([[st.span_lo[w], st.span_hi[w]] for w in flagged], np.float64).reshape(-1, 2),
    )
    _evidence(f, tests, main, comms, blame, st, g_ev, ni, node_names, node_series, float(st.clock_floor[main.r]),
              epoch_rt, p)
    return f


DEVICE_EVIDENCE_MAX_INSTANCES = 512  # instances read for it: [instances x ranks] of one communicator


def _device_time_evidence(f: Finding, blame: Blame, times: Sequence[AlignedRows], p: StragglerParams) -> None:
    """NCCL on device times: a late kernel start whose host enqueue was late as well means the host
    reached the collective late (the GPU waited for work: host); an enqueue on time with the kernel
    starting late means the rank's GPU was still busy with its earlier work (GPU). This is the most
    direct evidence there is for an own-compute lateness, so it decides the cause of one; an exit
    delay (the kernel ended late) keeps its own rule."""
    g = f.evidence_gids
    if g is None or not len(g):
        return
    ci = int(blame.comm[g[0]])
    read_host = getattr(times[ci], "host_enter", None) if ci < len(times) else None
    if read_host is None:
        return
    if len(g) > DEVICE_EVIDENCE_MAX_INSTANCES:  # evenly spread, the same whatever the rank count
        g = g[np.linspace(0, len(g) - 1, DEVICE_EVIDENCE_MAX_INSTANCES).round().astype(np.int64)]
    H = read_host(blame.seq[g])
    if H is None:
        return
    L = blame.waitee[g]
    with quiet_nan():
        mine = H[np.arange(len(g)), L]
        enq = mine - np.nanmedian(H, axis=1)
    ok = np.isfinite(enq)
    if not ok.any():
        return
    ms = 1e6
    enq_late = float(np.median(enq[ok]))
    dev_late = float(np.median(blame.late_ns[g][ok]))
    f.metrics.update({"enqueue_late_ns": enq_late, "kernel_start_late_ns": dev_late,
                      "device_timed_instances": float(ok.sum())})
    if f.kind != "own compute":
        f.evidence.append(f"NCCL device times: its kernels started {dev_late / ms:.3f} ms after the median rank's, "
                          f"its host enqueued {enq_late / ms:+.3f} ms vs the median rank ({int(ok.sum())} instances)")
        return
    if dev_late > 0 and enq_late >= p.enqueue_share * dev_late:
        f.cause = "host"
        f.evidence.append(f"NCCL device times: the host enqueued the collective {enq_late / ms:.3f} ms after the median "
                          f"rank and its kernel started {dev_late / ms:.3f} ms late ({int(ok.sum())} instances): the "
                          "host reached the collective late, the GPU waited for it")
    else:
        f.cause = "gpu"
        f.evidence.append(f"NCCL device times: the host enqueued the collective on time ({enq_late / ms:+.3f} ms vs the "
                          f"median rank) but its kernel started {dev_late / ms:.3f} ms late ({int(ok.sum())} "
                          "instances): the rank's GPU was still busy with its earlier work")


def _on_cpu_evidence(f: Finding, tests: list[_Test], comms: list[CommSummary], stats: dict[int, _CommStats],
                     node_on_cpu: Sequence[dict[int, OnCpuBins]], epoch_rt: int) -> None:
    """Where the straggler's processes were on CPU in the flagged windows (CPU samples, innermost
    frame) against the other ranks of the communicator: a rank computing while its peers poll in
    MPI, or polling like them (then its lateness was not its compute)."""
    main = min(tests, key=lambda t: (-comms[t.ci].size, t.p, t.ci, t.w, t.r))
    c, st = comms[main.ci], stats[main.ci]
    windows = flagged_windows(tests, main)
    a = np.array([st.span_lo[w] for w in windows])
    b = np.array([st.span_hi[w] for w in windows])

    def merged(ranks: list[int]) -> tuple[int, list[tuple[str, float]]]:
        total, share = 0, dict[str, float]()
        for r in ranks:
            ni, pid = int(c.node_of_rank[r]), int(c.pid_of_rank[r])
            o = node_on_cpu[ni].get(pid) if 0 <= ni < len(node_on_cpu) else None
            if o is None:
                continue
            n, top = o.top(a, b, epoch_rt, n=len(o.labels))
            total += n
            for name, x in top:
                share[name] = share.get(name, 0.0) + x * n
        best = sorted(share.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        return total, [(k, v / total) for k, v in best] if total else []

    mine = set(f.ranks)
    n_me, top_me = merged(f.ranks)
    n_peer, top_peer = merged([r for r in range(c.size) if r not in mine])
    if not n_me:
        f.evidence.append("no CPU samples of its processes in the flagged windows (mode stacks, or a sealed file, "
                          "gives where it was on CPU)")
        return

    def fmt(top: list[tuple[str, float]]) -> str:
        return ", ".join(f"{x:.0%} {name}" for name, x in top)

    f.evidence.append(f"on CPU in the flagged windows ({n_me} samples, innermost frame): {fmt(top_me)}"
                      + (f"; the other ranks ({n_peer} samples): {fmt(top_peer)}" if n_peer else ""))
    f.metrics["cpu_samples"] = float(n_me)


NAMED_MIN_NS_PER_S = 10e6  # an excess in a phase or a kernel below this (1 % of the time) names none
NAMED_WORDS = {  # what: (evidence heading, the thing named, its unit of time)
    "phase": ("NVTX phases", "range", "the extra time"),
    "kernel": ("GPU kernels (CUPTI)", "kernel", "the extra GPU time"),
}


def _named_time_evidence(f: Finding, tests: list[_Test], comms: list[CommSummary], stats: dict[int, _CommStats],
                         per_node: Sequence[dict[int, NamedTimeBins]], epoch_rt: int, what: str) -> None:
    """The time of the straggler's processes in named intervals over its flagged windows against
    the other ranks' (median over ranks, per second): NVTX ranges (the phases users mark: forward,
    backward, optimizer) or the CUDA kernels that ran. The name with the largest excess is the
    finding's `phase` or `kernel`."""
    main = min(tests, key=lambda t: (-comms[t.ci].size, t.p, t.ci, t.w, t.r))
    c, st = comms[main.ci], stats[main.ci]
    windows = flagged_windows(tests, main)
    a = np.array([st.span_lo[w] for w in windows])
    b = np.array([st.span_hi[w] for w in windows])

    def rates(r: int) -> dict[str, float] | None:
        ni, pid = int(c.node_of_rank[r]), int(c.pid_of_rank[r])
        nb = per_node[ni].get(pid) if 0 <= ni < len(per_node) else None
        return None if nb is None else nb.rates(a, b, epoch_rt)

    mine = [x for x in (rates(r) for r in f.ranks) if x is not None]
    peers = [x for x in (rates(r) for r in range(c.size) if r not in set(f.ranks)) if x is not None]
    if not mine or not peers:
        return
    names = sorted({k for d in mine + peers for k in d} - {"(other ranges)", "(other kernels)"})
    excess = []
    for name in names:
        me = float(np.mean([d.get(name, 0.0) for d in mine]))
        peer = float(np.median([d.get(name, 0.0) for d in peers]))
        excess.append((me - peer, name, me, peer))
    if not excess:
        return
    excess.sort(key=lambda e: (-e[0], e[1]))
    ms = 1e6
    heading, thing, extra = NAMED_WORDS[what]
    top = ", ".join(f"{name} {me / ms:.0f} ms/s vs {peer / ms:.0f}" for _, name, me, peer in excess[:3])
    d, name, me, peer = excess[0]
    if d >= NAMED_MIN_NS_PER_S:
        setattr(f, what, name)
        f.metrics.update({f"{what}_ns_per_s": me, f"{what}_ns_per_s_peers": peer})
        f.evidence.append(f"{heading} in the flagged windows: {extra} went into {name!r} ({me / ms:.0f} ms/s vs the "
                          f"other ranks' median {peer / ms:.0f} ms/s); by {thing}: {top}")
    else:
        f.evidence.append(f"{heading} in the flagged windows: no {thing} took its processes >= "
                          f"{NAMED_MIN_NS_PER_S / ms:.0f} ms/s more than the other ranks ({top})")


def flagged_windows(tests: list[_Test], main: _Test) -> list[int]:
    return sorted({t.w for t in tests if t.ci == main.ci})


def _process_offcpu(c: CommSummary, ranks: list[int], st: _CommStats, windows: list[int],
                    node_series: list[dict[str, Series]], epoch_rt: int) -> dict[str, float]:
    """Blocked and runnable off-CPU time (ns/s) of the straggler's MPI threads and the median of the
    other ranks' over the flagged windows (the per-process series of loading._rank_thread_offcpu;
    NaN where a process has none)."""
    a = np.array([st.span_lo[w] for w in windows])
    b = np.array([st.span_hi[w] for w in windows])

    def rate(r: int, key: str) -> float:
        ni, pid = int(c.node_of_rank[r]), int(c.pid_of_rank[r])
        s = node_series[ni].get(f"pid{pid}:{key}") if 0 <= ni < len(node_series) else None
        return _bins_mean(s, a, b, epoch_rt) if s is not None else float("nan")

    out: dict[str, float] = {}
    mine = set(ranks)
    for key, name in (("offcpu_blocked_ns", "blocked_ns_per_s"), ("offcpu_runnable_ns", "runnable_ns_per_s")):
        me = [rate(r, key) for r in ranks]
        peers = [rate(r, key) for r in range(c.size) if r not in mine]
        me = [x for x in me if np.isfinite(x)]
        peers = [x for x in peers if np.isfinite(x)]
        out[name] = float(np.mean(me)) if me else float("nan")
        out[f"{name}_peers"] = float(np.median(peers)) if peers else float("nan")
    return out


def _peer_not_running(c: CommSummary, ranks: list[int], st: _CommStats, windows: list[int], node_names: list[str],
                      node_series: list[dict[str, Series]], epoch_rt: int, p: StragglerParams) -> str:
    """Why a late exit of `ranks` is a wait inside the collective, or '': another rank of the
    communicator (on another node) whose MPI threads were, in the flagged windows, off CPU and not
    runnable (stopped, sleeping) or on CPU far less than the others (held off it: run-queue time, a
    co-runner), by the same margins as a straggler's own evidence. A ring or tree collective returns
    on a rank only after the data of the others reached it."""
    ms = 1e6
    mine = set(ranks)
    nodes_mine = {int(c.node_of_rank[r]) for r in ranks}
    for r in range(c.size):
        if r in mine or int(c.node_of_rank[r]) in nodes_mine:
            continue
        off = _process_offcpu(c, [r], st, windows, node_series, epoch_rt)
        blk, blk_p, rq, rq_p = (off[k] for k in ("blocked_ns_per_s", "blocked_ns_per_s_peers", "runnable_ns_per_s",
                                                 "runnable_ns_per_s_peers"))
        if not all(np.isfinite(x) for x in (blk, blk_p, rq, rq_p)):
            continue
        stopped = blk - blk_p >= p.offcpu_min_ns_per_s and blk >= p.offcpu_ratio * blk_p
        on_cpu, on_cpu_p = 1e9 - blk - rq, 1e9 - blk_p - rq_p
        held_off = ((blk + rq) - (blk_p + rq_p) >= p.offcpu_min_ns_per_s and on_cpu_p > 0
                    and on_cpu <= p.peer_on_cpu_ratio * on_cpu_p)
        if stopped or held_off:
            what = (f"off CPU and not runnable {blk / ms:.0f} ms/s vs {blk_p / ms:.0f} ms/s" if stopped else
                    f"on CPU {on_cpu / ms:.0f} ms/s vs {on_cpu_p / ms:.0f} ms/s")
            ni = int(c.node_of_rank[r])
            where = f" ({node_names[ni]})" if 0 <= ni < len(node_names) else ""
            return (f"its collectives returned late while rank {r}{where} was not running "
                    f"({what} for the other ranks, off-CPU time of its MPI threads): a wait inside the "
                    "collective, not the network")
    return ""


def _p(x: float) -> str:
    """A p-value for the evidence; below the smallest double it is only bounded."""
    return f"{x:.2g}" if x > 0 else "<1e-300"


def _bins_mean(s: Series, a: np.ndarray, b: np.ndarray, epoch_rt: int) -> float:
    """Mean of a binned series over the bins that overlap any of the ranges [a, b) (aligned ns)."""
    if not len(s.values) or not len(a):
        return float("nan")
    v = s.values[bins_overlapping(s.t_rt, s.bin_ns, a, b, epoch_rt)]
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else float("nan")


def _gpu_series(series: dict[str, Series]) -> dict[int, Series]:
    """gpu index -> its activity series (SM activity where GPM gives it, else NVML utilization)."""
    out: dict[int, Series] = {}
    for suffix in (":util_gpu", ":sm_activity"):  # the second overrides
        for k, s in series.items():
            if k.startswith("gpu") and k.endswith(suffix) and k[3:-len(suffix)].isdigit():
                out[int(k[3:-len(suffix)])] = s
    return out


def _rank_gpu(comms: list[CommSummary], blame: Blame, ci: int, r: int, ni: int, n_gpus: int) -> int | None:
    """The rank's own GPU when the ranks of its node map one to one onto its GPUs (by local rank
    order in the largest communicator holding the process), else None."""
    proc = blame.procs[ci][r]
    best: tuple[int, int] | None = None
    for cj, c in enumerate(comms):
        hit = np.flatnonzero(blame.procs[cj] == proc)
        if len(hit) and (best is None or c.size > comms[best[0]].size):
            best = (cj, int(hit[0]))
    if best is None:
        return None
    cj, rr = best
    local = np.flatnonzero(np.asarray(comms[cj].node_of_rank) == ni)
    if len(local) != n_gpus or n_gpus == 0:
        return None
    return int(np.searchsorted(local, rr))


def _evidence(f: Finding, tests: list[_Test], main: _Test, comms: list[CommSummary], blame: Blame, st: _CommStats,
              g_ev: np.ndarray,
              ni: int, node_names: list[str], node_series: list[dict[str, Series]], clock_floor: float,
              epoch_rt: int, p: StragglerParams) -> None:
    ms = 1e6
    by_node = main.p0 * comms[main.ci].size > 1 or len(set(np.asarray(comms[main.ci].node_of_rank).tolist())) > 1
    f.evidence.append(
        f"held the other {'nodes' if by_node else 'ranks'} of the communicator back for "
        f"{f.held_ns / ms:.1f} ms in {f.windows_flagged} of {f.windows_judged} windows (up to {f.held_share:.1%} of "
        f"a window's time in collectives, against {f.next_held_share:.1%} for any other), between "
        f"t={f.first_s:.1f} s and t={f.last_s:.1f} s")
    f.evidence.append(
        f"the culprit of {main.k} of the {main.n} instances where the last one held the others back by more than "
        f"{main.level_ns / ms:.3f} ms (chance {main.p0:.1%} each); exact binomial p={_p(f.p_value)} (the smallest "
        f"over {LEVELS} thresholds, x{LEVELS}), Benjamini-Hochberg q={_p(f.q_value)} (threshold {p.fdr_q:g} over all "
        "units, windows and communicators)")
    f.evidence.append(
        f"median {f.lateness_when_last_ns / ms:.3f} ms after the median rank in those instances, "
        f"{main.effect_ns / ms:.3f} ms after the next {'node' if by_node else 'rank'} (the part it caused: not "
        f"propagated to it, not the algorithm's usual exit offset); the floor {main.floor_ns / ms:.3f} ms is "
        f"{p.min_effect:.0%} of the typical compute interval or the clock error {clock_floor / ms:.3f} ms"
        + (f"; slowness score {f.score_min:.2f} (1 = fastest)" if f.score_min is not None else
           f"; slowness score n/a: {f.score_reason}"))
    f.evidence.append(
        f"cost: {f.cost_ns / ms:.1f} ms of waiting of other ranks ({f.cost_share:.0%} of the job's waits in "
        f"synchronizing collectives), {f.direct_cost_ns / ms:.1f} ms directly and "
        f"{(f.cost_ns - f.direct_cost_ns) / ms:.1f} ms propagated"
        + (" (" + ", ".join(f"{e['wait_ns'] / ms:.1f} ms on {e['comm_id']} via ranks {e['ranks']}"
                            for e in f.propagated[:4]) + ")" if f.propagated else ""))
    others = sorted({f"{comms[t.ci].comm_id:#x}" for t in tests if t.ci != main.ci})
    if others:
        f.evidence.append("also the origin on communicator(s) " + ", ".join(others))
    ex = float(np.median(blame.exit_delay_ns[g_ev])) if len(g_ev) else 0.0
    asym = float(np.median(blame.asym_ns[g_ev])) if len(g_ev) else 0.0
    cx = float(np.median(blame.compute_excess_ns[g_ev])) if len(g_ev) else 0.0
    f.metrics.update({"exit_delay_ns": ex, "exit_asymmetry_ns": asym, "compute_excess_ns": cx,
                      "effect_ns": main.effect_ns, "effect_floor_ns": main.floor_ns,
                      "clock_floor_ns": clock_floor})
    off = _process_offcpu(comms[main.ci], f.ranks, st, flagged_windows(tests, main), node_series, epoch_rt)
    f.metrics.update({k: v for k, v in off.items() if np.isfinite(v)})
    blk, blk_p, rq, rq_p = (off[k] for k in ("blocked_ns_per_s", "blocked_ns_per_s_peers", "runnable_ns_per_s",
                                             "runnable_ns_per_s_peers"))
    stopped = bool(np.isfinite(blk) and np.isfinite(blk_p) and blk - blk_p >= p.offcpu_min_ns_per_s
                   and blk >= p.offcpu_ratio * blk_p)
    starved = bool(np.isfinite(rq) and np.isfinite(rq_p) and rq - rq_p >= p.offcpu_min_ns_per_s
                   and rq >= p.runnable_ratio * rq_p)
    off_note = []
    if stopped:
        off_note.append(f"its MPI threads were off CPU and not runnable (sleeping, or stopped by a signal) "
                        f"{blk / ms:.0f} ms/s vs peers {blk_p / ms:.0f} ms/s")
    if starved:
        off_note.append(f"its MPI threads waited for a CPU (runnable, not running) {rq / ms:.0f} ms/s vs peers "
                        f"{rq_p / ms:.0f} ms/s")
    # blocked: eBPF (bpf/offcpu.c); runnable: the kernel's per-thread run_delay, read by the collector
    where_off = " in the flagged windows (off-CPU time of the threads that call MPI)"
    if f.kind == "exit delay" and (stopped or starved):
        # a collective that returns late on a process that was not on a CPU: the host held it
        f.cause = "host"
        f.evidence.append(
            f"the previous collective returned {ex / ms:.3f} ms later on this rank than on the median rank, beyond "
            f"its usual exit offset ({asym / ms:.3f} ms), but " + " and ".join(off_note) + where_off
            + ": the process was not running, not the network")
        return
    if f.kind == "exit delay":
        peer = _peer_not_running(comms[main.ci], f.ranks, st, flagged_windows(tests, main), node_names, node_series,
                                 epoch_rt, p)
        if peer:
            # the collective returned late here because a peer it needed data from was not running:
            # a wait inside the collective, whose origin is that peer (its own finding, if it is one)
            f.explained_by_peer = peer
            return
        f.cause = "network"
        f.evidence.append(
            f"the previous collective returned {ex / ms:.3f} ms later on this rank than on the median rank, beyond "
            f"its usual exit offset ({asym / ms:.3f} ms, the collective's algorithm) and the clock error "
            f"({clock_floor / ms:.3f} ms), while its "
            f"compute interval was {cx / ms:+.3f} ms vs peers: arrivals were aligned, the collective was slower on "
            "this rank's path (network or collective)")
        return
    f.evidence.append(f"compute interval before the collective {cx / ms:+.3f} ms vs the median rank "
                      f"(previous collective returned {ex / ms:+.3f} ms vs its usual exit)")
    # the intervals before the late arrivals: from leaving the previous collective to entering
    a = blame.prev_exit[g_ev]
    b = blame.enter_ns[g_ev]
    own = node_series[ni] if 0 <= ni < len(node_series) else {}
    peers = [s for j, s in enumerate(node_series) if j != ni]

    def node_metric(series: dict[str, Series], key: str) -> float:
        s = [v for k, v in series.items() if k == key or k.endswith(key)]
        vals = [_bins_mean(x, a, b, epoch_rt) for x in s]
        vals = [v for v in vals if np.isfinite(v)]
        return float(np.mean(vals)) if vals else float("nan")

    def peer_median(key: str) -> float:
        v = [node_metric(s, key) for s in peers]
        v = [x for x in v if np.isfinite(x)]
        return float(np.median(v)) if v else float("nan")

    c_me, c_peer = node_metric(own, "host:cpu_cores"), peer_median("host:cpu_cores")
    o_me, o_peer = node_metric(own, "offcpu/intervals:runnable_ns"), peer_median("offcpu/intervals:runnable_ns")
    gpus = _gpu_series(own)
    g_rank = _rank_gpu(comms, blame, main.ci, main.r, ni, len(gpus))
    gpu_note = ""
    if g_rank is not None and g_rank < len(gpus):
        gid = sorted(gpus)[g_rank]
        g_me = _bins_mean(gpus[gid], a, b, epoch_rt)
        peer_g = [_bins_mean(s, a, b, epoch_rt) for j, ss in enumerate(node_series)
                  for gg, s in _gpu_series(ss).items() if not (j == ni and gg == gid)]
        gpu_note = f"its GPU {gid}"
    else:
        vals = [_bins_mean(s, a, b, epoch_rt) for s in gpus.values()]
        vals = [v for v in vals if np.isfinite(v)]
        g_me = float(np.mean(vals)) if vals else float("nan")
        peer_g = []
        for j, ss in enumerate(node_series):
            if j == ni:
                continue
            v = [_bins_mean(s, a, b, epoch_rt) for s in _gpu_series(ss).values()]
            v = [x for x in v if np.isfinite(x)]
            if v:
                peer_g.append(float(np.mean(v)))
        gpu_note = "the node's GPUs (mean; ranks do not map one to one onto GPUs)" if gpus else ""
    peer_g = [x for x in peer_g if np.isfinite(x)]
    g_peer = float(np.median(peer_g)) if peer_g else float("nan")
    f.metrics.update({"gpu_activity": g_me, "gpu_activity_peers": g_peer, "cpu_cores": c_me,
                      "cpu_cores_peers": c_peer, "offcpu": o_me, "offcpu_peers": o_peer,
                      "evidence_intervals": float(len(a))})
    dg = g_me - g_peer
    cpu_hi = bool(np.isfinite(c_me) and np.isfinite(c_peer) and c_peer > 0 and c_me / c_peer >= p.cpu_ratio)
    off_hi = bool(np.isfinite(o_me) and np.isfinite(o_peer) and o_peer > 0 and o_me / o_peer >= p.offcpu_ratio)
    where = f"in the {len(a)} intervals before its late arrivals"
    if np.isfinite(dg) and dg >= p.gpu_delta_points and not cpu_hi:
        f.cause = "gpu"
        f.evidence.append(f"GPU SM activity {g_me:.0f}% ({gpu_note}) vs peers {g_peer:.0f}% {where}: "
                          "longer GPU work before the collective")
        if np.isfinite(c_me):
            f.evidence.append(f"CPU {c_me:.2f} cores vs peers {c_peer:.2f}: host not busier")
    elif stopped or starved or cpu_hi or off_hi or (np.isfinite(dg) and dg <= -p.gpu_delta_points):
        f.cause = "host"
        if off_note:
            f.evidence.append("; ".join(off_note) + where_off)
        if cpu_hi:
            f.evidence.append(f"job processes used {c_me:.2f} CPU cores vs peers {c_peer:.2f} {where}")
        if off_hi:
            f.evidence.append(f"off-CPU / run-queue time {o_me / 1e6:.1f} ms/s vs peers {o_peer / 1e6:.1f} ms/s {where}")
        if np.isfinite(dg):
            f.evidence.append(f"GPU SM activity {g_me:.0f}% ({gpu_note}) vs peers {g_peer:.0f}%: "
                              "the GPU waited for the host")
    elif not np.isfinite(g_me) and not np.isfinite(g_peer) and cx > 0:
        # No GPU anywhere in the job: the longer compute interval can only have been spent on the host
        # (on its CPU, or blocked in it). Busy-polling MPI ranks keep their CPU busy while they wait,
        # so CPU use alone cannot tell the straggler from its peers here.
        f.cause = "host"
        f.evidence.append("no GPU metrics on any node: the longer compute interval ran on the host"
                          + (f" (job processes used {c_me:.2f} CPU cores vs peers {c_peer:.2f})"
                             if np.isfinite(c_me) and np.isfinite(c_peer) else ""))
    else:
        f.cause = "compute (unattributed)"
        f.evidence.append("no GPU or host metric differs from the peers enough to name a cause"
                          + ("" if np.isfinite(dg) else " (no GPU metrics on this node)")
                          + (f"; CPU {c_me:.2f} cores vs peers {c_peer:.2f}" if np.isfinite(c_me) and np.isfinite(c_peer)
                             else ""))
