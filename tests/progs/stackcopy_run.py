"""Runs of the stack-copy sampler (bpf/stackcopy.c) and the CFI unwinder
(collector/native/unwind_dwarf.c) over tests/progs/nofp_tree.c, shared by tests/test_bpf_stacks.py
and tests/bench/bench_stacks.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

NOFP_TREE = ("leaf_spin", "level_c", "level_b", "level_a", "main")


def nofp_tree() -> Path:
    """tests/progs/nofp_tree.c built -O2 -fomit-frame-pointer (what distributions and HPC codes do)."""
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        raise FileNotFoundError("gcc not installed")
    src = Path(__file__).resolve().parent / "nofp_tree.c"
    out = src.parent / "build" / "nofp_tree"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        out.parent.mkdir(exist_ok=True)
        subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-o", str(out), str(src)], check=True)
    return out


def unwinder_skip_reason() -> str | None:
    import subprocess

    from gpuprof.collector.symbolize import UNWIND_LIBRARY

    if not Path(UNWIND_LIBRARY).exists():
        native = Path(__file__).resolve().parents[2] / "collector" / "native"
        r = subprocess.run(["make", "-C", str(native), "unwind"], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            return f"make -C collector/native unwind failed (apt-get install libdw-dev): {r.stderr[-300:]}"
    return None


def copied_stacks(prog: list[str]) -> tuple[list[tuple[int, int, int, bytes]], dict[str, Any]]:
    """Run prog under bpf/stackcopy.c at 99 Hz: its stack copies (ip, sp, bp, bytes), the
    unwinder and store made while it lives, the BPF counters, the BPF program's run time (with
    kernel.bpf_stats_enabled) and the program's JSON line."""
    import json
    import os

    from bcc import BPF
    from harness import GatedProcess

    from gpuprof.collector.bpf_support import BPF_DIR
    from gpuprof.collector.symbolize import DwarfUnwinder, StackStore

    b = BPF(src_file=str(BPF_DIR / "stackcopy.c").encode())
    gated = GatedProcess(prog)
    pids = b[b"gp_copy_pids"]
    pids[pids.Key(gated.pid)] = pids.Leaf(1)
    records: list[tuple[int, int, int, bytes]] = []

    def keep(ctx: Any, data: Any, size: int) -> None:
        ev = b[b"gp_stack_copies"].event(data)
        records.append((int(ev.ip), int(ev.sp), int(ev.bp), bytes(bytearray(ev.data)[: ev.len])))

    b[b"gp_stack_copies"].open_ring_buffer(keep)
    b.attach_perf_event(ev_type=1, ev_config=0, fn_name=b"gp_copy_sample", sample_freq=99)
    try:
        gated.go()
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{gated.pid}/exe") != str(prog[0]) and time.monotonic() < deadline:
            time.sleep(0.01)  # the program sleeps 0.3 s after its exec: its maps are read then
        unwinder = DwarfUnwinder(gated.pid)
        store = StackStore()
        store.watch([gated.pid])
        while gated.proc.poll() is None:
            b.ring_buffer_poll(200)
        rc, out, err = gated.wait()
        b.ring_buffer_consume()
        counters = [int(sum(v)) for _, v in sorted(b[b"gp_copy_counters"].items(), key=lambda kv: kv[0].value)]
        fd = b.funcs[b"gp_copy_sample"].fd
        info = dict(line.split(":", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
                    if ":" in line)
        bpf_ns = int(info.get("run_time_ns", "0"))
    finally:
        b.cleanup()
    assert rc == 0, err
    return records, {"unwinder": unwinder, "store": store, "counters": counters, "pid": gated.pid, "bpf_ns": bpf_ns,
                     "info": json.loads(out.strip().splitlines()[-1])}
