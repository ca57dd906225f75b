"""The cost of naming native frames at seal (docs/probes.md, "Names of native frames"): one JSON
object per line.

  .venv/bin/python tests/bench/bench_symbols.py [--frames N] [--unbounded]

symbolize_cost   N distinct frames (default 1000) spread uniformly over the functions .eh_frame_hdr
                 lists in a real file (Debian's libc.so.6, the python3.11 executable), each a few
                 bytes into its function, named by a fresh Resolver (what one seal does): the file
                 alone (.dynsym / .symtab), with the debug roots (libc6-dbg's file by build id,
                 where installed) without inlined frames, and with them under the default budget
                 (--unbounded: also without a budget, what the DWARF walk would cost in full).
                 Figures: wall seconds (the first frame of a file pays its symbol table), us per
                 frame, the share of frames named, frames that became more than one (inlined),
                 DWARF entries parsed and whether the budget ran out. Uniform over a whole library
                 is the worst case for the DWARF walk (a real stack table meets far fewer functions).
symbolize_real   --real: the stack table of a real run (the stacks source with the CFI walk, 99 Hz,
                 a few seconds of tests/progs/py_calltree.py, a Python program calling numpy, and of
                 nofp_tree, C -O2 -g) named at seal three ways: without debug roots, with them but
                 no inlined frames, with both (default budget). Needs root and BCC.
Needs no root and no BPF (but --real).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gpuprof.collector import debuginfo
from gpuprof.collector.symbolize import Module, Resolver, is_unknown

FILES = ("/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/python3.11")


def frames_of(path: str, n: int, seed: int = 1) -> list[int]:
    """n file offsets, each 1-40 bytes into a function .eh_frame_hdr lists (distinct functions
    while there are enough)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        elf = debuginfo.read_elf_fd(fd, path)
        starts = elf.function_starts()
    finally:
        os.close(fd)
    if starts is None or not len(starts):
        raise SystemExit(f"{path}: no .eh_frame_hdr table")
    rnd = random.Random(seed)
    picks = rnd.sample(list(starts), n) if n <= len(starts) else [rnd.choice(list(starts)) for _ in range(n)]
    out = []
    for s in picks:
        off = elf.vaddr_to_offset(int(s) + rnd.randint(1, 40))
        if off is not None:
            out.append(off)
    return out


def run(path: str, offsets: list[int], roots: list[str], die_budget: int | None,
        seconds: float | None) -> dict[str, Any]:
    mods = [Module("kernel", name="[kernel]"), Module("elf", path, 0, os.path.basename(path))]
    r = Resolver(mods, debug_roots=roots, die_budget=die_budget, inline_seconds=seconds)
    try:
        t0 = time.perf_counter()
        c0 = time.process_time()
        first = r.resolve_frames(1, offsets[0])
        t_first = time.perf_counter() - t0
        out = [first] + [r.resolve_frames(1, o) for o in offsets[1:]]
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        names = r._by_key and next(iter(r._by_key.values()))
        return {"bench": "symbolize_cost", "file": path, "frames": len(offsets),
                "debug_roots": roots, "inline": die_budget != 0,
                "budget": "unbounded" if (die_budget or 0) > debuginfo.DIE_BUDGET else
                ("none" if die_budget == 0 else f"{debuginfo.DIE_BUDGET} DIEs, {debuginfo.INLINE_BUDGET_S} s"),
                "names_from": names.source if names else None,
                "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "first_frame_s": round(t_first, 3),
                "us_per_frame_after_first": round((wall - t_first) / max(1, len(offsets) - 1) * 1e6, 1),
                "named_share": round(sum(not is_unknown(f[-1][0]) for f in out) / len(out), 3),
                "inlined_frames": sum(len(f) > 1 for f in out), "dies_parsed": r.budget.used,
                "budget_exhausted": r.budget.exhausted}
    finally:
        r.close()


def real_tables(seconds: float) -> None:
    sys.path.insert(0, str(REPO / "tests" / "progs"))
    from harness import GatedProcess, bpf_skip_reason, make_ctx
    from stackcopy_run import nofp_tree

    from gpuprof.collector.sources.bpf_stacks import BpfStacksSource

    reason = bpf_skip_reason()
    if reason:
        raise SystemExit(f"--real: {reason}")
    programs = {"py_calltree": [sys.executable, str(REPO / "tests" / "progs" / "py_calltree.py"), str(seconds)],
                "nofp_tree": [str(nofp_tree()), str(seconds)]}
    for name, cmd in programs.items():
        src = BpfStacksSource(99, python_frames=True, unwinder="cfi")
        gated = GatedProcess(cmd)
        pid = gated.pid
        src.start(make_ctx(lambda p=pid: frozenset({p}), ("stacks",)))
        try:
            gated.go()
            while gated.proc.poll() is None:
                time.sleep(src.interval_s)
                src.sample(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
            gated.wait()
            src.final(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
            store = src.store
            assert store is not None
            for roots, budget in (((), 0), (("/usr/lib/debug",), 0), (("/usr/lib/debug",), None)):
                store.debug_roots = roots
                t0, c0 = time.perf_counter(), time.process_time()
                frames, symbols = store.symbol_tables(die_budget=budget)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                names = [s["name"].decode() for s in symbols]
                st = store.last_resolver_stats
                unknown = sum(is_unknown(names[int(i)]) for i in frames["symbol_id"])
                print(json.dumps({"bench": "symbolize_real", "program": name, "stacks": len(store.stacks),
                                  "frame_rows": len(frames), "debug_roots": list(roots), "inline": budget != 0,
                                  "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                                  "unknown_row_share": round(unknown / max(1, len(frames)), 3),
                                  "dies_parsed": st.get("dies_parsed"),
                                  "inline_budget_exhausted": st.get("inline_budget_exhausted"),
                                  "files": len(st.get("files", {})), "load_avg": list(os.getloadavg())}), flush=True)
        finally:
            src.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--debug-root", default="/usr/lib/debug")
    ap.add_argument("--unbounded", action="store_true", help="also the DWARF walk without a budget (slow)")
    ap.add_argument("--real", action="store_true", help="the stack tables of real runs (root, BCC)")
    ap.add_argument("--seconds", type=float, default=3.0, help="--real: each program's run")
    a = ap.parse_args()
    if a.real:
        real_tables(a.seconds)
        return 0
    for path in FILES:
        if not os.path.exists(path):
            continue
        offsets = frames_of(path, a.frames)
        configs: list[tuple[list[str], int | None, float | None]] = [([], 0, None), ([a.debug_root], 0, None),
                                                                     ([a.debug_root], None, None)]
        if a.unbounded:
            configs.append(([a.debug_root], 10**9, 3600.0))
        for roots, budget, seconds in configs:
            print(json.dumps(run(path, offsets, roots, budget, seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
