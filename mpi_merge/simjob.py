"""In-memory simulated collective timelines (a test and benchmark tool; every result is synthetic).

Unlike synthetic.py, which writes node files for the whole merge, this builds the straggler analysis's
own inputs directly, CommSummary and AlignedRows per communicator, so a job of 16384 ranks is judged
in seconds. The model, per iteration and step: every rank taking part computes (lognormal around the
step's mean, times a per-rank slow-down factor, plus with some chance a time slice lost to another task
sharing its core), then enters a blocking collective on each communicator of the step it belongs to;
the collective completes its own time after the last arrival and each rank leaves after an
exponential exit jitter plus a fixed per-rank exit offset of its communicator (the asymmetry of small
communicators' algorithms: the second rank of a 2-rank Allreduce leaves later). Aligned times carry a
residual clock error per node, uniform within +-clock_error_us, which is also what the caller is told.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gpuprof.mpi_merge.common import read_rows
from gpuprof.mpi_merge.loading import Series
from gpuprof.mpi_merge.waitstates import CommSummary, CommWaits

SIM_COMM_BASE = 0x51A0_0000_0000_0000


@dataclass
class MemRows:
    """stragglers.AlignedRows over in-memory [seq x rank] tables."""

    E: np.ndarray
    X: np.ndarray

    def enter(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        return read_rows(self.E, seqs, 0, ranks)

    def exit(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        return read_rows(self.X, seqs, 0, ranks)


@dataclass
class Step:
    compute_ms: float  # mean compute before the step's collectives
    comms: list[int]  # indices of the communicators whose collective each member then calls


@dataclass
class SimJob:
    ranks: int
    comms: list[np.ndarray]  # world ranks of each communicator, in communicator rank order
    steps: list[Step]
    iterations: int = 200
    ranks_per_node: int = 1
    sigma: float = 0.03  # lognormal sigma of compute times
    share_prob: float = 0.0  # chance per rank and step of losing a slice to a task on the same core
    share_slice_ms: float = 1.0  # that slice, uniform up to this
    collective_us: float = 50.0
    exit_jitter_us: float = 5.0
    exit_asym_us: dict[int, np.ndarray] = field(default_factory=dict)  # comm -> [size] fixed exit offsets
    slow: dict[int, float] = field(default_factory=dict)  # world rank -> compute factor
    slow_from_iter: int = 0  # the slow-down starts here
    # world rank -> (chance, mean in us): its collectives return that much later (exponential) by chance
    slow_exit: dict[int, tuple[float, float]] = field(default_factory=dict)
    # world rank -> (chance per step, ms): the rank is stopped that long (SIGSTOP from outside) by chance
    stall: dict[int, tuple[float, float]] = field(default_factory=dict)
    clock_error_us: float = 0.0
    seed: int = 1


@dataclass
class SimResult:
    comms: list[CommSummary]
    times: list[MemRows]
    node_names: list[str]
    clock_error_ns: np.ndarray
    node_series: list[dict[str, Series]]


def simulate(job: SimJob) -> SimResult:
    rng = np.random.default_rng(job.seed)
    R = job.ranks
    node = np.arange(R) // job.ranks_per_node
    n_nodes = int(node.max()) + 1
    clock = rng.uniform(-1, 1, n_nodes) * job.clock_error_us * 1e3
    n_inst = [0] * len(job.comms)
    for s in job.steps:
        for c in s.comms:
            n_inst[c] += job.iterations
    E = [np.empty((n, len(m))) for n, m in zip(n_inst, job.comms)]
    X = [np.empty((n, len(m))) for n, m in zip(n_inst, job.comms)]
    k = [0] * len(job.comms)
    factor = np.ones(R)
    free = np.zeros(R)
    for it in range(job.iterations):
        if it == job.slow_from_iter:
            for r, fct in job.slow.items():
                factor[r] = fct
        for s in job.steps:
            # every rank computes; a rank in none of the step's communicators just carries on
            comp = s.compute_ms * 1e6 * rng.lognormal(0.0, job.sigma, R) * factor
            if job.share_prob:
                hit = rng.random(R) < job.share_prob
                comp += np.where(hit, rng.uniform(0, job.share_slice_ms * 1e6, R), 0.0)
            for r, (chance, ms) in job.stall.items():
                if rng.random() < chance:
                    comp[r] += ms * 1e6
            ready = free + comp
            free = ready.copy()
            for c in s.comms:
                m = job.comms[c]
                last = ready[m].max()
                d = job.collective_us * 1e3 * (1 + np.log2(len(m)) / 4) * rng.lognormal(0.0, 0.1)
                ex = last + d + rng.exponential(job.exit_jitter_us * 1e3, len(m))
                if c in job.exit_asym_us:
                    ex = ex + job.exit_asym_us[c] * 1e3
                for r, (chance, mean_us) in job.slow_exit.items():
                    at = np.flatnonzero(m == r)
                    if len(at) and rng.random() < chance:
                        ex[at] += rng.exponential(mean_us * 1e3)
                E[c][k[c]] = ready[m] + clock[node[m]]
                X[c][k[c]] = ex + clock[node[m]]
                free[m] = ex
                k[c] += 1
    comms, times = [], []
    for ci, m in enumerate(job.comms):
        comms.append(summarize(SIM_COMM_BASE + ci, E[ci], X[ci], node[m], 1000 + m))
        times.append(MemRows(E[ci], X[ci]))
    names = [f"sim{i:05d}" for i in range(n_nodes)]
    return SimResult(comms, times, names, np.full(n_nodes, job.clock_error_us * 1e3), [{} for _ in range(n_nodes)])


def summarize(comm_id: int, E: np.ndarray, X: np.ndarray, node_of_rank: np.ndarray,
              pid_of_rank: np.ndarray) -> CommSummary:
    """The wait-state pass of an all-Allreduce communicator, from its aligned tables."""
    n, size = E.shape
    last = E.max(axis=1)
    w = CommWaits(comm_id, np.ones(n, bool), np.zeros(n, np.int8), np.argmax(E, axis=1).astype(np.int32), last,
                  np.median(X, axis=1) - last, last[:, None] - E)
    cs = CommSummary.empty(comm_id, size, n, np.asarray(node_of_rank, np.int64), np.asarray(pid_of_rank, np.int64))
    cs.add(0, w, E)
    return cs


def balanced_job(ranks: int, *, iterations: int = 240, pair_ranks: int = 64, seed: int = 1,
                 ranks_per_node: int = 4) -> SimJob:
    """A balanced job as real ones are noisy: lognormal compute (sigma 5 %), 2 % of steps losing up to
    1 ms to a task sharing the core, the first `pair_ranks` ranks also in 2-rank sub-communicators
    whose second rank always leaves 1 ms later (the other ranks in one sub-communicator, so all do
    the same work), 20 us of residual clock error per node. Per iteration: 10 ms of compute and a
    world Allreduce, then 1 ms and the sub-communicators' Allreduce."""
    world = np.arange(ranks)
    comms = [world]
    pairs = []
    n_pair = min(pair_ranks, ranks) // 2 * 2
    for a in range(0, n_pair, 2):
        pairs.append(len(comms))
        comms.append(np.array([a, a + 1]))
    second = list(pairs)
    if ranks - n_pair >= 2:  # every rank does the same work: the others in one sub-communicator
        second.append(len(comms))
        comms.append(np.arange(n_pair, ranks))
    steps = [Step(10.0, [0])] + ([Step(1.0, second)] if second else [])
    return SimJob(ranks, comms, steps, iterations=iterations, ranks_per_node=min(ranks_per_node, ranks),
                  sigma=0.05, share_prob=0.02, share_slice_ms=1.0, exit_asym_us={c: np.array([0.0, 1000.0]) for c in pairs},
                  clock_error_us=20.0, seed=seed)
