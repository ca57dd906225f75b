"""The peer the merge is measured against: Slurm's own HDF5 profiling (`sbatch --profile=task`),
whose per node and step files `sh5util -j JOB` merges into one. Runs a real 4-node job on the local
cluster (acct_gather.conf there sets ProfileHDF5Dir) and times sh5util on its files."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PROFILE_DIR = REPO / ".cluster" / "profile_hdf5"


def _env() -> dict[str, str]:
    return dict(os.environ, SLURM_CONF=str(REPO / ".cluster" / "slurm.conf"))


def sh5util_throughput(job_seconds: int = 20, repeats: int = 10) -> dict[str, Any]:
    """{"sh5util_mb_per_s": ..., "sh5util_input_mb": ...} or {"sh5util_mb_per_s": None, "reason": ...}."""
    env = _env()
    work = Path(tempfile.mkdtemp(prefix="gpuprof-sh5util-"))
    busy = f"srun -N4 sh -c 'end=$((SECONDS+{job_seconds})); while [ $SECONDS -lt $end ]; do :; done'"
    try:
        p = subprocess.run(["sbatch", "--parsable", "--profile=task", "--acctg-freq=task=1", "-N4", "--wrap", busy],
                           cwd=work, env=env, capture_output=True, text=True, check=False, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return {"sh5util_mb_per_s": None, "reason": f"sbatch: {e}"}
    if p.returncode != 0:
        return {"sh5util_mb_per_s": None, "reason": f"sbatch --profile=task failed: {p.stderr.strip()}"}
    job = p.stdout.strip()
    deadline = time.monotonic() + job_seconds + 120
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True, check=False)
        if not q.stdout.strip():
            break
        time.sleep(1)
    files = sorted(PROFILE_DIR.glob(f"*/{job}_*.h5"))
    if not files:
        return {"sh5util_mb_per_s": None, "reason": f"no profile files of job {job} under {PROFILE_DIR}"}
    size = sum(f.stat().st_size for f in files)
    out = work / "merged.h5"
    times = []
    for _ in range(repeats):
        out.unlink(missing_ok=True)
        t0 = time.perf_counter()
        subprocess.run(["sh5util", "-j", job, "-S", "-o", str(out)], env=env, capture_output=True, check=True,
                       cwd=work)
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"sh5util_mb_per_s": round(size / 1e6 / best, 3), "sh5util_input_mb": round(size / 1e6, 4),
            "sh5util_files": len(files)}
