"""Collector figures, one JSON object per line (issue 3). GPU values come from the NVML test double
(tests/nvml_double), so every line says "emulated": true: they are costs, not GPU measurements.

    .venv/bin/python tests/bench/bench_collector.py            full run (>= 60 s of collection)
    .venv/bin/python tests/bench/bench_collector.py --quick    smoke run (a few seconds)
    .venv/bin/python tests/bench/bench_collector.py --filters  also compare gzip/lzf/none on a
                                                               10-minute default-rate file

collector_cpu: `gpuprof collect` with the default sources (metrics: host + NVML at 10 Hz, clock,
process tracker), 8 emulated GPUs, 16 real job processes; CPU of the collector process from
/proc/PID/stat, peak RSS from VmHWM. baseline: a process that makes only the same emulated NVML
calls, done the same way (NvmlSource as the collector runs it: its native sampling thread at 10 Hz,
collector/native/nvmltick.c, drained by NvmlSource.sample once a second, processes queried at
1 Hz), for the same time, concurrently.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "nvml_double"))
import double

from gpuprof.collector import schema
from gpuprof.collector.writer import NodeMeta, NodeTraceWriter

TICK = os.sysconf("SC_CLK_TCK")
BASELINE = r"""
import os, sys, time
sys.path.insert(0, {root!r})
from gpuprof.collector.sources.nvml import NvmlSource
from gpuprof.collector.sources.base import SourceContext
from gpuprof.collector.config import defaults
pids = frozenset(int(p) for p in {pids!r})
ctx = SourceContext("b", "n", ("metrics",), {{}}, lambda: pids, lambda: (), lambda s, m: None, lambda *a: None)
src = NvmlSource(defaults()["sources.nvml"] | {{"gpus": "all"}}, threaded=True)
src.start(ctx)
end = time.monotonic() + {duration}
nxt = time.monotonic()
while time.monotonic() < end:
    src.sample(time.monotonic_ns())
    nxt += src.interval_s
    time.sleep(max(0.0, nxt - time.monotonic()))
src.stop()
"""


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / TICK


def hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench_collector(duration: float, tmp: Path) -> None:
    lib = double.build()
    jobs = [subprocess.Popen(["sleep", str(duration + 60)]) for _ in range(16)]
    pids = [p.pid for p in jobs]
    conf = double.write_config(tmp / "fake.conf", gpus=8, pids=pids[:4])
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPUPROF_NVML_LIBRARY=str(lib),
               GPUPROF_FAKE_NVML_CONFIG=str(conf))
    # the job: a parent shell owning the 16 processes is what --pid would follow; here the
    # 16 are children of this script, so --pid is this process and the tracker finds them
    out = tmp / "node.h5"
    coll = subprocess.Popen(
        [sys.executable, "-m", "gpuprof.slurm_hooks.cli", "collect", "--pid", str(os.getpid()), "--modes", "metrics",
         "--gpus", "all", "--output", str(out), "--duration", str(duration), "--nice", "0"],
        env=env, stderr=subprocess.DEVNULL)
    base = subprocess.Popen([sys.executable, "-c", BASELINE.format(root=str(ROOT), pids=pids, duration=duration)],
                            env=env)
    time.sleep(3.0)  # skip interpreter start-up and imports: the steady state is what a job pays
    c0, b0, t0 = cpu_s(coll.pid), cpu_s(base.pid), time.monotonic()
    peak = 0.0
    while coll.poll() is None and time.monotonic() - t0 < duration - 3.5:
        peak = max(peak, hwm_mb(coll.pid))
        time.sleep(0.5)
    c1, b1, t1 = cpu_s(coll.pid), cpu_s(base.pid), time.monotonic()
    peak = max(peak, hwm_mb(coll.pid))
    coll.wait()
    base.wait()
    for p in jobs:
        p.kill()
        p.wait()
    wall = t1 - t0
    print(json.dumps({"bench": "collector_cpu", "cpu_percent_of_core": round(100 * (c1 - c0) / wall, 3),
                      "peak_rss_mb": round(peak, 1), "baseline_cpu_percent": round(100 * (b1 - b0) / wall, 3),
                      "emulated": True, "gpus": 8, "job_processes": 16, "rate_hz": 10,
                      "measured_s": round(wall, 1)}), flush=True)
    size_mb = out.stat().st_size / 1e6
    print(json.dumps({"bench": "collector_bytes", "mb_per_min": round(size_mb / (duration / 60), 4),
                      "filter": "gzip", "file_mb": round(size_mb, 3), "duration_s": duration,
                      "emulated": True}), flush=True)


def synthetic_minute_rows(rng: np.random.Generator, t0: int, seconds: float) -> dict[str, np.ndarray]:
    """Default-rate rows with realistic variation (noisy utilization, growing counters)."""
    n = int(seconds * 10)
    t = t0 + (np.arange(n) * 100_000_000).astype(np.uint64)
    out: dict[str, np.ndarray] = {}  # table path -> rows
    s = schema.GPU_SAMPLES.empty(n * 8)
    s["t_ns"] = np.repeat(t, 8)
    s["gpu"] = np.tile(np.arange(8), n)
    s["util_gpu"] = np.clip(rng.normal(85, 10, n * 8), 0, 100).round()
    s["util_mem"] = np.clip(rng.normal(40, 8, n * 8), 0, 100).round()
    s["mem_used_bytes"] = 60e9 + rng.integers(0, 2**20, n * 8)
    s["power_w"] = rng.normal(550, 40, n * 8).round(3)
    s["temp_c"] = rng.integers(55, 70, n * 8)
    s["sm_clock_mhz"] = rng.choice([1755, 1980], n * 8)
    s["mem_clock_mhz"] = 2619
    s["pcie_tx_kbps"] = rng.normal(2e6, 3e5, n * 8)
    s["pcie_rx_kbps"] = rng.normal(4e6, 5e5, n * 8)
    s["nvlink_tx_kbps"] = rng.normal(1.5e8, 2e7, n * 8)
    s["nvlink_rx_kbps"] = rng.normal(1.5e8, 2e7, n * 8)
    s["throttle_reasons"] = 0
    out[schema.GPU_SAMPLES.path] = s
    g = schema.GPU_GPM.empty(n * 8)
    g["t_ns"], g["gpu"], g["interval_ns"] = s["t_ns"], s["gpu"], 100_000_000 + rng.integers(0, 50_000, n * 8)
    for col in ("sm_activity", "sm_occupancy", "tensor_activity", "dram_bw_util"):
        g[col] = np.clip(rng.normal(60, 15, n * 8), 0, 100)
    out[schema.GPU_GPM.path] = g
    p = schema.HOST_PROCS.empty(n * 16)
    p["t_ns"], p["pid"] = np.repeat(t, 16), np.tile(np.arange(1000, 1016), n)
    p["cpu_time_ns"] = np.repeat(np.arange(n), 16) * 100_000_000 + rng.integers(0, 10_000_000, n * 16)
    p["rss_bytes"] = 4e9 + rng.integers(0, 2**16, n * 16) * 4096
    p["num_threads"] = 48
    p["voluntary_ctxsw"] = np.repeat(np.arange(n), 16) * 50
    p["involuntary_ctxsw"] = np.repeat(np.arange(n), 16) * 5
    p["read_bytes"] = p["write_bytes"] = 0
    out[schema.HOST_PROCS.path] = p
    h = schema.HOST_NODE.empty(n)
    h["t_ns"], h["cpu_busy"] = t, rng.uniform(0.6, 0.9, n)
    h["mem_used_bytes"], h["mem_total_bytes"] = 500e9 + rng.integers(0, 2**30, n), 2e12
    h["net_rx_bytes"] = np.cumsum(rng.integers(0, 10**7, n))
    h["net_tx_bytes"] = np.cumsum(rng.integers(0, 10**7, n))
    h["load1"] = rng.uniform(30, 40, n)
    out[schema.HOST_NODE.path] = h
    c = schema.CLOCK_PAIRS.empty(int(seconds))
    c["monotonic_ns"] = t0 + np.arange(int(seconds)) * 10**9
    c["realtime_ns"] = c["monotonic_ns"].astype(np.int64) + 1_700_000_000 * 10**9
    c["uncertainty_ns"] = rng.integers(20, 80, int(seconds))
    out[schema.CLOCK_PAIRS.path] = c
    return out


def bench_filters(tmp: Path, minutes: float) -> None:
    """Same 10-minute default-rate data through the writer with each filter, flushed every
    collector.flush_interval_s, as the collector does."""
    from gpuprof.collector.config import defaults

    every = float(defaults()["collector"]["flush_interval_s"])
    for filt in ("gzip", "lzf", "none"):
        rng = np.random.default_rng(1)
        path = tmp / f"f-{filt}.h5"
        meta = NodeMeta(job_id="bench", node="n", modes=("metrics",), synthetic=True)
        c0 = time.process_time()
        w = NodeTraceWriter(path, meta, schema.tables_for_modes(("metrics",)), compression=filt)
        for k in range(int(minutes * 60 / every)):
            for tpath, rows in synthetic_minute_rows(rng, int(k * every * 1e9), every).items():
                w.append(tpath, rows)
            w.flush()
        w.seal(drops={})
        cpu = time.process_time() - c0
        print(json.dumps({"bench": "trace_filter", "filter": filt, "minutes": minutes,
                          "mb_per_min": round(path.stat().st_size / 1e6 / minutes, 4),
                          "writer_cpu_s": round(cpu, 3), "flush_interval_s": every, "synthetic": True}), flush=True)


def bench_writer(tmp: Path, seconds: float) -> None:
    """Records per second the writer thread's drain+append+flush path absorbs (host/procs rows)."""
    meta = NodeMeta(job_id="bench", node="n", modes=("metrics",), synthetic=True)
    w = NodeTraceWriter(tmp / "w.h5", meta, schema.tables_for_modes(("metrics",)), compression="gzip")
    batch = synthetic_minute_rows(np.random.default_rng(2), 0, 60.0)[schema.HOST_PROCS.path]  # 9600 rows
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        w.append(schema.HOST_PROCS.path, batch)
        w.flush()
        n += len(batch)
    dt = time.monotonic() - t0
    w.seal(drops={})
    print(json.dumps({"bench": "writer_throughput", "records_per_s": int(n / dt), "filter": "gzip",
                      "batch_rows": len(batch)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--duration", type=float, default=None, help="collection seconds (default 75, quick 8)")
    ap.add_argument("--filters", action="store_true", help="compare HDF5 filters on a 10-minute file")
    a = ap.parse_args()
    duration = a.duration or (8.0 if a.quick else 75.0)
    with tempfile.TemporaryDirectory(prefix="gpuprof-bench-") as d:
        tmp = Path(d)
        bench_collector(duration, tmp)
        bench_writer(tmp, 1.0 if a.quick else 5.0)
        if a.filters:
            bench_filters(tmp, 1.0 if a.quick else 10.0)


if __name__ == "__main__":
    main()
