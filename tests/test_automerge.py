"""The merge at job end: submitted from the first node's Epilog as the job's user with a clean
environment (works with SlurmUser=slurm), launched with mpirun or srun, as configured."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("launcher,first", [("mpirun", ["mpirun", "-n", "3", "--oversubscribe"]),
                                            ("srun --mpi=pmix", ["srun", "--mpi=pmix", "-n", "3", "--overcommit"]),
                                            ("/opt/mpich/bin/mpiexec", ["/opt/mpich/bin/mpiexec", "-n", "3",
                                                                        "--oversubscribe"])])
def test_launcher_from_config(launcher: str, first: list[str]) -> None:
    cmd = automerge.launch_command(launcher, 3, "/usr/bin/python3")
    assert cmd[:len(first)] == first and cmd[len(first):] == ["/usr/bin/python3", "-m", "mpi4py", "-m",
                                                               "gpuprof.slurm_hooks.cli"]


def test_only_the_first_node_submits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    submitted: list[str] = []

    class Source:
        def lookup(self, job_id: str) -> JobInfo:
            return job(tmp_path)

    monkeypatch.setattr(automerge, "job_source", lambda: Source())
    monkeypatch.setattr(automerge, "submit", lambda job_id, cfg, j=None: submitted.append(job_id) or "99")
    cfg = config.defaults()
    log = logging.getLogger("test")
    automerge.from_node_epilog(cfg, "77", "node3", log)
    assert submitted == []
    automerge.from_node_epilog(cfg, "77", "node2", log)
    assert submitted == ["77"]
    cfg["merge"]["submit_from"] = "epilog_slurmctld"
    automerge.from_node_epilog(cfg, "77", "node2", log)
    assert submitted == ["77"]


def test_submit_from_is_checked(tmp_path: Path) -> None:
    p = tmp_path / "g.toml"
    p.write_text('[merge]\nsubmit_from = "slurmctld"\n')
    with pytest.raises(ConfigError, match="submit_from' must be one of node_epilog, epilog_slurmctld"):
        config.load(str(p))
