"""Figures of the probes (docs/probes.md): one JSON object per line, each against the same program
uninstrumented in the same run.

  .venv/bin/python tests/bench/bench_probes.py [--quick]

collective_overhead  per-call cost of the uprobe path and of the fast path (tight loop of
                     MPI_Allreduce on MPI_COMM_SELF), the fast path's cost per MPI_Testany that
                     completes nothing (a polling loop's call: hpcc's RandomAccess makes millions),
                     and the slowdown of a 2-rank program doing one MPI_Allreduce after every 100 us
                     of computation
collective_loss      calls made vs rows captured at about 10,000 collectives/s on the node, per path
stack_sampling       the stacks source at 99 Hz over a program with 16 busy threads: the collector's
                     CPU time while sampling (and at seal, symbolizing), bytes per sample on disk
                     including the stack table (gzip as the writer), the BPF program's cost per
                     sample (kernel.bpf_stats_enabled) and the program's slowdown against a plain run
Needs root and BCC for the uprobe and stack figures, mpicc/mpirun for the collective ones, gcc.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "progs"))

from harness import GatedProcess, bpf_skip_reason, collect, make_ctx, mpirun_cmd, run_source_over

from gpuprof.collector import schema
from gpuprof.collector.fastpath_env import built_libraries
from gpuprof.collector.sources.base import Source
from gpuprof.collector.sources.bpf_collectives import BpfCollectivesSource
from gpuprof.collector.sources.fastpath import FastpathSource

BENCH = REPO / "tests" / "progs" / "build" / "mpi_bench"
ALLREDUCE = schema.COLLECTIVE_OPS.index("MPI_Allreduce")


def build() -> None:
    BENCH.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mpicc", "-O2", "-o", str(BENCH), str(REPO / "tests" / "progs" / "mpi_bench.c")], check=True)
    subprocess.run(["make", "-s", "-C", str(REPO / "bpf" / "fastpath")], check=True)


def run(args: list[str], ranks: int, path: str | None) -> tuple[dict[str, Any], int, int]:
    """Run mpi_bench; path None (plain), 'fastpath' or 'uprobe'. Returns (its JSON, rows of
    MPI_Allreduce captured, records dropped)."""
    job = f"bench{uuid.uuid4().hex[:6]}"
    env: dict[str, str] = {}
    src: Source | None = None
    config = {"sources.collectives": {"mpi_path": path or "uprobe", "nccl_path": "uprobe"}}
    ring_dir: str | None = None
    if path == "fastpath":
        # a private directory, as the prolog makes one per job (the interposers refuse /dev/shm itself)
        ring_dir = tempfile.mkdtemp(prefix="gpuprof-bench-", dir="/dev/shm")
        env = {"LD_PRELOAD": str(built_libraries()["mpi"]), "GPUPROF_FASTPATH_JOB": job,
               "GPUPROF_FASTPATH_DIR": ring_dir}
        src = FastpathSource(ring_dir=ring_dir)
    elif path == "uprobe":
        src = BpfCollectivesSource(("mpi",))
    gated = GatedProcess(mpirun_cmd(ranks, [str(BENCH), *args], env=env))
    if src is None:
        gated.go()
        rc, out, err = gated.wait(timeout=600)
        captured = dropped = 0
    else:
        ctx = make_ctx(lambda: frozenset({gated.pid}), ("collectives",), config=config, job_id=job)
        # drained at the source's own interval, as the collector does
        try:
            batches, (rc, out, err) = run_source_over(src, ctx, gated, timeout=600, poll_s=src.interval_s)
        finally:
            if ring_dir is not None:
                shutil.rmtree(ring_dir, ignore_errors=True)
        calls = collect(batches, schema.COLLECTIVE_CALLS)
        captured = int((calls["op"] == ALLREDUCE).sum())
        # what the source itself counted (interposer rings full, BPF ring buffer full), read at its stop
        dropped = src.dropped_total if isinstance(src, (FastpathSource, BpfCollectivesSource)) else 0
    if rc != 0:
        raise RuntimeError(f"mpi_bench {args} ({path}) failed: {err[-500:]}")
    return json.loads(out.strip().splitlines()[-1]), captured, dropped


def best(args: list[str], ranks: int, paths: tuple[str | None, ...], reps: int) -> dict[str | None, float]:
    """Shortest loop time of each variant over `reps` interleaved runs (the VMs are noisy: the
    minimum is the run least disturbed by others)."""
    out: dict[str | None, float] = {}
    for _ in range(reps):
        for path in paths:
            sec = run(args, ranks, path)[0]["seconds"]
            out[path] = min(out.get(path, sec), sec)
    return out


def pairs_of(args: list[str], ranks: int, path: str, reps: int) -> tuple[list[float], list[float]]:
    """The loop times of `reps` interleaved pairs (plain, then the path), in order."""
    plain: list[float] = []
    instrumented: list[float] = []
    for _ in range(reps):
        plain.append(run(args, ranks, None)[0]["seconds"])
        instrumented.append(run(args, ranks, path)[0]["seconds"])
    return plain, instrumented


def collective_overhead(quick: bool) -> dict[str, Any]:
    tight = 50_000 if quick else 200_000
    tight_uprobe = 5_000 if quick else 20_000
    paced = 3_000 if quick else 10_000
    polls = 2_000_000 if quick else 20_000_000
    reps = 2 if quick else 5
    bpf = bpf_skip_reason() is None
    t = best(["tight", str(tight)], 1, (None, "fastpath"), reps)
    plain_q, fast_q = pairs_of(["poll", str(polls)], 1, "fastpath", 7 if not quick else 2)
    added = sorted((f - p) / polls * 1e9 for p, f in zip(plain_q, fast_q, strict=True))
    paths: tuple[str | None, ...] = (None, "fastpath", "uprobe") if bpf else (None, "fastpath")
    p = best(["paced", str(paced), "100"], 2, paths, reps)
    out: dict[str, Any] = {
        "bench": "collective_overhead",
        "fastpath_ns_per_call": round((t["fastpath"] - t[None]) / tight * 1e9, 1),
        # a few ns on a call of about 25: medians of interleaved pairs, the pairs' spread beside
        "fastpath_ns_per_poll": round((statistics.median(fast_q) - statistics.median(plain_q)) / polls * 1e9, 2),
        "fastpath_ns_per_poll_pairs": {"min": round(added[0], 2), "max": round(added[-1], 2)},
        "plain_ns_per_poll": round(statistics.median(plain_q) / polls * 1e9, 2),
        "fastpath_slowdown_percent": round((p["fastpath"] / p[None] - 1) * 100, 2),
    }
    if not bpf:
        out.update(uprobe_us_per_call=None, uprobe_slowdown_percent=None, uprobe_missing=bpf_skip_reason())
        return out
    u = best(["tight", str(tight_uprobe)], 1, (None, "uprobe"), reps)
    out["uprobe_us_per_call"] = round((u["uprobe"] - u[None]) / tight_uprobe * 1e6, 2)
    out["uprobe_slowdown_percent"] = round((p["uprobe"] / p[None] - 1) * 100, 2)
    return out


def collective_loss(quick: bool) -> list[dict[str, Any]]:
    """About 10,000 collectives/s on the node: one rank, one MPI_Allreduce per ~100 us (one rank
    because two busy ranks and the collector oversubscribe the 2-core test VMs)."""
    n = 20_000 if quick else 60_000
    lines = []
    for path in ("fastpath", "uprobe"):
        if path == "uprobe" and bpf_skip_reason():
            continue
        res, captured, dropped = run(["paced", str(n), "95"], 1, path)
        lines.append({"bench": "collective_loss", "path": path, "calls": n, "captured": captured,
                      "dropped": dropped, "rate_per_s": round(n / res["seconds"])})
    return lines


def _hot_run(seconds: float, threads: int, src: Any = None) -> dict[str, Any]:
    """cpu_work hot THREADS SECONDS, plain or under the stacks source (one drain per second)."""
    import time

    import native_progs

    gated = GatedProcess([str(native_progs.cpu_work()), "hot", str(threads), str(seconds)])
    out: dict[str, Any] = {}
    if src is None:
        gated.go()
        rc, _, err = gated.wait(timeout=seconds + 60)
    else:
        ctx = make_ctx(lambda: frozenset({gated.pid}), ("stacks",))
        src.start(ctx)  # the compile (about 1 s of CPU, once per collector) is not part of the figure
        batches = []
        try:
            cpu0, wall0 = time.process_time(), time.monotonic()
            gated.go()
            while gated.proc.poll() is None:
                time.sleep(src.interval_s)
                batches.extend(src.sample(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
            rc, _, err = gated.wait()
            batches.extend(src.final(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
            out["cpu_s"], out["wall_s"] = time.process_time() - cpu0, time.monotonic() - wall0
            out["bpf"] = _prog_stats(src)
        finally:
            src.stop()
        out["batches"] = batches
    if rc != 0:
        raise RuntimeError(f"cpu_work failed: {err[-500:]}")
    out["iterations"] = json.loads(err.strip().splitlines()[-1])["iterations"]
    return out


def _prog_stats(src: Any) -> tuple[int, int] | None:
    """(run_time_ns, run_cnt) of the sampling program from its fdinfo (kernel.bpf_stats_enabled)."""
    try:
        fd = src.hub.bpf.funcs[b"gp_cpu_sample"].fd
        info = dict(line.split(":", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
                    if ":" in line)
        return int(info["run_time_ns"]), int(info["run_cnt"])
    except (KeyError, OSError, ValueError, AttributeError):
        return None


def stack_sampling(quick: bool, unwinder: str | None = None, pairs: int = 3) -> dict[str, Any]:
    """99 Hz over 16 busy threads: collector CPU, bytes per sample on disk, BPF cost, and the job's
    slowdown against unprofiled runs: `pairs` pairs (plain, profiled), the order alternating,
    medians with min and max. unwinder: sources.stacks.unwinder (None: the config's default, what a
    user gets)."""
    import statistics
    import tempfile
    import time

    import h5py

    from gpuprof.collector import config
    from gpuprof.collector.sources.bpf_stacks import BpfStacksSource
    from gpuprof.collector.writer import CHUNK_ROWS, compression_kwargs

    reason = bpf_skip_reason()
    if reason:
        return {"bench": "stack_sampling", "cpu_percent_of_core": None, "bytes_per_sample": None, "missing": reason}
    seconds, threads = (5.0 if quick else 20.0), 16
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    old_stats = stats.read_text().strip() if stats.exists() else None
    if old_stats is not None:
        stats.write_text("1")
    pairs = 1 if quick else pairs
    slowdowns: list[float] = []
    cpus: list[float] = []
    bpf_ns: list[float] = []
    try:
        for i in range(pairs):
            src = BpfStacksSource(99, unwinder=unwinder)
            if i % 2 == 0:
                plain = _hot_run(seconds, threads)
                run_ = _hot_run(seconds, threads, src)
            else:
                run_ = _hot_run(seconds, threads, src)
                plain = _hot_run(seconds, threads)
            slowdowns.append((plain["iterations"] / max(1, run_["iterations"]) - 1) * 100)
            cpus.append(run_["cpu_s"] / run_["wall_s"] * 100)
            if run_["bpf"] and run_["bpf"][1]:
                bpf_ns.append(run_["bpf"][0] / run_["bpf"][1])
    finally:
        if old_stats is not None:
            stats.write_text(old_stats)

    def spread(v: list[float], digits: int = 2) -> dict[str, float] | None:
        return {"median": round(statistics.median(v), digits), "min": round(min(v), digits),
                "max": round(max(v), digits)} if v else None
    rows = collect(run_["batches"], schema.STACK_SAMPLES)
    samples = int(rows["count"].sum())
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "node.h5"
        with h5py.File(path, "w", libver="latest") as f:
            for t in (schema.STACK_SAMPLES, schema.STACK_FRAMES, schema.STACK_SYMBOLS):
                f.create_dataset(t.path, shape=(0,), maxshape=(None,), dtype=t.dtype, chunks=(CHUNK_ROWS,),
                                 **compression_kwargs("gzip"))
            # as the writer appends: one batch per drain
            for _, part in run_["batches"]:
                ds = f[schema.STACK_SAMPLES.path]
                n = ds.shape[0]
                ds.resize((n + len(part),))
                ds[n:] = part
        seal0 = time.process_time()
        with h5py.File(path, "r+") as f:
            src.at_seal(f)
        seal_cpu = time.process_time() - seal0
        with h5py.File(path, "r") as f:
            stored = {t.name: f[t.path].id.get_storage_size()
                      for t in (schema.STACK_SAMPLES, schema.STACK_FRAMES, schema.STACK_SYMBOLS)}
            n_stacks = len(set(f[schema.STACK_FRAMES.path]["stack_id"].tolist()))
    return {
        "bench": "stack_sampling",
        "unwinder": unwinder or f"{config.defaults()['sources.stacks']['unwinder']} (the default)",
        "cpu_percent_of_core": spread(cpus, 3),
        "bytes_per_sample": round(sum(stored.values()) / max(1, samples), 3),
        "samples": samples, "rows": len(rows), "stacks": n_stacks, "bytes": stored,
        "threads": threads, "seconds": seconds, "seal_cpu_s": round(seal_cpu, 3),
        "bpf_ns_per_sample": spread(bpf_ns, 0),
        "job_slowdown_percent": spread(slowdowns),
        "pairs": pairs, "interleaved": "alternating order", "load_avg": [round(x, 2) for x in os.getloadavg()],
        "goals": {"cpu_percent_of_core": 1.0, "bytes_per_sample": 8.0, "job_slowdown_percent": 1.0},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (noisier figures)")
    args = ap.parse_args()
    build()
    print(json.dumps(collective_overhead(args.quick)), flush=True)
    for line in collective_loss(args.quick):
        print(json.dumps(line), flush=True)
    print(json.dumps(stack_sampling(args.quick)), flush=True)
    print(json.dumps(stack_sampling(args.quick, "frame_pointers")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
