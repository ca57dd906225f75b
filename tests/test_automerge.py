"""The merge at job end: submitted from the first node's Epilog as the job's user with a clean
environment (works with SlurmUser=slurm), launched with mpirun or srun, as configured."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from conftest import Cluster

from gpuprof.collector import config
from gpuprof.collector.errors import ConfigError
from gpuprof.slurm_hooks import automerge
from gpuprof.slurm_hooks.job import JobInfo


def job(tmp_path: Path) -> JobInfo:
    return JobInfo("77", "gpuprof-test", 1001, 1001, ["node2", "node3"], str(tmp_path), str(tmp_path / "slurm-77.out"),
                   "COMPLETING")


def test_merge_job_gets_a_clean_environment(tmp_path: Path) -> None:
    cmd = automerge.merge_job_command(job(tmp_path), config.defaults(), sys.executable)
    export = [a for a in cmd if a.startswith("--export=")]
    assert export and export[0].startswith(f"--export=PATH={automerge.CLEAN_PATH},HOME=")
    assert "--dependency=afterany:77" in cmd and "--ntasks=2" in cmd


# what each launcher prints for --version (Open MPI 4.1's mpirun, MPICH 4's hydra mpiexec)
VERSIONS = {"openmpi": "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/",
            "hydra": "HYDRA build details:\n    Version:                                 4.0.2",
            "other": "some launcher 1.0"}


@pytest.mark.parametrize("flavour,extra", [("openmpi", ["--oversubscribe"]), ("hydra", []), ("other", [])])
def test_launcher_from_config(flavour: str, extra: list[str], tmp_path: Path) -> None:
    """Open MPI's mpirun gets --oversubscribe (the merge job may have fewer CPUs than ranks); MPICH's
    hydra rejects that option ("unrecognized argument") and needs none; srun gets --overcommit."""
    launcher = tmp_path / "mpiexec"
    launcher.write_text(f"#!/bin/sh\ncat <<'EOF'\n{VERSIONS[flavour]}\nEOF\n")
    launcher.chmod(0o755)
    cmd = automerge.launch_command(str(launcher), 3, "/usr/bin/python3")
    assert cmd == [str(launcher), "-n", "3", *extra, "/usr/bin/python3", "-m", "mpi4py", "-m",
                   "gpuprof.slurm_hooks.cli"]
    assert automerge.launch_command("srun --mpi=pmix", 3, "/usr/bin/python3")[:5] == [
        "srun", "--mpi=pmix", "-n", "3", "--overcommit"]
    assert automerge.launcher_flavour("mpirun") == "openmpi"  # the one this machine has
    assert automerge.launcher_flavour(str(tmp_path / "absent")) == "unknown"


def test_only_the_first_node_submits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    submitted: list[str] = []

    class Source:
        def lookup(self, job_id: str) -> JobInfo:
            return job(tmp_path)

    monkeypatch.setattr(automerge, "job_source", lambda: Source())
    monkeypatch.setattr(automerge, "submit", lambda job_id, cfg, j=None: submitted.append(job_id) or "99")
    for v in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(v, raising=False)  # the lookup's nodes, then
    cfg = config.defaults()
    log = logging.getLogger("test")
    automerge.from_node_epilog(cfg, "77", "node3", log)
    assert submitted == []
    automerge.from_node_epilog(cfg, "77", "node2", log)
    assert submitted == ["77"]
    cfg["merge"]["submit_from"] = "epilog_slurmctld"
    automerge.from_node_epilog(cfg, "77", "node2", log)
    assert submitted == ["77"]


@pytest.mark.parametrize("variable", ["SLURM_JOB_NODELIST", "SLURM_NODELIST"])  # Slurm 23.02 on; 22.05
def test_the_first_node_is_the_allocations_not_the_completing_jobs(tmp_path: Path, variable: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """node1's epilog is done, and the lookup of the completing job lists node[2-4] only: node2 is
    still not the first (the Epilog's SLURM_JOB_NODELIST is the allocation); node1 submits the merge
    for all four nodes."""
    submitted: list[list[str]] = []

    class Source:
        def lookup(self, job_id: str) -> JobInfo:
            j = job(tmp_path)
            j.nodes = ["node2", "node3", "node4"]
            return j

    monkeypatch.setattr(automerge, "job_source", lambda: Source())
    monkeypatch.setattr(automerge, "submit", lambda job_id, cfg, j: submitted.append(j.nodes) or "99")
    for v in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(variable, "node[1-4]")
    monkeypatch.setattr(automerge, "expand_hostlist",
                        lambda s: ["node1", "node2", "node3", "node4"] if s == "node[1-4]" else [])
    log = logging.getLogger("test")
    automerge.from_node_epilog(config.defaults(), "77", "node2", log)
    assert submitted == []
    automerge.from_node_epilog(config.defaults(), "77", "node1", log)
    assert submitted == [["node1", "node2", "node3", "node4"]]


def test_submit_from_is_checked(tmp_path: Path) -> None:
    p = tmp_path / "g.toml"
    p.write_text('[merge]\nsubmit_from = "slurmctld"\n')
    with pytest.raises(ConfigError, match="submit_from' must be one of node_epilog, epilog_slurmctld"):
        config.load(str(p))


REPO = Path(__file__).resolve().parents[1]
MPICH_PYTHON = REPO / ".venv-mpich" / "bin" / "python"


@pytest.mark.skipif(not MPICH_PYTHON.exists() or shutil.which("mpiexec.mpich") is None,
                    reason="no MPICH environment (etc/dev/setup.sh makes .venv-mpich where Debian's mpich installs)")
def test_the_merge_job_runs_with_mpich(tmp_path: Path) -> None:
    """The merge job's body (`automerge run`) with `merge.mpirun = mpiexec.mpich` and an mpi4py
    built for MPICH, as a site whose MPI is MPICH has them: hydra starts 2 ranks (each says its
    rank), no Open MPI option on its command line, and the job file is the serial merge's, bit for bit."""
    from gpuprof.mpi_merge import synthetic as syn
    from gpuprof.mpi_merge.jobfile import compare_job_files
    from gpuprof.mpi_merge.merge import merge

    tree = tmp_path / "site" / "gpuprof"  # the project as that environment imports it
    tree.mkdir(parents=True)
    for pkg in ("collector", "mpi_merge", "slurm_hooks", "bpf"):
        (tree / pkg).symlink_to(REPO / pkg)
    d = tmp_path / "slurm-88.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, ranks_per_node=2, duration_s=10, seed=8,
                                 stragglers=[syn.Straggler(2, "host", 2.0, 8.0)]), d)
    stdout = tmp_path / "slurm-88.out"
    stdout.write_text("the job's own output\n")
    nodes = ",".join(syn.node_name(i, 4) for i in range(4))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(tree.parent),
           "GPUPROF_MERGE_TIMING": "1"}
    p = subprocess.run([str(MPICH_PYTHON), "-m", "gpuprof.slurm_hooks.automerge", "run", "--job", "88", "--dir", str(d),
                        "--stdout", str(stdout), "--nodes", nodes, "--ranks", "2", "--mpirun", "mpiexec.mpich"],
                       capture_output=True, text=True, env=env, timeout=600, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    launched = next(line for line in out.splitlines() if line.startswith("gpuprof merge: mpiexec.mpich"))
    assert " -n 2 " in launched and "--oversubscribe" not in launched
    assert "timing rank 0:" in out and "timing rank 1:" in out  # one job of 2 ranks, not 2 singletons
    serial = merge(str(d), output_stem=str(tmp_path / "serial"))
    assert serial is not None
    assert compare_job_files(tmp_path / "slurm-88.gpuprof.h5", serial.job_file) == []
    assert stdout.read_text() == "the job's own output\n"


@pytest.mark.slurm
@pytest.mark.mpi
@pytest.mark.skipif(not MPICH_PYTHON.exists() or shutil.which("mpiexec.mpich") is None,
                    reason="no MPICH environment (etc/dev/setup.sh makes .venv-mpich where Debian's mpich installs)")
def test_the_merge_job_runs_with_mpich_through_slurm(cluster: Cluster, test_user: str, user_tmpdir: Path) -> None:
    """The merge job as the node Epilog submits it (merge_job_command: sbatch as the job's user, a
    clean environment, a dependency on the job), with `merge.mpirun = mpiexec.mpich` and the MPICH
    environment's Python as the hooks' Python: hydra starts 2 ranks inside the merge job's
    allocation, and the job file beside the job's output is the serial merge's, the user's own."""
    from gpuprof.mpi_merge import synthetic as syn
    from gpuprof.mpi_merge.jobfile import compare_job_files
    from gpuprof.mpi_merge.merge import merge

    pw = pwd.getpwnam(test_user)
    # the profiled job: a real one of the user's (the merge job depends on it), its traces generated
    first = cluster.sbatch(["--wrap=echo the job output", f"--chdir={user_tmpdir}",
                            f"--output={user_tmpdir}/slurm-%j.out", "--nodes=1"], user=test_user, cwd=user_tmpdir)
    cluster.wait_job(first)
    stdout = user_tmpdir / f"slurm-{first}.out"
    node_dir = user_tmpdir / f"slurm-{first}.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, ranks_per_node=2, duration_s=10, seed=8,
                                 stragglers=[syn.Straggler(2, "host", 2.0, 8.0)]), node_dir)
    for p in [node_dir, *node_dir.iterdir()]:
        os.chown(p, pw.pw_uid, pw.pw_gid)
    cfg = config.load(str(cluster.dir / "gpuprof.toml"))
    cfg["merge"]["mpirun"] = "mpiexec.mpich"
    cfg["merge"]["max_ranks"] = 2
    info = JobInfo(first, test_user, pw.pw_uid, pw.pw_gid, [syn.node_name(i, 4) for i in range(4)],
                   str(user_tmpdir), str(stdout), "COMPLETED")
    cmd = automerge.merge_job_command(info, cfg, str(MPICH_PYTHON))
    assert cmd[:2] == ["sbatch", "--parsable"]
    merge_id = cluster.sbatch(cmd[2:], user=test_user, cwd=user_tmpdir)
    state = cluster.wait_job(merge_id, timeout=300)["JobState"]
    log = (user_tmpdir / f"slurm-{first}.gpuprof-merge.log").read_text()
    assert state == "COMPLETED", log[-3000:]
    launched = next(line for line in log.splitlines() if line.startswith("gpuprof merge: mpiexec.mpich"))
    assert " -n 2 " in launched and "--oversubscribe" not in launched
    job_file = user_tmpdir / f"slurm-{first}.gpuprof.h5"
    assert job_file.stat().st_uid == pw.pw_uid
    with h5py.File(job_file, "r") as f:
        assert int(f.attrs["merge_ranks"]) == 2  # one MPI job of 2 ranks, not 2 singletons
    serial = merge(str(node_dir), output_stem=str(user_tmpdir / "serial"))
    assert serial is not None
    assert compare_job_files(job_file, serial.job_file) == []
    assert stdout.read_text() == "the job output\n"
