"""Submitting to the local cluster (etc/dev/cluster-up.sh) as the unprivileged test user and waiting,
without pytest (the bench uses it too). The same calls as tests/conftest.py's Cluster."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER_DIR = REPO / ".cluster"
TEST_USER = "gpuprof-test"
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"})


class SlurmError(RuntimeError):
    pass


def cluster_env() -> dict[str, str]:
    conf = CLUSTER_DIR / "slurm.conf"
    if not conf.exists():
        raise SlurmError(f"{conf} missing: the local cluster is not set up (make cluster)")
    env = dict(os.environ)
    env["SLURM_CONF"] = str(conf)
    env["GPUPROF_CONFIG"] = str(CLUSTER_DIR / "gpuprof.toml")
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def run(args: Sequence[str], user: str | None = None, env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = cluster_env()
    if env:
        full.update(env)
    cmd = list(args)
    if user is not None:
        pw = pwd.getpwnam(user)
        full.update(HOME=pw.pw_dir, USER=user, LOGNAME=user)
        cmd = ["runuser", "-u", user, "--", "env", *[f"{k}={v}" for k, v in full.items()], *cmd]
    return subprocess.run(cmd, check=False, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def sbatch(args: Sequence[str], user: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    p = run(["sbatch", "--parsable", *args], user=user, cwd=cwd, env=env)
    if p.returncode != 0:
        raise SlurmError(f"sbatch {' '.join(args)} (in {cwd}) -> rc {p.returncode}: {p.stderr.strip()}")
    return p.stdout.strip().split(";")[0]


def job_info(jobid: str) -> dict[str, str]:
    p = run(["scontrol", "show", "job", "-o", str(jobid)])
    if p.returncode != 0:
        raise SlurmError(f"scontrol show job {jobid}: {p.stderr.strip()}")
    return {m.group(1): m.group(2) for m in re.finditer(
        r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s[A-Za-z][A-Za-z0-9_:/]*=|$)", p.stdout.strip())}


def state(jobid: str) -> str:
    return job_info(jobid).get("JobState", "")


def wait_running(jobid: str, timeout: float) -> str:
    """Wait until the job runs (or already ended); returns the state."""
    deadline = time.monotonic() + timeout
    st = ""
    while time.monotonic() < deadline:
        st = state(jobid)
        if st == "RUNNING" or st in FINAL_STATES:
            return st
        time.sleep(0.3)
    raise TimeoutError(f"job {jobid} not running after {timeout:.0f} s (state {st!r})")


def wait_final(jobid: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(jobid)
        if info.get("JobState", "") in FINAL_STATES:
            return info
        time.sleep(0.5)
    run(["scancel", str(jobid)])
    raise TimeoutError(f"job {jobid} not finished after {timeout:.0f} s (state {info.get('JobState')!r}); cancelled")


def queued(name: str, states: str = "all") -> list[str]:
    """Ids of the jobs of that name in the queue, in the given states (squeue -t)."""
    p = run(["squeue", "-h", "-o", "%i", "-n", name, "-t", states])
    if p.returncode != 0:
        raise SlurmError(f"squeue -n {name}: {p.stderr.strip()}")
    return p.stdout.split()
