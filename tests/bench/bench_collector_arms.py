"""Collector settings against each other on a real job: profiled runs of one application of
tests/realapps, interleaved, each run under one arm's [collector] settings (written into the local
cluster's gpuprof.toml, $GPUPROF_CONFIG, before its sbatch, and the file restored at the end), and
what the collector's CPU displaced in each (tests/bench/displaced.py, as bench_slowdown --displaced).

The slowdown's pairs spread over several points on this VM, more than a setting moves; what a
setting changes is read in the runs' own figures, pair by pair:
- `preempted_rank_ms`: the collector's run time on a computing rank's core (the job loses it);
- `yielded_worked_ms`: on the core of a rank polling in sched_yield that then had work (an upper
  bound of what that rank lost);
- `taken_ms`: the two added up, what the ranks can have lost to the collector;
- `collector_ms`: the collector's CPU inside the timed line.

    .venv/bin/python tests/bench/bench_collector_arms.py [--app gromacs] [--layout node] [--pairs 6]
        [--arm 'other=sched_batch = false' --arm 'batch=']

An arm is NAME=TOML, the lines added under [collector] (`\\n` between lines; empty: the defaults).
Each run prints one JSON line; at the end, one line per arm with the medians (min, max) over its
runs, and, for every arm after the first, its difference from the first in each pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_slowdown as bs  # beside this file
from displaced import Displacement
from realapps import apps as apps_mod

FIGURES = ("preempted_rank_ms", "yielded_worked_ms", "taken_ms", "collector_ms", "seconds")


def parse_arm(text: str) -> tuple[str, str]:
    name, sep, toml = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--arm {text!r}: NAME=TOML lines under [collector] (empty: the defaults)")
    return name, toml.replace("\\n", "\n").strip()


def figures(r: bs.Run) -> dict[str, float]:
    if r.displaced_ms is None or r.outcomes_ms is None:
        raise RuntimeError("a profiled run without the displacement figures")
    preempted = r.displaced_ms.get("preempted_rank", 0.0)
    worked = r.outcomes_ms.get("worked", 0.0)
    return {"preempted_rank_ms": round(preempted, 1), "yielded_worked_ms": round(worked, 1),
            "taken_ms": round(preempted + worked, 1), "collector_ms": round(r.collector_ms, 1),
            "seconds": r.seconds}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--app", default="gromacs")
    ap.add_argument("--layout", default="node", choices=("node", "shared", "nodes"))
    ap.add_argument("--pairs", type=int, default=6, help="rounds of one run per arm, the arms' order rotated")
    ap.add_argument("--arm", action="append", type=parse_arm,
                    help="NAME=TOML (default: other=sched_batch = false, batch=)")
    a = ap.parse_args()
    arms = a.arm or [("other", "sched_batch = false"), ("batch", "")]
    toml = Path(os.environ["GPUPROF_CONFIG"])
    original = toml.read_text()
    app = apps_mod.get(a.app)
    if app.name == "gromacs":
        app = apps_mod.gromacs_steps(app, bs.GROMACS_STEPS)
    app.check()
    version = bs.code_version()
    base = Path(tempfile.mkdtemp(prefix="gpuprof-arms-", dir="/var/tmp"))
    base.chmod(0o755)
    displacement = Displacement(Path(app.argv[0]).name)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in arms}
    try:
        for i in range(a.pairs):
            order = arms[i % len(arms):] + arms[:i % len(arms)]
            for k, (name, lines) in enumerate(order):
                toml.write_text(original + (f"\n[collector]\n{lines}\n" if lines else ""))
                r = bs.one_run(app, True, base, i * len(arms) + k, "", a.layout, None, False, displacement)
                runs[name].append(figures(r))
                print(json.dumps({"bench": "collector_arm_run", "arm": name, "pair": i, **runs[name][-1]}), flush=True)
    finally:
        toml.write_text(original)
        displacement.close()
    first = arms[0][0]
    for name, lines in arms:
        line: dict[str, Any] = {"bench": "collector_arm", "app": app.name, "layout": a.layout, "arm": name,
                                "collector_toml": lines, "runs": len(runs[name]), **version}
        line.update({f: spread([r[f] for r in runs[name]]) for f in FIGURES})
        line["taken_percent_of_run"] = spread([r["taken_ms"] / r["seconds"] / 10 for r in runs[name]])
        line["preempted_rank_percent_of_run"] = spread([r["preempted_rank_ms"] / r["seconds"] / 10 for r in runs[name]])
        if name != first:
            line[f"taken_ms_minus_{first}_by_pair"] = [round(r["taken_ms"] - f["taken_ms"], 1)
                                                      for r, f in zip(runs[name], runs[first])]
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
