"""The job-wide analysis on rank 0: node summaries in, everything the job file and reports need out.

Pure: no MPI, no paths opened. The order of `summaries` does not matter (they are sorted by file
name here), so every rank count gives the same result.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from collector import schema
from mpi_merge.clock import DEFAULT_CLOCK_PARAMS, ClockFit, ClockParams, fit_clocks
from mpi_merge.loading import NodeSummary
from mpi_merge.matching import (
    CommTable,
    Mismatch,
    build_comms,
    describe,
    find_mismatches,
    match_p2p,
    node_instances,
)
from mpi_merge.stragglers import DEFAULT_STRAGGLER_PARAMS, Finding, StragglerParams, find_stragglers
from mpi_merge.waitstates import PATTERNS, CommWaits, P2PWaits, compute_p2p_waits, compute_waits, rank_summary


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
    comms: list[CommTable]
    enter_al: list[np.ndarray]
    exit_al: list[np.ndarray]
    waits: list[CommWaits]
    p2p_waits: P2PWaits | None
    mismatches: list[Mismatch]
    findings: list[Finding]
    straggler_metrics: dict[str, Any]
    partial_reasons: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)

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
    """`release_calls`: empty each summary's call array once matched (the merge driver's choice, to
    bound rank 0's memory; library callers that analyze the same summaries twice keep them)."""
    nodes, excluded, missing, job = select_nodes(summaries, job_id, expect_nodes)
    partial: list[str] = []
    for e in excluded:
        partial.append(f"excluded {Path(e.file).name}: {e.reason}")
    for n in missing:
        partial.append(f"node {n}: expected, but no node file")
    for s in nodes:
        for r in s.partial_reasons:
            partial.append(f"node {s.node}: {r}")
    names = [s.node for s in nodes]
    epoch = min((s.span_rt[0] for s in nodes if s.span_rt is not None), default=0)
    calls = [s.calls for s in nodes]
    for s in nodes:
        if not s.n_calls:
            partial.append(f"node {s.node}: no collective calls recorded (metrics kept, clock not aligned)")
    comms = build_comms(calls, epoch)
    inst = node_instances(comms, len(nodes))
    if reference and reference not in names:
        partial.append(f"configured reference node {reference} not among the merged nodes; using the first")
        reference = ""
    if not reference:
        with_calls = [s.node for s in nodes if s.n_calls]
        reference = with_calls[0] if with_calls else (names[0] if names else "")
    if names:
        clock = fit_clocks(inst, names, reference, clock_params,
                           clock_domains=[f"{s.hostname}/{s.boot_id}" for s in nodes])
    else:
        clock = ClockFit(reference, clock_params.method, [], [])
    for m in clock.models:
        if not m.aligned and nodes[names.index(m.node)].n_calls:
            partial.append(f"node {m.node}: clock not aligned: {m.reason}")
    models = {m.node: m for m in clock.models}
    enter_al, exit_al = [], []
    for t in comms:
        E = t.enter.copy()
        X = t.exit.copy()
        for col in range(t.size):
            ni = int(t.node_of_rank[col])
            if ni >= 0:
                E[:, col] = models[names[ni]].align(E[:, col])
                X[:, col] = models[names[ni]].align(X[:, col])
        enter_al.append(E)
        exit_al.append(X)
    waits = [compute_waits(t, E, X) for t, E, X in zip(comms, enter_al, exit_al)]
    p2p = match_p2p(calls, epoch)
    p2p_waits = None
    if len(p2p.src):
        def al(nodes_idx: np.ndarray, t: np.ndarray) -> np.ndarray:
            out = t.copy()
            for ni in np.unique(nodes_idx):
                sel = nodes_idx == ni
                out[sel] = models[names[int(ni)]].align(t[sel])
            return out
        p2p_waits = compute_p2p_waits(p2p, al(p2p.send_node, p2p.send_enter), al(p2p.send_node, p2p.send_exit),
                                      al(p2p.recv_node, p2p.recv_enter))
    # the per-call arrays are not needed past matching: release them (at 128 nodes they are the
    # largest thing rank 0 holds), keeping only the counts the report shows
    del calls, inst
    if release_calls:
        for s in nodes:
            s.calls = s.calls[:0]
    partial_nodes = {s.node for s in nodes if s.partial_reasons}
    mism = find_mismatches(comms, names, partial_nodes, {e.node: e.reason for e in excluded if e.node})
    for mm in mism:
        partial.append(f"communicator {mm.comm_id:#x}: {mm.kind} at seq {mm.first_seq}: {mm.detail}")
    findings, smetrics = find_stragglers(
        comms, waits, enter_al, exit_al, names, [s.series for s in nodes], epoch, 0.0, straggler_params
    )
    a = JobAnalysis(
        job_id=job, synthetic=any(s.synthetic for s in nodes), nodes=nodes, excluded=excluded,
        missing_nodes=missing, epoch_rt=epoch, clock=clock, comms=comms, enter_al=enter_al, exit_al=exit_al,
        waits=waits, p2p_waits=p2p_waits, mismatches=mism, findings=findings, straggler_metrics=smetrics,
        partial_reasons=partial,
    )
    if p2p.unmatched:
        a.partial_reasons.append(f"{p2p.unmatched} point-to-point calls without a matching partner")
    a.report = build_report_dict(a, p2p.unmatched)
    return a


def _f(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def build_report_dict(a: JobAnalysis, p2p_unmatched: int = 0) -> dict[str, Any]:
    """The machine-readable report (the .json file); the text and HTML reports render it."""
    ms = 1e6
    nodes = []
    for s in a.nodes:
        m = a.clock.model(s.node)
        nodes.append({
            "node": s.node, "file": Path(s.file).name, "hostname": s.hostname, "sealed": s.sealed,
            "partial_reasons": s.partial_reasons, "collective_calls": s.n_calls,
            "drops": s.drops, "drops_total": int(sum(s.drops.values())), "errors": s.errors[:20],
            "errors_total": len(s.errors), "missing_metrics": s.missing_metrics[:20],
            "clock": {
                "aligned": m.aligned, "reason": m.reason, "reference": m.is_reference,
                "offset_us": _f(float(m.offset_ns(np.array([m.seg_start[0]]))[0]) / 1e3) if len(m.seg_start) else None,
                "drift_ppm": _f(m.mean_drift_ppm) if m.aligned else None,
                "segments": len(m.seg_start), "residual_us": _f(m.residual_ns / 1e3),
                "uncertainty_us": _f(m.uncertainty_ns / 1e3), "n_points": m.n_points,
            },
            "gpus": s.gpus,
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
    for t, w in zip(a.comms, a.waits):
        comp = w.complete
        pat = {}
        for pi, name in enumerate(PATTERNS):
            sel = w.pattern == pi
            if sel.any():
                pat[name] = {"instances": int(sel.sum()), "wait_ms_total": float(np.nansum(w.waits[sel])) / ms}
        skew = w.last_enter[comp] - np.nanmin(a.enter_al[a.comms.index(t)][comp], axis=1) if comp.any() else np.zeros(0)
        comms.append({
            "comm_id": f"{t.comm_id:#x}", "size": t.size, "instances": t.n_seq, "complete": int(comp.sum()),
            "ranks_seen": int((t.node_of_rank >= 0).sum()), "patterns": pat,
            "arrival_skew_ms": {"median": _f(float(np.median(skew)) / ms) if len(skew) else None,
                                "p99": _f(float(np.percentile(skew, 99)) / ms) if len(skew) else None},
            "own_time_ms_median": _f(float(np.nanmedian(w.own_time[comp])) / ms) if comp.any() else None,
        })
    ranks = rank_summary(a.waits, a.comms, a.node_names)
    return {
        "schema": "slurm-gpuprof.report", "schema_version": 1, "job_id": a.job_id, "synthetic": a.synthetic,
        "status": "partial" if a.partial else "complete", "partial_reasons": a.partial_reasons,
        "nodes_merged": a.node_names, "missing_nodes": a.missing_nodes,
        "excluded": [{"file": Path(e.file).name, "node": e.node, "reason": e.reason} for e in a.excluded],
        "clock": {"reference": a.clock.reference, "method": a.clock.method, "components": a.clock.components,
                  "causality_violations": a.clock.causality_violations,
                  "instances_used": a.clock.instances_used, "notes": a.clock.notes},
        "nodes": nodes, "idle_or_underused_gpus": idle, "communicators": comms, "ranks": ranks,
        "stragglers": [f.as_dict() for f in a.findings], "straggler_metrics": a.straggler_metrics,
        "mismatches": [describe(m) for m in a.mismatches],
        "p2p": None if a.p2p_waits is None else {
            "pairs": len(a.p2p_waits.late_sender_ns), "unmatched": p2p_unmatched,
            "Late Sender_ms_total": float(a.p2p_waits.late_sender_ns.sum()) / ms,
            "Late Receiver_ms_total": float(a.p2p_waits.late_receiver_ns.sum()) / ms,
        },
        "op_names": list(schema.COLLECTIVE_OPS),
    }
