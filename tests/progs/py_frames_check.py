"""The frames of tests/progs/py_blocked_tree.py read from the live process as bpf/pyframes.h reads
them, with the layout the collector chose, and checked against the program's known call tree, per
CPython version (shared by tests/test_python_stacks_313.py, Debian 13's python3.13 in a root, and
tests/test_python_stacks_pyenv.py, pyenv's builds of 3.10-3.13)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import native_progs
import pytest
from harness import GatedProcess, bpf_skip_reason, collect, make_ctx, run_source_over

from gpuprof.collector import pyframes, schema
from gpuprof.collector.pyframes import FRAME_OWNED_BY_CSTACK, LAST_OF_CALL, NONE, PyFrameNamer, PyProcess
from gpuprof.collector.sources.bpf_stacks import BpfStacksSource

BLOCKED_TREE = Path(__file__).resolve().parent / "py_blocked_tree.py"

Frame = tuple[str, str, int]  # (function, file, line) as the namer gives them


def marker_line(marker: str) -> int:
    """The line of py_blocked_tree.py that ends with `# marker`."""
    src = BLOCKED_TREE.read_text().splitlines()
    return next(i for i, t in enumerate(src, 1) if t.rstrip().endswith(f"# {marker}"))


def walk_threads(proc: PyProcess) -> dict[int, list[tuple[int, int]]]:
    """Every thread's Python stack as bpf/pyframes.h records it, read with the same offsets from user
    space: the value the thread state holds for its thread (native id; 3.10: pthread id) ->
    [(code, instr)], innermost first; code 0 for an entry frame (3.12+), LAST_OF_CALL in instr for
    the last frame of a C-level call (3.11: is_entry; 3.10: every frame)."""
    lay = proc.layout
    mem = pyframes.ProcessMemory(proc.pid)
    out: dict[int, list[tuple[int, int]]] = {}
    interp = mem.u64(proc.runtime + lay.runtime_interp_head)
    while interp:
        ts = mem.u64(interp + lay.interp_threads_head)
        while ts:
            entries: list[tuple[int, int]] = []
            frame = mem.u64(ts + lay.tstate_frame)
            if frame and lay.cframe_frame != NONE:
                frame = mem.u64(frame + lay.cframe_frame)
            while frame and len(entries) < 64:
                code = mem.u64(frame + lay.frame_code)
                # f_lasti (3.10) is an int, read as the BPF side reads it: 4 bytes, zero-extended
                instr = (int.from_bytes(mem.read(frame + lay.frame_instr, 4), "little") if lay.instr_is_index
                         else mem.u64(frame + lay.frame_instr))
                if lay.frame_owner != NONE and mem.read(frame + lay.frame_owner, 1)[0] == FRAME_OWNED_BY_CSTACK:
                    code = 0
                elif lay.boundary_each_frame or (lay.frame_is_entry != NONE
                                                 and mem.read(frame + lay.frame_is_entry, 1)[0]):
                    instr |= LAST_OF_CALL
                entries.append((code, instr))
                frame = mem.u64(frame + lay.frame_previous)
            out[mem.u64(ts + lay.tstate_thread_id)] = entries
            ts = mem.u64(ts + lay.tstate_next)
        interp = mem.u64(interp + lay.interp_next)
    return out


def expected_runs(version: tuple[int, int], script: str, threading_py: str) -> tuple[list[list[Any]],
                                                                                    list[list[Any]]]:
    """(main thread, each worker): the runs of frames (one per C-level call of the evaluation loop,
    innermost first) of the blocked program, as (function, file, line); None for a line of
    threading.py (any line > 0). Names are co_qualname on 3.11+, co_name on 3.10. C-level calls:
    every frame on 3.10; on 3.11 Thread.run calls its target through CALL_FUNCTION_EX
    (PyObject_Call, a new call of the loop), which 3.12 and 3.13 run in the same loop (as pyenv's
    3.12.1 shows: one entry frame, under Thread._bootstrap)."""
    q = version >= (3, 11)
    wait = [("Condition.wait" if q else "wait", threading_py, None), ("Event.wait" if q else "wait", threading_py, None)]
    program = [(f, script, marker_line(m)) for f, m in (("leaf", "LEAF"), ("middle", "MIDDLE"), ("outer", "OUTER"))]
    thread = [(("Thread." if q else "") + f, threading_py, None) for f in ("run", "_bootstrap_inner", "_bootstrap")]
    main = [("main", script, marker_line("MAIN")), ("<module>", script, marker_line("MODULE"))]
    if version == (3, 10):
        return [[f] for f in main], [[f] for f in wait + program + thread]
    if version == (3, 11):
        return [main], [wait + program, thread]
    if version in ((3, 12), (3, 13)):
        return [main], [wait + program + thread]
    raise AssertionError(f"no expected frames for Python {version}")


def _matches(got: list[list[Frame]], want: list[list[Any]]) -> bool:
    if [len(r) for r in got] != [len(r) for r in want]:
        return False
    for g, w in zip((f for r in got for f in r), (f for r in want for f in r), strict=True):
        if g[:2] != w[:2] or (g[2] != w[2] if w[2] is not None else g[2] <= 0):
            return False
    return True


@contextlib.contextmanager
def blocked_tree(cmd: Sequence[str], env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """py_blocked_tree.py started by cmd, blocked: (the process, its JSON line). At the end it is
    let go and must exit 0."""
    p = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout is not None and p.stdin is not None
        line = p.stdout.readline()
        assert line, f"the program did not start: {p.stderr.read() if p.poll() is not None else ''}"
        info = json.loads(line)
        assert info["pid"] == p.pid
        yield p, info
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=30) == 0, p.stderr.read() if p.stderr else ""
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def check_blocked_tree(proc: PyProcess, info: dict[str, Any], script: str, threading_py: str) -> dict[int, list]:
    """The blocked program read with proc's layout: leaf's code object's fields at the layout's
    offsets are the objects the program reports; the thread list holds exactly its four threads;
    each thread's frames, named, are the known tree (function, file, line, in order, runs ending
    where each C-level call of the loop ends). Returns the named runs per native thread id."""
    lay = proc.layout
    assert lay.version == tuple(info["version"]), (lay.version, info["version"])
    mem = pyframes.ProcessMemory(proc.pid)
    code = info["code"]
    assert mem.u64(code + lay.code_name) == info["name"]
    assert mem.u64(code + lay.code_filename) == info["filename"]
    assert mem.u64(code + lay.code_linetable) == info["linetable"]
    assert mem.i32(code + lay.code_firstlineno) == info["firstlineno"]

    # the thread states hold native ids, or pthread ids on 3.10: key in the thread state -> native id
    natives = [info["main"], *info["workers"]]
    held = [info["main_ident"], *info["worker_idents"]] if lay.thread_id_is_pthread else natives
    native_of = dict(zip(held, natives, strict=True))
    keys = held
    want_main, want_worker = expected_runs(lay.version, script, threading_py)
    namer = PyFrameNamer(proc)
    deadline = time.monotonic() + 10
    while True:  # the workers may not have reached ev.wait() yet
        walked = walk_threads(proc)
        named = {k: namer.chunks(entries) for k, entries in walked.items()}
        settled = _matches(named.get(keys[0], []), want_main) and all(
            _matches(named.get(k, []), want_worker) for k in keys[1:])
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert set(walked) == set(keys), (sorted(walked), keys)
    assert _matches(named[keys[0]], want_main), (named[keys[0]], want_main)
    for k in keys[1:]:
        assert _matches(named[k], want_worker), (k, named[k], want_worker)
    assert namer.read_errors == 0
    return {native_of[k]: runs for k, runs in named.items()}


def sample_with_bpf(cmd: list[str], env: dict[str, str], node_file: Path) -> tuple[Any, dict[str, Any], h5py.File,
                                                                                 BpfStacksSource]:
    """Run `cmd` (a Python program that prints a JSON line last) gated under the BPF stacks source at
    99 Hz: its stack samples, that JSON line, the sealed node file (opened) and the source. The
    program's interpreter must have been found (its pid among the namers). Skips without BPF."""
    reason = bpf_skip_reason()
    if reason:
        pytest.skip(reason)
    src = BpfStacksSource(99)
    gated = GatedProcess(cmd, env=env)
    errors: list[str] = []
    ctx = make_ctx(lambda: frozenset({gated.pid}), ("stacks",), errors=errors)
    batches, (rc, out, err) = run_source_over(src, ctx, gated, poll_s=0.5)
    assert rc == 0, err
    assert not errors, errors
    assert src.python is not None
    assert gated.pid in src.python.namers, src.python.not_python  # its interpreter was found
    native_progs.sealed_file(node_file, [src], batches, ("stacks",))
    return collect(batches, schema.STACK_SAMPLES), json.loads(out.strip().splitlines()[-1]), h5py.File(node_file), src
