"""The MPI merge driver: any number of ranks, the same job file for every rank count.

  1. every rank reads node files (sorted by name; rank r takes file r, then each rank claims the
     next file no rank has claimed yet, so a rank slowed down by other load reads fewer): a small
     summary per node (loading.py: no calls, no bulk tables) and the node's calls, on its realtime
     clock, saved beside it (.calls.npy);
  2. rank 0 receives the summaries rank by rank (one message per node) and selects the files to
     merge; it broadcasts the selection and the job's epoch;
  3. the job file's writer (the last rank, rank 0 when alone) creates the job file and copies the
     selected node files' tables into /nodes, straight from the node file (one HDF5 object copy of
     each node file's root), while rank 0 loads the calls one node at a time in the job's node
     order into the job-wide [seq x rank] tables of a scratch HDF5 file (matching.CommStore) and
     closes it; every rank opens it read-only from then on. The writer copies a node at a time
     whenever it waits for rank 0 (common.ChoresComm, jobfile.JobFileCopies), here and in every
     later step, and what its waits left at the end of the analysis. The blocks of the scan
     (analysis.JobAnalyzer.scan) are dealt over the ranks (common.RankPool), rank 0 writes the
     clock fit's input from their results into a file of its own; then every rank fits the clocks,
     the windows dealt over the ranks (common.CommSpread), and all hold the models;
  4. every rank writes the aligned call times of the nodes it read into files of their own, from
     the saved calls; the writer adds them to the job file once every rank is done (in its waits,
     the rest after step 5's items when it is not rank 0), and tells rank 0;
  5. rank 0 leads the rest of the analysis (analysis.JobAnalyzer.finish) and every other rank
     serves its items (common.RankPool: the blocks of the wait states, the delay analysis's
     baselines and ranges of the time order, the straggler scores' windows). A block computed on
     another rank comes back with its /collectives chunks already compressed (ChunkPacker), which
     rank 0 writes as they are into a part file of its own; then mismatches, the tests of the
     stragglers and the reports on rank 0. Rank 0 then adds /collectives, /clock, /analysis and the
     root attributes to the job file, renames it into place, then writes the reports the same way.
     The HTML page is drawn from the finished job file; with other ranks its two passes over the
     node groups are dealt over all ranks (html_report.PoolPasses; the same page), and its
     communicator sections are computed while rank 0 waits for the writer (html_report.prepare_comms).

Rank 0's memory therefore holds the per-node summaries (bounded per node), per-instance vectors,
per-rank sums and one block of the tables (or its window of results): not the calls, not the
[instance x node] tables, not the bulk data; the other ranks hold one block, per-instance vectors
and a few numbers per process (docs/merge.md, "Rank 0's memory", "At scale"). Most of the copying
runs on the writer, beside rank 0's analysis. An exception on any rank propagates to the CLI, which
aborts the whole MPI job with the message (comm.Abort), so a failing rank never leaves the others
waiting in a receive; a rank killed outright ends the job through mpirun.
With GPUPROF_MERGE_TIMING=1 every rank prints its seconds per step to stderr (StepTimes).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np

from gpuprof.collector import environment
from gpuprof.collector.errors import MergeError, TraceFormatError
from gpuprof.mpi_merge import nccl_log
from gpuprof.mpi_merge.analysis import (
    AnalysisContext,
    ClockInput,
    JobAnalysis,
    JobAnalyzer,
    Selection,
    p2p_rows,
)
from gpuprof.mpi_merge.clock import DEFAULT_CLOCK_PARAMS, ClockParams, NodeClockModel
from gpuprof.mpi_merge.common import (
    ChoresComm,
    CommSpread,
    DealStats,
    RankPool,
    SerialSpread,
    open_scratch_for_reads,
)
from gpuprof.mpi_merge.html_report import PageContext, prepare_comms, render_html_file
from gpuprof.mpi_merge.jobfile import (
    COMM_MATRICES,
    CollectivesWriter,
    JobFileCopies,
    finish_job_file,
    write_aligned_times,
)
from gpuprof.mpi_merge.loading import NodeSummary, discover, expected_nodes_from_attrs, summarize_node
from gpuprof.mpi_merge.matching import CommStore, CommTable, InstanceTable, StoredComm
from gpuprof.mpi_merge.progress_bar import TerminalProgress
from gpuprof.mpi_merge.report import render_reports, write_rendered
from gpuprof.mpi_merge.stragglers import DEFAULT_STRAGGLER_PARAMS, StragglerParams
from gpuprof.mpi_merge.waitstates import CommSummary, CommWaits

EXIT_COMPLETE = 0
EXIT_ERROR = 2
EXIT_PARTIAL = 3
TAG_COUNT, TAG_SUMMARY, TAG_LAYOUT, TAG_ALIGNED, TAG_NODES = 11, 12, 13, 15, 16
# the steps whose progress is counted in instances (pass 1 and pass 2 over the job-wide tables)
SCAN_STEP = "scan: completeness, mismatches, clock input"
WAITS_STEP = "aligned times, wait states"


class Comm(Protocol):
    """The part of mpi4py's communicator the driver uses (a serial stand-in satisfies it too)."""

    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...
    def bcast(self, obj: Any, root: int = 0) -> Any: ...
    def send(self, obj: Any, dest: int, tag: int = 0) -> None: ...
    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any: ...
    def isend(self, obj: Any, dest: int, tag: int = 0) -> Any: ...
    def iprobe(self, source: int = 0, tag: int = 0) -> bool: ...
    def allgather(self, obj: Any) -> list[Any]: ...


class SerialComm:
    """One process, no MPI: what library callers and tests get without mpirun."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        raise MergeError("SerialComm has no peers to send to")

    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any:
        raise MergeError("SerialComm has no peers to receive from")

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Any:
        raise MergeError("SerialComm has no peers to send to")

    def iprobe(self, source: int = 0, tag: int = 0) -> bool:
        return False  # no peer, no message

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]


@dataclass
class MergeResult:
    job_file: Path
    reports: dict[str, Path]
    status: str  # "complete" or "partial"
    partial_reasons: list[str]
    exit_code: int
    job_id: str
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0


class StepTimes:
    """Seconds per step of one rank, printed to stderr at the end when GPUPROF_MERGE_TIMING=1:
    what the throughput figures are tuned with (which rank waits for which, where the time goes)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.on = environment.get(environment.GPUPROF_MERGE_TIMING) == "1"
        self.t0 = self.last = time.monotonic()
        self.steps: list[tuple[str, float]] = []
        self.dealt: list[tuple[str, DealStats]] = []
        # the process's peak RSS (MB) when each step ended: which step set the peak
        self.peak_mb: list[tuple[str, float]] = []

    def deal(self, step: str, stats: DealStats) -> None:
        """How a step's items were dealt (rank 0): printed on a line of its own."""
        if self.on:
            self.dealt.append((step, stats))

    def note(self, what: str, seconds: float) -> None:
        """Seconds spent inside the steps (the writer's copies in its waits): printed among them."""
        if self.on:
            self.steps.append((what, seconds))

    def mark(self, step: str) -> None:
        """The step that just ended."""
        if self.on:
            now = time.monotonic()
            self.steps.append((step, now - self.last))
            self.last = now
            self.peak_mb.append((step, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))  # KB on Linux

    def report(self) -> None:
        if self.on:
            steps = " ".join(f"{name}={sec:.3f}" for name, sec in self.steps)
            print(f"gpuprof merge timing rank {self.rank}: {steps} total={time.monotonic() - self.t0:.3f}",
                  file=sys.stderr, flush=True)
            peaks = " ".join(f"{name}={mb:.1f}" for name, mb in self.peak_mb)
            print(f"gpuprof merge peak rss MB rank {self.rank}: {peaks}", file=sys.stderr, flush=True)
            for step, d in self.dealt:
                print(f"gpuprof merge items {step}: by rank {d.items_by_rank}, computed again on rank 0 "
                      f"{d.recomputed}, most held {d.most_held}", file=sys.stderr, flush=True)


class Progress:
    """Rank 0's progress lines on stderr (the merge job's log): per step what is done of how much
    and, once ESTIMATE_AFTER of it is done, about how long the step still takes at its rate so far
    (the seconds since the step's first call over what it has done). At most one line every
    MIN_INTERVAL_S, besides the lines that close a step (done == total, or forced).
    `clock`: seconds on a monotonic clock (tests pass a fake one)."""

    MIN_INTERVAL_S = 1.0
    # the first few percent are the least representative (files start cold, the first blocks
    # carry the setup): no estimate before them
    ESTIMATE_AFTER = 0.03

    def __init__(self, on: bool, clock: Callable[[], float] = time.monotonic):
        self.on = on
        self.clock = clock
        self.t0 = clock()
        self._last = -math.inf
        self._last_printed: tuple[str, int, int] | None = None
        self._step_t0: dict[str, float] = {}

    def due(self) -> bool:
        """Whether a line now would be printed: a count that costs something is made only then."""
        return self.on and self.clock() - self._last >= self.MIN_INTERVAL_S

    def __call__(self, step: str, done: int, total: int, unit: str, force: bool = False) -> None:
        if not self.on:
            return
        now = self.clock()
        t_step = self._step_t0.setdefault(step, now)  # a step's first call starts its rate, printed or not
        if not force and now - self._last < self.MIN_INTERVAL_S and done < total:
            return
        if (step, done, total) == self._last_printed:  # a step's forced end right after its last block
            return
        self._last = now
        self._last_printed = (step, done, total)
        share = f", {100 * done // total}%" if total > 0 else ""  # rounded down: 100% only when done
        left = ""
        if 0 < done < total and done >= self.ESTIMATE_AFTER * total:
            seconds_left = (now - t_step) / done * (total - done)
            left = f", left ~{seconds_left:.0f} s" if seconds_left >= 0.5 else ", left <1 s"
        print(f"gpuprof merge: {step}: {done}/{total} {unit}{share} ({now - self.t0:.1f} s{left})",
              file=sys.stderr, flush=True)


class RankZeroCollectives:
    """Rank 0's analysis.CommSink: /collectives of its part file through a CollectivesWriter, the blocks
    another rank computed as the chunks it packed (ChunkPacker), written as they are."""

    def __init__(self, writer: CollectivesWriter):
        self.writer = writer

    def begin(self, c: StoredComm) -> None:
        self.writer.begin(c)

    def block(self, blk: CommTable, enter_al: np.ndarray, exit_al: np.ndarray, w: CommWaits) -> None:
        self.writer.block(blk, enter_al, exit_al, w)

    def packed(self, seq0: int, payload: Any) -> None:
        assert self.writer.g is not None
        for name, (mask, chunk) in payload.items():
            self.writer.g[name].id.write_direct_chunk((seq0, 0), chunk, mask)

    def end(self, summary: CommSummary) -> None:
        self.writer.end(summary)


class ChunkPacker:
    """analysis.BlockSink of the ranks other than 0: each block of pass 2 written by a CollectivesWriter
    into an in-memory HDF5 file of its own and its chunk of every table read back as stored
    (compressed, with its filter mask), so rank 0 writes the bytes it would have made itself and the
    compression runs where the block was computed. A block is one chunk (CollectivesWriter)."""

    def __init__(self, store: CommStore, names: list[str], epoch_rt: int):
        self.comm_of = {c.comm_id: c for c in store.comms}
        self.names = names
        self.epoch_rt = epoch_rt

    def block(self, blk: CommTable, enter_al: np.ndarray, exit_al: np.ndarray, w: CommWaits) -> dict[str, Any]:
        c = self.comm_of[blk.comm_id]
        # libver "latest" as rank 0's part file: a communicator of more than about 8000 ranks has
        # attributes (node_of_rank_json, pid_of_rank) beyond the 64 KB the oldest format allows
        with h5py.File(f"block-{os.getpid()}.h5", "w", driver="core", backing_store=False, libver="latest") as mem:
            writer = CollectivesWriter(mem, self.names, self.epoch_rt)
            writer.begin(c)
            writer.block(blk, enter_al, exit_al, w)
            assert writer.g is not None
            return {name: writer.g[name].id.read_direct_chunk((blk.seq0, 0)) for name, _ in COMM_MATRICES}


def _store_layout(store: CommStore) -> list[tuple[StoredComm, dict[str, str]]]:
    """What another rank needs to open the job-wide tables of `store` from its file: each
    communicator without its tables, and the path of each table in the file."""
    return [(replace(c, data={}), {name: d.name for name, d in c.data.items() if isinstance(d, h5py.Dataset)})
            for c in store.comms]


def _open_store(layout: list[tuple[StoredComm, dict[str, str]]], epoch_rt: int, f: h5py.File) -> CommStore:
    """The store of _store_layout, its tables read from `f` (opened read-only: every rank reads them)."""
    store = CommStore({}, epoch_rt)
    store.comms = [replace(c, data={name: f[path] for name, path in paths.items()}) for c, paths in layout]
    return store


_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def resolve_source(source: str, output_stem: str | None) -> tuple[Path, Path, str | None, list[str] | None]:
    """JOB_OR_DIR -> (node directory, output stem, job id if given, the job's node list if known)."""
    p = Path(source)
    if p.is_dir():
        d = p.resolve()
        if output_stem:
            return d, Path(output_stem), None, None
        name = d.name.removesuffix(".gpuprof.d")
        return d, d.parent / name, None, None
    if _JOB_ID.match(source):
        from gpuprof.slurm_hooks.job import job_source
        from gpuprof.slurm_hooks.paths import node_dir_for_stdout, stdout_stem

        job = job_source().lookup(source)
        node_dir = node_dir_for_stdout(job.stdout)
        sd, stem = stdout_stem(job.stdout)
        if not node_dir.is_dir():
            raise MergeError(f"job {source}: no node files at {node_dir} (from StdOut={job.stdout})")
        return node_dir, Path(output_stem) if output_stem else sd / stem, source, job.nodes or None
    raise MergeError(f"{source}: neither a directory of node files nor a job id")


def output_paths(stem: Path) -> dict[str, Path]:
    return {ext: Path(f"{stem}.gpuprof.{ext}") for ext in ("h5", "txt", "json", "html")}


def merge(
    source: str,
    *,
    comm: Comm | None = None,
    output_stem: str | None = None,
    expect_nodes: list[str] | None = None,
    reference: str = "",
    clock_params: ClockParams = DEFAULT_CLOCK_PARAMS,
    straggler_params: StragglerParams = DEFAULT_STRAGGLER_PARAMS,
    show_progress: bool = False,
) -> MergeResult | None:
    """Merge a job's node files. Returns the result on rank 0, None on the other ranks.
    show_progress: rank 0 prints progress lines per step on stderr."""
    c: Comm = comm if comm is not None else SerialComm()
    if c.Get_size() > 1:
        from mpi4py import MPI  # only with other ranks: library use needs no MPI

        if isinstance(c, MPI.Comm):
            c = ChoresComm(c)  # the writer's copies run in its waits (another wrapper keeps its own waits)
    rank = c.Get_rank()
    t_start = time.monotonic()
    plan: dict[str, Any] | None = None
    if rank == 0:
        node_dir, stem, job_id, job_nodes = resolve_source(source, output_stem)
        files = [str(f) for f in discover(node_dir) if not f.name.endswith(tuple(f".gpuprof.{e}" for e in ("h5",)))]
        if not files:
            raise MergeError(f"{node_dir}: no node files (*.h5) to merge")
        token = f"{os.getpid()}-{int(time.time() * 1e3)}"
        parts_dir = stem.parent / f".{stem.name}.gpuprof.parts-{token}"
        plan = {"files": files, "stem": str(stem), "job_id": job_id, "expect": expect_nodes or job_nodes,
                "parts_dir": str(parts_dir)}
        parts_dir.mkdir(parents=True, exist_ok=False)
    plan = c.bcast(plan, root=0)  # the parts directory exists before anyone writes into it
    assert plan is not None
    files = plan["files"]
    parts_dir = Path(plan["parts_dir"])
    try:
        with contextlib.ExitStack() as resources:
            return _merge(c, plan, files, parts_dir, t_start, reference, clock_params, straggler_params,
                          show_progress, resources)
    finally:
        if rank == 0:
            shutil.rmtree(parts_dir, ignore_errors=True)


def _merge(c: Comm, plan: dict[str, Any], files: list[str], parts_dir: Path, t_start: float, reference: str,
           clock_params: ClockParams, straggler_params: StragglerParams, show_progress: bool,
           resources: contextlib.ExitStack) -> MergeResult | None:
    rank, size = c.Get_rank(), c.Get_size()
    steps = StepTimes(rank)
    # the rank that assembles the job file from the node files while rank 0 analyzes
    writer = size - 1
    calls_of = {f: node_part(parts_dir, i, "calls.npy") for i, f in enumerate(files)}
    # aligned call times go to a file of their own per node, written by the node's rank
    aligned_of = {f: node_part(parts_dir, i, "aligned.h5") for i, f in enumerate(files)}
    job_tmp = parts_dir / "job.h5"  # beside the output (same file system), renamed into place at the end

    # 1. each rank reads its node files once: the summary, and the node's calls on its realtime clock
    #    saved for rank 0 to load one node at a time (step 3) and for this rank to align (step 4)
    summaries: list[NodeSummary] = []
    mine: set[str] = set()
    # bars (tqdm) on a terminal; in a batch log the plain lines
    progress: Progress | TerminalProgress = (TerminalProgress if sys.stderr.isatty() else Progress)(
        rank == 0 and show_progress)
    # with progress on, every rank leaves a marker per file it has read, which rank 0 counts
    read_marker_of = {f: node_part(parts_dir, i, "read") for i, f in enumerate(files)}
    progress("reading node files", 0, len(files), "files read")
    for f in claim_files(files, rank, size, parts_dir):
        if progress.due():  # the count lists the parts directory: only for a line that is printed
            progress("reading node files", _files_read(parts_dir), len(files), "files read")
        mine.add(f)
        s = summarize_node(f)
        if s.error is None:
            np.save(calls_of[f], s.calls, allow_pickle=False)
        if show_progress:
            read_marker_of[f].touch()
        s.calls = np.zeros(0, s.calls.dtype)  # a new empty array: a slice would keep them
        # the clock map is in the saved calls' times already: no rank needs it any more
        summaries.append(replace(s, clock=None))
    steps.mark("read")
    # rank 0 has no file left to claim; the others may still be reading their last one
    progress("reading node files", _files_read(parts_dir) if progress.on else 0, len(files), "files read",
             force=True)

    # 2. rank 0 receives the summaries rank by rank and selects the files to merge
    sel: Selection | None = None
    decision: dict[str, Any] | None = None
    if rank == 0:
        all_s: list[NodeSummary] = list(summaries)
        for r in range(1, size):
            n = c.recv(source=r, tag=TAG_COUNT)
            for _ in range(n):
                all_s.append(c.recv(source=r, tag=TAG_SUMMARY))
        sel = Selection.of(all_s, plan["job_id"], plan["expect"] or expected_nodes_from_attrs(all_s))
        decision = {"files": [s.file for s in sel.nodes], "nodes": [s.node for s in sel.nodes],
                    "epoch": sel.epoch_rt}
        del all_s
    else:
        c.send(len(summaries), dest=0, tag=TAG_COUNT)
        for s in summaries:
            c.send(s, dest=0, tag=TAG_SUMMARY)
    decision = c.bcast(decision, root=0)
    assert decision is not None
    selected = list(zip(decision["files"], decision["nodes"]))
    steps.mark("select")
    if size > 1:  # every rank's summaries are in: all files are read
        progress("reading node files", len(files), len(files), "files read", force=True)

    # 3. the writer starts the job file and copies every selected node's tables into it, straight
    #    from the node files, while it waits for rank 0 (which fills the job-wide tables with the
    #    calls, one node at a time in the job's node order) here and in the later steps
    copies: JobFileCopies | None = None
    aligned_from = {r for r in range(size) if r != writer}  # the ranks whose aligned times the writer awaits

    def aligned_ready() -> bool:
        for r in sorted(aligned_from):
            if c.iprobe(source=r, tag=TAG_ALIGNED):
                c.recv(source=r, tag=TAG_ALIGNED)  # there: taken without a wait
                aligned_from.discard(r)
        return not aligned_from

    def wait_aligned() -> None:
        while aligned_from:
            r = min(aligned_from)
            c.recv(source=r, tag=TAG_ALIGNED)
            aligned_from.discard(r)

    if rank == writer:
        copies = JobFileCopies(job_tmp, [(node, Path(f)) for f, node in selected],
                               [(node, aligned_of[f]) for f, node in selected], aligned_ready)
        if isinstance(c, ChoresComm) and writer != 0:
            # with other ranks, the copies run whenever the writer waits for rank 0 (from the loading
            # of the calls, which rank 0 does alone, to the end of the analysis)
            c.chores = copies.step
    job: JobAnalyzer | None = None
    clock_in: ClockInput | None = None
    layout: list[tuple[StoredComm, dict[str, str]]] | None = None
    instances_file = parts_dir / "instances.h5"
    scratch_file = parts_dir / "scratch.h5"
    if rank == 0:
        assert sel is not None
        with h5py.File(scratch_file, "w") as scratch:
            store = CommStore(sel.comm_shapes(), sel.epoch_rt, scratch.create_group("store"))
            p2p = []
            progress("loading calls into the job-wide tables", 0, len(selected), "nodes")
            for ni, (f, _node) in enumerate(selected):
                calls = _load_calls(calls_of[f])
                store.add_node(ni, calls)
                p2p.append(p2p_rows(calls))
                progress("loading calls into the job-wide tables", ni + 1, len(selected), "nodes")
            job = JobAnalyzer(sel, store, p2p)  # leaves the ranks of cut-off files out of the tables
            layout = _store_layout(store)
        # the tables are complete: closed here, and every rank reads them from now on
        steps.mark("load_calls")
    # point to point: the writer's copies run while it waits for it
    if rank == 0:
        for req in [c.isend(layout, dest=r, tag=TAG_LAYOUT) for r in range(1, size)]:
            req.wait()
    else:
        layout = c.recv(source=0, tag=TAG_LAYOUT)
    assert layout is not None
    names = decision["nodes"]
    # closed by merge() when the merge ends
    tables = _open_store(layout, decision["epoch"], resources.enter_context(open_scratch_for_reads(scratch_file)))
    if rank == 0:
        assert job is not None
        job.store = tables
        # pass 1 over the tables, its blocks dealt over the ranks; the clock fit's input in a file of
        # its own, closed before the others open it
        n_scan = sum(cc.n_seq for cc in tables.comms)
        scanned = [0]

        def on_scanned(n: int) -> None:
            scanned[0] += n
            progress(SCAN_STEP, scanned[0], n_scan, "instances analysed")

        progress(SCAN_STEP, 0, n_scan, "instances analysed")
        scan_pool = RankPool(c, AnalysisContext(tables, names))
        with h5py.File(instances_file, "w") as inst_f:
            clock_in = job.scan(reference, clock_params, inst_f, scan_pool if size > 1 else None, on_scanned)
        scan_pool.close()
        if size > 1:
            steps.deal("scan", scan_pool.stats)
        progress(SCAN_STEP, n_scan, n_scan, "instances analysed", force=True)
    else:
        RankPool(c, AnalysisContext(tables, names)).serve()
    steps.mark("scan")
    # every rank fits the clocks: the windows are dealt over the ranks (CommSpread), all get the models
    clock_in = c.bcast(clock_in.without_table() if clock_in is not None else None, root=0)
    assert clock_in is not None
    with open_scratch_for_reads(instances_file) as inst_f:
        table = InstanceTable.existing(inst_f, clock_in.n_rows) if clock_in.names else None
        spread = CommSpread(c) if size > 1 else SerialSpread()
        clock = clock_in.fit(table, spread)
    if isinstance(spread, CommSpread) and rank == 0:
        steps.deal("fit_clocks", spread.stats)
    steps.mark("fit_clocks")
    progress("clock fit", clock_in.n_rows, clock_in.n_rows, f"instances on {size} rank(s)", force=True)
    models: dict[str, NodeClockModel] = {m.node: m for m in clock.models}

    # 4. every rank aligns its nodes' calls; the writer copies them in when all are done (after the
    #    analysis's items when it is not rank 0: the job file waits, the analysis does not)
    for f, node in selected:
        if f in mine:
            write_aligned_times(aligned_of[f], _load_calls(calls_of[f]), models[node], decision["epoch"])
    steps.mark("align")
    if rank != writer:
        c.send(True, dest=writer, tag=TAG_ALIGNED)

    def finish_copies() -> None:
        assert copies is not None
        if isinstance(c, ChoresComm):
            c.chores = None
            steps.note("copies_in_waits", c.chore_seconds)
        copies.finish(wait_aligned)  # what the writer had no wait for
        steps.mark("copies_left")

    if rank != 0:
        # 5. the other ranks: the items of rank 0's analysis (blocks of pass 2, the sweep's ranges, the
        #    straggler scores' windows) until rank 0 closes the pool
        RankPool(c, AnalysisContext(tables, names, models, ChunkPacker(tables, names, decision["epoch"]))).serve()
        steps.mark("analysis_items")
        if rank == writer:
            finish_copies()
            c.send(True, dest=0, tag=TAG_NODES)
            if isinstance(c, ChoresComm):
                # every node's parts are read by now (its calls loaded and aligned, its aligned times
                # copied in): the writer removes them in its waits for the page's items, so that rank
                # 0's removal of the parts directory at the end finds only its own few files
                c.chores = FileRemoval(node_parts(parts_dir, files)).step
        # then the page's passes over the nodes of the finished job file, until rank 0 has drawn it
        page = PageContext(output_paths(Path(plan["stem"]))["h5"])
        RankPool(c, page).serve()
        if isinstance(c, ChoresComm):
            c.chores = None
        page.close()
        steps.mark("page_items")
        steps.report()
        return None
    if writer == 0:
        finish_copies()

    # 5. rank 0: wait states into its part of /collectives, the rest of the analysis, the reports
    assert job is not None
    job.set_clock(clock)
    collectives_part = parts_dir / "collectives.h5"
    n_instances = sum(cc.n_seq for cc in tables.comms)
    done = [0]

    def on_block(n: int) -> None:
        done[0] += n
        progress(WAITS_STEP, done[0], n_instances, "instances analysed")

    # no chunk cache: every chunk is written whole, once (CollectivesWriter)
    with h5py.File(collectives_part, "w", libver="latest", rdcc_nbytes=0) as cf:
        progress(WAITS_STEP, 0, n_instances, "instances analysed")
        sink = RankZeroCollectives(CollectivesWriter(cf, job.names, decision["epoch"]))
        # with other ranks, rank 0 packs the blocks it computes as they do: items are dealt on demand,
        # so rank 0 may compute a block ahead of the one it writes (of another communicator, even),
        # and a packed block is written in order by the loop that takes the results (the same chunks)
        packer = ChunkPacker(tables, names, decision["epoch"])
        pool = RankPool(c, AnalysisContext(tables, names, models, packer)) if size > 1 else None
        analysis = job.finish(sink, straggler_params, pool, on_block)
        if pool is not None:
            pool.close()
            steps.deal("finish_analysis", pool.stats)
    steps.mark("finish_analysis")
    progress("wait states, stragglers", n_instances, n_instances,
             f"instances analysed in {len(job.store.comms)} communicator(s)", force=True)
    nccl = _nccl_log(files, analysis)
    texts = render_reports(analysis)
    steps.mark("render")
    # the page's communicator sections (its largest reads) from rank 0's part of /collectives, the
    # tables the job file gets, while the writer still copies the node tables (the report is final)
    comm_sections = None
    if size > 1:
        comm_sections = prepare_comms(collectives_part, analysis.report, analysis.epoch_rt)
        steps.mark("page_comms")
    if writer != 0:
        c.recv(source=writer, tag=TAG_NODES)
    steps.mark("wait_writer")
    finish_job_file(job_tmp, analysis, collectives_part, merge_ranks=size, merged_at_ns=time.time_ns())
    if nccl is not None:
        nccl_log.write_into_job_file(job_tmp, nccl)
    outs = output_paths(Path(plan["stem"]))
    os.replace(job_tmp, outs["h5"])
    # the page is drawn from the job file, the same code as `gpuprof report --html`; with other ranks
    # its passes over the nodes (their tables: most of the page at 1024 nodes) are dealt over them
    if size > 1:
        page = PageContext(outs["h5"])
        page_pool = RankPool(c, page)
        texts["html"] = render_html_file(outs["h5"], page_pool, page, comm_sections)
        page_pool.close()
        steps.deal("page", page_pool.stats)
    else:
        texts["html"] = render_html_file(outs["h5"])
    reports = write_rendered(texts, outs)
    steps.mark("job_file_reports")
    steps.report()
    partial = analysis.partial
    return MergeResult(
        job_file=outs["h5"], reports=reports, status="partial" if partial else "complete",
        partial_reasons=analysis.partial_reasons, exit_code=EXIT_PARTIAL if partial else EXIT_COMPLETE,
        job_id=analysis.job_id, stragglers=analysis.report["stragglers"], seconds=time.monotonic() - t_start,
        bytes_read=sum(os.path.getsize(f) for f in files if os.path.exists(f)),
    )


def _nccl_log(files: list[str], analysis: JobAnalysis) -> nccl_log.NcclLog | None:
    """The job's NCCL_DEBUG log when it left one (mpi_merge/nccl_log.py): its summary and NCCL's own
    counts against the collectors' go into the report (`nccl_log`), the parsed log into the job
    file (/nccl_log). A log that cannot be read is said in the report; the merge goes on."""
    if not files:
        return None
    nodes = [(s.node, s.hostname, Path(s.file)) for s in analysis.nodes]
    try:
        found = nccl_log.for_merge(Path(files[0]).parent, nodes)
    except (OSError, TraceFormatError) as e:
        analysis.report["nccl_log"] = {"error": str(e)}
        return None
    if found is None:
        return None
    log, entry = found
    analysis.report["nccl_log"] = entry
    return log


NODE_PARTS = ("claim", "read", "calls.npy", "aligned.h5")  # what the merge leaves per node file


def node_part(parts_dir: Path, i: int, kind: str) -> Path:
    """The part `kind` (NODE_PARTS) of node file i in the parts directory."""
    return parts_dir / f"{i:06d}.{kind}"


def node_parts(parts_dir: Path, files: list[str]) -> list[Path]:
    """Every node file's parts: its claim, its read marker, its calls and its aligned times."""
    return [node_part(parts_dir, i, kind) for i in range(len(files)) for kind in NODE_PARTS]


class FileRemoval:
    """Files removed a few at a time (a chore: each step takes milliseconds); a file that is not
    there (never written, or removed already) is skipped."""

    STEP_FILES = 16

    def __init__(self, paths: list[Path]):
        self.paths = paths
        self.done = 0

    def step(self) -> bool:
        """Remove the next few; False when none is left."""
        for path in self.paths[self.done:self.done + self.STEP_FILES]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self.done += self.STEP_FILES
        return self.done < len(self.paths)


def _files_read(parts_dir: Path) -> int:
    """Node files read so far by all ranks: the markers they leave in the parts directory."""
    return sum(1 for _ in parts_dir.glob("*.read"))


def claim_files(files: list[str], rank: int, size: int, parts_dir: Path) -> Iterator[str]:
    """The node files this rank reads, one at a time: file `rank` first (so that every rank reads
    one when there are enough), then each of the others that no rank has claimed yet, in order. A
    claim is the exclusive creation of a file in the parts directory (atomic on local and network
    file systems alike, and it needs no rank to answer), made just before the read: a rank slowed
    down by the machine's other load reads fewer files instead of holding back every other rank,
    as a fixed round robin would. Which rank reads a file changes nothing in the result."""
    for i, f in enumerate(files):
        if i < size:
            if i == rank:
                yield f
            continue
        try:
            fd = os.open(node_part(parts_dir, i, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            continue  # another rank reads it
        os.close(fd)
        yield f


def _load_calls(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise MergeError(f"{path}: the calls its node's rank saved cannot be read: {e}") from None


def merge_at_job_end(node_dir: str, stdout_path: str, nodes: list[str]) -> MergeResult:
    """For the lead's job-end path without MPI: one process merges `node_dir` next to the job's
    stdout (slurm-123.out -> slurm-123.gpuprof.{h5,txt,json,html})."""
    from gpuprof.slurm_hooks.paths import stdout_stem

    d, stem = stdout_stem(stdout_path)
    res = merge(node_dir, output_stem=str(d / stem), expect_nodes=nodes)
    assert res is not None
    return res
