"""balanced_at_scale: simulated BALANCED jobs from 2 to 16384 ranks must yield no straggler finding.

    .venv/bin/python tests/bench/bench_balanced.py [--quick] [--ranks 2,8,...]

The jobs come from gpuprof.mpi_merge.simjob.balanced_job (SYNTHETIC, in memory, no node files):
lognormal compute (sigma 5 %), 2 % of steps losing up to 1 ms to a task sharing the core, 2-rank
sub-communicators whose second rank always leaves 1 ms later, 20 us of residual clock error per
node; each is fed to find_stragglers as CommSummary and AlignedRows arrays. Besides the findings of the
detector (root causes, exact test, Benjamini-Hochberg at q = 0.01, effect floor), the line gives what
the parts do: `raw_p_below_q`, the tests an uncorrected test at q would flag; `findings_last_share`,
the same statistics on "arrived last" without the root-cause split. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gpuprof.mpi_merge import simjob
from gpuprof.mpi_merge.stragglers import StragglerParams, find_stragglers

RANKS = [2, 8, 64, 512, 2048, 16384]


def judge(sim: simjob.SimResult, algorithm: str) -> tuple[int, dict[str, object]]:
    params = StragglerParams(window_s=0.5, algorithm=algorithm)
    findings, m = find_stragglers(sim.comms, sim.times, sim.node_names, sim.node_series, 0, 0.0, params,
                                  sim.clock_error_ns)
    s = m["_summary"]
    assert isinstance(s, dict)
    return len(findings), s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    a = ap.parse_args()
    ranks = [int(x) for x in a.ranks.split(",")]
    out: dict[str, list[object]] = {k: [] for k in ("findings", "windows_judged", "tests", "raw_p_below_q",
                                                    "findings_last_share", "seconds", "instances")}
    for r in ranks:
        sim = simjob.simulate(simjob.balanced_job(r, iterations=80 if a.quick else 240, seed=r))
        t = time.monotonic()
        n, s = judge(sim, "rootcause")
        out["seconds"].append(round(time.monotonic() - t, 2))
        out["findings"].append(n)
        out["windows_judged"].append(s["windows_judged"])
        out["tests"].append(s["tests"])
        out["raw_p_below_q"].append(s["candidates"])
        out["instances"].append(sum(int(c.complete.sum()) for c in sim.comms))
        out["findings_last_share"].append(judge(sim, "last_share")[0] if r <= 2048 or not a.quick else None)
        print(f"bench_balanced: {r} ranks: {n} findings", file=sys.stderr)
    print(json.dumps({"bench": "balanced_at_scale", "ranks": ranks, **out, "fdr_q": StragglerParams().fdr_q,
                      "quick": a.quick, "cores": os.cpu_count(), "synthetic": True}))


if __name__ == "__main__":
    main()
