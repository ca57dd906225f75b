"""The Slurm suite end to end on the local cluster, through real sbatch: prolog starts a collector on
every node, the epilog seals and places node files as the job's user, DCGM is paused exactly while
profiled jobs run, and no failure of ours drains a node or fails a job."""

from __future__ import annotations

import json
import os
import pwd
import signal
import time
from pathlib import Path

import h5py
import pytest
from conftest import NODES, Cluster

from gpuprof.collector.reader import open_node_trace

pytestmark = pytest.mark.slurm
FAKE_DCGMI = Path(__file__).parent / "doubles" / "fake_dcgmi"


def base_config(cluster: Cluster, calls: Path, extra: str = "") -> str:
    return (
        f'[paths]\nstate_dir = "{cluster.dir}/state/gpuprof"\nlog_file = "{cluster.dir}/log/gpuprof-hooks.log"\n'
        f'[dcgm]\ndcgmi = "{FAKE_DCGMI}"\n'
        f"[merge]\nauto = false\n" + extra
    )


def dcgmi_calls(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def assert_nodes_idle(cluster: Cluster) -> None:
    deadline = time.monotonic() + 30
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = cluster.node_states()
        if all(states.get(n) == "idle" for n in NODES):
            return
        time.sleep(0.5)
    raise AssertionError(f"nodes not idle: {states}")


def hooks_log_tail(cluster: Cluster, lines: int = 40) -> str:
    """The end of the hooks' and collectors' log, for an assertion's message."""
    log = cluster.dir / "log" / "gpuprof-hooks.log"
    return "\n" + "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else ""


def wait_files(d: Path, names: list[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((d / n).exists() for n in names):
            return
        time.sleep(0.2)
    raise AssertionError(f"{d}: expected {names}, found {sorted(p.name for p in d.glob('*')) if d.exists() else 'no dir'}")


@pytest.fixture
def fake_dcgmi_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The prolog's environment is Slurm's, not ours: the double logs to its default file then.
    calls = Path("/tmp/gpuprof-fake-dcgmi.calls")
    calls.unlink(missing_ok=True)
    return calls


def test_profiled_job_by_ordinary_user_gets_node_files(cluster: Cluster, test_user: str, user_tmpdir: Path,
                                                       hook_config, fake_dcgmi_log: Path) -> None:
    hook_config(base_config(cluster, fake_dcgmi_log))
    job = cluster.sbatch(["-N4", "--profile-gpu", "--wrap", "sleep 4"], user=test_user, cwd=user_tmpdir)
    info = cluster.wait_job(job)
    assert info["JobState"] == "COMPLETED"
    node_dir = user_tmpdir / f"slurm-{job}.gpuprof.d"
    wait_files(node_dir, [f"{n}.h5" for n in NODES])
    pw = pwd.getpwnam(test_user)
    for n in NODES:
        f = node_dir / f"{n}.h5"
        st = f.stat()
        assert (st.st_uid, st.st_gid) == (pw.pw_uid, pw.pw_gid), f"{f} not owned by {test_user}"
        trace = open_node_trace(f)
        assert trace.sealed and trace.node == n and trace.job_id == job
        assert trace.attrs["modes"] == "metrics,stacks,collectives"
        assert len(trace.table("/clock/pairs")) >= 3  # start, each second, end
        assert len(trace.table("/host/node")) > 0
    assert node_dir.stat().st_uid == pw.pw_uid
    assert dcgmi_calls(fake_dcgmi_log) == ["profile --pause", "profile --resume"]
    # the state directory is cleaned
    assert not list((cluster.dir / "state" / "gpuprof" / "jobs").glob(f"{job}@*"))
    assert_nodes_idle(cluster)


def test_job_without_flag_costs_nothing(cluster: Cluster, user_tmpdir: Path, test_user: str, hook_config,
                                        fake_dcgmi_log: Path) -> None:
    hook_config(base_config(cluster, fake_dcgmi_log))
    job = cluster.sbatch(["-N2", "--wrap", "true"], user=test_user, cwd=user_tmpdir)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    time.sleep(1)
    assert not (user_tmpdir / f"slurm-{job}.gpuprof.d").exists()
    assert dcgmi_calls(fake_dcgmi_log) == []


def test_modes_reach_prolog_and_task_prolog(cluster: Cluster, user_tmpdir: Path, test_user: str, hook_config,
                                            fake_dcgmi_log: Path) -> None:
    hook_config(base_config(cluster, fake_dcgmi_log))
    job = cluster.sbatch(["-N1", "--profile-gpu=collectives,metrics", "--wrap",
                          "srun env | grep -E '^(GPUPROF_|LD_PRELOAD)'"], user=test_user, cwd=user_tmpdir)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    out = (user_tmpdir / f"slurm-{job}.out").read_text()
    assert "GPUPROF_MODES=metrics,collectives" in out
    # the TaskProlog put the collectives fast path into the job (auto = fast path once built)
    assert "libgpuprof_pmpi.so" in out and f"GPUPROF_FASTPATH_JOB={job}" in out
    f = user_tmpdir / f"slurm-{job}.gpuprof.d" / "node1.h5"
    wait_files(f.parent, [f.name])
    assert open_node_trace(f).attrs["modes"] == "metrics,collectives"


def test_collector_killed_mid_job(cluster: Cluster, user_tmpdir: Path, test_user: str, hook_config,
                                  fake_dcgmi_log: Path) -> None:
    hook_config(base_config(cluster, fake_dcgmi_log))
    job = cluster.sbatch(["-N2", "--profile-gpu", "--wrap", "sleep 8"], user=test_user, cwd=user_tmpdir)
    state_root = cluster.dir / "state" / "gpuprof" / "jobs"
    deadline = time.monotonic() + 30
    pid = None
    while time.monotonic() < deadline and pid is None:
        f = state_root / f"{job}@node1" / "state.json"
        if f.exists():
            st = json.loads(f.read_text())
            if st.get("collector_started"):
                pid = st["collector_pid"]
        time.sleep(0.2)
    assert pid, "collector of node1 never recorded"
    time.sleep(3)  # let it flush at least once
    os.kill(pid, signal.SIGKILL)
    info = cluster.wait_job(job)
    assert info["JobState"] == "COMPLETED", "the job must not notice the collector's death"
    node_dir = user_tmpdir / f"slurm-{job}.gpuprof.d"
    wait_files(node_dir, ["node1.h5", "node2.h5"])
    killed = open_node_trace(node_dir / "node1.h5")
    assert not killed.sealed and killed.partial_reasons
    assert len(killed.table("/clock/pairs")) >= 1
    with h5py.File(node_dir / "node1.h5", "r") as f:  # a plain file any HDF5 tool opens
        assert f.attrs["partial_reason"]
    note = node_dir / "node2.problem.txt"
    assert open_node_trace(node_dir / "node2.h5").sealed, (
        note.read_text() if note.exists() else "no node2.problem.txt") + hooks_log_tail(cluster)
    assert dcgmi_calls(fake_dcgmi_log) == ["profile --pause", "profile --resume"]
    assert_nodes_idle(cluster)


def test_two_profiled_jobs_share_a_node(cluster: Cluster, user_tmpdir: Path, test_user: str, hook_config,
                                        fake_dcgmi_log: Path) -> None:
    hook_config(base_config(cluster, fake_dcgmi_log))
    a = cluster.sbatch(["-w", "node3", "--oversubscribe", "--profile-gpu=metrics", "--wrap", "sleep 20"],
                       user=test_user, cwd=user_tmpdir)
    time.sleep(2)
    b = cluster.sbatch(["-w", "node3", "--oversubscribe", "--profile-gpu=metrics", "--wrap", "sleep 1"],
                       user=test_user, cwd=user_tmpdir)
    assert cluster.wait_job(b)["JobState"] == "COMPLETED"
    assert cluster.job_info(a)["JobState"] == "RUNNING", "the test needs a to outlive b"
    # b ended while a still runs: DCGM must still be paused
    assert dcgmi_calls(fake_dcgmi_log) == ["profile --pause"]
    assert cluster.wait_job(a)["JobState"] == "COMPLETED"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(dcgmi_calls(fake_dcgmi_log)) < 2:
        time.sleep(0.2)
    assert dcgmi_calls(fake_dcgmi_log) == ["profile --pause", "profile --resume"]


def test_invalid_config_runs_job_unprofiled(cluster: Cluster, user_tmpdir: Path, test_user: str, hook_config,
                                            fake_dcgmi_log: Path) -> None:
    hook_config("[paths]\nnot_a_key = 1\n")
    job = cluster.sbatch(["-N2", "--profile-gpu", "--wrap", "true"], user=test_user, cwd=user_tmpdir)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    assert_nodes_idle(cluster)
    hook_config("[dcgm\n")  # not TOML
    job = cluster.sbatch(["-N1", "--profile-gpu", "--wrap", "true"], user=test_user, cwd=user_tmpdir)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    assert_nodes_idle(cluster)


def test_collector_that_cannot_start(cluster: Cluster, user_tmpdir: Path, test_user: str, hook_config,
                                     fake_dcgmi_log: Path) -> None:
    hook_config(base_config(cluster, fake_dcgmi_log, '[hooks]\ncollector_python = "/nonexistent/python"\n'))
    job = cluster.sbatch(["-N2", "--profile-gpu", "--wrap", "true"], user=test_user, cwd=user_tmpdir)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    assert_nodes_idle(cluster)
    assert dcgmi_calls(fake_dcgmi_log) == ["profile --pause", "profile --resume"]
    log = (cluster.dir / "log" / "gpuprof-hooks.log").read_text()
    assert f"job={job}" in log and "collector" in log


def test_stdout_dir_symlinked_to_root_place(cluster: Cluster, user_tmpdir: Path, test_user: str, hook_config,
                                            fake_dcgmi_log: Path, tmp_path: Path) -> None:
    hook_config(base_config(cluster, fake_dcgmi_log))
    root_place = Path("/tmp") / f"gpuprof-rootonly-{os.getpid()}"
    root_place.mkdir(mode=0o755, exist_ok=True)
    try:
        # The job's stdout goes to a user-writable dir; the node-file dir name is a symlink the user
        # planted, pointing at a root-owned place.
        (user_tmpdir / "out").mkdir()
        os.chown(user_tmpdir / "out", pwd.getpwnam(test_user).pw_uid, -1)
        job = cluster.sbatch(["-N1", "--profile-gpu", "-o", f"{user_tmpdir}/out/run.log", "--wrap", "sleep 2"],
                             user=test_user, cwd=user_tmpdir)
        (user_tmpdir / "out" / "run.gpuprof.d").symlink_to(root_place)
        assert cluster.wait_job(job)["JobState"] == "COMPLETED"
        time.sleep(2)
        assert list(root_place.iterdir()) == []
        assert_nodes_idle(cluster)
    finally:
        root_place.rmdir()


def test_fastpath_ring_dir_made_for_the_user_and_removed(cluster: Cluster, user_tmpdir: Path, test_user: str,
                                                         hook_config, fake_dcgmi_log: Path) -> None:
    """The prolog makes /dev/shm/gpuprof-<job>@<node> as root for the job's user (0700), the
    TaskProlog points the interposers at it, the epilog removes it (docs/probes.md)."""
    hook_config(base_config(cluster, fake_dcgmi_log))
    job = cluster.sbatch(["-N1", "--profile-gpu=collectives", "--wrap",
                          'srun sh -c \'echo "DIR=$GPUPROF_FASTPATH_DIR"; stat -c "%U %a %F" "$GPUPROF_FASTPATH_DIR"\''],
                         user=test_user, cwd=user_tmpdir)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    out = (user_tmpdir / f"slurm-{job}.out").read_text()
    assert f"DIR=/dev/shm/gpuprof-{job}@node1" in out
    assert f"{test_user} 700 directory" in out
    f = user_tmpdir / f"slurm-{job}.gpuprof.d" / "node1.h5"
    wait_files(f.parent, [f.name])
    with h5py.File(f, "r") as h:
        fastpath = json.loads(h.attrs["fastpath_json"])
    assert fastpath["dir"] == f"/dev/shm/gpuprof-{job}@node1" and fastpath["dir_problem"] == ""
    assert fastpath["refused"] == 0 and fastpath["create_failed"] == 0
    assert not Path(f"/dev/shm/gpuprof-{job}@node1").exists()
    assert_nodes_idle(cluster)


@pytest.mark.bpf
@pytest.mark.parametrize("slow_s, budget_s, late", [(1.5, 10, False), (4, 1, True)])
def test_prolog_waits_for_probes_or_marks_them_late(cluster: Cluster, user_tmpdir: Path, test_user: str,
                                                    hook_config, fake_dcgmi_log: Path, slow_s: float,
                                                    budget_s: float, late: bool) -> None:
    """collector.test_slow_attach_s (a test hook) delays every source's start: within
    hooks.attach_timeout_s the prolog waits and the job starts with its probes in place; past it
    the job starts anyway and the node file names the late sources."""
    hook_config(base_config(cluster, fake_dcgmi_log,
                            f"[hooks]\nattach_timeout_s = {budget_s}\n[collector]\ntest_slow_attach_s = {slow_s}\n"))
    job = cluster.sbatch(["-N1", "--profile-gpu=stacks", "--wrap", "sleep 6"], user=test_user, cwd=user_tmpdir)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    f = user_tmpdir / f"slurm-{job}.gpuprof.d" / "node1.h5"
    wait_files(f.parent, [f.name])
    with h5py.File(f, "r") as h:
        late_sources = json.loads(h.attrs["late_sources"])
        attach = json.loads(h.attrs["attach_json"])
    if attach["stacks"]["state"] != "attached":
        pytest.skip(f"BPF unavailable on the nodes: {attach['stacks']}")
    if late:
        assert {"stacks", "offcpu"} <= set(late_sources), attach
        assert attach["stacks"]["late_by_s"] > 0
        log = (cluster.dir / "log" / "gpuprof-hooks.log").read_text()
        assert f"job={job} node=node1: sources" in log and "not attached within" in log
    else:
        assert late_sources == [], attach


def test_a_node_with_a_continuous_collector_starts_none_for_the_job(cluster: Cluster, user_tmpdir: Path,
                                                                    test_user: str, hook_config, fake_dcgmi_log: Path,
                                                                    tmp_path: Path) -> None:
    """node1 runs the always-on collector (docs/continuous.md): the prolog hands it the job instead of
    starting a second collector and sets up no fast path, the epilog gets the job's node file from
    it and places it like any other; node2, without one, starts its own."""
    import subprocess
    import sys

    run = Path("/tmp") / f"gpuprof-cont-{os.getpid()}"
    run.mkdir(mode=0o755)
    sock = run / "node1.sock"
    conf = run / "continuous.toml"
    conf.write_text(f'[collector]\nflush_interval_s = 1.0\n[continuous]\nsocket = "{run}/{{node}}.sock"\n'
                    f'spill_dir = "{run}/spill"\nexport_dir = "{run}/exports"\nsegment_s = 1.0\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUPROF_"))}
    env["GPUPROF_NVML_LIBRARY"] = "/nonexistent/libnvidia-ml.so.1"  # no GPU here
    collector = subprocess.Popen([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "--config", str(conf), "collect",
                                  "--continuous", "--node", "node1"], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert collector.poll() is None and time.monotonic() < deadline, collector.communicate()[1][-2000:]
            time.sleep(0.2)
        hook_config(base_config(cluster, fake_dcgmi_log, f'[continuous]\nsocket = "{run}/{{node}}.sock"\n'))
        job = cluster.sbatch(["-N2", "--profile-gpu", "--wrap", "srun sh -c 'env | grep -c GPUPROF_FASTPATH; sleep 6'"],
                             user=test_user, cwd=user_tmpdir)
        state_root = cluster.dir / "state" / "gpuprof" / "jobs"
        seen: dict[str, dict] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(seen) < 2:
            for n in ("node1", "node2"):
                f = state_root / f"{job}@{n}" / "state.json"
                if f.exists() and n not in seen:
                    st = json.loads(f.read_text())
                    if st.get("collector_started"):
                        seen[n] = st
            time.sleep(0.2)
        assert seen["node1"]["continuous_socket"] == str(sock) and seen["node1"]["collector_pid"] is None
        assert seen["node2"]["continuous_socket"] == "" and seen["node2"]["collector_pid"]
        assert cluster.wait_job(job)["JobState"] == "COMPLETED"
        node_dir = user_tmpdir / f"slurm-{job}.gpuprof.d"
        wait_files(node_dir, ["node1.h5", "node2.h5"])
        from_continuous = open_node_trace(node_dir / "node1.h5")
        assert from_continuous.sealed and from_continuous.attrs["modes"] == "metrics"  # the collector's modes
        assert (node_dir / "node1.h5").stat().st_uid == pwd.getpwnam(test_user).pw_uid
        # node2's tasks got the fast path, node1's none (nothing there drains rings)
        counts = (user_tmpdir / f"slurm-{job}.out").read_text().split()
        assert sorted(counts) == ["0", "2"], counts
    finally:
        collector.terminate()
        collector.wait(timeout=30)
        import shutil

        shutil.rmtree(run, ignore_errors=True)


def test_status_asks_the_running_collectors(cluster: Cluster, user_tmpdir: Path, test_user: str, hook_config,
                                            fake_dcgmi_log: Path) -> None:
    """`gpuprof status JOB` (root, on the host): each node's collector of the job says what it has
    recorded so far; an ordinary user is told it is root's; after the job, nothing answers."""
    import subprocess
    import sys

    hook_config(base_config(cluster, fake_dcgmi_log))
    job = cluster.sbatch(["-N2", "--profile-gpu=metrics,collectives", "--wrap", "sleep 8"], user=test_user,
                         cwd=user_tmpdir)
    state_root = cluster.dir / "state" / "gpuprof" / "jobs"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            (state_root / f"{job}@{n}" / "state.json").exists()
            and json.loads((state_root / f"{job}@{n}" / "state.json").read_text()).get("collector_started")
            for n in ("node1", "node2")):
        time.sleep(0.2)
    time.sleep(2)  # a flush: rows to count
    cmd = [sys.executable, "-m", "gpuprof.slurm_hooks.cli", "--config", str(cluster.dir / "gpuprof.toml"), "status", job]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["node1", "node2"], r.stdout
    assert all("recording" in ln and "/clock/pairs" in ln for ln in lines), r.stdout
    assert "nvml: unavailable: NVML not available" in lines[0]  # its errors, as phrases (no GPU here)
    as_user = subprocess.run(["runuser", "-u", test_user, "--", *cmd], capture_output=True, text=True, timeout=60,
                             check=False, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert as_user.returncode == 2 and "root only" in as_user.stderr
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    deadline = time.monotonic() + 30  # the epilogs remove the job's state as they end
    while True:
        after = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if after.returncode == 1 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert after.returncode == 1 and "no collector of job" in after.stderr, after.stdout + after.stderr
