"""Reports and exports: SYNTHETIC banner, escaped trace names, readable exports, report command."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import h5py
import pytest
from click.testing import CliRunner

from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.cli import export as export_cmd
from gpuprof.mpi_merge.cli import report as report_cmd
from gpuprof.mpi_merge.merge import merge


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rep") / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=3, duration_s=6, gpus_per_node=2, idle_gpus=[(2, 1)], seed=4), d)
    # a hostile name from a trace must come out escaped in the HTML
    with h5py.File(d / "node001.h5", "r+") as f:
        f.attrs["hostname"] = "<script>alert(1)</script>"
    res = merge(str(d))
    assert res is not None
    return res.job_file


def test_text_report(merged: Path) -> None:
    txt = merged.with_suffix(".txt").read_text()
    assert txt.startswith("*** SYNTHETIC DATA")
    assert "node002          1" in txt and "node002 gpu1 (idle, 0%)" in txt
    assert "Stragglers: none" in txt


def test_html_self_contained_and_escaped(merged: Path) -> None:
    # the page is now drawn by its script from a JSON payload (mpi_merge/html_report.py): names travel
    # in the payload with '<' and '>' as \u escapes, and the browser test (test_browser.py) checks
    # they are shown as text; the SVG drawing this test counted is gone
    page = merged.with_suffix(".html").read_text()
    assert '"synthetic":true' in page and "SYNTHETIC DATA" in page
    assert "<script>alert(1)</script>" not in page and "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in page
    assert "<script src" not in page and "<link" not in page  # nothing fetched
    assert 'id="gp-data"' in page and "echarts" in page


def test_json_report_and_report_command(merged: Path) -> None:
    rep = json.loads(merged.with_suffix(".json").read_text())
    assert rep["synthetic"] is True and rep["status"] == "complete"
    r = CliRunner().invoke(report_cmd, [str(merged), "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.output)["job_id"] == rep["job_id"]


def test_job_file_has_aligned_beside_raw(merged: Path) -> None:
    with h5py.File(merged, "r") as f:
        calls = f["nodes/node001/collectives/calls"]
        al = f["nodes/node001/collectives/calls_aligned"]
        assert al.shape == calls.shape
        assert f.attrs["schema"] == "slurm-gpuprof.job" and f.attrs["synthetic"]
        g = f["collectives"][next(iter(f["collectives"]))]
        assert g["enter_aligned_ns"].shape == g["enter_raw_ns"].shape == g["wait_ns"].shape


def test_exports(merged: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    r = CliRunner().invoke(export_cmd, [str(merged), "--format", "perfetto", "-o", str(out)])
    assert r.exit_code == 0, r.output
    ev = json.loads(out.read_text())["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == 3 * 600 and all(e["dur"] > 0 for e in xs)
    out_csv = tmp_path / "util.csv"
    r = CliRunner().invoke(export_cmd, [str(merged), "--format", "csv", "-o", str(out_csv), "--series", "gpu1:util_gpu"])
    assert r.exit_code == 0, r.output
    rows = list(csv.reader(out_csv.open()))
    assert rows[0] == ["node", "gpu", "t_aligned_ns", "util_gpu"]
    assert {row[0] for row in rows[1:]} == {"node000", "node001", "node002"}
    assert all(row[1] == "1" for row in rows[1:])
    r = CliRunner().invoke(export_cmd, [str(merged), "--format", "collapsed", "-o", str(tmp_path / "s.txt")])
    assert r.exit_code == 1 and "no CPU stack table" in r.output
