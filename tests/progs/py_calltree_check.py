"""The samples of tests/progs/py_calltree.py against its known call tree (the Python stack tests of
3.11, tests/test_python_stacks.py, and of 3.13 in a Debian 13 root, tests/test_python_stacks_313.py)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from gpuprof.collector.symbolize import folded_stacks, stack_names

KNOWN_CHAIN = ("py::run_for", "py::train_step", "py::forward")


def py_frames(names: list[str]) -> list[str]:
    """The Python frames of a stack, root first, as `py::function`."""
    return [n.split(" (")[0] for n in reversed(names) if n.startswith("py::")]


def gil_states(rows: Any, names: dict[int, list[str]], innermost_py: str, native_leaf: str = "") -> Counter[int]:
    """Samples per GIL state (schema.GIL_*) of the stacks whose innermost Python frame is
    `innermost_py` (`py::function`) and, with native_leaf, whose innermost frame starts with it."""
    out: Counter[int] = Counter()
    for r in rows:
        st = names.get(int(r["user_stack"]), [])
        py = [n.split(" (")[0] for n in st if n.startswith("py::")]
        if py and py[0] == innermost_py and (not native_leaf or (st and st[0].startswith(native_leaf))):
            out[int(r["gil"])] += int(r["count"])
    return out


def check_known_tree(rows: Any, names: dict[int, list[str]], tids: list[int], root: tuple[str, ...],
                     outermost: bool = False, t_work_ns: int = 0) -> dict[str, Any]:
    """The samples of the worker threads against the program's call tree: every Python stack of the
    work (in run_for) holds `root` (from the outermost frame when `outermost`) then the known
    chain, in order. Counted: the samples of windows that started after t_work_ns (the work, not
    the interpreter's start-up before the collector found it)."""
    mine = rows[np.isin(rows["tid"], tids) & (rows["t_ns"] >= t_work_ns)]
    total = int(mine["count"].sum())
    with_py = 0
    leaves: Counter[str] = Counter()
    layer_with_native = 0
    for r in mine:
        stack = names.get(int(r["user_stack"]), [])
        py = py_frames(stack)
        n = int(r["count"])
        if not py:
            continue
        with_py += n
        if "py::run_for" not in py:
            continue  # interpreter start-up, imports (site.main, numpy.random): not the known tree
        assert root[-1] in py, py
        at = py.index(root[-1]) + 1
        assert tuple(py[at - len(root): at]) == root and (at == len(root) or not outermost), py
        assert tuple(py[at: at + 3]) == KNOWN_CHAIN[: len(py) - at], py
        leaves[py[-1]] += n
        if py[-1] == "py::layer" and not stack[0].startswith("py::"):
            layer_with_native += n  # numpy's C code above the Python frame that called it
    assert total > 0
    return {"total": total, "with_py": with_py, "leaves": leaves, "layer_with_native": layer_with_native}


def check_leaf_shares(got: dict[str, Any], info: dict[str, Any]) -> None:
    """Each leaf of the tree (layer, activation) holds the share of the samples that the program
    measured of its CPU time (info["leaf_shares"], the threads' clocks around each call): within
    four binomial standard deviations of the sample count, plus 3 % of the samples for the
    windows' edges (start-up and the end are in the total, not in the leaves); and each leaf is
    seen at all (at least a quarter of its measured share)."""
    total = got["total"]
    for leaf, share in info["leaf_shares"].items():
        seen = got["leaves"][leaf]
        expected = share * total
        slack = 4 * (total * share * (1 - share)) ** 0.5 + 0.03 * total
        assert abs(seen - expected) <= slack, (leaf, seen, expected, slack, got)
        assert seen >= 0.25 * expected, (leaf, seen, expected, got)


def sbatch_job_stacks(job_dir: Path, job: int | str) -> tuple[dict[str, Any], Any, dict[int, list[str]], Counter[str]]:
    """Of a finished `sbatch --profile-gpu=stacks` job of py_calltree.py run in job_dir: the program's
    JSON line, node1's /stacks/samples rows, their stack names and folded stacks. The node file may
    come a little after the job's end (the epilog seals it): waited for up to 30 s. Skips when the
    node file says BPF was not attached."""
    node = job_dir / f"slurm-{job}.gpuprof.d" / "node1.h5"
    deadline = time.monotonic() + 30
    while not node.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    if not node.exists():
        notes = {p.name: p.read_text() for p in node.parent.glob("*.problem.txt")} if node.parent.exists() else {}
        found = sorted(p.name for p in node.parent.iterdir()) if node.parent.exists() else "no directory"
        raise AssertionError(f"{node} missing 30 s after the job's end; found {found}; notes {notes}")
    info = json.loads((job_dir / f"slurm-{job}.out").read_text().strip().splitlines()[-1])
    with h5py.File(node, "r") as f:
        attach = json.loads(f.attrs["attach_json"])
        if attach.get("stacks", {}).get("state") != "attached":
            pytest.skip(f"BPF unavailable on the nodes: {attach.get('stacks')}")
        return info, f["stacks/samples"][()], stack_names(f), folded_stacks(f)
