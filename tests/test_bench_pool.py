"""tests/bench/pool_slowdown.py: pairs of job_slowdown benches pooled only when they measured the
same code at the same stack rate, and the pooled figures those of all the pairs together."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

POOL = Path(__file__).resolve().parent / "bench" / "pool_slowdown.py"


def bench_line(plain: list[float], prof: list[float], **extra: Any) -> dict[str, Any]:
    return {"bench": "job_slowdown", "app": "gromacs", "layout": "node", "modes": "metrics,stacks,collectives",
            "commit": "a" * 40, "tree_changed": False, "stacks_rate_hz": 19.0,
            "median_percent": round((statistics.median(prof) / statistics.median(plain) - 1) * 100, 2),
            "plain_s": plain, "profiled_s": prof, **extra}


def write(path: Path, *lines: dict[str, Any]) -> Path:
    # as the bench writes them: a control line and progress beside the job_slowdown lines
    path.write_text("\n".join([json.dumps({"bench": "job_slowdown_displaced_control", "seconds": 10.0}),
                               *map(json.dumps, lines)]) + "\n")
    return path


def pool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(POOL), *map(str, args)], capture_output=True, text=True, timeout=60,
                          check=False)


def test_pairs_of_the_same_code_are_pooled(tmp_path: Path) -> None:
    a = write(tmp_path / "a.json", bench_line([30.0, 31.0, 29.0], [30.6, 31.2, 29.9]))
    b = write(tmp_path / "b.json", bench_line([28.0, 27.0], [28.1, 27.5]))
    r = pool(a, b)
    assert r.returncode == 0, r.stderr
    (line,) = [json.loads(x) for x in r.stdout.splitlines()]
    plain, prof = [30.0, 31.0, 29.0, 28.0, 27.0], [30.6, 31.2, 29.9, 28.1, 27.5]
    assert line["pairs"] == 5 and line["benches"] == 2
    assert line["median_percent"] == round((statistics.median(prof) / statistics.median(plain) - 1) * 100, 2)
    pairs = [(p / q - 1) * 100 for p, q in zip(prof, plain, strict=True)]
    assert line["pair_percent_median"] == round(statistics.median(pairs), 2)
    lo, hi = line["pair_percent_median_ci95"]
    assert min(pairs) - 1e-9 <= lo <= line["pair_percent_median"] <= hi <= max(pairs) + 1e-9
    assert [b["pairs"] for b in line["each_bench"]] == [3, 2]


def test_other_code_or_a_changed_tree_is_not_pooled_unless_asked(tmp_path: Path) -> None:
    a = write(tmp_path / "a.json", bench_line([30.0], [30.3]))
    b = write(tmp_path / "b.json", bench_line([30.0], [30.9], commit="b" * 40))
    r = pool(a, b)
    assert r.returncode == 0 and r.stdout == ""
    assert "not one commit's clean tree" in r.stderr and "a.json:2" in r.stderr and "b.json:2" in r.stderr
    changed = write(tmp_path / "c.json", bench_line([30.0], [30.9], tree_changed=True))
    assert pool(a, changed).stdout == ""
    r = pool(a, b, "--any-commit")
    (line,) = [json.loads(x) for x in r.stdout.splitlines()]
    assert line["pairs"] == 2 and line["commits"] == ["a" * 40, "b" * 40]


def test_a_line_that_does_not_say_its_stack_rate_needs_it_named(tmp_path: Path) -> None:
    """Benches written before the lines said their rate: pooled only at the rate the user names,
    and never with lines of another rate."""
    old = bench_line([30.0], [30.3])
    del old["stacks_rate_hz"], old["commit"], old["tree_changed"]
    a = write(tmp_path / "old.json", old)
    r = pool(a, "--any-commit")
    assert r.returncode == 2 and "does not say its stack rate" in r.stderr and "old.json:2" in r.stderr
    at_49 = json.loads(pool(a, "--any-commit", "--unsaid-rate", "49").stdout)
    assert at_49["stacks_rate_hz"] == 49.0 and at_49["pairs"] == 1
    new = write(tmp_path / "new.json", bench_line([30.0], [30.6]))
    lines = [json.loads(x) for x in pool(a, new, "--any-commit", "--unsaid-rate", "49").stdout.splitlines()]
    assert sorted((x["stacks_rate_hz"], x["pairs"]) for x in lines) == [(19.0, 1), (49.0, 1)]


def test_a_broken_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(bench_line([30.0], [30.3])) + "\n{not json\n")
    r = pool(bad)
    assert r.returncode != 0 and "bad.json:2" in r.stderr
    unpaired = write(tmp_path / "unpaired.json", bench_line([30.0, 31.0], [30.3]))
    r = pool(unpaired)
    assert r.returncode != 0 and "unpaired.json:2" in r.stderr and "not pairs" in r.stderr
