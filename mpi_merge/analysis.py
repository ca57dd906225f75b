"""The job-wide analysis, led by rank 0: node summaries and calls in, everything the job file and reports need out.

No MPI and no paths: the calls arrive in a CommStore (matching.py), one node at a time, and the
analysis reads the store back in passes over blocks of instances (common.BLOCK_CELLS cells each):

  1. scan (fit_clocks): completeness and mismatch flags per instance, and the clock fit's
     [instance x node] input appended to an InstanceTable; then the clock fit, which reads that
     table by rows (its windows dealt over the merge ranks by the driver);
  2. finish: per block, aligned times, wait states and their per-rank sums (BlockWaits, added to a
     CommSummary in block order), the block handed to a sink (the job file's /collectives in the
     merge, memory for library callers); then mismatches, stragglers (reading aligned times by
     ranges of the time order and by windows), the report.

The heavy items of finish (the blocks of pass 2, the delay analysis's baselines and ranges, the
straggler scores' windows) are common.Task objects run through a common.Pool: on one process by
default, dealt over the merge ranks in the MPI driver (common.RankPool; every rank holds an
AnalysisContext over the same tables). Rank 0 takes the results in item order and combines them,
so the numbers do not depend on which rank computed what.

With the store and the instance table in an HDF5 scratch file, what stays in memory is per node
(summaries, clock models, per-window clock estimates), per instance (vectors) or per rank (sums),
plus one block: never the [instance x node] tables. The summaries are sorted by file name and the
blocks depend only on the tables' widths, so every rank count gives the same result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.mpi_merge.clock import (
    DEFAULT_CLOCK_PARAMS,
    ClockFit,
    ClockParams,
    InstanceRows,
    NodeClockModel,
    RankClocks,
    fit_clocks,
)
from gpuprof.mpi_merge.common import Pool, SerialPool, Spread, row_blocks
from gpuprof.mpi_merge.flames import stack_evidence
from gpuprof.mpi_merge.loading import NodeSummary
from gpuprof.mpi_merge.matching import (
    P2P_OPS,
    CommStore,
    CommTable,
    InstanceTable,
    Mismatch,
    MismatchRows,
    NodeInstances,
    P2PPairs,
    StoredComm,
    describe,
    find_mismatches,
    job_comm_shapes,
    match_p2p,
    mismatch_rows,
    node_instances,
    p2p_instances,
)
from gpuprof.mpi_merge.stragglers import (
    DEFAULT_STRAGGLER_PARAMS,
    Finding,
    P2PLateness,
    StragglerParams,
    find_stragglers,
)
from gpuprof.mpi_merge.waitstates import (
    PATTERNS,
    BlockWaits,
    CommSummary,
    CommWaits,
    P2PWaits,
    compute_p2p_waits,
    compute_waits,
    concat_waits,
    rank_summary,
)


@dataclass
class Excluded:
    file: str
    node: str
    reason: str


@dataclass
class JobAnalysis:
    job_id: str
    synthetic: bool
    nodes: list[NodeSummary]  # included, sorted by node name
    excluded: list[Excluded]
    missing_nodes: list[str]  # expected but no file
    epoch_rt: int
    clock: ClockFit
    comms: list[CommSummary]  # per communicator: per-instance vectors and per-rank sums
    p2p_waits: P2PWaits | None
    mismatches: list[Mismatch]
    findings: list[Finding]
    straggler_metrics: dict[str, Any]
    partial_reasons: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    # per finding index: per stack table ("cpu", "offcpu") the top folded stacks as (stack, late
    # processes' mean, peers' mean) over its flagged windows (flames.stack_evidence): /analysis/flames
    flames: dict[int, dict[str, list[tuple[str, float, float]]]] = field(default_factory=dict)
    # Full [seq x rank] tables per communicator: kept by analyze() for library callers only. The
    # merge streams them into the job file block by block and leaves these empty.
    tables: list[CommTable] = field(default_factory=list)
    waits: list[CommWaits] = field(default_factory=list)

    @property
    def node_names(self) -> list[str]:
        return [s.node for s in self.nodes]

    @property
    def partial(self) -> bool:
        return bool(self.partial_reasons)


def select_nodes(
    summaries: list[NodeSummary], job_id: str | None, expect_nodes: list[str] | None
) -> tuple[list[NodeSummary], list[Excluded], list[str], str]:
    """Keep one good file per node of one job; say why each other file is left out."""
    summaries = sorted(summaries, key=lambda s: Path(s.file).name)
    excluded: list[Excluded] = []
    ok: list[NodeSummary] = []
    for s in summaries:
        if s.error is not None:
            excluded.append(Excluded(s.file, s.node, s.error))
        else:
            ok.append(s)
    if job_id is None:
        counts = Counter(s.job_id for s in ok)
        if not counts:
            job_id = ""
        else:
            top = counts.most_common()
            if len(top) > 1 and top[0][1] == top[1][1]:
                raise_ = sorted(c for c, n in top if n == top[0][1])
                job_id = raise_[0]
            else:
                job_id = top[0][0]
    kept: list[NodeSummary] = []
    for s in ok:
        if s.job_id != job_id:
            excluded.append(Excluded(s.file, s.node, f"belongs to job {s.job_id}, not job {job_id}"))
        else:
            kept.append(s)
    by_node: dict[str, list[NodeSummary]] = {}
    for s in kept:
        by_node.setdefault(s.node, []).append(s)
    chosen: list[NodeSummary] = []
    for node in sorted(by_node):
        group = by_node[node]
        # prefer the file named after the node, then the sealed one, then the first by name
        group.sort(key=lambda s: (Path(s.file).stem != node, not s.sealed, Path(s.file).name))
        chosen.append(group[0])
        for other in group[1:]:
            excluded.append(Excluded(other.file, node, f"second file claiming node {node} (kept {Path(group[0].file).name})"))
    missing = sorted(set(expect_nodes or []) - {s.node for s in chosen})
    return chosen, excluded, missing, job_id


@dataclass
class ClockInput:
    """What the clock fit reads: the [instance x node] table and how to fit it. `instances` is None in
    the form sent to the other merge ranks, which open the table from its file themselves."""

    instances: InstanceRows | None
    n_rows: int
    names: list[str]
    reference: str
    params: ClockParams
    clock_domains: list[str]

    def fit(self, instances: InstanceRows | None = None, spread: Spread | None = None) -> ClockFit:
        inst = instances if instances is not None else self.instances
        if not self.names or inst is None:
            return ClockFit(self.reference, self.params.method, [], [])
        return fit_clocks(inst, self.names, self.reference, self.params, clock_domains=self.clock_domains,
                          spread=spread)

    def without_table(self) -> ClockInput:
        return replace(self, instances=None)


@dataclass
class Selection:
    """The files to merge, from select_nodes, and what follows from them before any call is read."""

    nodes: list[NodeSummary]
    excluded: list[Excluded]
    missing: list[str]
    job_id: str

    @classmethod
    def of(cls, summaries: list[NodeSummary], job_id: str | None, expect_nodes: list[str] | None) -> Selection:
        return cls(*select_nodes(summaries, job_id, expect_nodes))

    @property
    def epoch_rt(self) -> int:
        return min((s.span_rt[0] for s in self.nodes if s.span_rt is not None), default=0)

    def comm_shapes(self) -> dict[int, tuple[int, int]]:
        return job_comm_shapes([s.comm_shapes for s in self.nodes])


def _rank_list(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks[:8]) + (f",... ({len(ranks)})" if len(ranks) > 8 else "")


def p2p_rows(calls: np.ndarray) -> np.ndarray:
    """The point-to-point calls of a node: all match_p2p reads of it."""
    return calls[np.isin(calls["op"], list(P2P_OPS))]


class BlockSink(Protocol):
    """Where the merge rank that computed a block of pass 2 puts its [seq x rank] tables: rank 0's
    CommSink takes them (returns None); another rank packs them for rank 0 (the payload travels with
    the block's result and reaches CommSink.packed)."""

    def block(self, blk: CommTable, enter_al: np.ndarray, exit_al: np.ndarray, w: CommWaits) -> Any: ...


class CommSink(Protocol):
    """Where the [seq x rank] tables of each communicator go, block by block, in seq order: blocks
    computed on rank 0 through block(), those of the other ranks as their packed payload."""

    def begin(self, c: StoredComm) -> None: ...
    def block(self, blk: CommTable, enter_al: np.ndarray, exit_al: np.ndarray, w: CommWaits) -> None: ...
    def packed(self, seq0: int, payload: Any) -> None: ...
    def end(self, summary: CommSummary) -> None: ...


class MemorySink:
    """Keeps every communicator's full tables (library use: analyze(), one process)."""

    def __init__(self) -> None:
        self.tables: list[CommTable] = []
        self.waits: list[CommWaits] = []
        self._blocks: list[CommTable] = []
        self._waits: list[CommWaits] = []

    def begin(self, c: StoredComm) -> None:
        self._blocks, self._waits = [], []

    def block(self, blk: CommTable, enter_al: np.ndarray, exit_al: np.ndarray, w: CommWaits) -> None:
        self._blocks.append(blk)
        self._waits.append(w)

    def packed(self, seq0: int, payload: Any) -> None:
        raise RuntimeError("MemorySink keeps the blocks of one process: no other rank packs any")

    def end(self, summary: CommSummary) -> None:
        b = self._blocks

        def whole(f: str) -> np.ndarray:
            return np.concatenate([getattr(x, f) for x in b])

        self.tables.append(CommTable(b[0].comm_id, b[0].size, b[0].node_of_rank, b[0].pid_of_rank, whole("enter"),
                                     whole("exit"), whole("op"), whole("nbytes"), whole("root")))
        self.waits.append(concat_waits(self._waits))


def _models_of_rank(c: StoredComm, names: list[str], models: dict[str, NodeClockModel]) -> list[NodeClockModel | None]:
    return [models[names[int(ni)]] if ni >= 0 else None for ni in c.node_of_rank]


@dataclass
class StoreAligned:
    """stragglers.AlignedRows of one communicator: raw times from the store, aligned on reading."""

    store: CommStore
    ci: int
    clocks: RankClocks

    def _read(self, name: str, seqs: np.ndarray, ranks: slice) -> np.ndarray:
        r0 = ranks.indices(self.store.comms[self.ci].size)[0]
        return self.clocks.align(self.store.read(self.ci, name, seqs, ranks), r0)

    def enter(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        return self._read("enter", seqs, ranks)

    def exit(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray:
        return self._read("exit", seqs, ranks)

    def host_enter(self, seqs: np.ndarray, ranks: slice = slice(None)) -> np.ndarray | None:
        """The host's enqueue of device-timed NCCL calls (NaN elsewhere); None when the communicator
        has none (its enter and exit are the host's own)."""
        if not self.store.comms[self.ci].device_timed:
            return None
        return self._read("host_enter", seqs, ranks)


class AnalysisContext:
    """What a merge rank reads for the items of JobAnalyzer.finish (common.Task's context): the
    job-wide tables, the clock models (every rank holds them after the fit), and where the blocks of
    pass 2 it computes go."""

    def __init__(self, store: CommStore, names: list[str], models: dict[str, NodeClockModel] | None = None,
                 blocks: BlockSink | None = None):
        self.store = store
        self.names = names
        self.models = models or {}  # none before the clock fit (the scan's items need none)
        self.blocks = blocks
        self._clocks: dict[int, RankClocks] = {}
        self._times: list[StoreAligned] | None = None

    def clocks(self, ci: int) -> RankClocks:
        if ci not in self._clocks:
            self._clocks[ci] = RankClocks(_models_of_rank(self.store.comms[ci], self.names, self.models))
        return self._clocks[ci]

    @property
    def times(self) -> list[StoreAligned]:
        """rootcause.TimesContext: every communicator's aligned times, read from the tables."""
        if self._times is None:
            self._times = [StoreAligned(self.store, ci, self.clocks(ci)) for ci in range(len(self.store.comms))]
        return self._times


@dataclass
class BlockResult:
    """One block of pass 2 as rank 0 receives it: the summary's part, and the packed tables when
    another rank computed it (else None)."""

    waits: BlockWaits
    packed: Any


@dataclass
class _ScanBlocks:
    """Task: pass 1 on one block (item: blocks[i], (communicator, first seq, end seq)): its mismatch
    flags, completeness, and rows of the clock fit's [instance x node] input."""

    blocks: list[tuple[int, int, int]]
    n_nodes: int

    def __call__(self, ctx: AnalysisContext, i: int) -> tuple[MismatchRows, np.ndarray, NodeInstances]:
        blk = ctx.store.block(*self.blocks[i])
        return mismatch_rows(blk), blk.complete(), node_instances([blk], self.n_nodes)


@dataclass
class _WaitStates:
    """Task: pass 2 on one block (item: blocks[i], (communicator, first seq, end seq)): aligned times
    and wait states."""

    blocks: list[tuple[int, int, int]]

    def __call__(self, ctx: AnalysisContext, i: int) -> BlockResult:
        ci, s0, s1 = self.blocks[i]
        blk = ctx.store.block(ci, s0, s1)
        rc = ctx.clocks(ci)
        E, X = rc.align(blk.enter), rc.align(blk.exit)
        w = compute_waits(blk, E, X)
        if ctx.blocks is None:
            raise RuntimeError("pass 2 on a rank without a sink for its blocks")
        return BlockResult(BlockWaits.of(s0, w, E), ctx.blocks.block(blk, E, X, w))


class JobAnalyzer:
    """The analysis of one selection of nodes whose calls are in `store` (node i = nodes[i])."""

    def __init__(self, sel: Selection, store: CommStore, p2p_calls: list[np.ndarray], scratch: h5py.Group | None = None):
        self.sel = sel
        self.store = store
        self.p2p_calls = p2p_calls
        self.scratch = scratch
        self.names = [s.node for s in sel.nodes]
        self.partial: list[str] = []
        for e in sel.excluded:
            self.partial.append(f"excluded {Path(e.file).name}: {e.reason}")
        for n in sel.missing:
            self.partial.append(f"node {n}: expected, but no node file")
        for s in sel.nodes:
            for r in s.partial_reasons:
                self.partial.append(f"node {s.node}: {r}")
        for s in sel.nodes:
            for note in s.late_probe_notes:
                self.partial.append(f"node {s.node}: {note}")
        for s in sel.nodes:
            if not s.n_calls:
                self.partial.append(f"node {s.node}: no collective calls recorded (metrics kept, clock not aligned)")
        # a node cut short (collector killed, node crashed) or without a file loses its own ranks from
        # the instances it misses; the other ranks' instances are still judged
        cut = {i for i, s in enumerate(sel.nodes) if s.partial_reasons}
        for ci, ranks, start in store.exclude_cut_ranks(cut):
            c = store.comms[ci]
            who = (f"node {self.names[int(c.node_of_rank[ranks[0]])]}'s file ends" if start else "no node file has them")
            self.partial.append(f"communicator {c.comm_id:#x}: ranks {_rank_list(ranks)} left out from seq {start} "
                                f"on ({who}); its {c.n_seq - start} later instance(s) are judged on the other ranks")
        self._p2p: P2PPairs | None = None  # matched once, in fit_clocks, for the clock fit and the waits
        self.mismatch_flags: list[MismatchRows] = []
        self.complete: list[np.ndarray] = []
        self.clock: ClockFit | None = None

    def scan(self, reference: str = "", params: ClockParams = DEFAULT_CLOCK_PARAMS,
             instances: h5py.Group | None = None, pool: Pool | None = None,
             on_block: Callable[[int], None] | None = None) -> ClockInput:
        """Pass 1 over the store: completeness and mismatch flags per instance, and the clock fit's
        [instance x node] input, into `instances` (an HDF5 group the other merge ranks can read once
        its file is closed) or the scratch file. Returns what every rank needs to run the fit.
        `pool`: the merge ranks the blocks are read on (by default this process); `on_block(n)`: n
        more instances scanned (progress)."""
        nodes, names = self.sel.nodes, self.names
        # matched messages constrain the clocks too (method "minimal": no receive completes before its
        # send started); the other methods are exit-synchronous estimates that only collectives fit
        self._p2p = match_p2p(self.p2p_calls, self.store.epoch_rt)
        msg_rows = p2p_instances(self._p2p, len(nodes)) if params.method == "minimal" else None
        n_msg = msg_rows.n_rows if msg_rows is not None else 0
        inst = InstanceTable(len(nodes), sum(c.n_seq for c in self.store.comms) + n_msg,
                             instances if instances is not None else self.scratch)
        if pool is None:
            pool = SerialPool(AnalysisContext(self.store, names))
        blocks = [(ci, s0, s1) for ci in range(len(self.store.comms)) for s0, s1 in self.store.blocks(ci)]
        results = pool.map(_ScanBlocks(blocks, len(nodes)), len(blocks))
        for ci, c in enumerate(self.store.comms):
            flags = []
            complete = np.zeros(c.n_seq, bool)
            for s0, s1 in self.store.blocks(ci):
                block_flags, complete[s0:s1], rows = next(results)
                flags.append(block_flags)
                inst.append(rows)
                if on_block is not None:
                    on_block(s1 - s0)
            self.mismatch_flags.append(MismatchRows.concat(flags))
            self.complete.append(complete)
        if msg_rows is not None and n_msg:
            for k0, k1 in row_blocks(n_msg, len(nodes)):
                inst.append(NodeInstances(*(getattr(msg_rows, f)[k0:k1] for f in
                                            ("enter_max", "exit_min", "exit_med", "comm_id", "seq"))))
        if reference and reference not in names:
            self.partial.append(f"configured reference node {reference} not among the merged nodes; using the first")
            reference = ""
        if not reference:
            with_calls = [s.node for s in nodes if s.n_calls]
            reference = with_calls[0] if with_calls else (names[0] if names else "")
        return ClockInput(inst, inst.n_rows, list(names), reference, params,
                          [f"{s.hostname}/{s.boot_id}" for s in nodes])

    def set_clock(self, clock: ClockFit) -> None:
        """The fit of `scan`'s input (run here or over all merge ranks)."""
        nodes, names = self.sel.nodes, self.names
        for m in clock.models:
            if not m.aligned and nodes[names.index(m.node)].n_calls:
                self.partial.append(f"node {m.node}: clock not aligned: {m.reason}")
        self.clock = clock

    def fit_clocks(self, reference: str = "", params: ClockParams = DEFAULT_CLOCK_PARAMS) -> ClockFit:
        """Pass 1 over the store, then the clock fit, all in this process."""
        self.set_clock(self.scan(reference, params).fit())
        assert self.clock is not None
        return self.clock

    def finish(self, sink: CommSink, params: StragglerParams = DEFAULT_STRAGGLER_PARAMS, pool: Pool | None = None,
               on_block: Callable[[int], None] | None = None) -> JobAnalysis:
        """Pass 2 (aligned times and wait states, to the sink), mismatches, stragglers, the report.
        `pool`: the merge ranks the blocks of pass 2 and the reads of the straggler analysis are dealt
        over (common.RankPool, whose other ranks hold an AnalysisContext of the same tables); by
        default this process. `on_block(n)`: n more instances through pass 2 (progress)."""
        if self.clock is None:
            raise RuntimeError("JobAnalyzer.finish before fit_clocks: no clock models to align with")
        sel, store, names, epoch = self.sel, self.store, self.names, self.store.epoch_rt
        models = {m.node: m for m in self.clock.models}
        if pool is None:
            pool = SerialPool(AnalysisContext(store, names, models, sink))
        # one map over the blocks of every communicator (thousands of small ones are dealt like the
        # blocks of a large one); rank 0 takes them in order, communicator after communicator
        blocks = [(ci, s0, s1) for ci in range(len(store.comms)) for s0, s1 in store.blocks(ci)]
        task = _WaitStates(blocks)
        comms: list[CommSummary] = []
        results = pool.map(task, len(blocks))
        for ci, c in enumerate(store.comms):
            cs = CommSummary.empty(c.comm_id, c.size, c.n_seq, c.node_of_rank, c.pid_of_rank)
            sink.begin(c)
            for s0, s1 in store.blocks(ci):
                res = next(results)
                cs.add_block(res.waits)
                if res.packed is not None:
                    sink.packed(s0, res.packed)
                if on_block is not None:
                    on_block(s1 - s0)
            sink.end(cs)
            comms.append(cs)
        p2p = self._p2p if self._p2p is not None else match_p2p(self.p2p_calls, epoch)
        p2p_waits = None
        late = None
        if len(p2p.src):
            def al(nodes_idx: np.ndarray, t: np.ndarray) -> np.ndarray:
                out = t.copy()
                for ni in np.unique(nodes_idx):
                    sel_ = nodes_idx == ni
                    out[sel_] = models[names[int(ni)]].align(t[sel_])
                return out
            p2p_waits = compute_p2p_waits(p2p, al(p2p.send_node, p2p.send_enter), al(p2p.send_node, p2p.send_exit),
                                          al(p2p.recv_node, p2p.recv_enter), al(p2p.recv_node, p2p.recv_wait),
                                          al(p2p.recv_node, p2p.recv_exit))
            late = P2PLateness(p2p.send_node, p2p.recv_node, al(p2p.send_node, p2p.send_enter), p2p_waits.late_sender_ns,
                               p2p.comm_id, p2p.src, p2p.dst, al(p2p.recv_node, p2p.recv_wait),
                               al(p2p.recv_node, p2p.recv_exit))
        partial_nodes = {s.node for s in sel.nodes if s.partial_reasons}
        lossy = {s.node: int(sum(v for k, v in s.drops.items() if k.startswith("collectives"))) for s in sel.nodes}
        mism = find_mismatches(store, self.mismatch_flags, names, partial_nodes,
                               {e.node: e.reason for e in sel.excluded if e.node}, lossy)
        for mm in mism:
            self.partial.append(f"communicator {mm.comm_id:#x}: {mm.kind} at seq {mm.first_seq}: {mm.detail}")
        times = [StoreAligned(store, ci, RankClocks(_models_of_rank(c, names, models)))
                 for ci, c in enumerate(store.comms)]
        # each node's clock error (the model's uncertainty; 0 where unknown) sets the stragglers' effect floor
        clock_err = [float(getattr(models.get(n), "uncertainty_ns", float("nan"))) for n in names]
        findings, smetrics = find_stragglers(comms, times, names, [s.series for s in sel.nodes], epoch, 0.0, params,
                                             clock_error_ns=clock_err, p2p=late,
                                             node_on_cpu=[s.on_cpu for s in sel.nodes], pool=pool,
                                             node_phases=[s.phases for s in sel.nodes],
                                             node_kernels=[s.kernels for s in sel.nodes])
        flames = stack_evidence(findings, comms, [s.file for s in sel.nodes], names, epoch, pool)
        a = JobAnalysis(
            job_id=sel.job_id, synthetic=any(s.synthetic for s in sel.nodes), nodes=sel.nodes, excluded=sel.excluded,
            missing_nodes=sel.missing, epoch_rt=epoch, clock=self.clock, comms=comms, p2p_waits=p2p_waits,
            mismatches=mism, findings=findings, straggler_metrics=smetrics,
            partial_reasons=self.partial, flames=flames,
        )
        lost = {n: d for n, d in lossy.items() if d}
        if lost:
            a.partial_reasons.append(
                "collective and point-to-point call records dropped by the collectors (ring full): "
                + ", ".join(f"{n} {d}" for n, d in sorted(lost.items()))
                + "; calls without a partner and ranks missing from instances below can be these lost records")
        for why, n in p2p.unmatched_reasons.items():
            a.partial_reasons.append(f"point to point: {n} {why}")
        a.report = build_report_dict(a, p2p.unmatched, {**p2p.unmatched_reasons, **p2p.unpaired_reasons})
        return a


def analyze(
    summaries: list[NodeSummary],
    *,
    job_id: str | None = None,
    expect_nodes: list[str] | None = None,
    reference: str = "",
    clock_params: ClockParams = DEFAULT_CLOCK_PARAMS,
    straggler_params: StragglerParams = DEFAULT_STRAGGLER_PARAMS,
    release_calls: bool = False,
) -> JobAnalysis:
    """The whole analysis in memory, from summaries that carry their calls (library use; the merge
    driver runs the same JobAnalyzer on a scratch file). `release_calls`: empty each summary's call
    array once it is in the store."""
    sel = Selection.of(summaries, job_id, expect_nodes)
    store = CommStore(sel.comm_shapes(), sel.epoch_rt)
    p2p = []
    for ni, s in enumerate(sel.nodes):
        store.add_node(ni, s.calls)
        p2p.append(p2p_rows(s.calls))
        if release_calls:
            s.calls = np.zeros(0, s.calls.dtype)  # not a slice, which would keep the array
    job = JobAnalyzer(sel, store, p2p)
    job.fit_clocks(reference, clock_params)
    sink = MemorySink()
    a = job.finish(sink, straggler_params)
    a.tables, a.waits = sink.tables, sink.waits
    return a


def _f(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _clock_interval(m: NodeClockModel, epoch_rt: int) -> dict[str, Any]:
    """What the data allow of a node's offset (method "minimal"): the interval at the model's first
    point, where the model keeps the prior for lack of any constraint, and what the data contradict."""
    lo, hi = m.interval_ns(np.array([m.seg_start[0]])) if len(m.seg_start) else (np.full(1, np.nan),) * 2
    return {
        "interval_lo_us": _f(float(lo[0]) / 1e3), "interval_hi_us": _f(float(hi[0]) / 1e3),
        # seconds since the job's epoch (the node-clock times of the models are ns from it)
        "unconstrained_spans_s": [[s0 / 1e9, s1 / 1e9] for s0, s1 in m.unconstrained_spans],
        "unconstrained_spans_realtime_ns": [[int(s0) + epoch_rt, int(s1) + epoch_rt] for s0, s1 in m.unconstrained_spans],
        "inconsistent": m.inconsistent, "drift_note": m.drift_note,
    }


def build_report_dict(a: JobAnalysis, p2p_unmatched: int = 0,
                      p2p_reasons: dict[str, int] | None = None) -> dict[str, Any]:
    """The machine-readable report (the .json file); the text and HTML reports render it."""
    ms = 1e6
    nodes = []
    for s in a.nodes:
        m = a.clock.model(s.node)
        nodes.append({
            "node": s.node, "file": Path(s.file).name, "hostname": s.hostname, "sealed": s.sealed,
            "partial_reasons": s.partial_reasons, "collective_calls": s.n_calls,
            "drops": s.drops, "drops_total": int(sum(s.drops.values())), "errors": s.errors[:20],
            "errors_total": s.errors_total, "missing_metrics": s.missing_metrics[:20],
            "clock": {
                "aligned": m.aligned, "reason": m.reason, "reference": m.is_reference,
                "offset_us": _f(float(m.offset_ns(np.array([m.seg_start[0]]))[0]) / 1e3) if len(m.seg_start) else None,
                "drift_ppm": _f(m.mean_drift_ppm) if m.aligned else None,
                "segments": len(m.seg_start), "residual_us": _f(m.residual_ns / 1e3),
                "uncertainty_us": _f(m.uncertainty_ns / 1e3), "n_points": m.n_points,
                **_clock_interval(m, a.epoch_rt),
                # steps of the node's wall clock seen in its clock pairs, taken out (loading.clock_map_of)
                "wall_clock_steps": [{"t_s": round((t - a.epoch_rt) / 1e9, 3), "step_ms": round(d / 1e6, 6)}
                                     for t, d in s.clock_steps],
            },
            "gpus": s.gpus,
            # per process with NVTX ranges: seconds in each range (exclusive of nested ranges), the
            # longest NAMED_TOP names
            "nvtx_phases_s": {str(pid): {k: round(v, 6) for k, v in ph.totals_s().items()}
                              for pid, ph in sorted(s.phases.items())},
            # per process whose kernels CUPTI recorded: GPU seconds per kernel name, the longest 12
            "kernel_time_s": {str(pid): {k: round(v, 6) for k, v in kt.totals_s().items()}
                              for pid, kt in sorted(s.kernels.items())},
        })
    idle = []
    for s in a.nodes:
        for g in s.gpus:
            u = g.get("sm_activity_mean", g.get("util_gpu_mean"))
            if u is None:
                continue
            if u < 1.0:
                idle.append({"node": s.node, "gpu": g["gpu"], "activity_mean": u, "verdict": "idle"})
            elif u < 30.0:
                idle.append({"node": s.node, "gpu": g["gpu"], "activity_mean": u, "verdict": "underused"})
    comms = []
    for c in a.comms:
        comp = c.complete
        pat = {name: {"instances": int(c.pattern_instances[pi]), "wait_ms_total": float(c.pattern_wait_ns[pi]) / ms}
               for pi, name in enumerate(PATTERNS) if c.pattern_instances[pi]}
        skew = c.skew()
        comms.append({
            "comm_id": f"{c.comm_id:#x}", "size": c.size, "instances": c.n_seq, "complete": int(comp.sum()),
            "ranks_seen": int((c.node_of_rank >= 0).sum()), "patterns": pat,
            "arrival_skew_ms": {"median": _f(float(np.median(skew)) / ms) if len(skew) else None,
                                "p99": _f(float(np.percentile(skew, 99)) / ms) if len(skew) else None},
            "own_time_ms_median": _f(float(np.nanmedian(c.own_time[comp])) / ms) if comp.any() else None,
        })
    ranks = rank_summary(a.comms, a.node_names)
    return {
        "schema": "slurm-gpuprof.report", "schema_version": 1, "job_id": a.job_id, "synthetic": a.synthetic,
        "status": "partial" if a.partial else "complete", "partial_reasons": a.partial_reasons,
        "nodes_merged": a.node_names, "missing_nodes": a.missing_nodes,
        "excluded": [{"file": Path(e.file).name, "node": e.node, "reason": e.reason} for e in a.excluded],
        "clock": {"reference": a.clock.reference, "method": a.clock.method, "components": a.clock.components,
                  "causality_violations": a.clock.causality_violations,
                  "instances_used": a.clock.instances_used, "notes": a.clock.notes},
        "nodes": nodes, "idle_or_underused_gpus": idle, "communicators": comms, "ranks": ranks,
        # stragglers are root causes (cost, propagated lateness under each); the summary says how many
        # tests the false discovery rate was controlled over
        "stragglers": [f.as_dict() for f in a.findings],
        "straggler_summary": a.straggler_metrics.get("_summary", {}),
        "straggler_metrics": {k: v for k, v in a.straggler_metrics.items() if k != "_summary"},
        "mismatches": [describe(m) for m in a.mismatches],
        "p2p": None if a.p2p_waits is None else {
            "pairs": len(a.p2p_waits.late_sender_ns), "unmatched": p2p_unmatched,
            "unmatched_reasons": dict(p2p_reasons or {}),
            "Late Sender_ms_total": float(a.p2p_waits.late_sender_ns.sum()) / ms,
            "Late Receiver_ms_total": float(a.p2p_waits.late_receiver_ns.sum()) / ms,
        },
        "op_names": list(schema.COLLECTIVE_OPS),
    }
