"""The real-application fault-injection suite (tests/realapps), short version for CI.

On the local cluster: the training-shaped mpi4py program balanced, with extra sleep in one rank's data
loading (its own knob) and with one rank stopped periodically from outside (SIGSTOP/SIGCONT by a
helper process that finds the rank in its node's Slurm job cgroup), each a real `sbatch -N4
--profile-gpu` job, recorded, merged and scored. What is asserted here is the suite: the jobs ran, the
faults took effect where the ground truth says, the recordings hold the collectives, the scores count
the report's findings, --rescore re-merges the cache. Whether the analysis gets the faults right is
what `tests/bench/bench_real.py` measures (goals of issue 10); here it is only reported (xfail).

Without the cluster: the re-timing tool (clock pairs rewritten by a known offset, drift and slews,
distinct hostname and boot_id) and the clock scoring, on node files of the synthetic generator.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import Cluster
from realapps import apps, faults, retime, runner, scoring

from gpuprof.collector.reader import open_node_trace
from gpuprof.collector.schema import CLOCK_PAIRS, COLLECTIVE_CALLS, COLLECTIVE_OPS
from gpuprof.mpi_merge import synthetic as syn

REPO = Path(__file__).resolve().parents[1]
STEPS = 600  # of the training program in CI (the catalogue's 1500 in the bench)
CI_RUNS = (("train", "balanced"), ("train", "load_sleep"), ("train", "sigstop"))


# =================================================================================================
# On the cluster
# =================================================================================================


@pytest.fixture(scope="module")
def real_cache(cluster: Cluster, test_user: str) -> Iterator[Path]:
    """A cache of the CI runs, recorded once for the module (~2 min on 2 cores)."""
    cache = Path(tempfile.mkdtemp(prefix="gpuprof-realapps-ci-", dir="/var/tmp"))
    cache.chmod(0o755)
    train = apps.APPS["train"]
    argv = list(train.argv)
    argv[argv.index("--steps") + 1] = str(STEPS)
    short = apps.App(**{**train.__dict__, "argv": tuple(argv)})
    specs = [runner.RunSpec(short, faults.FAULTS[f], 0) for _, f in CI_RUNS]
    scores = runner.run_all(specs, cache)
    errors = [f"{s.run}: {s.error}" for s in scores if s.error]
    assert not errors, "\n".join(errors)
    yield cache
    shutil.rmtree(cache, ignore_errors=True)




def world_allreduces(path: Path) -> np.ndarray:
    calls = open_node_trace(path).table(COLLECTIVE_CALLS.path)
    return calls[(calls["op"] == COLLECTIVE_OPS.index("MPI_Allreduce")) & (calls["comm_size"] == 4)]


@pytest.mark.slurm
@pytest.mark.mpi
def test_recordings_and_ground_truth(real_cache: Path) -> None:
    for app, fault in CI_RUNS:
        run_dir = real_cache / f"{app}-{fault}-0"
        truth = json.loads((run_dir / "ground_truth.json").read_text())
        assert truth["job_state"] == "COMPLETED"
        assert truth["nodes"] == ["node1", "node2", "node3", "node4"]
        # one rank per node, and the node files agree with the launcher's rank -> node lines
        assert sorted(truth["rank_of_node"].values()) == [0, 1, 2, 3]
        assert truth["world_rank_in_node_file"] == truth["rank_of_node"], run_dir
        if fault == "balanced":
            assert truth["cause"] is None and truth["node"] is None
        else:
            assert truth["cause"] == "host"
            assert truth["rank_of_node"][truth["node"]] == truth["rank"]
        for n in truth["nodes"]:
            f = run_dir / "recording" / f"{n}.h5"
            assert open_node_trace(f).sealed, f
            world = world_allreduces(f)
            # every step's gradient Allreduce recorded exactly once on every node
            assert len(world) == STEPS, f"{f}: {len(world)} world Allreduce, expected {STEPS}"


@pytest.mark.slurm
@pytest.mark.mpi
def test_load_sleep_lengthens_the_target_ranks_interval(real_cache: Path) -> None:
    """The injection is where the truth says: the target rank's time between its Allreduces (data
    loading + compute) exceeds every other rank's by more than half the extra sleep (12 ms). Not by
    all of it: the four ranks share the two cores, and while the others wait in the Allreduce for
    the target, it computes on a core of its own, so its compute is shorter than theirs (measured
    on the CI machine of 2026-12-05: 7.5 and 7.7 ms more than the slowest other rank, twice)."""
    run_dir = real_cache / "train-load_sleep-0"
    truth = json.loads((run_dir / "ground_truth.json").read_text())
    gaps = {}
    for n in truth["nodes"]:
        w = np.sort(world_allreduces(run_dir / "recording" / f"{n}.h5"), order="seq")
        gaps[n] = float(np.median(w["t_enter_ns"][1:].astype(np.int64) - w["t_exit_ns"][:-1].astype(np.int64))) / 1e6
    others = [g for n, g in gaps.items() if n != truth["node"]]
    assert gaps[truth["node"]] > max(others) + 6.0, gaps


@pytest.mark.slurm
@pytest.mark.mpi
def test_sigstop_injector_stopped_the_recorded_rank(real_cache: Path) -> None:
    run_dir = real_cache / "train-sigstop-0"
    truth = json.loads((run_dir / "ground_truth.json").read_text())
    log = (run_dir / "inject.log").read_text()
    line = [x for x in log.splitlines() if x.startswith("inject: sigstop on ")]
    assert line, log
    node, pid = line[0].split()[3], int(line[0].split()[5])
    assert node == truth["node"]
    out = next((run_dir / "work").glob("slurm-*.out")).read_text()
    assert f"realapps: rank {truth['rank']} node {node} pid {pid}" in out
    # the pid the helper stopped is the one whose collectives the node file holds
    assert set(world_allreduces(run_dir / "recording" / f"{node}.h5")["pid"].tolist()) == {pid}


@pytest.mark.slurm
@pytest.mark.mpi
def test_scores_count_the_reports_findings_and_rescore_repeats_them(real_cache: Path) -> None:
    first = {}
    for app, fault in CI_RUNS:
        run_dir = real_cache / f"{app}-{fault}-0"
        s = json.loads((run_dir / "score.json").read_text())
        report = json.loads((run_dir / "merged.gpuprof.json").read_text())
        assert s["findings"] == len(report["stragglers"])
        assert 0 <= s["true_positive"] <= s["located"] <= s["findings"]
        if fault == "balanced":
            assert s["balanced"] and s["located"] == 0
        first[s["run"]] = (s["findings"], s["true_positive"])
    specs = runner.plan(["train"], [f for _, f in CI_RUNS], 1)
    again = runner.run_all(specs, real_cache, rescore=True)
    assert {s.run: (s.findings, s.true_positive) for s in again} == first
    lines = runner.bench_lines(again)
    keys = {"bench", "app", "fault", "runs", "precision", "recall", "cause_accuracy", "findings_on_balanced"}
    assert all(keys <= set(x) for x in lines)
    assert lines[-1]["app"] == "all" and lines[-1]["runs"] == len(CI_RUNS)


@pytest.mark.slurm
@pytest.mark.mpi
def test_accuracy_goals(real_cache: Path) -> None:
    """The goals of issue 10 on the CI runs: a gross regression (most findings wrong, most faults
    missed) fails; a run below the goals (a fault missed, a finding on the balanced run: seen once
    in CI on this shared 2-core VM) is reported as an xfail with the figures, which
    tests/bench/bench_real.py measures over more runs."""
    specs = runner.plan(["train"], [f for _, f in CI_RUNS], 1)
    scores = runner.run_all(specs, real_cache, rescore=True)
    total = runner.bench_lines(scores)[-1]
    assert total["precision"] is None or total["precision"] >= 0.5, total
    assert total["recall"] is not None and total["recall"] >= 0.5, total
    if (total["findings_on_balanced"] or total["recall"] < 0.9
            or (total["precision"] is not None and total["precision"] < 0.95)):
        pytest.xfail(f"below issue 10's goals on this run: {total}")


# =================================================================================================
# Without the cluster: scoring and the re-timing tool
# =================================================================================================


def test_scoring_of_findings() -> None:
    truth = {"app": "x", "fault": "sigstop", "cause": "host", "node": "node3", "rank": 2}
    report = {"status": "complete", "stragglers": [
        {"node": "node3", "ranks": [2], "cause": "host", "comm_id": "0x1"},
        {"node": "node3", "ranks": [0], "cause": "network", "comm_id": "0x2"},
        {"node": "node1", "ranks": [0], "cause": "host", "comm_id": "0x1"},
    ]}
    s = scoring.score_run(report, truth, "r")
    assert (s.findings, s.located, s.true_positive) == (3, 2, 1)
    bal = scoring.score_run({"stragglers": [report["stragglers"][0]]}, {**truth, "fault": "balanced", "cause": None,
                                                                         "node": None, "rank": None}, "b")
    agg = scoring.aggregate([s, bal], "all", "all")
    assert agg["precision"] == round(1 / 3, 4) and agg["recall"] == 1.0 and agg["cause_accuracy"] == 0.5
    assert agg["findings_on_balanced"] == 1


def test_a_fault_run_without_effect_is_counted_apart_not_scored() -> None:
    truth = {"app": "x", "fault": "corunner", "cause": "host", "node": "node3", "rank": 2}
    hit = scoring.score_run({"stragglers": [{"node": "node3", "ranks": [2], "cause": "host"}]},
                            {**truth, "fault_effect": {"wait_gap": 0.6, "took_effect": True}}, "a")
    missed = scoring.score_run({"stragglers": []}, {**truth, "fault_effect": {"wait_gap": 0.0, "took_effect": False}}, "b")
    before = scoring.score_run({"stragglers": []}, truth, "c")  # recorded before the injector measured
    agg = scoring.aggregate([hit, missed], "x", "corunner")
    assert (agg["runs"], agg["runs_fault_without_effect"], agg["recall"]) == (1, 1, 1.0)
    agg = scoring.aggregate([hit, missed, before], "x", "corunner")
    assert (agg["runs"], agg["runs_fault_without_effect"], agg["recall"]) == (2, 1, 0.5)


def test_corunner_effect_is_read_from_the_ranks_run_queue_waits(tmp_path: Path) -> None:
    """The injector's effect line on real processes: a "rank" pinned to a CPU with three busy loops
    (it waits for the CPU about three quarters of the time it wants it) against a rank that mostly
    sleeps on the other CPU, and the roles the other way round; and the runner's reading of it."""
    def pinned(cpu: int, code: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["taskset", "-c", str(cpu), "python3", "-c", code])

    crowded = [pinned(0, "while True: pass") for _ in range(4)]
    light = pinned(1, "import time\nwhile True: time.sleep(0.01)")
    try:
        shares = faults.SchedShares()
        pids = [light.pid, *(c.pid for c in crowded)]
        shares.read(pids)
        time.sleep(1.5)
        shares.read(pids)
        starved = faults.effect_line(shares, crowded[0].pid, [light.pid])
        fed = faults.effect_line(shares, light.pid, [crowded[0].pid])
    finally:
        for q in (*crowded, light):
            q.kill()
            q.wait()
    log = tmp_path / "inject.log"
    log.write_text(f"inject: corunner on node3 pid {crowded[0].pid} rank 2\n{starved}\n")
    effect = runner.fault_effect(log, "corunner")
    assert effect is not None and effect["took_effect"] and effect["rank_wait_share"] > 0.5, (starved, effect)
    log.write_text(f"inject: corunner on node3 pid {light.pid} rank 2\n{fed}\n")
    effect = runner.fault_effect(log, "corunner")
    assert effect is not None and not effect["took_effect"] and effect["wait_gap"] < 0, (fed, effect)
    log.write_text("inject: corunner on node3 pid 1 rank 2\n")  # killed before it printed
    effect = runner.fault_effect(log, "corunner")
    assert effect is not None and not effect["took_effect"]
    assert runner.fault_effect(log, "sigstop") is None


@pytest.fixture(scope="module")
def same_host_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Node files of the generator with every virtual node on one host (one clock, as on the local
    cluster): the recorded pairs are the truth."""
    d = tmp_path_factory.mktemp("samehost")
    syn.generate(syn.SynthConfig(nodes=4, duration_s=20.0, period_ms=10.0, same_host=True, write_bulk=False,
                                 op_mix=False, seed=3), d)
    return d


def test_retimed_pairs_carry_the_intended_error(same_host_job: Path, tmp_path: Path) -> None:
    errs = {f"node{i}": retime.ClockError(offset_us=1000.0 * i - 1500.0, drift_ppm=20.0 * (i - 2),
                                          slews=[retime.Slew(5.0, 4.0, 30.0 * (-1) ** i)]) for i in range(1, 5)}
    names = sorted(p.stem for p in same_host_job.glob("node*.h5"))
    errs = dict(zip(names, errs.values(), strict=True))
    truth = retime.retime_recording(same_host_job, tmp_path, errors=errs)
    t0 = truth["t0_ns"]
    hosts, boots = set(), set()
    for n in names:
        with h5py.File(same_host_job / f"{n}.h5", "r") as a, h5py.File(tmp_path / f"{n}.h5", "r") as b:
            pa, pb = a[CLOCK_PAIRS.path][()], b[CLOCK_PAIRS.path][()]
            assert np.array_equal(pa["monotonic_ns"], pb["monotonic_ns"])
            got = pb["realtime_ns"].astype(np.int64) - pa["realtime_ns"].astype(np.int64)
            dt = (pa["realtime_ns"].astype(np.int64) - t0) / 1e9
            e = errs[n]
            want_us = e.offset_us + e.drift_ppm * dt + e.slews[0].rate_ppm * np.clip(dt - 5.0, 0, 4.0)
            assert np.max(np.abs(got / 1e3 - want_us)) < 0.002, n
            assert int(b.attrs["start_realtime_ns"]) - int(a.attrs["start_realtime_ns"]) == int(
                e.error_ns(np.array([int(a.attrs["start_realtime_ns"])]), t0)[0])
            hosts.add(b.attrs["hostname"])
            boots.add(b.attrs["boot_id"])
            # everything but the clock is the recording's own
            assert np.array_equal(a[COLLECTIVE_CALLS.path][()], b[COLLECTIVE_CALLS.path][()])
    assert len(hosts) == len(names) and len(boots) == len(names)
    assert json.loads((tmp_path / retime.TRUTH_FILE).read_text())["errors"][names[1]]["offset_us"] == errs[
        names[1]].offset_us


def _fake_job_file(path: Path, src: Path, names: list[str], aligned_of: dict[str, np.ndarray]) -> None:
    """A job file holding only what clock_errors reads, with the aligned times given."""
    with h5py.File(path, "w") as f:
        for n in names:
            calls = open_node_trace(src / f"{n}.h5").table(COLLECTIVE_CALLS.path)
            g = f.create_group(f"nodes/{n}/collectives")
            g["calls"] = calls
            al = np.zeros(len(calls), dtype=[("t_enter_aligned_ns", "<i8"), ("t_exit_aligned_ns", "<i8")])
            al["t_enter_aligned_ns"] = np.rint(aligned_of[n]).astype(np.int64)
            g["calls_aligned"] = al


def test_clock_scoring_of_a_retimed_recording(same_host_job: Path, tmp_path: Path) -> None:
    """Scored against hand-made alignments: no correction gives the raw wall-clock error, the exact
    correction gives zero; and a real merge of the re-timed copy is scored without violations counted
    wrong."""
    rt = tmp_path / "retimed"
    truth = retime.retime_recording(same_host_job, rt, seed=5)
    names = sorted(truth["errors"])
    errs = retime.load_errors(truth)
    t0 = truth["t0_ns"]
    ref = names[0]
    report = {"clock": {"reference": ref, "causality_violations": 0},
              "nodes": [{"node": n, "clock": {"offset_us": 0.0}} for n in names]}
    raw, exact = {}, {}
    for n in names:
        calls = open_node_trace(same_host_job / f"{n}.h5").table(COLLECTIVE_CALLS.path)
        with h5py.File(same_host_job / f"{n}.h5", "r") as f:
            pairs0 = f[CLOCK_PAIRS.path][()]
        with h5py.File(rt / f"{n}.h5", "r") as f:
            pairs1 = f[CLOCK_PAIRS.path][()]
        true_rt = retime.mono_to_real(calls["t_enter_ns"], pairs0)
        raw[n] = retime.mono_to_real(calls["t_enter_ns"], pairs1)
        exact[n] = true_rt + errs[ref].error_ns(np.rint(true_rt).astype(np.int64), t0)
    _fake_job_file(tmp_path / "raw.h5", same_host_job, names, raw)
    _fake_job_file(tmp_path / "exact.h5", same_host_job, names, exact)
    s_raw = retime.clock_errors(same_host_job, rt, tmp_path / "raw.h5", report)
    s_exact = retime.clock_errors(same_host_job, rt, tmp_path / "exact.h5", report)
    assert s_raw.rms_error_us is not None and s_raw.raw_wall_clock_us is not None
    assert s_exact.rms_error_us is not None
    assert s_raw.rms_error_us == pytest.approx(s_raw.raw_wall_clock_us, rel=1e-3, abs=0.01)
    assert s_raw.raw_wall_clock_us > 100.0  # ms offsets were injected
    assert s_exact.rms_error_us < 0.01
    assert s_exact.interval_coverage is None  # no interval in this report
    # and a real merge of the copy is scored (its accuracy is the bench's business)
    p = subprocess.run([str(REPO / ".venv" / "bin" / "gpuprof"), "merge", str(rt), "--output-stem",
                        str(tmp_path / "m"), "--quiet"], capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode in (0, 3), p.stderr
    rep = json.loads((tmp_path / "m.gpuprof.json").read_text())
    s = retime.clock_errors(same_host_job, rt, tmp_path / "m.gpuprof.h5", rep)
    assert s.rms_error_us is not None and s.raw_wall_clock_us == pytest.approx(s_raw.raw_wall_clock_us, rel=0.05)
    assert sum(v["calls"] for v in s.per_node.values()) > 0
