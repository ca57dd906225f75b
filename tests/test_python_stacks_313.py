"""Python frames of CPython 3.13 (Debian 13's), on a real interpreter: the 3.13 layout read from the
process's own _Py_DebugOffsets, its frames and names, and programs with a known call tree sampled
by BPF, single-threaded and in threads.

The interpreter is Debian 13's /usr/bin/python3.13 in a minimal trixie root that `make setup` makes
(etc/dev/trixie-root.sh, GPUPROF_TRIXIE_ROOT); programs run in it with `chroot --userspec` as an
unprivileged user, so the collector sees their files through /proc/PID/root and, as /proc/PID/maps
writes them, under the root's path here. A missing root is a failure (CI runs `make setup`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

from conftest import unprivileged_user
from harness import PROGS
from py_calltree_check import check_known_tree, check_leaf_shares, gil_states, py_frames
from py_frames_check import BLOCKED_TREE, blocked_tree, check_blocked_tree, sample_with_bpf

from gpuprof.collector import pyframes, schema
from gpuprof.collector.bpf_support import attach_path, read_maps
from gpuprof.collector.pyframes import find_interpreter
from gpuprof.collector.sources.bpf_stacks import BpfStacksSource
from gpuprof.collector.symbolize import folded_stacks, stack_names

ROOT = Path(os.environ.get("GPUPROF_TRIXIE_ROOT", "/var/lib/gpuprof-test/trixie"))
STAMP = ".gpuprof-root-complete"  # written last by etc/dev/trixie-root.sh
PY313 = "/usr/bin/python3.13"  # inside the root
THREADING = "/usr/lib/python3.13/threading.py"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def _root() -> Path:
    if not (ROOT / STAMP).is_file() or not (ROOT / PY313.lstrip("/")).is_file():
        pytest.fail(f"{ROOT}: no complete Debian 13 root with {PY313} (no {STAMP}); `make setup` makes it "
                    "(etc/dev/trixie-root.sh)", pytrace=False)
    if os.geteuid() != 0:
        pytest.skip("chroot into the Debian 13 root needs root")
    return ROOT


@contextlib.contextmanager
def in_root() -> Iterator[tuple[Path, str]]:
    """A fresh directory in the root's /tmp: (its path here, its path inside the root). A test, not
    a fixture: a missing root fails the test itself."""
    root = _root()
    d = Path(tempfile.mkdtemp(prefix="gpuprof-py313-", dir=root / "tmp"))
    try:
        d.chmod(0o755)
        yield d, "/" + str(d.relative_to(root))
    finally:
        shutil.rmtree(d)


def chroot_cmd(script: str, *args: str) -> list[str]:
    pw = unprivileged_user()
    chroot = shutil.which("chroot", path=ENV["PATH"])
    assert chroot is not None, "chroot (coreutils) not found"
    # numeric ids: a user name would be looked up in the root's /etc/passwd, which lacks it
    return [chroot, f"--userspec={pw.pw_uid}:{pw.pw_gid}", str(ROOT), PY313, script, *args]


# --- the layout and frames of a 3.13 process, read as the collector reads them ----------------------
def test_313_process_in_a_debian_13_root_frames_and_names() -> None:
    """Debian 13's python3.13, chroot'ed, blocked with three threads in leaf <- middle <- outer and
    its main thread in main <- <module> (tests/progs/py_blocked_tree.py): the interpreter is found
    through its root, the layout comes from its _Py_DebugOffsets, and each thread's frames read with
    that layout name the functions, file and line of the program, in order, each C-level call
    ending at an entry frame (tests/progs/py_frames_check.py)."""
    with in_root() as (here, inside):
        shutil.copy(BLOCKED_TREE, here / "py_blocked_tree.py")
        script = f"{inside}/py_blocked_tree.py"
        with blocked_tree(chroot_cmd(script), ENV) as (p, info):
            assert info["version"] == [3, 13]
            assert os.readlink(f"/proc/{p.pid}/root") == str(ROOT)
            # the executable is found through the process's root: the file it maps, no other
            proc = find_interpreter(p.pid)
            exe = os.stat(f"/proc/{p.pid}/exe")
            st = os.stat(proc.path)
            assert (st.st_dev, st.st_ino) == (exe.st_dev, exe.st_ino), proc.path
            assert proc.path in (f"{ROOT}{PY313}", f"/proc/{p.pid}/root{PY313}"), proc.path
            maps = [m for m in read_maps(p.pid) if m.path.endswith(PY313)]
            assert maps and {attach_path(p.pid, m.path) for m in maps} == {proc.path}
            lay = proc.layout
            assert lay.version == (3, 13) and lay.tested and proc.eval_ranges
            assert lay.cframe_frame == pyframes.NONE and lay.frame_is_entry == pyframes.NONE
            check_blocked_tree(proc, info, script, THREADING)


# --- the call-tree program under BPF ----------------------------------------------------------------------
def run_calltree_313(here: Path, inside: str, tmp_path: Path, args: list[str]) -> tuple[Any, dict[str, Any],
                                                                                          Any, BpfStacksSource]:
    shutil.copy(PROGS / "py_calltree.py", here / "py_calltree.py")
    # 32 x 32 matrices: the root's numpy uses the reference BLAS, whose 96 x 96 products (the
    # program's default, sized for OpenBLAS) would leave the pure Python leaf ~1 % of the samples
    return sample_with_bpf(chroot_cmd(f"{inside}/py_calltree.py", *args), {**ENV, "PY_CALLTREE_N": "32"},
                           tmp_path / "node.h5")


_LABEL = re.compile(r"^py::(.+) \((.+):(\d+)\)$")


def _files_and_lines(names: dict[int, list[str]], script: str, within: str) -> dict[str, set[tuple[str, int]]]:
    """(file, line) of each function of the program in the stacks that run through function
    `within` (the work: a sample of main after it, at the line printing the result, is not one)."""
    out: dict[str, set[tuple[str, int]]] = {}
    for st in names.values():
        if not any(n.startswith(f"py::{within} (") for n in st):
            continue
        for n in st:
            m = _LABEL.match(n)
            if m and m[2] == script:
                out.setdefault(m[1], set()).add((m[2], int(m[3])))
    return out


@pytest.mark.bpf
def test_313_call_tree_single_thread(tmp_path: Path) -> None:
    """py_calltree.py (main -> run_for -> train_step -> forward -> layer -> numpy's matmul, and
    forward -> activation) under Debian 13's python3.13: the work's samples hold its Python frames
    in order, with the program's file and the lines being run."""
    with in_root() as (here, inside):
        rows, info, f, src = run_calltree_313(here, inside, tmp_path, ["3"])
    names = stack_names(f)
    got = check_known_tree(rows, names, info["tids"], ("py::<module>", "py::main"), outermost=True,
                           t_work_ns=info["t_work_ns"])
    print("python3.13 single thread:", json.dumps({k: dict(v) if k == "leaves" else v for k, v in got.items()}))
    assert got["with_py"] >= 0.9 * got["total"], got
    check_leaf_shares(got, info)
    assert got["layer_with_native"] >= 0.8 * got["leaves"]["py::layer"], got  # numpy's C code above layer
    script = f"{inside}/py_calltree.py"
    src_lines = (PROGS / "py_calltree.py").read_text().splitlines()

    def line_of(text: str, after: str = "") -> int:
        """The first line holding text (after the line holding `after`)."""
        start = next(i for i, t in enumerate(src_lines, 1) if after in t)
        return next(i for i, t in enumerate(src_lines, 1) if i >= start and text in t)

    where = _files_and_lines(names, script, within="run_for")
    # the line being run in each caller: its call of the next function down
    assert where["forward"] >= {(script, line_of("y = layer(x)"))}, where["forward"]
    # or at its `def` line: a frame sampled at its first instruction (RESUME is on the def line)
    for func, line, def_line in (
            ("train_step", line_of("return forward(x)"), line_of("def train_step(")),
            ("main", line_of("run_for(seconds)", after="def main"), line_of("def main(")),
            ("layer", line_of("return np.matmul(x, A)"), line_of("def layer(", after='LEAF == "numpy"'))):
        assert (script, line) in where[func] and where[func] <= {(script, line), (script, def_line)}, \
            (func, where[func], line, def_line)
    callers = {st[i + 1] for st in names.values() for i, n in enumerate(st[:-1])
               if n.startswith("py::layer (") and st[i + 1].startswith("py::forward (")}
    assert callers == {f"py::forward ({script}:{line_of('y = layer(x)')})"}, callers
    # numpy's C code above layer, named through the root: the reference BLAS's dgemm_ innermost
    assert any(";py::layer (" in k and k.endswith(";cblas_dgemm;dgemm_") for k in folded_stacks(f)), \
        sorted(folded_stacks(f))[:5]
    walked, _missing, not_stored, _truncated = src.python.last_counts
    assert walked > 0 and not_stored == 0
    # the GIL, read through the thread's interpreter at the debug offsets: held in the pure Python loop
    held = gil_states(rows, names, "py::activation")
    assert held[schema.GIL_HELD] >= 0.9 * sum(held.values()) > 0, held


@pytest.mark.bpf
def test_313_call_tree_threads(tmp_path: Path) -> None:
    """Three threads in the same tree under python3.13: each sample is named from its own thread's
    frames, under threading's Thread.run (python3.13's own threading.py, inside the root)."""
    with in_root() as (here, inside):
        rows, info, f, _ = run_calltree_313(here, inside, tmp_path, ["3", "3"])
    names = stack_names(f)
    assert len(info["tids"]) == 3
    for tid in info["tids"]:
        got = check_known_tree(rows, names, [tid], ("py::Thread._bootstrap_inner", "py::Thread.run",
                                                    "py::spawn_workers.<locals>.work"), t_work_ns=info["t_work_ns"])
        print(f"python3.13 thread {tid}:", json.dumps({k: dict(v) if k == "leaves" else v for k, v in got.items()}))
        assert got["with_py"] >= 0.9 * got["total"], (tid, got)
    threading_frames = {n for st in names.values() for n in st if n.startswith("py::Thread.run (")}
    assert threading_frames and all(f"({THREADING}:" in n for n in threading_frames), threading_frames
    for r in rows[rows["tid"] == info["pid"]]:
        assert "py::run_for" not in py_frames(names.get(int(r["user_stack"]), [])), "a worker's frames on main"
