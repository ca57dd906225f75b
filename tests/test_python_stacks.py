"""Python frames in the CPU stacks (bpf/pyframes.h, collector/pyframes.py): the 3.11 layout against
the interpreter's own headers, line numbers against the interpreter's own tables, the merge into
native stacks, and real programs with a known call tree sampled by BPF, directly and under
`sbatch --profile-gpu=stacks` on the local cluster."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

import native_progs
from harness import GatedProcess, bpf_skip_reason, collect, make_ctx, python, run_source_over
from py_calltree_check import check_known_tree, check_leaf_shares, sbatch_job_stacks
from py_calltree_check import py_frames as _py

from gpuprof.collector import pyframes, schema
from gpuprof.collector.pyframes import (
    DEBUG_COOKIE,
    LAYOUTS,
    PyFrameNamer,
    find_interpreter,
    frame_label,
    layout_from_debug_offsets,
    line_of,
)
from gpuprof.collector.sources.bpf_stacks import BpfStacksSource
from gpuprof.collector.symbolize import folded_stacks, merge_python_frames, stack_names

CALLTREE = str(Path(__file__).resolve().parent / "progs" / "py_calltree.py")
GIL_PROG = str(Path(__file__).resolve().parent / "progs" / "py_gil.py")
HERE = (sys.version_info.major, sys.version_info.minor)


# --- layouts -------------------------------------------------------------------------------------
_OFFSETS_C = r"""
#define Py_BUILD_CORE 1
#include <Python.h>
#include <internal/pycore_frame.h>
#include <internal/pycore_interp.h>
#include <internal/pycore_runtime.h>
#include <stddef.h>
#include <stdio.h>
#define P(name, s, f) printf("%s %zu\n", name, offsetof(s, f))
int main(void) {
    P("runtime_interp_head", _PyRuntimeState, interpreters.head);
    P("interp_next", PyInterpreterState, next);
    P("interp_threads_head", PyInterpreterState, threads.head);
    P("tstate_next", PyThreadState, next);
    P("tstate_thread_id", PyThreadState, native_thread_id);
    P("tstate_frame", PyThreadState, cframe);
    P("cframe_frame", _PyCFrame, current_frame);
    P("frame_code", _PyInterpreterFrame, f_code);
    P("frame_previous", _PyInterpreterFrame, previous);
    P("frame_instr", _PyInterpreterFrame, prev_instr);
    P("frame_is_entry", _PyInterpreterFrame, is_entry);
    P("code_filename", PyCodeObject, co_filename);
    P("code_name", PyCodeObject, co_qualname);
    P("code_linetable", PyCodeObject, co_linetable);
    P("code_firstlineno", PyCodeObject, co_firstlineno);
    P("code_adaptive", PyCodeObject, co_code_adaptive);
    P("gil_runtime", _PyRuntimeState, ceval.gil);
    P("gil_holder", struct _gil_runtime_state, last_holder);
    P("gil_locked", struct _gil_runtime_state, locked);
    printf("unicode_ascii_size %zu\nunicode_compact_size %zu\n", sizeof(PyASCIIObject),
           sizeof(PyCompactUnicodeObject));
    return 0;
}
"""


def test_311_layout_is_the_headers_own(tmp_path: Path) -> None:
    """Every offset of the 3.11 table, against offsetof() over the installed headers."""
    if HERE != (3, 11):
        pytest.skip(f"the test interpreter is {HERE}, the headers checked here are 3.11's")
    inc = sysconfig.get_paths()["include"]
    if not Path(inc, "internal", "pycore_frame.h").exists() or shutil.which("gcc") is None:
        pytest.skip("python3.11-dev headers (internal/) or gcc missing: apt-get install python3.11-dev gcc")
    src = tmp_path / "off.c"
    src.write_text(_OFFSETS_C)
    subprocess.run(["gcc", f"-I{inc}", str(src), "-o", str(tmp_path / "off")], check=True)
    out = subprocess.run([str(tmp_path / "off")], check=True, capture_output=True, text=True).stdout
    want = {k: int(v) for k, v in (line.split() for line in out.splitlines())}
    lay = LAYOUTS[(3, 11)]
    got = {k: getattr(lay, k) for k in want}
    assert got == want


def test_every_table_layout_is_marked_tested() -> None:
    # 3.11 here; 3.10, 3.11 and 3.12 on pyenv's builds (tests/test_python_stacks_pyenv.py); 3.13's
    # layout is read from the process (tests/test_python_stacks_313.py)
    assert [v for v, lay in LAYOUTS.items() if lay.tested] == [(3, 10), (3, 11), (3, 12)]


def test_313_layout_comes_from_the_process_debug_offsets() -> None:
    n = len(pyframes._DEBUG_OFFSETS_313)
    values = list(range(1000, 1000 + n))
    values[0] = 0x030D02F0  # 3.13.2 final
    values[1] = 0  # not free-threaded
    at = {name: i for i, name in enumerate(pyframes._DEBUG_OFFSETS_313)}
    for name, off in pyframes._OBJECT_FIELDS_313.items():  # where the str and bytes readers look
        values[at[name]] = off
    values[at["unicode_object.asciiobject_size"]] = 40
    raw = DEBUG_COOKIE + struct.pack(f"<{n}Q", *values)
    lay = layout_from_debug_offsets(raw)
    idx = {name: 1000 + i for i, name in enumerate(pyframes._DEBUG_OFFSETS_313)}
    assert lay.version == (3, 13) and lay.tested  # tested on Debian 13's (tests/test_python_stacks_313.py)
    assert (lay.unicode_ascii_size, lay.unicode_compact_size) == (40, 56)
    assert lay.runtime_interp_head == idx["runtime_state.interpreters_head"]
    assert lay.tstate_thread_id == idx["thread_state.native_thread_id"]
    assert lay.tstate_frame == idx["thread_state.current_frame"] and lay.cframe_frame == pyframes.NONE
    assert lay.frame_instr == idx["interpreter_frame.instr_ptr"]
    assert lay.code_name == idx["code_object.qualname"]
    with pytest.raises(ValueError, match="cookie"):
        layout_from_debug_offsets(b"notdebug" + raw[8:])
    values[0] = 0x030E00F0
    with pytest.raises(ValueError, match="3.14"):
        layout_from_debug_offsets(DEBUG_COOKIE + struct.pack(f"<{n}Q", *values))
    values[0], values[1] = 0x030D00F0, 1
    with pytest.raises(ValueError, match="free-threaded"):
        layout_from_debug_offsets(DEBUG_COOKIE + struct.pack(f"<{n}Q", *values))
    with pytest.raises(ValueError, match="bytes read"):
        layout_from_debug_offsets(raw[:64])
    values[1] = 0
    values[at["bytes_object.ob_sval"]] = 40  # a str/bytes layout the readers do not know: refused
    with pytest.raises(ValueError, match="ob_sval is 40"):
        layout_from_debug_offsets(DEBUG_COOKIE + struct.pack(f"<{n}Q", *values))


# --- line numbers --------------------------------------------------------------------------------
def _all_code(c: Any) -> list[Any]:
    out = [c]
    for k in c.co_consts:
        if hasattr(k, "co_code"):
            out.extend(_all_code(k))
    return out


def test_line_numbers_match_the_interpreters_own_table() -> None:
    """line_of() over every instruction of every function of a few stdlib modules, against
    code.co_positions() (3.11+ location table)."""
    if HERE < (3, 11):
        pytest.skip("the 3.11 location table format")
    import argparse as m1
    import inspect
    import json.decoder as m2
    import threading as m3

    checked = 0
    for mod in (m1, m2, m3):
        code = compile(inspect.getsource(mod), mod.__file__ or "?", "exec")
        for c in _all_code(code):
            for i, pos in enumerate(c.co_positions()):
                want = pos[0] if pos[0] is not None else 0
                got = line_of(c.co_linetable, c.co_firstlineno, i, "3.11")
                assert got == want, (c.co_name, i, got, want)
                checked += 1
    assert checked > 10000


def test_line_numbers_of_the_310_table() -> None:
    # (bytecode bytes, line delta) pairs from line 10: 4 bytes on 10, 6 on 12, 2 with no line,
    # 2 on 11 (a negative delta), as 3.10 writes them
    table = bytes([4, 0, 6, 2, 2, 0x80, 2, 0xFF])
    lines = [line_of(table, 10, i, "3.10") for i in range(8)]
    assert lines == [10, 10, 12, 12, 12, 0, 11, 0]


# --- naming code objects of a live process --------------------------------------------------------
def test_names_code_objects_of_a_live_process() -> None:
    """The namer reads this very process: the caller's frame, named from its code object's
    address and instruction, gives its function, file and current line."""
    if HERE not in LAYOUTS or not LAYOUTS[HERE].tested:
        pytest.skip(f"no tested layout for Python {HERE}")
    proc = find_interpreter(os.getpid())
    assert proc.layout.version == HERE
    assert proc.eval_ranges, "no _PyEval_EvalFrameDefault in " + proc.path
    namer = PyFrameNamer(proc)
    frame = sys._getframe()
    code = frame.f_code
    # prev_instr of this frame, and its line, read on one line
    instr, lineno = id(code) + proc.layout.code_adaptive + frame.f_lasti, frame.f_lineno
    name, filename, line = namer.name(id(code), instr)
    assert (name, filename, line) == ("test_names_code_objects_of_a_live_process", __file__, lineno)
    # an address that is no code object: unknown, counted, never an exception
    assert namer.name(16, 0) == pyframes.UNKNOWN_FRAME and namer.read_errors == 1


def test_not_python_says_why() -> None:
    p = subprocess.Popen(["sleep", "5"])
    try:
        with pytest.raises(pyframes.NotPython, match="no mapped python"):
            find_interpreter(p.pid)
    finally:
        p.kill()
        p.wait()


def test_label_keeps_the_line_of_long_paths() -> None:
    label = frame_label("f", "/very" + "/long" * 60 + "/train.py", 12)
    assert label.startswith("py::f (...") and label.endswith("/train.py:12)") and len(label) < 200


# --- merging Python frames into native stacks -------------------------------------------------------
EVAL = (1, 500)


def _is_eval(f: tuple[int, int]) -> bool:
    return f == EVAL


def test_merge_replaces_each_eval_frame_with_its_python_run() -> None:
    # native: leaf C function, eval, PyObject_Call, eval, main (innermost first)
    native = [(2, 1), EVAL, (1, 10), EVAL, (1, 20)]
    chunks = [[(9, 0), (9, 1)], [(9, 2)]]
    assert merge_python_frames(native, chunks, _is_eval) == [(2, 1), (9, 0), (9, 1), (1, 10), (9, 2), (1, 20)]


def test_merge_without_eval_frames_puts_python_at_the_outer_end() -> None:
    # frame-pointer-less interpreter: the native unwinder lost the loop's frames
    native = [(2, 1), (2, 2)]
    assert merge_python_frames(native, [[(9, 0)], [(9, 1)]], _is_eval) == [(2, 1), (2, 2), (9, 0), (9, 1)]


def test_merge_leftover_runs_go_outside_the_last_eval_frame() -> None:
    native = [(2, 1), EVAL, (1, 20)]
    assert merge_python_frames(native, [[(9, 0)], [(9, 1)]], _is_eval) == [(2, 1), (9, 0), (9, 1), (1, 20)]
    # more eval frames than runs (a truncated Python stack): the extra ones stay
    assert merge_python_frames([EVAL, EVAL], [[(9, 0)]], _is_eval) == [(9, 0), EVAL]


# --- real programs under BPF ---------------------------------------------------------------------------
def _skip_bpf() -> None:
    reason = bpf_skip_reason()
    if reason:
        pytest.skip(reason)
    if HERE not in LAYOUTS or not LAYOUTS[HERE].tested:
        pytest.skip(f"no tested layout for Python {HERE}")


def run_calltree(tmp_path: Path, args: list[str], python_frames: bool = True, program: str = CALLTREE,
                 ) -> tuple[Any, dict[str, Any], Any, BpfStacksSource]:
    src = BpfStacksSource(99, python_frames=python_frames)
    gated = GatedProcess([python(), program, *args])
    errors: list[str] = []
    ctx = make_ctx(lambda: frozenset({gated.pid}), ("stacks",), errors=errors)
    batches, (rc, out, err) = run_source_over(src, ctx, gated, poll_s=0.5)
    assert rc == 0, err
    assert not errors, errors
    path = tmp_path / "node.h5"
    native_progs.sealed_file(path, [src], batches, ("stacks",))
    return collect(batches, schema.STACK_SAMPLES), json.loads(out.strip().splitlines()[-1]), h5py.File(path), src


@pytest.mark.bpf
def test_python_call_tree_single_thread(tmp_path: Path) -> None:
    _skip_bpf()
    rows, info, f, src = run_calltree(tmp_path, ["3"])
    names = stack_names(f)
    got = check_known_tree(rows, names, info["tids"], ("py::<module>", "py::main"), outermost=True,
                           t_work_ns=info["t_work_ns"])
    assert got["with_py"] >= 0.95 * got["total"], got
    assert got["layer_with_native"] >= 0.8 * got["leaves"]["py::layer"], got
    # both leaves of the tree show, each with the share of the time the program measured of it
    check_leaf_shares(got, info)
    # forward()'s frame under layer() is at the line of that call: the sampled line, not the def's
    src_lines = Path(CALLTREE).read_text().splitlines()
    call_line = next(i for i, t in enumerate(src_lines, 1) if "y = layer(x)" in t)
    callers = {st[i + 1] for st in names.values() for i, n in enumerate(st[:-1])
               if n.startswith("py::layer (") and st[i + 1].startswith("py::forward (")}
    assert callers == {f"py::forward ({CALLTREE}:{call_line})"}, callers
    sym = f["stacks/symbols"][()]
    assert b"py_calltree.py" in set(sym["module"][np.char.startswith(sym["name"], b"py::")].tolist())
    folded = folded_stacks(f)
    assert any(";py::layer (" in k and "matmul" not in k.split(";py::layer")[0] for k in folded)
    assert src.python is not None
    # (stacks past 64 frames happen: numpy's nested imports at start-up; the work's are 7 deep)
    walked, _missing, not_stored, _truncated = src.python.last_counts
    assert walked > 0 and not_stored == 0


@pytest.mark.bpf
def test_python_call_tree_threads(tmp_path: Path) -> None:
    """Three threads in the same tree: each sample is named from its own thread's frames."""
    _skip_bpf()
    rows, info, f, _ = run_calltree(tmp_path, ["3", "3"])
    names = stack_names(f)
    assert len(info["tids"]) == 3
    for tid in info["tids"]:
        got = check_known_tree(rows, names, [tid], ("py::Thread._bootstrap_inner", "py::Thread.run",
                                                    "py::spawn_workers.<locals>.work"), t_work_ns=info["t_work_ns"])
        assert got["with_py"] >= 0.9 * got["total"], (tid, got)
    # the main thread waits in join: never a worker's stack
    main_rows = rows[rows["tid"] == info["pid"]]
    for r in main_rows:
        assert "py::run_for" not in _py(names.get(int(r["user_stack"]), [])), "a worker's frames on the main thread"


@pytest.mark.bpf
def test_gil_state_of_each_sample(tmp_path: Path) -> None:
    """A thread in a pure Python loop holds the GIL in its samples; a thread hashing in OpenSSL's
    code, which released the GIL, does not; samples without Python frames say nothing."""
    _skip_bpf()
    rows, info, f, _ = run_calltree(tmp_path, ["4"], program=GIL_PROG)
    names = stack_names(f)
    work = rows[rows["t_ns"] >= info["t_work_ns"]]

    def states(fn: str, tid: int) -> dict[int, int]:
        out = {schema.GIL_UNKNOWN: 0, schema.GIL_HELD: 0, schema.GIL_NOT_HELD: 0}
        for r in work[work["tid"] == tid]:
            if any(n.startswith(f"py::{fn} (") for n in names.get(int(r["user_stack"]), [])):
                out[int(r["gil"])] += int(r["count"])
        return out

    held = states("holds_gil", info["tids"]["holds_gil"])
    released = states("releases_gil", info["tids"]["releases_gil"])
    assert sum(held.values()) >= 50 and sum(released.values()) >= 50, (held, released)
    assert held[schema.GIL_HELD] >= 0.9 * sum(held.values()), held
    assert released[schema.GIL_NOT_HELD] >= 0.8 * sum(released.values()), released
    assert held[schema.GIL_UNKNOWN] == released[schema.GIL_UNKNOWN] == 0
    no_py = [int(r["gil"]) for r in rows if not _py(names.get(int(r["user_stack"]), []))]
    assert set(no_py) <= {schema.GIL_UNKNOWN}


@pytest.mark.bpf
def test_python_frames_off_gives_native_stacks_only(tmp_path: Path) -> None:
    _skip_bpf()
    rows, _, f, src = run_calltree(tmp_path, ["1.5"], python_frames=False)
    assert src.python is None
    names = stack_names(f)
    assert int(rows["count"].sum()) > 0
    assert not any(n.startswith("py::") for st in names.values() for n in st)


# --- the same program under Slurm -----------------------------------------------------------------------
@pytest.mark.slurm
@pytest.mark.bpf
def test_python_stacks_under_sbatch(cluster: Any, test_user: str, user_tmpdir: Path) -> None:
    """`sbatch --profile-gpu=stacks` of the call-tree program: the node file's stacks read as the
    program's Python code, with numpy's C code above `layer`."""
    _skip_bpf()
    job = cluster.sbatch(["-N1", "--profile-gpu=stacks", "--wrap", f"{python()} {CALLTREE} 3"], user=test_user,
                         cwd=user_tmpdir)
    assert cluster.wait_job(job)["JobState"] == "COMPLETED"
    info, rows, names, _ = sbatch_job_stacks(user_tmpdir, job)
    got = check_known_tree(rows, names, info["tids"], ("py::<module>", "py::main"), outermost=True,
                           t_work_ns=info["t_work_ns"])
    assert got["with_py"] >= 0.95 * got["total"], got
    assert got["leaves"]["py::layer"] > 0 and got["leaves"]["py::activation"] > 0, got


def test_namer_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    if HERE not in LAYOUTS or not LAYOUTS[HERE].tested:
        pytest.skip(f"no tested layout for Python {HERE}")
    monkeypatch.setattr(pyframes, "MAX_CODES_PER_PID", 8)
    namer = PyFrameNamer(find_interpreter(os.getpid()))
    codes = [c for c in _all_code(compile("def a(): pass\ndef b(): pass\n" * 10, "x", "exec"))]
    for c in codes:
        namer.name(id(c), id(c) + namer.proc.layout.code_adaptive)
    assert len(namer.codes) <= 8


def test_a_thread_state_walk_of_this_process_finds_this_thread() -> None:
    """The thread list as bpf/pyframes.h walks it (interpreters -> thread states, native ids),
    read from this process with the same offsets: it holds every live thread of ours."""
    if HERE not in LAYOUTS or not LAYOUTS[HERE].tested:
        pytest.skip(f"no tested layout for Python {HERE}")
    proc = find_interpreter(os.getpid())
    lay = proc.layout
    mem = pyframes.ProcessMemory(os.getpid())
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        found = set()
        interp = mem.u64(proc.runtime + lay.runtime_interp_head)
        while interp:
            ts = mem.u64(interp + lay.interp_threads_head)
            while ts:
                found.add(mem.u64(ts + lay.tstate_thread_id))
                ts = mem.u64(ts + lay.tstate_next)
            interp = mem.u64(interp + lay.interp_next)
        assert {threading.get_native_id(), t.native_id} <= found
    finally:
        stop.set()
        t.join()


def test_a_process_that_exited_before_the_drain_gives_unknown_frames() -> None:
    """Names are read from the live process: once it is gone its code objects are [unknown],
    counted, and no exception reaches the drain."""
    if HERE not in LAYOUTS or not LAYOUTS[HERE].tested:
        pytest.skip(f"no tested layout for Python {HERE}")
    script = "import sys, time; print(id(sys._getframe().f_code), flush=True); time.sleep(30)"
    p = subprocess.Popen([python(), "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        code_addr = int(p.stdout.readline())
        namer = PyFrameNamer(find_interpreter(p.pid))
        assert namer.name(code_addr, code_addr + namer.proc.layout.code_adaptive)[0] == "<module>"
        namer.codes.clear()  # as if first seen after the exit
    finally:
        p.kill()
        p.wait()
    assert namer.name(code_addr, code_addr) == pyframes.UNKNOWN_FRAME and namer.read_errors == 1
    assert frame_label(*pyframes.UNKNOWN_FRAME) == "py::[unknown]"


class _FakeMap(dict):  # type: ignore[type-arg]
    """The few calls PythonStacks.register makes on a BCC table."""

    class Leaf:
        pass

    @staticmethod
    def Key(pid: int) -> int:  # BCC's name
        return pid


def test_an_interpreter_whose_libpython_is_not_mapped_yet_is_looked_at_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared-libpython build (pyenv's) has /proc/PID/exe changed at exec, and libpython3.X.so
    mapped by the dynamic loader just after: a drain in between finds no _PyRuntime. Such a process
    (its executable named like an interpreter) is looked at again at the next drains, a bounded
    number of times; a process named otherwise is looked at once per executable."""
    from gpuprof.collector.sources import bpf_stacks

    exes = {1: "/opt/py/bin/python3.10", 2: "/usr/bin/sleep", 3: "/opt/py/bin/python3.12"}
    calls: dict[int, int] = {1: 0, 2: 0, 3: 0}
    mapped_after = {1: 2}  # pid 1's libpython shows at its second look; pid 3's never does

    def fake_find(pid: int, maps: Any) -> pyframes.PyProcess:
        calls[pid] += 1
        if calls[pid] < mapped_after.get(pid, 10**9):
            raise pyframes.NotPython(f"pid {pid}: no mapped python executable or libpython defines _PyRuntime")
        return pyframes.PyProcess(pid, "/opt/py/lib/libpython3.10.so.1.0", 0x1000, LAYOUTS[(3, 10)], ())

    monkeypatch.setattr(bpf_stacks, "find_interpreter", fake_find)
    monkeypatch.setattr(bpf_stacks, "read_maps", lambda pid: [])
    monkeypatch.setattr(bpf_stacks, "_exe", lambda pid: exes[pid])
    # 3.10's threads are matched by fs base: task_struct's offsets from the kernel's BTF
    btf = {("task_struct", "thread"): 3088, ("thread_struct", "fsbase"): 40}
    monkeypatch.setattr(bpf_stacks, "kernel_member_offset", lambda s, m: btf[(s, m)])
    procs = _FakeMap()
    py = bpf_stacks.PythonStacks({b"gp_py_procs": procs, b"gp_py_stacks": _FakeMap(), b"gp_py_counters": _FakeMap()})
    py.register([1, 2, 3])
    assert set(procs) == set() and set(py.not_python) == {1, 2, 3}
    py.register([1, 2, 3])
    assert set(procs) == {1} and 1 not in py.not_python and procs[1].interp_head_addr == 0x1000 + 32
    assert procs[1].task_fsbase == 3088 + 40
    for _ in range(3 * bpf_stacks.PY_INTERP_RETRIES):
        py.register([1, 2, 3])
    assert calls == {1: 2, 2: 1, 3: 1 + bpf_stacks.PY_INTERP_RETRIES}
    assert set(procs) == {1} and set(py.not_python) == {2, 3}
    exes[3] = "/opt/py/bin/python3.13"  # an exec: looked at again, with retries of its own
    py.register([3])
    assert calls[3] == 2 + bpf_stacks.PY_INTERP_RETRIES
    py.forget({1})
    assert set(py.retries) <= {1} and set(py.procs) == {1}


def test_kernel_member_offsets_come_from_the_running_kernels_btf() -> None:
    """task_struct.thread.fsbase (how 3.10's threads are matched) read from /sys/kernel/btf/vmlinux:
    the same offsets as BCC's compile only when its headers are this kernel's."""
    from gpuprof.collector.bpf_support import VMLINUX_BTF, kernel_member_offset

    if not Path(VMLINUX_BTF).is_file():
        pytest.skip(f"{VMLINUX_BTF} missing: a kernel built without CONFIG_DEBUG_INFO_BTF")
    thread = kernel_member_offset("task_struct", "thread")
    fsbase = kernel_member_offset("thread_struct", "fsbase")
    assert 0 < thread < 16384 and 0 < fsbase < 256, (thread, fsbase)
    assert kernel_member_offset("task_struct", "pid") < thread
    with pytest.raises(LookupError, match="no member"):
        kernel_member_offset("task_struct", "no_such_member")
    with pytest.raises(LookupError, match="no struct"):
        kernel_member_offset("no_such_struct_gpuprof", "x")
