"""The MPI merge driver: any number of ranks, the same job file for every rank count.

  1. every rank reads its share of the node files (sorted by name, round robin): a small summary
     per node (loading.py: no calls, no bulk tables), the node's tables staged into a part file,
     and the node's collective and point-to-point calls saved beside it (.calls.npy);
  2. rank 0 receives the summaries rank by rank (one message per node) and selects the files to
     merge; it broadcasts the selection and the job's epoch;
  3. the job file's writer (the last rank, rank 0 when alone) creates the job file and copies every
     selected node's part into /nodes. Meanwhile rank 0 loads the calls one node at a time in the
     job's node order into the job-wide [seq x rank] tables of a scratch HDF5 file
     (matching.CommStore), reads them back by blocks to fit the clocks
     (analysis.JobAnalyzer.fit_clocks) and sends the models to every rank without waiting for them;
  4. every rank writes the aligned call times of its nodes into files of their own (a part is never
     written after staging, so the writer can copy it meanwhile); the writer adds them to the job
     file once every rank is done, and tells rank 0;
  5. rank 0 reads the tables by blocks again for the wait states, writing /collectives into a part
     file of its own one chunk per block, then mismatches, stragglers and the reports; once the
     writer is done, rank 0 adds /collectives, /clock, /analysis and the root attributes to the job
     file, renames it into place, then writes the reports the same way.

Rank 0's memory therefore holds the per-node summaries (bounded per node), per-instance vectors,
per-rank sums and one block of the tables: not the calls, not the [instance x node] tables, not
the bulk data (docs/merge.md, "Rank 0's memory"). Most of the copying runs on the writer, beside
rank 0's analysis. An exception on any rank propagates to the CLI, which aborts the whole MPI job
with the message (comm.Abort), so a failing rank never leaves the others waiting in a receive.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np

from mpi_merge.analysis import JobAnalyzer, Selection, p2p_rows
from mpi_merge.clock import DEFAULT_CLOCK_PARAMS, ClockParams, NodeClockModel
from mpi_merge.jobfile import (
    CollectivesWriter,
    add_aligned_times,
    copy_aligned_times,
    copy_node_tables,
    finish_job_file,
)
from mpi_merge.loading import NodeSummary, discover, expected_nodes_from_attrs, summarize_node
from mpi_merge.matching import COLLECTIVE_SET, P2P_OPS, CommStore
from mpi_merge.report import render_reports, write_rendered
from mpi_merge.stragglers import DEFAULT_STRAGGLER_PARAMS, StragglerParams
from slurm_hooks.errors import MergeError

EXIT_COMPLETE = 0
EXIT_ERROR = 2
EXIT_PARTIAL = 3
TAG_COUNT, TAG_SUMMARY, TAG_MODELS, TAG_ALIGNED, TAG_NODES = 11, 12, 14, 15, 16


class Comm(Protocol):
    """The part of mpi4py's communicator the driver uses (a serial stand-in satisfies it too)."""

    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...
    def bcast(self, obj: Any, root: int = 0) -> Any: ...
    def send(self, obj: Any, dest: int, tag: int = 0) -> None: ...
    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request: ...
    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any: ...


class Request(Protocol):
    def wait(self) -> Any: ...


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

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        raise MergeError("SerialComm has no peers to send to")

    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any:
        raise MergeError("SerialComm has no peers to receive from")


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
        from slurm_hooks.job import job_source
        from slurm_hooks.paths import node_dir_for_stdout, stdout_stem

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
) -> MergeResult | None:
    """Merge a job's node files. Returns the result on rank 0, None on the other ranks."""
    c: Comm = comm if comm is not None else SerialComm()
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
        return _merge(c, plan, files, parts_dir, t_start, reference, clock_params, straggler_params)
    finally:
        if rank == 0:
            shutil.rmtree(parts_dir, ignore_errors=True)


def _merge(c: Comm, plan: dict[str, Any], files: list[str], parts_dir: Path, t_start: float, reference: str,
           clock_params: ClockParams, straggler_params: StragglerParams) -> MergeResult | None:
    rank, size = c.Get_rank(), c.Get_size()
    # the rank that assembles the job file from the node parts while rank 0 analyzes
    writer = size - 1
    owner = {f: i % size for i, f in enumerate(files)}
    part_of = {f: parts_dir / f"{i:06d}.h5" for i, f in enumerate(files)}
    calls_of = {f: parts_dir / f"{i:06d}.calls.npy" for i, f in enumerate(files)}
    # aligned call times go to a file of their own: a part is never written once staged, so the
    # writer can copy it while its owner reads it
    aligned_of = {f: parts_dir / f"{i:06d}.aligned.h5" for i, f in enumerate(files)}
    job_tmp = parts_dir / "job.h5"  # beside the output (same file system), renamed into place at the end

    # 1. each rank reads its node files once: the summary, the tables staged into a part file, and
    #    the calls the analysis reads saved for rank 0 to load one node at a time (step 3)
    summaries: list[NodeSummary] = []
    for f in files:
        if owner[f] == rank:
            s = summarize_node(f, part_of[f])
            if s.error is None:
                np.save(calls_of[f], analysis_calls(s.calls), allow_pickle=False)
            s.calls = np.zeros(0, s.calls.dtype)  # a new empty array: a slice would keep them
            summaries.append(s)
    mine = {s.file: s for s in summaries}

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
            # the clock map (its pairs) serves only the owner, for the aligned call times (step 4)
            c.send(replace(s, clock=None), dest=0, tag=TAG_SUMMARY)
    decision = c.bcast(decision, root=0)
    assert decision is not None
    selected = list(zip(decision["files"], decision["nodes"]))
    for s in summaries:
        if s.file not in decision["files"]:
            part_of[s.file].unlink(missing_ok=True)

    # 3. the writer starts the job file with every selected node's tables, while rank 0 fills the
    #    job-wide tables with the calls, one node at a time in the job's node order, and fits the clocks
    node_parts = [(node, part_of[f]) for f, node in selected]
    if rank == writer:
        copy_node_tables(job_tmp, node_parts)
    models: dict[str, NodeClockModel] | None = None
    sent: list[Request] = []
    job: JobAnalyzer | None = None
    scratch: h5py.File | None = None
    if rank == 0:
        assert sel is not None
        scratch = h5py.File(parts_dir / "scratch.h5", "w")
        store = CommStore(sel.comm_shapes(), sel.epoch_rt, scratch.create_group("store"))
        p2p = []
        for ni, (f, _node) in enumerate(selected):
            calls = _load_calls(calls_of[f])
            store.add_node(ni, calls)
            p2p.append(p2p_rows(calls))
        job = JobAnalyzer(sel, store, p2p, scratch)
        models = {m.node: m for m in job.fit_clocks(reference, clock_params).models}
        # not a broadcast: the writer takes them once its copy is done, rank 0 goes on meanwhile
        sent = [c.isend(models, dest=r, tag=TAG_MODELS) for r in range(1, size)]
    else:
        models = c.recv(source=0, tag=TAG_MODELS)
    assert models is not None

    # 4. every rank aligns its nodes' calls; the writer copies them in when all are done
    for f, node in selected:
        if owner[f] == rank:
            clock = mine[f].clock
            if clock is None:
                raise MergeError(f"{f}: selected for the merge but its summary has no clock map")
            add_aligned_times(part_of[f], clock, models[node], decision["epoch"], out=aligned_of[f])
    if rank != writer:
        c.send(True, dest=writer, tag=TAG_ALIGNED)
    else:
        for r in range(size):
            if r != writer:
                c.recv(source=r, tag=TAG_ALIGNED)
        copy_aligned_times(job_tmp, [(node, aligned_of[f]) for f, node in selected])
        if writer != 0:
            c.send(True, dest=0, tag=TAG_NODES)
    if rank != 0:
        return None

    # 5. rank 0: wait states into its part of /collectives, the rest of the analysis, the reports
    assert job is not None and scratch is not None
    collectives_part = parts_dir / "collectives.h5"
    try:
        # no chunk cache: every chunk is written whole, once (CollectivesWriter)
        with h5py.File(collectives_part, "w", libver="latest", rdcc_nbytes=0) as cf:
            analysis = job.finish(CollectivesWriter(cf, job.names, decision["epoch"]), straggler_params)
    finally:
        scratch.close()
    texts = render_reports(analysis)
    for req in sent:
        req.wait()
    if writer != 0:
        c.recv(source=writer, tag=TAG_NODES)
    finish_job_file(job_tmp, analysis, collectives_part, merge_ranks=size, merged_at_ns=time.time_ns())
    outs = output_paths(Path(plan["stem"]))
    os.replace(job_tmp, outs["h5"])
    reports = write_rendered(texts, outs)
    partial = analysis.partial
    return MergeResult(
        job_file=outs["h5"], reports=reports, status="partial" if partial else "complete",
        partial_reasons=analysis.partial_reasons, exit_code=EXIT_PARTIAL if partial else EXIT_COMPLETE,
        job_id=analysis.job_id, stragglers=analysis.report["stragglers"], seconds=time.monotonic() - t_start,
        bytes_read=sum(os.path.getsize(f) for f in files if os.path.exists(f)),
    )


def analysis_calls(calls: np.ndarray) -> np.ndarray:
    """The calls of a node that the job-wide analysis reads: collectives and point-to-point."""
    return calls[np.isin(calls["op"], list(COLLECTIVE_SET | P2P_OPS))]


def _load_calls(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise MergeError(f"{path}: the calls its node's rank saved cannot be read: {e}") from None


def merge_at_job_end(node_dir: str, stdout_path: str, nodes: list[str]) -> MergeResult:
    """For the lead's job-end path without MPI: one process merges `node_dir` next to the job's
    stdout (slurm-123.out -> slurm-123.gpuprof.{h5,txt,json,html})."""
    from slurm_hooks.paths import stdout_stem

    d, stem = stdout_stem(stdout_path)
    res = merge(node_dir, output_stem=str(d / stem), expect_nodes=nodes)
    assert res is not None
    return res
