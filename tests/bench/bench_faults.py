"""The fault suite's figures (issue 11): runs tests/test_hook_faults.py and tests/test_faults.py (the
latter on the local cluster) and adds up what each case's checks found (tests/faultcheck.py), so the
figures come from the same checks the tests assert. One JSON line:

    {"bench": "faults", "cases": N, "drained": 0, "paused_left": 0, "collectors_left": 0,
     "lost_outputs": 0, "failed": [...], "skipped": {...}, "results": {case: "complete" | "partial: ..."}}

    .venv/bin/python tests/bench/bench_faults.py [--quick]      (--quick: the cases without a cluster)
Needs root; the cluster cases need the local cluster (`make cluster`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the cases that need no cluster")
    a = ap.parse_args()
    files = ["tests/test_hook_faults.py"] + ([] if a.quick else ["tests/test_faults.py"])
    with tempfile.TemporaryDirectory(prefix="gpuprof-faults-bench-") as d:
        results = Path(d) / "results.jsonl"
        junit = Path(d) / "junit.xml"
        env = dict(os.environ, GPUPROF_FAULTS_RESULTS=str(results))
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                            f"--junitxml={junit}", *files], cwd=ROOT, env=env, capture_output=True, text=True,
                           check=False)
        outcomes = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        junit_text = junit.read_text() if junit.exists() else ""
    outcomes = [o for o in outcomes if o["case"] != "x"]  # the results file's own unit test
    failed = re.findall(r'<testcase classname="[^"]*" name="([^"]+)"[^>]*>\s*<(?:failure|error)', junit_text)
    skipped: dict[str, str] = {}
    for line in p.stdout.splitlines():
        m = re.match(r"SKIPPED \[\d+\] (\S+?):(\d+): (.*)", line)
        if m:
            skipped[f"{Path(m.group(1)).name}:{m.group(2)}"] = m.group(3)[:300]
    line = {
        "bench": "faults", "cases": len(outcomes),
        "drained": sum(o["drained"] for o in outcomes), "paused_left": sum(o["paused_left"] for o in outcomes),
        "collectors_left": sum(o["collectors_left"] for o in outcomes),
        "lost_outputs": sum(o["lost_outputs"] for o in outcomes),
        "failed": failed, "skipped": skipped,
        "results": {o["case"]: o["result"][:160] for o in outcomes},
        "pytest_rc": p.returncode, "cluster_cases": not a.quick,
    }
    if p.returncode not in (0, 5) and not failed:
        line["pytest_tail"] = p.stdout[-1500:] + p.stderr[-500:]
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
