"""Python frames of CPython 3.10-3.13 on pyenv's builds (/root/.pyenv/versions, part of this
machine's image): each layout against offsetof() over that build's own headers, the frames of a
blocked program read with the layout the collector chose, and programs with a known call tree
sampled by BPF, single-threaded and in threads.

pyenv's builds are shared-library ones (the executable maps libpython3.X.so.1.0, which defines
_PyRuntime), unlike Debian's python3.11 (tests/test_python_stacks.py) and python3.13
(tests/test_python_stacks_313.py), whose executables hold the interpreter. They have no numpy: the
call-tree program runs with PY_CALLTREE_LEAF=zlib (zlib.crc32, C code, under `layer`). The programs
run as root, as the interpreters live under /root. A missing interpreter skips its tests, naming
its path."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

from harness import PROGS
from py_calltree_check import check_known_tree, check_leaf_shares, gil_states, py_frames, sbatch_job_stacks
from py_frames_check import BLOCKED_TREE, blocked_tree, check_blocked_tree, sample_with_bpf

from gpuprof.collector import pyframes, schema
from gpuprof.collector.pyframes import LAYOUTS, find_interpreter
from gpuprof.collector.sources.bpf_stacks import BpfStacksSource
from gpuprof.collector.symbolize import folded_stacks, stack_names

PYENV = Path("/root/.pyenv/versions")
VERSIONS = ("3.10.13", "3.11.7", "3.12.1", "3.13.0")
CALLTREE = str(PROGS / "py_calltree.py")
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def _minor(version: str) -> tuple[int, int]:
    major, minor, _ = version.split(".")
    return int(major), int(minor)


def _python(version: str) -> str:
    """pyenv's interpreter of `version` (a skip naming its path when this machine lacks it)."""
    minor = _minor(version)
    exe = PYENV / version / "bin" / f"python{minor[0]}.{minor[1]}"
    if not os.access(PYENV, os.X_OK):
        pytest.skip(f"{PYENV} not readable by uid {os.geteuid()} (pyenv's builds live under /root)")
    if not exe.is_file():
        pytest.skip(f"{exe} missing: pyenv's build of Python {version} is not on this machine")
    return str(exe)


def _libpython(version: str) -> Path:
    major, minor = _minor(version)
    return PYENV / version / "lib" / f"libpython{major}.{minor}.so.1.0"


def _threading_py(version: str) -> str:
    major, minor = _minor(version)
    return str(PYENV / version / "lib" / f"python{major}.{minor}" / "threading.py")


# --- the layouts against each build's own headers -----------------------------------------------------
# field of PyLayout -> (struct, member) per version; offsetof() of each over the build's headers
_GIL_FIELDS = {"gil_holder": ("struct _gil_runtime_state", "last_holder"),
               "gil_locked": ("struct _gil_runtime_state", "locked")}
_FIELDS_310 = {
    "runtime_interp_head": ("_PyRuntimeState", "interpreters.head"), "interp_next": ("PyInterpreterState", "next"),
    "interp_threads_head": ("PyInterpreterState", "tstate_head"), "tstate_next": ("PyThreadState", "next"),
    "tstate_thread_id": ("PyThreadState", "thread_id"), "tstate_frame": ("PyThreadState", "frame"),
    "frame_code": ("PyFrameObject", "f_code"), "frame_previous": ("PyFrameObject", "f_back"),
    "frame_instr": ("PyFrameObject", "f_lasti"), "code_filename": ("PyCodeObject", "co_filename"),
    "code_name": ("PyCodeObject", "co_name"), "code_linetable": ("PyCodeObject", "co_linetable"),
    "code_firstlineno": ("PyCodeObject", "co_firstlineno"),
    "gil_runtime": ("_PyRuntimeState", "ceval.gil"), **_GIL_FIELDS,
}
_FIELDS_311_312 = {
    "runtime_interp_head": ("_PyRuntimeState", "interpreters.head"), "interp_next": ("PyInterpreterState", "next"),
    "interp_threads_head": ("PyInterpreterState", "threads.head"), "tstate_next": ("PyThreadState", "next"),
    "tstate_thread_id": ("PyThreadState", "native_thread_id"), "tstate_frame": ("PyThreadState", "cframe"),
    "cframe_frame": ("_PyCFrame", "current_frame"), "frame_code": ("_PyInterpreterFrame", "f_code"),
    "frame_previous": ("_PyInterpreterFrame", "previous"), "frame_instr": ("_PyInterpreterFrame", "prev_instr"),
    "code_filename": ("PyCodeObject", "co_filename"), "code_name": ("PyCodeObject", "co_qualname"),
    "code_linetable": ("PyCodeObject", "co_linetable"), "code_firstlineno": ("PyCodeObject", "co_firstlineno"),
    "code_adaptive": ("PyCodeObject", "co_code_adaptive"),
}
HEADER_FIELDS = {
    (3, 10): _FIELDS_310,
    (3, 11): {**_FIELDS_311_312, "frame_is_entry": ("_PyInterpreterFrame", "is_entry"),
              "gil_runtime": ("_PyRuntimeState", "ceval.gil"), **_GIL_FIELDS},
    (3, 12): {**_FIELDS_311_312, "frame_owner": ("_PyInterpreterFrame", "owner"),
              "tstate_interp": ("PyThreadState", "interp"), "interp_ceval_gil": ("PyInterpreterState", "ceval.gil"),
              **_GIL_FIELDS},
}
_INCLUDES = {(3, 10): ("frameobject.h", "internal/pycore_interp.h", "internal/pycore_runtime.h")}
_INCLUDES_311 = ("internal/pycore_frame.h", "internal/pycore_interp.h", "internal/pycore_runtime.h")


def _offsets_over_headers(version: str, fields: dict[str, tuple[str, str]], extra: str, tmp_path: Path) -> dict[str, int]:
    """name -> value, printed by a C program compiled against the build's own headers."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc missing: apt-get install gcc")
    major, minor = _minor(version)
    inc = PYENV / version / "include" / f"python{major}.{minor}"
    if not (inc / "internal" / "pycore_runtime.h").is_file():
        pytest.skip(f"{inc}/internal/pycore_runtime.h missing: the build's internal headers")
    includes = _INCLUDES.get((major, minor), _INCLUDES_311)
    src = ["#define Py_BUILD_CORE 1", "#include <Python.h>", *(f"#include <{h}>" for h in includes),
           "#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    src += [f'    printf("{k} %zu\\n", offsetof({s}, {f}));' for k, (s, f) in fields.items()]
    src += [extra, "    return 0;", "}"]
    (tmp_path / "off.c").write_text("\n".join(src) + "\n")
    subprocess.run(["gcc", f"-I{inc}", str(tmp_path / "off.c"), "-o", str(tmp_path / "off")], check=True)
    out = subprocess.run([str(tmp_path / "off")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("version", [v for v in VERSIONS if _minor(v) in HEADER_FIELDS])
def test_layout_is_the_builds_own_headers(version: str, tmp_path: Path) -> None:
    """Every offset of the version's table, the str object sizes and the entry frames' owner value,
    against offsetof() and sizeof() over pyenv's headers of that version."""
    _python(version)
    minor = _minor(version)
    extra = ('    printf("unicode_ascii_size %zu\\nunicode_compact_size %zu\\n", sizeof(PyASCIIObject), '
             'sizeof(PyCompactUnicodeObject));')
    if minor >= (3, 12):
        extra += '\n    printf("owner_cstack %d\\n", (int)FRAME_OWNED_BY_CSTACK);'
    want = _offsets_over_headers(version, HEADER_FIELDS[minor], extra, tmp_path)
    lay = LAYOUTS[minor]
    got = {k: getattr(lay, k) for k in want if k != "owner_cstack"}
    if "owner_cstack" in want:
        got["owner_cstack"] = pyframes.FRAME_OWNED_BY_CSTACK
    assert got == want
    # the fields this version lacks are marked so (the BPF walk reads them as absent)
    for k in {"cframe_frame", "frame_owner", "frame_is_entry"} - set(HEADER_FIELDS[minor]):
        assert getattr(lay, k) == pyframes.NONE, k


def test_313_debug_offsets_order_is_the_headers_own(tmp_path: Path) -> None:
    """The order of _Py_DebugOffsets' fields the collector reads, against offsetof() over pyenv's
    3.13.0 header (a second 3.13 release; Debian 13's 3.13.5 was compared by hand)."""
    version = "3.13.0"
    _python(version)
    fields = {name: ("_Py_DebugOffsets", name) for name in pyframes._DEBUG_OFFSETS_313}
    got = _offsets_over_headers(version, fields, '    printf("sizeof %zu\\n", sizeof(_Py_DebugOffsets));', tmp_path)
    n = len(pyframes._DEBUG_OFFSETS_313)
    assert got == {**{name: 8 + 8 * i for i, name in enumerate(pyframes._DEBUG_OFFSETS_313)}, "sizeof": 8 + 8 * n}


# --- a blocked program's frames, read with the layout the collector chose ------------------------------
@pytest.mark.parametrize("version", VERSIONS)
def test_blocked_program_frames_and_names(version: str) -> None:
    """pyenv's interpreter blocked with three threads in leaf <- middle <- outer and its main thread
    in main <- <module>: the interpreter is found in the libpython it maps, with the version's
    layout, and each thread's frames read with that layout name the functions, file and line of
    the program, in order, runs ending where the C-level calls of the evaluation loop end."""
    exe = _python(version)
    with blocked_tree([exe, str(BLOCKED_TREE)], ENV) as (p, info):
        assert tuple(info["version"]) == _minor(version)
        proc = find_interpreter(p.pid)
        assert os.path.realpath(proc.path) == str(_libpython(version)), proc.path
        assert proc.eval_ranges, f"no _PyEval_EvalFrameDefault in {proc.path}"
        assert proc.layout.version == _minor(version)
        runs = check_blocked_tree(proc, info, str(BLOCKED_TREE), _threading_py(version))
        assert set(runs) == {info["main"], *info["workers"]}
        assert proc.layout.tested, "the layout passes here: mark it tested"


# --- the call-tree program under BPF -------------------------------------------------------------------
def run_calltree(version: str, tmp_path: Path, args: list[str]) -> tuple[Any, dict[str, Any], Any, BpfStacksSource]:
    return sample_with_bpf([_python(version), CALLTREE, *args], {**ENV, "PY_CALLTREE_LEAF": "zlib"},
                           tmp_path / "node.h5")


_LABEL = re.compile(r"^py::(.+) \((.+):(\d+)\)$")


def _lines_of(names: dict[int, list[str]]) -> dict[str, set[int]]:
    """The lines each function of the program is seen at."""
    out: dict[str, set[int]] = {}
    for st in names.values():
        for n in st:
            m = _LABEL.match(n)
            if m and m[2] == CALLTREE:
                out.setdefault(m[1], set()).add(int(m[3]))
    return out


def _src_line(text: str, after: str = "") -> int:
    """The first line of py_calltree.py holding text (after the line holding `after`)."""
    src = Path(CALLTREE).read_text().splitlines()
    start = next(i for i, t in enumerate(src, 1) if after in t)
    return next(i for i, t in enumerate(src, 1) if i >= start and text in t)


def _summary(got: dict[str, Any]) -> str:
    return json.dumps({k: dict(v) if k == "leaves" else v for k, v in got.items()})


@pytest.mark.bpf
@pytest.mark.parametrize("version", VERSIONS)
def test_call_tree_single_thread(version: str, tmp_path: Path) -> None:
    """py_calltree.py (main -> run_for -> train_step -> forward -> layer -> zlib.crc32, and
    forward -> activation) under pyenv's interpreter: the work's samples hold its Python frames in
    order, at the lines being run, with zlib's C code above `layer`."""
    rows, info, f, src = run_calltree(version, tmp_path, ["3"])
    names = stack_names(f)
    got = check_known_tree(rows, names, info["tids"], ("py::<module>", "py::main"), outermost=True,
                           t_work_ns=info["t_work_ns"])
    print(f"python {version} single thread:", _summary(got))
    assert got["with_py"] >= 0.9 * got["total"], got
    check_leaf_shares(got, info)
    assert got["layer_with_native"] >= 0.8 * got["leaves"]["py::layer"], got
    # the lines of the work's stacks (under run_for): a sample after it returns has main at its
    # next lines (os.times, the print), which is right but not what is checked here
    where = _lines_of({k: st for k, st in names.items() if any(n.startswith("py::run_for (") for n in st)})
    assert where["forward"] >= {_src_line("y = layer(x)")}, where["forward"]
    # each at the line being run, its call of the next function down; or at its `def` line, a frame
    # sampled before its first instruction (3.12's prev_instr of a new frame is before its code)
    for func, line, def_line in (
            ("train_step", _src_line("return forward(x)"), _src_line("def train_step(")),
            ("main", _src_line("run_for(seconds)", after="def main"), _src_line("def main(")),
            ("layer", _src_line("return zlib.crc32(DATA, int(x))"), _src_line("def layer(", after='LEAF == "zlib"'))):
        assert line in where[func] and where[func] <= {line, def_line}, (func, where[func], line, def_line)
    # forward's frame under layer's (the Python frames only: on 3.10 each one is a C-level call of
    # its own, with the interpreter's native frames between them)
    pys = [[n for n in st if n.startswith("py::")] for st in names.values()]
    callers = {st[i + 1] for st in pys for i, n in enumerate(st[:-1]) if n.startswith("py::layer (")}
    assert callers == {f"py::forward ({CALLTREE}:{_src_line('y = layer(x)')})"}, callers
    # zlib's C code above layer, named: libz's crc32 innermost
    assert any(";py::layer (" in k and k.rsplit(";", 1)[-1].startswith("crc32") for k in folded_stacks(f)), \
        sorted(folded_stacks(f))[:5]
    walked, _missing, not_stored, _truncated = src.python.last_counts  # type: ignore[union-attr]
    assert walked > 0 and not_stored == 0
    # the GIL: held in the pure Python loop, released by zlib's crc32 over 72 kB (its own GIL read:
    # 3.10/3.11 the runtime's, 3.12 the interpreter's, 3.13 from its debug offsets)
    held = gil_states(rows, names, "py::activation")
    released = gil_states(rows, names, "py::layer", native_leaf="crc32")
    print(f"python {version} GIL states (1 held, 2 not):", dict(held), dict(released))
    assert held[schema.GIL_HELD] >= 0.9 * sum(held.values()) > 0, held
    assert released[schema.GIL_NOT_HELD] >= 0.8 * sum(released.values()) > 0, released


@pytest.mark.bpf
@pytest.mark.parametrize("version", VERSIONS)
def test_call_tree_threads(version: str, tmp_path: Path) -> None:
    """Three threads in the same tree: each sample is named from its own thread's frames (3.10's
    thread states matched by pthread id), under the build's own threading.py."""
    rows, info, f, _ = run_calltree(version, tmp_path, ["3", "3"])
    names = stack_names(f)
    assert len(info["tids"]) == 3
    q = "Thread." if _minor(version) >= (3, 11) else ""  # co_qualname on 3.11+, co_name on 3.10
    work = "spawn_workers.<locals>.work" if q else "work"
    for tid in info["tids"]:
        got = check_known_tree(rows, names, [tid], (f"py::{q}_bootstrap_inner", f"py::{q}run", f"py::{work}"),
                               t_work_ns=info["t_work_ns"])
        print(f"python {version} thread {tid}:", _summary(got))
        assert got["with_py"] >= 0.9 * got["total"], (tid, got)
    run_frames = {n for st in names.values() for n in st if n.startswith(f"py::{q}run (")}
    assert run_frames and all(f"({_threading_py(version)}:" in n for n in run_frames), run_frames
    for r in rows[rows["tid"] == info["pid"]]:
        assert "py::run_for" not in py_frames(names.get(int(r["user_stack"]), [])), "a worker's frames on main"


# --- the same under Slurm, as the job's user ------------------------------------------------------------
USER_VISIBLE = Path("/var/lib/gpuprof-test/pyenv")  # pyenv's builds, bound here read-only for the job's user


@pytest.fixture(scope="module")
def pyenv_for_users() -> Any:
    """pyenv's builds where an unprivileged job can run them: /root is 0700, so its versions
    directory is bound read-only at USER_VISIBLE (no copy of 1.8 GB) for this module's tests and
    unbound after. Their RUNPATH names /root, so the job sets LD_LIBRARY_PATH to the bound lib/."""
    if os.geteuid() != 0 or not PYENV.is_dir():
        pytest.skip(f"binding {PYENV} for the job's user needs root and {PYENV}")
    USER_VISIBLE.mkdir(parents=True, exist_ok=True)
    os.chmod(USER_VISIBLE.parent, 0o755)
    mounted = subprocess.run(["mountpoint", "-q", str(USER_VISIBLE)], check=False).returncode == 0
    if not mounted:
        subprocess.run(["mount", "--bind", str(PYENV), str(USER_VISIBLE)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(USER_VISIBLE)], check=True)
    yield USER_VISIBLE
    if not mounted:
        subprocess.run(["umount", str(USER_VISIBLE)], check=False)


@pytest.mark.slurm
@pytest.mark.bpf
@pytest.mark.parametrize("version", ("3.10.13", "3.12.1", "3.13.0"))  # 3.11: Debian's, tests/test_python_stacks.py
def test_call_tree_under_sbatch(version: str, pyenv_for_users: Path, cluster: Any, test_user: str,
                                user_tmpdir: Path) -> None:
    """`sbatch --profile-gpu=stacks` of the call-tree program under pyenv's interpreter, run by the
    job's (unprivileged) user: the node file's stacks read as the program's Python code, with zlib's
    C code above `layer`, as with Debian's python3.11."""
    _python(version)  # skips, naming the path, when this build is missing
    major, minor = _minor(version)
    home = pyenv_for_users / version
    exe = home / "bin" / f"python{major}.{minor}"
    wrap = (f"env LD_LIBRARY_PATH={home / 'lib'} PY_CALLTREE_LEAF=zlib PYTHONDONTWRITEBYTECODE=1 "
            f"{exe} {CALLTREE} 3")
    job = cluster.sbatch(["-N1", "--profile-gpu=stacks", "--wrap", wrap], user=test_user, cwd=user_tmpdir)
    state = cluster.wait_job(job)["JobState"]
    out = user_tmpdir / f"slurm-{job}.out"
    assert state == "COMPLETED", (state, out.read_text() if out.exists() else "no output")
    info, rows, names, folded = sbatch_job_stacks(user_tmpdir, job)
    got = check_known_tree(rows, names, info["tids"], ("py::<module>", "py::main"), outermost=True,
                           t_work_ns=info["t_work_ns"])
    print(f"python {version} under sbatch:", _summary(got))
    assert got["with_py"] >= 0.95 * got["total"], got
    assert got["leaves"]["py::layer"] > 0 and got["leaves"]["py::activation"] > 0, got
    assert any(";py::layer (" in k and k.rsplit(";", 1)[-1].startswith("crc32") for k in folded), sorted(folded)[:5]


SUBINTERP = str(Path(__file__).resolve().parent / "progs" / "py_subinterp.py")


@pytest.mark.bpf
@pytest.mark.parametrize("version", [v for v in VERSIONS if _minor(v) >= (3, 13)])
def test_subinterpreter_frames_and_gil(version: str, tmp_path: Path) -> None:
    """A loop in a subinterpreter (its own GIL, run by another thread through run_string) beside one
    in the main interpreter: each thread's samples hold its own interpreter's frames, and each held
    its own interpreter's GIL (the thread has a state in both interpreters: the walk takes the one
    holding its GIL). Not 3.12: its _xxsubinterpreters.run_string runs the other thread on the state
    bound to the thread that created the interpreter, whose thread id is the creator's, so no
    reader can tell the two threads apart by thread id (docs/probes.md)."""
    rows, info, f, _ = sample_with_bpf([_python(version), SUBINTERP, "3"], ENV, tmp_path / "node.h5")
    names = stack_names(f)
    work = rows[rows["t_ns"] >= info["t_work_ns"]]
    for fn in ("main_spin", "sub_spin"):
        mine = work[work["tid"] == info["tids"][fn]]
        total = int(mine["count"].sum())
        in_fn = [r for r in mine if any(n.startswith(f"py::{fn} (") for n in names.get(int(r["user_stack"]), []))]
        n_in = sum(int(r["count"]) for r in in_fn)
        held = sum(int(r["count"]) for r in in_fn if int(r["gil"]) == schema.GIL_HELD)
        print(f"python {version} {fn}: {total} samples, {n_in} in it, {held} with the GIL held")
        assert total >= 50, (fn, total)
        assert n_in >= 0.9 * total, fn
        assert held >= 0.9 * n_in, fn
