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
Needs no root and no BPF.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--debug-root", default="/usr/lib/debug")
    ap.add_argument("--unbounded", action="store_true", help="also the DWARF walk without a budget (slow)")
    a = ap.parse_args()
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
