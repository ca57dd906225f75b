"""The SPANK plugin through real sbatch/srun on the local cluster (etc/dev/cluster-up.sh)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

VALID_MODES_TEXT = "metrics, stacks, collectives, kernels"
PWNED = Path("/tmp/pwned")

REFUSED = {
    "unknown": "bogus",
    "empty-item": "metrics,,x",
    "too-long": "metrics," * 1280,  # 10 kB
    "shell": "$(touch /tmp/pwned)",
    "upper-case": "METRICS",
}


def _unique_name() -> str:
    return f"gpuprof-t-{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize("value", REFUSED.values(), ids=REFUSED.keys())
def test_invalid_value_refused_before_queueing(cluster, value):
    PWNED.unlink(missing_ok=True)
    name = _unique_name()
    proc = cluster.run(["sbatch", f"--job-name={name}", f"--profile-gpu={value}", "--wrap", "true"])
    assert proc.returncode != 0, proc.stdout
    assert VALID_MODES_TEXT in proc.stderr
    assert "gpuprof: invalid --profile-gpu value" in proc.stderr
    assert cluster.squeue(name=name) == []
    assert not PWNED.exists()


def test_invalid_value_in_script_directive_refused(cluster, tmp_path):
    PWNED.unlink(missing_ok=True)
    name = _unique_name()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n#SBATCH --profile-gpu=$(touch /tmp/pwned)\ntrue\n")
    proc = cluster.run(["sbatch", f"--job-name={name}", str(script)], cwd=tmp_path)
    assert proc.returncode != 0
    assert VALID_MODES_TEXT in proc.stderr
    assert cluster.squeue(name=name) == []
    assert not PWNED.exists()


def test_srun_refuses_invalid_value(cluster):
    proc = cluster.run(["srun", "-N1", "--profile-gpu=nope", "true"], timeout=60)
    assert proc.returncode != 0
    assert VALID_MODES_TEXT in proc.stderr


def test_help_lists_option(cluster):
    proc = cluster.run(["sbatch", "--help"], check=True)
    assert "--profile-gpu" in proc.stdout
    assert "metrics, stacks, collectives, kernels" in " ".join(proc.stdout.split())


SHOW = "srun -N2 -l sh -c 'echo \"$SLURMD_NODENAME modes=$GPUPROF_MODES raw=$SLURM_SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu\"'"


@pytest.mark.parametrize(
    ("option", "canonical", "raw"),
    [
        ("--profile-gpu=stacks,metrics,stacks", "metrics,stacks", "stacks,metrics,stacks"),
        ("--profile-gpu=kernels", "kernels", "kernels"),
        # Without a value Slurm 22.05 forwards the raw option as the string "(null)".
        ("--profile-gpu", "metrics,stacks,collectives", None),
    ],
)
def test_valid_value_runs_on_two_nodes(cluster, tmp_path, option, canonical, raw):
    out = tmp_path / "out.txt"
    jobid = cluster.sbatch(["-N2", option, f"--output={out}", "--wrap", SHOW], cwd=tmp_path)
    info = cluster.wait_job(jobid, timeout=120)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED", text
    lines = sorted(line.split(": ", 1)[1] for line in text.splitlines() if ": " in line)
    assert len(lines) == 2, text
    nodes = {line.split()[0] for line in lines}
    assert len(nodes) == 2, text
    for line in lines:
        assert f"modes={canonical} " in line
        if raw is not None:
            assert line.endswith(f"raw={raw}")


def test_job_without_option_has_no_modes(cluster, tmp_path):
    out = tmp_path / "out.txt"
    jobid = cluster.sbatch(["-N1", f"--output={out}", "--wrap", "env"], cwd=tmp_path)
    assert cluster.wait_job(jobid)["JobState"] == "COMPLETED"
    text = out.read_text()
    assert "GPUPROF_MODES" not in text
    assert "SPANK_OPTION_gpuprof" not in text


def test_unprivileged_user_job(cluster, test_user, user_tmpdir):
    out = user_tmpdir / "out.txt"
    jobid = cluster.sbatch(
        [
            "-N1",
            "--profile-gpu=collectives,metrics",
            f"--chdir={user_tmpdir}",
            f"--output={out}",
            "--wrap",
            'echo "user=$(id -un) modes=$GPUPROF_MODES"',
        ],
        user=test_user,
        cwd=user_tmpdir,
    )
    info = cluster.wait_job(jobid)
    assert info["JobState"] == "COMPLETED", out.read_text() if out.exists() else info
    assert info["UserId"].startswith(f"{test_user}(")
    assert out.read_text().strip() == f"user={test_user} modes=metrics,collectives"


def test_unprivileged_user_invalid_value_refused(cluster, test_user, user_tmpdir):
    name = _unique_name()
    proc = cluster.run(
        ["sbatch", f"--job-name={name}", "--profile-gpu=root", "--wrap", "true"],
        user=test_user,
        cwd=user_tmpdir,
    )
    assert proc.returncode != 0
    assert VALID_MODES_TEXT in proc.stderr
    assert cluster.squeue(user=test_user, name=name) == []
