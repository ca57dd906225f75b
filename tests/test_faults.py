"""The fault suite on the local cluster (issue 11): real sbatch jobs of the test user with
--profile-gpu, a fault applied while they run, then tests/faultcheck.py's checks: no node drained
or down, no DCGM pause left (tests/doubles/fake_dcgmi), no collector left, the job's own output
intact, and every node's result complete, or partial with the reason where the user looks.

Faults that need no slurmd (state lost, the epilog never running after a crash, an orphaned
collector, disk full in the state or output directory) run faster without a cluster in
tests/test_hook_faults.py; the ones here need slurmd itself or the whole path through Slurm.
tests/bench/bench_faults.py runs both files and prints the figures.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import NODES, Cluster
from faultcheck import FaultOutcome, collectors_left, dcgm_left, digest, fill, mount_tmpfs, node_result

from gpuprof.slurm_hooks.hooks import collector_pids

pytestmark = pytest.mark.slurm
FAKE_DCGMI = Path(__file__).parent / "doubles" / "fake_dcgmi"
CALLS = Path("/tmp/gpuprof-fake-dcgmi.calls")  # the double's default log: hooks run in Slurm's environment


def _config(cluster: Cluster, state_dir: Path, extra: str = "") -> str:
    return (f'[paths]\nstate_dir = "{state_dir}"\nlog_file = "{cluster.dir}/log/gpuprof-hooks.log"\n'
            f'[dcgm]\ndcgmi = "{FAKE_DCGMI}"\n[merge]\nauto = false\n' + extra)


@pytest.fixture(autouse=True)
def no_dcgmi_calls_left() -> None:
    """Each case counts the dcgmi calls of its own run."""
    CALLS.unlink(missing_ok=True)


@pytest.fixture
def state_dir(cluster: Cluster) -> Path:
    return cluster.dir / "state" / "gpuprof"


def wait_collector(state_dir: Path, job: str, node: str, timeout: float = 60) -> int:
    """pid of the job's collector on node once the prolog recorded it as recording."""
    f = state_dir / "jobs" / f"{job}@{node}" / "state.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f.exists():
            try:
                st = json.loads(f.read_text())
            except json.JSONDecodeError:
                st = {}
            if st.get("collector_started"):
                return int(st["collector_pid"])
        time.sleep(0.2)
    raise AssertionError(f"no recording collector for job {job} on {node} after {timeout} s")


def not_idle(cluster: Cluster, timeout: float = 60) -> dict[str, str]:
    """Nodes not idle once the jobs are done (drained, down, still completing), after a grace."""
    deadline = time.monotonic() + timeout
    while True:
        states = cluster.node_states()
        bad = {n: s for n, s in states.items() if s != "idle"}
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.5)


def wait_placed(node_dir: Path, nodes: list[str], timeout: float = 60) -> None:
    """Until every node has a file or a note there (the epilogs run after the job's state shows)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((node_dir / f"{n}.h5").exists() or (node_dir / f"{n}.problem.txt").exists() for n in nodes):
            return
        time.sleep(0.3)


def finish(cluster: Cluster, case: str, jobs: list[str], nodes: list[str], outputs: dict[Path, str],
           results: dict[str, str], state_dir: Path) -> FaultOutcome:
    o = FaultOutcome(case)
    bad = not_idle(cluster)
    o.drained = len(bad)
    o.notes += [f"{n}: {s}" for n, s in bad.items()]
    deadline = time.monotonic() + 30
    while dcgm_left(CALLS, state_dir) and time.monotonic() < deadline:
        time.sleep(0.3)  # the last epilog may still be running
    o.paused_left = dcgm_left(CALLS, state_dir)
    o.collectors_left = collectors_left(jobs, list(NODES))
    o.lost_outputs = sum(1 for p, d in outputs.items() if not p.is_file() or digest(p) != d)
    worst = sorted(results.items(), key=lambda kv: (kv[1] == "complete", kv[0]))
    o.result = worst[0][1] if worst[0][1] != "complete" else "complete"
    o.notes += [f"{n}: {r}" for n, r in worst]
    return o


def test_collector_sigkilled(cluster: Cluster, test_user: str, user_tmpdir: Path, hook_config, state_dir: Path) -> None:
    hook_config(_config(cluster, state_dir))
    job = cluster.sbatch(["-N2", "--profile-gpu", "--wrap", "echo out; sleep 8"], user=test_user, cwd=user_tmpdir)
    pid = wait_collector(state_dir, job, "node1")
    time.sleep(2)
    os.kill(pid, signal.SIGKILL)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    out = user_tmpdir / f"slurm-{job}.out"
    node_dir = user_tmpdir / f"slurm-{job}.gpuprof.d"
    wait_placed(node_dir, ["node1", "node2"])
    results = {n: node_result(node_dir, n) for n in ("node1", "node2")}
    assert results["node1"].startswith("partial: ") and results["node2"] == "complete", results
    o = finish(cluster, "slurm:collector_sigkilled", [job], ["node1", "node2"], {out: digest(out)}, results, state_dir)
    assert out.read_text() == "out\n"
    o.check()


def _slurmd_pid(cluster: Cluster, node: str) -> int | None:
    for line in subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout.splitlines():
        pid, _, args = line.strip().partition(" ")
        if args.split()[:1] == ["slurmd"] and f"-N {node}" in args and str(cluster.conf) in args:
            return int(pid)
    return None


def _start_slurmd(cluster: Cluster, node: str) -> None:
    """As etc/dev/cluster-up.sh starts it: a plain environment, not the test's (slurmd keeps its
    environment for as long as it runs)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": str(cluster.conf)}
    subprocess.run(["slurmd", "-f", str(cluster.conf), "-N", node], env=env, cwd=cluster.dir / "log", check=True,
                   capture_output=True, timeout=60)


def test_slurmd_restarted_mid_job(cluster: Cluster, test_user: str, user_tmpdir: Path, hook_config,
                                  state_dir: Path) -> None:
    """slurmd of the job's node stops and starts again while the job runs (an upgrade, a crash
    of the daemon alone): the job and its collector go on, and the epilog seals as usual."""
    hook_config(_config(cluster, state_dir))
    job = cluster.sbatch(["-w", "node2", "--profile-gpu", "--wrap", "echo out; sleep 14"], user=test_user,
                         cwd=user_tmpdir)
    wait_collector(state_dir, job, "node2")
    pid = _slurmd_pid(cluster, "node2")
    assert pid is not None, "slurmd of node2 not found"
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _slurmd_pid(cluster, "node2") is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)
    finally:
        if _slurmd_pid(cluster, "node2") is None:
            _start_slurmd(cluster, "node2")
    assert collector_pids(job, "node2"), "the collector must outlive slurmd"
    assert cluster.wait_job(job, timeout=180)["JobState"] == "COMPLETED"
    out = user_tmpdir / f"slurm-{job}.out"
    node_dir = user_tmpdir / f"slurm-{job}.gpuprof.d"
    wait_placed(node_dir, ["node2"])
    results = {"node2": node_result(node_dir, "node2")}
    assert results["node2"] == "complete", results
    o = finish(cluster, "slurm:slurmd_restarted", [job], ["node2"], {out: digest(out)}, results, state_dir)
    assert out.read_text() == "out\n"
    o.check()


@pytest.mark.parametrize("jobs_n", [2, 3])
def test_profiled_jobs_share_a_node(cluster: Cluster, test_user: str, user_tmpdir: Path, hook_config,
                                    state_dir: Path, jobs_n: int) -> None:
    """Overlapping profiled jobs on one node: DCGM stays paused until the last one ends, each job
    gets its own complete node file."""
    hook_config(_config(cluster, state_dir))
    if jobs_n > 2:
        # node3 has 2 CPUs and the partition does not share them: let it, for this test only
        cluster.run(["scontrol", "update", "PartitionName=debug", "OverSubscribe=YES"], check=True)
    try:
        _share_a_node(cluster, test_user, user_tmpdir, state_dir, jobs_n)
    finally:
        if jobs_n > 2:
            cluster.run(["scontrol", "update", "PartitionName=debug", "OverSubscribe=NO"], check=True)


def _share_a_node(cluster: Cluster, test_user: str, user_tmpdir: Path, state_dir: Path, jobs_n: int) -> None:
    gate = user_tmpdir / "gate"
    jobs: list[str] = []
    try:
        for k in range(jobs_n):
            # all but the last wait for the gate, so the last surely ends while the others run
            body = f"echo out{k}; " + ("sleep 2" if k == jobs_n - 1 else f"while [ ! -e {gate} ]; do sleep 0.3; done")
            jobs.append(cluster.sbatch(["-w", "node3", "--oversubscribe", "--profile-gpu=metrics", "--wrap", body],
                                       user=test_user, cwd=user_tmpdir))
            wait_collector(state_dir, jobs[-1], "node3")
        assert cluster.wait_job(jobs[-1])["JobState"] == "COMPLETED"
        assert all(cluster.job_info(j)["JobState"] == "RUNNING" for j in jobs[:-1])
        calls = CALLS.read_text().splitlines()
        assert calls == ["profile --pause"], f"DCGM resumed while a profiled job runs: {calls}"
    finally:
        gate.touch()  # whatever failed, the waiting jobs end
    for j in jobs:
        assert cluster.wait_job(j)["JobState"] == "COMPLETED"
    outputs, results = {}, {}
    for j in jobs:
        out = user_tmpdir / f"slurm-{j}.out"
        outputs[out] = digest(out)
        node_dir = user_tmpdir / f"slurm-{j}.gpuprof.d"
        wait_placed(node_dir, ["node3"])
        results[f"{j}@node3"] = node_result(node_dir, "node3")
    assert set(results.values()) == {"complete"}, results
    o = finish(cluster, f"slurm:{jobs_n}_jobs_share_a_node", jobs, ["node3"], outputs, results, state_dir)
    assert CALLS.read_text().splitlines() == ["profile --pause", "profile --resume"]
    o.check()


def test_state_dir_full(cluster: Cluster, test_user: str, user_tmpdir: Path, hook_config, tmp_path: Path) -> None:
    """The hand-tried case of issue 11 through Slurm: the state directory on a full 64 kB file
    system. The job runs and completes unprofiled, no collector is left, DCGM is not left paused,
    and next to the job's output a note per node says why."""
    state = Path("/run") / f"gpuprof-fault-state-{os.getpid()}"
    mount_tmpfs(state, "64k")
    try:
        fill(state)
        hook_config(_config(cluster, state))
        job = cluster.sbatch(["-N2", "--profile-gpu", "--wrap", "echo out; sleep 3"], user=test_user, cwd=user_tmpdir)
        assert cluster.wait_job(job)["JobState"] == "COMPLETED"
        out = user_tmpdir / f"slurm-{job}.out"
        node_dir = user_tmpdir / f"slurm-{job}.gpuprof.d"
        wait_placed(node_dir, ["node1", "node2"])
        results = {n: node_result(node_dir, n) for n in ("node1", "node2")}
        assert all(r.startswith("missing: ") and "full" in r for r in results.values()), results
        o = finish(cluster, "slurm:state_dir_full", [job], ["node1", "node2"], {out: digest(out)}, results, state)
        assert out.read_text() == "out\n"
        o.check()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)
        shutil.rmtree(state, ignore_errors=True)


def test_output_dir_full(cluster: Cluster, test_user: str, hook_config, state_dir: Path) -> None:
    """The job's output directory fills while it runs: what the job wrote stays, the node files
    are kept for root (state_dir/undelivered), nothing is left running or paused."""
    pw = pwd.getpwnam(test_user)
    disk = Path("/tmp") / f"gpuprof-fault-out-{os.getpid()}"
    mount_tmpfs(disk, "512k", owner=pw)
    try:
        hook_config(_config(cluster, state_dir))
        job = cluster.sbatch(["-N1", "--profile-gpu=metrics", "--wrap", "echo out; sleep 8"], user=test_user,
                             cwd=disk)
        wait_collector(state_dir, job, "node1")
        time.sleep(1)
        out = disk / f"slurm-{job}.out"
        fill(disk)
        assert cluster.wait_job(job)["JobState"] == "COMPLETED"
        kept = state_dir / "undelivered" / f"{job}@node1.h5"
        deadline = time.monotonic() + 30
        while not kept.exists() and time.monotonic() < deadline:
            time.sleep(0.3)
        assert kept.is_file(), "the node file was neither delivered nor kept"
        results = {"node1": f"missing: output directory full; node file kept at {kept}"}
        o = finish(cluster, "slurm:output_dir_full", [job], ["node1"], {}, results, state_dir)
        o.lost_outputs = int(out.read_text() != "out\n")
        kept.unlink()
        o.check()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
        shutil.rmtree(disk, ignore_errors=True)


def test_output_dir_removed_mid_job(cluster: Cluster, test_user: str, user_tmpdir: Path, hook_config,
                                    state_dir: Path) -> None:
    """The directory of the job's stdout is removed while the job runs: the node file goes to the
    job's working directory with a note saying why; the job's own results there are intact."""
    hook_config(_config(cluster, state_dir))
    outdir = user_tmpdir / "out"
    cluster.run(["mkdir", str(outdir)], user=test_user, check=True)
    job = cluster.sbatch(["-N1", "--profile-gpu=metrics", "-o", f"{outdir}/run.out", "--wrap",
                          f"echo result > {user_tmpdir}/result.dat; sleep 8"], user=test_user, cwd=user_tmpdir)
    wait_collector(state_dir, job, "node1")
    time.sleep(1)
    cluster.run(["rm", "-rf", str(outdir)], user=test_user, check=True)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    node_dir = user_tmpdir / "run.gpuprof.d"
    wait_placed(node_dir, ["node1"])
    results = {"node1": node_result(node_dir, "node1")}
    assert results["node1"].startswith("partial: ") and "working directory" in results["node1"], results
    result = user_tmpdir / "result.dat"
    o = finish(cluster, "slurm:output_dir_removed", [job], ["node1"], {result: digest(result)}, results, state_dir)
    assert result.read_text() == "result\n"
    o.check()


def test_clock_stepped_on_one_node() -> None:
    pytest.skip("not feasible here: node1..node4 are virtual nodes of one host sharing one kernel clock, and a "
                "time namespace cannot move CLOCK_REALTIME; stepping it would step every node and this VM. "
                "The merge's handling of a stepped node clock is tested on a real recording whose clock pairs "
                "are stepped (tests/test_real_recordings.py::test_wall_clock_stepped_on_one_node_mid_job).")


def test_node_crash_through_slurm() -> None:
    pytest.skip("in CI at the hook level (tests/test_hook_faults.py::test_node_crash_epilog_never_runs): through "
                "Slurm a crashed node stays COMPLETING until SlurmdTimeout (300 s here) and comes back DOWN, "
                "which needs an operator's resume")
