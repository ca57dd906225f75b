"""Delay analysis (root causes of wait states, after Böhme et al., Scalasca) and the statistics the
straggler detector needs (an exact binomial tail, Benjamini-Hochberg). Arrays in, nothing loaded here.

Delay analysis. Every process (a (node, pid) pair: one MPI process is a rank of the world and of every
sub-communicator it belongs to) runs a sequence of blocking collectives, ordered by time. For a
synchronizing instance (Wait at NxN, Wait at Barrier), the last arrival L (the waitee) made every
other rank j wait  e_L - e_j;  W is their sum. Why was L later than j? From s, the newest instance
both took part in (on any communicator: their last synchronization), each spent its time on

  own work A         compute, and the own time of the collectives in between
  waits B            in the collectives in between (waiting for someone else)
  exit delays        its exit at s and in between beyond its usual exit offset
  usual offsets      its usual exit offset b (per rank and communicator: the 25th percentile of
                     exit - median exit over a sample of instances), at s and in between

and exactly  e_L - e_j = dA + dB + d(exit delays) + d(offsets)  (the median exit of s cancels).
Summed over the waiters and clipped at 0, the parts split W: own work -> L is an origin ("own
compute"); exit delays -> L is an origin on its path ("exit delay", a slow network or collective);
usual offsets -> the communicator's algorithm (a 2-rank Allreduce's second rank always leaves later;
a constant offset is also what a clock error gives), no one's fault, never a finding; waits ->
propagated: that share of W goes to the blame of the instance in between where L waited longest
(split the same way, recursively). So
  d_i(q) = (f_own_i + f_exit_i) [L_i = q] + f_prop_i d_parent(i)(q)
is the share of W_i that process q caused, and q's cost is sum_i W_i d_i(q); what reached W_i through
f_prop is *propagated* lateness (reported under q, on the communicator of i, with the ranks that
carried it), the rest is q's direct cost.

Memory and distribution: the sweep goes through all instances of all communicators in time order in
spans of about common.BLOCK_CELLS / 4 cells (its temporaries hold RING entries per cell); it reads
aligned times through AlignedRows (a few rows of each communicator per span), keeps per process its
last RING collectives (a few numbers each, with running sums in whole ns, exact, so the spans'
cuts change nothing), and produces per-instance vectors only. Each communicator's exit baselines are
read once, from a sample. The time order is cut into ranges (sweep_cuts: SWEEP_RANGES_PER_RANK per
merge rank, shrinking from the first to the last so that the ranges dealt last are short), each
swept on a rank (a common.Task through a common.Pool) from a ring warmed up on the instances just
before it (_warm_start: back until every process has its last RING instances;
a few rows of each communicator where every process is in a communicator used all along). The
running sums then start from another origin, but only their differences on one process are used,
and they are exact: each range gives bit for bit what one sweep from the start gives, so rank 0
concatenates the ranges' vectors and the result does not depend on the number of ranks.
Propagation (Blame.propagate) runs on rank 0 over those vectors: per instance, log depth.
The result depends only on the data (a deterministic order: time, communicator index, seq).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpuprof.mpi_merge import common
from gpuprof.mpi_merge.common import Pool, SerialPool, block_rows, nanquantile_cols, quiet_nan
from gpuprof.mpi_merge.waitstates import CommSummary

SYNC_PATTERNS = (0, 1)  # Wait at NxN, Wait at Barrier: every other rank waits for the last arrival
BASELINE_SAMPLE = 256  # instances per communicator the exit baselines are estimated from
BASELINE_QUANTILE = 0.25  # a slow path in < 75 % of the instances does not move the baseline

KIND_NONE, KIND_OWN, KIND_EXIT, KIND_ASYM, KIND_PROP = 0, 1, 2, 3, 4
KIND_NAMES = ("unattributed", "own compute", "exit delay", "exit asymmetry", "propagated")


class AlignedRows(Protocol):
    """Aligned enter and exit times (float ns from the epoch) of one communicator, read by seqs."""

    def enter(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        """[len(seqs), ranks]"""
        ...

    def exit(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        """[len(seqs), ranks]"""
        ...


# --- statistics ------------------------------------------------------------------------------------
def log_binom_tails(n: int, p: float) -> np.ndarray:
    """log P(X >= k) for k = 0..n, X ~ Binomial(n, p): exact, in log space (log C(n, k) as a cumulative
    sum of logs, the tail as a running logaddexp from the top, so tiny tails do not underflow)."""
    if n <= 0:
        return np.zeros(max(n, 0) + 1)
    k = np.arange(n + 1, dtype=np.float64)
    if p <= 0.0:
        out = np.full(n + 1, -np.inf)
        out[0] = 0.0
        return out
    if p >= 1.0:
        return np.zeros(n + 1)
    i = k[1:]
    log_c = np.concatenate([[0.0], np.cumsum(np.log(n - i + 1.0) - np.log(i))])
    log_pmf = log_c + k * math.log(p) + (n - k) * math.log1p(-p)
    tails = np.logaddexp.accumulate(log_pmf[::-1])[::-1]
    return np.minimum(tails, 0.0)


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k), X ~ Binomial(n, p), exact (one-sided test that an event of chance p happened k times
    or more in n trials)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return float(math.exp(log_binom_tails(n, p)[k]))


def binom_sf_many(k: np.ndarray, n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """binom_sf elementwise; one tail table per distinct (n, p)."""
    k, n, p = (np.asarray(a) for a in (k, n, p))
    out = np.ones(k.shape, np.float64)
    if not k.size:
        return out
    pairs = np.stack([n.astype(np.float64).ravel(), p.astype(np.float64).ravel()], axis=1)
    uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
    inv = inv.ravel()
    kf = k.ravel().astype(np.int64)
    flat = out.ravel()
    for u, (nn, pp) in enumerate(uniq):
        sel = np.flatnonzero(inv == u)
        tails = log_binom_tails(int(nn), float(pp))
        kk = kf[sel]
        v = np.where(kk <= 0, 0.0, np.where(kk > int(nn), -np.inf, tails[np.clip(kk, 0, int(nn))]))
        flat[sel] = np.exp(v)
    return flat.reshape(k.shape)


def benjamini_hochberg(p: np.ndarray, q: float, m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Benjamini-Hochberg step-up at false discovery rate q over m tests, of which `p` are the p-values
    passed (the others, m - len(p), are known to be above q: they can never be rejected and only count
    in m). Returns (rejected mask, BH-adjusted p-values, capped at 1)."""
    p = np.asarray(p, np.float64)
    m = len(p) if m is None else int(m)
    if m < len(p):
        raise ValueError(f"m={m} is smaller than the {len(p)} p-values given")
    if not len(p):
        return np.zeros(0, bool), np.zeros(0)
    order = np.argsort(p, kind="stable")
    rank = np.arange(1, len(p) + 1)
    ps = p[order]
    below = np.flatnonzero(ps <= q * rank / m)
    rejected = np.zeros(len(p), bool)
    if len(below):
        rejected[order[:below[-1] + 1]] = True
    adj = np.minimum.accumulate((ps * m / rank)[::-1])[::-1]
    q_values = np.empty(len(p))
    q_values[order] = np.minimum(adj, 1.0)
    return rejected, q_values


# --- processes ---------------------------------------------------------------------------------------
def process_ids(comms: Sequence[CommSummary]) -> tuple[list[np.ndarray], int]:
    """Per communicator, the process of each rank: ranks with the same (node, pid) on several
    communicators are one process. A rank without a node or pid, or one whose (node, pid) repeats
    inside its own communicator, is a process of its own (nothing links it to other communicators)."""
    keys, where = [], []
    for ci, c in enumerate(comms):
        node = np.asarray(c.node_of_rank, np.int64)
        pid = np.asarray(c.pid_of_rank, np.int64)
        key = node * (1 << 32) + (pid & 0xFFFFFFFF)
        ok = (node >= 0) & (pid > 0)
        if ok.any():
            _, counts = np.unique(key[ok], return_counts=True)
            if (counts > 1).any():
                ok[:] = False
        keys.append(np.where(ok, key, -1))
        where.append(ok)
    known = np.concatenate(keys)[np.concatenate(where)] if keys else np.zeros(0, np.int64)
    uniq = np.unique(known)
    out: list[np.ndarray] = []
    next_id = len(uniq)
    for key, ok in zip(keys, where):
        ids = np.empty(len(key), np.int64)
        ids[ok] = np.searchsorted(uniq, key[ok])
        n_own = int((~ok).sum())
        ids[~ok] = np.arange(next_id, next_id + n_own)
        next_id += n_own
        out.append(ids)
    return out, next_id


def comm_units(c: CommSummary) -> np.ndarray:
    """[size] the unit each rank is judged in: its node where the communicator spans several nodes
    (a node's ranks share its CPUs, network and clock: a slow node is one straggler however many of
    its ranks arrive last), else the rank itself; a rank without a node is a unit of its own."""
    node = np.asarray(c.node_of_rank, np.int64)
    own = -2 - np.arange(c.size, dtype=np.int64)
    known = node[node >= 0]
    if len(known) and (known == known[0]).all() and (node >= 0).all():
        return own
    return np.where(node >= 0, node, own)


class TimesContext(Protocol):
    """What the delay analysis's tasks read on the rank that runs them: the aligned times of every
    communicator (common.Task's context)."""

    @property
    def times(self) -> Sequence[AlignedRows]: ...


@dataclass
class GivenTimes:
    """A TimesContext of aligned times at hand (library callers with arrays, one process)."""

    times: Sequence[AlignedRows]


def _baseline_picks(c: CommSummary, sample: int) -> np.ndarray:
    """Up to `sample` complete instances spread over the run: what the exit baselines are read from."""
    comp = np.flatnonzero(c.complete)
    if c.size < 2 or not len(comp):
        return np.zeros(0, np.int64)
    return comp[np.unique(np.linspace(0, len(comp) - 1, min(sample, len(comp))).round().astype(np.int64))]


@dataclass
class _PickMedians:
    """Task: the median exit over all ranks of each of a few sampled instances (item: (ci, seqs))."""

    items: list[tuple[int, np.ndarray]]

    def __call__(self, ctx: TimesContext, i: int) -> np.ndarray:
        ci, seqs = self.items[i]
        return np.asarray(np.median(ctx.times[ci].exit(seqs), axis=1))


@dataclass
class _BaselineColumns:
    """Task: the baselines of a few ranks (item: (ci, sampled seqs, their median exits, ranks))."""

    items: list[tuple[int, np.ndarray, np.ndarray, slice]]

    def __call__(self, ctx: TimesContext, i: int) -> np.ndarray:
        ci, pick, med, ranks = self.items[i]
        return nanquantile_cols(ctx.times[ci].exit(pick, ranks) - med[:, None], BASELINE_QUANTILE)


def exit_baselines(comms: Sequence[CommSummary], pool: Pool, sample: int = BASELINE_SAMPLE) -> list[np.ndarray]:
    """Per communicator, [size] each rank's usual exit offset: the BASELINE_QUANTILE of exit - median
    exit over up to `sample` complete instances spread over the run (the medians a block of rows at a
    time, then the quantiles a few ranks at a time; both dealt over the pool's ranks)."""
    picks = [_baseline_picks(c, sample) for c in comms]
    rows = [(ci, pick[a:a + block_rows(c.size)]) for ci, (c, pick) in enumerate(zip(comms, picks))
            for a in range(0, len(pick), block_rows(c.size))]
    meds: list[list[np.ndarray]] = [[] for _ in comms]
    for (ci, _), med in zip(rows, pool.map(_PickMedians(rows), len(rows))):
        meds[ci].append(med)
    cols = [(ci, pick, np.concatenate(meds[ci]), slice(r0, min(c.size, r0 + block_rows(len(pick)))))
            for ci, (c, pick) in enumerate(zip(comms, picks)) if len(pick)
            for r0 in range(0, c.size, block_rows(len(pick)))]
    out = [np.zeros(c.size) for c in comms]
    for (ci, _, _, ranks), q in zip(cols, pool.map(_BaselineColumns(cols), len(cols))):
        out[ci][ranks] = q
    return [np.nan_to_num(b) for b in out]


# --- the sweep -------------------------------------------------------------------------------------
@dataclass
class Blame:
    """Per instance of every communicator (complete instances, in the global time order), the split
    of its waits. `gids[ci]` are the global indices of communicator ci's complete instances, in seq
    order (`seqs[ci]`)."""

    comm: np.ndarray  # [N] communicator index
    seq: np.ndarray  # [N]
    wait_ns: np.ndarray  # [N] W: the waits of the instance (0 when not synchronizing)
    f_own: np.ndarray  # [N] shares of W (sum to 1 where attributed, else all 0)
    f_exit: np.ndarray
    f_asym: np.ndarray
    f_prop: np.ndarray
    ptr: np.ndarray  # [N] gid of the waitee's previous instance where f_prop > 0, else -1
    waitee: np.ndarray  # [N] rank (in the communicator) of the last arrival, -1 when none
    proc: np.ndarray  # [N] its process, -1 when none
    late_ns: np.ndarray  # [N] waitee's enter - median enter
    exit_delay_ns: np.ndarray  # [N] waitee's exit delay at its previous instance beyond its usual offset
    asym_ns: np.ndarray  # [N] that usual offset (b_L)
    compute_excess_ns: np.ndarray  # [N] waitee's compute interval - median over ranks
    held_ns: np.ndarray  # [N] how much earlier the instance would have begun had the waitee's unit (its
    # node, or the rank itself where the communicator lies on one node) arrived with the next unit
    prev_exit: np.ndarray  # [N] when the waitee left its previous collective (aligned ns)
    enter_ns: np.ndarray  # [N] its arrival
    attributed: np.ndarray  # [N] bool
    gids: list[np.ndarray]
    seqs: list[np.ndarray]
    procs: list[np.ndarray]  # per communicator, the process of each rank
    baselines: list[np.ndarray]  # per communicator, b per rank

    @property
    def kind(self) -> np.ndarray:
        """[N] the dominant part of each instance's blame (KIND_*)."""
        f = np.stack([self.f_own, self.f_exit, self.f_asym, self.f_prop])
        k = np.argmax(f, axis=0) + 1
        return np.where(self.attributed, k, KIND_NONE).astype(np.int8)

    def propagate(self, roots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For a set of processes (bool [n_procs]): (direct share c_i, total share d_i) of each
        instance's waits they caused, d_i = c_i + f_prop_i d_ptr(i), by pointer doubling (log depth)."""
        n = len(self.comm)
        mine = np.zeros(n, bool)
        has = self.proc >= 0
        mine[has] = roots[self.proc[has]]
        direct = np.where(mine, self.f_own + self.f_exit, 0.0)
        d = np.append(direct, 0.0)
        r = np.append(np.where(self.ptr >= 0, self.f_prop, 0.0), 0.0)
        p = np.append(np.where(self.ptr >= 0, self.ptr, n), n)
        while True:
            live = (p != n) & (r > 1e-15)
            if not live.any():
                break
            d = d + np.where(live, r * d[p], 0.0)
            r = np.where(live, r * r[p], 0.0)
            p = np.where(live, p[p], n)
        return direct, d[:n]


def _instance_order(comms: Sequence[CommSummary]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    keys, cis, seqs_all, seqs = [], [], [], []
    for ci, c in enumerate(comms):
        s = np.flatnonzero(c.complete)
        seqs.append(s)
        # time key: the last arrival (inside every rank's busy interval of that instance), kept
        # non-decreasing along the seqs so a process's instances stay in their own order
        t = c.last_enter[s]
        keys.append(np.maximum.accumulate(t) if len(t) else t)
        cis.append(np.full(len(s), ci, np.int64))
        seqs_all.append(s)
    key = np.concatenate(keys) if keys else np.zeros(0)
    comm = np.concatenate(cis) if cis else np.zeros(0, np.int64)
    seq = np.concatenate(seqs_all) if seqs_all else np.zeros(0, np.int64)
    order = np.lexsort((seq, comm, key))
    pos = np.empty(len(order), np.int64)
    pos[order] = np.arange(len(order))
    gids, o = [], 0
    for s in seqs:
        gids.append(pos[o:o + len(s)])
        o += len(s)
    return comm[order], seq[order], gids, seqs


RING = 8  # per process, the last instances kept to find where it last synchronized with each waiter
# fields of a ring entry: the instance, the process's exit there, its usual exit offset there, its exit
# delay beyond it, its wait there, and its running sums (after the instance) of waits, exit delays, offsets
F_GID, F_X, F_B, F_XD, F_W, F_CW, F_CXD, F_CXB = range(8)
N_FIELDS = 8


BLAME_FIELDS = ("wait", "own", "exit", "asym", "prop", "late", "xd", "b", "cx", "px", "e", "held")


@dataclass
class _Sweep:
    """Task: the sweep over one range of the global time order (item i: instances cuts[i] ..
    cuts[i + 1] - 1), from a ring warmed up on the instances just before the range (_warm_start)."""

    comms: Sequence[CommSummary]
    gcomm: np.ndarray
    gseq: np.ndarray
    gids: list[np.ndarray]
    procs: list[np.ndarray]
    n_proc: int
    base: list[np.ndarray]
    units: list[np.ndarray]
    cuts: np.ndarray
    span_cells: int

    def __call__(self, ctx: TimesContext, i: int) -> dict[str, np.ndarray]:
        return _sweep_range(self, ctx.times, int(self.cuts[i]), int(self.cuts[i + 1]))


def _warm_start(gids: list[np.ndarray], procs: list[np.ndarray], n_proc: int, g0: int) -> int:
    """Where a sweep that begins its output at instance g0 starts reading: early enough that every
    process has its last RING instances before g0 in its ring (or all of them, if it has fewer), so
    the ring at g0 holds what the sweep from the start would. A process takes part in every instance
    of its communicators: its RING-th last instance is no earlier than the RING-th last of any of
    them; with none of RING, it is no earlier than the first of all of them."""
    strong = np.full(n_proc, -1, np.int64)
    first = np.full(n_proc, g0, np.int64)
    for g, pr in zip(gids, procs):
        before = int(np.searchsorted(g, g0))
        if before >= RING:
            np.maximum.at(strong, pr, int(g[before - RING]))
        if before:
            np.minimum.at(first, pr, int(g[0]))
    return int(np.where(strong >= 0, strong, first).min()) if n_proc else g0


def _sweep_range(sw: _Sweep, times: Sequence[AlignedRows], g0: int, g1: int) -> dict[str, np.ndarray]:
    """The per-instance vectors (BLAME_FIELDS, ptr, waitee, proc, attributed) of instances g0 .. g1-1.
    The running sums in the ring are kept from the warm start on, not from the job's start: only their
    differences on one process are used, and they are whole ns (exact), so they are the same."""
    comms, gcomm, gseq = sw.comms, sw.gcomm, sw.gseq
    n = g1 - g0
    f = {name: np.zeros(n) for name in BLAME_FIELDS}
    ptr = np.full(n, -1, np.int64)
    waitee = np.full(n, -1, np.int64)
    proc_l = np.full(n, -1, np.int64)
    attributed = np.zeros(n, bool)
    # per process: its last RING instances, oldest first (gid -1: none)
    ring = np.zeros((N_FIELDS, sw.n_proc, RING))
    ring[F_GID] = -1
    start = _warm_start(sw.gids, sw.procs, sw.n_proc, g0) if g0 else 0
    sizes = np.array([c.size for c in comms], np.int64)[gcomm[start:g1]] if g1 > start else np.zeros(0, np.int64)
    cum = np.cumsum(sizes)
    budget = max(sw.span_cells // 4, int(sizes.max()) if len(sizes) else 1)  # [cells x RING x fields] temporaries
    s0 = start
    while s0 < g1:
        done = cum[s0 - start - 1] if s0 > start else 0
        s1 = max(s0 + 1, start + int(np.searchsorted(cum, done + budget, side="right")))
        if s0 < g0:  # the warm-up ends where the output begins
            s1 = min(s1, g0)
        blocks = []
        for ci in np.unique(gcomm[s0:s1]):
            sel = s0 + np.flatnonzero(gcomm[s0:s1] == ci)
            tm, c = times[int(ci)], comms[int(ci)]
            E, X = tm.enter(gseq[sel]), tm.exit(gseq[sel])
            sync = np.isin(c.pattern[gseq[sel]], SYNC_PATTERNS)
            wait = np.where(sync[:, None], E.max(axis=1)[:, None] - E, 0.0)
            b = np.broadcast_to(sw.base[ci], E.shape)
            xd = X - np.median(X, axis=1)[:, None] - b
            blocks.append((int(ci), sel, E, np.stack([np.broadcast_to(sel[:, None], E.shape), X, b, xd, wait])))
        proc = np.concatenate([np.tile(sw.procs[ci], len(sel)) for ci, sel, _, _ in blocks])
        vals = np.concatenate([v.reshape(5, -1) for *_, v in blocks], axis=1)
        comb, back, before = _ring_lookup(proc, vals, ring)
        o = 0
        for ci, sel, E, _ in blocks if s0 >= g0 else ():
            nr, sz = E.shape
            cells = slice(o, o + nr * sz)
            o += nr * sz
            _attribute_rows(comms[ci], gseq[sel], sel - g0, E, comb, back[cells].reshape(nr, sz, RING),
                            before[:, cells].reshape(3, nr, sz), sw.procs[ci], sw.units[ci], f, ptr, waitee,
                            proc_l, attributed)
        s0 = s1
    return {**f, "ptr": ptr, "waitee": waitee, "proc": proc_l, "attributed": attributed}


SWEEP_RANGES_PER_RANK = 8  # ranges of the sweep per merge rank (each starts from a warmed ring)
# the last range is this share of the first: ranges are dealt on demand in order, so the ones dealt
# last set how long the other ranks wait for the rank that took the last one (equal ranges left
# about half a range's time, ~0.5 s at 256 x 4 on 2 ranks, idle on the other rank)
SWEEP_LAST_RANGE_SHARE = 0.125


def sweep_cuts(comms: Sequence[CommSummary], gcomm: np.ndarray, parts: int) -> np.ndarray:
    """[parts + 1] boundaries of `parts` ranges of the global time order, their cells (instances x
    ranks) shrinking geometrically from the first to the last (SWEEP_LAST_RANGE_SHARE): the items of
    the sweep (which cuts changes no number)."""
    sizes = np.array([c.size for c in comms], np.int64)[gcomm] if len(gcomm) else np.zeros(0, np.int64)
    cum = np.cumsum(sizes)
    total = int(cum[-1]) if len(cum) else 0
    weights = SWEEP_LAST_RANGE_SHARE ** (np.arange(parts) / max(1, parts - 1))
    shares = np.cumsum(weights)[:-1] / weights.sum()
    inner = np.searchsorted(cum, total * shares, side="left")
    return np.unique(np.concatenate([[0], inner, [len(gcomm)]])).astype(np.int64)


def delay_analysis(comms: Sequence[CommSummary], times: Sequence[AlignedRows] | None = None,
                   span_cells: int | None = None, pool: Pool | None = None) -> Blame:
    """The sweep over every communicator's complete instances in time order (module docstring),
    its ranges dealt over `pool` (default: this process, reading `times`).
    span_cells: cells per span (default common.BLOCK_CELLS, read when called)."""
    if pool is None:
        if times is None:
            raise ValueError("delay_analysis needs the aligned times or a pool whose ranks read them")
        pool = SerialPool(GivenTimes(times))
    if span_cells is None:
        span_cells = common.BLOCK_CELLS
    procs, n_proc = process_ids(comms)
    gcomm, gseq, gids, seqs = _instance_order(comms)
    base = exit_baselines(comms, pool)
    units = [comm_units(c) for c in comms]
    # several ranges per merge rank: they are dealt on demand, so a rank slowed down by other load
    # sweeps fewer of them (one range per rank would make every rank wait for the slowest)
    cuts = sweep_cuts(comms, gcomm, pool.size * SWEEP_RANGES_PER_RANK if pool.size > 1 else 1)
    task = _Sweep(comms, gcomm, gseq, gids, procs, n_proc, base, units, cuts, span_cells)
    parts = list(pool.map(task, len(cuts) - 1))
    keys = (*BLAME_FIELDS, "ptr", "waitee", "proc", "attributed")
    empty = _sweep_range(task, [], 0, 0)
    v = {k: np.concatenate([p[k] for p in parts]) if parts else empty[k] for k in keys}
    return Blame(gcomm, gseq, v["wait"], v["own"], v["exit"], v["asym"], v["prop"], v["ptr"], v["waitee"], v["proc"],
                 v["late"], v["xd"], v["b"], v["cx"], v["held"], v["px"], v["e"], v["attributed"], gids, seqs, procs,
                 base)


def _ring_lookup(proc: np.ndarray, vals: np.ndarray, ring: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cell (a process at an instance; vals: gid, exit, offset, exit delay, wait): the entries
    ([N_FIELDS, entries]) and, per cell, the indices of its previous RING instances among them, newest
    first ([cells, RING]), and its running sums before this instance ([3, cells]: waits, exit delays,
    offsets). The ring is updated with the span's cells."""
    gid = vals[0]
    srt = np.lexsort((gid, proc))
    ps = proc[srt]
    start = np.ones(len(ps), bool)
    start[1:] = ps[1:] != ps[:-1]
    grp = np.cumsum(start) - 1
    uniq = ps[start]
    counts = np.bincount(grp, minlength=len(uniq))
    first_of = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pos_in = np.arange(len(ps)) - first_of[grp]
    v = vals[:, srt]
    # running sums: the process's last ring entry's, plus its cells of the span so far
    carry = ring[[F_CW, F_CXD, F_CXB], :, RING - 1][:, uniq]  # [3, groups]
    # wait, exit delay, offset, rounded to whole ns: the running sums are then exact in float64 (up to
    # 2**53 ns), so they do not depend on where the spans cut the sequence. A cell without a value (a
    # rank left out of an instance, a row with such a rank: NaN) adds 0: its NaN would otherwise reach
    # every later process's sums through the span's one cumulative sum, which made the result depend
    # on the spans' cuts (and left a job with a cut-off node without any attributed instance)
    inc = np.stack([v[4], v[3], v[2]])
    inc = np.round(np.where(np.isfinite(inc), inc, 0.0))
    cs = np.cumsum(inc, axis=1)
    cs_before_group = np.where(first_of > 0, cs[:, np.maximum(first_of - 1, 0)], 0.0)
    after = carry[:, grp] + cs - cs_before_group[:, grp]
    before_s = after - inc
    entries = np.concatenate([v, after])  # [N_FIELDS, cells] in F_* order
    # combined per process: its RING ring entries, then its cells of the span
    comb_len = counts + RING
    comb_off = np.concatenate([[0], np.cumsum(comb_len)[:-1]])
    comb = np.empty((N_FIELDS, int(comb_len.sum())))
    ring_idx = (comb_off[:, None] + np.arange(RING)[None, :]).ravel()
    comb[:, ring_idx] = ring[:, uniq].reshape(N_FIELDS, -1)
    me = comb_off[grp] + RING + pos_in
    comb[:, me] = entries
    back_s = me[:, None] - np.arange(1, RING + 1)[None, :]  # newest first, inside the process's entries
    last = (comb_off + comb_len)[:, None] - RING + np.arange(RING)[None, :]
    ring[:, uniq] = comb[:, last]
    back = np.empty_like(back_s)
    before = np.empty_like(before_s)
    back[srt] = back_s
    before[:, srt] = before_s
    return comb, back, before


def _attribute_rows(c: CommSummary, seqs: np.ndarray, out: np.ndarray, E: np.ndarray, comb: np.ndarray,
                    back: np.ndarray, before: np.ndarray, procs: np.ndarray, units: np.ndarray,
                    f: dict[str, np.ndarray],
                    ptr: np.ndarray, waitee: np.ndarray, proc_l: np.ndarray, attributed: np.ndarray) -> None:
    """One communicator's rows of a span: each row's waits split, waiter by waiter, over the parts of
    the waitee's and the waiter's time since the last instance both were in (module docstring).
    `out`: the rows' places in the range's vectors (f, ptr, waitee, proc_l, attributed)."""
    nr, sz = E.shape
    sync = np.isin(c.pattern[seqs], SYNC_PATTERNS) & (sz >= 2)
    if not sync.any():
        return
    rows = np.arange(nr)
    L = np.argmax(E, axis=1)
    eL = E[rows, L]
    W = sz * eL - E.sum(axis=1)
    gap = ~np.isfinite(W)
    if gap.any():  # ranks left out of the instance (a cut-off node file): not split, W of the ranks present
        with quiet_nan():
            W[gap] = np.nansum(np.nanmax(E[gap], axis=1)[:, None] - E[gap], axis=1)
    G = comb[F_GID][back]  # [nr, sz, RING]
    GL = G[rows, L]  # [nr, RING]
    # the newest instance each waiter shares with the waitee (both rings are newest first)
    eq = (G[:, :, :, None] == GL[:, None, None, :]) & (G[:, :, :, None] >= 0)
    in_l = eq.any(axis=3)  # [nr, sz, RING]
    has = in_l.any(axis=2)
    pj = np.argmax(in_l, axis=2)  # position in the waiter's ring
    qj = np.argmax(eq[rows[:, None], np.arange(sz)[None, :], pj], axis=2)  # position in the waitee's ring
    r_i, j_i = rows[:, None], np.arange(sz)[None, :]

    idx_j = back[r_i, j_i, pj]  # [nr, sz] entry of the shared instance in the waiter's ring
    idx_l = back[r_i, L[:, None], qj]  # ... and in the waitee's

    def at_j(fld: int) -> np.ndarray:
        return comb[fld][idx_j]

    def at_l(fld: int) -> np.ndarray:
        return comb[fld][idx_l]

    cw_b, cxd_b, cxb_b = before  # [nr, sz]
    lr = (r_i, L[:, None])
    # since the shared instance s: waits B, exit delays XD, offsets XB in between; the interval I
    B_j, XD_j, XB_j = cw_b - at_j(F_CW), cxd_b - at_j(F_CXD), cxb_b - at_j(F_CXB)
    B_l, XD_l, XB_l = cw_b[lr] - at_l(F_CW), cxd_b[lr] - at_l(F_CXD), cxb_b[lr] - at_l(F_CXB)
    A_j = (E - at_j(F_X)) - B_j - XD_j - XB_j
    A_l = (eL[:, None] - at_l(F_X)) - B_l - XD_l - XB_l
    waiter = has & (j_i != L[:, None])
    with quiet_nan():
        parts = [np.where(waiter, p, 0.0) for p in (
            A_l - A_j,  # own work: compute and the collectives' own time
            (at_l(F_XD) + XD_l) - (at_j(F_XD) + XD_j),  # exit delays beyond the usual
            (at_l(F_B) + XB_l) - (at_j(F_B) + XB_j),  # the usual exit offsets (the algorithms')
            B_l - B_j,  # waits in between: propagated
        )]
        own, xd, asym, prop = (np.clip(p.sum(axis=1), 0, None) for p in parts)
        # the instance in between where the waitee waited longest, after the oldest shared instance
        s_min = np.where(waiter, G[r_i, j_i, pj], np.inf).min(axis=1)
        wl = np.where((GL > s_min[:, None]) & (GL >= 0), comb[F_W][back[rows, L]], 0.0)
        jmax = np.argmax(wl, axis=1)
        parent = np.where(wl[rows, jmax] > 0, GL[rows, jmax], -1).astype(np.int64)
        prop = np.where(parent >= 0, prop, 0.0)
        tot = own + xd + asym + prop
        ok = sync & waiter.any(axis=1) & np.isfinite(tot) & (tot > 0) & (W > 0)
        safe = np.where(ok, tot, 1.0)
        nw = np.maximum(waiter.sum(axis=1), 1)
        g = out
        f["wait"][g] = np.where(sync, W, 0.0)
        f["own"][g] = np.where(ok, own / safe, 0.0)
        f["exit"][g] = np.where(ok, xd / safe, 0.0)
        f["asym"][g] = np.where(ok, asym / safe, 0.0)
        f["prop"][g] = np.where(ok, prop / safe, 0.0)
        ptr[g] = np.where(ok & (prop > 0), parent, -1)
        waitee[g] = np.where(sync, L, -1)
        proc_l[g] = np.where(sync, procs[L], -1)
        f["late"][g] = eL - np.median(E, axis=1)
        # per waiter means of the parts (what the evidence quotes)
        f["cx"][g] = parts[0].sum(axis=1) / nw
        f["xd"][g] = parts[1].sum(axis=1) / nw
        f["b"][g] = parts[2].sum(axis=1) / nw
        uL = units[L]
        others = np.where(units[None, :] == uL[:, None], -np.inf, E).max(axis=1)
        f["held"][g] = np.where(sync & np.isfinite(others), eL - others, 0.0)
        f["px"][g] = comb[F_X][back[rows, L, 0]]  # the waitee left its previous collective
        f["e"][g] = eL
        attributed[g] = ok
