"""The MPI merge driver: any number of ranks, the same job file for every rank count.

  1. every rank summarizes its share of the node files (sorted by name, round robin);
  2. rank 0 receives the summaries rank by rank (one message per node, never one big gather),
     selects the files to merge, fits the clocks and runs the analyses (analysis.py);
  3. rank 0 broadcasts the clock models; every rank writes a part file per node it read (tables
     plus aligned times); rank 0 copies the parts into the job file, writes it under a temporary
     name and renames it into place, then the reports.

An exception on any rank propagates to the CLI, which aborts the whole MPI job with the message
(comm.Abort), so a failing rank never leaves the others waiting in a receive.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mpi_merge.analysis import JobAnalysis, analyze
from mpi_merge.clock import DEFAULT_CLOCK_PARAMS, ClockParams
from mpi_merge.jobfile import add_aligned_times, write_job_file
from mpi_merge.loading import NodeSummary, discover, expected_nodes_from_attrs, summarize_node
from mpi_merge.report import write_reports
from mpi_merge.stragglers import DEFAULT_STRAGGLER_PARAMS, StragglerParams
from slurm_hooks.errors import MergeError

EXIT_COMPLETE = 0
EXIT_ERROR = 2
EXIT_PARTIAL = 3
TAG_COUNT, TAG_SUMMARY, TAG_DONE = 11, 12, 13


class Comm(Protocol):
    """The part of mpi4py's communicator the driver uses (a serial stand-in satisfies it too)."""

    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...
    def bcast(self, obj: Any, root: int = 0) -> Any: ...
    def send(self, obj: Any, dest: int, tag: int = 0) -> None: ...
    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any: ...


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
    # 1. each rank reads its node files once: the summary, and the tables staged into a part file
    mine = list(range(rank, len(files), size))
    staged = {files[i]: parts_dir / f"{i:06d}.h5" for i in mine}
    summaries = [summarize_node(files[i], staged[files[i]]) for i in mine]

    # 2. rank 0 receives summaries rank by rank
    analysis: JobAnalysis | None = None
    decision: dict[str, Any] | None = None
    if rank == 0:
        all_s: list[NodeSummary] = list(summaries)
        for r in range(1, size):
            n = c.recv(source=r, tag=TAG_COUNT)
            for _ in range(n):
                all_s.append(c.recv(source=r, tag=TAG_SUMMARY))
        expect = plan["expect"] or expected_nodes_from_attrs(all_s)
        analysis = analyze(all_s, job_id=plan["job_id"], expect_nodes=expect, reference=reference,
                           clock_params=clock_params, straggler_params=straggler_params, release_calls=True)
        included = {s.file: s.node for s in analysis.nodes}
        decision = {"included": included, "models": {m.node: m for m in analysis.clock.models},
                    "epoch": analysis.epoch_rt}
        del all_s
    else:
        c.send(len(summaries), dest=0, tag=TAG_COUNT)
        for s in summaries:
            c.send(s, dest=0, tag=TAG_SUMMARY)
    decision = c.bcast(decision, root=0)
    assert decision is not None

    # 3. aligned times into the staged part files, then the job file on rank 0
    my_parts: dict[str, str] = {}
    for s in summaries:
        node = decision["included"].get(s.file)
        part = staged[s.file]
        if node is None or s.clock is None or not part.exists():
            part.unlink(missing_ok=True)
            continue
        add_aligned_times(part, s.clock, decision["models"][node], decision["epoch"])
        my_parts[node] = str(part)
    summaries.clear()
    if rank != 0:
        c.send(my_parts, dest=0, tag=TAG_DONE)
        return None
    assert analysis is not None
    parts = {k: Path(v) for k, v in my_parts.items()}
    for r in range(1, size):
        parts.update({k: Path(v) for k, v in c.recv(source=r, tag=TAG_DONE).items()})
    stem = Path(plan["stem"])
    outs = output_paths(stem)
    tmp = outs["h5"].with_name(f".{outs['h5'].name}.tmp-{os.getpid()}")
    try:
        write_job_file(analysis, tmp, parts, merge_ranks=size, merged_at_ns=time.time_ns())
        os.replace(tmp, outs["h5"])
    finally:
        if tmp.exists():
            tmp.unlink()
    reports = write_reports(analysis, outs)
    partial = analysis.partial
    return MergeResult(
        job_file=outs["h5"], reports=reports, status="partial" if partial else "complete",
        partial_reasons=analysis.partial_reasons, exit_code=EXIT_PARTIAL if partial else EXIT_COMPLETE,
        job_id=analysis.job_id, stragglers=analysis.report["stragglers"], seconds=time.monotonic() - t_start,
        bytes_read=sum(os.path.getsize(f) for f in files if os.path.exists(f)),
    )


def merge_at_job_end(node_dir: str, stdout_path: str, nodes: list[str]) -> MergeResult:
    """For the lead's job-end path without MPI: one process merges `node_dir` next to the job's
    stdout (slurm-123.out -> slurm-123.gpuprof.{h5,txt,json,html})."""
    from slurm_hooks.paths import stdout_stem

    d, stem = stdout_stem(stdout_path)
    res = merge(node_dir, output_stem=str(d / stem), expect_nodes=nodes)
    assert res is not None
    return res
