"""Faults of the node side without a cluster: the real `gpuprof prolog` and `gpuprof epilog` run as
slurmd runs them (as root, in a Slurm hook environment) against a state directory and output
directories on small tmpfs mounts, with Slurm's `scontrol` replaced by a double that answers from
files (a job runs, or Slurm forgot it) and the DCGM double (tests/doubles/fake_dcgmi).

Each case ends with tests/faultcheck.py's checks: every hook exited 0, no DCGM pause left, no
collector left, the job's own output intact, the node's result complete or partial with the reason
where the user looks. The cases that need slurmd itself (restarts, jobs sharing a node) are in
tests/test_faults.py.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultcheck import (
    FaultOutcome,
    collectors_left,
    dcgm_left,
    digest,
    fill,
    mount_quota,
    mount_tmpfs,
    node_result,
)

from gpuprof.collector.control import request
from gpuprof.collector.errors import GpuprofError
from gpuprof.slurm_hooks.hooks import collector_pids

REPO = Path(__file__).resolve().parents[1]
FAKE_DCGMI = REPO / "tests" / "doubles" / "fake_dcgmi"
TEST_USER = "gpuprof-test"
FAKE_SCONTROL = """#!/bin/sh
# scontrol double: `show job -o ID` prints $FAKE_SLURM_JOBS/ID (absent: Slurm forgot the job),
# `show hostnames LIST` splits a plain comma list, anything else fails like an unreachable slurmd.
case "$1 $2" in
"show job")
    f="$FAKE_SLURM_JOBS/$4"
    if [ -s "$f" ]; then cat "$f"; exit 0; fi
    echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;
"show hostnames") echo "$3" | tr ',' '\\n'; exit 0;;
*) echo "fake scontrol: $*: unsupported" >&2; exit 1;;
esac
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts tmpfs, hooks drop to the job's user)")


def _user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(TEST_USER)
    except KeyError:
        pytest.skip(f"user {TEST_USER} missing: run `make setup`")


class Node:
    """One node's hooks for jobs of the test user, under tmp."""

    def __init__(self, tmp: Path, state_dir: Path, name: str = "nodeA") -> None:
        self.tmp, self.state_dir, self.name = tmp, state_dir, name
        self.user = _user()
        self.bin = tmp / "bin"
        self.bin.mkdir(exist_ok=True)
        (self.bin / "scontrol").write_text(FAKE_SCONTROL)
        (self.bin / "scontrol").chmod(0o755)
        self.jobs_dir = tmp / "slurm-jobs"
        self.jobs_dir.mkdir(exist_ok=True)
        self.calls = tmp / "dcgmi.calls"
        self.log = tmp / "hooks.log"
        self.config = tmp / "gpuprof.toml"
        self.config.write_text(
            f'[paths]\nstate_dir = "{state_dir}"\nlog_file = "{self.log}"\n'
            f'[dcgm]\ndcgmi = "{FAKE_DCGMI}"\n[merge]\nauto = false\n'
            # generous under load (the suite shares 2 cores with the cluster); the checks are not timed
            "[hooks]\ncollector_ready_timeout_s = 30.0\nseal_timeout_s = 30.0\n"
            "[collector]\njob_check_interval_s = 0.5\nflush_interval_s = 1.0\n")
        self.exits: list[int] = []
        self.jobs: list[str] = []

    def work_dir(self, job: str, parent: Path | None = None) -> Path:
        w = (parent or self.tmp) / f"work-{job}"
        w.mkdir(mode=0o755)
        os.chown(w, self.user.pw_uid, self.user.pw_gid)
        return w

    def submit(self, work: Path, stdout: Path | None = None, nodes: str = "") -> str:
        """A job Slurm knows as RUNNING, with its own output file written (as the user)."""
        job = str(900000 + uuid.uuid4().int % 99999)
        out = stdout or work / f"slurm-{job}.out"
        (self.jobs_dir / job).write_text(
            f"JobId={job} JobName=wrap UserId={self.user.pw_name}({self.user.pw_uid}) "
            f"GroupId={self.user.pw_name}({self.user.pw_gid}) JobState=RUNNING NodeList={nodes or self.name} "
            f"WorkDir={work} StdOut={out}\n")
        subprocess.run(["runuser", "-u", self.user.pw_name, "--", "sh", "-c", f"echo result of {job} > '{out}'"],
                       check=True)
        self.jobs.append(job)
        self.stdout = out
        return job

    def forget(self, job: str) -> None:
        """Slurm no longer knows the job (it ended long ago, or its record is gone)."""
        (self.jobs_dir / job).unlink(missing_ok=True)

    def env(self, job: str, work: Path, nodes: str = "", node: str | None = None) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SPANK", "GPUPROF_"))}
        e.update(
            PATH=f"{self.bin}:{REPO / '.venv' / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin", GPUPROF_CONFIG=str(self.config),
            FAKE_DCGMI_LOG=str(self.calls), FAKE_SLURM_JOBS=str(self.jobs_dir),
            SLURM_JOB_ID=job, SLURM_JOB_UID=str(self.user.pw_uid), SLURM_JOB_GID=str(self.user.pw_gid),
            SLURM_JOB_USER=self.user.pw_name, SLURMD_NODENAME=node or self.name, SLURM_JOB_WORK_DIR=str(work),
            SLURM_JOB_STDOUT=str(self.stdout), SLURM_JOB_NODELIST=nodes or self.name,
            SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu="metrics",
        )
        return e

    def hook(self, which: str, job: str, work: Path, nodes: str = "", node: str | None = None) -> None:
        p = subprocess.run([sys.executable, "-m", "gpuprof.slurm_hooks.cli", which],
                           env=self.env(job, work, nodes, node), capture_output=True, text=True, timeout=120,
                           check=False)
        self.exits.append(p.returncode)

    def job_state_dir(self, job: str, node: str | None = None) -> Path:
        return self.state_dir / "jobs" / f"{job}@{node or self.name}"

    def wait_recording(self, job: str, node: str | None = None, timeout: float = 30) -> None:
        sock = self.job_state_dir(job, node) / "control.sock"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if request(sock, "status", 2.0)["state"] == "recording":
                    return
            except GpuprofError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"collector of {job} not recording; log:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def outcome(self, case: str, job_outputs: dict[Path, str], node_dir: Path | None, nodes: list[str] | None = None,
                result: str | None = None) -> FaultOutcome:
        o = FaultOutcome(case)
        o.drained = sum(1 for rc in self.exits if rc != 0)
        o.paused_left = dcgm_left(self.calls, self.state_dir) if self.state_dir.is_dir() else 0
        o.collectors_left = collectors_left(self.jobs, nodes or [self.name])
        o.lost_outputs = sum(1 for p, d in job_outputs.items() if not p.is_file() or digest(p) != d)
        o.result = result if result is not None else (node_result(node_dir, self.name) if node_dir else "")
        return o

    def stop_all(self) -> None:
        for job in self.jobs:
            for node in ("nodeA", "nodeB", self.name):
                for pid in collector_pids(job, node):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory the job's user can reach (pytest's tmp_path is root-only), removed after."""
    d = Path(tempfile.mkdtemp(prefix="gpuprof-faults-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for m in reversed(made):
        subprocess.run(["umount", "-l", str(m)], check=False)


@pytest.fixture
def node(base: Path) -> Iterator[Node]:
    n = Node(base, base / "state")
    yield n
    n.stop_all()


def test_state_dir_full_before_the_job(base: Path, mounts: list[Path]) -> None:
    """The hand-tried case of issue 11: a 60 kB state directory. The job runs unprofiled, no
    collector is left, DCGM is not left paused, and next to the job output a note says why."""
    state = base / "state"
    mount_tmpfs(state, "64k")
    mounts.append(state)
    n = Node(base, state)
    try:
        fill(state)
        w = n.work_dir("a")
        job = n.submit(w)
        out_digest = digest(n.stdout)
        n.hook("prolog", job, w)
        assert collector_pids(job, n.name) == [], "a collector was left running by the prolog"
        n.hook("epilog", job, w)
        node_dir = w / f"slurm-{job}.gpuprof.d"
        o = n.outcome("node:state_dir_full_before_job", {n.stdout: out_digest}, node_dir)
        assert o.result.startswith("missing: ") and "full" in o.result, (o.result, n.log_text()[-3000:])
        o.check()
    finally:
        n.stop_all()


def test_state_dir_fills_during_the_job(base: Path, mounts: list[Path]) -> None:
    """The node file stops at ENOSPC; what was flushed before reaches the user, marked partial
    with the reason, and the collector (kept up to tell the epilog why) is gone after the epilog."""
    state = base / "state"
    mount_tmpfs(state, "2m")
    mounts.append(state)
    n = Node(base, state)
    try:
        w = n.work_dir("a")
        job = n.submit(w)
        out_digest = digest(n.stdout)
        n.hook("prolog", job, w)
        n.wait_recording(job)
        sock = n.job_state_dir(job) / "control.sock"
        flushed = request(sock, "flush", 30.0)["records"]
        assert flushed.get("/clock/pairs", 0) >= 1
        fill(state)
        deadline = time.monotonic() + 30
        while request(sock, "status", 5.0)["state"] != "error" and time.monotonic() < deadline:
            time.sleep(0.2)
        n.hook("epilog", job, w)
        node_dir = w / f"slurm-{job}.gpuprof.d"
        o = n.outcome("node:state_dir_fills_mid_job", {n.stdout: out_digest}, node_dir)
        assert o.result.startswith("partial: ") and "ENOSPC" in o.result, (o.result, n.log_text()[-3000:])
        assert (node_dir / f"{n.name}.h5").stat().st_uid == n.user.pw_uid
        o.check()
    finally:
        n.stop_all()


def test_prolog_state_lost_epilog_still_finds_the_collector(node: Node) -> None:
    """state.json unreadable (as a full disk once left it, empty): the epilog finds the collector
    by its fixed socket and command line, seals it, places the file and says what was wrong."""
    w = node.work_dir("a")
    job = node.submit(w)
    out_digest = digest(node.stdout)
    node.hook("prolog", job, w)
    node.wait_recording(job)
    (node.job_state_dir(job) / "state.json").write_text("")
    node.hook("epilog", job, w)
    node_dir = w / f"slurm-{job}.gpuprof.d"
    o = node.outcome("node:prolog_state_lost", {node.stdout: out_digest}, node_dir)
    assert o.result.startswith("partial: ") and "unreadable" in o.result, o.result
    from gpuprof.collector.reader import open_node_trace

    assert open_node_trace(node_dir / f"{node.name}.h5").sealed  # sealed by the fallback, not recovered
    o.check()


def test_the_prolog_writes_the_task_plan_the_epilog_removes_it(node: Node) -> None:
    """The job's task plan, which the TaskProlog reads in shell at every task: written by the
    prolog for the job's user alone, read by etc/task-prolog as that user, removed by the epilog."""
    from gpuprof.collector.fastpath_env import task_plan_path

    w = node.work_dir("a")
    job = node.submit(w)
    node.hook("prolog", job, w)
    plan = task_plan_path(job, node.name)
    try:
        st = plan.stat()
        assert st.st_uid == node.user.pw_uid and st.st_mode & 0o777 == 0o400, node.log_text()[-2000:]
        task_env = {k: v for k, v in node.env(job, w).items() if k != "GPUPROF_CONFIG"}
        r = subprocess.run(["runuser", "-u", node.user.pw_name, "--", "/bin/sh", str(REPO / "etc" / "task-prolog")],
                           env={**task_env, "GPUPROF_PYTHON": "/nonexistent"}, capture_output=True, text=True,
                           timeout=30, check=True)
        assert r.stdout.splitlines() == ["export GPUPROF_MODES=metrics"]
    finally:
        node.hook("epilog", job, w)
    assert not plan.exists() and node.exits == [0, 0]


def test_collector_sealed_before_the_epilog_is_placed_whole(node: Node) -> None:
    """The collector sealed and exited before its epilog asked (it stopped by itself, or sealed for
    a seal request whose answer was lost): its control socket is gone, but its file is sealed,
    and the epilog places it whole instead of "recovering" it as partial."""
    w = node.work_dir("a")
    job = node.submit(w)
    out_digest = digest(node.stdout)
    node.hook("prolog", job, w)
    node.wait_recording(job)
    assert request(node.job_state_dir(job) / "control.sock", "seal", 30.0)["sealed"]
    collectors_left([job], [node.name], wait_s=30)
    node.hook("epilog", job, w)
    node_dir = w / f"slurm-{job}.gpuprof.d"
    from gpuprof.collector.reader import open_node_trace

    assert open_node_trace(node_dir / f"{node.name}.h5").sealed, node.log_text()[-3000:]
    o = node.outcome("node:collector_sealed_before_epilog", {node.stdout: out_digest}, node_dir)
    assert "the file is complete" in o.result, o.result
    o.check()


def test_node_crash_epilog_never_runs(node: Node, base: Path) -> None:
    """Node B's collector is killed and its epilog never runs (a crash); node A ends normally.
    The next job's prolog on B (its watchdog) drops the dead holder and resumes DCGM once that job
    ends, the orphaned state is cleaned and its node file kept for root, and the merge of what
    reached the user names B as expected but missing."""
    w = node.work_dir("a")
    job = node.submit(w, nodes="nodeA,nodeB")
    out, out_digest = node.stdout, digest(node.stdout)
    for nd in ("nodeA", "nodeB"):
        node.hook("prolog", job, w, nodes="nodeA,nodeB", node=nd)
    node.wait_recording(job, "nodeA")
    node.wait_recording(job, "nodeB")
    request(node.job_state_dir(job, "nodeB") / "control.sock", "flush", 30.0)
    for pid in collector_pids(job, "nodeB"):
        os.kill(pid, signal.SIGKILL)
    node.hook("epilog", job, w, nodes="nodeA,nodeB", node="nodeA")
    node.forget(job)  # the job is long over; B's epilog never came
    w2 = node.work_dir("b")
    job2 = node.submit(w2, nodes="nodeB")
    node.hook("prolog", job2, w2, node="nodeB")
    node.hook("epilog", job2, w2, node="nodeB")
    assert not node.job_state_dir(job, "nodeB").exists(), "the crashed job's state was not cleaned"
    assert (node.state_dir / "undelivered" / f"{job}@nodeB.h5").is_file()
    node_dir = w / f"slurm-{job}.gpuprof.d"
    merged = subprocess.run([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "merge", str(node_dir)],
                            capture_output=True, text=True, timeout=300, cwd=base, check=False,
                            env={**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"})
    report = [p for p in node_dir.parent.glob(f"slurm-{job}.gpuprof.txt")]
    text = report[0].read_text() if report else merged.stdout + merged.stderr
    assert "nodeB" in text and "no node file" in text, text[-3000:]
    o = node.outcome("node:node_crash_no_epilog", {out: out_digest}, None, nodes=["nodeA", "nodeB"],
                     result="partial: merge of nodeA; nodeB expected, no node file (epilog never ran)")
    o.check()


def test_collector_stops_by_itself_when_no_epilog_comes(node: Node) -> None:
    """slurmd was down when the job ended: no epilog, but the collector is alive. Once Slurm no
    longer knows the job it seals and stops on its own; the next hook keeps its file for root."""
    w = node.work_dir("a")
    job = node.submit(w)
    out, out_digest = node.stdout, digest(node.stdout)
    node.hook("prolog", job, w)
    node.wait_recording(job)
    node.forget(job)
    collectors_left([job], [node.name], wait_s=30)  # it stops by itself (the checks back off to 4 s here)
    o = node.outcome("node:collector_orphaned", {out: out_digest}, None)
    w2 = node.work_dir("b")
    job2 = node.submit(w2)
    node.hook("prolog", job2, w2)
    node.hook("epilog", job2, w2)
    assert (node.state_dir / "undelivered" / f"{job}@{node.name}.h5").is_file()
    from gpuprof.collector.reader import open_node_trace

    kept = open_node_trace(node.state_dir / "undelivered" / f"{job}@{node.name}.h5")
    assert kept.sealed
    o.paused_left = dcgm_left(node.calls, node.state_dir)
    o.result = "missing: epilog never ran; node file sealed by the collector itself and kept by root"
    o.check()


def _job_ends_with_no_room(node: Node, disk: Path) -> tuple[Path, str]:
    """A job whose output directory is on `disk`, which fills up between its prolog and its
    epilog: the node file the epilog kept for root (asserted to exist) and the digest of the job's
    own output before."""
    w = node.work_dir("a", parent=disk)
    job = node.submit(w)
    out_digest = digest(node.stdout)
    node.hook("prolog", job, w)
    node.wait_recording(job)
    fill(disk)
    node.hook("epilog", job, w)
    kept = node.state_dir / "undelivered" / f"{job}@{node.name}.h5"
    assert kept.is_file(), node.log_text()[-3000:]
    return kept, out_digest


def test_output_dir_full(node: Node, mounts: list[Path], base: Path) -> None:
    """The job's output directory fills up: the job's own output stays as it was, the node file
    is kept for root (state_dir/undelivered) and the hook log says so."""
    disk = base / "disk"
    mount_tmpfs(disk, "256k", owner=node.user)
    mounts.append(disk)
    kept, out_digest = _job_ends_with_no_room(node, disk)
    assert "not delivered" in node.log_text() and str(kept) in node.log_text()
    o = node.outcome("node:output_dir_full", {node.stdout: out_digest}, None,
                     result=f"missing: output directory full; node file kept at {kept}")
    o.check()


@pytest.mark.skipif(shutil.which("mkfs.btrfs") is None, reason="needs btrfs-progs (etc/dev/setup.sh installs it)")
def test_output_dir_over_quota(node: Node, mounts: list[Path], base: Path) -> None:
    """The job's output directory is over its quota (EDQUOT, not ENOSPC: the file system has room,
    the user has none): as when it is full, the job's own output stays as it was, the node file is
    kept for root and the hook log says so, with the reason."""
    disk = base / "quota"
    try:
        quota = mount_quota(disk, "512k", node.user)
    except subprocess.CalledProcessError as e:  # a machine without loop devices or btrfs quotas
        pytest.skip(f"no quota here: {' '.join(e.cmd)}: {(e.stderr or b'').decode(errors='replace')[-200:]}")
    mounts.append(disk)
    kept, out_digest = _job_ends_with_no_room(node, quota)  # a quota group limits root too
    log = node.log_text()
    assert "not delivered" in log and str(kept) in log and "quota" in log.lower(), log[-3000:]
    o = node.outcome("node:output_dir_over_quota", {node.stdout: out_digest}, None,
                     result=f"missing: output directory over its quota; node file kept at {kept}")
    o.check()


def test_output_dir_removed_mid_job(node: Node) -> None:
    """The directory of the job's stdout is removed while the job runs: the node file goes to the
    job's working directory instead, with a note saying why; the job's other output is intact."""
    w = node.work_dir("a")
    outdir = w / "out"
    outdir.mkdir()
    os.chown(outdir, node.user.pw_uid, node.user.pw_gid)
    keep = w / "result.dat"
    keep.write_text("the job's own result\n")
    job = node.submit(w, stdout=outdir / "run.out")
    out_digest = digest(keep)
    node.hook("prolog", job, w)
    node.wait_recording(job)
    shutil.rmtree(outdir)
    node.hook("epilog", job, w)
    node_dir = w / "run.gpuprof.d"
    o = node.outcome("node:output_dir_removed", {keep: out_digest}, node_dir)
    assert o.result.startswith("partial: ") and "working directory" in o.result, (o.result, node.log_text()[-2000:])
    o.check()


def test_results_file_lines_are_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's source of figures: each case's outcome, one JSON object per line."""
    out = tmp_path / "r.jsonl"
    monkeypatch.setenv("GPUPROF_FAULTS_RESULTS", str(out))
    FaultOutcome("x", result="complete").check()
    assert json.loads(out.read_text())["case"] == "x"


def test_undelivered_node_files_are_held_to_their_limit(tmp_path: Path) -> None:
    """A node whose deliveries keep failing (an output file system full for days) keeps root's copies
    within hooks.undelivered_max_mb: the oldest go first, the one just kept never, and what is not a
    node file of root's (a symlink, another file) is left alone."""
    import logging

    from gpuprof.slurm_hooks.hooks import _trim_undelivered

    d = tmp_path / "undelivered"
    d.mkdir()
    mb = 1 << 20
    files = {name: d / f"{name}.h5" for name in ("oldest", "middle", "newest")}
    for i, path in enumerate(files.values()):
        path.write_bytes(b"\0" * 2 * mb)
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    (d / "notes.txt").write_bytes(b"\0" * 3 * mb)
    (d / "link.h5").symlink_to(files["oldest"])
    log = logging.getLogger("test-undelivered")
    _trim_undelivered(d, 5 * mb, files["newest"], log)
    assert sorted(p.name for p in d.iterdir()) == ["link.h5", "middle.h5", "newest.h5", "notes.txt"]
    _trim_undelivered(d, 1 * mb, files["newest"], log)  # below the newest alone: it stays all the same
    assert sorted(p.name for p in d.iterdir()) == ["link.h5", "newest.h5", "notes.txt"]
