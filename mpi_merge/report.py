"""Reports: a short text summary, JSON for machines, one self-contained HTML page with inline SVG.

The text and JSON render the report dict (analysis.build_report_dict); the HTML also draws the
lanes and the wait heat map the analysis kept of the first communicator (a bounded number of
cells). Every name that comes from a trace (nodes, hosts, GPU names, evidence) is escaped.
Reports of synthetic inputs say SYNTHETIC at the top.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from gpuprof.mpi_merge.analysis import JobAnalysis
from gpuprof.mpi_merge.common import quiet_nan
from gpuprof.mpi_merge.jobfile import _json_default
from gpuprof.mpi_merge.waitstates import PATTERNS

SYNTHETIC_BANNER = "SYNTHETIC DATA (gpuprof.mpi_merge.synthetic): not a measurement of any real job"


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
            out.append(f"  {s['node']} (ranks {','.join(map(str, s['ranks']))} of communicator {s['comm_id']}): "
                       f"cause {s['cause'].upper()} ({s.get('kind', '')}), cost {s.get('cost_ns', 0) / 1e6:.1f} ms "
                       f"({s.get('cost_share', 0):.0%} of the job's waits), last in {s['share_last']:.0%} of "
                       f"instances (expected {s['expected_share']:.0%}), {s['lateness_when_last_ns'] / 1e6:.3f} ms "
                       f"late, score {_fmt(s['score_min'], '.2f')}, q={_fmt(s.get('q_value'), '.2g') if s.get('q_value') else '<1e-300'}, "
                       f"t={s['first_s']:.0f}-{s['last_s']:.0f} s")
            for p in s.get("propagated", []):
                out.append(f"      propagated: {p['wait_ns'] / 1e6:.1f} ms of waiting on communicator {p['comm_id']} "
                           f"via its ranks {','.join(map(str, p['ranks']))} ({p['instances']} instances)")
            out += [f"      evidence: {e}" for e in s["evidence"]]
    else:
        summ = r.get("straggler_summary") or {}
        out.append("Stragglers: none (no rank was the origin of the others' waits more often or longer than chance, "
                   "noise and the clock error explain"
                   + (f"; {summ['tests']} tests at false discovery rate {summ['fdr_q']:g})" if summ.get("tests") else ")"))
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


# --- HTML -----------------------------------------------------------------------------------------
def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _svg_lanes(a: JobAnalysis, by_time: bool) -> str:
    """Per node lanes of the first communicator: bars from enter to exit, by index or aligned time."""
    if not a.comms:
        return "<p>no collectives</p>"
    ln = a.lanes
    if ln is None:
        return "<p>no complete instances</p>"
    c = a.comms[0]
    shown = ln.enter.shape[1]  # the first ranks; the heat map covers all
    W, lane, left = 900, 14, 110
    H = lane * shown + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-size="10">']
    if by_time:
        t0, t1 = float(np.nanmin(ln.first_enter)), float(np.nanmax(ln.last_exit))
    else:
        t0, t1 = 0.0, float(len(ln.seqs))
    sx = (W - left - 10) / max(t1 - t0, 1e-9)
    for r in range(shown):
        y = 10 + r * lane
        ni = int(c.node_of_rank[r])
        label = f"r{r} {a.node_names[ni] if ni >= 0 else '?'}"
        parts.append(f'<text x="2" y="{y + 10}">{_e(label)}</text>')
        for j, k in enumerate(ln.seqs):
            e, x = ln.enter[j, r], ln.exit[j, r]
            if by_time:
                x0, x1 = left + (e - t0) * sx, left + (x - t0) * sx
            else:
                # by index: the wait before the last arrival in orange, the collective's own time in blue
                span = (ln.last_exit[j] - ln.first_enter[j]) or 1.0
                x0 = left + (j + (e - ln.first_enter[j]) / span) * sx
                x1 = left + (j + (x - ln.first_enter[j]) / span) * sx
            last = ln.last_rank[j] == r
            parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 0.5):.1f}" height="{lane - 3}" '
                         f'fill="{"#d62728" if last else "#ff7f0e"}" opacity="0.8"><title>{_e(label)} seq {k}'
                         f'{" (last)" if last else ""}</title></rect>')
    axis = "aligned time (ms)" if by_time else "collective index"
    more = f" (first {shown} of {c.size} ranks)" if shown < c.size else ""
    parts.append(f'<text x="{left}" y="{H - 5}">{_e(axis)}: red = arrived last{more}</text></svg>')
    return "".join(parts)


def _svg_heatmap(a: JobAnalysis) -> str:
    if not a.comms:
        return "<p>no collectives</p>"
    if a.heat is None:
        return "<p>no complete instances</p>"
    c, M = a.comms[0], a.heat  # [size, columns]: mean wait per rank and group of collectives
    with quiet_nan():
        vmax = float(np.nanpercentile(M, 99)) or 1.0
    cw, ch, left = max(1.0, 800 / M.shape[1]), max(4, min(14, 400 // max(1, c.size))), 110
    H = int(ch * c.size + 30)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{int(left + cw * M.shape[1] + 10)}" height="{H}" font-size="10">']

    def cell(r: int, j: int) -> str:
        v = M[r, j]
        level = 0.0 if not np.isfinite(v) else min(1.0, v / vmax)
        col = f"rgb({int(255 * level)},{int(80 * (1 - level))},{int(255 * (1 - level))})"
        return f'<rect x="{left + j * cw:.1f}" y="{r * ch}" width="{cw + 0.2:.1f}" height="{ch}" fill="{col}"/>'

    for r in range(c.size):
        ni = int(c.node_of_rank[r])
        if ch >= 8:
            parts.append(f'<text x="2" y="{r * ch + ch}">{_e(f"r{r} " + (a.node_names[ni] if ni >= 0 else "?"))}</text>')
        # one string per rank rather than one per cell: the page is the same, its build smaller
        parts.append("".join(cell(r, j) for j in range(M.shape[1])))
    parts.append(f'<text x="{left}" y="{H - 5}">wait per rank (rows) and collective group (columns); red = up to '
                 f'{vmax / 1e6:.3f} ms</text></svg>')
    return "".join(parts)


def _svg_offsets(r: dict[str, Any]) -> str:
    rows = [n for n in r["nodes"] if n["clock"]["offset_us"] is not None]
    if not rows:
        return "<p>no clock model</p>"
    vals = [n["clock"]["offset_us"] for n in rows]
    errs = [n["clock"]["uncertainty_us"] or 0.0 for n in rows]
    lo, hi = min(v - e for v, e in zip(vals, errs)), max(v + e for v, e in zip(vals, errs))
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    W, rowh, left = 700, 14, 110
    sx = (W - left - 20) / max(hi - lo, 1e-9)
    H = rowh * len(rows) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-size="10">']
    x0 = left + (0 - lo) * sx
    parts.append(f'<line x1="{x0:.1f}" y1="0" x2="{x0:.1f}" y2="{H - 20}" stroke="#999"/>')
    for i, (n, v, e) in enumerate(zip(rows, vals, errs)):
        y = 10 + i * rowh
        parts.append(f'<text x="2" y="{y + 4}">{_e(n["node"])}</text>')
        parts.append(f'<line x1="{left + (v - e - lo) * sx:.1f}" y1="{y}" x2="{left + (v + e - lo) * sx:.1f}" y2="{y}" '
                     f'stroke="#333"/><circle cx="{left + (v - lo) * sx:.1f}" cy="{y}" r="3" fill="#1f77b4">'
                     f'<title>{_e(n["node"])}: {v:.1f} us +- {e:.1f} us</title></circle>')
    parts.append(f'<text x="{left}" y="{H - 5}">offset at start vs reference (us), bars = causality interval '
                 f'half-width; range {lo:.0f} to {hi:.0f} us</text></svg>')
    return "".join(parts)


def _svg_metric(a: JobAnalysis, suffix: str, title: str) -> str:
    series = [(s.node, k, v) for s in a.nodes for k, v in s.series.items() if k.endswith(suffix)]
    if not series:
        return f"<p>no {_e(title)} samples</p>"
    W, H, left = 900, 160, 40
    t0 = min(int(v.t_rt[0]) for _, _, v in series)
    t1 = max(int(v.t_rt[-1]) for _, _, v in series) or t0 + 1
    with quiet_nan():
        vmax = max(float(np.nanmax(v.values)) if np.isfinite(v.values).any() else 0.0 for _, _, v in series) or 1.0
    sx, sy = (W - left - 10) / max(t1 - t0, 1), (H - 30) / vmax
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-size="10">']
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    for i, (node, key, v) in enumerate(series[:64]):
        ok = np.isfinite(v.values)
        # the same arithmetic as per point, on arrays, then formatted as Python floats (fast)
        xs = (left + (v.t_rt[ok] - t0) * sx).tolist()
        ys = (H - 20 - v.values[ok] * sy).tolist()
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
        parts.append(f'<polyline fill="none" stroke="{palette[i % len(palette)]}" stroke-width="1" points="{pts}">'
                     f'<title>{_e(node)} {_e(key)}</title></polyline>')
    parts.append(f'<text x="{left}" y="{H - 5}">{_e(title)} (max {vmax:.0f}) over the job, one line per GPU</text></svg>')
    return "".join(parts)


def render_html(a: JobAnalysis) -> str:
    r = a.report
    banner = f'<div class="syn">{_e(SYNTHETIC_BANNER)}</div>' if r["synthetic"] else ""
    rows = []
    for n in r["nodes"]:
        k = n["clock"]
        rows.append("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in (
            n["node"], n["hostname"], _fmt(k["offset_us"]), _fmt(k["drift_ppm"], ".2f"), k["segments"],
            _fmt(k["residual_us"], ".2f"), _fmt(k["uncertainty_us"]), k["n_points"], n["collective_calls"],
            n["drops_total"], "; ".join(n["partial_reasons"]) or ("not aligned: " + k["reason"] if not k["aligned"] else ""),
        )) + "</tr>")
    strag = "".join(
        f"<li><b>{_e(s['node'])}</b> (ranks {_e(','.join(map(str, s['ranks'])))} of {_e(s['comm_id'])}): root cause "
        f"{_e(s['cause'])} ({_e(s.get('kind', ''))}), cost {s.get('cost_ns', 0) / 1e6:.1f} ms "
        f"({s.get('cost_share', 0):.0%} of the job's waits), last in {s['share_last']:.0%} "
        f"(expected {s['expected_share']:.0%})<ul>"
        + "".join(f"<li>propagated: {p['wait_ns'] / 1e6:.1f} ms on {_e(p['comm_id'])} via ranks "
                  f"{_e(','.join(map(str, p['ranks'])))}</li>" for p in s.get("propagated", []))
        + "".join(f"<li>{_e(e)}</li>" for e in s["evidence"]) + "</ul></li>"
        for s in r["stragglers"]
    ) or "<li>none</li>"
    missing = "".join(f"<li>{_e(x)}</li>" for x in r["partial_reasons"]) or "<li>nothing</li>"
    mism = "".join(f"<li>{_e(m['comm_id'])} {_e(m['kind'])} at seq {m['first_seq']}: {_e(m['detail'])}</li>"
                   for m in r["mismatches"]) or "<li>none</li>"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>gpuprof job {_e(r['job_id'])}</title>
<style>body{{font-family:sans-serif;margin:1em}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;
padding:2px 6px;font-size:12px}} .syn{{background:#c00;color:#fff;padding:6px;font-weight:bold}}</style></head>
<body>{banner}
<h1>gpuprof job {_e(r['job_id'])}: {_e(r['status'])}</h1>
<h2>Missing or excluded</h2><ul>{missing}</ul>
<h2>Stragglers</h2><ul>{strag}</ul>
<h2>Mismatches</h2><ul>{mism}</ul>
<h2>Nodes and clocks (reference {_e(r['clock']['reference'])}, method {_e(r['clock']['method'])})</h2>
<table><tr><th>node</th><th>host</th><th>offset us</th><th>drift ppm</th><th>segments</th><th>residual us</th>
<th>+- us</th><th>points</th><th>calls</th><th>drops</th><th>notes</th></tr>{''.join(rows)}</table>
<h2>Clock offsets with error bars</h2>{_svg_offsets(r)}
<h2>Per rank lanes by collective index</h2>{_svg_lanes(a, by_time=False)}
<h2>Per rank lanes by aligned time</h2>{_svg_lanes(a, by_time=True)}
<h2>Wait time heat map (rank x collective)</h2>{_svg_heatmap(a)}
<h2>GPU metric timelines</h2>{_svg_metric(a, ':sm_activity', 'SM activity %')}{_svg_metric(a, ':util_gpu', 'GPU utilization %')}
<h2>Wait states</h2><p>{_e(', '.join(PATTERNS))}</p>
<pre>{_e(json.dumps(r['communicators'], indent=1))}</pre>
</body></html>
"""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def render_reports(a: JobAnalysis) -> dict[str, str]:
    """The text, JSON and HTML reports as strings (the merge renders them while the job file is
    still being assembled, and writes them once it is in place)."""
    return {"txt": render_text(a.report),
            "json": json.dumps(a.report, indent=1, sort_keys=True, default=_json_default) + "\n",
            "html": render_html(a)}


def write_rendered(texts: dict[str, str], outs: dict[str, Path]) -> dict[str, Path]:
    for ext in ("txt", "json", "html"):
        _atomic_write(outs[ext], texts[ext])
    return {k: outs[k] for k in ("txt", "json", "html")}
