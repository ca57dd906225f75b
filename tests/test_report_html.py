"""The HTML report's payload and page (mpi_merge/html_report.py), without a browser: what each section
is given, escaping, the summaries of large jobs, the roofline classes, `gpuprof report --html`.
tests/test_browser.py loads the same pages in Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from gpuprof.collector import schema
from gpuprof.mpi_merge import common, html_report, roofline
from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.cli import report as report_cmd
from gpuprof.mpi_merge.common import SerialPool
from gpuprof.mpi_merge.export import open_job_file
from gpuprof.mpi_merge.jobfile import JOB_SCHEMA, METADATA_CACHE_BYTES
from gpuprof.mpi_merge.merge import merge

RECORDING = Path(__file__).parent / "recordings" / "demo-4nodes"
HOSTILE = "<img src=x onerror=alert(1)>"


def payload_of(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="gp-data">(.*?)</script>', page, re.DOTALL)
    assert m, "no payload in the page"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def demo_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real demo recording (4 nodes, stacks and off-CPU, node3 the injected slow rank), one
    stack symbol renamed to markup: a name from a trace."""
    d = tmp_path_factory.mktemp("demo") / "demo.gpuprof.d"
    shutil.copytree(RECORDING, d)
    with h5py.File(d / "node3.h5", "r+") as f:
        sym = f["stacks/symbols"][()]
        sym["name"][0] = (HOSTILE + "poll_markup").encode()
        f["stacks/symbols"][...] = sym
    res = merge(str(d))
    assert res is not None
    return res.job_file


@pytest.fixture(scope="module")
def synth_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("syn") / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=4, gpus_per_node=2, idle_gpus=[(2, 1)], seed=5,
                                 stragglers=[syn.Straggler(1, "gpu", 1.0, 3.5)]), d)
    with h5py.File(d / "node000.h5", "r+") as f:
        f.attrs["hostname"] = HOSTILE
    res = merge(str(d))
    assert res is not None
    return res.job_file


def test_merge_writes_the_page_the_report_command_redraws(synth_job: Path, tmp_path: Path) -> None:
    written = synth_job.with_suffix(".html").read_text()
    out = tmp_path / "again.html"
    r = CliRunner().invoke(report_cmd, [str(synth_job), "--html", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert payload_of(out.read_text()) == payload_of(written)
    # --text and --json regenerate the other two from the same file
    r = CliRunner().invoke(report_cmd, [str(synth_job), "--text"])
    # (the job file's report dict has its keys sorted: the wait patterns may come in another order)
    assert r.exit_code == 0 and sorted(r.output.splitlines()) == sorted(synth_job.with_suffix(".txt").read_text().splitlines())
    r = CliRunner().invoke(report_cmd, [str(synth_job), "--json"])
    assert r.exit_code == 0 and json.loads(r.output) == json.loads(synth_job.with_suffix(".json").read_text())


def test_report_command_rejects_a_file_that_is_not_a_job_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.h5"
    with h5py.File(bad, "w") as f:
        f.attrs["schema"] = "something else"
    r = CliRunner().invoke(report_cmd, [str(bad), "--html"])
    assert r.exit_code == 1 and "not a slurm-gpuprof job file" in r.output and str(bad) in r.output


def test_page_is_self_contained(synth_job: Path) -> None:
    page = synth_job.with_suffix(".html").read_text()
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=|@import|url\(http", page)
    assert "Apache ECharts" in page and html_report.CHART_LIBRARY in page


def test_names_stay_inside_the_payload_escaped(synth_job: Path, demo_job: Path) -> None:
    for job in (synth_job, demo_job):
        page = job.with_suffix(".html").read_text()
        assert HOSTILE not in page  # not as markup anywhere: '<' in the payload is \\u003c
        body = page.split('id="gp-data">', 1)[1].split("</script>", 1)[0]
        assert "<" not in body and ">" not in body
    host = {n["node"]: n["host"] for n in payload_of(synth_job.with_suffix(".html").read_text())["clock_table"]}
    assert host["node000"] == HOSTILE  # the name itself survives, as text
    assert any(s.startswith(HOSTILE) for s in payload_of(demo_job.with_suffix(".html").read_text())["strings"])


def test_synthetic_job_sections(synth_job: Path) -> None:
    p = payload_of(synth_job.with_suffix(".html").read_text())
    assert p["synthetic"] is True and "SYNTHETIC" in p["synthetic_banner"]
    assert [s["node"] for s in p["summary"]["stragglers"]] == ["node001"]
    (c,) = p["comms"]
    assert c["size"] == 4 and len(c["heat"]["ms"]) == 4 and c["cells"]
    # every drawn call lies in the window, on the job's time grid
    s0, s1 = c["window"]
    t1 = p["grid"]["t0"] + p["grid"]["dt"] * p["grid"]["bins"]
    assert all(s0 <= x[1] < s1 and x[2] <= x[3] and p["grid"]["t0"] - 1 <= x[2] <= t1 + 1 for x in c["cells"])
    # one last arrival per instance drawn
    per_seq = {}
    for x in c["cells"]:
        per_seq[x[1]] = per_seq.get(x[1], 0) + x[6]
    assert set(per_seq.values()) == {1}
    keys = {m["key"] for m in p["metrics"]}
    assert {"util_gpu", "sm_activity", "power_w", "cpu_busy"} <= keys
    util = next(m for m in p["metrics"] if m["key"] == "util_gpu")
    assert util["band"] is None and len(util["series"]) == 8  # 4 nodes x 2 GPUs, all drawn
    assert all(len(s["v"]) == p["grid"]["bins"] for s in util["series"])
    # the idle GPU (node002 gpu1) reads ~0 where the others are busy
    idle = next(s for s in util["series"] if s["node"] == "node002" and s["gpu"] == 1)
    busy = next(s for s in util["series"] if s["node"] == "node000" and s["gpu"] == 0)
    assert np.nanmean([v for v in idle["v"] if v is not None]) < 1 < np.nanmean([v for v in busy["v"] if v is not None])
    # bins no narrower than the 10 Hz sampling: a line, not isolated points between gaps
    assert p["grid"]["dt"] >= 0.09 and sum(v is None for v in busy["v"]) <= 2
    # the synthetic generator writes no stacks and no kernels (the page says "not recorded"), and no NVTX range
    assert all(r["samples"] is None and r["kernels"] is None and not r["nvtx"] for r in p["node_rows"].values())
    assert {g["roofline"] for g in p["gpus"] if g["node"] == "node002" and g["gpu"] == 1} == {"underused"}
    # at 4 nodes only the 400 instances are summarized: in heat map groups and a window of lanes
    assert [x.split(":")[1].split("(")[0].strip() for x in p["summarized"]] == [
        "wait heat map of 400 instances in 200 groups", "time lanes of instances 221-300 of 400"]


def test_demo_recording_has_stacks_for_flames_and_drill_down(demo_job: Path) -> None:
    p = payload_of(demo_job.with_suffix(".html").read_text())
    assert [s["node"] for s in p["summary"]["stragglers"]] == ["node3"]
    assert len(p["comms"]) == 3
    rows = p["node_rows"]["node3"]
    assert rows["samples"] and rows["offcpu"] and rows["stacks"]
    assert rows["nvtx"] is None and rows["kernels"] is None  # the demo ran without those modes
    names = {p["strings"][i] for st in rows["stacks"] for i in st}
    assert "poll" in names
    # the lanes' window lies where every node has stacks (the probes attached after the job began)
    first = max(min(r[0] for r in n["samples"]) for n in p["node_rows"].values())
    world = max(p["comms"], key=lambda c: c["size"])
    assert min(x[2] for x in world["cells"] if x[1] == world["worst_seq"]) >= first
    assert {m["key"] for m in p["metrics"]} >= {"cpu_busy", "offcpu"}
    assert p["gpus"] == []  # no GPU on the recording's nodes
    # the analysis's per-process differential of the finding, as stored in the job file
    with h5py.File(demo_job, "r") as f:
        stored = f["analysis/flames/finding_0/cpu"][()]
    (ff,) = p["finding_flames"]
    assert len(ff["cpu"]) == len(stored)
    assert sum(r[1] for r in ff["cpu"]) == pytest.approx(float(stored["late"].sum()), rel=1e-3)
    assert {";".join(p["strings"][i] for i in r[0]) for r in ff["cpu"]} == {x.decode() for x in stored["stack"]}


def test_large_jobs_are_summarized(synth_job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(html_report, "ALL_SERIES_NODES", 2)
    monkeypatch.setattr(html_report, "TOP_SERIES", 3)
    monkeypatch.setattr(html_report, "MAX_LANE_RANKS", 2)
    monkeypatch.setattr(html_report, "HEAT_COLUMNS", 10)
    p = payload_of(html_report.render_html_file(synth_job))
    util = next(m for m in p["metrics"] if m["key"] == "util_gpu")
    assert util["band"] is not None and len(util["series"]) == 3
    assert util["series"][0]["node"] == "node001"  # the straggler's node first
    (c,) = p["comms"]
    assert len(c["ranks"]) == 2 and 1 in c["ranks"]  # node001's rank kept
    assert len(c["heat"]["edges"]) == 11
    text = " ".join(p["summarized"])
    assert "GPU utilization: 8 series of 4 nodes" in text and "lanes of 2 of its 4 ranks" in text
    assert "wait heat map" in text


@pytest.mark.parametrize("name,means,expected,flagged", [
    ("NVIDIA H100 80GB HBM3", {"sm_activity": 85, "tensor_activity": 70, "dram_bw_util": 30}, "compute-bound", False),
    ("NVIDIA H100 80GB HBM3", {"sm_activity": 70, "tensor_activity": 1, "dram_bw_util": 80}, "memory-bound", True),
    ("NVIDIA A100-SXM4-80GB", {"sm_activity": 75, "tensor_activity": 0, "dram_bw_util": 20}, "compute-bound", True),
    ("NVIDIA A100-SXM4-80GB", {"sm_activity": 45, "tensor_activity": 10, "dram_bw_util": 20}, "latency-bound", False),
    ("Tesla T4", {"sm_activity": 5, "tensor_activity": 0, "dram_bw_util": 2}, "underused", False),
])
def test_roofline_classes(name: str, means: dict, expected: str, flagged: bool) -> None:
    m = {"sm_occupancy": float("nan"), "util_gpu": float("nan"), **{k: float(v) for k, v in means.items()}}
    c = roofline.classify(name, m)
    assert c["roofline"] == expected, c
    assert bool(c["flags"]) == flagged
    assert c["peaks_model"] is not None and c["mem_tb_s_est"] is not None


def test_roofline_without_gpm() -> None:
    nan = float("nan")
    base = {"sm_activity": nan, "sm_occupancy": nan, "tensor_activity": nan, "dram_bw_util": nan}
    assert roofline.classify("Unknown GPU", {**base, "util_gpu": nan})["roofline"] == "unknown"
    assert roofline.classify("Unknown GPU", {**base, "util_gpu": 3.0})["roofline"] == "underused"
    assert roofline.peaks_of("NVIDIA H100 PCIe")[0] == "H100 PCIe"  # the longest matching model name


def test_roofline_per_nvtx_phase(synth_job: Path, tmp_path: Path) -> None:
    """NVTX ranges added to node001 (the GPU straggler) in a copy of the job file: each range name's
    class comes from the GPM samples inside its ranges, on the node's own clock."""
    job = tmp_path / "job.gpuprof.h5"
    shutil.copy(synth_job, job)
    with h5py.File(job, "r+") as f:
        g = f["nodes/node001"]
        gpm = g["gpu/gpm"][()]
        t0, t1 = int(gpm["t_ns"].min()), int(gpm["t_ns"].max())
        mid = (t0 + t1) // 2
        for path in ("nvtx/ranges", "nvtx/strings"):
            if path in g:
                del g[path]
        r = np.zeros(2, schema.TABLES_BY_PATH["/nvtx/ranges"].dtype)
        r["t_start_ns"], r["t_end_ns"] = [t0, mid], [mid, t1]
        r["pid"], r["name_id"] = 5, [1, 2]
        g.create_dataset("nvtx/ranges", data=r)
        s = np.zeros(2, schema.TABLES_BY_PATH["/nvtx/strings"].dtype)
        s["pid"], s["string_id"], s["text"] = 5, [1, 2], [HOSTILE.encode(), b"second half"]
        g.create_dataset("nvtx/strings", data=s)
        phases = roofline.phase_classes(f, "node001", 0, "")
        g0 = gpm[gpm["gpu"] == 0]
        first = g0[g0["t_ns"] <= mid]
    assert [p["range"] for p in phases] == [HOSTILE, "second half"] or [p["range"] for p in phases] == ["second half", HOSTILE]
    p0 = next(p for p in phases if p["range"] == HOSTILE)
    assert p0["samples"] == len(first)
    want = roofline.classify("", {"sm_activity": float(first["sm_activity"].mean()),
                                  "tensor_activity": float(first["tensor_activity"].mean()),
                                  "dram_bw_util": float(first["dram_bw_util"].mean()),
                                  "sm_occupancy": float("nan"), "util_gpu": float("nan")})
    assert p0["roofline"] == want["roofline"]
    page = html_report.render_html_file(job)
    assert HOSTILE not in page
    gp = next(x for x in payload_of(page)["gpus"] if x["node"] == "node001" and x["gpu"] == 0)
    assert {p["range"] for p in gp["phases"]} == {HOSTILE, "second half"}
    assert payload_of(page)["node_rows"]["node001"]["nvtx"]  # the drill-down has them too


def test_a_job_without_metrics_or_stacks(tmp_path: Path) -> None:
    """Clocks and collectives only (the generator's --no-bulk): every section is there, saying what
    was not recorded."""
    d = tmp_path / "bare.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=3, duration_s=2, write_bulk=False, seed=2), d)
    res = merge(str(d))
    assert res is not None
    p = payload_of(res.job_file.with_suffix(".html").read_text())
    assert p["metrics"] == [] and p["gpus"] == [] and len(p["comms"]) == 1
    cov = {c["source"]: c["nodes"] for c in p["coverage"]}
    assert cov["collective calls"] == 3 and cov["GPU metrics (NVML)"] == 0 and cov["CPU stacks"] == 0


# --- the page's passes over the nodes: the same page from one process and from the merge ranks --------

def _replace(g: h5py.Group, path: str, data: np.ndarray) -> None:
    if path in g:
        del g[path]
    g.create_dataset(path, data=data, maxshape=(None,), chunks=(max(1, min(64, len(data))),))


def enrich_node_file(f: h5py.Group, i: int) -> None:
    """NVTX ranges, kernel launches, CPU stacks and off-CPU rows (real schema tables) in a synthetic
    node file, on node i's own clock: beyond the page's per-node limits on some nodes, names shared
    between nodes (each payload string once, ids given in node order), tables without rows, names
    missing from the string tables."""
    t = f["gpu/samples"][()]["t_ns"].astype(np.int64)
    t0, t1 = int(t.min()), int(t.max())
    rng = np.random.default_rng(i)
    pids = np.unique(f["collectives/calls"][()]["pid"])
    pid = int(pids[0])

    def times(n: int) -> np.ndarray:
        return np.sort(rng.integers(t0, t1, n)).astype(np.uint64)

    if i in (0, 3):  # NVTX ranges: beyond MAX_EVENT_ROWS on node 0, a few on node 3 with the same names
        n = html_report.MAX_EVENT_ROWS + 50 if i == 0 else 7
        r = np.zeros(n, schema.TABLES_BY_PATH["/nvtx/ranges"].dtype)
        r["t_start_ns"] = times(n)
        r["t_end_ns"] = r["t_start_ns"] + rng.integers(1000, 10**7, n).astype(np.uint64)
        r["pid"], r["tid"], r["name_id"], r["depth"] = pid, pid + 1, rng.integers(1, 5, n), rng.integers(0, 3, n)
        _replace(f, "nvtx/ranges", r)
        s = np.zeros(3, schema.TABLES_BY_PATH["/nvtx/strings"].dtype)  # name 4 has no string: "[string 4 ...]"
        s["pid"], s["string_id"], s["text"] = pid, [1, 2, 3], [b"step", HOSTILE.encode(), f"only on node {i}".encode()]
        _replace(f, "nvtx/strings", s)
    if i in (0, 3):  # kernel launches: beyond MAX_EVENT_ROWS on node 0; one function without a name
        n = html_report.MAX_EVENT_ROWS + 50 if i == 0 else 5
        k = np.zeros(n, schema.TABLES_BY_PATH["/kernels/launches"].dtype)
        k["t_ns"], k["pid"], k["function"] = times(n), pid, rng.integers(0x10, 0x13, n)
        k["grid_x"], k["grid_y"], k["grid_z"] = 4096, 4096, rng.integers(1, 300, n)  # beyond 2**32 cells
        _replace(f, "kernels/launches", k)
        fn = np.zeros(2, schema.TABLES_BY_PATH["/kernels/functions"].dtype)
        fn["pid"], fn["function"], fn["name"] = pid, [0x10, 0x11], [b"gemm", b"allreduce_kernel"]
        _replace(f, "kernels/functions", fn)
    if i == 4:  # tables the collectors created without rows
        _replace(f, "nvtx/ranges", np.zeros(0, schema.TABLES_BY_PATH["/nvtx/ranges"].dtype))
        _replace(f, "kernels/launches", np.zeros(0, schema.TABLES_BY_PATH["/kernels/launches"].dtype))
    if i in (1, 3):  # CPU stacks (beyond MAX_STACK_ROWS on node 1) and off-CPU windows
        sym = np.zeros(6, schema.TABLES_BY_PATH["/stacks/symbols"].dtype)
        sym["symbol_id"], sym["name"] = np.arange(6), [b"main", b"step", b"MPI_Allreduce", b"poll", b"schedule", b"x"]
        _replace(f, "stacks/symbols", sym)
        fr = np.zeros(9, schema.TABLES_BY_PATH["/stacks/frames"].dtype)  # stack 3 names symbol 9: "?"
        fr["stack_id"] = [1, 1, 1, 2, 2, 3, 3, 4, 4]
        fr["depth"] = [0, 1, 2, 0, 1, 0, 1, 0, 1]
        fr["symbol_id"] = [3, 2, 0, 1, 0, 9, 0, 4, 3]
        _replace(f, "stacks/frames", fr)
        n = html_report.MAX_STACK_ROWS + 50 if i == 1 else 40
        st = np.zeros(n, schema.TABLES_BY_PATH["/stacks/samples"].dtype)
        st["t_ns"], st["pid"], st["tid"], st["count"] = times(n), pid, pid, rng.integers(1, 50, n)
        st["user_stack"], st["kernel_stack"] = rng.integers(1, 4, n), rng.choice([0, 4], n)
        _replace(f, "stacks/samples", st)
        m = 300
        off = np.zeros(m, schema.TABLES_BY_PATH["/offcpu/intervals"].dtype)
        off["t_ns"] = np.repeat(np.linspace(t0, t1, m // 3).astype(np.uint64), 3)
        off["pid"], off["tid"], off["user_stack"], off["kernel_stack"] = pid, pid, rng.integers(1, 4, m), 4
        off["blocked_ns"], off["count"] = rng.integers(0, 10**8, m), 1
        _replace(f, "offcpu/intervals", off)
        # the drains' rates, as the collector writes them: a row's window (loading.row_window_ns)
        f.attrs["rates_json"] = json.dumps(json.loads(f.attrs["rates_json"]) | {"stacks": 1.0, "offcpu": 1.0})


@pytest.fixture(scope="module")
def rich_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rich") / "rich.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=6, duration_s=3, ranks_per_node=2, gpus_per_node=2, seed=11,
                                 stragglers=[syn.Straggler(3, "gpu", 1.0, 2.5)]), d)
    for i, node_file in enumerate(sorted(d.glob("node*.h5"))):
        with h5py.File(node_file, "r+") as f:
            enrich_node_file(f, i)
    return d


@pytest.fixture(scope="module")
def rich_job(rich_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    res = merge(str(rich_dir), output_stem=str(tmp_path_factory.mktemp("rich1") / "k1"))
    assert res is not None
    return res.job_file


def pooled_page(job: Path, ranks: int) -> str:
    """The page as a merge of `ranks` ranks draws it: its passes over the nodes cut into items as
    the merge cuts them, every item computed by a PageContext of its own (no mapper, group or
    string table shared with the page's builder, as on another rank), and the communicators'
    sections computed before (prepare_comms, here from the job file's own /collectives)."""
    with h5py.File(job, "r") as f:
        report = json.loads(f["analysis"].attrs["report_json"])
        nodes = html_report.JobNodes(f)
        comms = html_report.prepare_comms(job, report, nodes.epoch)
        context = html_report.PageContext(job)
        passes = html_report.PoolPasses(SerialPool(context, size=ranks), len(nodes.nodes))
        try:
            return html_report.render_page(html_report.PayloadBuilder(f, report, passes, nodes, comms).build())
        finally:
            context.close()


def test_rich_job_rows_and_summaries(rich_job: Path) -> None:
    """What the enriched nodes give: each name once in the string table, the rows of a node naming
    them through it, the per-node limits said in `summarized`, [] for a table without rows."""
    p = payload_of(rich_job.with_suffix(".html").read_text())
    strings = p["strings"]
    assert len(set(strings)) == len(strings)
    rows = p["node_rows"]
    n0, n3 = rows["node000"], rows["node003"]
    assert len(n0["nvtx"]) == html_report.MAX_EVENT_ROWS and len(n0["kernels"]) == html_report.MAX_EVENT_ROWS
    names0 = {strings[r[2]] for r in n0["nvtx"]}
    assert {"step", HOSTILE, "only on node 0"} <= names0 and any(x.startswith("[string 4 of pid") for x in names0)
    assert {strings[r[2]] for r in n3["nvtx"]} <= {"step", HOSTILE, "only on node 3"} | {
        x for x in names0 if x.startswith("[string 4")}
    assert {strings[r[1]] for r in n0["kernels"]} == {"gemm", "allreduce_kernel", "function 0x12"}
    assert all(r[2] >= 4096 * 4096 for r in n0["kernels"])
    n1 = rows["node001"]
    assert len(n1["samples"]) == html_report.MAX_STACK_ROWS and n1["offcpu"]
    frames = {";".join(strings[i] for i in st) for st in n1["stacks"]}
    assert "main;MPI_Allreduce;poll" in frames and any("?" in x.split(";") for x in frames)
    assert rows["node004"]["nvtx"] == [] and rows["node004"]["kernels"] == []
    assert rows["node002"]["nvtx"] == [] and rows["node002"]["kernels"] is None  # empty in the generator's files
    said = " ".join(p["summarized"])
    assert f"NVTX ranges: the {html_report.MAX_EVENT_ROWS} longest per node, on 1 node(s)" in said
    assert f"/stacks/samples: the {html_report.MAX_STACK_ROWS} heaviest rows per node, on 1 node(s)" in said
    assert "offcpu" in {m["key"] for m in p["metrics"]}


@pytest.mark.parametrize("ranks,items_per_rank", [(2, 8), (3, 1), (1, 1), (64, 8)])
def test_page_from_pooled_passes_is_the_same(rich_job: Path, synth_job: Path, demo_job: Path, ranks: int,
                                             items_per_rank: int, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The passes over the nodes cut into items as a merge of 2, 3, 1 or 64 ranks cuts them (one
    node an item, two or three, all in one), each computed on a context of its own: the same page,
    byte for byte, as drawn on one process (`gpuprof report --html`). Also for a job file whose
    tables lack what the merge always writes (NVTX strings without a pid column, stack frames
    without symbols)."""
    monkeypatch.setattr(html_report, "ITEMS_PER_RANK", items_per_rank)
    odd = tmp_path / "odd.gpuprof.h5"
    shutil.copy(rich_job, odd)
    with h5py.File(odd, "r+") as f:
        g = f["nodes/node003"]
        s = g["nvtx/strings"][()]
        del g["nvtx/strings"]
        g.create_dataset("nvtx/strings", data=np.array([(x["string_id"], x["text"]) for x in s],
                                                       dtype=[("string_id", "<u4"), ("text", "S128")]))
        del g["stacks/symbols"]
    for job in (rich_job, odd, synth_job, demo_job):
        assert pooled_page(job, ranks) == html_report.render_html_file(job), job


MPIRUN = shutil.which("mpirun")


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (mpi marker)")
def test_page_drawn_with_merge_ranks_is_the_same(rich_dir: Path, rich_job: Path, tmp_path: Path) -> None:
    """A merge on 2 and 3 ranks deals the page's passes over the nodes over its ranks (pickled to
    rank 0, names mapped to the page's string table there): the same page as on one rank, and the
    other ranks computed some of the nodes."""
    assert MPIRUN is not None
    root = Path(__file__).resolve().parent.parent
    for n in (2, 3):
        stem = tmp_path / f"k{n}"
        p = subprocess.run(
            [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable, "-m", "mpi4py", "-m",
             "gpuprof.slurm_hooks.cli", "merge", str(rich_dir), "--output-stem", str(stem), "--quiet"],
            capture_output=True, text=True, timeout=300, cwd=root, check=False,
            env=dict(os.environ, PYTHONPATH=str(root), GPUPROF_MERGE_TIMING="1"))
        assert p.returncode == 0, p.stderr[-3000:]
        assert Path(f"{stem}.gpuprof.html").read_text() == rich_job.with_suffix(".html").read_text(), n
        line = next(x for x in p.stderr.splitlines() if x.startswith("gpuprof merge items page:"))
        by_rank = json.loads(line.split("by rank ")[1].split("]")[0] + "]")
        assert len(by_rank) == n and sum(by_rank[1:]) > 0, line


@pytest.mark.parametrize("layout", ["nodes_reversed", "rows_interleaved"])
def test_clock_segments_in_another_order_give_the_same_page(rich_job: Path, tmp_path: Path, layout: str) -> None:
    """The page reads each node's /clock/segments rows where /clock/nodes' counts put them (the
    merge writes them node by node); a job file whose table has them elsewhere (whole nodes in
    another order, or the nodes' rows interleaved, each node's in its order) is read whole and
    grouped by node: the same page."""
    job = tmp_path / "job.gpuprof.h5"
    shutil.copy(rich_job, job)
    with h5py.File(job, "r+") as f:
        segs = f["clock/segments"][()]
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in segs["node"]]
        by_node = {n: np.flatnonzero(np.array(names) == n) for n in dict.fromkeys(names)}
        if layout == "nodes_reversed":
            order = np.concatenate([by_node[n] for n in reversed(by_node)])
        else:  # round robin over the nodes
            longest = max(len(v) for v in by_node.values())
            order = np.array([v[k] for k in range(longest) for v in by_node.values() if k < len(v)])
        assert sorted(order.tolist()) == list(range(len(segs))) and not np.array_equal(order, np.arange(len(segs)))
        doc = f["clock/segments"].attrs["doc"]
        del f["clock/segments"]
        f["clock"].create_dataset("segments", data=segs[order]).attrs["doc"] = doc
    page = html_report.render_html_file(job)
    assert page == rich_job.with_suffix(".html").read_text()
    assert pooled_page(job, 2) == page


def test_communicator_sections_read_by_blocks_give_the_same_page(synth_job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page reads a communicator's [seq x rank] tables (its heat map, skew and lanes) by blocks
    of rows of BLOCK_CELLS cells, so a read does not grow with the ranks times a fixed row count.
    With blocks of one row the page is the same, byte for byte, in the merge's two ways (sections
    computed before, or by the page), and no 2-D read of /collectives holds more than one block."""
    page = html_report.render_html_file(synth_job)
    with h5py.File(synth_job, "r") as f:
        size = max(int(g.attrs["size"]) for g in f["collectives"].values())
    assert size > 1
    cells = size  # one row of the widest communicator a block
    monkeypatch.setattr(common, "BLOCK_CELLS", cells)
    reads: list[tuple[str, tuple[int, ...]]] = []
    getitem = h5py.Dataset.__getitem__

    def recording(ds: h5py.Dataset, key: object) -> np.ndarray:
        out = getitem(ds, key)
        if ds.name.startswith("/collectives/") and ds.ndim == 2:
            reads.append((ds.name, np.shape(out)))
        return out

    monkeypatch.setattr(h5py.Dataset, "__getitem__", recording)
    assert html_report.render_html_file(synth_job) == page
    assert pooled_page(synth_job, 2) == page
    assert reads and {n.rpartition("/")[2] for n, _ in reads} >= {"wait_ns", "enter_aligned_ns", "exit_aligned_ns", "op"}
    assert max(int(np.prod(s)) for _, s in reads) <= cells, max(reads, key=lambda r: int(np.prod(r[1])))


def test_reading_the_report_does_not_grow_the_metadata_cache(tmp_path: Path) -> None:
    """HDF5 grows a file's metadata cache at once by 1.4x any entry larger than a quarter of it
    (the report's attribute: 14 MB at 32768 ranks), and the page then fills it with the node
    groups' object headers (230 MB more at 4096 nodes). The job file is read with the cache fixed
    at its initial size, for every handle of the file; a plain h5py open grows it."""
    job = tmp_path / "big.gpuprof.h5"
    big = json.dumps({"ranks": [{"rank": i, "wait_ns_total": float(i)} for i in range(60_000)]})
    assert len(big) > METADATA_CACHE_BYTES // 4  # beyond HDF5's flash threshold
    with h5py.File(job, "w", libver="latest") as f:
        f.attrs["schema"] = JOB_SCHEMA
        f.create_group("analysis").attrs["report_json"] = big
    with h5py.File(job, "r") as f:  # the control: HDF5's default grows the cache past the report
        assert json.loads(f["analysis"].attrs["report_json"]) == json.loads(big)
        assert f.id.get_mdc_size()[0] > len(big)
    with open_job_file(job) as f:
        assert json.loads(f["analysis"].attrs["report_json"]) == json.loads(big)
        assert f.id.get_mdc_size()[0] == METADATA_CACHE_BYTES
        with h5py.File(job, "r") as g:  # another handle of the same file shares the bounded cache
            assert len(g["analysis"].attrs["report_json"]) == len(big)
            assert g.id.get_mdc_size()[0] == METADATA_CACHE_BYTES
