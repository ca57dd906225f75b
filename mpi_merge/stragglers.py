"""Stragglers: a metric step (per rank and instance) then a detection step (per rank and time window),
then the cause from the evidence. Takes arrays; the detection algorithm is a parameter.

Metric step, per complete instance k and rank r (aligned times):
  arrival    a[k,r] = enter[k,r] - median_j exit[k-1,j]   time to arrive since the previous instance
  lateness   l[k,r] = enter[k,r] - median_j enter[k,j]
  exit_excess[k,r]  = exit[k-1,r] - median_j exit[k-1,j]  (the collective returned late here)
  compute_excess    = (enter[k,r]-exit[k-1,r]) - median_j (enter[k,j]-exit[k-1,j])
Detection, per window of window_s: NVIDIA's straggler detector score  min_j median(a_j) / median(a_r)
(1 = as fast as the fastest rank), and how much more often than 1/size the rank arrived last
(binomial z). A rank is a straggler in a window when score < score_threshold or z >= last_share_z.
Cause, over the instances where a flagged rank was last: exit excess dominating -> network /
collective; compute excess dominating -> GPU or host by the node's metrics against its peers.

The aligned times are read through AlignedRows, by blocks of instances (the per-instance medians),
by windows (the per-rank medians) and by single ranks (the evidence of a finding), so nothing of
size instances x ranks is held whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gpuprof.mpi_merge.common import block_rows, quiet_nan, row_blocks
from gpuprof.mpi_merge.loading import Series
from gpuprof.mpi_merge.waitstates import CommSummary


@dataclass(frozen=True)
class StragglerParams:
    window_s: float = 10.0
    score_threshold: float = 0.9
    last_share_z: float = 6.0
    # windows with fewer complete instances are not judged; a short job's windows are stretched to
    # hold this many (20 arrivals: a rank last every time has z = 7.7 at 4 ranks, chance cannot do it)
    min_instances: int = 20
    gpu_delta_points: float = 5.0  # SM activity this much above peers = GPU-bound evidence
    cpu_ratio: float = 1.25  # CPU use this much above peers = host-bound evidence
    algorithm: str = "score_or_last"  # "score", "last_share", "score_or_last"


DEFAULT_STRAGGLER_PARAMS = StragglerParams()


@dataclass
class RankWindowMetrics:
    t_start: np.ndarray  # [W] aligned ns
    score: np.ndarray  # [W, size]
    last_share: np.ndarray  # [W, size]
    last_z: np.ndarray  # [W, size]
    n: np.ndarray  # [W]


@dataclass
class Finding:
    node: str
    comm_id: int
    ranks: list[int]
    cause: str  # "gpu", "host", "network", "compute (unattributed)"
    windows_flagged: int
    windows_judged: int
    first_s: float
    last_s: float
    times_last: int
    share_last: float
    expected_share: float
    lateness_when_last_ns: float
    score_min: float
    evidence: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["comm_id"] = f"{self.comm_id:#x}"
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


class AlignedRows(Protocol):
    """Aligned enter and exit times (float ns from the epoch) of one communicator, read by seqs."""

    def enter(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        """[len(seqs), ranks]"""
        ...

    def exit(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        """[len(seqs), ranks]"""
        ...


@dataclass
class InstanceMetrics:
    """The metric step of one communicator, per instance k used (complete, after a complete one).
    The per-rank columns (lateness, exit and compute excess) are read for the ranks a finding names."""

    k: np.ndarray  # seqs used
    win: np.ndarray  # window of each
    last: np.ndarray  # rank that arrived last
    t: np.ndarray  # aligned ns of the last arrival
    window_s: float
    times: AlignedRows
    med_prev_exit: np.ndarray  # median over ranks of exit[k-1]
    med_enter: np.ndarray  # median over ranks of enter[k]
    med_interval: np.ndarray  # median over ranks of enter[k] - exit[k-1]

    def _col(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        one = slice(r, r + 1)
        return self.times.enter(self.k, one)[:, 0], self.times.exit(self.k - 1, one)[:, 0]

    def lateness(self, r: int) -> np.ndarray:
        """enter[k, r] - median_j enter[k, j]"""
        return self._col(r)[0] - self.med_enter

    def exit_excess(self, r: int) -> np.ndarray:
        """exit[k-1, r] - median_j exit[k-1, j]: the previous collective returned late on r"""
        return self._col(r)[1] - self.med_prev_exit

    def compute_excess(self, r: int) -> np.ndarray:
        """(enter[k, r] - exit[k-1, r]) - its median over ranks: r computed longer"""
        e, xp = self._col(r)
        return (e - xp) - self.med_interval


def window_metrics(c: CommSummary, times: AlignedRows, window_s: float, t0: float,
                   min_instances: int = 1) -> tuple[RankWindowMetrics, InstanceMetrics]:
    comp = c.complete.copy()
    comp[0] = False  # the first instance has no predecessor
    prev_ok = np.concatenate([[False], c.complete[:-1]])
    k = np.flatnonzero(comp & prev_ok)
    size = c.size
    # per instance: medians over ranks, a block of instances at a time
    med_xp, med_e, med_ci = (np.empty(len(k)) for _ in range(3))
    for b0, b1 in row_blocks(len(k), size):
        E, Xp = times.enter(k[b0:b1]), times.exit(k[b0:b1] - 1)
        with quiet_nan():
            med_xp[b0:b1] = np.median(Xp, axis=1)
            med_e[b0:b1] = np.median(E, axis=1)
            med_ci[b0:b1] = np.median(E - Xp, axis=1)
    tk = c.last_enter[k]
    window_s = stretched_window_s(tk, window_s, min_instances)
    win = np.floor((tk - t0) / (window_s * 1e9)).astype(np.int64) if len(k) else np.zeros(0, np.int64)
    nw = int(win.max()) + 1 if len(win) else 0
    score = np.full((nw, size), np.nan)
    share = np.full((nw, size), np.nan)
    z = np.full((nw, size), np.nan)
    last = c.last_rank[k]
    p0 = 1.0 / size
    # instances grouped by window (in seq order within one), windows read together up to a block
    order = np.argsort(win, kind="stable")
    bounds = np.searchsorted(win[order], np.arange(nw + 1))
    n = np.diff(bounds).astype(np.int64)
    w0 = 0
    while w0 < nw:
        w1 = w0 + 1
        while w1 < nw and bounds[w1 + 1] - bounds[w0] <= block_rows(size):
            w1 += 1
        pos = order[bounds[w0]:bounds[w1]]
        med = np.full((w1 - w0, size), np.nan)
        # a window longer than a block is read a few ranks at a time (medians are per rank)
        step = block_rows(len(pos))
        for r0 in range(0, size, step):
            ranks = slice(r0, min(size, r0 + step))
            arrival = times.enter(k[pos], ranks) - med_xp[pos][:, None]
            for i in range(w0, w1):
                if n[i]:
                    med[i - w0, ranks] = np.median(arrival[bounds[i] - bounds[w0]:bounds[i + 1] - bounds[w0]], axis=0)
        for i in range(w0, w1):
            if not n[i]:
                continue
            score[i] = np.min(med[i - w0]) / med[i - w0]
            cnt = np.bincount(last[order[bounds[i]:bounds[i + 1]]], minlength=size)
            share[i] = cnt / n[i]
            z[i] = (share[i] - p0) / np.sqrt(p0 * (1 - p0) / n[i])
        w0 = w1
    inst = InstanceMetrics(k, win, last, tk, window_s, times, med_xp, med_e, med_ci)
    return RankWindowMetrics(t0 + np.arange(nw) * window_s * 1e9, score, share, z, n), inst


Detector = Callable[[RankWindowMetrics, StragglerParams], np.ndarray]


def detect(m: RankWindowMetrics, p: StragglerParams) -> np.ndarray:
    """[W, size] bool: rank is a straggler in that window."""
    judged = (m.n >= p.min_instances)[:, None]
    by_score = np.nan_to_num(m.score, nan=1.0) < p.score_threshold
    by_last = np.nan_to_num(m.last_z) >= p.last_share_z
    if p.algorithm == "score":
        flag = by_score
    elif p.algorithm == "last_share":
        flag = by_last
    elif p.algorithm == "score_or_last":
        # A slow score alone does not make a straggler: the rank must also have held the others back,
        # i.e. been last more often than chance. (On a busy node every rank's arrival spreads, and the
        # score of ranks that are never last drops too.)
        size = m.score.shape[1] if m.score.ndim == 2 else 1
        held_back = np.nan_to_num(m.last_share) > 1.0 / max(size, 1)
        flag = (by_score & held_back) | by_last
    else:
        raise ValueError(f"unknown straggler algorithm {p.algorithm!r}")
    return flag & judged


def _series_mean(s: Series | None, ranges: list[tuple[float, float]], epoch_rt: int) -> float:
    """Mean of a binned series over ranges of aligned ns (bins start on the node's realtime clock:
    a few ms of clock error are nothing against 1 s bins)."""
    if s is None or not len(s.values):
        return float("nan")
    t = (s.t_rt - epoch_rt).astype(np.float64)
    sel = np.zeros(len(t), bool)
    for a, b in ranges:
        sel |= (t + s.bin_ns > a) & (t < b)
    v = s.values[sel]
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else float("nan")


def _node_metric(series: dict[str, Series], kind: str) -> list[Series]:
    if kind == "gpu":
        sm = [s for k, s in series.items() if k.endswith(":sm_activity")]
        return sm or [s for k, s in series.items() if k.endswith(":util_gpu")]
    if kind == "cpu":
        return [s for k, s in series.items() if k == "host:cpu_cores"]
    if kind == "offcpu":
        # Run-queue wait only: blocked time is highest on the early ranks, which block inside the
        # collective waiting for the straggler, so it would point at the wrong rank.
        return [s for k, s in series.items() if k.endswith("offcpu/intervals:runnable_ns")]
    return []


def _mean_over(series: list[Series], ranges: list[tuple[float, float]], epoch_rt: int) -> float:
    vals = [_series_mean(s, ranges, epoch_rt) for s in series]
    vals = [v for v in vals if np.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")


def find_stragglers(
    comms: list[CommSummary], times: Sequence[AlignedRows], node_names: list[str], node_series: list[dict[str, Series]],
    epoch_rt: int, t0: float, params: StragglerParams = DEFAULT_STRAGGLER_PARAMS, detector: Detector = detect,
) -> tuple[list[Finding], dict[str, Any]]:
    findings: list[Finding] = []
    per_rank: dict[str, Any] = {}
    for c, tm in zip(comms, times):
        if c.size < 2 or c.complete.sum() < 2:
            continue
        m, inst = window_metrics(c, tm, params.window_s, t0, params.min_instances)
        window_s = inst.window_s
        flags = detector(m, params)
        judged = m.n >= params.min_instances
        with quiet_nan():
            overall_score = np.nanmin(m.score[judged], axis=0) if judged.any() else np.full(c.size, np.nan)
        per_rank[f"{c.comm_id:#x}"] = {
            "score_min": [None if not np.isfinite(x) else float(x) for x in overall_score],
            "times_last": np.bincount(inst.last, minlength=c.size).tolist(),
            "windows_judged": int(judged.sum()),
        }
        by_node: dict[int, list[int]] = {}
        for r in np.flatnonzero(flags.any(axis=0)):
            by_node.setdefault(int(c.node_of_rank[r]), []).append(int(r))
        for ni, ranks in sorted(by_node.items()):
            fw = flags[:, ranks].any(axis=1)
            sel_inst = np.isin(inst.win, np.flatnonzero(fw)) & np.isin(inst.last, ranks)
            in_win = np.isin(inst.win, np.flatnonzero(fw))
            times_last = int(np.isin(inst.last, ranks).sum())
            rl = ranks[0]
            ranges = [(float(m.t_start[i]), float(m.t_start[i] + window_s * 1e9)) for i in np.flatnonzero(fw)]
            f = Finding(
                node=node_names[ni] if ni >= 0 else "?", comm_id=c.comm_id, ranks=ranks, cause="",
                windows_flagged=int(fw.sum()), windows_judged=int(judged.sum()),
                first_s=(ranges[0][0] - t0) / 1e9, last_s=(ranges[-1][1] - t0) / 1e9, times_last=times_last,
                share_last=float(np.isin(inst.last[in_win], ranks).mean()) if in_win.any() else 0.0,
                expected_share=len(ranks) / c.size,
                lateness_when_last_ns=float(np.median(inst.lateness(rl)[sel_inst])) if sel_inst.any() else 0.0,
                score_min=float(np.nanmin(m.score[fw][:, ranks])),
            )
            _attribute(f, inst, sel_inst, rl, ni, node_series, ranges, epoch_rt, params)
            findings.append(f)
    return findings, per_rank


def _attribute(f: Finding, inst: InstanceMetrics, sel: np.ndarray, r: int, ni: int,
               node_series: list[dict[str, Series]], ranges: list[tuple[float, float]], epoch_rt: int,
               p: StragglerParams) -> None:
    ms = 1e6
    f.evidence.append(
        f"arrived last in {f.share_last:.0%} of instances in {f.windows_flagged} of {f.windows_judged} windows "
        f"(expected {f.expected_share:.0%}), between t={f.first_s:.1f} s and t={f.last_s:.1f} s; "
        f"median {f.lateness_when_last_ns / ms:.3f} ms after the median rank when last; "
        f"slowness score {f.score_min:.2f} (1 = fastest)"
    )
    ex = float(np.mean(inst.exit_excess(r)[sel])) if sel.any() else 0.0
    cx = float(np.mean(inst.compute_excess(r)[sel])) if sel.any() else 0.0
    f.metrics.update({"exit_excess_ns": ex, "compute_excess_ns": cx})
    if ex > cx and ex > 0:
        f.cause = "network"
        f.evidence.append(
            f"the previous collective returned {ex / ms:.3f} ms later here than on the median rank while its "
            f"compute interval was {cx / ms:+.3f} ms vs peers: arrivals were aligned, the collective was slow "
            "on this node (network or collective)"
        )
        return
    f.evidence.append(f"compute interval before the collective {cx / ms:+.3f} ms vs the median rank "
                      f"(previous collective returned {ex / ms:+.3f} ms vs median)")
    own = node_series[ni] if ni >= 0 else {}
    peers = [s for j, s in enumerate(node_series) if j != ni]

    def compare(kind: str) -> tuple[float, float]:
        mine = _mean_over(_node_metric(own, kind), ranges, epoch_rt)
        theirs = [_mean_over(_node_metric(s, kind), ranges, epoch_rt) for s in peers]
        theirs = [x for x in theirs if np.isfinite(x)]
        return mine, (float(np.median(theirs)) if theirs else float("nan"))

    g_me, g_peer = compare("gpu")
    c_me, c_peer = compare("cpu")
    o_me, o_peer = compare("offcpu")
    f.metrics.update({"gpu_activity": g_me, "gpu_activity_peers": g_peer, "cpu_cores": c_me,
                      "cpu_cores_peers": c_peer, "offcpu": o_me, "offcpu_peers": o_peer})
    dg = g_me - g_peer
    cpu_hi = np.isfinite(c_me) and np.isfinite(c_peer) and c_peer > 0 and c_me / c_peer >= p.cpu_ratio
    off_hi = np.isfinite(o_me) and np.isfinite(o_peer) and o_peer > 0 and o_me / o_peer >= 1.5
    if np.isfinite(dg) and dg >= p.gpu_delta_points and not cpu_hi:
        f.cause = "gpu"
        f.evidence.append(f"GPU SM activity {g_me:.0f}% vs peers {g_peer:.0f}% in the same intervals: "
                          "longer GPU work before the collective")
        if np.isfinite(c_me):
            f.evidence.append(f"CPU {c_me:.2f} cores vs peers {c_peer:.2f}: host not busier")
    elif cpu_hi or off_hi or (np.isfinite(dg) and dg <= -p.gpu_delta_points):
        f.cause = "host"
        if cpu_hi:
            f.evidence.append(f"job processes used {c_me:.2f} CPU cores vs peers {c_peer:.2f}")
        if off_hi:
            f.evidence.append(f"off-CPU / run-queue time {o_me / 1e6:.1f} ms/s vs peers {o_peer / 1e6:.1f} ms/s")
        if np.isfinite(dg):
            f.evidence.append(f"GPU SM activity {g_me:.0f}% vs peers {g_peer:.0f}%: the GPU waited for the host")
    elif not np.isfinite(g_me) and not np.isfinite(g_peer) and cx > 0:
        # No GPU anywhere in the job: the longer compute interval before the collective can only have
        # been spent on the host (on its CPU, or blocked in it). Busy-polling MPI ranks keep their
        # CPU busy while they wait, so CPU use alone cannot tell the straggler from its peers here.
        f.cause = "host"
        f.evidence.append("no GPU metrics on any node: the longer compute interval ran on the host"
                          + (f" (job processes used {c_me:.2f} CPU cores vs peers {c_peer:.2f})"
                             if np.isfinite(c_me) and np.isfinite(c_peer) else ""))
    else:
        f.cause = "compute (unattributed)"
        f.evidence.append("no GPU or host metric differs from the peers enough to name a cause"
                          + ("" if np.isfinite(dg) else " (no GPU metrics on this node)"))
