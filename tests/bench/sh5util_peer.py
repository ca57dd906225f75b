"""The peer the merge is measured against: Slurm's own HDF5 profiling (`sbatch --profile=task`),
whose per node and step files `sh5util -j JOB` merges into one. Runs a real job on the local
cluster (acct_gather.conf there sets ProfileHDF5Dir) and times sh5util on its files.

Why a long job of many tasks: sh5util's time on the 36 kB that a 20 s job of one task per node
leaves is start-up, not merging (issue 11). The job here has the length and node count of the
job our merge is timed on where the cluster allows it (bench_merge.py: 300 s; 4 nodes here, the
cluster's size), and 16 tasks per node sampled every second (Slurm's finest --acctg-freq), the
most series Slurm's profile gives: its input is then megabytes, and the line says how many.

    .venv/bin/python tests/bench/sh5util_peer.py [--seconds 300] [--tasks-per-node 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PROFILE_DIR = REPO / ".cluster" / "profile_hdf5"
JOB_SECONDS = 300  # bench_merge.py's synthetic job: duration_s = 300
NODES = 4
TASKS_PER_NODE = 16


def _env() -> dict[str, str]:
    return dict(os.environ, SLURM_CONF=str(REPO / ".cluster" / "slurm.conf"))


def sh5util_throughput(job_seconds: int = JOB_SECONDS, repeats: int = 5, nodes: int = NODES,
                       tasks_per_node: int = TASKS_PER_NODE) -> dict[str, Any]:
    """{"sh5util_mb_per_s": median, min, max, "sh5util_input_mb": ..., the job's shape} or
    {"sh5util_mb_per_s": None, "reason": ...}."""
    env = _env()
    work = Path(tempfile.mkdtemp(prefix="gpuprof-sh5util-"))
    # sleeping tasks: the profile samples every task every second whatever it does
    # -n with --overcommit (2 CPUs per node here; --ntasks-per-node above the CPUs is refused)
    ntasks = nodes * tasks_per_node
    step = f"srun -N{nodes} -n{ntasks} --overcommit sleep {job_seconds}"
    try:
        try:
            p = subprocess.run(["sbatch", "--parsable", "--profile=task", "--acctg-freq=task=1", f"-N{nodes}",
                                f"-n{ntasks}", "--overcommit", "--wrap", step],
                               cwd=work, env=env, capture_output=True, text=True, check=False, timeout=30)
        except (FileNotFoundError, subprocess.TimeoutExpired) as e:
            return {"sh5util_mb_per_s": None, "reason": f"sbatch: {e}"}
        if p.returncode != 0:
            return {"sh5util_mb_per_s": None, "reason": f"sbatch --profile=task failed: {p.stderr.strip()}"}
        job = p.stdout.strip()
        deadline = time.monotonic() + job_seconds + 300
        while time.monotonic() < deadline:
            q = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True, check=False)
            if not q.stdout.strip():
                break
            time.sleep(2)
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
        for f in files:
            f.unlink()
        mb = size / 1e6
        return {"sh5util_mb_per_s": round(mb / statistics.median(times), 3),
                "sh5util_mb_per_s_min": round(mb / max(times), 3), "sh5util_mb_per_s_max": round(mb / min(times), 3),
                "sh5util_seconds": [round(t, 3) for t in times], "sh5util_input_mb": round(mb, 3),
                "sh5util_files": len(files), "sh5util_job_seconds": job_seconds, "sh5util_nodes": nodes,
                "sh5util_tasks_per_node": tasks_per_node, "sh5util_output_mb": round(out.stat().st_size / 1e6, 3)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=JOB_SECONDS)
    ap.add_argument("--tasks-per-node", type=int, default=TASKS_PER_NODE)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(json.dumps({"bench": "sh5util_peer", **sh5util_throughput(a.seconds, a.repeats,
                                                                    tasks_per_node=a.tasks_per_node)}), flush=True)


if __name__ == "__main__":
    main()
