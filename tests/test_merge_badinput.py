"""Bad input: the merge completes with the rest, says exactly what is left out and why, exits 3."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import pytest
from click.testing import CliRunner

from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.cli import merge as merge_cmd
from gpuprof.mpi_merge.merge import EXIT_COMPLETE, EXIT_PARTIAL, Progress, merge


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("base") / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=8, seed=21), d)
    (d / "ground_truth.json").unlink()
    return d


def copy(base: Path, tmp: Path) -> Path:
    d = tmp / "job.gpuprof.d"
    shutil.copytree(base, d)
    return d


def run(d: Path, *args: str) -> tuple[int, dict, str]:
    r = CliRunner().invoke(merge_cmd, [str(d), "--quiet", *args], obj={"config_path": None})
    rep = json.loads((d.parent / "job.gpuprof.json").read_text()) if (d.parent / "job.gpuprof.json").exists() else {}
    return r.exit_code, rep, r.output


def test_clean_merge_is_complete(base: Path, tmp_path: Path) -> None:
    code, rep, out = run(copy(base, tmp_path))
    assert code == EXIT_COMPLETE, out
    assert rep["status"] == "complete" and rep["partial_reasons"] == []
    assert rep["nodes_merged"] == ["node000", "node001", "node002", "node003"]


def test_progress_lines_name_each_step(base: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(merge_cmd, [str(copy(base, tmp_path)), "--quiet", "--progress"],
                           obj={"config_path": None})
    assert r.exit_code == EXIT_COMPLETE, r.output
    for step in ("reading node files: 4/4 files read", "loading calls into the job-wide tables: 4/4 nodes",
                 "scan: completeness, mismatches, clock input: 800/800 instances analysed", "clock fit:",
                 "aligned times, wait states: 800/800 instances analysed", "wait states, stragglers:"):
        assert f"gpuprof merge: {step}" in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert all(line.startswith("gpuprof merge: ") for line in lines), r.stderr
    assert len(lines) == len(set(lines)), r.stderr  # a step's end is printed once


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_estimates_time_left_from_the_rate_so_far(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    p = Progress(True, clock=clock)
    step = "aligned times, wait states"
    p(step, 0, 400, "instances analysed")
    clock.now += 0.5
    p(step, 4, 400, "instances analysed")  # half a second after the last line: not printed
    clock.now += 0.5
    p(step, 8, 400, "instances analysed")  # 2 % done: too early for an estimate
    clock.now += 1.0
    p(step, 20, 400, "instances analysed")  # 5 % in 2 s: 0.1 s an instance, 380 left
    assert p.due() is False
    clock.now += 1.0
    assert p.due() is True
    p(step, 300, 400, "instances analysed")  # 75 % in 3 s: 100 left at 0.01 s each
    clock.now += 0.2
    p(step, 400, 400, "instances analysed")  # the step's end is always printed, with no estimate
    clock.now += 0.1
    p("clock fit", 10, 1000, "instances")  # a new step has a rate of its own: 1 % done, none yet
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "gpuprof merge: aligned times, wait states: 0/400 instances analysed, 0% (0.0 s)",
        "gpuprof merge: aligned times, wait states: 8/400 instances analysed, 2% (1.0 s)",
        "gpuprof merge: aligned times, wait states: 20/400 instances analysed, 5% (2.0 s, left ~38 s)",
        "gpuprof merge: aligned times, wait states: 300/400 instances analysed, 75% (3.0 s, left ~1 s)",
        "gpuprof merge: aligned times, wait states: 400/400 instances analysed, 100% (3.2 s)",
    ], lines


def test_progress_rate_is_per_step_and_off_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    p = Progress(True, clock=clock)
    p("reading node files", 4, 4, "files read")
    clock.now += 10.0  # the next step starts late: its rate counts from its own first call
    p("loading calls into the job-wide tables", 0, 100, "nodes")
    clock.now += 2.0
    p("loading calls into the job-wide tables", 50, 100, "nodes")
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gpuprof merge: loading calls into the job-wide tables: 50/100 nodes, 50% (12.0 s, left ~2 s)")
    clock.now += 1.0
    p("loading calls into the job-wide tables", 99, 100, "nodes")  # not done: 99%, and under a second left
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gpuprof merge: loading calls into the job-wide tables: 99/100 nodes, 99% (13.0 s, left <1 s)")
    off = Progress(False, clock=clock)
    off("reading node files", 1, 4, "files read", force=True)
    assert not off.due() and capsys.readouterr().err == ""


def test_missing_node_file(base: Path, tmp_path: Path) -> None:
    code, rep, _ = run(copy(base, tmp_path), "--expect-nodes", "node000,node001,node002,node003,node004")
    assert code == EXIT_PARTIAL
    assert rep["missing_nodes"] == ["node004"]
    assert "node node004: expected, but no node file" in rep["partial_reasons"]


def test_truncated_file(base: Path, tmp_path: Path) -> None:
    d = copy(base, tmp_path)
    p = d / "node002.h5"
    os.truncate(p, p.stat().st_size // 3)
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    ex = {e["file"]: e["reason"] for e in rep["excluded"]}
    assert "node002.h5" in ex and "node002.h5" in ex["node002.h5"]
    assert rep["nodes_merged"] == ["node000", "node001", "node003"]
    assert any("rank_never_seen" == m["kind"] for m in rep["mismatches"])


def test_file_of_another_job(base: Path, tmp_path: Path) -> None:
    d = copy(base, tmp_path)
    with h5py.File(d / "node001.h5", "r+") as f:
        f.attrs["job_id"] = "999"
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    assert rep["excluded"] == [{"file": "node001.h5", "node": "node001", "reason": "belongs to job 999, not job 4242"}]


def test_wrong_schema_version(base: Path, tmp_path: Path) -> None:
    d = copy(base, tmp_path)
    with h5py.File(d / "node003.h5", "r+") as f:
        f.attrs["schema_version"] = 99
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    assert "schema_version 99" in rep["excluded"][0]["reason"]


def test_two_files_claim_one_node(base: Path, tmp_path: Path) -> None:
    d = copy(base, tmp_path)
    shutil.copy(d / "node001.h5", d / "zz-copy.h5")
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    assert rep["excluded"][0]["file"] == "zz-copy.h5"
    assert "second file claiming node node001 (kept node001.h5)" == rep["excluded"][0]["reason"]


def test_node_without_collectives(base: Path, tmp_path: Path) -> None:
    d = copy(base, tmp_path)
    with h5py.File(d / "node002.h5", "r+") as f:
        f["collectives/calls"].resize((0,))
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    assert "node node002: no collective calls recorded (metrics kept, clock not aligned)" in rep["partial_reasons"]
    n2 = next(n for n in rep["nodes"] if n["node"] == "node002")
    assert n2["clock"]["aligned"] is False and n2["gpus"]


def test_disjoint_communicators(tmp_path: Path) -> None:
    d = tmp_path / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=5, disjoint_comms=2), d)
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    assert any("node002: clock not aligned" in r and "disjoint" in r for r in rep["partial_reasons"])
    assert rep["clock"]["components"] == [["node000", "node001"], ["node002", "node003"]]


def test_cut_off_node_and_hang(tmp_path: Path) -> None:
    d = tmp_path / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=8, cutoff_nodes={1: 4.0}), d)
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    m = rep["mismatches"][0]
    assert m["kind"] == "missing_rank" and m["culprit_nodes"] == ["node001"] and "cut off" in m["detail"]


def test_cut_off_node_loses_only_its_own_ranks(tmp_path: Path) -> None:
    """A node whose collector died half-way: its ranks are left out of the later instances, which
    are still judged on the other ranks (not dropped for everyone), and the report says so."""
    d = tmp_path / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=8, cutoff_nodes={1: 4.0}), d)
    _code, rep, _ = run(d)
    world = rep["communicators"][0]
    assert world["complete"] >= 0.9 * world["instances"], world
    left_out = [r for r in rep["partial_reasons"] if "left out from seq" in r]
    assert left_out and "ranks 1 " in left_out[0] and "node node001's file ends" in left_out[0]


def test_missing_node_file_leaves_its_ranks_out(base: Path, tmp_path: Path) -> None:
    d = copy(base, tmp_path)
    (d / "node003.h5").unlink()
    code, rep, _ = run(d, "--expect-nodes", "node000,node001,node002,node003")
    assert code == EXIT_PARTIAL and rep["missing_nodes"] == ["node003"]
    world = rep["communicators"][0]
    assert world["complete"] >= 0.9 * world["instances"], world
    assert any("ranks 3 left out from seq 0" in r and "no node file" in r for r in rep["partial_reasons"])


def test_late_attached_probe_leaves_out_the_misnumbered_calls(base: Path, tmp_path: Path) -> None:
    """node001's uprobes attached after its rank had started (attach_json, docs/trace-format.md):
    its sequence numbers count from the first call seen, so its calls are not matched with the
    others' by (comm, seq); its rank is left out of those instances, the rest is judged."""
    d = copy(base, tmp_path)
    with h5py.File(d / "node001.h5", "r+") as f:
        calls = f["collectives/calls"]
        rows = calls[...]
        rows["path"] = 0  # recorded by the uprobe path
        calls[...] = rows
        pid = int(rows["pid"][0])
        f.attrs["attach_json"] = json.dumps({"collectives_uprobe": {
            "state": "attached", "attached_ns": int(rows["t_enter_ns"][len(rows) // 2]), "probe": True,
            "late": True, "pids_before": [pid], "may_have_missed": "calls before attached_ns"}})
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    assert any("node node001: process" in r and "left out" in r for r in rep["partial_reasons"]), rep["partial_reasons"]
    world = rep["communicators"][0]
    assert world["complete"] >= 0.9 * world["instances"], world  # judged on the other ranks
    assert any("ranks 1 left out from seq 0" in r for r in rep["partial_reasons"]), rep["partial_reasons"]


def test_lost_record_is_not_called_a_hang(base: Path, tmp_path: Path) -> None:
    """One call record of node002 missing in the middle (a full ring drops records): its rank called
    the later collectives, so the report says the record was lost, not that the job hung."""
    from gpuprof.collector.schema import COLLECTIVE_OPS

    d = copy(base, tmp_path)
    with h5py.File(d / "node002.h5", "r+") as f:
        calls = f["collectives/calls"]
        rows = calls[...]
        k = int((rows["seq"] == 300).nonzero()[0][0])
        rows["op"][k] = COLLECTIVE_OPS.index("ncclGroupStart")  # no longer a collective of the table
        calls[...] = rows
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    (m,) = rep["mismatches"]
    assert (m["kind"], m["first_seq"], m["culprit_nodes"]) == ("records_lost", 300, ["node002"]), m
    assert "did not hang" in m["detail"]


def test_hung_job_culprit(tmp_path: Path) -> None:
    d = tmp_path / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=8, hang_at_seq=500, hang_culprit=2), d)
    code, rep, _ = run(d)
    assert code == EXIT_PARTIAL
    m = rep["mismatches"][0]
    assert (m["first_seq"], m["kind"], m["culprit_ranks"], m["culprit_nodes"]) == (500, "missing_rank", [2], ["node002"])
    assert "hung" in m["detail"]


def test_op_mismatch_culprit(tmp_path: Path) -> None:
    d = tmp_path / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=8, hang_at_seq=300, hang_culprit=1, hang_kind="op"), d)
    _code, rep, _ = run(d)
    m = rep["mismatches"][0]
    assert (m["first_seq"], m["kind"], m["culprit_nodes"]) == (300, "op_differs", ["node001"])


def test_rerun_replaces_atomically(base: Path, tmp_path: Path) -> None:
    d = copy(base, tmp_path)
    r1 = merge(str(d))
    assert r1 is not None
    ino = r1.job_file.stat().st_ino
    r2 = merge(str(d))
    assert r2 is not None and r2.job_file == r1.job_file
    assert r2.job_file.stat().st_ino != ino  # a new file renamed into place, not rewritten in place
    leftovers = [p.name for p in d.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_nothing_to_merge_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(merge_cmd, [str(tmp_path / "empty")], obj={"config_path": None})
    assert r.exit_code == 2 and "no node files" in r.output
