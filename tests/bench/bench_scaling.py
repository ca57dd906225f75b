"""Figures of the merge at scale (SYNTHETIC jobs from gpuprof.mpi_merge.synthetic): seconds on 1 and
on 2 merge ranks, interleaved, median with min and max; the largest peak RSS of any merge rank; and
seconds per (job rank x instance) of each step (GPUPROF_MERGE_TIMING), for the cost model in
docs/merge.md.

    .venv/bin/python tests/bench/bench_scaling.py [--quick] [--jobs 256x4,1024x4:10,4096x8:2:1] [--repeats 3]
        [--cache DIR]

A job `NxR` is N nodes of R ranks each, 120 s (or --duration-s, or `NxR:SECONDS[:RUNS]` for that job,
with that many interleaved pairs of runs instead of --repeats) with a
collective every 10 ms on each communicator (--quick: 64x4 for 30 s, one run each); --cache keeps the
generated jobs in DIR and reuses them (the same configuration gives the same files). The 1-minute load average before and after is printed with
the figures: the machine is shared, and a 2-rank run loses more to other work than a 1-rank one.
One JSON line per job size:
{"bench": "merge_scaling", "ranks_in_job": ..., "seconds_1rank": ..., "seconds_2ranks": ...,
 "speedup_2ranks": ..., "max_rss_mb_any_rank": ..., "seconds_per_rank_instance": {...}, "synthetic": true}
and, with more than one job size, the largest RSS of any merge rank per size against the smallest:
{"bench": "merge_scaling_memory", "max_rss_mb_any_rank": {ranks_in_job: MB}, "rss_ratio_largest_to_smallest": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TIMING = re.compile(r"gpuprof merge timing rank (\d+): (.*) total=([\d.]+)")
PEAKS = re.compile(r"gpuprof merge peak rss MB rank (\d+): (.*)")
# the steps after the analysis: the job file and the reports (the HTML page is drawn from the job file)
REPORT_STEPS = ("page_comms", "job_file_reports", "page_items")


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def run_merge(n: int, src: Path, stem: Path) -> dict[str, Any]:
    """One merge under mpirun with n ranks: wall seconds, the largest peak RSS of its processes (the
    ranks are this process's only children: RUSAGE_CHILDREN's maxrss is the largest of them), and
    rank 0's seconds per step."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun not found (the merge at scale is an MPI program)")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable, "-m", "mpi4py", "-m",
           "gpuprof.slurm_hooks.cli", "merge", str(src), "--output-stem", str(stem), "--quiet", "--no-progress"]
    # a fresh parent per run: its RUSAGE_CHILDREN maxrss is the largest of this run's processes only
    wrap = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]).returncode; "
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
            "sys.exit(r)")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", wrap, *cmd], capture_output=True, text=True, check=False,
                       timeout=3600, cwd=ROOT, env={**os.environ, "GPUPROF_MERGE_TIMING": "1"})
    seconds = time.monotonic() - t0
    if p.returncode not in (0, 3):
        raise RuntimeError(f"merge on {n} rank(s) failed ({p.returncode}): {p.stderr[-2000:]}")
    rss = int(re.search(r"MAXRSS_KB (\d+)", p.stderr).group(1))  # type: ignore[union-attr]
    steps: dict[str, float] = {}
    for m in TIMING.finditer(p.stderr):
        if m.group(1) == "0":
            steps = {k: float(v) for k, v in (kv.split("=") for kv in m.group(2).split())}
    # each rank's peak RSS when the analysis ended (before the job file and the reports)
    analysis_peak = 0.0
    for m in PEAKS.finditer(p.stderr):
        at_step = [(k, float(v)) for k, v in (kv.split("=") for kv in m.group(2).split())]
        analysis_peak = max([analysis_peak] + [mb for k, mb in at_step if k not in REPORT_STEPS])
    for f in stem.parent.glob(f"{stem.name}.gpuprof.*"):
        f.unlink()
    return {"seconds": seconds, "rss_mb": rss / 1024, "analysis_rss_mb": analysis_peak, "steps": steps,
            "load1": round(os.getloadavg()[0], 2)}


def bench_job(tmp: Path, nodes: int, ranks_per_node: int, duration_s: float, repeats: int,
              cache: Path | None) -> dict[str, Any]:
    from gpuprof.mpi_merge import synthetic as syn

    name = f"job{nodes}x{ranks_per_node}-{duration_s:g}s.gpuprof.d"
    d = (cache or tmp) / name
    t0 = time.monotonic()
    cfg = syn.SynthConfig(nodes=nodes, ranks_per_node=ranks_per_node, duration_s=duration_s, period_ms=10.0,
                          write_bulk=False, seed=3)
    if not (d / ".complete").exists():
        shutil.rmtree(d, ignore_errors=True)
        syn.generate(cfg, d)
        (d / ".complete").touch()
    gen_s = time.monotonic() - t0
    mb = sum(f.stat().st_size for f in d.glob("*.h5")) / 1e6
    load_start = os.getloadavg()[0]
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for i in range(repeats):  # interleaved: the machine's other load hits both alike
        for n in (1, 2):
            runs[n].append(run_merge(n, d, tmp / f"out{n}-{i}"))
    instances = int(duration_s * 1000 / cfg.period_ms)
    job_ranks = nodes * ranks_per_node
    s1 = [r["seconds"] for r in runs[1]]
    s2 = [r["seconds"] for r in runs[2]]

    def steps(n: int) -> dict[str, float]:
        return {k: statistics.median(r["steps"].get(k, 0.0) for r in runs[n])
                for k in sorted({k for r in runs[n] for k in r["steps"]})}

    def per_cell(n: int) -> dict[str, float]:
        return {k: v / (job_ranks * instances) for k, v in steps(n).items()}

    line = {"bench": "merge_scaling", "ranks_in_job": job_ranks, "nodes": nodes, "duration_s": duration_s,
            "instances_per_communicator": instances, "node_files_mb": round(mb, 1), "generate_s": round(gen_s, 1),
            "seconds_1rank": statistics.median(s1), "seconds_1rank_min_max": [min(s1), max(s1)],
            "seconds_2ranks": statistics.median(s2), "seconds_2ranks_min_max": [min(s2), max(s2)],
            "speedup_2ranks": statistics.median(s1) / statistics.median(s2),
            "max_rss_mb_any_rank": max(r["rss_mb"] for r in runs[1] + runs[2]),
            "max_rss_mb_any_rank_before_reports": max(r["analysis_rss_mb"] for r in runs[1] + runs[2]),
            "steps_rank0_1rank_s": steps(1), "steps_rank0_2ranks_s": steps(2),
            "seconds_per_rank_instance": per_cell(1), "seconds_per_rank_instance_2ranks": per_cell(2),
            "seconds_1rank_all": s1, "seconds_2ranks_all": s2,
            "load1_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)], "cores": os.cpu_count(),
            "speedup_per_pair": [round(x / y, 3) for x, y in zip(s1, s2)],
            "seconds_per_rank_instance_whole_1rank": statistics.median(s1) / (job_ranks * instances),
            "load1_per_run": {n: [r["load1"] for r in runs[n]] for n in runs},
            "runs": repeats, "synthetic": True}
    emit(line)
    if cache is None:
        shutil.rmtree(d)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", default=None, help="comma list of NODESxRANKS (default 256x4)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--duration-s", type=float, default=None)
    ap.add_argument("--cache", type=Path, default=None, help="keep the generated jobs here and reuse them")
    a = ap.parse_args()
    jobs = a.jobs or ("64x4" if a.quick else "256x4")
    repeats = a.repeats or (1 if a.quick else 3)
    duration = a.duration_s or (30.0 if a.quick else 120.0)
    lines = []
    with tempfile.TemporaryDirectory(prefix="bench_scaling-", dir="/var/tmp") as t:
        for spec in jobs.split(","):
            shape, seconds, runs = ([*spec.lower().split(":"), "", ""])[:3]
            nodes, rpn = (int(x) for x in shape.split("x"))
            lines.append(bench_job(Path(t), nodes, rpn, float(seconds) if seconds else duration,
                                   int(runs) if runs else repeats, a.cache))
    if len(lines) > 1:
        rss = {ln["ranks_in_job"]: round(ln["max_rss_mb_any_rank"], 1) for ln in lines}
        before = {ln["ranks_in_job"]: round(ln["max_rss_mb_any_rank_before_reports"], 1) for ln in lines}
        smallest, largest = min(rss), max(rss)
        emit({"bench": "merge_scaling_memory", "max_rss_mb_any_rank": rss,
              "rss_ratio_largest_to_smallest": round(rss[largest] / rss[smallest], 3),
              "max_rss_mb_any_rank_before_reports": before,
              "before_reports_ratio_largest_to_smallest": round(before[largest] / before[smallest], 3),
              "durations_s": {ln["ranks_in_job"]: ln["duration_s"] for ln in lines}, "synthetic": True})


if __name__ == "__main__":
    main()
