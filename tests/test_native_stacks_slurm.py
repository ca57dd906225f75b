"""Native programs built without frame pointers, each with a known call tree, run as an ordinary
user under `sbatch --profile-gpu=stacks` on the local cluster (the collector started by the prolog,
its unwinder the default one, CFI): the node file's stacks read as each program's tree, down to
`main` and the C library's start (or the thread's start). The same programs through the stacks
source alone: tests/test_cfi_unwind.py."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

import native_progs
from harness import bpf_skip_reason
from stackcopy_run import NOFP_TREE, nofp_tree

pytestmark = [pytest.mark.slurm, pytest.mark.bpf]

SECONDS = 4  # each program's run: the registration of a new process takes a drain or two
Stack = tuple[str, ...]


def _fortran(name: str) -> tuple[str, ...]:
    """A gfortran module procedure as the symbol table has it and as the symbolizer may name it."""
    return (f"__tree_MOD_{name}", f"tree::{name}")


def _to_start(s: Stack) -> bool:
    return "main" in s and (s[-1] == "_start" or "__libc_start_main" in s)


def _tree(*levels: tuple[str, ...] | str, contains: bool = False) -> Callable[[Stack], bool]:
    """stack -> whether its innermost frames are `levels` (each one name, or names it may have;
    contains: the frame's name holds it, for C++ templates and their arguments)."""
    want = [(lv,) if isinstance(lv, str) else lv for lv in levels]

    def ok(s: Stack) -> bool:
        if len(s) < len(want):
            return False
        return all(any((w in f) if contains else (w == f) for w in names) for names, f in zip(want, s))

    return ok


# (program, command line, its tree from the leaf, the stack's outer end is the process's start:
# True, or the thread's start in the C library: False)
def _programs() -> list[tuple[str, list[str], Callable[[Stack], bool], bool]]:
    progs: list[tuple[str, list[str], Callable[[Stack], bool], bool]] = [
        ("c", [str(nofp_tree()), str(SECONDS)], _tree(*NOFP_TREE), True),
        ("cpp", [str(native_progs.nofp_cpp()), str(SECONDS)],
         _tree("spin<3>", "Mix::step", "apply<Mix>", "Runner<Mix>::run", "main", contains=True), True),
        ("threads", [str(native_progs.nofp_threads()), str(SECONDS)], _tree("spin", "work_b", "work_a", "worker"),
         False),
    ]
    prog, lib = native_progs.nofp_dlopen()
    progs.append(("dlopen", [str(prog), str(lib), str(SECONDS)],
                  _tree("plugin_leaf", "plugin_work", "run_plugin", "main"), True))
    if native_progs.fortran_skip_reason() is None:
        progs.append(("fortran", [str(native_progs.nofp_fortran()), str(SECONDS)],
                      _tree(_fortran("leaf_spin"), _fortran("level_b"), _fortran("level_a"), "MAIN__", "main"),
                      True))
    return progs


def _job_script(progs: list[tuple[str, list[str], Any, bool]]) -> str:
    """Runs the programs one after the other, each line of pids.txt: name and pid."""
    lines = ["#!/bin/bash", "set -e"]
    for name, cmd, _, _ in progs:
        lines.append(f"{' '.join(cmd)} > /dev/null & echo \"{name} $!\" >> pids.txt; wait $!")
    return "\n".join(lines) + "\n"


def _node_stacks(node: Path) -> tuple[np.ndarray, dict[int, Stack], dict[int, tuple[str, ...]], dict[str, Any]]:
    with h5py.File(node, "r") as f:
        attach = json.loads(f.attrs["attach_json"])
        unwind = json.loads(f.attrs["unwind_json"])
        rows = f["stacks/samples"][()]
        sym = {int(s["symbol_id"]): (s["name"].decode(errors="replace"), s["module"].decode(errors="replace"))
               for s in f["stacks/symbols"][()]}
        by: dict[int, list[tuple[int, int]]] = {}
        for r in f["stacks/frames"][()]:
            by.setdefault(int(r["stack_id"]), []).append((int(r["depth"]), int(r["symbol_id"])))
    names = {k: tuple(sym[i][0] for _, i in sorted(v)) for k, v in by.items()}
    modules = {k: tuple(sym[i][1] for _, i in sorted(v)) for k, v in by.items()}
    return rows, names, modules, {"attach": attach, "unwind": unwind}


def _from_registration(rows: np.ndarray, names: dict[int, Stack], ok: Callable[[Stack], bool]) -> Counter[Stack]:
    """Samples by user stack from the first window holding a stack of the known tree on: a new
    process is walked by CFI once the collector registered its tables (its first moments, and on
    a cold node the seconds its tables compile, keep frame-pointer stacks)."""
    stacks = [names.get(int(r["user_stack"]), ()) for r in rows]
    t0 = min((int(r["t_ns"]) for r, s in zip(rows, stacks) if ok(s)), default=None)
    c: Counter[Stack] = Counter()
    for r, s in zip(rows, stacks):
        if t0 is not None and int(r["t_ns"]) >= t0:
            c[s] += int(r["count"])
    return c


def test_programs_without_frame_pointers_under_sbatch(cluster: Any, test_user: str, user_tmpdir: Path) -> None:
    """C, C++ (templates), Fortran, a library dlopen()ed after start and a threaded program, all
    -O2 -fomit-frame-pointer: >= 0.9 of each program's samples (after its registration) hold its
    whole tree and go on to its start; each program has samples after registration."""
    reason = bpf_skip_reason() or native_progs.cc_skip_reason()
    if reason:
        pytest.skip(reason)
    progs = _programs()
    script = user_tmpdir / "job.sh"
    script.write_text(_job_script(progs))
    script.chmod(0o755)
    job = cluster.sbatch(["-N1", "--profile-gpu=stacks", str(script)], user=test_user, cwd=user_tmpdir)
    info = cluster.wait_job(job, timeout=240)
    assert info["JobState"] == "COMPLETED", (user_tmpdir / f"slurm-{job}.out").read_text()
    node = user_tmpdir / f"slurm-{job}.gpuprof.d" / "node1.h5"
    deadline = time.monotonic() + 30
    while not node.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    rows, names, modules, meta = _node_stacks(node)
    assert meta["attach"]["stacks"]["state"] == "attached", meta["attach"]
    assert meta["unwind"]["unwinder"] == "cfi", meta["unwind"]
    pids = {line.split()[0]: int(line.split()[1]) for line in (user_tmpdir / "pids.txt").read_text().splitlines()}
    report = {}
    for name, _, ok, process_start in progs:
        mine = rows[rows["pid"] == pids[name]]
        c = _from_registration(mine, names, ok)
        total = sum(c.values())
        if process_start:
            whole = sum(n for s, n in c.items() if ok(s) and _to_start(s))
        else:  # a thread's stack ends in the C library's thread start (unnamed in Debian's libc)
            outer = {names[k]: modules[k][-1] for k in names if modules[k]}
            whole = sum(n for s, n in c.items() if ok(s) and outer.get(s, "").startswith("libc.so"))
        if not total:  # no stack of the tree at all: what was there instead
            c = Counter()
            for r in mine:
                c[names.get(int(r["user_stack"]), ())] += int(r["count"])
        report[name] = (whole, total, [(n, ";".join(s)) for s, n in c.most_common(3)])
    ends = {k: v for k, v in (meta["unwind"]["cfi"] or {}).items() if k.startswith("end_") and v}
    for name, (whole, total, top) in report.items():
        assert total >= 50, (name, report, ends)
        assert whole >= 0.9 * total, (name, report, ends)
