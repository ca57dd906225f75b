"""Clock alignment from matched collectives (docs/merge.md has the reasoning and the figures).

Input: per N-to-N instance and node, the latest enter, earliest exit and median exit of the node's
ranks, on each node's realtime clock (float ns from the job epoch). Output: per node an offset
function o(t) = node clock - reference clock, piecewise linear (offset + drift per segment), with a
residual, the number of points and the half-width of the causality interval as its uncertainty.

Method "minimal" (the default): the node's wall clock (what NTP/chrony gives) is the prior, and
the collectives are hard causality constraints (no rank leaves an N-to-N collective before the last
rank entered). Every constraint is a difference constraint between two nodes' corrections,
    d_a - d_b <= exit_a - enter_b      (node a's earliest exit, node b's latest enter, one instance)
so the feasible set is closed under componentwise min and max. Per piece of the job (a window of
`window_s`, split in halves where one constant correction cannot satisfy its instances because the
clocks drift within it):
  0. the target is the prior, except for a node whose instances in the piece are synchronous by
     construction (N-to-N NCCL on its kernels' device times, InstanceRows.synchronous): there it
     is the correction that makes their ends coincide (_exit_sync_target), clipped into the
     constraints like the prior (docs/merge.md, "NCCL on device times");
  1. relax from the target upwards and downwards (Bellman-Ford sweeps over the instances, through
     the top-two trick: O(instances x nodes) a sweep): the least feasible correction >= the target
     and the greatest <= the target; both satisfy every constraint, so their mean does, and it is
     the target itself whenever the target is feasible: a clock moves only as far as the data require
     (Scalasca's controlled logical clock, Becker et al., applied to the clock model instead of to
     the events). A piece that does not converge within nodes sweeps holds a cycle of constraints
     no correction satisfies: its data are inconsistent, it keeps the prior and the report says so;
  2. per node, its error interval: the range of corrections the constraints allow with the
     reference fixed (relaxation from -inf and +inf), not a statistic of the estimate; a node with no
     constraint in a piece keeps the prior there and its model says so (unconstrained spans). The
     intervals reported with the final model are its points' own (_knot_intervals: the instances
     around each point moved to its time by the drift bound), which hold the truth also where a
     clock drifts inside a piece;
  3. the pieces' corrections joined as a piecewise-linear model whose drift is bounded by the
     kernel's slew limit (|drift| <= 500 ppm): the points are clipped into the tube that the bound
     leaves around the intervals; when no such tube exists the data ask for more than 500 ppm and
     the model says so. Steps 1-3 are repeated against the current model (evaluated at each
     instance, so the drift it already has is removed before the next constant is fitted);
  4. the exact last step (_repair_exact): constants joined linearly cannot follow a slewing clock
     within the microseconds that matched messages allow, so the intervals of the model that still
     hold an instance out of order get more knots, and each run of them is solved as a linear
     program (HiGHS): the knot values nearest the model's (L1) that keep every instance there in
     order with |drift| <= 500 ppm; a run with no solution is grown up to the whole model. Only what
     no clock within the slew limit can put in order is called inconsistent (and stays counted).
After alignment no instance violates causality beyond `violation_tol_ns` unless the data contradict
every physical clock (counted and reported).

Method "bounds" (the previous default, kept for comparison), per window of `window_s`:
  1. start from the exit-synchronous estimate (all ranks leave an N-to-N collective at about the same
     instant): a median polish of exit times over instances x nodes, per window;
  2. clip it into each window's feasible interval against the others' current offsets;
  3. fit line segments to the window estimates greedily.
It invents offsets where the data do not pin them (exit asymmetries of MPI algorithms read as clock
offsets): on real recordings of one host it moved clocks by milliseconds.

The naive methods (none, constant, start_end, exit_median) are the same function with another
`method`, so the benchmark compares them on identical data.

The input is read by rows (InstanceRows): in memory (NodeInstances) or from the merge's scratch
file (matching.InstanceTable). Every pass holds one block of about BLOCK_CELLS instance x node
cells; what stays in memory is per instance (its time) and per window and node (the estimates).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from gpuprof.mpi_merge.common import (
    SerialSpread,
    Spread,
    block_rows,
    nanmedian_rows,
    nanquantile_cols,
    nanquantile_groups,
    quiet_nan,
    row_blocks,
)

METHODS = ("minimal", "bounds", "bounds_center", "exit_median", "start_end", "constant", "none")
MAX_DRIFT_PPM = 500.0  # the kernel slews a clock by at most 500 ppm (adjtimex)


@dataclass(frozen=True)
class ClockParams:
    method: str = "minimal"
    window_s: float = 2.0
    min_points: int = 8  # windows with fewer instances are merged into their neighbour
    max_bound_width_us: float = 200.0
    iterations: int = 4
    max_iterations: int = 16  # "minimal": more rounds while instances are still out of order
    segment_tol_us: float | None = None  # None: 4 x the noise of the window estimates, at least 1 us
    start_end_points: int = 100  # instances at each end for the Score-P-like start/end method
    # A low quantile of a node's exit differences, not the median: exit delays are never negative,
    # so a node whose collective returns late in up to 75% of the instances does not move it. The
    # quantile's own bias is the same on every node (identical jitter) and cancels against the
    # reference.
    exit_quantile: float = 0.25
    max_drift_ppm: float = MAX_DRIFT_PPM
    violation_tol_ns: float = 1000.0  # an aligned exit this far before the last enter is a violation


DEFAULT_CLOCK_PARAMS = ClockParams()


@dataclass
class NodeClockModel:
    node: str
    aligned: bool
    reason: str  # why not aligned ('' when aligned)
    seg_start: np.ndarray  # float ns from the epoch (node clock), first segment extends to -inf
    seg_offset: np.ndarray  # ns at seg_start
    seg_drift_ppm: np.ndarray
    residual_ns: float = float("nan")
    n_points: int = 0
    uncertainty_ns: float = float("nan")  # median half-width of the causality interval
    is_reference: bool = False
    # "minimal": per model point (seg_start), the interval of offsets the constraints allow
    # (-inf / +inf where a side is not constrained); empty for the other methods
    point_lo: np.ndarray = field(default_factory=lambda: np.zeros(0))
    point_hi: np.ndarray = field(default_factory=lambda: np.zeros(0))
    unconstrained_spans: list[tuple[float, float]] = field(default_factory=list)  # node clock ns, prior kept
    inconsistent: str = ""  # why the data contradict every model of this node ('' when they do not)
    drift_note: str = ""  # where this model itself drifts beyond the slew limit, and why
    max_drift_ppm: float = MAX_DRIFT_PPM

    def offset_ns(self, t: np.ndarray | float) -> np.ndarray:
        """node clock - reference clock (ns) at node-clock time t (float ns from the epoch)."""
        tt = np.asarray(t, dtype=np.float64)
        if not len(self.seg_start):
            return np.zeros_like(tt)
        i = np.clip(np.searchsorted(self.seg_start, tt, side="right") - 1, 0, len(self.seg_start) - 1)
        return self.seg_offset[i] + self.seg_drift_ppm[i] * 1e-6 * (tt - self.seg_start[i])

    def align(self, t: np.ndarray) -> np.ndarray:
        return np.asarray(t, dtype=np.float64) - self.offset_ns(t)

    @property
    def mean_drift_ppm(self) -> float:
        return float(np.mean(self.seg_drift_ppm)) if len(self.seg_drift_ppm) else 0.0

    def interval_ns(self, t: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """The offsets at node-clock time t that the constraints allow: between model points, each
        point's interval widened by the drift bound over the distance to it, the tighter of the two
        neighbours taken. (-inf, +inf) where nothing constrains the node; (offset, offset) for the
        reference; (NaN, NaN) for the methods that keep no intervals."""
        tt = np.asarray(t, dtype=np.float64)
        if self.is_reference:
            o = self.offset_ns(tt)
            return o, o.copy()
        if not len(self.point_lo):
            nan = np.full_like(tt, np.nan)
            return nan, nan.copy()
        s = self.max_drift_ppm * 1e-6
        i = np.clip(np.searchsorted(self.seg_start, tt, side="right") - 1, 0, len(self.seg_start) - 1)
        j = np.minimum(i + 1, len(self.seg_start) - 1)
        with np.errstate(invalid="ignore"):
            di, dj = np.abs(tt - self.seg_start[i]) * s, np.abs(self.seg_start[j] - tt) * s
            lo = np.fmax(self.point_lo[i] - di, self.point_lo[j] - dj)
            hi = np.fmin(self.point_hi[i] + di, self.point_hi[j] + dj)
        return lo, hi


@dataclass
class ClockFit:
    reference: str
    method: str
    models: list[NodeClockModel]
    components: list[list[str]]
    causality_violations: int = 0
    instances_used: int = 0
    notes: list[str] = field(default_factory=list)

    def model(self, node: str) -> NodeClockModel:
        for m in self.models:
            if m.node == node:
                return m
        raise KeyError(node)


class InstanceRows(Protocol):
    """Per N-to-N instance (row) and node (column): the latest enter, earliest exit and median exit
    of the node's ranks, raw float ns from the epoch, NaN where the node took no part. Read by rows."""

    @property
    def n_rows(self) -> int: ...

    @property
    def n_cols(self) -> int: ...

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(enter_max, exit_min, exit_med) of the given rows, each [len(rows), n_cols]."""
        ...

    def synchronous(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] bool: the rows whose exits are synchronous by construction (N-to-N NCCL
        collectives on their kernels' device times), which the minimal fit aims at (EXIT_SYNC_MIN_ROWS)."""
        ...


def _chunked_take(src: InstanceRows, rows: np.ndarray,
                  reduce: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """reduce(src.take(chunk)) over chunks of rows small enough for src's width, concatenated: a view
    with fewer columns than its source reads no more than a block of the source at a time."""
    step = block_rows(src.n_cols)
    parts = [reduce(*src.take(rows[i:i + step])) for i in range(0, len(rows), step)]
    if not parts:
        return reduce(*src.take(rows))
    return tuple(np.concatenate([p[j] for p in parts]) for j in range(3))  # type: ignore[return-value]


@dataclass
class _Subset:
    """Rows `rows` (in that order) and columns `cols` of another source."""

    src: InstanceRows
    rows: np.ndarray
    cols: list[int] | None = None

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    @property
    def n_cols(self) -> int:
        return self.src.n_cols if self.cols is None else len(self.cols)

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.cols is None:
            return self.src.take(self.rows[rows])
        cols = self.cols
        return _chunked_take(self.src, self.rows[rows], lambda E, Xn, Xm: (E[:, cols], Xn[:, cols], Xm[:, cols]))

    def synchronous(self, rows: np.ndarray) -> np.ndarray:
        return self.src.synchronous(self.rows[rows])


@dataclass
class _Collapsed:
    """Columns of another source merged by group (nodes that read one clock)."""

    src: InstanceRows
    groups: list[list[int]]

    @property
    def n_rows(self) -> int:
        return self.src.n_rows

    @property
    def n_cols(self) -> int:
        return len(self.groups)

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        def collapse(E: np.ndarray, Xn: np.ndarray, Xm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            with quiet_nan():
                return (np.column_stack([np.nanmax(E[:, g], axis=1) for g in self.groups]),
                        np.column_stack([np.nanmin(Xn[:, g], axis=1) for g in self.groups]),
                        np.column_stack([np.nanmedian(Xm[:, g], axis=1) for g in self.groups]))

        return _chunked_take(self.src, rows, collapse)

    def synchronous(self, rows: np.ndarray) -> np.ndarray:
        return self.src.synchronous(rows)


def _all(k0: int, k1: int) -> np.ndarray:
    return np.arange(k0, k1)


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        p = self.parent
        while p[x] != x:
            p[x] = p[p[x]]
            x = p[x]
        return x

    def join_pattern(self, row: np.ndarray) -> None:
        idx = np.flatnonzero(row)
        for j in idx[1:]:
            a, b = self.find(int(idx[0])), self.find(int(j))
            if a != b:
                self.parent[b] = a

    def groups(self, members: np.ndarray) -> list[list[int]]:
        out: dict[int, list[int]] = {}
        for i in np.flatnonzero(members):
            out.setdefault(self.find(int(i)), []).append(int(i))
        return sorted(out.values(), key=lambda g: g[0])


def components(present: np.ndarray) -> list[list[int]]:
    """Groups of nodes connected by shared instances (union-find over instance rows)."""
    uf = _UnionFind(present.shape[1])
    # one representative pair per distinct participation pattern is enough
    for row in np.unique(present, axis=0) if len(present) else ():
        uf.join_pattern(row)
    return uf.groups(np.asarray(present.any(axis=0)))


@dataclass
class _Presence:
    points: np.ndarray  # [n_cols] instances each node took part in
    useful: int  # instances with at least two nodes (the others tell nothing about clocks)
    components: list[list[int]]  # nodes connected by useful instances


def _presence(inst: InstanceRows) -> _Presence:
    """One pass over the rows: what components() and the point counts need."""
    n = inst.n_cols
    points = np.zeros(n, np.int64)
    in_useful = np.zeros(n, bool)
    useful = 0
    uf = _UnionFind(n)
    for k0, k1 in row_blocks(inst.n_rows, n):
        E, _, Xm = inst.take(_all(k0, k1))
        present = np.isfinite(Xm) | np.isfinite(E)  # a message row has one side per node
        points += present.sum(axis=0)
        ok = present.sum(axis=1) >= 2
        useful += int(ok.sum())
        in_useful |= present[ok].any(axis=0)
        for row in np.unique(present[ok], axis=0) if ok.any() else ():
            uf.join_pattern(row)
    return _Presence(points, useful, uf.groups(in_useful))


def fit_clocks(
    inst: InstanceRows, node_names: list[str], reference: str, params: ClockParams = DEFAULT_CLOCK_PARAMS,
    clock_domains: list[str] | None = None, spread: Spread | None = None,
) -> ClockFit:
    """Per node clock models against the reference node.

    spread: the merge's ranks, over which the minimal fit deals its windows (every rank calls this
    with the same arguments and gets the same result; None: all here).

    clock_domains (one per node, e.g. the boot id): nodes that read the same clock (several virtual
    Slurm nodes on one host share CLOCK_MONOTONIC and CLOCK_REALTIME) are one clock. Their offset to
    each other is zero by construction, not by estimate, and they are fitted as one column, so the
    estimate between hosts uses every rank of both."""
    if clock_domains is not None and len(set(clock_domains)) < len(clock_domains):
        return _fit_by_domain(inst, node_names, reference, params, clock_domains, spread)
    if params.method not in METHODS:
        raise ValueError(f"unknown clock method {params.method!r}; one of {METHODS}")
    n_nodes = len(node_names)
    pres = _presence(inst)
    comps = pres.components
    ref = node_names.index(reference)
    ref_comp = next((g for g in comps if ref in g), None)
    models: list[NodeClockModel] = []
    fit = ClockFit(reference, params.method, models, [[node_names[i] for i in g] for g in comps],
                   instances_used=pres.useful)
    empty = np.zeros(0)
    by_node: dict[int, NodeClockModel] = {}
    if ref_comp is None:
        if n_nodes > 1:  # one node (or one clock, collapsed) has nothing to align with
            fit.notes.append(f"reference node {reference} shares no collective with any other node")
    else:
        # the useful instances of the reference's component (a useful instance lies in one component)
        rows = []
        for k0, k1 in row_blocks(inst.n_rows, n_nodes):
            E, _, Xm = inst.take(_all(k0, k1))
            present = np.isfinite(Xm) | np.isfinite(E)  # a message row has one side per node
            hit = (present.sum(axis=1) >= 2) & present[:, ref_comp].any(axis=1)
            rows.append(np.flatnonzero(hit) + k0)
        sub = _Subset(inst, np.concatenate(rows), ref_comp)
        res = _fit_component(sub, ref_comp.index(ref), params, spread)
        for j, ni in enumerate(ref_comp):
            m = res[j]
            m.node = node_names[ni]
            m.is_reference = ni == ref
            by_node[ni] = m
        fit.causality_violations = _violations(sub, [res[j] for j in range(len(ref_comp))],
                                               params.violation_tol_ns, spread)
    for ni in range(n_nodes):
        if ni in by_node:
            models.append(by_node[ni])
            continue
        if ni == ref:  # the reference is its own clock, partner or not
            models.append(NodeClockModel(node_names[ni], True, "", np.zeros(1), np.zeros(1), np.zeros(1), 0.0,
                                         int(pres.points[ni]), 0.0, is_reference=True))
            continue
        if not pres.points[ni]:
            why = "no N-to-N collective instance on this node (nothing to align with)"
        else:
            why = (f"shares no collective with the reference node {reference} (disjoint communicators); "
                   "its times stay on its own realtime (NTP) clock")
        models.append(NodeClockModel(node_names[ni], False, why, empty, empty, empty,
                                     n_points=int(pres.points[ni])))
    return fit


def _fit_by_domain(inst: InstanceRows, node_names: list[str], reference: str, params: ClockParams,
                   clock_domains: list[str], spread: Spread | None = None) -> ClockFit:
    groups: dict[str, list[int]] = {}
    for i, d in enumerate(clock_domains):
        groups.setdefault(d, []).append(i)
    doms = list(groups.values())
    rep = [node_names[g[0]] for g in doms]
    ref_dom = next(k for k, g in enumerate(doms) if node_names.index(reference) in g)
    sub = fit_clocks(_Collapsed(inst, doms), rep, rep[ref_dom], params, spread=spread)
    pres = _presence(inst)
    by_rep = {m.node: m for m in sub.models}
    models: list[NodeClockModel] = []
    for k, g in enumerate(doms):
        for i in g:
            m = by_rep[rep[k]]
            models.append(NodeClockModel(node_names[i], m.aligned, m.reason, m.seg_start, m.seg_offset,
                                         m.seg_drift_ppm, m.residual_ns, int(pres.points[i]), m.uncertainty_ns,
                                         is_reference=node_names[i] == reference))
    models.sort(key=lambda m: node_names.index(m.node))
    fit = ClockFit(reference, params.method, models,
                   [[node_names[i] for k in comp for i in doms[rep.index(k)]] for comp in sub.components],
                   sub.causality_violations, pres.useful, list(sub.notes))
    for g in doms:
        if len(g) > 1:
            bad = _violations(_Subset(inst, np.arange(inst.n_rows), g), [_IDENTITY] * len(g), params.violation_tol_ns,
                              spread)
            agree = ("their collectives agree" if not bad else
                     f"but their data DISAGREE: in {bad} instance(s) a rank left before another entered on "
                     "that one clock (timestamps of one node are off: check its collector)")
            fit.notes.append(f"{', '.join(node_names[i] for i in g)} read one clock (same host and boot id): "
                             f"zero offset between them by construction; {agree}")
    return fit


_IDENTITY = NodeClockModel("", True, "", np.zeros(1), np.zeros(1), np.zeros(1))  # no correction


def _window_index(t: np.ndarray, window_ns: float, min_points: int) -> tuple[np.ndarray, int]:
    """Window number of each instance; thin windows merged forward so each has >= min_points."""
    w = np.floor((t - t.min()) / window_ns).astype(np.int64)
    uniq, counts = np.unique(w, return_counts=True)
    remap = np.empty(len(uniq), np.int64)
    cur, acc = 0, 0
    for i, c in enumerate(counts):
        remap[i] = cur
        acc += c
        if acc >= min_points:
            cur, acc = cur + 1, 0
    if acc and cur > 0:  # a thin tail joins the last full window
        remap[remap == cur] = cur - 1
    nw = int(remap.max()) + 1
    return remap[np.searchsorted(uniq, w)], nw


def _group_reduce(vals: np.ndarray, win: np.ndarray, nw: int, how: str, q: float = 0.5) -> np.ndarray:
    """Per window and column: nanmin / nanmax / nanmedian / nanquantile of vals[k, a] (k sorted by window).
    Identical to numpy's nan-functions per window, but vectorized over the columns and the windows
    (the clock fit's hot spot: numpy's nanquantile loops over columns in Python)."""
    out = np.full((nw, vals.shape[1]), np.nan)
    bounds = np.searchsorted(win, np.arange(nw + 1))
    nonempty = bounds[1:] > bounds[:-1]
    if how in ("min", "max") and nonempty.any():
        # fmin/fmax ignore NaN as nanmin/nanmax do; all-NaN stays NaN
        red = np.fmin if how == "min" else np.fmax
        starts = bounds[:-1][nonempty]
        out[nonempty] = red.reduceat(vals, starts, axis=0)
        return out
    qq = 0.5 if how == "median" else q
    together = nanquantile_groups(vals, bounds, qq)
    if together is not None:
        return together
    for i in np.flatnonzero(nonempty):
        out[i] = nanquantile_cols(vals[bounds[i]:bounds[i + 1]], qq)
    return out


def _interp_cols(t: np.ndarray, tw: np.ndarray, O: np.ndarray) -> np.ndarray:
    if len(tw) == 1:
        return np.repeat(O[:1], len(t), axis=0)
    return np.stack([np.interp(t, tw, O[:, a]) for a in range(O.shape[1])], axis=1)


def _fill_nan_cols(tw: np.ndarray, O: np.ndarray) -> np.ndarray:
    """Windows where a node was absent: interpolate from its neighbouring windows."""
    out = O.copy()
    for a in range(O.shape[1]):
        ok = np.isfinite(O[:, a])
        if ok.all() or not ok.any():
            continue
        out[~ok, a] = np.interp(tw[~ok], tw[ok], O[ok, a])
    return out


def _window_blocks(win: np.ndarray, nw: int, n_cols: int) -> list[tuple[int, int, int, int]]:
    """(first window, end window, first row, end row) of consecutive windows holding about
    BLOCK_CELLS cells each. Every reduction in the fit is per window (or per row), so processing a
    block at a time gives the same numbers with temporaries bounded whatever the node count."""
    bounds = np.searchsorted(win, np.arange(nw + 1))
    rows_per_block = block_rows(n_cols)
    out = []
    w0 = 0
    while w0 < nw:
        w1 = int(np.searchsorted(bounds, bounds[w0] + rows_per_block, side="right")) - 1
        w1 = min(nw, max(w1, w0 + 1))
        out.append((w0, w1, int(bounds[w0]), int(bounds[w1])))
        w0 = w1
    return out


def _exit_polish(read_D: Callable[[int, int], np.ndarray], n_cols: int, win: np.ndarray, nw: int, q: float,
                 rounds: int = 3) -> np.ndarray:
    """Polish of D[k, a] = exit - t_k into per-instance c_k (median over nodes) + per-window-node theta
    (quantile q over the window's instances). read_D(k0, k1): rows k0..k1 of D."""
    O = np.zeros((nw, n_cols))
    blocks = _window_blocks(win, nw, n_cols)
    for _ in range(rounds):
        new = np.empty_like(O)
        for w0, w1, k0, k1 in blocks:
            Db, wb = read_D(k0, k1), win[k0:k1] - w0
            c = nanmedian_rows(Db - O[win[k0:k1]])
            new[w0:w1] = _group_reduce(Db - c[:, None], wb, w1 - w0, "quantile", q)
        O = np.where(np.isfinite(new), new, 0.0)
    return O


def _others_extreme(V: np.ndarray, how: str) -> np.ndarray:
    """For each [k, a]: max (or min) over j != a of V[k, j], NaN-aware, by the top-two trick: the
    extreme of the row and, at its own column, the second one (two linear passes, no sort)."""
    s = -V if how == "max" else V
    s = np.where(np.isfinite(s), s, np.inf)
    if s.shape[1] < 2:
        return np.full(s.shape, np.nan)
    rows = np.arange(len(s))
    i1 = np.argmin(s, axis=1)
    first = s[rows, i1]
    s[rows, i1] = np.inf  # s is our own copy (np.where made it)
    second = s.min(axis=1)
    res = np.repeat(first[:, None], s.shape[1], axis=1)
    res[rows, i1] = second
    res[np.isinf(res)] = np.nan
    return -res if how == "max" else res


def _fit_component(inst: InstanceRows, ref: int, p: ClockParams, spread: Spread | None = None,
                   ) -> list[NodeClockModel]:
    n = inst.n_cols
    # the instances in time order (median exit over nodes), and each node's number of points
    t = np.empty(inst.n_rows)
    npts = np.zeros(n, np.int64)
    for k0, k1 in row_blocks(inst.n_rows, n):
        Xm = inst.take(_all(k0, k1))[2]
        t[k0:k1] = nanmedian_rows(Xm)
        npts += np.isfinite(Xm).sum(axis=0)
    order = np.argsort(t, kind="stable")
    t = t[order]
    rows = _Subset(inst, order)
    if p.method == "none" or n == 1:
        return [NodeClockModel("", True, "", np.array([t[0]]), np.zeros(1), np.zeros(1), 0.0, int(npts[a]))
                for a in range(n)]
    if p.method == "minimal":
        return _fit_minimal(rows, t, npts, ref, p, spread or SerialSpread())

    def read_D(k0: int, k1: int) -> np.ndarray:
        return rows.take(_all(k0, k1))[2] - t[k0:k1, None]

    if p.method in ("constant", "start_end"):
        if p.method == "constant":
            win = np.zeros(len(t), np.int64)
            O = _exit_polish(read_D, n, win, 1, p.exit_quantile)
            tw = np.array([np.median(t)])
        else:
            k = min(p.start_end_points, len(t) // 2) or 1
            sel = np.concatenate([np.arange(k), np.arange(len(t) - k, len(t))])
            win = np.concatenate([np.zeros(k, np.int64), np.ones(k, np.int64)])
            D_sel = rows.take(sel)[2] - t[sel][:, None]
            O = _exit_polish(lambda k0, k1: D_sel[k0:k1], n, win, 2, p.exit_quantile)
            tw = np.array([np.median(t[:k]), np.median(t[-k:])])
        O = O - O[:, ref:ref + 1]
        models = []
        for a in range(n):
            drift = 0.0 if len(tw) == 1 else (O[1, a] - O[0, a]) / (tw[1] - tw[0]) * 1e6
            models.append(NodeClockModel("", True, "", np.array([tw[0]]), np.array([O[0, a]]), np.array([drift]),
                                         float("nan"), int(npts[a])))
        return models

    win, nw = _window_index(t, p.window_s * 1e9, p.min_points)
    tw = _group_reduce(t[:, None], win, nw, "median")[:, 0]
    O = _exit_polish(read_D, n, win, nw, p.exit_quantile)
    O = O - O[:, ref:ref + 1]
    half_width = np.full(n, np.nan)
    if p.method in ("bounds", "bounds_center"):
        limit = p.max_bound_width_us * 1e3 if p.method == "bounds_center" else -1.0
        blocks = _window_blocks(win, nw, n)
        for _ in range(p.iterations):
            RH, RL, RX = (np.full((nw, n), np.nan) for _ in range(3))
            for w0, w1, k0, k1 in blocks:
                E, Xmin, Xmed = rows.take(_all(k0, k1))
                Th = _interp_cols(t[k0:k1], tw, O)
                Ea, Xa, Xm = E - Th, Xmin - Th, Xmed - Th
                c = nanmedian_rows(Xm)
                wb, nb = win[k0:k1] - w0, w1 - w0
                RH[w0:w1] = _group_reduce(Xa - _others_extreme(Ea, "max"), wb, nb, "min")
                RL[w0:w1] = _group_reduce(Ea - _others_extreme(Xa, "min"), wb, nb, "max")
                RX[w0:w1] = _group_reduce(Xm - c[:, None], wb, nb, "quantile", p.exit_quantile)
                del Th, Ea, Xa, Xm
            width = RH - RL
            ok = np.isfinite(width) & (width >= 0)
            narrow = ok & (width <= limit)
            delta = np.where(narrow, (RH + RL) / 2, np.where(ok, np.clip(RX, RL, RH), RX))
            delta = np.where(np.isfinite(delta), delta, 0.0)
            O = O + delta
            O = O - O[:, ref:ref + 1]
            with quiet_nan():
                half_width = np.nanmedian(np.where(ok, width, np.nan), axis=0) / 2
    O = _fill_nan_cols(tw, O)
    models = []
    for a in range(n):
        if a == ref:
            models.append(NodeClockModel("", True, "", np.array([tw[0]]), np.zeros(1), np.zeros(1), 0.0,
                                         int(npts[a]), 0.0))
            continue
        starts, offs, drifts, resid = segment_fit(tw, O[:, a], p.segment_tol_us)
        models.append(NodeClockModel("", True, "", starts, offs, drifts, resid, int(npts[a]),
                                     float(half_width[a])))
    return models


def segment_fit(
    t: np.ndarray, y: np.ndarray, tol_us: float | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Greedy piecewise-linear fit: extend a least-squares line while every point stays within tol.

    Returns segment start times (the first at t[0]; boundaries half-way between windows), offsets at
    the starts, drifts in ppm, and the RMS residual of the points against the model."""
    if len(t) == 1:
        return np.array([t[0]]), np.array([y[0]]), np.zeros(1), 0.0
    if tol_us is None:
        d = np.diff(y, 2) if len(y) > 3 else np.diff(y)
        sigma = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / np.sqrt(6 if len(y) > 3 else 2)
        tol = max(1e3, 4.0 * sigma)
    else:
        tol = tol_us * 1e3

    def fits(i0: int, i1: int) -> tuple[bool, float, float]:
        tt, yy = t[i0:i1], y[i0:i1]
        if len(tt) < 2:
            return True, 0.0, float(yy[0])
        tc = tt - tt[0]
        slope, icpt = np.polyfit(tc, yy, 1)
        return bool(np.max(np.abs(yy - (slope * tc + icpt))) <= tol), float(slope), float(icpt)

    segs: list[tuple[int, int, float, float]] = []
    i0, n = 0, len(t)
    while i0 < n:
        # grow by doubling, then binary search the longest fitting end
        good, step = min(i0 + 2, n), 2
        while good < n:
            cand = min(n, i0 + step * 2)
            if fits(i0, cand)[0]:
                good, step = cand, step * 2
            else:
                lo, hi = good, cand
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if fits(i0, mid)[0]:
                        lo = mid
                    else:
                        hi = mid
                good = lo
                break
        _, slope, icpt = fits(i0, good)
        segs.append((i0, good, slope, icpt))
        i0 = good
    starts = np.array([t[0]] + [(t[s[0] - 1] + t[s[0]]) / 2 for s in segs[1:]])
    offs = np.array([s[3] + s[2] * (st - t[s[0]]) for s, st in zip(segs, starts)])
    drifts = np.array([s[2] * 1e6 for s in segs])
    model = np.empty_like(y)
    for (a, b, slope, icpt) in segs:
        model[a:b] = icpt + slope * (t[a:b] - t[a])
    return starts, offs, drifts, float(np.sqrt(np.mean((y - model) ** 2)))


def _violations(inst: InstanceRows, models: list[NodeClockModel], tol_ns: float = 1000.0,
                spread: Spread | None = None) -> int:
    """Instances where, after alignment, some node left before the last node entered (beyond tol)."""
    return len(_violation_rows(inst, models, tol_ns, spread or SerialSpread()))


# --- method "minimal": the prior moved only as far as the constraints require --------------------
RELAX_TOL_NS = 1.0  # a relaxation sweep that moves no correction by more than this has converged
MAX_SWEEPS = 64  # more sweeps than this without converging is treated as a contradicting cycle


def _relax(E: np.ndarray, X: np.ndarray, d0: np.ndarray, up: bool, box_lo: np.ndarray | None = None,
           box_hi: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """Fixpoint of the causality constraints  d_a - d_b <= X[k, a] - E[k, b]  (a != b, both present
    in instance k) and box_lo <= d <= box_hi, from d0 (inside the box): the least solution >= d0 (up)
    or the greatest solution <= d0.

    E, X: [instances, nodes] latest enter and earliest exit on the current model's clocks (NaN where
    a node took no part). Each sweep is one Bellman-Ford round over every constraint at once, with
    the top-two trick (O(instances x nodes)); -inf / +inf in d0 mean "no bound yet". Returns
    (solution, converged); not converging, or leaving the box, means no correction satisfies the
    constraints (a cycle of them, or one with the box: a box of width 0 pins a node)."""
    d = d0.astype(np.float64).copy()
    sweeps = min(E.shape[1] + 1, MAX_SWEEPS)
    for _ in range(sweeps):
        with quiet_nan():
            if up:
                new = np.fmax(d, np.nanmax(E - _others_extreme(X - d, "min"), axis=0))
            else:
                new = np.fmin(d, np.nanmin(X - _others_extreme(E - d, "max"), axis=0))
        if box_hi is not None and up and np.any(new > box_hi + RELAX_TOL_NS):
            return d, False
        if box_lo is not None and not up and np.any(new < box_lo - RELAX_TOL_NS):
            return d, False
        with np.errstate(invalid="ignore"):  # inf - inf where a node is still unbounded: equal
            moved = np.where(new == d, 0.0, np.abs(new - d))
        if not (moved > RELAX_TOL_NS).any():
            return new, True
        d = new
    return d, False


@dataclass
class _Piece:
    """A run of instances (rows r0..r1 in time order) fitted with one constant correction."""

    r0: int
    r1: int
    t: float  # median instance time, node clock ns
    lo: np.ndarray  # [n] interval of the correction with the reference fixed (-inf/+inf: unbounded)
    hi: np.ndarray
    consistent: bool = True


def _joint(E: np.ndarray, X: np.ndarray, target: np.ndarray, box_lo: np.ndarray, box_hi: np.ndarray,
           ) -> np.ndarray | None:
    """A correction near the target that satisfies the piece's constraints within the box (the
    reference pinned by a box of width 0), or None when none does.

    Each node first goes to the point of its own feasible range nearest the target (its range with
    the reference fixed: it moves only as far as the data require, towards the truth, which lies in
    that range). Those points need not satisfy the constraints between two other nodes together;
    the least solution >= them and the greatest <= them do (both exist: the set is closed under
    componentwise max and min, so its corners are feasible), and so does their mean, which is the
    points themselves whenever they are jointly feasible."""
    rng = _interval(E, X, box_lo, box_hi)
    if rng is None:
        return None
    lo, hi = rng
    x = np.clip(target, lo, hi)
    up, ok_up = _relax(E, X, x, True, box_lo, box_hi)
    down, ok_down = _relax(E, X, x, False, box_lo, box_hi)
    if not (ok_up and ok_down):
        return None
    return np.clip((up + down) / 2, lo, hi)


def _interval(E: np.ndarray, X: np.ndarray, box_lo: np.ndarray, box_hi: np.ndarray,
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """Per node, the range of corrections the piece's constraints allow within the box (the
    reference pinned by a box of width 0): relaxation from the box's lower corner upwards and from
    its upper corner downwards. None when the constraints contradict each other or the box."""
    lo, ok_lo = _relax(E, X, box_lo.copy(), True, box_lo, box_hi)
    hi, ok_hi = _relax(E, X, box_hi.copy(), False, box_lo, box_hi)
    if not (ok_lo and ok_hi):
        return None
    return lo, hi


def _ref_box(n: int, ref: int) -> tuple[np.ndarray, np.ndarray]:
    box_lo, box_hi = np.full(n, -np.inf), np.full(n, np.inf)
    box_lo[ref] = box_hi[ref] = 0.0
    return box_lo, box_hi


def _residual(rows: InstanceRows, clocks: RankClocks, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
    """Latest enter and earliest exit of rows r0..r1 on the current models' clocks."""
    E_raw, X_raw, _ = rows.take(_all(r0, r1))
    # each node's model at its own timestamps, exactly as align() will map them
    return clocks.align(E_raw), clocks.align(X_raw)


def _piece_residual(rows: InstanceRows, clocks: RankClocks, pieces: list[_Piece], i: int,
                    ) -> tuple[np.ndarray, np.ndarray] | None:
    """Piece i's residual (_residual), None for a piece whose constraints contradict."""
    pc = pieces[i]
    return _residual(rows, clocks, pc.r0, pc.r1) if pc.consistent else None


def _tube_boxes(tube_lo: np.ndarray, tube_hi: np.ndarray, base: np.ndarray, ref: int) -> tuple[np.ndarray, np.ndarray]:
    """[pieces, nodes] bounds of each piece's correction inside the nodes' tubes, the reference pinned."""
    lo, hi = tube_lo - base, tube_hi - base
    lo[:, ref] = hi[:, ref] = 0.0
    return lo, hi


def _repair_point(E: np.ndarray, X: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray, ref: int) -> np.ndarray | None:
    """The repair's correction of one piece within the box, or, when none is, the constraints' own
    (they win over the drift bound; said at the end of the fit if it shows)."""
    d = _joint(E, X, np.zeros(len(b_lo)), b_lo, b_hi) if np.all(b_lo <= b_hi) else None
    return d if d is not None else _joint(E, X, np.zeros(len(b_lo)), *_ref_box(len(b_lo), ref))


def _repair_item(rows: InstanceRows, clocks: RankClocks, pieces: list[_Piece], tube_box: tuple[np.ndarray, np.ndarray],
                 ref: int, ahead: bool, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """Piece i's residual for the repair loop and, with other ranks to compute it (`ahead`), its
    correction within its tube box alone. The loop bounds each piece by the last piece's point too;
    where that bound binds no node the box is the tube box and this is the loop's own solve, done
    here in parallel instead of serially on rank 0 (the loop checks and solves again otherwise, so
    the result is the same for every rank count; on one rank nothing is solved ahead)."""
    got = _piece_residual(rows, clocks, pieces, i)
    if got is None:
        return None
    E, X = got
    return E, X, (_repair_point(E, X, tube_box[0][i], tube_box[1][i], ref) if ahead else None)


class RankClocks:
    """The clock models of a communicator's ranks (None, or a model without segments: the rank's times
    are kept), applied to [rows, ranks] blocks of raw times all at once when the models share their
    segment starts (as the minimal fit's do); the same numbers as NodeClockModel.align per column."""

    def __init__(self, models_of_rank: list[NodeClockModel | None]):
        self.models = models_of_rank
        live = [m for m in models_of_rank if m is not None and len(m.seg_start)]
        s = live[0].seg_start if live else np.zeros(0)
        self.shared = bool(live) and all(m.seg_start is s or np.array_equal(m.seg_start, s) for m in live)
        self.has = np.array([m is not None and len(m.seg_start) > 0 for m in models_of_rank], bool)
        self.s = s
        if self.shared:
            zero = np.zeros(len(s))
            self.off = np.column_stack([m.seg_offset if h and m is not None else zero
                                        for m, h in zip(models_of_rank, self.has)])
            self.drift = np.column_stack([m.seg_drift_ppm if h and m is not None else zero
                                          for m, h in zip(models_of_rank, self.has)])

    def offsets_at(self, tq: np.ndarray) -> np.ndarray:
        """[len(tq), ranks]: each model's offset_ns at the times tq, all columns at once when the
        models share their segment starts (the same numbers as offset_ns per column)."""
        if not self.shared:
            return np.column_stack([m.offset_ns(tq) if m is not None else np.zeros(len(tq)) for m in self.models])
        s = self.s
        i = np.clip(np.searchsorted(s, tq, side="right") - 1, 0, len(s) - 1)
        return self.off[i] + self.drift[i] * 1e-6 * (tq - s[i])[:, None]

    def align(self, T: np.ndarray, r0: int = 0) -> np.ndarray:
        """Raw [rows, ranks r0..r0+k] times -> the reference clock."""
        if not self.shared:
            out = T.copy()
            for j in range(T.shape[1]):
                m = self.models[r0 + j]
                if m is not None:
                    out[:, j] = m.align(T[:, j])
            return out
        cols = np.arange(r0, r0 + T.shape[1])[None, :]
        s = self.s
        i = np.clip(np.searchsorted(s, T, side="right") - 1, 0, len(s) - 1)
        aligned = T - (self.off[i, cols] + self.drift[i, cols] * 1e-6 * (T - s[i]))
        return np.where(self.has[r0:r0 + T.shape[1]][None, :], aligned, T)


def _pieces(rows: InstanceRows, t: np.ndarray, clocks: RankClocks, ref: int, win: np.ndarray,
            nw: int, spread: Spread, violation_tol_ns: float | None = None) -> tuple[list[_Piece], int | None]:
    """Each window's interval; a window whose constraints no constant satisfies (drift inside it) is
    split in halves until each half is satisfiable, or a single contradicting instance is left.
    With violation_tol_ns, also the instances out of order on the current models (_violations), in
    the same map (one round of items over the ranks instead of two); else None."""
    n = rows.n_cols
    out: list[_Piece] = []
    bounds = np.searchsorted(win, np.arange(nw + 1))
    # a window of more than a block of cells is fitted in pieces of a block: memory stays bounded by
    # BLOCK_CELLS whatever the node count (docs/merge.md, "Rank 0's memory")
    step = block_rows(n)
    spans = [(a, min(int(bounds[w + 1]), a + step)) for w in range(nw)
             for a in range(int(bounds[w]), int(bounds[w + 1]), step)]

    def solve(i: int) -> list[_Piece]:
        r0, r1 = spans[i]
        E, X = _residual(rows, clocks, r0, r1)
        got_pieces = []
        stack = [(r0, r1)]
        while stack:
            a, b = stack.pop()
            got = _interval(E[a - r0:b - r0], X[a - r0:b - r0], *_ref_box(n, ref))
            tm = float(np.median(t[a:b]))
            if got is not None:
                got_pieces.append(_Piece(a, b, tm, *got))
            elif b - a > 1:
                mid = (a + b) // 2
                stack.extend([(mid, b), (a, mid)])
            else:
                nan = np.full(n, np.nan)
                got_pieces.append(_Piece(a, b, tm, nan, nan.copy(), consistent=False))
        return got_pieces

    checks = row_blocks(rows.n_rows, n) if violation_tol_ns is not None else []

    def item(i: int) -> list[_Piece] | int:
        if i < len(checks):
            return len(_block_violations(rows, clocks, checks, violation_tol_ns or 0.0, i))
        return solve(i - len(checks))

    bad = 0
    for part in spread.map(item, len(checks) + len(spans)):
        if isinstance(part, int):
            bad += part
        else:
            out.extend(part)
    out.sort(key=lambda pc: pc.r0)
    return out, (bad if violation_tol_ns is not None else None)


def _py_max(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Python's max(x, y) elementwise (y only where y > x: NaN and ties as the scalar code had them)."""
    return np.where(y > x, y, x)


def _py_min(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Python's min(x, y) elementwise."""
    return np.where(y < x, y, x)


def _tube(tp: np.ndarray, lo: np.ndarray, hi: np.ndarray, s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The intervals [pieces, nodes] tightened so that a path with |slope| <= s runs through all of
    each node's (forward and backward passes, all nodes at once: a loop over the pieces, not over
    pieces x nodes); per node False when no such path exists."""
    lo, hi = lo.copy(), hi.copy()
    for i in range(1, len(tp)):
        g = s * (tp[i] - tp[i - 1])
        lo[i], hi[i] = _py_max(lo[i], lo[i - 1] - g), _py_min(hi[i], hi[i - 1] + g)
    for i in range(len(tp) - 2, -1, -1):
        g = s * (tp[i + 1] - tp[i])
        lo[i], hi[i] = _py_max(lo[i], lo[i + 1] - g), _py_min(hi[i], hi[i + 1] + g)
    return lo, hi, np.all(lo <= hi + RELAX_TOL_NS, axis=0)


def _bounded_path(tp: np.ndarray, want: np.ndarray, lo: np.ndarray, hi: np.ndarray, s: float) -> np.ndarray:
    """Per node (columns), points as close to `want` as the tube allows, each within s x dt of the
    previous one."""
    p = np.empty_like(want)
    for i in range(len(tp)):
        a, b = lo[i], hi[i]
        if i:
            g = s * (tp[i] - tp[i - 1])
            a, b = _py_max(a, p[i - 1] - g), _py_min(b, p[i - 1] + g)
        p[i] = np.where(a <= b, _py_min(_py_max(want[i], a), b), (a + b) / 2)
    return p


def _piece_point(rows: InstanceRows, clocks: RankClocks, pieces: list[_Piece], base: np.ndarray, ref: int,
                 q: float, i: int) -> np.ndarray | None:
    """Piece i's joint correction towards its target (_joint), None when its constraints contradict.
    The target is the prior (the node's wall clock), except for a node whose instances in the piece
    include synchronous exits (_exit_sync_target): there it is the correction that makes them
    synchronous. Either way the constraints decide: the target is only where, inside them, to go."""
    pc = pieces[i]
    if not pc.consistent:
        return None
    E, X = _residual(rows, clocks, pc.r0, pc.r1)
    target = -base[i]
    sync = _exit_sync_target(rows, clocks, pc, ref, q)
    if sync is not None:
        target = np.where(np.isfinite(sync), sync, target)
    return _joint(E, X, target, *_ref_box(rows.n_cols, ref))


EXIT_SYNC_MIN_ROWS = 8  # synchronous instances of a node in a piece before they, not its wall clock, are aimed at


def _exit_sync_target(rows: InstanceRows, clocks: RankClocks, pc: _Piece, ref: int, q: float) -> np.ndarray | None:
    """Per node, the correction (on the current models) that makes the piece's synchronous instances
    end together with the reference's: a median polish of their exits (per instance the median
    over nodes, per node the quantile q of its exits against it), NaN for a node with fewer than
    EXIT_SYNC_MIN_ROWS of them; None when the reference has too few.

    Why only those: an NCCL kernel ends when the last data reached its rank, which on every rank
    of an N-to-N collective is the same step of the algorithm (a ring's last all-gather step, a
    tree's broadcast): the ends differ by a link's latency, microseconds, whoever was late. MPI
    calls on host times have no such property (their exits differ by the algorithm's asymmetry,
    which read as an offset moved real clocks by milliseconds), so they keep the prior."""
    idx = np.arange(pc.r0, pc.r1)
    sel = idx[rows.synchronous(idx)]
    if len(sel) < EXIT_SYNC_MIN_ROWS:
        return None
    X = clocks.align(rows.take(sel)[2])
    counts = np.isfinite(X).sum(axis=0)
    if counts[ref] < EXIT_SYNC_MIN_ROWS:
        return None
    d = np.zeros(X.shape[1])
    for _ in range(3):
        c = nanmedian_rows(X - d[None, :])
        d = nanquantile_cols(X - c[:, None], q)
        d = np.where(np.isfinite(d), d - d[ref], 0.0)
    return np.where(counts >= EXIT_SYNC_MIN_ROWS, d, np.nan)


def _fit_minimal(rows: InstanceRows, t: np.ndarray, npts: np.ndarray, ref: int, p: ClockParams,
                 spread: Spread) -> list[NodeClockModel]:
    """Per iteration: each piece's interval against the current model (_pieces), each node's tube of
    bounded drift through them (_tube), then one forward pass over the pieces choosing, jointly for
    all nodes, the correction nearest the prior inside the constraints and inside each node's tube
    and drift bound from its previous point (_joint). The points joined linearly are the new model."""
    n = rows.n_cols
    s = p.max_drift_ppm * 1e-6
    win, nw = _window_index(t, p.window_s * 1e9, p.min_points)
    zero = np.zeros(1)
    models = [NodeClockModel("", True, "", np.array([t[0]]), zero.copy(), zero.copy(), max_drift_ppm=p.max_drift_ppm)
              for _ in range(n)]
    pieces: list[_Piece] = []
    notes = [""] * n
    for it in range(max(1, p.max_iterations)):
        # the tube of the last round decides: the first rounds fit constants against a model that does
        # not drift yet, and a drifting clock then looks like one that needs more than the bound
        notes = [""] * n
        # each round fits constants against the last round's model; joined linearly they can leave a
        # few instances out of order between two points: go on until none is (or the data say why)
        clocks = RankClocks(list(models))  # the round's models, applied to whole blocks
        # the pieces and, from the repair rounds on, the instances still out of order: one map
        pieces, bad = _pieces(rows, t, clocks, ref, win, nw, spread,
                              p.violation_tol_ns if it >= p.iterations else None)
        if bad == 0:
            break
        tp = np.array([pc.t for pc in pieces])
        base = clocks.offsets_at(tp)  # [pieces, n]
        lo = base + np.array([pc.lo for pc in pieces])
        hi = base + np.array([pc.hi for pc in pieces])
        lo, hi = np.where(np.isnan(lo), -np.inf, lo), np.where(np.isnan(hi), np.inf, hi)  # contradicting
        tube_lo, tube_hi = lo.copy(), hi.copy()
        la, ha, ok = _tube(tp, lo, hi, s)
        ok[ref] = False  # the reference keeps its intervals (its box pins it at 0)
        tube_lo[:, ok], tube_hi[:, ok] = la[:, ok], ha[:, ok]
        for bad in np.flatnonzero(~ok).tolist():
            if bad != ref and not notes[bad]:
                notes[bad] = (f"the collectives ask for a drift beyond {p.max_drift_ppm:.0f} ppm (the kernel's slew "
                            "limit): the data are inconsistent with any physical clock")
        pts = np.zeros((len(pieces), n))
        if it < p.iterations:
            # jointly per piece: the correction nearest the prior that the piece's constraints allow;
            # then per node the path nearest those points with bounded drift inside the node's tube
            joint = functools.partial(_piece_point, rows, clocks, pieces, base, ref, p.exit_quantile)
            want = base.copy()
            for i, d in enumerate(spread.map(joint, len(pieces))):
                if d is not None:  # else: contradicting (what stays out of order is judged at the end)
                    want[i] = base[i] + d
            free = np.arange(n) != ref
            pts[:, free] = _bounded_path(tp, want[:, free], tube_lo[:, free], tube_hi[:, free], s)
        else:
            # repair: what the per-node paths left out of order between nodes, fixed jointly piece by
            # piece in time order, each node kept inside its tube and its drift bound from the last point.
            # The loop is serial (each point bounds the next) and runs on rank 0; the pieces' residuals,
            # most of its cost, are computed on every rank and come to it in order (Spread.ordered)
            tube_box = _tube_boxes(tube_lo, tube_hi, base, ref)
            residual = functools.partial(_repair_item, rows, clocks, pieces, tube_box, ref, spread.size > 1)
            for i, got in enumerate(spread.ordered(residual, len(pieces))):
                b_lo, b_hi = tube_box[0][i].copy(), tube_box[1][i].copy()
                if i:
                    g = s * (tp[i] - tp[i - 1])
                    b_lo = np.fmax(b_lo, pts[i - 1] - g - base[i])
                    b_hi = np.fmin(b_hi, pts[i - 1] + g - base[i])
                b_lo[ref] = b_hi[ref] = 0.0
                d = None
                if got is not None:
                    E, X, ahead = got
                    if ahead is not None and np.array_equal(b_lo, tube_box[0][i]) and np.array_equal(
                            b_hi, tube_box[1][i]):
                        d = ahead  # the drift bound from the last point binds no node: the same solve
                    else:
                        d = _repair_point(E, X, b_lo, b_hi, ref)
                pts[i] = base[i] + (d if d is not None else 0.0)
            pts = spread.share(pts)
        tp_all = np.concatenate([[t[0]], tp, [t[-1]]])
        # every node at once, then one row of each [node, knot] table per model
        pa = _node_rows(np.concatenate([pts[:1], pts, pts[-1:]]))
        drift = _node_rows(_knot_drifts(tp_all, pa.T))
        la = _node_rows(np.concatenate([tube_lo[:1], tube_lo, tube_lo[-1:]]))
        ha = _node_rows(np.concatenate([tube_hi[:1], tube_hi, tube_hi[-1:]]))
        models = [NodeClockModel("", True, "", tp_all, pa[a], drift[a], float("nan"), int(npts[a]),
                                 point_lo=la[a], point_hi=ha[a], inconsistent=notes[a], max_drift_ppm=p.max_drift_ppm)
                  for a in range(n)]
    models, unrepaired = _repair_exact(rows, t, models, ref, p, spread)
    for a, m in enumerate(models):
        # what the data say, from the final model: a node whose rows are all in order on a clock within
        # the slew limit is consistent, whatever the rounds' constant pieces suggested on the way
        if unrepaired[a]:
            m.inconsistent = (f"no clock with |drift| <= {p.max_drift_ppm:.0f} ppm (the kernel's slew limit) keeps "
                              "every collective and message of this node in order: the data are inconsistent with "
                              "any physical clock (the instances left out of order are counted)")
        elif not np.any(np.abs(m.seg_drift_ppm) > p.max_drift_ppm * (1 + 1e-9)):
            m.inconsistent = ""
    _knot_intervals(rows, t, models, ref, p, spread)
    # what the final pieces say about each node: its error interval and where nothing constrained it
    for a, m in enumerate(models):
        if a == ref:
            m.uncertainty_ns = 0.0
            continue
        steep = np.flatnonzero(np.abs(m.seg_drift_ppm) > p.max_drift_ppm * (1 + 1e-9))
        if len(steep) and not m.inconsistent:
            # not a claim about the data (its tube exists): the greedy joint repair found no path
            # within the bound that also keeps every node pair in order, so the model says so
            m.drift_note = (f"between t={m.seg_start[steep[0]] / 1e9:.1f} s and "
                            f"t={m.seg_start[min(steep[-1] + 1, len(m.seg_start) - 1)] / 1e9:.1f} s this model "
                            f"drifts up to {float(np.max(np.abs(m.seg_drift_ppm))):.0f} ppm (beyond the "
                            f"{p.max_drift_ppm:.0f} ppm slew limit) to keep every collective in order; the "
                            "collectives pin the node only loosely there (see its interval)")
        widths = [pc.hi[a] - pc.lo[a] for pc in pieces if np.isfinite(pc.hi[a] - pc.lo[a])]
        # the error bar is the model points' own intervals (_knot_intervals), not the pieces'
        point_w = (m.point_hi - m.point_lo)[np.isfinite(m.point_hi - m.point_lo)]
        m.uncertainty_ns = float(np.median(point_w)) / 2 if len(point_w) else float("nan")
        spans: list[tuple[float, float]] = []
        for pc in pieces:
            if pc.consistent and np.isinf(pc.lo[a]) and np.isinf(pc.hi[a]):
                t0, t1 = float(t[pc.r0]), float(t[pc.r1 - 1])
                if spans and spans[-1][1] >= float(t[max(pc.r0 - 1, 0)]):
                    spans[-1] = (spans[-1][0], t1)
                else:
                    spans.append((t0, t1))
        m.unconstrained_spans = spans
        if not widths:
            m.reason = "no collective constrains this node's clock: it keeps its wall clock (the prior)"
    return models


# --- the exact last step: what the pieces' points, joined linearly, still leave out of order -------
REPAIR_ROUNDS = 4
REPAIR_SUBKNOTS = 8  # each interval of the model that holds a violation gets this many pieces
REPAIR_MIN_GAP_NS = 5e6  # intervals are not cut into pieces shorter than this
REPAIR_MAX_CELLS = 16 << 16  # instance x node cells of one program at most (its temporaries: ~10 floats each)
REPAIR_SLACK_NS = 10e3  # constraints with less slack than this (beyond 4x the worst violation) are kept
REPAIR_PAD_NS = 50e6  # rows this close to a region are in its program too (their times straddle a knot)
REPAIR_MAX_MOVING = 64  # nodes one program moves at most (its constraints between them grow as their square)


def _violation_rows(rows: InstanceRows, models: list[NodeClockModel], tol_ns: float, spread: Spread) -> np.ndarray:
    """Rows (time order) where, after alignment, some node left before the last node entered (beyond tol)."""
    blocks = row_blocks(rows.n_rows, rows.n_cols)
    find = functools.partial(_block_violations, rows, RankClocks(list(models)), blocks, tol_ns)
    found = list((spread or SerialSpread()).map(find, len(blocks)))
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def _block_violations(rows: InstanceRows, clocks: RankClocks, blocks: list[tuple[int, int]], tol_ns: float,
                      b: int) -> np.ndarray:
    """The rows of block b out of order on the clocks (_violation_rows)."""
    E, Xmin, _ = rows.take(_all(*blocks[b]))
    with quiet_nan():
        bad = np.nanmin(clocks.align(Xmin), axis=1) < np.nanmax(clocks.align(E), axis=1) - tol_ns
    return np.flatnonzero(bad) + blocks[b][0]


def _knot_weights(T: np.ndarray, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The piecewise-linear function through values at knots T, at times tau, as weights on two knots
    (i, i + 1): exactly NodeClockModel.offset_ns (the first piece extended backwards, constant after
    the last knot). Returns (i, weight of i, weight of i + 1); i + 1 is clipped to the last knot."""
    K = len(T) - 1
    i = np.clip(np.searchsorted(T, tau, side="right") - 1, 0, K)
    last = i >= K
    ii = np.minimum(i, K - 1)
    lam = np.where(last, 1.0, (tau - T[ii]) / np.maximum(T[ii + 1] - T[ii], 1.0))
    return ii, 1.0 - lam, lam


def _solve_region(rows: InstanceRows, t: np.ndarray, T: np.ndarray, P: np.ndarray, ref: int, k0: int, k1: int,
                  s: float, movable: list[int]) -> np.ndarray | None:
    """New values of the knots k0 .. k1 of the `movable` nodes (k0 and k1 stay, unless they are the
    model's first or last knot, which nothing beyond them holds; every other node and the reference
    stay): the ones nearest the current values P (L1) with which every instance near the region is
    in causal order and every node drifts by at most s between knots: a linear program (HiGHS through
    scipy). None when there are none (with these end knots and movable nodes: the caller grows the
    region), or when the region holds more than REPAIR_MAX_CELLS cells (memory stays bounded).

    Size: an instance gives each movable node one constraint against the nodes that stay (only the
    tightest of them can bind: the latest aligned enter, the earliest aligned exit) and one per pair
    of movable nodes, so thousands of nodes cost no more than the few that move."""
    from scipy.optimize import linprog
    from scipy.sparse import bmat, coo_matrix, csr_matrix, hstack, identity, vstack

    n = P.shape[1]
    free = sorted({a for a in movable if a != ref})
    f0, f1 = (k0 if k0 == 0 else k0 + 1), (k1 + 1 if k1 == len(T) - 1 else k1)  # free knots f0 .. f1 - 1
    kf = np.arange(f0, f1)
    if not len(kf) or not free:
        return P[k0:k1 + 1].copy()
    r0, r1 = (int(x) for x in np.searchsorted(t, [T[k0] - REPAIR_PAD_NS, T[k1] + REPAIR_PAD_NS]))
    if (r1 - r0) * n > REPAIR_MAX_CELLS:
        return None
    col_of_node = np.full(n, -1)
    col_of_node[free] = np.arange(len(free))
    nv = len(kf) * len(free)

    def var(k: np.ndarray, a: np.ndarray) -> np.ndarray:
        """Variable index of knot k of node a, -1 where that value is fixed."""
        ok = (k >= f0) & (k < f1) & (col_of_node[a] >= 0)
        return np.where(ok, (k - f0) * len(free) + col_of_node[a], -1)

    E, X, _ = rows.take(np.arange(r0, r1))
    cols = np.arange(n)[None, :]

    def weights(V: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        i, w0, w1 = _knot_weights(T, np.where(np.isfinite(V), V, T[0]))
        return i, w0, w1, V - (w0 * P[i, cols] + w1 * P[i + 1, cols])  # aligned on the current model

    iE, wE0, wE1, Ea = weights(E)
    iX, wX0, wX1, Xa = weights(X)
    stay = np.ones(n, bool)
    stay[free] = False
    with quiet_nan():
        late_enter = np.nanmax(np.where(stay[None, :], Ea, np.nan), axis=1)  # of the nodes that stay
        early_exit = np.nanmin(np.where(stay[None, :], Xa, np.nan), axis=1)
    # Constraints with more slack than the nodes will move are left out: at most 2 s per unit of the
    # region's length each, and in practice a few times the worst violation there (a cutting plane:
    # what a move puts out of order anyway is found by the next round's check and added then).
    with quiet_nan():
        worst = float(np.nanmax(np.nanmax(Ea, axis=1) - np.nanmin(Xa, axis=1), initial=0.0))
    cap = min(4 * s * float(T[k1] - T[k0]), 4 * max(worst, 0.0) + REPAIR_SLACK_NS)
    terms_r, terms_v, terms_w, rhs = [], [], [], []
    m = 0

    def add(slack: np.ndarray, sides: list[tuple[np.ndarray, np.ndarray, np.ndarray, float, int]]) -> None:
        """Constraints sum over sides of sign * (w0 change[i] + w1 change[i + 1]) <= slack, one per row
        where the slack is finite and below the cap; a side: (i, w0, w1, sign, node)."""
        nonlocal m
        keep = np.flatnonzero(np.isfinite(slack) & (slack < cap))
        if not len(keep):
            return
        rid = m + np.arange(len(keep))
        m += len(keep)
        for i, w0, w1, sign, node in sides:
            for kk, w in ((i, w0), (i + 1, w1)):
                v = var(kk[keep], np.full(len(keep), node))
                use = (v >= 0) & (w[keep] != 0.0)
                terms_r.append(rid[use])
                terms_v.append(v[use])
                terms_w.append(sign * w[keep][use])
        rhs.append(slack[keep])

    for a in free:
        # a leaves no earlier than the nodes that stay entered; a enters no later than they left
        add(Xa[:, a] - late_enter, [(iX[:, a], wX0[:, a], wX1[:, a], 1.0, a)])
        add(early_exit - Ea[:, a], [(iE[:, a], wE0[:, a], wE1[:, a], -1.0, a)])
        for b in free:
            if b != a:
                add(Xa[:, a] - Ea[:, b], [(iX[:, a], wX0[:, a], wX1[:, a], 1.0, a),
                                          (iE[:, b], wE0[:, b], wE1[:, b], -1.0, b)])
    if not m:
        return P[k0:k1 + 1].copy()
    A_c = coo_matrix((np.concatenate(terms_w), (np.concatenate(terms_r), np.concatenate(terms_v))), shape=(m, nv))
    b_c = np.concatenate(rhs)
    # drift between consecutive knots k, k + 1 of the region, each free node: |dP + change| <= s dT
    kk, aa = (x.ravel() for x in np.meshgrid(np.arange(k0, k1), np.asarray(free), indexing="ij"))
    g = s * (T[kk + 1] - T[kk])
    d = P[kk + 1, aa] - P[kk, aa]
    v1, v0 = var(kk + 1, aa), var(kk, aa)
    dr, dv, dw = [], [], []
    for sign, first in ((1.0, 0), (-1.0, len(kk))):  # change(k+1) - change(k) <= g - d, and >= -g - d
        for v, coef in ((v1, sign), (v0, -sign)):
            use = v >= 0
            dr.append(first + np.flatnonzero(use))
            dv.append(v[use])
            dw.append(np.full(int(use.sum()), coef))
    A_d = coo_matrix((np.concatenate(dw), (np.concatenate(dr), np.concatenate(dv))), shape=(2 * len(kk), nv))
    db = np.concatenate([g - d, g + d])
    # |change| <= u: minimise the sum of u
    eye = identity(nv, format="csr")
    A_abs = bmat([[eye, -eye], [-eye, -eye]])
    c = np.concatenate([np.zeros(nv), np.ones(nv)])
    bounds = [(None, None)] * nv + [(0, None)] * nv
    main = vstack([A_c, A_d])
    A = vstack([hstack([main, csr_matrix((main.shape[0], nv))]), A_abs]).tocsr()
    res = linprog(c, A_ub=A, b_ub=np.concatenate([b_c, db, np.zeros(2 * nv)]), bounds=bounds, method="highs")
    if res.status == 0:
        out = P[k0:k1 + 1].copy()
        out[f0 - k0:f1 - k0] += _unflatten(res.x[:nv], kf, free, n)
        return out
    return None


def _unflatten(x: np.ndarray, kf: np.ndarray, free_nodes: list[int], n: int) -> np.ndarray:
    out = np.zeros((len(kf), n))
    out[:, free_nodes] = x.reshape(len(kf), len(free_nodes))
    return out


def _repair_exact(rows: InstanceRows, t: np.ndarray, models: list[NodeClockModel], ref: int, p: ClockParams,
                  spread: Spread) -> tuple[list[NodeClockModel], np.ndarray]:
    """The rounds above fit one constant per piece and join the pieces' points linearly; where the
    constraints are tight (matched messages between nodes: microseconds) and the clocks drift, the
    line between two points can leave rows out of order. Here each interval of the model that holds
    such a row (with its neighbours) gets REPAIR_SUBKNOTS knots, and the knots of each run of such
    intervals are solved exactly (_solve_region): the nearest model that keeps every row in order. A
    run whose end knots, held where the rounds put them, leave no solution is grown (doubled on each
    side, up to the whole model). Returns the models (all on the same knots, as the rounds' are) and
    the nodes of rows that no clock keeps in order."""
    n = len(models)
    s = p.max_drift_ppm * 1e-6
    unrepaired = np.zeros(n, bool)
    for _ in range(REPAIR_ROUNDS):
        bad = _violation_rows(rows, models, p.violation_tol_ns, spread)
        T = models[0].seg_start
        steep = _steep_intervals(models, ref)
        if (not len(bad) and not steep.any()) or len(T) < 2:
            break
        K = len(T) - 1
        iv = np.clip(np.searchsorted(T, t[bad], side="right") - 1, 0, K - 1)
        steep_iv = np.flatnonzero(steep.any(axis=1))
        marked = np.unique(np.clip(np.concatenate([iv - 1, iv, iv + 1, steep_iv - 1, steep_iv, steep_iv + 1]), 0, K - 1))
        long_ = marked[T[marked + 1] - T[marked] > REPAIR_MIN_GAP_NS * REPAIR_SUBKNOTS]
        frac = np.arange(1, REPAIR_SUBKNOTS) / REPAIR_SUBKNOTS
        T_new = np.union1d(T, (T[long_][:, None] + (T[long_ + 1] - T[long_])[:, None] * frac[None, :]).ravel())
        P = RankClocks(list(models)).offsets_at(T_new)
        P[:, ref] = 0.0
        # runs of marked intervals, as knot ranges of T_new
        runs: list[tuple[int, int]] = []
        for i in marked:
            a, b = int(np.searchsorted(T_new, T[i])), int(np.searchsorted(T_new, T[i + 1]))
            if runs and runs[-1][1] >= a:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))

        # the nodes that move in a run: those of its instances out of order that entered last or left
        # first on the current model (the others keep their values and bound them)
        culprits = _culprits(rows, bad, models)
        movable = []
        for a, b in runs:
            # and the nodes whose model drifts beyond the bound there (the rounds' greedy path can, where
            # the data do not ask for it: the program bounds every movable node's drift)
            over = steep[(T[:-1] >= T_new[a]) & (T[:-1] < T_new[b])].any(axis=0)
            movable.append(sorted({int(c) for c in culprits[(t[bad] >= T_new[a]) & (t[bad] <= T_new[b])].ravel()}
                                  | {int(c) for c in np.flatnonzero(over)}))
        solve = functools.partial(_solve_region, rows, t, T_new, ref=ref, s=s)
        first = functools.partial(_solve_run, solve, P, runs, movable)
        failed = []
        for i, got in enumerate(spread.map(first, len(runs))):
            if got is None:
                failed.append(i)
            else:
                P[runs[i][0]:runs[i][1] + 1] = got
        for i in failed:  # rare: grown one after the other, each on what the others left
            (a, b), last = runs[i], len(T_new) - 1
            moving = movable[i]
            while True:
                width = b - a
                a, b = max(0, a - width), min(last, b + width)
                got, moving = _solve_widening(solve, rows, t, T_new, P, a, b, moving, ref)
                if got is not None:
                    P[a:b + 1] = got
                    break
                if a == 0 and b == last:
                    unrepaired[[c for c in moving if c != ref]] = True
                    break
        models = _on_knots(models, T_new, P, p.max_drift_ppm)
    return models, unrepaired


def _steep_intervals(models: list[NodeClockModel], ref: int) -> np.ndarray:
    """[intervals, nodes]: where a node's model drifts beyond its slew limit between two knots (all
    models on the same knots, as the minimal fit's are); the reference never does."""
    T = models[0].seg_start
    out = np.zeros((max(len(T) - 1, 0), len(models)), bool)
    for a, m in enumerate(models):
        if a != ref and len(m.seg_drift_ppm) == len(T):
            out[:, a] = np.abs(m.seg_drift_ppm[:-1]) > m.max_drift_ppm * (1 + 1e-9)
    return out


def _solve_widening(solve: Callable[..., np.ndarray | None], rows: InstanceRows, t: np.ndarray, T: np.ndarray,
                    P: np.ndarray, k0: int, k1: int, movable: list[int], ref: int,
                    ) -> tuple[np.ndarray | None, list[int]]:
    """The region's solve with the movable nodes, and where it has none, with the nodes that bound
    them added (_binding_stayers) until one is found or no node is left to add (or more than
    REPAIR_MAX_MOVING would move); returns the solution (None) and the nodes that moved. The
    culprits of the rows out of order are not always the nodes whose clock is off: a node held at
    its current values (in order against each culprit alone) can leave them no room, and growing
    the region in time never frees it (a GROMACS run re-timed with NTP-like slews was called
    inconsistent on two nodes so, while its true clocks kept every instance in order with 6 us to
    spare)."""
    moving = sorted(movable)
    while True:
        got = solve(P, k0=k0, k1=k1, movable=moving)
        if got is not None:
            return got, moving
        wider = sorted(set(moving) | _binding_stayers(rows, t, T, P, k0, k1, moving, ref))
        if wider == moving or len(wider) > REPAIR_MAX_MOVING:
            return None, moving
        moving = wider


def _binding_stayers(rows: InstanceRows, t: np.ndarray, T: np.ndarray, P: np.ndarray, k0: int, k1: int,
                     movable: list[int], ref: int) -> set[int]:
    """The nodes that stay in _solve_region's program of knots k0 .. k1 and bound its movable nodes:
    per instance near the region, the staying node that entered last and the one that left first
    on the model P (the only stayers its constraints name), the reference excepted."""
    r0, r1 = (int(x) for x in np.searchsorted(t, [T[k0] - REPAIR_PAD_NS, T[k1] + REPAIR_PAD_NS]))
    n = P.shape[1]
    stay = np.ones(n, bool)
    stay[movable] = False
    stay[ref] = False
    if not stay.any():
        return set()
    cols = np.arange(n)[None, :]
    found: set[int] = set()
    step = block_rows(rows.n_cols)
    for q0 in range(r0, r1, step):
        E, X, _ = rows.take(np.arange(q0, min(q0 + step, r1)))
        aligned = []
        for V in (E, X):
            i, w0, w1 = _knot_weights(T, np.where(np.isfinite(V), V, T[0]))
            aligned.append(np.where(stay[None, :], V - (w0 * P[i, cols] + w1 * P[i + 1, cols]), np.nan))
        Ea, Xa = aligned
        has_e = np.isfinite(Ea).any(axis=1)
        has_x = np.isfinite(Xa).any(axis=1)
        found.update(np.argmax(np.where(np.isfinite(Ea), Ea, -np.inf), axis=1)[has_e].tolist())
        found.update(np.argmin(np.where(np.isfinite(Xa), Xa, np.inf), axis=1)[has_x].tolist())
    return found


def _solve_run(solve: Callable[..., np.ndarray | None], P: np.ndarray, runs: list[tuple[int, int]],
               movable: list[list[int]], i: int) -> np.ndarray | None:
    return solve(P, k0=runs[i][0], k1=runs[i][1], movable=movable[i])


def _culprits(rows: InstanceRows, bad: np.ndarray, models: list[NodeClockModel]) -> np.ndarray:
    """[len(bad), 2]: per instance out of order, the node that entered last and the one that left
    first, on the models' clocks."""
    clocks = RankClocks(list(models))
    out = []
    for i in range(0, len(bad), block_rows(rows.n_cols)):
        E, X, _ = rows.take(bad[i:i + block_rows(rows.n_cols)])
        Ea, Xa = clocks.align(E), clocks.align(X)
        out.append(np.stack([np.argmax(np.where(np.isfinite(Ea), Ea, -np.inf), axis=1),
                             np.argmin(np.where(np.isfinite(Xa), Xa, np.inf), axis=1)], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 2), np.int64)


def _node_rows(a: np.ndarray) -> np.ndarray:
    """[knots, nodes] -> [nodes, knots], C-contiguous: each node's row is a contiguous view."""
    return np.ascontiguousarray(a.T)


def _knot_drifts(T: np.ndarray, P: np.ndarray) -> np.ndarray:
    """[knots, nodes] drift (ppm) from each knot to the next, 0 after the last: per column exactly
    np.append(np.diff(P[:, a]) / np.maximum(np.diff(T), 1.0) * 1e6, 0.0)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.diff(P, axis=0) / np.maximum(np.diff(T), 1.0)[:, None] * 1e6
    return np.concatenate([d, np.zeros((1, P.shape[1]))])


def _on_knots(models: list[NodeClockModel], T: np.ndarray, P: np.ndarray, max_drift_ppm: float,
              ) -> list[NodeClockModel]:
    """Each model on knots T with values P[:, node], its intervals interpolated at the new knots
    (NodeClockModel.interval_ns; 0 for the reference): all nodes at once where they share their
    knots and bound, as the minimal fit's models do; the same numbers as one node at a time."""
    n = len(models)
    lo, hi = np.zeros((len(T), n)), np.zeros((len(T), n))
    S = models[0].seg_start
    s = models[0].max_drift_ppm * 1e-6
    alike = [a for a, m in enumerate(models) if not m.is_reference and len(m.point_lo) and len(S)
             and (m.seg_start is S or np.array_equal(m.seg_start, S)) and m.max_drift_ppm * 1e-6 == s]
    if alike:
        i = np.clip(np.searchsorted(S, T, side="right") - 1, 0, len(S) - 1)
        j = np.minimum(i + 1, len(S) - 1)
        PL = np.column_stack([models[a].point_lo for a in alike])
        PH = np.column_stack([models[a].point_hi for a in alike])
        with np.errstate(invalid="ignore"):
            di, dj = (np.abs(T - S[i]) * s)[:, None], (np.abs(S[j] - T) * s)[:, None]
            lo[:, alike] = np.fmax(PL[i] - di, PL[j] - dj)
            hi[:, alike] = np.fmin(PH[i] + di, PH[j] + dj)
    done = set(alike)
    for a, m in enumerate(models):
        if a not in done and not m.is_reference:
            lo[:, a], hi[:, a] = m.interval_ns(T)
    drift, Pn, lo, hi = _node_rows(_knot_drifts(T, P)), _node_rows(P), _node_rows(lo), _node_rows(hi)
    return [replace(m, seg_start=T, seg_offset=Pn[a], seg_drift_ppm=drift[a], point_lo=lo[a], point_hi=hi[a],
                    max_drift_ppm=max_drift_ppm) for a, m in enumerate(models)]


def _knot_intervals(rows: InstanceRows, t: np.ndarray, models: list[NodeClockModel], ref: int, p: ClockParams,
                    spread: Spread) -> None:
    """Each model point's interval (point_lo, point_hi), from the feasible set of the raw constraints
    around it: the instances between the midpoints to its neighbour points, each constraint moved to
    the point's time by the drift bound (d_a(T) - d_b(T) <= exit_a - enter_b + s |t - T|, with s the
    bound the fit puts on each node's offset to the reference, whose offset is 0 at every time),
    relaxed with the reference fixed. The truth lies inside whenever the timestamps are causal and the clocks
    drift within the bound; the constant pieces' intervals above need not hold it where the clocks
    drift inside a piece. Points whose instances contradict the bound keep the pieces' intervals."""
    T = models[0].seg_start
    if len(T) < 2:
        return
    s = p.max_drift_ppm * 1e-6
    mid = (T[1:] + T[:-1]) / 2
    edges = np.searchsorted(t, np.concatenate([[-np.inf], mid, [np.inf]]))

    def one(k: int) -> tuple[np.ndarray, np.ndarray] | None:
        r0, r1 = int(edges[k]), int(edges[k + 1])
        if r1 <= r0:
            return None
        E, X, _ = rows.take(_all(r0, r1))
        widen = s * np.abs(t[r0:r1] - T[k])
        return _interval(E, X + widen[:, None], *_ref_box(rows.n_cols, ref))

    n = len(models)
    lo, hi = np.full((len(T), n), -np.inf), np.full((len(T), n), np.inf)  # no instance near a point: unbounded
    for k, iv in enumerate(spread.map(one, len(T))):
        if iv is not None:
            lo[k], hi[k] = iv
    lo, hi = _node_rows(lo), _node_rows(hi)
    for a, m in enumerate(models):
        if a != ref:
            m.point_lo, m.point_hi = lo[a], hi[a]
