"""The synthetic generator: files in format v1 marked synthetic, and a ground truth that matches them."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpuprof.collector.reader import open_node_trace
from gpuprof.mpi_merge import synthetic as syn


def test_files_are_marked_synthetic_and_readable(tmp_path: Path) -> None:
    truth = syn.generate(syn.SynthConfig(nodes=3, duration_s=5, seed=3), tmp_path)
    files = sorted(tmp_path.glob("*.h5"))
    assert [f.stem for f in files] == ["node000", "node001", "node002"]
    for f in files:
        t = open_node_trace(f)
        assert t.synthetic and t.sealed and not t.partial
        calls = t.table("/collectives/calls")
        assert len(calls) == 500 and (calls["t_exit_ns"] > calls["t_enter_ns"]).all()
    assert truth["synthetic"] is True
    assert json.loads((tmp_path / "ground_truth.json").read_text())["reference_node"] == "node000"


def test_clock_model_matches_written_times(tmp_path: Path) -> None:
    cfg = syn.SynthConfig(nodes=2, duration_s=3, seed=5, op_mix=False)
    truth = syn.generate(cfg, tmp_path)
    clocks = [syn.clock_from_truth(n) for n in truth["nodes"]]
    t = np.array([0.5, 1.5])
    rt = [c.to_monotonic_ns(t).astype(np.int64) + c.boot_ns for c in clocks]
    # the two realtime clocks differ by exactly the relative theta the merge must recover
    rel = syn.true_relative_offset_ns(truth, "node001", t)
    assert np.allclose((rt[1] - rt[0]).astype(float), rel, atol=2)
    assert np.all(np.abs(rel) <= cfg.offset_ms * 2e6)


def test_same_host_shares_one_clock(tmp_path: Path) -> None:
    truth = syn.generate(syn.SynthConfig(nodes=3, duration_s=2, same_host=True), tmp_path)
    offs = {n["offset_ns"] for n in truth["nodes"]}
    assert len(offs) == 1


def test_faults_missing_cutoff_hang(tmp_path: Path) -> None:
    cfg = syn.SynthConfig(nodes=4, duration_s=5, missing_nodes=[3], cutoff_nodes={1: 2.0}, hang_at_seq=400,
                          hang_culprit=2)
    syn.generate(cfg, tmp_path)
    assert not (tmp_path / "node003.h5").exists()
    cut = open_node_trace(tmp_path / "node001.h5")
    assert cut.partial and not cut.sealed
    hung = open_node_trace(tmp_path / "node002.h5").table("/collectives/calls")
    other = open_node_trace(tmp_path / "node000.h5").table("/collectives/calls")
    assert hung["seq"].max() == 399 and other["seq"].max() == 400 and other["t_exit_ns"][-1] == 0


def test_cli(tmp_path: Path) -> None:
    r = CliRunner().invoke(syn.main, ["--nodes", "2", "--out", str(tmp_path), "--duration-s", "2",
                                      "--straggler", "1:gpu:0:1"])
    assert r.exit_code == 0, r.output
    assert "SYNTHETIC" in r.output
    assert json.loads((tmp_path / "ground_truth.json").read_text())["stragglers"][0]["cause"] == "gpu"


def test_a_job_of_1024_nodes_of_8_ranks_generates_in_bounded_memory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The timeline is simulated by blocks of instances into a scratch file: the generator's traced
    peak stays below one float64 [instance x rank] table of the job (the whole-table simulation held
    about eight: 106 MB at 200 instances of this job). A small block makes this job many blocks
    (the default holds 2M cells). Only a sample of the node files is written: each costs the trace
    writer's setup (~25 ms, whatever the job's size), and they are written one at a time anyway."""
    monkeypatch.setattr(syn, "TIMELINE_BLOCK_CELLS", 1 << 16)
    nodes, per_node, instances = 1024, 8, 500
    written = [0, 1, 511, 1022, 1023]
    cfg = syn.SynthConfig(nodes=nodes, ranks_per_node=per_node, duration_s=instances * 0.01, period_ms=10.0,
                          write_bulk=False, missing_nodes=sorted(set(range(nodes)) - set(written)))
    tracemalloc.start()
    try:
        truth = syn.generate(cfg, tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    table_bytes = instances * nodes * per_node * 8
    assert peak < table_bytes / 4, f"peak {peak / 1e6:.1f} MB, one table {table_bytes / 1e6:.1f} MB"

    # names of four digits sort in node order; the scratch file is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"node{i:04d}.h5" for i in written] + ["ground_truth.json"])
    assert [n["node"] for n in truth["nodes"]][-2:] == ["node1022", "node1023"]
    for i in written:
        calls = open_node_trace(tmp_path / f"node{i:04d}.h5").table("/collectives/calls")
        assert set(calls["comm_size"]) == {nodes * per_node}
        for local in range(per_node):
            mine = calls[calls["pid"] == 10_000 + local]
            assert set(mine["comm_rank"]) == {i * per_node + local}
            assert np.array_equal(np.sort(mine["seq"]), np.arange(instances))
            assert (mine["t_exit_ns"] > mine["t_enter_ns"]).all()


def test_cli_takes_up_to_4096_nodes_and_names_a_bad_field(tmp_path: Path) -> None:
    r = CliRunner().invoke(syn.main, ["--nodes", "4097", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "4097" in r.output and "4096" in r.output
    r = CliRunner().invoke(syn.main, ["--nodes", "2", "--out", str(tmp_path), "--duration-s", "0.001"])
    assert r.exit_code == 2 and "duration_s=0.001" in r.output, r.output
