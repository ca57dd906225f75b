"""Stragglers of each cause found with their evidence; a balanced job yields none."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.analysis import JobAnalysis, analyze
from gpuprof.mpi_merge.loading import discover, summarize_node
from gpuprof.mpi_merge.stragglers import StragglerParams


def run(d: Path, cfg: syn.SynthConfig) -> JobAnalysis:
    syn.generate(cfg, d)
    return analyze([summarize_node(p) for p in discover(d)])


@pytest.mark.parametrize("cause,severity", [("gpu", 0.3), ("host", 0.3), ("network", 1.0)])
def test_straggler_and_cause_found(tmp_path: Path, cause: str, severity: float) -> None:
    cfg = syn.SynthConfig(nodes=8, duration_s=40, seed=7,
                          stragglers=[syn.Straggler(3, cause, 10.0, 30.0, severity)])
    a = run(tmp_path, cfg)
    assert [f.node for f in a.findings] == ["node003"]
    f = a.findings[0]
    assert f.cause == cause
    assert f.share_last > 2 * f.expected_share and f.evidence
    # the finding is persistent in the episode, not all over the job
    assert 5.0 <= f.first_s <= 15.0 and f.windows_flagged < f.windows_judged
    if cause == "gpu":
        assert any("SM activity" in e for e in f.evidence)
    if cause == "host":
        assert any("CPU cores" in e for e in f.evidence)
    if cause == "network":
        assert any("returned" in e and "later" in e for e in f.evidence)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_balanced_job_has_no_straggler(tmp_path: Path, seed: int) -> None:
    a = run(tmp_path, syn.SynthConfig(nodes=8, duration_s=40, seed=seed))
    assert a.findings == []
    assert a.report["stragglers"] == []


def test_algorithm_is_a_parameter(tmp_path: Path) -> None:
    syn.generate(syn.SynthConfig(nodes=6, duration_s=30, seed=9,
                                 stragglers=[syn.Straggler(2, "network", 5.0, 25.0, 1.0)]), tmp_path)
    S = [summarize_node(p) for p in discover(tmp_path)]
    # a network straggler hardly moves the median-ratio score; the last-arrival share finds it
    by_score = analyze(S, straggler_params=StragglerParams(algorithm="score"))
    by_last = analyze(S, straggler_params=StragglerParams(algorithm="last_share"))
    assert by_score.findings == []
    assert [f.node for f in by_last.findings] == ["node002"]


def test_wait_states_named_and_summed(tmp_path: Path) -> None:
    a = run(tmp_path, syn.SynthConfig(nodes=4, duration_s=10, seed=2))
    pats = a.report["communicators"][0]["patterns"]
    assert set(pats) == {"Wait at NxN", "Wait at Barrier", "Late Broadcast"}
    w = a.waits[0]
    k = int(w.complete.nonzero()[0][5])
    assert w.waits[k, w.last_rank[k]] == 0.0 and (w.waits[k][w.pattern[k] == 0] >= 0).all()
    assert 0 < w.own_time[k] < 200_000
