"""Pool the pairs of several job_slowdown benches of the same code into one figure.

One bench of 10 pairs on this VM reads anything from -3.6 to +7.0 % with the same code (docs/
collector.md, "What a lock-step job pays for the collector's CPU"): its interval is wider than the
goal. Pairs from benches run at different hours can be pooled, because each pair's two runs were
interleaved in the same minutes; this takes bench_slowdown.py's output files (JSON lines; progress
and other benches' lines are skipped) and prints, per (app, layout, modes, stacks rate), one line
over all their pairs:

    .venv/bin/python tests/bench/pool_slowdown.py /tmp/benchN.log /tmp/benchP.json [--any-commit]

- `median_percent`: the median profiled run against the median plain run over all pairs, and its
  95 % interval (the bench's own bootstrap over the pairs);
- `pair_percent_median`: the median of the pairs' own percentages, and its 95 % interval (a
  bootstrap of that median): the figure least moved by the hours' different speeds;
- each bench's own median, bound and pairs beside them.

Lines that say different commits, or a tree with changes, are not pooled unless --any-commit
(lines written before the benches said their commit have none: they pool only with --any-commit,
and the line says so). Lines written before the benches said their stack rate pool only with
--unsaid-rate HZ, the rate they were run at.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from slowdown_stats import median_percent_interval, pair_median_interval  # beside this file


def bench_lines(path: Path) -> list[dict[str, Any]]:
    """The job_slowdown lines of a bench output with a measured median; the file named on errors."""
    out = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if not text.startswith("{"):
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not a JSON line: {e}") from None
        if line.get("bench") == "job_slowdown" and line.get("median_percent") is not None:
            for field in ("plain_s", "profiled_s"):
                if not isinstance(line.get(field), list) or not line[field]:
                    raise SystemExit(f"{path}:{n}: job_slowdown line without its runs ({field})")
            if len(line["plain_s"]) != len(line["profiled_s"]):
                raise SystemExit(f"{path}:{n}: {len(line['plain_s'])} plain runs against "
                                 f"{len(line['profiled_s'])} profiled: not pairs")
            out.append({**line, "_from": f"{path.name}:{n}"})
    return out


def pooled(lines: list[dict[str, Any]]) -> dict[str, Any]:
    plain = [t for line in lines for t in line["plain_s"]]
    prof = [t for line in lines for t in line["profiled_s"]]
    per_pair = [(p / q - 1) * 100 for p, q in zip(prof, plain, strict=True)]
    first = lines[0]
    return {"bench": "job_slowdown_pooled", "app": first["app"], "layout": first["layout"], "modes": first["modes"],
            "stacks_rate_hz": first.get("stacks_rate_hz"),
            "commits": sorted({str(line.get("commit")) for line in lines}),
            "pairs": len(plain), "benches": len(lines),
            "median_percent": round((statistics.median(prof) / statistics.median(plain) - 1) * 100, 2),
            "median_percent_ci95": median_percent_interval(plain, prof),
            "pair_percent_median": round(statistics.median(per_pair), 2),
            "pair_percent_median_ci95": pair_median_interval(per_pair),
            "pair_percent_min": round(min(per_pair), 2), "pair_percent_max": round(max(per_pair), 2),
            "each_bench": [{"from": line["_from"], "pairs": len(line["plain_s"]),
                            "median_percent": line["median_percent"],
                            "profiler_cost_bound_percent_median":
                                (line.get("profiler_cost_bound_percent") or {}).get("median"),
                            "plain_s_median": round(statistics.median(line["plain_s"]), 2)} for line in lines],
            "goal_percent": 1.0,
            "what": "pairs of interleaved runs from several benches of the same code, pooled"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="bench_slowdown.py outputs (JSON lines)")
    ap.add_argument("--any-commit", action="store_true",
                    help="pool lines of different or unknown commits, or of changed trees (the line lists the commits)")
    ap.add_argument("--unsaid-rate", type=float, default=None, metavar="HZ",
                    help="the stack rate of lines that do not say theirs (written before the benches said it)")
    a = ap.parse_args()
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for path in a.files:
        if not path.is_file():
            ap.error(f"{path}: no such file")
        for line in bench_lines(path):
            if line.get("stacks_rate_hz") is None and "stacks" in line["modes"].split(","):
                if a.unsaid_rate is None:
                    print(f"pool_slowdown: {line['_from']} does not say its stack rate: left out "
                          f"(--unsaid-rate HZ names it)", file=sys.stderr)
                    continue
                line["stacks_rate_hz"] = a.unsaid_rate
            key = (line["app"], line.get("hpl_n"), line["layout"], line["modes"], str(line.get("stacks_rate_hz")))
            groups.setdefault(key, []).append(line)
    if not groups:
        print(f"pool_slowdown: no job_slowdown line with runs in {', '.join(map(str, a.files))}", file=sys.stderr)
        return 2
    for lines in groups.values():
        versions = {(line.get("commit"), line.get("tree_changed", False)) for line in lines}
        if not a.any_commit and (len(versions) > 1 or any(c is None or changed for c, changed in versions)):
            where = ", ".join(f"{line['_from']} ({line.get('commit') or 'no commit'}"
                              f"{', tree changed' if line.get('tree_changed') else ''})" for line in lines)
            print(f"pool_slowdown: not pooled, not one commit's clean tree: {where} (--any-commit pools them)",
                  file=sys.stderr)
            continue
        print(json.dumps(pooled(lines)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
