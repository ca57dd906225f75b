"""Stragglers as root causes: the delay analysis (rootcause.py) splits every wait, then an exact test
per rank and window, false-discovery-rate control across the whole job, a minimum effect size, and
the cause from the evidence. Takes arrays; the detection algorithm is a parameter.

Per communicator and window of window_s (stretched so a window holds min_instances on average), per
rank r and kind (own excess compute; exit delay on the rank's path): k = the instances where r was the
last arrival and that kind dominated the split of the others' waits, out of n attributed instances.
Without a straggler the last arrival is any rank with chance 1/size, so the one-sided exact binomial
tail P(X >= k | n, 1/size) is a valid (conservative) p-value. Benjamini-Hochberg at fdr_q runs once
over every test of the job (ranks x windows x communicators x kinds). A rejected test is a finding
only when its effect is large enough: the rank's median lateness when it was the origin (own) or its
median exit delay (exit) exceeds both min_effect x the communicator's typical compute interval in that
window and the clock error between its node and the others (the clock models' uncertainty). Findings
are grouped per node; each names its root ranks, its cost (the waiting time of others it caused,
directly and propagated, and the share of the job's waits), the lateness it propagated into other
communicators (under "propagated"), and its evidence.

Score (NVIDIA's straggler detector, median ratio): min over ranks of the median compute interval
(enter[k] - exit[k-1] on the same rank: one node's clock, never negative) over this rank's median, in
[0, 1], 1 = as fast as the fastest; None with a reason where a window is not judged or the rank has
no compute interval (median 0). Arrival times since the previous instance's *median* exit are not
used: they can be <= 0, and a ratio of them is meaningless.

The aligned times are read through AlignedRows: by spans of instances in time order (the delay
analysis), by windows a few ranks at a time (the scores), never as an [instances x ranks] table.
The work is per communicator (baselines, scores, tests) and per span; the tests are combined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuprof.mpi_merge.common import block_rows, quiet_nan
from gpuprof.mpi_merge.loading import Series
from gpuprof.mpi_merge.rootcause import (
    KIND_EXIT,
    KIND_OWN,
    AlignedRows,
    Blame,
    benjamini_hochberg,
    binom_sf_many,
    delay_analysis,
)
from gpuprof.mpi_merge.waitstates import CommSummary

__all__ = [
    "DEFAULT_STRAGGLER_PARAMS",
    "AlignedRows",
    "Finding",
    "StragglerParams",
    "find_stragglers",
    "stretched_window_s",
    "window_scores",
]

ALGORITHMS = ("rootcause", "last_share", "score")
MAX_DRIFT = 500e-6  # the kernel's slew limit: a clock's error over one compute interval
PROPAGATED_MIN_COST = 0.01  # a communicator is listed under "propagated" with >= this share of the cost
PROPAGATED_MIN_WAIT = 0.2  # ... and >= this share of that communicator's own waits


@dataclass(frozen=True)
class StragglerParams:
    window_s: float = 10.0
    score_threshold: float = 0.9  # algorithm "score": the score must also be below this
    # windows with fewer attributed instances are not judged; a short job's windows are stretched to
    # hold this many
    min_instances: int = 20
    fdr_q: float = 0.01  # Benjamini-Hochberg false discovery rate over every test of the job
    min_effect: float = 0.05  # lateness when origin >= this share of the typical compute interval
    gpu_delta_points: float = 5.0  # SM activity this much above peers = GPU-bound evidence
    cpu_ratio: float = 1.25  # CPU use this much above peers = host-bound evidence
    offcpu_ratio: float = 1.5  # run-queue time this much above peers = host-bound evidence
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
    propagated: list[dict[str, Any]] = field(default_factory=list)  # {comm_id, ranks, wait_ns}
    evidence: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["comm_id"] = f"{self.comm_id:#x}"
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


def window_scores(c: CommSummary, times: AlignedRows, win_of_seq: np.ndarray, nw: int) -> tuple[np.ndarray, np.ndarray]:
    """Per window and rank, the median compute interval enter[k] - exit[k-1] (instances k complete
    after a complete one) and the median-ratio score; windows read together up to a block, a window
    longer than a block a few ranks at a time. Returns (score [nw, size] NaN where undefined,
    typical interval [nw]: the median over ranks of the per-rank medians)."""
    size = c.size
    prev_ok = np.concatenate([[False], c.complete[:-1]])
    k = np.flatnonzero(c.complete & prev_ok)
    win = win_of_seq[k]
    med = np.full((nw, size), np.nan)
    order = np.argsort(win, kind="stable")
    bounds = np.searchsorted(win[order], np.arange(nw + 1))
    n = np.diff(bounds)
    w0 = 0
    while w0 < nw:
        w1 = w0 + 1
        while w1 < nw and bounds[w1 + 1] - bounds[w0] <= block_rows(size):
            w1 += 1
        pos = order[bounds[w0]:bounds[w1]]
        if len(pos):
            step = block_rows(len(pos))
            for r0 in range(0, size, step):
                ranks = slice(r0, min(size, r0 + step))
                ci = times.enter(k[pos], ranks) - times.exit(k[pos] - 1, ranks)
                for i in range(w0, w1):
                    if n[i]:
                        med[i, ranks] = np.median(ci[bounds[i] - bounds[w0]:bounds[i + 1] - bounds[w0]], axis=0)
        w0 = w1
    with quiet_nan(), np.errstate(divide="ignore", invalid="ignore"):
        fastest = np.nanmin(np.where(med > 0, med, np.nan), axis=1)
        score = np.where(med > 0, fastest[:, None] / med, np.nan)
        typical = np.nanmedian(med, axis=1)
    return np.clip(score, 0.0, 1.0), typical


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
    events: dict[str, np.ndarray]  # kind -> bool per complete seq


@dataclass
class _Test:
    ci: int
    w: int
    r: int
    kind: str
    k: int
    n: int
    p: float
    q: float = 1.0
    effect_ns: float = 0.0
    floor_ns: float = 0.0


def _events(blame: Blame, gids: np.ndarray, algorithm: str) -> dict[str, np.ndarray]:
    att = blame.attributed[gids]
    if algorithm == "rootcause":
        kind = blame.kind[gids]
        return {"own compute": att & (kind == KIND_OWN), "exit delay": att & (kind == KIND_EXIT)}
    return {"last": att}


def _effect(blame: Blame, g: np.ndarray, kind: str) -> float:
    """The effect of a test's events: own compute -> the compute excess (measured on the rank's own
    clock, so a clock error cancels); exit delay -> the exit delay beyond the usual offset; last (the
    algorithms without the split) -> the lateness against the median rank."""
    if not len(g):
        return 0.0
    v = {"own compute": blame.compute_excess_ns, "exit delay": blame.exit_delay_ns}.get(kind, blame.late_ns)[g]
    return float(np.median(v))


def find_stragglers(
    comms: list[CommSummary], times: Sequence[AlignedRows], node_names: list[str], node_series: list[dict[str, Series]],
    epoch_rt: int, t0: float, params: StragglerParams = DEFAULT_STRAGGLER_PARAMS,
    clock_error_ns: np.ndarray | Sequence[float] | None = None,
) -> tuple[list[Finding], dict[str, Any]]:
    """Findings (root causes) and the per-communicator metrics. `clock_error_ns`: per node (index of
    node_names), the clock model's error; NaN or missing counts as 0."""
    if params.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown straggler algorithm {params.algorithm!r}")
    err = np.zeros(len(node_names))
    if clock_error_ns is not None and len(node_names):
        e = np.asarray(clock_error_ns, np.float64)[:len(node_names)]
        err[:len(e)] = np.where(np.isfinite(e) & (e > 0), e, 0.0)
    blame = delay_analysis(comms, times)
    stats: dict[int, _CommStats] = {}
    cands: list[_Test] = []
    m_total = 0
    per_comm: dict[str, Any] = {}
    for ci, c in enumerate(comms):
        seqs, gids = blame.seqs[ci], blame.gids[ci]
        if c.size < 2 or len(seqs) < 2:
            continue
        tk = c.last_enter[seqs]
        window_s = stretched_window_s(tk, params.window_s, params.min_instances)
        win_of_seq = np.zeros(c.n_seq, np.int64)
        win_of_seq[seqs] = np.floor((tk - t0) / (window_s * 1e9)).astype(np.int64)
        win_of_seq = np.maximum(win_of_seq, 0)
        win = win_of_seq[seqs]
        nw = int(win.max()) + 1
        att = blame.attributed[gids]
        n_w = np.bincount(win[att], minlength=nw)
        judged = n_w >= params.min_instances
        score, typical = window_scores(c, times[ci], win_of_seq, nw)
        node = np.asarray(c.node_of_rank, np.int64)
        e_rank = np.where(node >= 0, err[np.clip(node, 0, max(len(err) - 1, 0))] if len(err) else 0.0, 0.0)
        clock_floor = e_rank + float(np.median(e_rank))
        ev = _events(blame, gids, params.algorithm)
        st = _CommStats(ci, window_s, win, n_w, judged, score, typical, clock_floor, ev)
        stats[ci] = st
        L = blame.waitee[gids]
        for kind, sel in ev.items():
            cnt = np.bincount(win[sel] * c.size + L[sel], minlength=nw * c.size).reshape(nw, c.size)
            m_total += int(judged.sum()) * c.size
            wi, ri = np.nonzero(judged[:, None] & (cnt > 0))
            if not len(wi):
                continue
            p = binom_sf_many(cnt[wi, ri], n_w[wi], np.full(len(wi), 1.0 / c.size))
            for j in np.flatnonzero(p <= params.fdr_q):
                cands.append(_Test(ci, int(wi[j]), int(ri[j]), kind, int(cnt[wi[j], ri[j]]), int(n_w[wi[j]]), float(p[j])))
        with quiet_nan():
            judged_scores = score[judged]
            smin = np.nanmin(judged_scores, axis=0) if judged.any() else np.full(c.size, np.nan)
        origin = np.zeros(c.size, np.int64)
        for sel in ev.values():
            origin += np.bincount(L[sel], minlength=c.size)
        per_comm[f"{c.comm_id:#x}"] = {
            "score_min": [None if not np.isfinite(x) else float(x) for x in smin],
            "times_last": np.bincount(c.last_rank[c.last_rank >= 0], minlength=c.size).tolist(),
            "times_origin": origin.tolist(),
            "windows_judged": int(judged.sum()), "window_s": window_s,
        }
    rejected, qv = benjamini_hochberg(np.array([t.p for t in cands]), params.fdr_q, max(m_total, len(cands)))
    kept: list[_Test] = []
    for t, rej, q in zip(cands, rejected, qv):
        if not rej:
            continue
        t.q = float(q)
        st = stats[t.ci]
        c = comms[t.ci]
        sel = (st.win == t.w) & st.events[t.kind] & (blame.waitee[blame.gids[t.ci]] == t.r)
        t.effect_ns = _effect(blame, blame.gids[t.ci][sel], t.kind)
        typ = float(st.typical[t.w]) if np.isfinite(st.typical[t.w]) else 0.0
        # a compute excess is one node's clock against itself: only drift (<= 500 ppm of the interval)
        # enters, far below min_effect; times compared across nodes carry both nodes' clock errors
        clock = MAX_DRIFT * typ if t.kind == "own compute" else float(st.clock_floor[t.r])
        t.floor_ns = max(params.min_effect * typ, clock)
        if t.effect_ns <= t.floor_ns:
            continue
        if params.algorithm == "score":
            s = st.score[t.w, t.r]
            if not (np.isfinite(s) and s < params.score_threshold):
                continue
        kept.append(t)
    total_wait = float(blame.wait_ns.sum())
    by_node: dict[tuple[int, int], list[_Test]] = {}
    for t in kept:
        ni = int(comms[t.ci].node_of_rank[t.r])
        key = (ni, -1) if ni >= 0 else (len(node_names), int(blame.procs[t.ci][t.r]))
        by_node.setdefault(key, []).append(t)
    findings = [_finding(tests, comms, blame, stats, node_names, node_series, epoch_rt, t0, total_wait, params)
                for _, tests in sorted(by_node.items())]
    metrics: dict[str, Any] = dict(per_comm)
    shares = {name: float((blame.wait_ns * getattr(blame, f)).sum()) for name, f in
              (("own compute", "f_own"), ("exit delay", "f_exit"), ("exit asymmetry", "f_asym"), ("propagated", "f_prop"))}
    metrics["_summary"] = {
        "algorithm": params.algorithm, "fdr_q": params.fdr_q, "tests": m_total, "candidates": len(cands),
        "rejected": int(rejected.sum()), "kept_after_effect_size": len(kept), "findings": len(findings),
        "wait_ns_total": total_wait, "wait_ns_by_split": shares,
        "windows_judged": int(sum(int(s.judged.sum()) for s in stats.values())),
    }
    return findings, metrics


def _finding(tests: list[_Test], comms: list[CommSummary], blame: Blame, stats: dict[int, _CommStats],
             node_names: list[str], node_series: list[dict[str, Series]], epoch_rt: int, t0: float,
             total_wait: float, p: StragglerParams) -> Finding:
    # named in its widest communicator (the world where it is one), then by significance
    main = min(tests, key=lambda t: (-comms[t.ci].size, t.p, t.ci, t.w, t.r))
    ci, c, st = main.ci, comms[main.ci], stats[main.ci]
    ni = int(c.node_of_rank[main.r])
    on_main = [t for t in tests if t.ci == ci]
    ranks = sorted({t.r for t in on_main})
    by_kind: dict[str, int] = {}
    for t in on_main:
        by_kind[t.kind] = by_kind.get(t.kind, 0) + t.k
    kind = max(sorted(by_kind), key=lambda k: by_kind[k])
    gids = blame.gids[ci]
    L = blame.waitee[gids]
    flagged = sorted({t.w for t in on_main})
    in_win = np.isin(st.win, flagged)
    mine = np.isin(L, ranks)
    ev = st.events[kind] & in_win & mine
    g_ev = gids[ev]
    if kind == "last":  # algorithms without the split: the dominant part of the events decides
        kind = "exit delay" if float(blame.f_exit[g_ev].sum()) > float(blame.f_own[g_ev].sum()) else "own compute"
    roots = np.zeros(int(max(int(x.max()) for x in blame.procs if len(x))) + 1, bool)
    for t in tests:
        roots[blame.procs[t.ci][t.r]] = True
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
        cost_share=cost / total_wait if total_wait > 0 else 0.0, propagated=propagated,
    )
    _evidence(f, tests, main, comms, blame, g_ev, ni, node_series, float(st.clock_floor[main.r]), epoch_rt, p)
    return f


def _p(x: float) -> str:
    """A p-value for the evidence; below the smallest double it is only bounded."""
    return f"{x:.2g}" if x > 0 else "<1e-300"


def _bins_mean(s: Series, a: np.ndarray, b: np.ndarray, epoch_rt: int) -> float:
    """Mean of a binned series over the bins that overlap any of the ranges [a, b) (aligned ns; bins
    start on the node's realtime clock: its error is nothing against the bins)."""
    if not len(s.values) or not len(a):
        return float("nan")
    t = (s.t_rt - epoch_rt).astype(np.float64)
    lo = np.searchsorted(t + s.bin_ns, a, side="right")
    hi = np.searchsorted(t, b, side="left")
    mark = np.zeros(len(t) + 1, np.int64)
    ok = hi > lo
    np.add.at(mark, lo[ok], 1)
    np.add.at(mark, hi[ok], -1)
    sel = np.cumsum(mark[:-1]) > 0
    v = s.values[sel]
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


def _evidence(f: Finding, tests: list[_Test], main: _Test, comms: list[CommSummary], blame: Blame, g_ev: np.ndarray,
              ni: int, node_series: list[dict[str, Series]], clock_floor: float, epoch_rt: int,
              p: StragglerParams) -> None:
    ms = 1e6
    n_ev = sum(t.k for t in tests if t.ci == main.ci)
    n_all = sum(t.n for t in tests if t.ci == main.ci)
    f.evidence.append(
        f"origin of the others' wait ({f.kind}) in {n_ev} of {n_all} instances of the {f.windows_flagged} flagged "
        f"of {f.windows_judged} windows (chance {1 / comms[main.ci].size:.1%} each), between t={f.first_s:.1f} s and "
        f"t={f.last_s:.1f} s; exact binomial p={_p(f.p_value)}, Benjamini-Hochberg q={_p(f.q_value)} "
        f"(threshold {p.fdr_q:g} over all ranks, windows and communicators)")
    f.evidence.append(
        f"median {f.lateness_when_last_ns / ms:.3f} ms after the median rank when it was the origin; effect "
        f"{main.effect_ns / ms:.3f} ms ({'compute excess' if f.kind == 'own compute' else f.kind}) against a floor of "
        f"{main.floor_ns / ms:.3f} ms ({p.min_effect:.0%} of the typical compute interval"
        + (", on the rank's own clock)" if f.kind == "own compute" else f", or the clock error {clock_floor / ms:.3f} ms)")
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
    if f.kind == "exit delay":
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
    elif cpu_hi or off_hi or (np.isfinite(dg) and dg <= -p.gpu_delta_points):
        f.cause = "host"
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
