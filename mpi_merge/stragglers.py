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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpi_merge.common import quiet_nan
from mpi_merge.loading import Series
from mpi_merge.matching import CommTable
from mpi_merge.waitstates import CommWaits


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


def window_metrics(t: CommTable, w: CommWaits, enter: np.ndarray, exit_: np.ndarray, window_s: float,
                   t0: float, min_instances: int = 1) -> tuple[RankWindowMetrics, dict[str, np.ndarray]]:
    comp = w.complete.copy()
    comp[0] = False  # the first instance has no predecessor
    prev_ok = np.concatenate([[False], w.complete[:-1]])
    use = comp & prev_ok
    k = np.flatnonzero(use)
    E, Xp, _Ep = enter[k], exit_[k - 1], enter[k - 1]
    with quiet_nan():
        med_xp = np.median(Xp, axis=1)
        a = E - med_xp[:, None]
        late = E - np.median(E, axis=1)[:, None]
        exit_excess = Xp - med_xp[:, None]
        comp_int = E - Xp
        compute_excess = comp_int - np.median(comp_int, axis=1)[:, None]
    tk = w.last_enter[k]
    window_s = stretched_window_s(tk, window_s, min_instances)
    win = np.floor((tk - t0) / (window_s * 1e9)).astype(np.int64) if len(k) else np.zeros(0, np.int64)
    nw = int(win.max()) + 1 if len(win) else 0
    size = t.size
    score = np.full((nw, size), np.nan)
    share = np.full((nw, size), np.nan)
    z = np.full((nw, size), np.nan)
    n = np.zeros(nw, np.int64)
    last = w.last_rank[k]
    p0 = 1.0 / size
    for i in range(nw):
        sel = win == i
        n[i] = int(sel.sum())
        if not n[i]:
            continue
        med = np.median(a[sel], axis=0)
        score[i] = np.min(med) / med
        cnt = np.bincount(last[sel], minlength=size)
        share[i] = cnt / n[i]
        z[i] = (share[i] - p0) / np.sqrt(p0 * (1 - p0) / n[i])
    per_inst = {"k": k, "win": win, "last": last, "lateness": late, "exit_excess": exit_excess,
                "compute_excess": compute_excess, "t": tk}
    per_inst["window_s"] = np.array(window_s)
    return RankWindowMetrics(t0 + np.arange(nw) * window_s * 1e9, score, share, z, n), per_inst


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
    comms: list[CommTable], waits: list[CommWaits], enter_al: list[np.ndarray], exit_al: list[np.ndarray],
    node_names: list[str], node_series: list[dict[str, Series]], epoch_rt: int, t0: float,
    params: StragglerParams = DEFAULT_STRAGGLER_PARAMS, detector: Detector = detect,
) -> tuple[list[Finding], dict[str, Any]]:
    findings: list[Finding] = []
    per_rank: dict[str, Any] = {}
    for t, w, E, X in zip(comms, waits, enter_al, exit_al):
        if t.size < 2 or w.complete.sum() < 2:
            continue
        m, inst = window_metrics(t, w, E, X, params.window_s, t0, params.min_instances)
        window_s = float(inst["window_s"])
        flags = detector(m, params)
        judged = m.n >= params.min_instances
        with quiet_nan():
            overall_score = np.nanmin(m.score[judged], axis=0) if judged.any() else np.full(t.size, np.nan)
        per_rank[f"{t.comm_id:#x}"] = {
            "score_min": [None if not np.isfinite(x) else float(x) for x in overall_score],
            "times_last": np.bincount(inst["last"], minlength=t.size).tolist(),
            "windows_judged": int(judged.sum()),
        }
        by_node: dict[int, list[int]] = {}
        for r in np.flatnonzero(flags.any(axis=0)):
            by_node.setdefault(int(t.node_of_rank[r]), []).append(int(r))
        for ni, ranks in sorted(by_node.items()):
            fw = flags[:, ranks].any(axis=1)
            sel_inst = np.isin(inst["win"], np.flatnonzero(fw)) & np.isin(inst["last"], ranks)
            in_win = np.isin(inst["win"], np.flatnonzero(fw))
            times_last = int(np.isin(inst["last"], ranks).sum())
            rl = ranks[0]
            ranges = [(float(m.t_start[i]), float(m.t_start[i] + window_s * 1e9)) for i in np.flatnonzero(fw)]
            f = Finding(
                node=node_names[ni] if ni >= 0 else "?", comm_id=t.comm_id, ranks=ranks, cause="",
                windows_flagged=int(fw.sum()), windows_judged=int(judged.sum()),
                first_s=(ranges[0][0] - t0) / 1e9, last_s=(ranges[-1][1] - t0) / 1e9, times_last=times_last,
                share_last=float(np.isin(inst["last"][in_win], ranks).mean()) if in_win.any() else 0.0,
                expected_share=len(ranks) / t.size,
                lateness_when_last_ns=float(np.median(inst["lateness"][sel_inst, rl])) if sel_inst.any() else 0.0,
                score_min=float(np.nanmin(m.score[fw][:, ranks])),
            )
            _attribute(f, inst, sel_inst, rl, ni, node_series, ranges, epoch_rt, params)
            findings.append(f)
    return findings, per_rank


def _attribute(f: Finding, inst: dict[str, np.ndarray], sel: np.ndarray, r: int, ni: int,
               node_series: list[dict[str, Series]], ranges: list[tuple[float, float]], epoch_rt: int,
               p: StragglerParams) -> None:
    ms = 1e6
    f.evidence.append(
        f"arrived last in {f.share_last:.0%} of instances in {f.windows_flagged} of {f.windows_judged} windows "
        f"(expected {f.expected_share:.0%}), between t={f.first_s:.1f} s and t={f.last_s:.1f} s; "
        f"median {f.lateness_when_last_ns / ms:.3f} ms after the median rank when last; "
        f"slowness score {f.score_min:.2f} (1 = fastest)"
    )
    ex = float(np.mean(inst["exit_excess"][sel, r])) if sel.any() else 0.0
    cx = float(np.mean(inst["compute_excess"][sel, r])) if sel.any() else 0.0
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
