"""Cost of the off-CPU stacks (docs/probes.md, "Off-CPU time"): one JSON object per line.

  .venv/bin/python tests/bench/bench_offcpu.py [--quick] [--pairs N] [--seconds S]

offcpu_blocked_stacks  a program whose main thread blocks about 480 times a second (2 ms waits)
                       under block_c -> block_b -> block_a -> main (tests/progs/nofp_block.c, -O2
                       -fomit-frame-pointer) or under a Python call tree (tests/progs/py_offcpu_tree.py,
                       time.sleep), run under the off-CPU source alone with sources.stacks.unwinder
                       "cfi" (the default: CFI walk of the user stack and Python frames at each
                       blocked switch-out) and "frame_pointers" (the kernel's walk), in pairs with
                       a plain run, the order alternating. Figures: the BPF time of sched_switch
                       (kernel.bpf_stats_enabled; the tail calls of the CFI walk run inside it) per
                       blocked switch-out of the job, the collector's CPU while draining (the
                       whole run, and from 2 s on: after the process's registration), the
                       program's slowdown against the plain run (iterations of its loop), the share
                       of the blocked time whose user stack holds the whole known chain.
offcpu_switch_cost     two threads of one process yielding to each other on CPU 0 (tests/progs/
                       cpu_work.c, mode yield: a switch at every sched_yield, as MPI ranks polling
                       on a shared core), their yields per second with and without the off-CPU
                       source (the default config, drained every second), in pairs whose order
                       alternates: what every switch of a job thread costs it. A runnable
                       switch-out records nothing (docs/probes.md, "Off-CPU time").
Needs root, BCC and gcc. Medians with min and max over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "progs"))

import native_progs
from harness import GatedProcess, bpf_skip_reason, collect, make_ctx, python

from gpuprof.collector import schema

SWITCH_PROG = b"raw_tracepoint__sched_switch"
PY_OFFCPU = str(REPO / "tests" / "progs" / "py_offcpu_tree.py")
C_CHAIN = ("block_c", "block_b", "block_a", "main")
PY_CHAIN = ["py::<module>", "py::main", "py::outer", "py::middle", "py::leaf_sleep"]


def warm_tables(state: Path) -> None:
    """The CFI tables of libc, the loader and the Python interpreter into the state dir's disk cache
    (a node's prewarm does this at the collector's start): the runs measure the walk, not a compile."""
    native_progs.warm_cfi_tables(state, ("libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2"),
                                 (os.path.realpath(python()),))


def _prog_stats(src: Any, name: bytes) -> tuple[int, int] | None:
    """(run_time_ns, run_cnt) of a loaded program from its fdinfo (kernel.bpf_stats_enabled)."""
    try:
        fd = src.hub.bpf.funcs[name].fd
        info = dict(line.split(":", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
                    if ":" in line)
        return int(info["run_time_ns"]), int(info["run_cnt"])
    except (KeyError, OSError, ValueError, AttributeError):
        return None


def _whole(names: list[str], python_prog: bool) -> bool:
    if python_prog:
        return [n.split(" (")[0] for n in reversed(names) if n.startswith("py::")] == PY_CHAIN
    s = tuple(names)
    return "block_c" in s and s[s.index("block_c"):s.index("block_c") + len(C_CHAIN)] == C_CHAIN


def one_run(cmd: list[str], state: Path, unwinder: str | None, python_prog: bool) -> dict[str, Any]:
    """cmd plain (unwinder None) or under the off-CPU source with that unwinder."""
    import h5py

    from gpuprof.collector.sources.bpf_offcpu import BpfOffcpuSource
    from gpuprof.collector.symbolize import stack_names

    gated = GatedProcess(cmd)
    out: dict[str, Any] = {}
    if unwinder is None:
        gated.go()
        rc, stdout, err = gated.wait()
    else:
        src = BpfOffcpuSource(flush_interval_s=1.0)
        ctx = make_ctx(lambda: frozenset({gated.pid}), ("stacks",),
                       config={"paths": {"state_dir": str(state)}, "sources.stacks": {"unwinder": unwinder}})
        src.start(ctx)  # the BPF compile (seconds of CPU, once per collector) is not part of the figure
        batches = []
        try:
            before = _prog_stats(src, SWITCH_PROG) or (0, 0)
            cpu0, wall0 = time.process_time(), time.monotonic()
            gated.go()
            steady: tuple[float, float] | None = None  # (cpu, wall) 2 s in: after the process's registration
            while gated.proc.poll() is None:
                time.sleep(src.interval_s)
                batches.extend(src.sample(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
                if steady is None and time.monotonic() - wall0 >= 2.0:
                    steady = (time.process_time(), time.monotonic())
            if steady is not None:
                out["steady_cpu_s"], out["steady_wall_s"] = time.process_time() - steady[0], time.monotonic() - steady[1]
            rc, stdout, err = gated.wait()
            batches.extend(src.final(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
            out["cpu_s"], out["wall_s"] = time.process_time() - cpu0, time.monotonic() - wall0
            after = _prog_stats(src, SWITCH_PROG)
            out["bpf"] = (after[0] - before[0], after[1] - before[1]) if after else None
        finally:
            src.stop()
        rows = collect(batches, schema.OFFCPU_INTERVALS)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "node.h5"
            native_progs.sealed_file(path, [src], batches, ("stacks",))
            with h5py.File(path) as f:
                names = stack_names(f)
        out["rows"], out["names"] = rows, names
    if rc != 0:
        raise RuntimeError(f"{cmd} failed: {err[-500:]}")
    info = json.loads(stdout.strip().splitlines()[-1])
    out["info"] = info
    if unwinder is not None:
        rows, names = out.pop("rows"), out.pop("names")
        mine = rows[rows["tid"] == info["tids"][0]]
        blocked_rows = mine[mine["blocked_ns"] > 0]
        out["blocked_switch_outs"] = int(blocked_rows["count"].sum())
        total = int(blocked_rows["blocked_ns"].sum())
        whole = sum(int(r["blocked_ns"]) for r in blocked_rows if _whole(names.get(int(r["user_stack"]), []),
                                                                           python_prog))
        out["whole_chain_share"] = whole / max(1, total)
    return out


def _spread(v: list[float], digits: int = 2) -> dict[str, float] | None:
    return {"median": round(statistics.median(v), digits), "min": round(min(v), digits),
            "max": round(max(v), digits)} if v else None


def offcpu_blocked_stacks(program: str, seconds: float, pairs: int, state: Path) -> list[dict[str, Any]]:
    import native_progs

    python_prog = program == "python"
    cmd = ([python(), PY_OFFCPU, "sleep", str(seconds)] if python_prog
           else [str(native_progs.nofp_block()), "sleep", str(seconds)])
    label = ("py_offcpu_tree sleep (time.sleep 2 ms under main -> outer -> middle -> leaf_sleep)" if python_prog
             else "nofp_block sleep (nanosleep 2 ms under block_c -> block_b -> block_a -> main, -O2 "
                  "-fomit-frame-pointer)")
    out = []
    for unwinder in ("cfi", "frame_pointers"):
        per_switch: list[float] = []
        per_run: list[float] = []
        cpus: list[float] = []
        steady_cpus: list[float] = []
        slow: list[float] = []
        whole: list[float] = []
        episodes: list[int] = []
        for i in range(pairs):
            if i % 2 == 0:
                plain = one_run(cmd, state, None, python_prog)
                prof = one_run(cmd, state, unwinder, python_prog)
            else:
                prof = one_run(cmd, state, unwinder, python_prog)
                plain = one_run(cmd, state, None, python_prog)
            slow.append((plain["info"]["iterations"] / max(1, prof["info"]["iterations"]) - 1) * 100)
            cpus.append(prof["cpu_s"] / prof["wall_s"] * 100)
            if prof.get("steady_wall_s"):
                steady_cpus.append(prof["steady_cpu_s"] / prof["steady_wall_s"] * 100)
            whole.append(prof["whole_chain_share"])
            episodes.append(prof["blocked_switch_outs"])
            if prof["bpf"] and prof["bpf"][1] and prof["blocked_switch_outs"]:
                per_switch.append(prof["bpf"][0] / prof["blocked_switch_outs"])
                per_run.append(prof["bpf"][0] / prof["bpf"][1])
        out.append({
            "bench": "offcpu_blocked_stacks", "program": label, "unwinder": unwinder,
            # every sched_switch run of the machine (other processes': two failed lookups) divided by the
            # job's blocked switch-outs: an upper bound of the cost of one
            "bpf_ns_per_blocked_switch_out": _spread(per_switch, 0),
            "bpf_ns_per_sched_switch_run": _spread(per_run, 0),
            "blocked_switch_outs": _spread([float(e) for e in episodes], 0),
            "collector_cpu_percent_of_core": _spread(cpus, 3),  # the whole run, registration included
            "collector_cpu_percent_of_core_from_2s": _spread(steady_cpus, 3),  # the drains only
            "job_slowdown_percent": _spread(slow),
            "whole_chain_share_of_blocked_time": _spread(whole, 3),
            "seconds": seconds, "pairs": pairs, "interleaved": "alternating order",
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        })
    return out


def offcpu_switch_cost(seconds: float, pairs: int) -> dict[str, Any]:
    from harness import run_source_over

    from gpuprof.collector.sources.bpf_offcpu import BpfOffcpuSource

    prog = str(native_progs.cpu_work())

    def yields_per_s(profiled: bool) -> float:
        gated = GatedProcess([prog, "yield", str(seconds)])
        if profiled:
            ctx = make_ctx(lambda: frozenset({gated.pid}), ("stacks",))
            _, (rc, _out, err) = run_source_over(BpfOffcpuSource(), ctx, gated, poll_s=1.0)
        else:
            gated.go()
            rc, _out, err = gated.wait()
        if rc != 0:
            raise RuntimeError(f"cpu_work yield failed: {err[-500:]}")
        return json.loads(err.strip().splitlines()[-1])["iterations"] / seconds

    plain: list[float] = []
    profiled: list[float] = []
    for i in range(pairs):
        for p in ((False, True) if i % 2 == 0 else (True, False)):
            (profiled if p else plain).append(yields_per_s(p))
    fewer = [(a / b - 1) * 100 for a, b in zip(plain, profiled)]
    return {"bench": "offcpu_switch_cost", "program": "cpu_work yield (two threads, sched_yield, CPU 0)",
            "fewer_yields_percent": round((statistics.median(plain) / statistics.median(profiled) - 1) * 100, 2),
            "pair_percent": _spread(fewer), "plain_yields_per_s": _spread(plain, 0),
            "profiled_yields_per_s": _spread(profiled, 0), "seconds": seconds, "pairs": pairs,
            "interleaved": "alternating order", "load_avg": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs, one pair (noisier figures)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each run (the work, after 0.3-1 s of start)")
    args = ap.parse_args()
    reason = bpf_skip_reason()
    if reason:
        print(json.dumps({"bench": "offcpu_blocked_stacks", "missing": reason}))
        return 0
    seconds, pairs = (2.0, 1) if args.quick else (args.seconds, args.pairs)
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    old_stats = stats.read_text().strip() if stats.exists() else None
    if old_stats is not None:
        stats.write_text("1")
    try:
        with tempfile.TemporaryDirectory() as d:
            state = Path(d)
            warm_tables(state)
            for program in ("c", "python"):
                for line in offcpu_blocked_stacks(program, seconds, pairs, state):
                    print(json.dumps(line), flush=True)
        print(json.dumps(offcpu_switch_cost(seconds, max(pairs, 3))), flush=True)
    finally:
        if old_stats is not None:
            stats.write_text(old_stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
