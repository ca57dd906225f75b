"""Figures of the HTML report and the trace exports on a 256-node SYNTHETIC job (gpuprof.mpi_merge.synthetic):

    .venv/bin/python tests/bench/bench_report.py [--quick] [--nodes 256] [--duration-s 30] [--repeats 3]
        [--cache DIR] [--libraries DIR] [--job JOB_FILE] [--parts html,exports,libraries]

One JSON line each (medians of interleaved runs, with min and max):
{"bench": "report_html", "nodes": 256, "file_mb": ..., "render_s": ..., "load_s_chromium": ...}
  render_s: `gpuprof report --html`'s drawing of the page from the job file (in process);
  load_s_chromium: from navigation start to every section drawn and every chart painted (the
  page's own performance.now() when it sets #gp-done[data-painted-ms]), headless Chromium, network
  cut; chromium_wall_s is the whole browser session (start, load, paint, checks). Goals: file_mb
  <= 10, load_s_chromium <= 5.
{"bench": "perfetto_export", "events": ..., "mb": ..., "s": ..., "chrome_json": {...}, ...}
  the protobuf export (perfetto_export.py) against the Chrome JSON export of the same job in the
  same run (ratios: protobuf over JSON).
{"bench": "otf2_export", "events": ..., "mb": ..., "s": ...}
{"bench": "report_chart_library", "library": ..., "lib_kb": ..., "draw_s": ...} per candidate, with
  --libraries DIR holding the npm packages unpacked (`npm pack echarts@6.1.0 uplot@1.6.32
  plotly.js-dist-min@4.1.2` and `tar xzf` each into DIR/<name>-<version>/): each draws the same 256-node
  data (the page's metric series and one communicator's lanes) in Chromium; how the library in
  mpi_merge/assets/ was chosen (docs/report.md).

--quick: 256 nodes for 3 s, one run each. --cache DIR keeps the generated job and its merge.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/headless.py

from headless import chromium, open_page


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def log(msg: str) -> None:
    print(f"bench_report: {msg}", file=sys.stderr, flush=True)


def med(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def job_file(nodes: int, duration_s: float, work: Path) -> Path:
    from gpuprof.mpi_merge import synthetic as syn
    from gpuprof.mpi_merge.merge import merge

    d = work / f"report{nodes}-{duration_s:g}s.gpuprof.d"
    out = d.with_suffix(".h5")
    if out.exists() and (d / ".merged").exists():
        return out
    shutil.rmtree(d, ignore_errors=True)
    t0 = time.monotonic()
    syn.generate(syn.SynthConfig(nodes=nodes, duration_s=duration_s, gpus_per_node=2, seed=3,
                                 stragglers=[syn.Straggler(min(37, nodes - 1), "gpu", duration_s * 0.2,
                                                           duration_s * 0.8)]), d)
    log(f"generated {nodes} nodes x {duration_s:g} s in {time.monotonic() - t0:.0f} s; merging")
    t0 = time.monotonic()
    res = merge(str(d))
    assert res is not None
    log(f"merged in {time.monotonic() - t0:.0f} s")
    (d / ".merged").touch()
    return res.job_file


def bench_html(job: Path, nodes: int, repeats: int, work: Path) -> None:
    from gpuprof.mpi_merge.html_report import render_html_file

    render, load_ms, wall = [], [], []
    page = work / "bench.html"
    for _ in range(repeats):  # interleaved: drawing in Python, then loading in the browser
        t0 = time.monotonic()
        text = render_html_file(job)
        render.append(time.monotonic() - t0)
        page.write_text(text, encoding="utf-8")
        t0 = time.monotonic()
        with open_page(page) as p:
            painted = int(p.js("document.getElementById('gp-done').dataset.paintedMs"))
            errs = p.js("document.getElementById('gp-errors').dataset.count")
            if errs != "0" or p.console:
                raise SystemExit(f"bench_report: the page did not draw cleanly: console {p.console[:3]}")
        load_ms.append(painted / 1e3)
        wall.append(time.monotonic() - t0)
    r, ld = med(render), med(load_ms)
    emit({"bench": "report_html", "nodes": nodes, "file_mb": round(page.stat().st_size / 1e6, 2),
          "render_s": r["median"], "render_s_min_max": [r["min"], r["max"]],
          "load_s_chromium": ld["median"], "load_s_chromium_min_max": [ld["min"], ld["max"]],
          "chromium_wall_s": med(wall)["median"], "goals": {"file_mb": 10, "load_s_chromium": 5},
          "runs": repeats, "load1": round(os.getloadavg()[0], 2), "cores": os.cpu_count(), "synthetic": True})


def bench_exports(job: Path, nodes: int, repeats: int, work: Path) -> None:
    import h5py

    from gpuprof.mpi_merge.export import export_perfetto
    from gpuprof.mpi_merge.otf2_export import export_otf2
    from gpuprof.mpi_merge.perfetto_export import export_perfetto_proto

    runs: dict[str, list[float]] = {"proto": [], "json": [], "otf2": []}
    n: dict[str, int] = {}
    size: dict[str, float] = {}
    for _ in range(repeats):  # interleaved
        with h5py.File(job, "r") as f:
            t0 = time.monotonic()
            c = export_perfetto_proto(f, work / "t.pftrace")
            runs["proto"].append(time.monotonic() - t0)
            n["proto"], size["proto"] = c.events, (work / "t.pftrace").stat().st_size / 1e6
            kinds = {"slices": c.slices, "flows": c.flows, "counter_values": c.counters, "nvtx": c.nvtx,
                     "kernels": c.kernels, "stack_samples": c.samples, "tracks": c.tracks}
            t0 = time.monotonic()
            n["json"] = export_perfetto(f, work / "t.json")
            runs["json"].append(time.monotonic() - t0)
            size["json"] = (work / "t.json").stat().st_size / 1e6
            t0 = time.monotonic()
            o = export_otf2(f, work / "t.otf2")
            runs["otf2"].append(time.monotonic() - t0)
            n["otf2"] = o.events
            size["otf2"] = sum(p.stat().st_size for p in (work / "t.otf2").rglob("*") if p.is_file()) / 1e6
    p, j, o2 = med(runs["proto"]), med(runs["json"]), med(runs["otf2"])
    emit({"bench": "perfetto_export", "nodes": nodes, "events": n["proto"], "events_by_kind": kinds,
          "mb": round(size["proto"], 2),
          "s": p["median"], "s_min_max": [p["min"], p["max"]],
          "chrome_json": {"events": n["json"], "mb": round(size["json"], 2), "s": j["median"], "s_min_max": [j["min"], j["max"]],
                          "holds": "collective calls only"},
          "mb_ratio_proto_over_json": round(size["proto"] / size["json"], 3),
          "s_ratio_proto_over_json": round(p["median"] / j["median"], 3),
          "proto_holds": "collective calls, instances with flows, every GPU/host counter, NVTX, kernels, stack samples",
          "runs": repeats, "synthetic": True})
    emit({"bench": "otf2_export", "nodes": nodes, "events": n["otf2"], "mb": round(size["otf2"], 2), "s": o2["median"],
          "s_min_max": [o2["min"], o2["max"]], "runs": repeats, "synthetic": True})


# --- chart library candidates -------------------------------------------------------------------
CANDIDATES = {  # name -> (folder under --libraries, minified file in it)
    "echarts-6.1.0": ("echarts-6.1.0/package/dist", "echarts.min.js"),
    "uplot-1.6.32": ("uplot-1.6.32/package/dist", "uPlot.iife.min.js"),
    "plotly.js-dist-min-4.1.2": ("plotly.js-dist-min-4.1.2/package", "plotly.min.js"),
}
DRAW = {
    # each gets D = {metrics: [{title, series: [[y per bin]...]}], xs: [t per bin], lanes: {ranks, cells}}
    "echarts": """
function drawAll(root){
  D.metrics.forEach(function(m){ var d=document.createElement('div'); d.style.height='190px'; d.style.width='1300px'; root.appendChild(d);
    echarts.init(d).setOption({animation:false, xAxis:{type:'value'}, yAxis:{type:'value'}, dataZoom:[{type:'inside'}],
      series:m.series.map(function(s){return {type:'line',symbol:'none',data:D.xs.map(function(t,i){return [t,s[i]];})};})}); });
  var d=document.createElement('div'); d.style.height='1100px'; d.style.width='1300px'; root.appendChild(d);
  echarts.init(d).setOption({animation:false, xAxis:{type:'value',scale:true}, yAxis:{type:'category',data:D.lanes.ranks},
    series:[{type:'custom',data:D.lanes.cells,renderItem:function(p,api){var a=api.coord([api.value(2),api.value(0)]),
      b=api.coord([api.value(3),api.value(0)]);return {type:'rect',shape:{x:a[0],y:a[1]-2,width:Math.max(1,b[0]-a[0]),height:4},
      style:{fill:'#d62728'}};}}]});
}""",
    "uplot": """
function drawAll(root){
  D.metrics.forEach(function(m){ new uPlot({width:1300,height:190,series:[{}].concat(m.series.map(function(){return {stroke:'#36c'};}))},
    [D.xs].concat(m.series), root); });
  var lo=Infinity,hi=-Infinity; D.lanes.cells.forEach(function(c){lo=Math.min(lo,c[2]);hi=Math.max(hi,c[3]);});
  new uPlot({width:1300,height:1100,scales:{x:{time:false},y:{range:[0,D.lanes.ranks.length]}},series:[{},{}],
    hooks:{draw:[function(u){var ctx=u.ctx;ctx.fillStyle='#d62728';D.lanes.cells.forEach(function(c){
      var x0=u.valToPos(c[2],'x',true),x1=u.valToPos(c[3],'x',true),y=u.valToPos(c[0],'y',true);
      ctx.fillRect(x0,y-2,Math.max(1,x1-x0),4);});}]}}, [[lo,hi],[0,D.lanes.ranks.length]], root);
}""",
    "plotly": """
function drawAll(root){
  D.metrics.forEach(function(m){ var d=document.createElement('div'); root.appendChild(d);
    Plotly.newPlot(d, m.series.map(function(s){return {x:D.xs,y:s,type:'scattergl' in window ? 'scatter':'scatter',mode:'lines'};}),
      {width:1300,height:190,showlegend:false,margin:{t:5,b:20}}, {staticPlot:false}); });
  var d=document.createElement('div'); root.appendChild(d);
  Plotly.newPlot(d,[{type:'bar',orientation:'h',base:D.lanes.cells.map(function(c){return c[2];}),
    x:D.lanes.cells.map(function(c){return c[3]-c[2];}),y:D.lanes.cells.map(function(c){return c[0];}),marker:{color:'#d62728'}}],
    {width:1300,height:1100,showlegend:false});
}""",
}


def candidate_data(page: str) -> dict[str, Any]:
    m = re.search(r'<script type="application/json" id="gp-data">(.*?)</script>', page, re.DOTALL)
    assert m
    p = json.loads(m.group(1))
    g = p["grid"]
    xs = [g["t0"] + (i + 0.5) * g["dt"] for i in range(g["bins"])]
    metrics = []
    for mt in p["metrics"]:
        series = [s["v"] for s in mt["series"]] + ([mt["band"][k] for k in ("p10", "p50", "p90")] if mt["band"] else [])
        metrics.append({"title": mt["title"], "series": series})
    c = p["comms"][0]
    return {"xs": xs, "metrics": metrics, "lanes": {"ranks": [str(r) for r in c["ranks"]], "cells": c["cells"]}}


def bench_libraries(job: Path, libs: Path, repeats: int, work: Path) -> None:
    from gpuprof.mpi_merge.html_report import payload_json, render_html_file

    data = candidate_data(render_html_file(job))
    pages = {}
    for name, (folder, fname) in CANDIDATES.items():
        lib = libs / folder / fname
        if not lib.exists():
            log(f"{name}: {lib} missing, skipped")
            continue
        kind = name.split("-")[0].split(".")[0]
        css = ""
        if kind == "uplot":
            css = (lib.parent / "uPlot.min.css").read_text()
        html = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><style>{css}</style></head><body><div id='root'></div>"
                f"<script type='application/json' id='d'>{payload_json(data)}</script>"
                f"<script>{lib.read_text()}</script><script>var D=JSON.parse(document.getElementById('d').textContent);"
                f"{DRAW[kind]}var t0=performance.now();drawAll(document.getElementById('root'));"
                f"var done=document.createElement('div');done.id='done';done.setAttribute('data-ms',String(performance.now()-t0));"
                f"document.body.appendChild(done);</script></body></html>")
        p = work / f"{name}.html"
        p.write_text(html)
        pages[name] = (p, lib.stat().st_size)
    times: dict[str, list[float]] = {n: [] for n in pages}
    for _ in range(repeats):  # interleaved
        for name, (path, _size) in pages.items():
            with open_page(path, height=4000, painted=False) as p:
                ms = p.wait_for("document.getElementById('done') && document.getElementById('done').dataset.ms")
                if p.console:
                    raise SystemExit(f"bench_report: {name} logged {p.console[:3]}")
            times[name].append(float(ms) / 1e3)
    for name, (p, size) in pages.items():
        t = med(times[name])
        emit({"bench": "report_chart_library", "library": name, "lib_kb": round(size / 1e3), "draw_s": t["median"],
              "draw_s_min_max": [t["min"], t["max"]], "page_mb": round(p.stat().st_size / 1e6, 2),
              "drawn": f"{len(data['metrics'])} line charts x {len(data['metrics'][0]['series'])} series x "
                       f"{len(data['xs'])} points + lanes of {len(data['lanes']['cells'])} calls",
              "runs": repeats, "synthetic": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--duration-s", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--cache", type=Path, default=None, help="keep the generated and merged job here")
    ap.add_argument("--libraries", type=Path, default=None, help="unpacked npm packages of the chart candidates")
    ap.add_argument("--job", type=Path, default=None, help="measure this merged job file instead of generating one")
    ap.add_argument("--parts", default="html,exports,libraries", help="comma list of html, exports, libraries")
    a = ap.parse_args()
    if chromium() is None:
        raise SystemExit("bench_report: chromium not installed (Debian package 'chromium'; `make setup`)")
    duration = a.duration_s or (3.0 if a.quick else 30.0)
    repeats = a.repeats or (1 if a.quick else 3)
    with tempfile.TemporaryDirectory(prefix="bench_report-", dir="/var/tmp") as t:
        work = Path(t)
        job = a.job if a.job is not None else job_file(a.nodes, duration, a.cache or work)
        if a.job is not None:
            import h5py

            with h5py.File(job, "r") as f:
                a.nodes = len(json.loads(f.attrs["nodes"]))
        parts = set(a.parts.split(","))
        if "html" in parts:
            bench_html(job, a.nodes, repeats, work)
        if "exports" in parts:
            bench_exports(job, a.nodes, repeats, work)
        if a.libraries and "libraries" in parts:
            bench_libraries(job, a.libraries, repeats, work)


if __name__ == "__main__":
    main()
