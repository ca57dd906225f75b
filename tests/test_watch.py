"""Live watch (collector/watch.py): node summaries from collective rows, the job-wide count test on
them, and a watch on a job that has ended. The detection on a real MPI job with one rank made slow
mid-job is the time_to_detect bench (tests/bench/bench_continuous.py --time-to-detect)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuprof.collector import schema
from gpuprof.collector.watch import node_summary
from gpuprof.mpi_merge.live_watch import combine, live_findings

ROOT = Path(__file__).resolve().parents[1]
MS = 1_000_000


def node_data(ranks: list[int], n: int, late: dict[int, tuple[int, float]], compute_ms: float = 20.0,
              seed: int = 0) -> dict[str, np.ndarray]:
    """One node's retained rows: MPI_Allreduce on a 4-rank communicator every compute_ms, arrival
    jitter of 0.2 ms; late = {rank: (from instance, by ms)}. The node's monotonic clock = realtime - 1e18."""
    rng = np.random.default_rng(seed)
    calls = schema.COLLECTIVE_CALLS.empty(n * len(ranks))
    i = 0
    for k in range(n):
        base = 10**12 + k * int((compute_ms + 1) * MS)
        ends = base + int(compute_ms * MS) + max(
            (int(by * MS) if k >= start else 0) for start, by in [late.get(r, (n, 0.0)) for r in range(4)])
        for r in ranks:
            start, by = late.get(r, (n, 0.0))
            t = base + int(compute_ms * MS) + int(rng.uniform(0, 0.2) * MS) + (int(by * MS) if k >= start else 0)
            calls[i] = (t, ends + MS, 100 + r, 100 + r, 0, schema.COLLECTIVE_OPS.index("MPI_Allreduce"), 77, k, r, 4,
                        8, -1, -1, 0, 0, 1)
            i += 1
    pairs = schema.CLOCK_PAIRS.empty(1)
    pairs[0] = (0, 10**18, 10)
    return {schema.COLLECTIVE_CALLS.path: calls, schema.CLOCK_PAIRS.path: pairs}


def summaries(n: int, late: dict[int, tuple[int, float]]) -> list[dict[str, Any]]:
    # 4 nodes, one rank each; every node sees only its own rank's calls
    return [node_summary({p: (rows[rows["comm_rank"] == r] if p == schema.COLLECTIVE_CALLS.path else rows)
                          for p, rows in node_data([0, 1, 2, 3], n, late).items()}, node=f"node{r + 1}")
            for r in range(4)]


def test_summary_is_small_and_on_realtime() -> None:
    s = node_summary(node_data([0, 1], 300, {}), node="n1")
    comm = s["communicators"]["77"]
    assert comm["comm_size"] == 4 and sorted(comm["ranks"]) == ["0", "1"]
    inst = comm["ranks"]["0"]
    assert len(inst) == 256 and inst[-1][0] == 299  # the newest instances only
    assert inst[0][1] > 10**18  # mapped to the node's realtime clock


def test_a_balanced_job_has_no_finding() -> None:
    findings, views = live_findings(combine(summaries(200, {})))
    assert findings == []
    assert views[0]["instances"] == 200 and set(views[0]["lateness_ms"]) == {"0", "1", "2", "3"}


def test_a_rank_made_slow_is_named_with_its_node() -> None:
    findings, views = live_findings(combine(summaries(200, {2: (150, 15.0)})))
    assert [f.unit for f in findings] == ["node3"]
    f = findings[0]
    assert f.ranks == [2] and f.late_instances >= 45 and f.p_value < 1e-6
    assert 0.6 < f.held_s < 0.8  # 50 instances x 15 ms
    assert "arrives late without computing longer" in f.cause
    assert views[0]["last_arrivals"][-1]["unit"] == "node3"


def test_a_few_late_instances_are_not_enough() -> None:
    findings, _ = live_findings(combine(summaries(200, {1: (198, 15.0)})))  # only the last 2 instances
    assert findings == []


def test_three_instances_are_enough_to_show() -> None:
    findings, views = live_findings(combine(summaries(3, {})))
    assert findings == [] and len(views[0]["last_arrivals"]) == 3


def test_missing_ranks_are_said() -> None:
    s = summaries(50, {})[:3]  # node4's summary did not come
    findings, views = live_findings(combine(s))
    assert findings == [] and views[0]["note"] == "not every rank seen"


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs scontrol (the local cluster)")
def test_watch_on_a_job_that_ended() -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin:/usr/local/bin"}
    r = subprocess.run([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "watch", "4000000000", "--once"],
                       capture_output=True, text=True, check=False, env=env | _cluster_env())
    assert r.returncode == 1, r.stderr
    assert "nothing to watch" in r.stdout


def _cluster_env() -> dict[str, str]:
    env_file = ROOT / ".cluster" / "env"
    if not env_file.exists():
        pytest.skip("no local cluster (.cluster/env)")
    out: dict[str, str] = {}
    for line in env_file.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            k, _, v = line[len("export "):].partition("=")
            out[k] = v.strip().strip('"').strip("'")
    return out


def test_a_rank_probed_late_counts_its_seq_from_later_and_is_realigned() -> None:
    # node2's probes came 7 instances late: its seq 0 is everyone else's seq 7
    s = summaries(200, {3: (150, 15.0)})
    ranks = s[1]["communicators"]["77"]["ranks"]
    ranks["1"] = [[q - 7, a, b] for q, a, b in ranks["1"] if q >= 7]
    combined = combine(s)
    assert combined["77"]["seq_shift"][1] == -7
    findings, _ = live_findings(combined)
    assert [f.unit for f in findings] == ["node4"]
    # without the realignment node2 would look late by 7 steps at every instance
    balanced = summaries(200, {})
    b_ranks = balanced[1]["communicators"]["77"]["ranks"]
    b_ranks["1"] = [[q - 7, a, b] for q, a, b in b_ranks["1"] if q >= 7]
    assert live_findings(combine(balanced))[0] == []


def test_a_finding_goes_to_syslog_and_the_jobs_comment_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpuprof watch --log --comment`: each new finding once to `logger` (syslog, tag gpuprof-watch)
    and into the job's Slurm comment (`scontrol update`), what an alert picks up. The two commands
    are stand-ins on PATH that record their arguments; the view is a real live_findings result."""
    from click.testing import CliRunner

    from gpuprof.mpi_merge import continuous_cli

    calls = tmp_path / "calls"
    for name in ("logger", "scontrol"):
        exe = tmp_path / name
        exe.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    findings, views = live_findings(combine(summaries(200, {2: (150, 15.0)})))
    view = {"job": "42", "state": "live", "nodes": ["node1"], "communicators": views, "nodes_without_summary": {},
            "findings": [f.__dict__ | {"line": f.line()} for f in findings]}
    monkeypatch.setattr(continuous_cli, "watch_once", lambda job, template, params=None: view)
    r = CliRunner().invoke(continuous_cli.watch, ["42", "--once", "--log", "--comment"], obj={})
    assert r.exit_code == 3, r.output  # a finding
    lines = calls.read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("logger -t gpuprof-watch job 42: ") and "node3" in lines[0]
    assert lines[1].startswith("scontrol update JobId=42 Comment=gpuprof: ") and "node3" in lines[1]
