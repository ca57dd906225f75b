"""Synthetic workload generator: node files in trace format v1 with known ground truth.

A test and benchmark tool. Every file it writes carries `synthetic=True`, and every report made from
such files says SYNTHETIC at the top; nothing here is ever presented as measured data.

The model (all times in a "true" time axis, seconds from job start):
  * Each node's CLOCK_REALTIME reads  t + theta(t),  theta(t) = offset + drift*t + the integral of an
    NTP-like rate that changes by up to +-ntp_rate_ppm every ~ntp_interval_s. CLOCK_MONOTONIC is the
    realtime clock minus a per-node boot epoch (both are slewed by NTP alike), so /clock/pairs holds
    the exact mapping and the remaining error is theta, which only the collectives can reveal.
  * Ranks run an iteration loop: compute, then a blocking collective on one world communicator
    (or on disjoint sub-communicators). A collective completes `collective_us` after its last rank
    entered; each rank returns after an exponential exit jitter, plus an optional per-rank bias that
    grows along the ring (the case no clock method can fully see).
  * Stragglers: "gpu" (longer compute, higher SM activity), "host" (longer compute, GPU starved,
    CPU busy and off-CPU time), "network" (the collective returns late on that node in about half
    the instances of the episode, so the node arrives late next time with normal compute).

Memory stays bounded at any job size (4096 nodes x 8 ranks is the largest the CLI takes, what the
merge at scale is measured with). The collective timeline is simulated in blocks of instances of at
most TIMELINE_BLOCK_CELLS (instance x rank) cells, written to a scratch file in the output directory
and read back one node's ranks at a time; node files are written one at a time. The generator
therefore holds: about six float64 arrays of one block (16 MB each at the default: 80 MB at the
peak whatever the job's size), per-instance vectors (the collective durations, ops, each
straggler's episode: tens of bytes per instance), per-rank vectors (communicator, rank within it,
the last exit jitter: tens of bytes per rank), one node's calls while writing it (79 bytes per call
of its ranks, twice while sorting) and the ground truth (per node its clock: a few hundred bytes).
Not the [instance x rank] tables of the job, which the scratch file holds (16 bytes a cell: 0.5 GB
for 4096 x 8 ranks over 10 s at a collective every 10 ms, 3.1 GB over 60 s; unlinked from the start,
so it goes when the generator ends, however it ends). The whole process peaked at 200 MB RSS for
4096 x 8 ranks over 10 s and 211 MB over 60 s (the whole-table version: 2050 MB over 10 s).

The output does not depend on the block size: the random draws keep the order of a whole-table
simulation (see `simulate`), so the files of a job are the same as before the blocks, bit for bit.

`python -m gpuprof.mpi_merge.synthetic --nodes N --out DIR` writes DIR/<node>.h5 and DIR/ground_truth.json.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import click
import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.writer import NodeMeta, NodeTraceWriter

WORLD_COMM_ID = 0x5EED_0000_0000_0001
SUB_COMM_BASE = 0x5EED_0000_0001_0000
EPOCH_NS = 1_790_000_000_000_000_000  # a fixed realtime epoch keeps runs reproducible
OP_ALLREDUCE = schema.COLLECTIVE_OPS.index("MPI_Allreduce")
OP_BCAST = schema.COLLECTIVE_OPS.index("MPI_Bcast")
OP_BARRIER = schema.COLLECTIVE_OPS.index("MPI_Barrier")
CAUSES = ("gpu", "host", "network")
# (instance x rank) cells of one block of the simulated timeline: 16 MB a float64 array, of which
# the simulation holds a handful at a time (the generator's memory bound, module docstring)
TIMELINE_BLOCK_CELLS = 1 << 21
MAX_NODES = 4096  # the CLI's limit: the largest job generated and merged so far (docs/merge.md, "At scale")


class SynthConfigError(ValueError):
    """A configuration the generator cannot simulate (the message names the field)."""


@dataclass
class Straggler:
    node: int  # node index
    cause: str  # one of CAUSES
    start_s: float
    end_s: float
    severity: float = 0.3  # gpu/host: compute slow-down factor - 1; network: mean extra delay in ms


@dataclass
class SynthConfig:
    nodes: int = 8
    duration_s: float = 60.0
    period_ms: float = 10.0
    ranks_per_node: int = 1
    gpus_per_node: int = 1
    seed: int = 1
    job_id: str = "4242"
    offset_ms: float = 10.0
    drift_ppm: float = 50.0
    ntp_rate_ppm: float = 2.0
    ntp_interval_s: float = 200.0
    exit_jitter_us: float = 5.0
    exit_bias_us: float = 0.0  # per-rank exit delay growing linearly to this along the ring
    compute_noise: float = 0.02
    collective_us: float = 50.0
    metric_rate_hz: float = 10.0
    same_host: bool = False  # all virtual nodes on one host: one clock, offsets must come out zero
    disjoint_comms: int = 0  # >1: ranks split into this many communicators with no world collective
    op_mix: bool = True  # every 10th a Bcast, every 50th a Barrier
    stragglers: list[Straggler] = field(default_factory=list)
    hang_at_seq: int | None = None  # the job hangs at this seq: the culprit never enters it
    hang_culprit: int = 0  # node index of the culprit rank (its first local rank)
    hang_kind: str = "missing"  # "missing" (culprit never arrives) or "op" (culprit calls another op)
    missing_nodes: list[int] = field(default_factory=list)  # files not written
    cutoff_nodes: dict[int, float] = field(default_factory=dict)  # node -> time its collector died
    idle_gpus: list[tuple[int, int]] = field(default_factory=list)  # (node, gpu) left idle
    write_bulk: bool = True  # write GPU/host tables (benchmarks of the clock fit skip them)
    # NCCL-only job as NCCL's profiler plugin records it: each call's host enqueue in
    # /collectives/calls (path nccl_profiler) and its kernel's device-side start and end (the
    # simulated arrival and completion) in /collectives/device_times, mapped to the host clock with
    # a Gaussian error of device_map_error_us. The host runs ahead of its GPU by 30-70 % of the
    # compute interval, except a "host" straggler's in its episode, which enqueues just in time.
    nccl: bool = False
    device_map_error_us: float = 1.0
    # NVTX ranges on every rank's compute interval: "step" around "forward" (40 % of the nominal
    # interval), "backward" (what is left: a slow rank's extra time) and "optimizer" (10 %)
    nvtx: bool = False
    # CUDA kernels as CUPTI records them (mode kernels): per compute interval "sgemm" for 50 % of the
    # nominal interval and "elementwise" for 20 %; a "gpu" straggler's extra time is in longer sgemms
    cupti: bool = False


def node_name(i: int, nodes: int = 0) -> str:
    """node000, node001, ...; in a job of more than 1000 nodes every name has as many digits as its
    last node's (node0000 ... node4095), so that names sort in node order: the merge orders node
    files by name."""
    return f"node{i:0{max(3, len(str(nodes - 1)))}d}"


# --- clocks --------------------------------------------------------------------------------------
@dataclass
class NodeClock:
    offset_ns: float
    drift_ppm: float
    knots_s: np.ndarray  # times where the NTP rate changes (first is 0)
    rates_ppm: np.ndarray  # extra rate from each knot on
    boot_ns: int  # realtime - monotonic

    def theta_ns(self, t_s: np.ndarray | float) -> np.ndarray:
        """realtime - true time at true time t (ns)."""
        t = np.asarray(t_s, dtype=np.float64)
        # integral of the piecewise-constant extra rate: piecewise linear, exact at the knots
        seg = np.diff(self.knots_s, append=self.knots_s[-1] + 1e9)
        cum = np.concatenate([[0.0], np.cumsum(self.rates_ppm * seg)[:-1]]) * 1e3  # ppm*s -> ns
        idx = np.clip(np.searchsorted(self.knots_s, t, side="right") - 1, 0, len(self.knots_s) - 1)
        extra = cum[idx] + self.rates_ppm[idx] * (t - self.knots_s[idx]) * 1e3
        return self.offset_ns + self.drift_ppm * t * 1e3 + extra

    def to_monotonic_ns(self, t_s: np.ndarray) -> np.ndarray:
        rt_rel = np.asarray(t_s, dtype=np.float64) * 1e9 + self.theta_ns(t_s)  # realtime - EPOCH
        return (np.round(rt_rel).astype(np.int64) + (EPOCH_NS - self.boot_ns)).astype(np.uint64)


def make_clocks(cfg: SynthConfig, rng: np.random.Generator) -> list[NodeClock]:
    clocks = []
    host_clock: NodeClock | None = None
    for i in range(cfg.nodes):
        if cfg.same_host and host_clock is not None:
            clocks.append(host_clock)
            continue
        n_knots = max(1, int(cfg.duration_s / cfg.ntp_interval_s) + 2)
        gaps = rng.uniform(0.75, 1.25, n_knots) * cfg.ntp_interval_s
        knots = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])
        c = NodeClock(
            offset_ns=float(rng.uniform(-1, 1) * cfg.offset_ms * 1e6),
            drift_ppm=float(rng.uniform(-1, 1) * cfg.drift_ppm),
            knots_s=knots,
            rates_ppm=rng.uniform(-1, 1, n_knots) * cfg.ntp_rate_ppm,
            boot_ns=int(EPOCH_NS - rng.integers(10**12, 10**14)),
        )
        clocks.append(c)
        host_clock = c
    return clocks


# --- the timeline --------------------------------------------------------------------------------
class Timeline:
    """True enter and exit times of every rank's collectives, [instance x rank], kept in a scratch
    file rather than in memory. Block b of `block_rows` instances (the last one may be shorter) is
    stored at the offset of its first instance as two rank-major arrays, enter then exit, so that the
    ranks of one node are one contiguous read per block and array."""

    def __init__(self, scratch: BinaryIO, n_instances: int, n_ranks: int, block_rows: int, ops: np.ndarray,
                 comm_of_rank: np.ndarray, comm_rank: np.ndarray, comm_sizes: list[int], last_exit_s: float):
        self.scratch = scratch
        self.n_instances = n_instances
        self.n_ranks = n_ranks
        self.block_rows = block_rows
        self.ops = ops  # [K]
        self.comm_of_rank = comm_of_rank  # [R] communicator index
        self.comm_rank = comm_rank  # [R] rank within its communicator
        self.comm_sizes = comm_sizes
        self.last_exit_s = last_exit_s  # the latest exit of the last instance

    def write_block(self, enter_s: np.ndarray, exit_s: np.ndarray) -> None:
        """Append the next block, [rows x R] each (blocks arrive in instance order)."""
        for a in (enter_s, exit_s):
            self.scratch.write(np.ascontiguousarray(a.T, dtype=np.float64).data)

    def ranks(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Enter and exit times of ranks first .. first+count-1, [K x count] each."""
        enter = np.empty((self.n_instances, count))
        exit_ = np.empty((self.n_instances, count))
        self.scratch.flush()  # the reads below go to the file descriptor, past the write buffer
        fd = self.scratch.fileno()
        for k0 in range(0, self.n_instances, self.block_rows):
            rows = min(self.block_rows, self.n_instances - k0)
            base = 2 * self.n_ranks * k0 * 8
            for j, out in enumerate((enter, exit_)):
                offset = base + (j * self.n_ranks + first) * rows * 8
                want = count * rows * 8
                buf = os.pread(fd, want, offset)
                if len(buf) != want:
                    raise OSError(f"the synthetic timeline's scratch file (in the output directory) ends at "
                                  f"byte {offset + len(buf)}, instances {k0}-{k0 + rows - 1} need {offset + want}")
                out[k0:k0 + rows] = np.frombuffer(buf, dtype=np.float64).reshape(count, rows).T
        return enter, exit_


def _fork(rng: np.random.Generator) -> np.random.Generator:
    """A generator that draws what `rng` would draw next (rng itself is not advanced)."""
    bit_generator = type(rng.bit_generator)()
    bit_generator.state = rng.bit_generator.state
    return np.random.Generator(bit_generator)


def simulate(cfg: SynthConfig, rng: np.random.Generator, scratch: BinaryIO) -> Timeline:
    """The job's collectives in true time, written into `scratch` by blocks of instances.

    The draws keep the order of the whole-table simulation this replaces (compute noise of every
    (instance, rank) in row order, then exit jitter of every one, then per-instance durations and the
    network stragglers' draws), so the files do not depend on the block size: a generator is forked
    at the start of each kind of draw and `rng` skips over that kind's draws, in blocks, to the next.
    The skipping draws every table value twice, the price of output identical to earlier versions."""
    R = cfg.nodes * cfg.ranks_per_node
    K = int(cfg.duration_s * 1e3 / cfg.period_ms)
    if K < 1:
        raise SynthConfigError(f"duration_s={cfg.duration_s} with period_ms={cfg.period_ms} gives no collective")
    if cfg.disjoint_comms > R:
        raise SynthConfigError(f"disjoint_comms={cfg.disjoint_comms} is more communicators than the job's {R} ranks")
    period = cfg.period_ms * 1e-3
    block_rows = max(1, TIMELINE_BLOCK_CELLS // R)
    blocks = [(k0, min(K, k0 + block_rows)) for k0 in range(0, K, block_rows)]
    node_of_rank = np.arange(R) // cfg.ranks_per_node

    noise_rng = _fork(rng)
    for k0, k1 in blocks:
        rng.standard_normal((k1 - k0, R))
    jitter_rng = _fork(rng)
    for k0, k1 in blocks:
        rng.exponential(cfg.exit_jitter_us * 1e-6, (k1 - k0, R))
    exit_bias = (np.arange(R) / max(1, R - 1)) * cfg.exit_bias_us * 1e-6 if cfg.exit_bias_us else None
    d = cfg.collective_us * 1e-6 * (1.0 + 0.1 * rng.standard_normal(K)).clip(0.5)
    t_nominal = np.arange(K) * (period + cfg.collective_us * 1e-6)
    # per straggler, in the configuration's order (overlapping episodes compound in that order):
    # its instances and ranks, and a compute factor or, per instance hit, the extra exit delay
    slow: list[tuple[np.ndarray, np.ndarray, float]] = []
    late: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for s in cfg.stragglers:
        ep = (t_nominal >= s.start_s) & (t_nominal < s.end_s)
        cols = np.flatnonzero(node_of_rank == s.node)
        if s.cause in ("gpu", "host"):
            slow.append((ep, cols, 1.0 + s.severity))
        else:
            hit = ep & (rng.random(K) < 0.5)
            extra = np.zeros(K)
            extra[hit] = rng.exponential(s.severity * 1e-3, int(hit.sum()))
            late.append((hit, cols, extra))

    if cfg.disjoint_comms > 1:
        comm_of_rank = np.arange(R) * cfg.disjoint_comms // R
    else:
        comm_of_rank = np.zeros(R, dtype=np.int64)
    n_comms = int(comm_of_rank.max()) + 1
    comm_rank = np.zeros(R, dtype=np.int64)
    sizes = []
    spans = []  # a communicator's ranks are contiguous: comm_of_rank does not decrease
    for c in range(n_comms):
        cols = np.flatnonzero(comm_of_rank == c)
        comm_rank[cols] = np.arange(len(cols))
        sizes.append(len(cols))
        spans.append(slice(int(cols[0]), int(cols[-1]) + 1))
    ops = np.full(K, OP_ALLREDUCE, dtype=np.uint8)
    if cfg.op_mix:
        ops[np.arange(K) % 10 == 9] = OP_BCAST
        ops[np.arange(K) % 50 == 49] = OP_BARRIER

    tl = Timeline(scratch, K, R, block_rows, ops, comm_of_rank, comm_rank, sizes, 0.0)
    # carried from one block to the next: each communicator's last completion, each rank's last jitter
    t_last = np.zeros(n_comms)
    j_last = np.zeros(R)
    X = np.empty((0, R))
    for k0, k1 in blocks:
        C = period * (1.0 + cfg.compute_noise * noise_rng.standard_normal((k1 - k0, R)))
        J = jitter_rng.exponential(cfg.exit_jitter_us * 1e-6, (k1 - k0, R))
        if exit_bias is not None:
            J += exit_bias
        for ep, cols, factor in slow:
            C[np.ix_(ep[k0:k1], cols)] *= factor
        for hit, cols, extra in late:
            rows = hit[k0:k1]
            J[np.ix_(rows, cols)] += extra[k0:k1][rows][:, None]
        E = np.empty((k1 - k0, R))
        X = np.empty((k1 - k0, R))
        for c, span in enumerate(spans):
            Cc, Jc = C[:, span], J[:, span]
            # T_k - T_{k-1} = max_r (J_{k-1,r} + C_{k,r}) + d_k: the loop vectorizes into a cumsum
            # (an accumulate adds in order, so starting it from the carry gives the whole-table sums)
            prev_j = np.vstack([j_last[None, span], Jc[:-1]])
            step = (prev_j + Cc).max(axis=1) + d[k0:k1]
            T = np.cumsum(np.concatenate([[t_last[c]], step]))[1:]
            T_prev = np.concatenate([[t_last[c]], T[:-1]])
            E[:, span] = T_prev[:, None] + prev_j + Cc
            X[:, span] = T[:, None] + Jc
            t_last[c] = T[-1]
        j_last = J[-1].copy()
        tl.write_block(E, X)
    tl.last_exit_s = float(np.nanmax(X[-1]))
    return tl


# --- writing -------------------------------------------------------------------------------------
def _metric_series(cfg: SynthConfig, node: int, t_s: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """GPU and host levels per sample time: peers wait in collectives, stragglers differ."""
    sm = 80.0 + 2.0 * rng.standard_normal(len(t_s))
    cpu = 1.0 + 0.05 * rng.standard_normal(len(t_s))  # cores per rank
    busy = 0.30 + 0.02 * rng.standard_normal(len(t_s))
    for s in cfg.stragglers:
        if s.node != node:
            continue
        ep = (t_s >= s.start_s) & (t_s < s.end_s)
        if s.cause == "gpu":
            sm[ep] = 96.0 + 1.0 * rng.standard_normal(int(ep.sum()))
        elif s.cause == "host":
            sm[ep] = 60.0 + 2.0 * rng.standard_normal(int(ep.sum()))
            cpu[ep] = 1.9 + 0.05 * rng.standard_normal(int(ep.sum()))
            busy[ep] = 0.75 + 0.02 * rng.standard_normal(int(ep.sum()))
    return {"sm": sm.clip(0, 100), "cpu": cpu.clip(0.01), "busy": busy.clip(0, 1)}


def write_node(
    cfg: SynthConfig, out: Path, i: int, clock: NodeClock, tl: Timeline, rng: np.random.Generator
) -> Path:
    name = node_name(i, cfg.nodes)
    path = out / f"{name}.h5"
    cut_s = cfg.cutoff_nodes.get(i)
    K = tl.n_instances
    end_s = tl.last_exit_s + 0.5
    if cut_s is not None:
        end_s = min(end_s, cut_s)
    modes = ("metrics", "collectives", "kernels") if cfg.cupti else ("metrics", "collectives")
    hostname = "synthhost" if cfg.same_host else f"{name}-host"
    boot_id = "synthetic-boot-shared" if cfg.same_host else f"synthetic-boot-{i}"
    meta = NodeMeta(
        job_id=cfg.job_id, node=name, modes=modes, rates={"nvml": cfg.metric_rate_hz, "host": cfg.metric_rate_hz},
        config={"generator": "gpuprof.mpi_merge.synthetic"}, synthetic=True, hostname=hostname, boot_id=boot_id,
    )
    start_mono = int(clock.to_monotonic_ns(np.array([-1.0]))[0])
    w = NodeTraceWriter(
        path, meta, schema.tables_for_modes(modes), compression="gzip",
        start_monotonic_ns=start_mono, start_realtime_ns=start_mono + clock.boot_ns,
    )
    # (monotonic, realtime) pairs every second: realtime = monotonic + boot epoch, exactly.
    tp = np.arange(-1.0, end_s, 1.0)
    pairs = schema.CLOCK_PAIRS.empty(len(tp))
    pairs["monotonic_ns"] = clock.to_monotonic_ns(tp)
    pairs["realtime_ns"] = pairs["monotonic_ns"].astype(np.int64) + clock.boot_ns
    pairs["uncertainty_ns"] = 200
    w.append(schema.CLOCK_PAIRS.path, pairs)

    # collectives of this node's ranks
    ranks = np.arange(i * cfg.ranks_per_node, (i + 1) * cfg.ranks_per_node)
    node_enter, node_exit = tl.ranks(int(ranks[0]), len(ranks))
    rows = []
    dev: list[np.ndarray] = []

    def prev_exit_of(lr: int, ks: np.ndarray) -> np.ndarray:
        """When local rank lr left the instance before each of ks (true s; the first: its arrival)."""
        x = node_exit[:, lr]
        return np.where(ks > 0, x[np.maximum(ks - 1, 0)], node_enter[ks, lr])

    for lr, r in enumerate(ranks):
        ks = np.arange(K)
        enter, exit_ = node_enter[:, lr].copy(), node_exit[:, lr].copy()
        ops = tl.ops.copy()
        returned = np.ones(K, dtype=bool)
        if cfg.hang_at_seq is not None:
            h = cfg.hang_at_seq
            culprit = r == cfg.hang_culprit * cfg.ranks_per_node
            if cfg.hang_kind == "missing" and culprit:
                keep = ks < h
            else:
                keep = ks <= h
                returned[h] = False
                if cfg.hang_kind == "op" and culprit:
                    ops[h] = OP_BARRIER if ops[h] != OP_BARRIER else OP_ALLREDUCE
            enter, exit_, ops, ks, returned = enter[keep], exit_[keep], ops[keep], ks[keep], returned[keep]
        if cut_s is not None:
            keep = exit_ < cut_s
            enter, exit_, ops, ks, returned = enter[keep], exit_[keep], ops[keep], ks[keep], returned[keep]
        c = schema.COLLECTIVE_CALLS.empty(len(ks))
        c["t_enter_ns"] = clock.to_monotonic_ns(enter)
        c["t_exit_ns"] = np.where(returned, clock.to_monotonic_ns(exit_), 0)
        c["pid"] = 10_000 + lr
        c["tid"] = 10_000 + lr
        c["library"] = 0
        c["op"] = ops
        comm = int(tl.comm_of_rank[r])
        c["comm_id"] = WORLD_COMM_ID if cfg.disjoint_comms <= 1 else SUB_COMM_BASE + comm
        c["seq"] = ks
        c["comm_rank"] = tl.comm_rank[r]
        c["comm_size"] = tl.comm_sizes[comm]
        c["bytes"] = np.where(ops == OP_BARRIER, 0, 4 << 20)
        c["root_or_peer"] = np.where(ops == OP_BCAST, 0, -1)
        c["tag"] = -1
        c["path"] = 1
        c["handle"] = 0x84000000 + comm
        if cfg.nccl:
            dev.append(_as_nccl(cfg, c, enter, exit_, returned, clock, i, int(r), prev_exit_of(lr, ks)))
        rows.append(c)
    calls = np.concatenate(rows) if rows else schema.COLLECTIVE_CALLS.empty()
    w.append(schema.COLLECTIVE_CALLS.path, np.sort(calls, order="t_enter_ns"))
    if cfg.nvtx:
        nv = [_nvtx_ranges(cfg, 10_000 + lr, node_enter[:, lr], prev_exit_of(lr, np.arange(K)), clock)
              for lr in range(len(ranks))]
        w.append(schema.NVTX_RANGES.path, np.sort(np.concatenate([r for r, _ in nv]), order="t_start_ns"))
        w.append(schema.NVTX_STRINGS.path, np.concatenate([t for _, t in nv]))
    if cfg.cupti:
        kx = [_cupti_kernels(cfg, 10_000 + lr, node_enter[:, lr], prev_exit_of(lr, np.arange(K)), clock)
              for lr in range(len(ranks))]
        for table in (schema.KERNEL_ACTIVITY, schema.KERNEL_ACTIVITY_NAMES, schema.KERNEL_ACTIVITY_LAUNCHES,
                      schema.KERNEL_LAUNCHES):
            table_rows = np.concatenate([k[table.path] for k in kx])
            first = table.columns[0].name  # the time column, except for the names
            w.append(table.path, table_rows if table is schema.KERNEL_ACTIVITY_NAMES else np.sort(table_rows, order=first))
        w.append(schema.STACK_FRAMES.path, LAUNCH_FRAMES)
        w.append(schema.STACK_SYMBOLS.path, LAUNCH_SYMBOLS)
    if cfg.nccl:
        w.append(schema.DEVICE_TIMES.path, np.concatenate(dev) if dev else schema.DEVICE_TIMES.empty())
    comms = schema.COMMUNICATORS.empty(len(ranks))
    comms["t_ns"] = clock.to_monotonic_ns(np.full(len(ranks), -0.5))
    comms["pid"] = 10_000 + np.arange(len(ranks))
    comms["op"] = schema.COMMUNICATOR_OPS.index("MPI_Init")
    for j, r in enumerate(ranks):
        comm = int(tl.comm_of_rank[r])
        comms["comm_id"][j] = WORLD_COMM_ID if cfg.disjoint_comms <= 1 else SUB_COMM_BASE + comm
        comms["comm_rank"][j] = tl.comm_rank[r]
        comms["comm_size"][j] = tl.comm_sizes[comm]
    w.append(schema.COMMUNICATORS.path, comms)

    if cfg.write_bulk:
        _write_metrics(cfg, w, i, clock, ranks, end_s, rng)
    if cut_s is not None:
        w.close_unsealed()
        with h5py.File(path, "r+") as f:
            f.attrs["partial_reason"] = f"synthetic: collector killed at t={cut_s:.1f} s"
    else:
        w.seal(drops={"nvml": 0, "host": 0, "collectives": 0})
        with h5py.File(path, "r+") as f:  # seal stamps the generator's own clock: use the model's
            f.attrs["end_monotonic_ns"] = np.uint64(clock.to_monotonic_ns(np.array([end_s]))[0])
            f.attrs["end_realtime_ns"] = np.int64(_realtime_of(clock, end_s))
    return path


NVTX_PHASES = ("step", "forward", "backward", "optimizer")


def _nvtx_ranges(cfg: SynthConfig, pid: int, enter: np.ndarray, prev_exit: np.ndarray,
                 clock: NodeClock) -> tuple[np.ndarray, np.ndarray]:
    """One rank's NVTX ranges and strings: per compute interval a "step" with its three phases."""
    nominal = cfg.period_ms * 1e-3
    k = len(enter)
    fwd0 = prev_exit
    bwd0 = fwd0 + 0.4 * nominal
    opt0 = np.maximum(enter - 0.1 * nominal, bwd0)
    bounds = [(prev_exit, enter, 1, 0), (fwd0, bwd0, 2, 1), (bwd0, opt0, 3, 1), (opt0, enter, 4, 1)]
    r = schema.NVTX_RANGES.empty(4 * k)
    for j, (a, b, name, depth) in enumerate(bounds):
        sl = slice(j * k, (j + 1) * k)
        r["t_start_ns"][sl] = clock.to_monotonic_ns(a)
        r["t_end_ns"][sl] = clock.to_monotonic_ns(np.maximum(a, b))
        r["name_id"][sl] = name
        r["depth"][sl] = depth
    r["pid"] = pid
    r["tid"] = pid
    r["kind"] = schema.NVTX_RANGES.enums["kind"].index("push_pop")
    t = schema.NVTX_STRINGS.empty(len(NVTX_PHASES))
    t["pid"] = pid
    t["string_id"] = np.arange(1, len(NVTX_PHASES) + 1)
    t["text"] = [n.encode() for n in NVTX_PHASES]
    return r, t


CUPTI_KERNELS = ("sgemm_128x64_nn", "elementwise_add")
# the CPU stacks the kernels are launched from (innermost first): stack id 1 for sgemm, 2 for elementwise
LAUNCH_STACKS = (("cublasSgemm", "matmul", "forward", "train_step", "main"), ("launch_add", "optimizer", "main"))
_NAMES = sorted({n for st in LAUNCH_STACKS for n in st})
LAUNCH_SYMBOLS = schema.STACK_SYMBOLS.empty(len(_NAMES))
LAUNCH_SYMBOLS["symbol_id"] = np.arange(1, len(_NAMES) + 1)
LAUNCH_SYMBOLS["name"] = [n.encode() for n in _NAMES]
LAUNCH_SYMBOLS["module"] = b"train"
LAUNCH_FRAMES = np.concatenate([
    np.array([(sid, depth, _NAMES.index(name) + 1) for depth, name in enumerate(st)], schema.STACK_FRAMES.dtype)
    for sid, st in enumerate(LAUNCH_STACKS, start=1)])
LAUNCH_LEAD_NS = 20_000  # the launch call, this long before its kernel starts


def _cupti_kernels(cfg: SynthConfig, pid: int, enter: np.ndarray, prev_exit: np.ndarray,
                   clock: NodeClock) -> dict[str, np.ndarray]:
    """One rank's kernel executions, their names, their launch calls as CUPTI's callbacks and the
    uprobes see them (with the CPU stack of each): per compute interval an sgemm (what the interval
    has beyond its nominal 30 % of other work and 20 % elementwise) then an elementwise."""
    nominal = cfg.period_ms * 1e-3
    k = len(enter)
    gemm_end = np.maximum(enter - 0.2 * nominal, prev_exit)
    gemm_start = np.minimum(prev_exit + 0.3 * nominal, gemm_end)
    r = schema.KERNEL_ACTIVITY.empty(2 * k)
    for j, (a, b) in enumerate(((gemm_start, gemm_end), (gemm_end, enter))):
        sl = slice(j * k, (j + 1) * k)
        r["t_start_ns"][sl] = clock.to_monotonic_ns(a)
        r["t_end_ns"][sl] = clock.to_monotonic_ns(np.maximum(a, b))
        r["name_id"][sl] = j + 1
        r["correlation_id"][sl] = 2 * np.arange(k) + j + 1
    r["pid"] = pid
    r["grid_x"], r["block_x"] = 256, 128
    n = schema.KERNEL_ACTIVITY_NAMES.empty(len(CUPTI_KERNELS))
    n["pid"] = pid
    n["name_id"] = np.arange(1, len(CUPTI_KERNELS) + 1)
    n["name"] = [x.encode() for x in CUPTI_KERNELS]
    al = schema.KERNEL_ACTIVITY_LAUNCHES.empty(len(r))
    al["t_ns"] = r["t_start_ns"] - LAUNCH_LEAD_NS
    al["pid"], al["tid"], al["correlation_id"] = pid, pid, r["correlation_id"]
    al["domain"] = schema.KERNEL_ACTIVITY_LAUNCHES.enums["domain"].index("runtime_api")
    kl = schema.KERNEL_LAUNCHES.empty(len(r))
    kl["t_ns"] = al["t_ns"]
    kl["pid"], kl["tid"] = pid, pid
    kl["user_stack"] = r["name_id"]  # sgemm from stack 1, elementwise from stack 2
    return {schema.KERNEL_ACTIVITY.path: r, schema.KERNEL_ACTIVITY_NAMES.path: n,
            schema.KERNEL_ACTIVITY_LAUNCHES.path: al, schema.KERNEL_LAUNCHES.path: kl}


NCCL_OP_OF = {OP_ALLREDUCE: schema.COLLECTIVE_OPS.index("ncclAllReduce"),
              OP_BCAST: schema.COLLECTIVE_OPS.index("ncclBroadcast"),
              OP_BARRIER: schema.COLLECTIVE_OPS.index("ncclAllReduce")}  # NCCL has no barrier: a 1-element allreduce
ENQUEUE_US = 8.0  # host time of an NCCL call (it returns once the work is queued)
LAUNCH_US = 10.0  # from enqueue to the kernel's start on an idle GPU


def _as_nccl(cfg: SynthConfig, c: np.ndarray, enter: np.ndarray, exit_: np.ndarray, returned: np.ndarray,
             clock: NodeClock, node: int, rank: int, prev_exit: np.ndarray) -> np.ndarray:
    """Turn one rank's calls `c` (MPI-shaped, in place) into what the NCCL profiler plugin records;
    returns its /collectives/device_times rows. enter/exit: the kernel's true start and end (s)."""
    rng = np.random.default_rng([cfg.seed, node, rank, 7])  # its own draws: the MPI mode's stay as they were
    n = len(c)
    launch = LAUNCH_US * 1e-6
    # the host's own work per iteration is the same on every rank (a "gpu" straggler's longer GPU
    # work does not delay its host); it enqueues as soon as it is done, at the latest one launch
    # before the kernel starts
    host_work = cfg.period_ms * 1e-3 * rng.uniform(0.3, 0.7, n)
    host = np.minimum(prev_exit + host_work, enter - launch)
    for s in cfg.stragglers:
        if s.node == node and s.cause == "host":  # the host is the bottleneck: the GPU waits for each enqueue
            ep = (enter >= s.start_s) & (enter < s.end_s)
            host[ep] = enter[ep] - launch * rng.uniform(1.0, 1.5, int(ep.sum()))
    c["t_enter_ns"] = clock.to_monotonic_ns(host)
    c["t_exit_ns"] = clock.to_monotonic_ns(host + ENQUEUE_US * 1e-6 * rng.uniform(0.8, 1.5, n))
    c["op"] = [NCCL_OP_OF.get(int(o), int(o)) for o in c["op"]]
    c["library"] = schema.COLLECTIVE_CALLS.enums["library"].index("nccl")
    c["path"] = schema.COLLECTIVE_CALLS.enums["path"].index("nccl_profiler")
    c["bytes"] = np.where(c["bytes"] == 0, 4, c["bytes"])
    d = schema.DEVICE_TIMES.empty(n)
    for f in ("pid", "comm_id", "seq", "op", "root_or_peer"):
        d[f] = c[f]
    err = cfg.device_map_error_us * 1e-6
    d["t_dev_start_ns"] = clock.to_monotonic_ns(enter + err * rng.standard_normal(n))
    d["t_dev_end_ns"] = np.where(returned, clock.to_monotonic_ns(exit_ + err * rng.standard_normal(n)), 0)
    en = schema.DEVICE_TIMES.enums
    d["timing"] = en["timing"].index("kernel_channel_gpu_timer")
    d["algorithm"] = en["algorithm"].index("ring")
    d["protocol"] = en["protocol"].index("simple")
    d["n_channels"] = 4
    d["count"] = c["bytes"] // 4
    d["datatype"] = en["datatype"].index("float32")
    return d


def _realtime_of(clock: NodeClock, t_s: float) -> int:
    # realtime = monotonic + boot epoch (boot_ns is the realtime of monotonic zero)
    return int(clock.to_monotonic_ns(np.array([t_s]))[0]) + int(clock.boot_ns)


def _write_metrics(
    cfg: SynthConfig, w: NodeTraceWriter, i: int, clock: NodeClock, ranks: np.ndarray, end_s: float,
    rng: np.random.Generator,
) -> None:
    ts = np.arange(0.0, end_s, 1.0 / cfg.metric_rate_hz)
    lv = _metric_series(cfg, i, ts, rng)
    mono = clock.to_monotonic_ns(ts)
    dev = schema.GPU_DEVICES.empty(cfg.gpus_per_node)
    dev["index"] = np.arange(cfg.gpus_per_node)
    dev["uuid"] = [f"GPU-synthetic-{i:03d}-{g}".encode() for g in range(cfg.gpus_per_node)]
    dev["name"] = b"Synthetic H100"
    dev["architecture"] = 9
    dev["memory_total_bytes"] = 80 << 30
    dev["gpm_supported"] = 1
    w.append(schema.GPU_DEVICES.path, dev)
    samples, gpm = [], []
    for g in range(cfg.gpus_per_node):
        idle = (i, g) in [tuple(x) for x in cfg.idle_gpus]
        s = schema.GPU_SAMPLES.empty(len(ts))
        s["t_ns"] = mono
        s["gpu"] = g
        util = np.zeros(len(ts)) if idle else np.minimum(100, lv["sm"] + 10)
        s["util_gpu"] = util
        s["util_mem"] = util * 0.5
        s["mem_used_bytes"] = 0 if idle else 40 << 30
        s["power_w"] = 70 if idle else 300 + 3 * lv["sm"]
        s["temp_c"] = 35 if idle else 60
        s["sm_clock_mhz"] = 1980
        s["mem_clock_mhz"] = 2619
        for col in ("pcie_tx_kbps", "pcie_rx_kbps", "nvlink_tx_kbps", "nvlink_rx_kbps"):
            s[col] = 0 if idle else 1e6
        s["throttle_reasons"] = 0
        s["ecc_sbe_total"] = 0
        s["ecc_dbe_total"] = 0
        samples.append(s)
        m = schema.GPU_GPM.empty(len(ts))
        m["t_ns"] = mono
        m["gpu"] = g
        m["interval_ns"] = int(1e9 / cfg.metric_rate_hz)
        m["sm_activity"] = 0 if idle else lv["sm"]
        m["sm_occupancy"] = 0 if idle else lv["sm"] * 0.6
        m["tensor_activity"] = 0 if idle else lv["sm"] * 0.5
        m["dram_bw_util"] = 0 if idle else 40
        gpm.append(m)
    w.append(schema.GPU_SAMPLES.path, np.sort(np.concatenate(samples), order="t_ns", kind="stable"))
    w.append(schema.GPU_GPM.path, np.sort(np.concatenate(gpm), order="t_ns", kind="stable"))
    procs = []
    dt = 1.0 / cfg.metric_rate_hz
    for lr in range(len(ranks)):
        p = schema.HOST_PROCS.empty(len(ts))
        p["t_ns"] = mono
        p["pid"] = 10_000 + lr
        p["cpu_time_ns"] = np.cumsum(lv["cpu"] * dt * 1e9).astype(np.uint64)
        p["rss_bytes"] = 8 << 30
        p["num_threads"] = 12
        p["voluntary_ctxsw"] = np.cumsum(np.full(len(ts), 50)).astype(np.uint64)
        p["involuntary_ctxsw"] = np.cumsum(np.full(len(ts), 5)).astype(np.uint64)
        procs.append(p)
    w.append(schema.HOST_PROCS.path, np.sort(np.concatenate(procs), order="t_ns", kind="stable"))
    hn = schema.HOST_NODE.empty(len(ts))
    hn["t_ns"] = mono
    hn["cpu_busy"] = lv["busy"]
    hn["cpu_iowait"] = 0.01
    hn["mem_used_bytes"] = 100 << 30
    hn["mem_total_bytes"] = 512 << 30
    hn["net_rx_bytes"] = np.cumsum(np.full(len(ts), 10 << 20)).astype(np.uint64)
    hn["net_tx_bytes"] = hn["net_rx_bytes"]
    hn["load1"] = 8.0
    w.append(schema.HOST_NODE.path, hn)


def ground_truth(cfg: SynthConfig, clocks: list[NodeClock], reference: int = 0) -> dict[str, Any]:
    """What the merge should find. Offsets are relative to the reference node's clock."""
    return {
        "synthetic": True,
        "config": _jsonable(asdict(cfg)),
        "reference_node": node_name(reference, cfg.nodes),
        "epoch_ns": EPOCH_NS,
        "nodes": [
            {
                "node": node_name(i, cfg.nodes),
                "offset_ns": c.offset_ns,
                "drift_ppm": c.drift_ppm,
                "ntp_knots_s": c.knots_s.tolist(),
                "ntp_rates_ppm": c.rates_ppm.tolist(),
                "boot_ns": c.boot_ns,
            }
            for i, c in enumerate(clocks)
        ],
        "stragglers": [
            {"node": node_name(s.node, cfg.nodes), "cause": s.cause, "start_s": s.start_s, "end_s": s.end_s}
            for s in cfg.stragglers
        ],
        "missing_nodes": [node_name(i, cfg.nodes) for i in cfg.missing_nodes],
        "cutoff_nodes": {node_name(i, cfg.nodes): t for i, t in cfg.cutoff_nodes.items()},
        "hang": None if cfg.hang_at_seq is None else {
            "seq": cfg.hang_at_seq, "culprit_node": node_name(cfg.hang_culprit, cfg.nodes), "kind": cfg.hang_kind,
        },
    }


def clock_from_truth(entry: dict[str, Any]) -> NodeClock:
    return NodeClock(
        offset_ns=entry["offset_ns"], drift_ppm=entry["drift_ppm"], knots_s=np.array(entry["ntp_knots_s"]),
        rates_ppm=np.array(entry["ntp_rates_ppm"]), boot_ns=int(entry["boot_ns"]),
    )


def true_relative_offset_ns(truth: dict[str, Any], node: str, t_s: np.ndarray) -> np.ndarray:
    """theta_node(t) - theta_reference(t): what the clock fit should recover, at true times t."""
    by = {n["node"]: n for n in truth["nodes"]}
    return clock_from_truth(by[node]).theta_ns(t_s) - clock_from_truth(by[truth["reference_node"]]).theta_ns(t_s)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def generate(cfg: SynthConfig, out: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the node files and ground_truth.json into `out`; return the ground truth."""
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(cfg.seed)
    clocks = make_clocks(cfg, rng)
    missing = set(cfg.missing_nodes)
    # the scratch file beside the output, not in /tmp (often a tmpfs: memory); unlinked at once
    with tempfile.TemporaryFile(dir=outp, prefix=".synthetic-timeline-") as scratch:
        tl = simulate(cfg, rng, scratch)
        for i in range(cfg.nodes):
            if i in missing:
                continue
            write_node(cfg, outp, i, clocks[i], tl, np.random.default_rng([cfg.seed, i]))
    truth = ground_truth(cfg, clocks)
    (outp / "ground_truth.json").write_text(json.dumps(truth, indent=1))
    return truth


def parse_straggler(spec: str) -> Straggler:
    """NODE:CAUSE[:START:END[:SEVERITY]], e.g. 3:gpu:10:40:0.3"""
    parts = spec.split(":")
    if len(parts) not in (2, 4, 5) or parts[1] not in CAUSES:
        raise click.BadParameter(f"{spec!r}: expected NODE:CAUSE[:START_S:END_S[:SEVERITY]], cause in {CAUSES}")
    s = Straggler(int(parts[0]), parts[1], 0.0, 1e12)
    if len(parts) >= 4:
        s.start_s, s.end_s = float(parts[2]), float(parts[3])
    if len(parts) == 5:
        s.severity = float(parts[4])
    return s


@click.command()
@click.option("--nodes", type=click.IntRange(1, MAX_NODES), default=8, show_default=True)
@click.option("--out", "out", type=click.Path(file_okay=False), required=True)
@click.option("--duration-s", type=float, default=60.0, show_default=True)
@click.option("--period-ms", type=float, default=10.0, show_default=True)
@click.option("--ranks-per-node", type=click.IntRange(1), default=1, show_default=True)
@click.option("--gpus-per-node", type=int, default=1, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--job-id", default="4242", show_default=True)
@click.option("--straggler", "stragglers", multiple=True, help="NODE:CAUSE[:START_S:END_S[:SEVERITY]]")
@click.option("--same-host", is_flag=True, help="all nodes share one clock (offsets must come out zero)")
@click.option("--hang-at-seq", type=int, default=None)
@click.option("--missing-node", "missing", type=int, multiple=True)
@click.option("--cutoff-node", "cutoff", multiple=True, help="NODE:T_S collector killed at T_S")
@click.option("--idle-gpu", "idle", multiple=True, help="NODE:GPU left idle")
@click.option("--bulk/--no-bulk", default=True, show_default=True,
              help="GPU and host tables (--no-bulk: clocks and collectives only, as the merge benchmarks at scale)")
@click.option("--nccl", is_flag=True, help="an NCCL-only job with device-side times, as NCCL's profiler plugin records it")
def main(
    nodes: int, out: str, duration_s: float, period_ms: float, ranks_per_node: int, gpus_per_node: int,
    seed: int, job_id: str, stragglers: tuple[str, ...], same_host: bool, hang_at_seq: int | None,
    missing: tuple[int, ...], cutoff: tuple[str, ...], idle: tuple[str, ...], bulk: bool, nccl: bool,
) -> None:
    """Write synthetic node files (synthetic=True) and ground_truth.json into OUT."""
    cfg = SynthConfig(
        nodes=nodes, duration_s=duration_s, period_ms=period_ms, ranks_per_node=ranks_per_node,
        gpus_per_node=gpus_per_node, seed=seed, job_id=job_id,
        stragglers=[parse_straggler(s) for s in stragglers], same_host=same_host, hang_at_seq=hang_at_seq,
        missing_nodes=list(missing),
        cutoff_nodes={int(c.split(":")[0]): float(c.split(":")[1]) for c in cutoff},
        idle_gpus=[(int(x.split(":")[0]), int(x.split(":")[1])) for x in idle], write_bulk=bulk, nccl=nccl,
    )
    try:
        generate(cfg, out)
    except SynthConfigError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {nodes - len(missing)} SYNTHETIC node files and ground_truth.json to {out}")


if __name__ == "__main__":
    main()
