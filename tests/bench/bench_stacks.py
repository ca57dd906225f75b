"""Figures of the CPU stacks' quality and of the Python frames' cost (docs/probes.md, "Python
frames"): one JSON object per line.

  .venv/bin/python tests/bench/bench_stacks.py [--quick]

stack_quality          per test program sampled at 99 Hz by the stacks source: samples of the
                       program's threads, the share of them with no [unknown] frame in the user
                       stack (fully_named_share), the median user stack depth, and for Python
                       programs the share of the samples taken while the interpreter runs the
                       program's code (the windows after its start-up) that hold Python frames;
                       and the demo's program (etc/dev/demo/allreduce_app.py, 2 ranks under
                       mpirun), every sample of its ranks, start-up included
python_unwind_cost     the BPF program's time per job sample with the Python walk and without it
                       (python_frames=False), on the same busy 2-thread Python program, runs
                       interleaved: medians with min and max
python_sampler_choice  the stacks source with Python frames against py-spy (PyPI py-spy; blocking,
                       its default, and --nonblocking) on the same busy Python job, interleaved with
                       runs without any sampler: the sampler's CPU (percent of one core), samples
                       with Python frames, their depth, and the job's train steps against the
                       unprofiled runs
native_unwind_cost     a C program built without frame pointers: stack copies (8 KB per sample)
                       walked with the files' CFI in user space against the kernel's frame-pointer
                       walk: BPF time per sample, unwind time per sample, the share of samples
                       unwound through the whole known tree, and fully named
cfi_unwind_cost        the same program under the CFI tables walked in the BPF program, the
                       frame-pointer walk and the stack copy, interleaved: BPF ns per sample,
                       collector CPU, whole-tree share, load average
Every figure of the stacks source runs with sources.stacks.unwinder = "cfi" unless it says
"frame_pointers"; --only NAME[,NAME] prints some of them.
Needs root and BCC (the stacks source); py-spy for the last figure (pip install py-spy).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "progs"))

import numpy as np
from harness import GatedProcess, bpf_skip_reason, collect, make_ctx, python
from stackcopy_run import NOFP_TREE, copied_stacks, nofp_tree, unwinder_skip_reason

from gpuprof.collector import schema
from gpuprof.collector.symbolize import is_unknown

CALLTREE = str(REPO / "tests" / "progs" / "py_calltree.py")
STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def _prog_stats(src: Any) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of the sampling program so far (kernel.bpf_stats_enabled)."""
    fd = src.hub.bpf.funcs[b"gp_cpu_sample"].fd
    info = dict(line.split(":", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines() if ":" in line)
    return int(info["run_time_ns"]), int(info["run_cnt"])


def sampled_run(cmd: list[str], python_frames: bool = True, env: dict[str, str] | None = None,
                unwinder: str = "cfi") -> dict[str, Any]:
    """Run cmd as the job under the stacks source at 99 Hz (one drain per second); the program's
    JSON line, the rows, the stack names, the BPF time and the collector's CPU while it ran.
    unwinder: sources.stacks.unwinder ("cfi" or "frame_pointers")."""
    import h5py
    import native_progs

    from gpuprof.collector.sources.bpf_stacks import BpfStacksSource

    src = BpfStacksSource(99, python_frames=python_frames, unwinder=unwinder)
    gated = GatedProcess(cmd, env=env)
    src.start(make_ctx(lambda: frozenset({gated.pid}), ("stacks",)))
    cfi_status: dict[str, Any] | None = None
    batches: list[Any] = []
    try:
        bpf0 = _prog_stats(src)
        cpu0, wall0 = time.process_time(), time.monotonic()
        gated.go()
        python_pids: set[int] = set()  # every process the source found an interpreter in
        while gated.proc.poll() is None:
            time.sleep(src.interval_s)
            batches.extend(src.sample(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
            if src.python is not None:
                python_pids |= {pid for pid, (_, proc) in src.python.procs.items() if proc is not None}
        rc, out, err = gated.wait()
        batches.extend(src.final(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
        cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
        bpf1 = _prog_stats(src)
        cfi_status = src.cfi.status() if src.cfi is not None else None

    finally:
        src.stop()
    if rc != 0:
        raise RuntimeError(f"{cmd} failed: {err[-500:]}")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "node.h5"
        native_progs.sealed_file(path, [src], batches, ("stacks",))
        with h5py.File(path, "r") as f:
            names, modules = stack_frames(f["stacks/frames"][()], f["stacks/symbols"][()])
    # py_calltree and cpu_work print {"pid", "tids", ...} as their last line on stdout
    last = out.strip().splitlines()[-1] if out.strip() else "{}"
    return {"info": json.loads(last) if last.startswith("{") else {"output": last},
            "python_pids": python_pids, "rows": collect(batches, schema.STACK_SAMPLES),
            "names": names, "modules": modules, "bpf_ns": bpf1[0] - bpf0[0], "bpf_runs": bpf1[1] - bpf0[1], "cpu_s": cpu_s,
            "wall_s": wall_s, "cfi": cfi_status}


def _load() -> list[float]:
    """The machine's load average (1, 5, 15 min): this 2-core VM is shared with other benches."""
    return [round(x, 2) for x in os.getloadavg()]


def stack_frames(frames: Any, symbols: Any) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """stack id -> frame names, and -> their modules, innermost first (/stacks/frames rows)."""
    sym = {int(s["symbol_id"]): (s["name"].decode(errors="replace"), s["module"].decode(errors="replace"))
           for s in symbols}
    by: dict[int, list[tuple[int, int]]] = {}
    for r in frames:
        by.setdefault(int(r["stack_id"]), []).append((int(r["depth"]), int(r["symbol_id"])))
    names = {k: [sym[i][0] for _, i in sorted(v)] for k, v in by.items()}
    modules = {k: [sym[i][1] for _, i in sorted(v)] for k, v in by.items()}
    return names, modules


def fully_named(names: list[str], modules: list[str]) -> bool:
    """No [unknown] frame from the leaf to main or the thread's start function: the C library's
    process and thread start (`__libc_start_call_main`, `start_thread`, `clone3`, unnamed in
    Debian's stripped libc) and `_start` are left out."""
    end = len(names)
    while end and (modules[end - 1].startswith("libc.so") or names[end - 1] == "_start"):
        end -= 1
    return end > 0 and not any(is_unknown(n) for n in names[:end])


def named_to_python(names: list[str]) -> bool:
    """No [unknown] frame from the leaf to the outermost Python frame (the interpreter's start-up
    path below it, static functions that Debian's stripped python3.11 does not name, left out)."""
    py = [i for i, n in enumerate(names) if n.startswith("py::")]
    return bool(py) and not any(is_unknown(n) for n in names[: py[-1] + 1]) and "py::[unknown]" not in names


def evaluating(names: list[str]) -> bool:
    """The sample was taken while the interpreter ran Python code: a Python frame, or the
    interpreter's evaluation loop in the native stack (its Python frames then missing)."""
    return any(n.startswith("py::") or n == "_PyEval_EvalFrameDefault" for n in names)


def _python_share_while_evaluating(stacks: list[tuple[list[str], int]]) -> float | None:
    """Of the samples taken while the interpreter evaluated Python code, the share with Python
    frames (the issue's figure: start-up and teardown in C are not Python code to show)."""
    ev = sum(n for st, n in stacks if evaluating(st))
    py = sum(n for st, n in stacks if any(x.startswith("py::") for x in st))
    return round(py / ev, 3) if ev else None


def _quality(program: str, run: dict[str, Any], python_prog: bool, unwinder: str = "cfi") -> dict[str, Any]:
    info, rows, names, modules = run["info"], run["rows"], run["names"], run["modules"]
    mine = rows[np.isin(rows["tid"], info["tids"])]
    if python_prog:
        mine = mine[mine["t_ns"] >= info["t_work_ns"]]
    total = int(mine["count"].sum())
    named = py = to_py = 0
    depths: list[int] = []
    pairs: list[tuple[list[str], int]] = []
    for r in mine:
        stack = names.get(int(r["user_stack"]), [])
        n = int(r["count"])
        pairs.append((stack, n))
        if fully_named(stack, modules.get(int(r["user_stack"]), [])):
            named += n
        if any(s.startswith("py::") for s in stack):
            py += n
        to_py += n * named_to_python(stack)
        depths.extend([len(stack)] * n)
    return {"bench": "stack_quality", "program": program, "samples": total,
            "fully_named_share": round(named / total, 3) if total else None,
            "depth_median": statistics.median(depths) if depths else None,
            "python_frames_share": (round(py / total, 3) if total else None) if python_prog else None,
            "python_frames_share_while_evaluating": _python_share_while_evaluating(pairs) if python_prog else None,
            "named_to_python_share": (round(to_py / total, 3) if total else None) if python_prog else None,
            "unwinder": unwinder, "load_avg": _load()}


def stack_quality(quick: bool) -> list[dict[str, Any]]:
    import native_progs

    seconds = 2.0 if quick else 6.0
    out = []
    for program, cmd, is_py, unwinder in (
        ("py_calltree", [python(), CALLTREE, str(seconds)], True, "cfi"),
        ("py_calltree_3_threads", [python(), CALLTREE, str(seconds), "3"], True, "cfi"),
        ("cpu_work_hot (C, frame pointers)", [str(native_progs.cpu_work()), "hot", "2", str(seconds)], False, "cfi"),
        ("nofp_tree (C, no frame pointers; CFI walk)", [str(nofp_tree()), str(seconds)], False, "cfi"),
        ("nofp_cpp (C++ templates, no frame pointers; CFI walk)", [str(native_progs.nofp_cpp()), str(seconds)],
         False, "cfi"),
        ("nofp_threads (C, 3 threads, no frame pointers; CFI walk)", [str(native_progs.nofp_threads()), str(seconds)],
         False, "cfi"),
        ("nofp_dlopen (C, a library dlopen()ed 1.5 s after start; CFI walk)",
         [str(p) for p in native_progs.nofp_dlopen()] + [str(seconds)], False, "cfi"),
        *([("nofp_fortran (Fortran, no frame pointers; CFI walk)", [str(native_progs.nofp_fortran()), str(seconds)],
            False, "cfi")] if native_progs.fortran_skip_reason() is None else []),
        ("nofp_tree (C, no frame pointers; frame-pointer walk)", [str(nofp_tree()), str(seconds)], False,
         "frame_pointers"),
    ):
        run = sampled_run(cmd, unwinder=unwinder)
        out.append(_quality(program, run, is_py, unwinder))
    return out


def demo_quality(quick: bool) -> dict[str, Any]:
    """The demo's program (etc/dev/demo/allreduce_app.py) on 2 local ranks under mpirun: every
    sample of its Python processes (the ranks, found by the source as they are sampled)."""
    import shutil

    if shutil.which("mpirun") is None:
        return {"bench": "stack_quality", "program": "demo allreduce_app.py", "missing": "mpirun not found"}
    env = dict(os.environ, DEMO_STEPS="60" if quick else "200", OPENBLAS_NUM_THREADS="1")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", python(),
           str(REPO / "etc" / "dev" / "demo" / "allreduce_app.py")]
    run = sampled_run(cmd, env=env)
    rows, names, modules = run["rows"], run["names"], run["modules"]
    mine = rows[np.isin(rows["pid"], sorted(run["python_pids"]))]
    total = int(mine["count"].sum())
    named = py = to_py = 0
    depths: list[int] = []
    pairs: list[tuple[list[str], int]] = []
    for r in mine:
        sid, n = int(r["user_stack"]), int(r["count"])
        stack = names.get(sid, [])
        pairs.append((stack, n))
        named += n * fully_named(stack, modules.get(sid, []))
        py += n * any(x.startswith("py::") for x in stack)
        to_py += n * named_to_python(stack)
        depths.extend([len(stack)] * n)
    # the ranks' first moments (before the collector found their interpreter) are in the count
    return {"bench": "stack_quality", "program": "demo allreduce_app.py, 2 ranks", "samples": total,
            "fully_named_share": round(named / total, 3) if total else None,
            "depth_median": statistics.median(depths) if depths else None,
            "python_frames_share": round(py / total, 3) if total else None,
            "python_frames_share_while_evaluating": _python_share_while_evaluating(pairs),
            "named_to_python_share": round(to_py / total, 3) if total else None, "unwinder": "cfi",
            "load_avg": _load(), "cfi": run["cfi"]}


def python_unwind_cost(quick: bool) -> dict[str, Any]:
    """BPF ns per job sample with and without the Python walk, same program, interleaved."""
    seconds, rounds = (3.0, 1) if quick else (6.0, 3)
    per: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for with_py in (False, True):
            run = sampled_run([python(), CALLTREE, str(seconds), "2"], python_frames=with_py)
            samples = int(run["rows"]["count"].sum())
            per[with_py].append(run["bpf_ns"] / max(1, samples))
            cpu[with_py].append(run["cpu_s"] / run["wall_s"] * 100)
    on, off = statistics.median(per[True]), statistics.median(per[False])
    return {"bench": "python_unwind_cost", "program": "py_calltree 2 threads", "seconds": seconds, "rounds": rounds,
            "bpf_ns_per_job_sample_with_python": _spread(per[True]),
            "bpf_ns_per_job_sample_native_only": _spread(per[False]),
            "python_walk_ns_per_sample": round(on - off),
            "collector_cpu_percent_with_python": _spread(cpu[True]),
            "collector_cpu_percent_native_only": _spread(cpu[False])}


def _pyspy_run(seconds: float, extra: list[str]) -> dict[str, Any]:
    """py-spy record over the same program (attached by pid during its 1 s settle)."""
    exe = shutil.which("py-spy") or str(REPO / ".venv" / "bin" / "py-spy")
    gated = GatedProcess([python(), CALLTREE, str(seconds), "2"])
    with tempfile.TemporaryDirectory() as d:
        raw = Path(d) / "raw.txt"
        gated.go()
        time.sleep(0.6)  # the interpreter is up (py-spy refuses a process not yet initialized)
        spy = subprocess.Popen([exe, "record", "--pid", str(gated.pid), "--rate", "99", "--format", "raw",
                                "--output", str(raw), "--threads", "--full-filenames", *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        rc, out, err = gated.wait()
        # children's CPU is added when they are reaped: the program is, py-spy not yet
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        spy.send_signal(signal.SIGINT)  # py-spy writes its file and exits (it would at the target's exit too)
        spy.wait(timeout=30)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spy_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        if rc != 0:
            raise RuntimeError(f"py_calltree failed: {err[-300:]}")
        stacks = raw.read_text().splitlines() if raw.exists() else []
    info = json.loads(out.strip().splitlines()[-1])
    samples = 0
    depths: list[int] = []
    for line in stacks:
        frames, _, n = line.rpartition(" ")
        parts = frames.split(";")[1:]  # the first is the thread
        samples += int(n)
        depths.extend([len(parts)] * int(n))
    wall = seconds + 1.0
    return {"cpu_percent_of_core": spy_cpu / wall * 100, "samples_with_python": samples,
            "python_depth_median": statistics.median(depths) if depths else None, "steps": info["steps"],
            "steps_per_cpu_s": info["steps"] / max(1e-9, info["cpu_s"])}


def _plain_run(seconds: float) -> dict[str, Any]:
    gated = GatedProcess([python(), CALLTREE, str(seconds), "2"])
    gated.go()
    rc, out, err = gated.wait()
    if rc != 0:
        raise RuntimeError(f"py_calltree failed: {err[-300:]}")
    info = json.loads(out.strip().splitlines()[-1])
    return {"steps": info["steps"], "steps_per_cpu_s": info["steps"] / max(1e-9, info["cpu_s"])}


def _ours_run(seconds: float) -> dict[str, Any]:
    run = sampled_run([python(), CALLTREE, str(seconds), "2"])
    rows, names, info = run["rows"], run["names"], run["info"]
    mine = rows[np.isin(rows["tid"], info["tids"]) & (rows["t_ns"] >= info["t_work_ns"])]
    samples = 0
    depths: list[int] = []
    for r in mine:
        py = [s for s in names.get(int(r["user_stack"]), []) if s.startswith("py::")]
        if py:
            samples += int(r["count"])
            depths.extend([len(py)] * int(r["count"]))
    # the sampler's CPU: the BPF program (all its runs) plus the collector's drains
    cpu = (run["bpf_ns"] / 1e9 + run["cpu_s"]) / run["wall_s"] * 100
    return {"cpu_percent_of_core": cpu, "samples_with_python": samples,
            "python_depth_median": statistics.median(depths) if depths else None, "steps": info["steps"],
            "steps_per_cpu_s": info["steps"] / max(1e-9, info["cpu_s"])}


def python_sampler_choice(quick: bool) -> dict[str, Any]:
    exe = shutil.which("py-spy") or (str(REPO / ".venv" / "bin" / "py-spy")
                                     if (REPO / ".venv" / "bin" / "py-spy").exists() else None)
    if exe is None:
        return {"bench": "python_sampler_choice", "missing": "py-spy not installed (pip install py-spy)"}
    seconds, rounds = (3.0, 1) if quick else (6.0, 3)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "gpuprof_bpf": [], "py-spy": [], "py-spy --nonblocking": []}
    makers: dict[str, Callable[[], dict[str, Any]]] = {
        "plain": lambda: _plain_run(seconds),
        "gpuprof_bpf": lambda: _ours_run(seconds),
        "py-spy": lambda: _pyspy_run(seconds, []),
        "py-spy --nonblocking": lambda: _pyspy_run(seconds, ["--nonblocking"]),
    }
    order = list(makers)
    for r in range(rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:  # each round starts elsewhere
            runs[name].append(makers[name]())
    plain_steps = statistics.median(r["steps"] for r in runs["plain"])
    plain_rate = statistics.median(r["steps_per_cpu_s"] for r in runs["plain"])
    out: dict[str, Any] = {"bench": "python_sampler_choice", "program": "py_calltree 2 threads", "seconds": seconds,
                           "rounds": rounds, "plain_steps": _spread([r["steps"] for r in runs["plain"]])}
    for name in ("gpuprof_bpf", "py-spy", "py-spy --nonblocking"):
        rs = runs[name]
        out[name] = {
            "cpu_percent_of_core": _spread([r["cpu_percent_of_core"] for r in rs]),
            "samples_with_python": _spread([r["samples_with_python"] for r in rs]),
            "python_depth_median": statistics.median(r["python_depth_median"] or 0 for r in rs),
            "job_slowdown_percent": round((plain_steps / max(1, statistics.median(r["steps"] for r in rs)) - 1) * 100,
                                          2),
            # steps per CPU second of the job: what the sampler costs the job's own threads (the
            # BPF program runs in them), blind to the machine's other load but also to py-spy's pauses
            "job_cpu_cost_percent": round(
                (plain_rate / max(1e-9, statistics.median(r["steps_per_cpu_s"] for r in rs)) - 1) * 100, 2),
        }
    return out


def native_unwind_cost(quick: bool) -> dict[str, Any]:
    """tests/progs/nofp_tree.c (-fomit-frame-pointer): stack copies walked with CFI in user space
    (bpf/stackcopy.c + collector/native/unwind_dwarf.c) against the kernel's frame-pointer walk
    (the stacks source), runs interleaved."""
    reason = unwinder_skip_reason()
    if reason:
        return {"bench": "native_unwind_cost", "missing": reason}
    seconds, rounds = (2.0, 1) if quick else (4.0, 3)
    cfi: dict[str, list[float]] = {"bpf_ns": [], "unwind_us": [], "whole": [], "named": [], "depth": []}
    fp: dict[str, list[float]] = {"bpf_ns": [], "whole": [], "named": [], "depth": []}
    for _ in range(rounds):
        records, got = copied_stacks([str(nofp_tree()), str(seconds)])
        times, ids = [], []
        for r in records:
            t0 = time.perf_counter_ns()
            pcs = got["unwinder"].unwind(*r)
            times.append(time.perf_counter_ns() - t0)
            ids.append(got["store"].intern_user(got["pid"], pcs))
        got["unwinder"].close()
        names, modules = stack_frames(*got["store"].symbol_tables())
        n = max(1, len(ids))
        cfi["bpf_ns"].append(got["bpf_ns"] / n)
        cfi["unwind_us"].append(statistics.median(times) / 1000 if times else 0.0)
        cfi["whole"].append(sum(tuple(names[i][:5]) == NOFP_TREE for i in ids) / n)
        cfi["named"].append(sum(fully_named(names[i], modules[i]) for i in ids) / n)
        cfi["depth"].append(statistics.median(len(names[i]) for i in ids) if ids else 0)
        run = sampled_run([str(nofp_tree()), str(seconds)], python_frames=False, unwinder="frame_pointers")
        rows = run["rows"]
        mine = rows[np.isin(rows["tid"], run["info"]["tids"])]
        total = max(1, int(mine["count"].sum()))
        fp["bpf_ns"].append(run["bpf_ns"] / total)
        fp["whole"].append(sum(int(r["count"]) for r in mine
                               if tuple(run["names"].get(int(r["user_stack"]), [])[:5]) == NOFP_TREE) / total)
        fp["named"].append(sum(int(r["count"]) for r in mine
                               if fully_named(run["names"].get(int(r["user_stack"]), []),
                                              run["modules"].get(int(r["user_stack"]), []))) / total)
        fp["depth"].append(statistics.median(len(run["names"].get(int(r["user_stack"]), [])) for r in mine)
                           if len(mine) else 0)
    return {"bench": "native_unwind_cost", "program": "nofp_tree (C, -O2 -fomit-frame-pointer)", "rounds": rounds,
            "seconds": seconds, "bytes_per_sample_to_user_space": 8192 + 40,
            "cfi_copy": {"bpf_ns_per_sample": _spread(cfi["bpf_ns"]), "unwind_us_per_sample": _spread(cfi["unwind_us"]),
                         "whole_tree_share": _spread(cfi["whole"]), "fully_named_share": _spread(cfi["named"]),
                         "depth_median": statistics.median(cfi["depth"])},
            "frame_pointers": {"bpf_ns_per_sample": _spread(fp["bpf_ns"]), "whole_tree_share": _spread(fp["whole"]),
                               "fully_named_share": _spread(fp["named"]), "depth_median": statistics.median(fp["depth"])}}


def cfi_unwind_cost(quick: bool) -> dict[str, Any]:
    """tests/progs/nofp_tree.c (-fomit-frame-pointer) under the three unwinders, runs interleaved:
    the CFI tables walked in the BPF program (bpf/cfiunwind.h, the stacks source with
    unwinder="cfi"), the kernel's frame-pointer walk (unwinder="frame_pointers") and the stack copy
    (bpf/stackcopy.c): BPF ns per sample (bpf_stats: run_time_ns / samples of the job; the CFI
    walk's tail calls are counted in the program that started them), collector CPU, the share of
    samples unwound through the whole tree, the load average beside each round."""
    seconds, rounds = (2.0, 1) if quick else (4.0, 3)
    per: dict[str, list[float]] = {"cfi": [], "frame_pointers": [], "stack_copy": []}
    whole: dict[str, list[float]] = {"cfi": [], "frame_pointers": [], "stack_copy": []}
    cpu: dict[str, list[float]] = {"cfi": [], "frame_pointers": []}
    # the CFI walk starts at the first drain after the exec (up to 1 s): the share from that window on
    registered: dict[str, list[float]] = {"cfi": []}
    loads: list[float] = []
    copy_reason = unwinder_skip_reason()
    for r in range(rounds):
        order = ["cfi", "frame_pointers", "stack_copy"]
        for kind in order[r % 3:] + order[: r % 3]:
            loads.append(_load()[0])
            if kind == "stack_copy":
                if copy_reason:
                    continue
                records, got = copied_stacks([str(nofp_tree()), str(seconds)])
                ids = [got["store"].intern_user(got["pid"], got["unwinder"].unwind(*rec)) for rec in records]
                got["unwinder"].close()
                names, _ = stack_frames(*got["store"].symbol_tables())
                n = max(1, len(ids))
                per[kind].append(got["bpf_ns"] / n)
                whole[kind].append(sum(tuple(names[i][:5]) == NOFP_TREE for i in ids) / n)
                continue
            run = sampled_run([str(nofp_tree()), str(seconds)], python_frames=False, unwinder=kind)
            rows = run["rows"]
            mine = rows[np.isin(rows["tid"], run["info"]["tids"])]
            total = max(1, int(rows["count"].sum()))
            per[kind].append(run["bpf_ns"] / total)
            cpu[kind].append(run["cpu_s"] / run["wall_s"] * 100)
            is_whole = np.array([tuple(run["names"].get(int(x["user_stack"]), [])[:5]) == NOFP_TREE for x in mine],
                                bool)
            counts = mine["count"].astype(np.int64)
            whole[kind].append(float(counts[is_whole].sum()) / max(1, int(counts.sum())))
            if kind in registered and is_whole.any():
                later = mine["t_ns"] >= mine["t_ns"][is_whole].min()
                registered[kind].append(float(counts[is_whole & later].sum()) / max(1, int(counts[later].sum())))
    out: dict[str, Any] = {"bench": "cfi_unwind_cost", "program": "nofp_tree (C, -O2 -fomit-frame-pointer)",
                           "rounds": rounds, "seconds": seconds, "load_avg_1min": _spread(loads)}
    for kind, values in per.items():
        if not values:
            out[kind] = {"missing": copy_reason}
            continue
        out[kind] = {"bpf_ns_per_sample": _spread(values), "whole_tree_share": _spread(whole[kind])}
        if kind in cpu:
            out[kind]["collector_cpu_percent"] = _spread(cpu[kind])
        if kind in registered:
            out[kind]["whole_tree_share_once_registered"] = _spread(registered[kind])
    out["stack_copy_bytes_per_sample_to_user_space"] = 8192 + 40
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (noisier figures)")
    ap.add_argument("--only", default="", help="comma-separated figures to print (default: all): stack_quality, "
                                               "demo, python_unwind_cost, python_sampler_choice, native_unwind_cost, "
                                               "cfi_unwind_cost")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))

    def want(name: str) -> bool:
        return not only or name in only

    reason = bpf_skip_reason()
    if reason:
        print(json.dumps({"bench": "stack_quality", "missing": reason}), flush=True)
        return 0
    from gpuprof.collector.bpf_support import BpfHub, defines_for_all

    old = STATS.read_text().strip() if STATS.exists() else None
    if old is not None:
        STATS.write_text("1")
    hub = BpfHub.acquire(("stacks",), defines_for_all, "cfi")  # one compile for every run of the bench
    try:
        if want("stack_quality"):
            for line in stack_quality(args.quick):
                print(json.dumps(line), flush=True)
        if want("demo"):
            print(json.dumps(demo_quality(args.quick)), flush=True)
        if want("python_unwind_cost"):
            print(json.dumps(python_unwind_cost(args.quick)), flush=True)
        if want("python_sampler_choice"):
            print(json.dumps(python_sampler_choice(args.quick)), flush=True)
        if want("native_unwind_cost"):
            print(json.dumps(native_unwind_cost(args.quick)), flush=True)
        if want("cfi_unwind_cost"):
            print(json.dumps(cfi_unwind_cost(args.quick)), flush=True)
    finally:
        hub.release()
        if old is not None:
            STATS.write_text(old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
