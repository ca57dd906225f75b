"""One namespace, one wheel: the wheel installs into a fresh venv and runs with no source tree.

Builds the wheel from this checkout, installs it into a new virtual environment and runs, from a
directory outside the repository: the CLI, `gpuprof doctor`, a merge of a small generated job, and
the installed TaskProlog (which must find the venv's own Python and the interposers inside it).
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                    "-w", str(tmp), str(REPO)], check=True, capture_output=True, text=True)
    (whl,) = tmp.glob("slurm_gpuprof-*.whl")
    venv = tmp / "venv"
    # Debian's bcc lives in the system site packages (docs/slurm.md, "Installing"); sys._base_executable
    # is the interpreter our own .venv was made from
    subprocess.run([sys._base_executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", str(whl)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return whl, venv


def _run(venv: Path, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(list(args), cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=300, check=False)


def test_wheel_has_one_namespace_and_the_native_parts(wheel_venv: tuple[Path, Path]) -> None:
    whl, _ = wheel_venv
    assert "linux_x86_64" in whl.name or "linux_aarch64" in whl.name, f"{whl.name}: native parts, platform tag"
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("slurm_gpuprof-")}
    assert tops == {"gpuprof"}, f"top-level entries besides gpuprof/: {tops}"
    for need in ("gpuprof/bpf/gpuprof.c", "gpuprof/bpf/collectives.c", "gpuprof/bpf/gpuprof_events.h",
                 "gpuprof/bpf/fastpath/build/libgpuprof_pmpi.so", "gpuprof/bpf/fastpath/build/layout.json",
                 "gpuprof/collector/native/build/libgpuprof_sampler.so", "gpuprof/slurm_hooks/spank/gpuprof_spank.c"):
        assert need in names, need
    assert not any(n.startswith("gpuprof/__init__") for n in names), "gpuprof must stay a namespace package"
    data = [n for n in names if ".data/data/etc/" in n]
    assert {Path(n).name for n in data} >= {"prolog", "epilog", "task-prolog", "epilog-slurmctld", "gpuprof.toml",
                                           "gpuprof-continuous.service", "gpuprof-prepare.service"}


def test_installed_cli_doctor_and_merge_without_source_tree(wheel_venv: tuple[Path, Path], tmp_path: Path) -> None:
    _, venv = wheel_venv
    where = _run(venv, str(venv / "bin/python"), "-c",
                 "import gpuprof.collector, gpuprof.mpi_merge, gpuprof.slurm_hooks as s; print(s.__file__)",
                 cwd=tmp_path)
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stdout + where.stderr
    bare = _run(venv, str(venv / "bin/python"), "-c", "import collector", cwd=tmp_path)
    assert bare.returncode != 0, "a top-level 'collector' package is importable from the wheel's venv"

    doc = _run(venv, str(venv / "bin/gpuprof"), "doctor", "--json", cwd=tmp_path)
    assert doc.returncode in (0, 1), doc.stderr
    checks = {c["name"]: c for c in json.loads(doc.stdout)}
    assert {"hdf5", "mpi", "state-dir"} <= set(checks), sorted(checks)
    assert checks["hdf5"]["ok"], checks["hdf5"]

    job = tmp_path / "job"
    gen = _run(venv, str(venv / "bin/python"), "-m", "gpuprof.mpi_merge.synthetic", "--nodes", "2",
               "--duration-s", "5", "--out", str(job), cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr
    merge = _run(venv, str(venv / "bin/gpuprof"), "merge", str(job), "--output-stem", str(tmp_path / "out"),
                 "--quiet", cwd=tmp_path)
    assert merge.returncode == 0, merge.stdout + merge.stderr
    assert (tmp_path / "out.gpuprof.h5").stat().st_size > 0 and (tmp_path / "out.gpuprof.txt").read_text()


def test_installed_task_prolog_finds_its_venv(wheel_venv: tuple[Path, Path], tmp_path: Path) -> None:
    _, venv = wheel_venv
    job_env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "wheelnode",
               "SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu": "collectives"}
    # without the ring directory the prolog makes, nothing would read the rings: no fast path
    # (what a node whose continuous collector records the job gets)
    r = _run(venv, str(venv / "etc/task-prolog"), cwd=tmp_path, env=job_env)
    assert r.returncode == 0 and r.stdout.splitlines() == ["export GPUPROF_MODES=collectives"], r.stdout
    ring_dir = Path("/dev/shm/gpuprof-77@wheelnode")
    ring_dir.mkdir(mode=0o700)
    try:
        r = _run(venv, str(venv / "etc/task-prolog"), cwd=tmp_path, env=job_env)
    finally:
        ring_dir.rmdir()
    assert r.returncode == 0
    preload = [ln for ln in r.stdout.splitlines() if ln.startswith("export LD_PRELOAD=")]
    assert preload and str(venv) in preload[0], r.stdout
    assert all(os.path.exists(p) for p in preload[0].split("=", 1)[1].split(":"))
    assert f"export GPUPROF_FASTPATH_DIR={ring_dir}" in r.stdout.splitlines()
