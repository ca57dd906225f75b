"""Reports: a short text summary and JSON for machines, both from the report dict
(analysis.build_report_dict); the interactive HTML page is html_report.py's, drawn from the job
file. Reports of synthetic inputs say SYNTHETIC at the top.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpuprof.mpi_merge.analysis import JobAnalysis
from gpuprof.mpi_merge.flames import path_text
from gpuprof.mpi_merge.html_report import SYNTHETIC_BANNER
from gpuprof.mpi_merge.jobfile import _json_default
from gpuprof.mpi_merge.stragglers import P2P_COMM


def _fmt(x: Any, spec: str = ".1f", none: str = "n/a") -> str:
    if x is None:
        return none
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def render_text(r: dict[str, Any]) -> str:
    out: list[str] = []
    if r["synthetic"]:
        out += [f"*** {SYNTHETIC_BANNER} ***", ""]
    out.append(f"gpuprof job {r['job_id']}: {r['status'].upper()} merge of {len(r['nodes_merged'])} node(s)")
    if r["partial_reasons"]:
        out.append("Missing or excluded:")
        out += [f"  - {x}" for x in r["partial_reasons"][:40]]
        if len(r["partial_reasons"]) > 40:
            out.append(f"  ... and {len(r['partial_reasons']) - 40} more (see the JSON report)")
    out.append("")
    c = r["clock"]
    out.append(f"Clocks: reference {c['reference']}, method {c['method']}, {c['instances_used']} collective "
               f"instances, causality violations after alignment: {c['causality_violations']}")
    out.append(f"{'node':<14}{'offset_us':>12}{'drift_ppm':>10}{'segs':>5}{'resid_us':>9}{'+-us':>8}{'points':>8}"
               f"{'calls':>9}{'drops':>7}  state")
    for n in r["nodes"]:
        k = n["clock"]
        state = "reference" if k["reference"] else ("aligned" if k["aligned"] else "NOT ALIGNED")
        if n["partial_reasons"]:
            state += ", partial file"
        out.append(f"{n['node']:<14}{_fmt(k['offset_us'], '.1f'):>12}{_fmt(k['drift_ppm'], '.2f'):>10}"
                   f"{k['segments']:>5}{_fmt(k['residual_us'], '.2f'):>9}{_fmt(k['uncertainty_us'], '.1f'):>8}"
                   f"{k['n_points']:>8}{n['collective_calls']:>9}{n['drops_total']:>7}  {state}")
    for n in r["nodes"]:
        k = n["clock"]
        spans = k.get("unconstrained_spans_s") or []
        if spans:
            out.append(f"  {n['node']}: no collective constrains its clock over "
                       + ", ".join(f"t={a:.1f}-{b:.1f} s" for a, b in spans[:5])
                       + (f" (+{len(spans) - 5} more)" if len(spans) > 5 else "")
                       + ": its wall clock (the prior) is kept there")
        for key in ("inconsistent", "drift_note"):
            if k.get(key):
                out.append(f"  {n['node']}: {k[key]}")
    for note in c.get("notes", []):
        out.append(f"  {note}")
    out.append("")
    out.append(f"{'node':<14}{'gpu':>4}  {'name':<22}{'util%':>7}{'sm%':>7}{'mem_max_GiB':>12}")
    for n in r["nodes"]:
        for g in n["gpus"]:
            mem = g.get("mem_used_max_bytes")
            out.append(f"{n['node']:<14}{g['gpu']:>4}  {str(g.get('name', ''))[:21]:<22}"
                       f"{_fmt(g.get('util_gpu_mean'), '.0f'):>7}{_fmt(g.get('sm_activity_mean'), '.0f'):>7}"
                       f"{_fmt(None if mem is None else mem / 2**30, '.1f'):>12}")
    if r["idle_or_underused_gpus"]:
        out.append("Idle or underused GPUs: " + ", ".join(
            f"{g['node']} gpu{g['gpu']} ({g['verdict']}, {g['activity_mean']:.0f}%)" for g in r["idle_or_underused_gpus"]))
    out.append("")
    for cm in r["communicators"]:
        sk = cm["arrival_skew_ms"]
        out.append(f"Communicator {cm['comm_id']} ({cm['size']} ranks, {cm['complete']}/{cm['instances']} complete "
                   f"instances): arrival skew median {_fmt(sk['median'], '.3f')} ms, p99 {_fmt(sk['p99'], '.3f')} ms, "
                   f"own time median {_fmt(cm['own_time_ms_median'], '.3f')} ms")
        for name, v in cm["patterns"].items():
            out.append(f"  {name:<18}{v['instances']:>8} instances, {v['wait_ms_total']:>12.1f} ms waited in total")
    if r.get("p2p"):
        p = r["p2p"]
        out.append(f"Point to point: {p['pairs']} pairs ({p['unmatched']} unmatched), Late Sender "
                   f"{p['Late Sender_ms_total']:.1f} ms, Late Receiver {p['Late Receiver_ms_total']:.1f} ms")
        for why, n in (p.get("unmatched_reasons") or {}).items():
            out.append(f"  {n} {why}")
    out.append("")
    if r["stragglers"]:
        out.append("STRAGGLERS (root causes, with the waiting time of others each caused):")
        for s in r["stragglers"]:
            p2p = s["comm_id"] == P2P_COMM
            # a point-to-point finding is a node's sends: its cost is its receivers' Late Sender waits,
            # not a share of the waits at collectives (which its cost_share is, 0 here)
            out.append(f"  {s['node']} ("
                       + (P2P_COMM if p2p else f"ranks {','.join(map(str, s['ranks']))} of communicator {s['comm_id']}")
                       + f"): cause {s['cause'].upper()} ({s.get('kind', '')}), cost {s.get('cost_ns', 0) / 1e6:.1f} ms "
                       + ("of its receivers' waits" if p2p else f"({s.get('cost_share', 0):.0%} of the job's waits)")
                       + f", last in {s['share_last']:.0%} of "
                       f"instances (expected {s['expected_share']:.0%}), {s['lateness_when_last_ns'] / 1e6:.3f} ms "
                       f"late, score {_fmt(s['score_min'], '.2f')}, q={_fmt(s.get('q_value'), '.2g') if s.get('q_value') else '<1e-300'}, "
                       f"t={s['first_s']:.0f}-{s['last_s']:.0f} s")
            where = [f"{label} {s[key]!r}" for key, label in (("phase", "NVTX phase"), ("kernel", "GPU kernel"))
                     if s.get(key)]
            for table, label in (("cpu", "on CPU"), ("offcpu", "off CPU")):
                st = (s.get("stacks") or {}).get(table) or {}
                if st.get("path"):
                    where.append(f"{label} {st['share_of_extra']:.0%} of the extra in {path_text(st['path'], ' -> ')}"
                                 + (f" (asleep in {st['asleep_in']['frame']})" if st.get("asleep_in") else ""))
            kl = (s.get("stacks") or {}).get("kernel_launch") or {}
            if kl.get("path"):
                where.append(f"its kernels launched from {path_text(kl['path'], ' -> ')}")
            if where:
                out.append("      where the time went: " + "; ".join(where))
            for p in s.get("propagated", []):
                out.append(f"      propagated: {p['wait_ns'] / 1e6:.1f} ms of waiting on communicator {p['comm_id']} "
                           f"via its ranks {','.join(map(str, p['ranks']))} ({p['instances']} instances)")
            out += [f"      evidence: {e}" for e in s["evidence"]]
    else:
        summ = r.get("straggler_summary") or {}
        out.append("Stragglers: none (no rank was the origin of the others' waits more often or longer than chance, "
                   "noise and the clock error explain"
                   + (f"; {summ['tests']} tests at false discovery rate {summ['fdr_q']:g})" if summ.get("tests") else ")"))
    nl = r.get("nccl_log")
    if nl:
        out.append("")
        if "error" in nl:
            out.append(f"NCCL log: not read: {nl['error']}")
        else:
            out += nl["summary"]
            out.append(f"  NCCL's own operation counts agree with the collectors' for {nl['processes_agreeing']} of "
                       f"{nl['processes_compared']} (process, operation) pairs")
    if r["mismatches"]:
        out.append("")
        out.append("MISMATCHES:")
        for m in r["mismatches"]:
            out.append(f"  communicator {m['comm_id']}: {m['kind']} at seq {m['first_seq']}; culprit ranks "
                       f"{m['culprit_ranks'][:10]} on {', '.join(m['culprit_nodes']) or 'n/a'}: {m['detail']}")
    drops = {n["node"]: n["drops_total"] for n in r["nodes"] if n["drops_total"]}
    if drops:
        out.append("")
        out.append("Dropped records: " + ", ".join(f"{k} {v}" for k, v in drops.items()))
    if r["excluded"] or r["missing_nodes"]:
        out.append("")
        out.append("Not merged:")
        out += [f"  {e['file']}: {e['reason']}" for e in r["excluded"]]
        out += [f"  node {n}: expected, no node file" for n in r["missing_nodes"]]
    return "\n".join(out) + "\n"


# --- HTML: mpi_merge/html_report.py draws it from the job file ---------------------------------


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def render_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=1, sort_keys=True, default=_json_default) + "\n"


def render_reports(a: JobAnalysis) -> dict[str, str]:
    """The text and JSON reports as strings (the merge renders them while the job file is still
    being assembled). The HTML page is drawn from the job file once it is in place
    (html_report.render_html_file, the same code as `gpuprof report --html`)."""
    return {"txt": render_text(a.report), "json": render_json(a.report)}


def write_report(path: Path, text: str) -> None:
    """One report written atomically (`gpuprof report -o`)."""
    _atomic_write(path, text)


def write_rendered(texts: dict[str, str], outs: dict[str, Path]) -> dict[str, Path]:
    """Write each report atomically (a reader never sees half a page); `texts` holds txt, json and html."""
    for ext in ("txt", "json", "html"):
        _atomic_write(outs[ext], texts[ext])
    return {k: outs[k] for k in ("txt", "json", "html")}
