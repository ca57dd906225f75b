"""Node trace format v1: every file in tests/data, bad input, and the doc kept in sync with the schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
