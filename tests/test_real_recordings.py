"""The merge judged on real recordings of the local cluster (tests/recordings/README.md): what a user
gets on real jobs, in every test run, without the cluster."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gpuprof.mpi_merge.merge import EXIT_COMPLETE, merge

RECORDINGS = Path(__file__).resolve().parent / "recordings"


def test_demo_recording_names_only_the_slow_rank(tmp_path: Path) -> None:
    d = tmp_path / "demo.gpuprof.d"
    shutil.copytree(RECORDINGS / "demo-4nodes", d)
    res = merge(str(d), output_stem=str(tmp_path / "demo"))
    assert res is not None and res.exit_code == EXIT_COMPLETE, res and res.partial_reasons
    report = json.loads(res.reports["json"].read_text())
    # one host: one clock, no correction, nothing out of order, and no note that contradicts it
    assert report["clock"]["causality_violations"] == 0
    assert all(n["clock"]["offset_us"] == 0.0 for n in report["nodes"])
    assert not any("shares no collective" in n for n in report["clock"]["notes"])
    # world rank 2 (node3) burns 30 ms more CPU per step: the one root cause, with its cost; the
    # waits on the 2-rank sub-communicators are not findings of their own
    assert [(f["node"], f["ranks"], f["cause"]) for f in report["stragglers"]] == [("node3", [2], "host")]
    world = next(c["comm_id"] for c in report["communicators"] if c["size"] == 4)
    f = report["stragglers"][0]
    assert f["comm_id"] == world and f["cost_share"] > 0.3 and f["q_value"] < 1e-6
    assert "node3" in res.reports["txt"].read_text()
