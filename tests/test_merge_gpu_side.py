"""The GPU side in the merge. NCCL on device times (docs/merge.md, "NCCL on device times"): the
profiler plugin's rows take their kernels' device-side start and end, join the clock fit, and the
host's enqueue decides between a late host and a busy GPU. NVTX phases: time per range and rank,
and the phase a straggler's extra time went into. Inputs: the SYNTHETIC generator's jobs
(gpuprof.mpi_merge.synthetic, nccl=True, nvtx=True) and hand-made tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuprof.collector import schema
from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.analysis import analyze
from gpuprof.mpi_merge.loading import ClockMap, call_rows, discover, summarize_node
from gpuprof.mpi_merge.matching import build_comms, node_instances

PLUGIN = schema.COLLECTIVE_CALLS.enums["path"].index("nccl_profiler")
FASTPATH = schema.COLLECTIVE_CALLS.enums["path"].index("fastpath")


def identity_clock() -> ClockMap:
    return ClockMap(np.array([0, 10**12], np.int64), np.zeros(2, np.int64), "pairs")  # realtime = monotonic


def plugin_calls(n: int, path: int = PLUGIN) -> np.ndarray:
    c = schema.COLLECTIVE_CALLS.empty(n)
    c["t_enter_ns"] = 1000 + 100 * np.arange(n)
    c["t_exit_ns"] = c["t_enter_ns"] + 8
    c["pid"], c["comm_id"], c["seq"] = 7, 0xABC, np.arange(n)
    c["op"] = schema.COLLECTIVE_OPS.index("ncclAllReduce")
    c["library"], c["path"] = 1, path
    c["comm_rank"], c["comm_size"] = 0, 2
    return c


def device_rows(calls: np.ndarray, start_offset: int = 30, length: int = 20) -> np.ndarray:
    d = schema.DEVICE_TIMES.empty(len(calls))
    for f in ("pid", "comm_id", "seq", "op", "root_or_peer"):
        d[f] = calls[f]
    d["t_dev_start_ns"] = calls["t_enter_ns"] + start_offset
    d["t_dev_end_ns"] = d["t_dev_start_ns"] + length
    return d


def test_plugin_rows_take_their_kernel_times_and_keep_the_enqueue() -> None:
    calls = plugin_calls(4)
    dev = device_rows(calls)[::-1]  # the join does not depend on the table's order
    rows = call_rows(calls, identity_clock(), dev)
    assert rows["device_timed"].all()
    assert (rows["enter_rt"] == calls["t_enter_ns"].astype(np.int64) + 30).all()
    assert (rows["exit_rt"] == calls["t_enter_ns"].astype(np.int64) + 50).all()
    assert (rows["host_enter_rt"] == calls["t_enter_ns"].astype(np.int64)).all()


def test_unknown_or_unmatched_device_times_leave_the_host_times() -> None:
    calls = plugin_calls(4)
    dev = device_rows(calls)
    dev["t_dev_start_ns"][1] = 0  # the plugin did not get this kernel's start
    dev = dev[[0, 1, 3]]  # and no row at all for seq 2
    other = plugin_calls(2, path=FASTPATH)  # the interposer's rows never take device times
    other["comm_id"] = 0xDEF  # its own communicator, with device rows of its own
    rows = call_rows(np.concatenate([calls, other]), identity_clock(), np.concatenate([dev, device_rows(other)]))
    assert rows["device_timed"].tolist() == [True, False, False, True, False, False]
    host = np.concatenate([calls, other])["t_enter_ns"].astype(np.int64)
    assert (rows["enter_rt"][~rows["device_timed"]] == host[~rows["device_timed"]]).all()


def nccl_job(tmp: Path, **kw: object) -> list:
    syn.generate(syn.SynthConfig(**{"nodes": 6, "duration_s": 30, "write_bulk": False, "seed": 3, "nccl": True,
                                    **kw}), tmp)  # type: ignore[arg-type]
    return [summarize_node(p) for p in discover(tmp)]


def test_an_nccl_only_job_is_aligned_from_device_times(tmp_path: Path) -> None:
    S = nccl_job(tmp_path / "j")
    assert all(s.calls["device_timed"].all() for s in S)
    epoch = min(s.span_rt[0] for s in S)
    inst = node_instances(build_comms([s.calls for s in S], epoch), len(S))
    # 3000 instances (30 s, one every 10 ms); all but the Broadcasts (every 10th, where not a
    # barrier: every 50th) are N-to-N on the device and rows of the fit; 1-to-N gives no such bound
    assert len(inst.comm_id) == 3000 - (300 - 60)
    a = analyze(S)
    assert a.clock.instances_used > 0 and a.clock.causality_violations == 0
    truth = json.loads((tmp_path / "j" / "ground_truth.json").read_text())
    for m in a.clock.models:
        if not m.is_reference:
            x = np.linspace(5e9, 25e9, 9)
            tru = syn.true_relative_offset_ns(truth, m.node, (x + epoch - syn.EPOCH_NS) / 1e9)
            # 10 ms offsets and drift, to a few us: the kernels' ends are synchronous (5 us jitter, 1 us
            # device-timer mapping error in the generator), and the fit aims at that inside the bounds
            assert np.abs(m.offset_ns(x) - tru).max() < 10e3, m.node
    assert inst.exit_sync is not None and inst.exit_sync.all()


def test_mpi_host_times_keep_the_wall_clock_as_the_target(tmp_path: Path) -> None:
    """Only device-timed NCCL rows are synchronous: an MPI job's exits (host times, an algorithm's
    asymmetry in them) never become the target, so its fit is the minimal correction it was."""
    syn.generate(syn.SynthConfig(nodes=4, duration_s=20, seed=11, exit_bias_us=40.0), tmp_path / "m")
    S = [summarize_node(p) for p in discover(tmp_path / "m")]
    epoch = min(s.span_rt[0] for s in S)
    inst = node_instances(build_comms([s.calls for s in S], epoch), len(S))
    assert len(inst.comm_id) and inst.exit_sync is None
    assert not inst.synchronous(np.arange(inst.n_rows)).any()


def test_biased_kernel_ends_stay_inside_the_bounds(tmp_path: Path) -> None:
    """Kernel ends that are not synchronous (here up to 40 us later along the ring, as a deep tree
    would end them) move the estimate at most by that, and never out of the constraints."""
    syn.generate(syn.SynthConfig(nodes=6, duration_s=20, seed=12, nccl=True, exit_bias_us=40.0), tmp_path / "b")
    S = [summarize_node(p) for p in discover(tmp_path / "b")]
    a = analyze(S)
    assert a.clock.causality_violations == 0
    truth = json.loads((tmp_path / "b" / "ground_truth.json").read_text())
    epoch = min(s.span_rt[0] for s in S)
    for m in a.clock.models:
        if not m.is_reference:
            x = np.linspace(3e9, 17e9, 8)
            tru = syn.true_relative_offset_ns(truth, m.node, (x + epoch - syn.EPOCH_NS) / 1e9)
            assert np.abs(m.offset_ns(x) - tru).max() < 60e3, m.node


def test_nccl_on_host_times_alone_is_not_aligned(tmp_path: Path) -> None:
    """Without device times (the interposer or uprobes) NCCL calls return at enqueue: no bound holds,
    so they stay out of the fit and the nodes are said to be not aligned."""
    S = nccl_job(tmp_path / "j")
    for s in S:
        s.calls["enter_rt"] = s.calls["host_enter_rt"]
        s.calls["device_timed"] = False
    a = analyze(S)
    assert a.clock.instances_used == 0
    assert not any(m.aligned for m in a.clock.models if not m.is_reference)


@pytest.mark.parametrize("cause", ["gpu", "host"])
def test_the_enqueue_tells_a_late_host_from_a_busy_gpu(cause: str, tmp_path: Path) -> None:
    S = nccl_job(tmp_path / cause, nodes=8, duration_s=45, stragglers=[syn.Straggler(3, cause, 10.0, 30.0, 0.3)],
                 write_bulk=True)
    a = analyze(S)
    assert [(f.node, f.cause) for f in a.findings] == [(syn.node_name(3, 8), cause)]
    f = a.findings[0]
    assert f.metrics["kernel_start_late_ns"] > 0.5e6
    late_enqueue = f.metrics["enqueue_late_ns"] >= 0.5 * f.metrics["kernel_start_late_ns"]
    assert late_enqueue == (cause == "host")
    assert any(e.startswith("NCCL device times") for e in f.evidence)


def test_nvtx_phases_name_where_the_extra_time_went(tmp_path: Path) -> None:
    """NVTX ranges (exclusive of nested ones) per rank and phase, and the straggler's phase: the
    generator's slow rank spends its extra compute in "backward"."""
    syn.generate(syn.SynthConfig(nodes=6, duration_s=40, seed=4, nvtx=True,
                                 stragglers=[syn.Straggler(2, "gpu", 10.0, 30.0, 0.4)]), tmp_path / "j")
    S = [summarize_node(p) for p in discover(tmp_path / "j")]
    totals = S[0].phases[10_000].totals_s()
    # 4000 steps of ~10 ms: forward 40 %, optimizer 10 %, backward the rest; "step" holds only what
    # its nested ranges do not (nothing here)
    assert totals["forward"] == pytest.approx(0.4 * 40, rel=0.02)
    assert totals["optimizer"] == pytest.approx(0.1 * 40, rel=0.05)
    assert totals["backward"] == pytest.approx(0.5 * 40, rel=0.05)
    assert totals.get("step", 0.0) < 0.01 * 40
    a = analyze(S)
    assert [(f.node, f.phase) for f in a.findings] == [(syn.node_name(2, 6), "backward")]
    assert any("NVTX phases" in e and "'backward'" in e for e in a.findings[0].evidence)


def test_exclusive_time_of_nested_ranges() -> None:
    from gpuprof.mpi_merge.loading import exclusive_ns

    r = schema.NVTX_RANGES.empty(5)
    # thread 1: [0, 100) holds [10, 30) and [40, 90), which holds [50, 60); thread 2: [0, 50) alone
    r["t_start_ns"] = [0, 10, 40, 50, 0]
    r["t_end_ns"] = [100, 30, 90, 60, 50]
    r["depth"] = [0, 1, 1, 2, 0]
    r["tid"] = [1, 1, 1, 1, 2]
    assert exclusive_ns(r).tolist() == [30, 20, 40, 10, 50]


def test_a_gpu_straggler_names_its_kernel(tmp_path: Path) -> None:
    """CUDA kernels as CUPTI records them: GPU seconds per kernel and rank in the report, and the
    kernel a GPU straggler's extra time went into in its finding."""
    syn.generate(syn.SynthConfig(nodes=6, duration_s=40, seed=6, cupti=True,
                                 stragglers=[syn.Straggler(4, "gpu", 10.0, 30.0, 0.4)]), tmp_path / "j")
    S = [summarize_node(p) for p in discover(tmp_path / "j")]
    totals = S[0].kernels[10_000].totals_s()
    assert totals["elementwise_add"] == pytest.approx(0.2 * 40, rel=0.05)
    assert totals["sgemm_128x64_nn"] == pytest.approx(0.5 * 40, rel=0.05)
    a = analyze(S)
    assert [(f.node, f.cause, f.kernel) for f in a.findings] == [(syn.node_name(4, 6), "gpu", "sgemm_128x64_nn")]
    assert any(e.startswith("GPU kernels (CUPTI)") and "'sgemm_128x64_nn'" in e for e in a.findings[0].evidence)
    node = next(n for n in a.report["nodes"] if n["node"] == syn.node_name(4, 6))
    assert node["kernel_time_s"]["10000"]["sgemm_128x64_nn"] > totals["sgemm_128x64_nn"]
    # and where on the CPU the straggler launched it from: CUPTI's launch record joined to the
    # uprobe's launch row of the same thread (the CPU stack), over the flagged windows
    launch = a.findings[0].stacks["kernel_launch"]
    assert launch["path"] == ["train_step", "forward", "matmul", "cublasSgemm"] and launch["depth"] == 5  # innermost 4
    assert launch["share_of_launches"] == 1.0 and launch["launches"] > 1000
    assert any(e.startswith("its 'sgemm_128x64_nn' kernels in the flagged windows were launched from")
               for e in a.findings[0].evidence)


def test_the_plugins_rows_replace_the_interposers_for_the_same_process() -> None:
    from gpuprof.mpi_merge.loading import _one_nccl_path

    plugin = plugin_calls(3)
    interposer = plugin_calls(3, path=FASTPATH)
    interposer["comm_id"] = 0x1D  # the ncclUniqueId's hash, not NCCL's commHash
    other_process = plugin_calls(2, path=FASTPATH)
    other_process["pid"] = 8  # no plugin there: its host rows stay
    mpi = plugin_calls(2, path=FASTPATH)
    mpi["library"] = 0
    kept = _one_nccl_path(np.concatenate([plugin, interposer, other_process, mpi]))
    assert kept["path"].tolist() == [PLUGIN] * 3 + [FASTPATH] * 4
    assert 0x1D not in kept["comm_id"].tolist()


def test_the_text_report_says_where_the_time_went(tmp_path: Path) -> None:
    from gpuprof.mpi_merge.report import render_text

    syn.generate(syn.SynthConfig(nodes=6, duration_s=40, seed=4, nvtx=True, cupti=True,
                                 stragglers=[syn.Straggler(2, "gpu", 10.0, 30.0, 0.4)]), tmp_path / "j")
    a = analyze([summarize_node(p) for p in discover(tmp_path / "j")])
    text = render_text(a.report)
    assert "where the time went: NVTX phase 'backward'; GPU kernel 'sgemm_128x64_nn'" in text
