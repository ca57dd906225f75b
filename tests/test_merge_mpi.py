"""The merge under mpirun with 1, 2 and 4 ranks gives identical job files; one rank's error aborts
the whole job with its message instead of hanging it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.jobfile import compare_job_files

ROOT = Path(__file__).resolve().parent.parent
MPIRUN = shutil.which("mpirun")
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (mpi marker)")]


def mpirun(n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    assert MPIRUN is not None
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable, "-m", "mpi4py", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("mpi") / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=5, duration_s=10, ranks_per_node=2, gpus_per_node=2, seed=8,
                                 stragglers=[syn.Straggler(1, "gpu", 2.0, 8.0)]), d)
    return d


def test_same_job_file_for_1_2_4_ranks(job: Path, tmp_path: Path) -> None:
    outs = {}
    for n in (1, 2, 4):
        stem = tmp_path / f"k{n}"
        p = mpirun(n, "-m", "gpuprof.slurm_hooks.cli", "merge", str(job), "--output-stem", str(stem), "--quiet")
        assert p.returncode == 0, p.stderr[-3000:]
        outs[n] = Path(f"{stem}.gpuprof.h5")
    assert compare_job_files(outs[1], outs[2]) == []
    assert compare_job_files(outs[1], outs[4]) == []
    reps = [json.loads(Path(f"{tmp_path}/k{n}.gpuprof.json").read_text()) for n in (1, 2, 4)]
    assert reps[0] == reps[1] == reps[2]
    assert [s["node"] for s in reps[0]["stragglers"]] == ["node001"]


def test_error_on_one_rank_aborts_all(job: Path, tmp_path: Path) -> None:
    script = tmp_path / "failing_rank.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "import gpuprof.mpi_merge.merge as m\n"
        "real = m.summarize_node\n"
        "def broken(path, *args):\n"
        "    if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "        raise OSError('injected read failure on rank 1')\n"
        "    return real(path, *args)\n"
        "m.summarize_node = broken\n"
        "from gpuprof.slurm_hooks.cli import main\n"
        f"import sys; sys.argv = ['gpuprof', 'merge', {str(job)!r}, '--output-stem', {str(tmp_path / 'x')!r}]\n"
        "main()\n"
    )
    p = mpirun(3, str(script), timeout=120)
    assert p.returncode != 0
    assert "injected read failure on rank 1" in p.stderr
    assert not (tmp_path / "x.gpuprof.h5").exists()
