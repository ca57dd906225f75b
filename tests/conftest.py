"""Shared pytest fixtures.

Sections are owned by different parts of the suite; add new fixtures in their own section.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# =================================================================================================
# Local Slurm cluster (etc/dev/cluster-up.sh): fixtures `cluster`, `test_user`, `user_tmpdir`.
# =================================================================================================

REPO = Path(__file__).resolve().parent.parent
CLUSTER_DIR = REPO / ".cluster"
TEST_USER = "gpuprof-test"
NODES = ("node1", "node2", "node3", "node4")
# Job states after which nothing more happens to the job.
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)


class SlurmCommandError(RuntimeError):
    """A Slurm client command failed; carries its stderr."""

    def __init__(self, args: Sequence[str], proc: subprocess.CompletedProcess[str]):
        super().__init__(f"{' '.join(args)} -> rc {proc.returncode}\n{proc.stderr.strip()}")
        self.proc = proc


@dataclass
class Cluster:
    """The running local cluster and helpers to use it from tests."""

    repo: Path
    dir: Path
    conf: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def spank_so(self) -> Path:
        return self.repo / "slurm_hooks" / "spank" / "gpuprof_spank.so"

    def run(
        self,
        args: Sequence[str],
        user: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command with the cluster's environment, as root or (user=) as another user."""
        full_env = dict(self.env)
        if env:
            full_env.update(env)
        cmd = list(args)
        if user is not None:
            # runuser keeps no environment we rely on: pass the cluster's explicitly.
            pw = pwd.getpwnam(user)
            full_env.update(HOME=pw.pw_dir, USER=user, LOGNAME=user)
            cmd = ["runuser", "-u", user, "--", "env", *[f"{k}={v}" for k, v in full_env.items()], *cmd]
        proc = subprocess.run(
            cmd, check=False, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise SlurmCommandError(cmd, proc)
        return proc

    def sbatch(
        self,
        args: Sequence[str],
        user: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        """Submit with `sbatch --parsable ARGS`; returns the job id, raises SlurmCommandError.

        A job asking for `-N K` and naming no nodes gets the first K (`-w node[1-K]`): the tests
        read node1's file of a one-node job, and the merge job an earlier test's epilog submitted
        may still hold node1, where Slurm would start this job on node2 instead (a CI run failed
        so: node1.h5 missing). Pinned, the job waits for the merge to end."""
        args = list(args)
        count = next((int(a[2:]) for a in args if re.fullmatch(r"-N\d+", a)), None)
        if count is not None and not any(a in ("-w", "--nodelist") or a.startswith("--nodelist=") for a in args):
            args = ["-w", f"node[1-{count}]" if count > 1 else "node1", *args]
        proc = self.run(["sbatch", "--parsable", *args], user=user, cwd=cwd, env=env, check=True)
        return proc.stdout.strip().split(";")[0]

    def job_info(self, jobid: str) -> dict[str, str]:
        """`scontrol show job -o JOBID` as a dict (finished jobs answer for MinJobAge=300 s)."""
        proc = self.run(["scontrol", "show", "job", "-o", str(jobid)], check=True)
        info: dict[str, str] = {}
        # Values have no spaces except Command=/WorkDir= etc. at the end; split on " Key=".
        for m in re.finditer(
            r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s[A-Za-z][A-Za-z0-9_:/]*=|$)", proc.stdout.strip()
        ):
            info[m.group(1)] = m.group(2)
        return info

    def wait_job(self, jobid: str, timeout: float = 120) -> dict[str, str]:
        """Wait until the job is finished and its epilogs are done; returns job_info()."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(jobid)
            state = info.get("JobState", "")
            if state in FINAL_STATES:
                # The job leaves COMPLETING (Epilog on every node) before this state shows.
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {jobid} not finished after {timeout}s: {info.get('JobState')!r}")

    def squeue(self, user: str | None = None, name: str | None = None) -> list[str]:
        """Ids of the jobs in the queue (pending or running), optionally by user and job name."""
        args = ["squeue", "-h", "-o", "%i"]
        if user:
            args += ["-u", user]
        if name:
            args += ["-n", name]
        return self.run(args, check=True).stdout.split()

    def node_states(self) -> dict[str, str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=True).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd runs jobs as their users)"
    for tool in ("slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"Slurm is not installed ({tool} missing): run `make setup`"
    return None


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that does nothing: the pid a collector or a ring is made for."""
    p = subprocess.Popen(["sleep", "120"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """Start (or reuse) the local 4-node cluster; it is left running for later sessions."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run(
        [str(REPO / "etc" / "dev" / "cluster-up.sh")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"etc/dev/cluster-up.sh failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    env = dict(os.environ)
    env["SLURM_CONF"] = str(CLUSTER_DIR / "slurm.conf")
    env["GPUPROF_CONFIG"] = str(CLUSTER_DIR / "gpuprof.toml")
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return Cluster(repo=REPO, dir=CLUSTER_DIR, conf=CLUSTER_DIR / "slurm.conf", env=env)


@pytest.fixture(scope="session")
def test_user() -> str:
    """The unprivileged user made by `make setup`."""
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        pytest.skip(f"user {TEST_USER} missing: run `make setup`")
    return TEST_USER


def unprivileged_user() -> pwd.struct_passwd:
    """The user a test drops to: the test user of `make setup`, else nobody; skips without either."""
    for name in (TEST_USER, "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    pytest.skip(f"no unprivileged user to run as (make setup creates {TEST_USER})")


@pytest.fixture
def user_tmpdir(test_user: str) -> Iterator[Path]:
    """A fresh directory owned by the test user (mode 0755), removed afterwards."""
    pw = pwd.getpwnam(test_user)
    d = Path(tempfile.mkdtemp(prefix="gpuprof-user-", dir="/tmp"))
    os.chown(d, pw.pw_uid, pw.pw_gid)
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def hook_config(cluster: Cluster) -> Iterator[Callable[[str], None]]:
    """Rewrite the cluster's gpuprof.toml for one test (the hooks read it at every run); restore after."""
    path = cluster.dir / "gpuprof.toml"
    original = path.read_bytes()

    def write(text: str) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    yield write
    path.write_bytes(original)
