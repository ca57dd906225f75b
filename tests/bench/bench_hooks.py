"""Hook latency figures (issue 2), one JSON object per line:

  prolog_fast_path  etc/prolog for a job without --profile-gpu (runs for every job of a cluster)
  prolog_start      etc/prolog with --profile-gpu until the collector records (it returns then)
  epilog            etc/epilog: seal, recover if needed, place the node file as the user, resume DCGM

The hooks are run the way slurmd runs them (same executables, a Prolog-like environment), on this
machine, with a stand-in dcgmi. Usage: python tests/bench/bench_hooks.py [--quick]
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

REPO = Path(__file__).resolve().parents[2]
FAKE_DCGMI = REPO / "tests" / "doubles" / "fake_dcgmi"


def hook_env(job: str, node: str, cfg: Path, work: Path, profiled: bool) -> dict[str, str]:
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "SLURM_JOB_ID": job,
        "SLURM_JOB_UID": "0",
        "SLURM_JOB_GID": "0",
        "SLURM_JOB_USER": "root",
        "SLURM_JOB_WORK_DIR": str(work),
        "SLURM_JOB_STDOUT": str(work / "slurm-%j.out"),
        "SLURMD_NODENAME": node,
        "SLURM_SCRIPT_CONTEXT": "prolog_slurmd",
        "GPUPROF_CONFIG": str(cfg),
        "FAKE_DCGMI_LOG": str(work / "dcgmi.calls"),
    }
    if profiled:
        env["SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu"] = "metrics,collectives"
    return env


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    fast_n, slow_n = (30, 3) if args.quick else (200, 10)
    work = Path(tempfile.mkdtemp(prefix="gpuprof-bench-hooks-"))
    try:
        cfg = work / "gpuprof.toml"
        cfg.write_text(f'[paths]\nstate_dir = "{work}/state"\n[dcgm]\ndcgmi = "{FAKE_DCGMI}"\n[merge]\nauto = false\n')
        prolog, epilog = str(REPO / "etc" / "prolog"), str(REPO / "etc" / "epilog")
        fast = [timed([prolog], hook_env(str(i), "node1", cfg, work, False)) for i in range(fast_n)]
        print(json.dumps({"bench": "prolog_fast_path", "median_ms": round(statistics.median(fast), 2),
                          "p90_ms": round(sorted(fast)[int(0.9 * len(fast))], 2), "runs": fast_n}), flush=True)
        starts, ends = [], []
        for i in range(slow_n):
            job = str(900000 + i)
            starts.append(timed([prolog], hook_env(job, "node1", cfg, work, True)))
            time.sleep(1.0)
            ends.append(timed([epilog], hook_env(job, "node1", cfg, work, True)))
            placed = work / f"slurm-{job}.gpuprof.d" / "node1.h5"
            if not placed.exists():
                raise SystemExit(f"bench: epilog did not place {placed}; see {work}/state")
        print(json.dumps({"bench": "prolog_start", "median_ms": round(statistics.median(starts), 1),
                          "max_ms": round(max(starts), 1), "runs": slow_n}), flush=True)
        print(json.dumps({"bench": "epilog", "median_ms": round(statistics.median(ends), 1),
                          "max_ms": round(max(ends), 1), "runs": slow_n}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if os.geteuid() != 0:
        raise SystemExit("bench_hooks: run as root (the hooks run as root under slurmd)")
    main()
