"""Figures of the GPU-side collectors (docs/probes.md, "Costs"): one JSON object per line, each
against a baseline measured in the same run, medians of interleaved runs with min and max.

  .venv/bin/python tests/bench/bench_gpu_side.py [--quick]

nccl_plugin_overhead  ns per plugin call (startEvent / stopEvent / recordEventState) of
                      libnccl-profiler-gpuprof.so, driven by the TEST DOUBLE of NCCL
                      (tests/doubles/nccl_profiler_host.c --bench) against a plugin that does nothing
                      (tests/doubles/nccl_profiler_null.c) in the same run; records lost from the
                      ring. Measured through the double, not in NCCL: no GPU here.
nvtx_overhead         ns per NVTX push/pop range of a tight loop (tests/progs/nvtx_loop.c, NVIDIA's
                      NVTX v3 headers) with NVTX_INJECTION64_PATH = libgpuprof_nvtx.so against the
                      same loop without injection; records lost from the ring.
cupti_overhead        ns per kernel record of libgpuprof_cupti.so (buffer hand-out, record to ring, name
                      lookup), driven by the TEST DOUBLES of the CUDA driver and of libcupti's activity
                      buffers (tests/doubles/cuda_driver_double.c, cupti_activity_double.c) against the
                      same run without the injection. Through the doubles: CUPTI's own cost is not in it.
Needs cc and the nvidia-nvtx-cu12 wheel (headers); no root, no GPU.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gpuprof.collector.sources import fastpath as fp

RING_RECORDS = 1 << 18  # holds every record of a run: nothing drains during the timing


def build(out: Path) -> dict[str, Path]:
    subprocess.run(["make", "-s", "-C", str(REPO / "bpf" / "fastpath")], check=True)
    headers = sorted((REPO / ".venv" / "lib").glob("python3*/site-packages/nvidia/nvtx/include"))
    if not headers:
        raise SystemExit("bench_gpu_side: the NVTX v3 headers are missing (pip install nvidia-nvtx-cu12)")
    progs = {"host": out / "nccl_profiler_host", "null": out / "nccl_profiler_null.so", "nvtx": out / "nvtx_loop",
             "cupti": out / "libcupti_double.so", "driver": out / "cuda_driver_double"}
    cc = ["cc", "-O2", "-std=gnu11"]
    subprocess.run([*cc, "-o", str(progs["host"]), str(REPO / "tests/doubles/nccl_profiler_host.c"), "-ldl"],
                   check=True)
    subprocess.run([*cc, "-shared", "-fPIC", "-o", str(progs["null"]), str(REPO / "tests/doubles/nccl_profiler_null.c")],
                   check=True)
    subprocess.run([*cc, f"-I{headers[0]}", "-o", str(progs["nvtx"]), str(REPO / "tests/progs/nvtx_loop.c"), "-ldl"],
                   check=True)
    subprocess.run([*cc, "-shared", "-fPIC", "-o", str(progs["cupti"]),
                    str(REPO / "tests/doubles/cupti_activity_double.c")], check=True)
    subprocess.run([*cc, "-o", str(progs["driver"]), str(REPO / "tests/doubles/cuda_driver_double.c"), "-ldl"],
                   check=True)
    return progs


def ring_env(ring_dir: Path) -> dict[str, str]:
    return {**os.environ, "GPUPROF_FASTPATH_DIR": str(ring_dir), "GPUPROF_FASTPATH_JOB": "bench",
            "GPUPROF_FASTPATH_RECORDS": str(RING_RECORDS)}


def lost_and_clear(ring_dir: Path) -> int:
    """Records the rings of a run could not take (their drop counters), then the rings removed."""
    lost = 0
    for path in ring_dir.iterdir():
        ring = fp.Ring(str(path), fp.layout())
        lost += ring.dropped()
        ring.close()
        path.unlink()
    return lost


def plugin_run(progs: dict[str, Path], plugin: Path, ring_dir: Path, ops: int) -> tuple[float, int, int]:
    """ns per plugin call and calls of one run of the double, and the records it lost."""
    out = subprocess.run([str(progs["host"]), str(plugin), "--ops", str(ops), "--bench"], env=ring_env(ring_dir),
                         capture_output=True, text=True, check=True, timeout=600).stdout
    bench = next(json.loads(line) for line in out.splitlines() if '"bench"' in line)
    return bench["ns"] / bench["calls"], bench["calls"], lost_and_clear(ring_dir)


def nvtx_run(progs: dict[str, Path], ring_dir: Path, n: int, inject: bool) -> tuple[float, int]:
    env = ring_env(ring_dir)
    if inject:
        env[fp.NVTX_INJECTION64_PATH] = str(fp.NVTX_INJECTION)
    else:
        env.pop(fp.NVTX_INJECTION64_PATH, None)
    out = subprocess.run([str(progs["nvtx"]), str(n)], env=env, capture_output=True, text=True, check=True,
                         timeout=600).stdout
    res = json.loads(out.strip().splitlines()[-1])
    return res["ns"] / res["ranges"], lost_and_clear(ring_dir)


def cupti_run(progs: dict[str, Path], ring_dir: Path, n: int, inject: bool) -> tuple[float, int]:
    """ns per kernel of one run past its start: the slope between runs of n and 2n kernels, so the
    one-time costs (libcupti loaded, the ring created at the first delivered buffer) are not in it."""
    t1, lost1 = _cupti_once(progs, ring_dir, n, inject)
    t2, lost2 = _cupti_once(progs, ring_dir, 2 * n, inject)
    return (t2 - t1) / n, lost1 + lost2


def _cupti_once(progs: dict[str, Path], ring_dir: Path, n: int, inject: bool) -> tuple[float, int]:
    env = {**ring_env(ring_dir), "GPUPROF_CUPTI_LIBRARY": str(progs["cupti"])}
    if inject:
        env[fp.CUDA_INJECTION64_PATH] = str(fp.CUPTI_INJECTION)
    else:
        env.pop(fp.CUDA_INJECTION64_PATH, None)
    out = subprocess.run([str(progs["driver"]), str(n)], env=env, capture_output=True, text=True, check=True,
                         timeout=600).stdout
    done = json.loads(out.strip().splitlines()[-1])
    return float(done["ns"]), lost_and_clear(ring_dir)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1), "max": round(max(values), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter runs (seconds)")
    args = ap.parse_args()
    if shutil.which("cc") is None:
        raise SystemExit("bench_gpu_side: needs cc")
    runs, ops, ranges = (3, 10_000, 50_000) if args.quick else (7, 40_000, 120_000)
    tmp = Path(tempfile.mkdtemp(prefix="gpuprof-bench-gpu-"))
    ring_dir = Path(tempfile.mkdtemp(prefix="gpuprof-bench-", dir="/dev/shm"))
    ring_dir.chmod(0o700)
    try:
        progs = build(tmp)
        ours, null, lost, calls = [], [], 0, 0
        for _ in range(runs):  # interleaved: the same machine state for both
            ns, calls, lost_run = plugin_run(progs, fp.NCCL_PROFILER, ring_dir, ops)
            ours.append(ns)
            lost += lost_run
            null.append(plugin_run(progs, progs["null"], ring_dir, ops)[0])
        per_event = [o - n for o, n in zip(ours, null)]
        med = statistics.median(per_event)
        print(json.dumps({"bench": "nccl_plugin_overhead", "ns_per_event": round(med, 1),
                          "events_per_s": round(1e9 / statistics.median(ours)), "lost": lost,
                          "ns_per_event_spread": spread(per_event), "baseline_ns_per_call": spread(null),
                          "calls_per_run": calls, "runs": runs,
                          "measured_through": "test double of NCCL (tests/doubles/nccl_profiler_host.c), no GPU",
                          "goal": "<= 300 ns per event at >= 100k events/s, 0 lost"}), flush=True)
        inj, plain, lost = [], [], 0
        for _ in range(runs):
            ns, lost_run = nvtx_run(progs, ring_dir, ranges, inject=True)
            inj.append(ns)
            lost += lost_run
            plain.append(nvtx_run(progs, ring_dir, ranges, inject=False)[0])
        per_range = [i - p for i, p in zip(inj, plain)]
        print(json.dumps({"bench": "nvtx_overhead", "ns_per_range": round(statistics.median(per_range), 1),
                          "slowdown_percent": round(100 * (statistics.median(inj) / statistics.median(plain) - 1), 1),
                          "lost": lost, "ns_per_range_spread": spread(per_range),
                          "baseline_ns_per_range": spread(plain), "ranges_per_run": ranges, "runs": runs,
                          "loop": "nvtxRangePushA + nvtxRangePop, NVIDIA's NVTX v3 headers, no GPU",
                          "goal": "<= 200 ns per range"}), flush=True)
        with_tool, without, lost = [], [], 0
        kernels = ranges // 5  # 2x this stays below the injection's buffer pool (16 x 3,276 records)
        for _ in range(runs):
            ns, lost_run = cupti_run(progs, ring_dir, kernels, inject=True)
            with_tool.append(ns)
            lost += lost_run
            without.append(cupti_run(progs, ring_dir, kernels, inject=False)[0])
        per_kernel = [w - o for w, o in zip(with_tool, without)]
        print(json.dumps({"bench": "cupti_overhead", "ns_per_kernel": round(statistics.median(per_kernel), 1),
                          "lost": lost, "ns_per_kernel_spread": spread(per_kernel), "kernels_per_run": [kernels, 2 * kernels], "per_kernel": "slope between the two",
                          "runs": runs, "measured_through": "test doubles of the CUDA driver and of libcupti's "
                          "activity buffers, no GPU: CUPTI's own cost is not in it"}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(ring_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
