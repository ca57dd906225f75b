"""Node trace format v1: every file in tests/data, bad input, and the doc kept in sync with the schema."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from gpuprof.collector import docgen, schema
from gpuprof.collector.errors import TraceFormatError
from gpuprof.collector.reader import open_node_trace, summarize

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
CASES = sorted(p.parent.name for p in DATA.glob("*/expect.json"))


def test_there_are_data_cases() -> None:
    assert len(CASES) >= 8


@pytest.mark.parametrize("case", CASES)
def test_every_data_file(case: str) -> None:
    path = DATA / case / "node.h5"
    expect = json.loads((DATA / case / "expect.json").read_text())
    if "error" in expect:
        with pytest.raises(TraceFormatError) as e:
            open_node_trace(path)
        assert str(path) in str(e.value) and expect["error"] in str(e.value)
        r = subprocess.run([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "inspect", str(path)],
                           capture_output=True, text=True, check=False, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r.returncode == 2 and "Traceback" not in r.stderr and str(path) in r.stderr
        return
    t = open_node_trace(path)
    assert t.partial == expect["partial"] and t.sealed == (not expect["partial"])
    s = summarize(t)
    assert s["records"]["/clock/pairs"] >= 1 and s["records"]["/host/node"] >= 1
    assert s["emulated"]  # the data were made with the NVML test double, and say so
    for tpath, rows in t.tables.items():
        spec = schema.TABLES_BY_PATH[tpath]
        assert rows.dtype == spec.dtype, tpath
        if "t_ns" in (rows.dtype.names or ()) and len(rows) > 1 and tpath != "/diagnostics/errors":
            assert int(rows["t_ns"].min()) >= int(t.attrs["start_monotonic_ns"]) - 10**9


def test_missing_file_is_named() -> None:
    with pytest.raises(TraceFormatError, match="does not exist"):
        open_node_trace(DATA / "no-such" / "node.h5")


def test_doc_lists_the_schema() -> None:
    text = (ROOT / "docs" / "trace-format.md").read_text()
    assert docgen.render() in text, "docs/trace-format.md is stale: run python -m gpuprof.collector.docgen --write"


def test_inspect_json_of_sealed_case() -> None:
    path = DATA / "sealed-metrics" / "node.h5"
    r = subprocess.run([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "inspect", "--json", str(path)],
                       capture_output=True, text=True, check=False, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    s = json.loads(r.stdout)
    assert s["sealed"] and s["schema"] == "slurm-gpuprof.node v1" and s["rates_hz"]["host"] == 10
    assert {"source": "nvml", "device": 1, "metric": "power_w", "reason": "NVML_ERROR_NOT_SUPPORTED"} \
        in s["missing_metrics"]


def test_a_column_added_later_reads_as_its_absent_value(tmp_path: Path) -> None:
    """A file written before /stacks/samples had `gil` (a real recording of the demo) reads it as
    0, "not known", with every other column as stored; a file that lacks a column every file has
    is refused, naming the file, the table and the column."""
    rec = ROOT / "tests" / "recordings" / "demo-4nodes" / "node1.h5"
    with h5py.File(rec, "r") as f:
        stored = f[schema.STACK_SAMPLES.path][()]
    assert "gil" not in (stored.dtype.names or ())
    rows = open_node_trace(rec, tables=(schema.STACK_SAMPLES.path,)).table(schema.STACK_SAMPLES.path)
    assert len(rows) == len(stored) > 0
    assert (rows["gil"] == schema.GIL_UNKNOWN).all()
    assert (rows["user_stack"] == stored["user_stack"]).all() and (rows["count"] == stored["count"]).all()
    bad = tmp_path / "node1.h5"
    shutil.copy(rec, bad)
    with h5py.File(bad, "r+") as f:
        old = f[schema.STACK_SAMPLES.path][()]
        keep = [n for n in old.dtype.names if n != "count"]
        del f[schema.STACK_SAMPLES.path]
        f.create_dataset(schema.STACK_SAMPLES.path, data=old[keep].copy())
    with pytest.raises(TraceFormatError, match=r"node1\.h5: table /stacks/samples lacks column\(s\) count"):
        open_node_trace(bad, tables=(schema.STACK_SAMPLES.path,))
