"""A first-pass roofline class per GPU from the activity metrics of a job file (docs/report.md).

GPM (or DCGM's equivalents) give, per sample, the share of time the SMs were active
(`sm_activity`), any tensor pipe was active (`tensor_activity`) and the DRAM bandwidth in use as a
share of the peak (`dram_bw_util`). These are fractions of each roof, not FLOP counts, so the class
says which roof a GPU sits closer to, not its arithmetic intensity:

- underused: SM activity (or, without GPM, NVML's utilization) below UNDERUSED_PCT;
- memory-bound: DRAM bandwidth at MEMORY_BOUND_PCT or more of the peak and a larger share of its
  roof than the compute pipes have of theirs;
- compute-bound: the compute pipes (tensor activity where the model has tensor cores and uses them,
  else SM activity) at COMPUTE_BOUND_PCT or more;
- latency-bound: SMs busy but neither roof approached (stalls, small kernels, synchronization);
- unknown: no GPM metrics recorded.

Flagged: SM busy (>= SM_BUSY_PCT) with the tensor pipes idle (< TENSOR_IDLE_PCT) on a GPU that has
tensor cores, the pattern of a workload that was meant to use them and fell back to FP32/CUDA cores.

PEAKS holds each model's datasheet peaks (dense, no sparsity), used to print the achieved
bandwidth and tensor throughput bounds these shares imply; sources are in PEAKS_DOC and
docs/report.md.
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

UNDERUSED_PCT = 30.0
MEMORY_BOUND_PCT = 60.0
COMPUTE_BOUND_PCT = 60.0
SM_BUSY_PCT = 50.0
TENSOR_IDLE_PCT = 5.0

# model name substring (matched against NVML's name, longest first) -> FP32 TFLOP/s (CUDA cores),
# dense FP16/BF16 tensor TFLOP/s, memory bandwidth TB/s, NVIDIA datasheet
PEAKS: dict[str, tuple[float, float, float, str]] = {
    "H200": (67.0, 989.0, 4.8, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    "H100 PCIe": (51.0, 756.0, 2.0, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)"),
    "H100 NVL": (60.0, 835.0, 3.9, "NVIDIA H100 Tensor Core GPU datasheet (NVL)"),
    "H100": (67.0, 989.0, 3.35, "NVIDIA H100 Tensor Core GPU datasheet (SXM)"),
    "A100-SXM4-80GB": (19.5, 312.0, 2.039, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)"),
    "A100-SXM4-40GB": (19.5, 312.0, 1.555, "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM)"),
    "A100 80GB PCIe": (19.5, 312.0, 1.935, "NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe)"),
    "A100": (19.5, 312.0, 1.555, "NVIDIA A100 Tensor Core GPU datasheet (40GB PCIe)"),
    "L40S": (91.6, 362.0, 0.864, "NVIDIA L40S datasheet"),
    "A10": (31.2, 125.0, 0.6, "NVIDIA A10 Tensor Core GPU datasheet"),
    "V100": (15.7, 125.0, 0.9, "NVIDIA Tesla V100 datasheet (SXM2)"),
    "T4": (8.1, 65.0, 0.32, "NVIDIA T4 Tensor Core GPU datasheet"),
}
PEAKS_DOC = [{"model": k, "fp32_tflops": v[0], "tensor_fp16_dense_tflops": v[1], "mem_tb_s": v[2], "source": v[3]}
             for k, v in PEAKS.items()]


def peaks_of(name: str) -> tuple[str, tuple[float, float, float, str]] | None:
    for key in sorted(PEAKS, key=len, reverse=True):
        if key.lower() in name.lower():
            return key, PEAKS[key]
    return None


def _mean(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(a.mean()) if len(a) else float("nan")


def node_gpu_tables(f: h5py.File, node: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A node's /gpu/gpm and /gpu/samples rows (None where absent or empty), read once for all its GPUs."""
    g = f[f"nodes/{node}"]
    gpm = g["gpu/gpm"][()] if "gpu/gpm" in g and g["gpu/gpm"].shape[0] else None
    samples = g["gpu/samples"][()] if "gpu/samples" in g and g["gpu/samples"].shape[0] else None
    return gpm, samples


def gpu_means(f: h5py.File, node: str, gpu: int,
              tables: tuple[np.ndarray | None, np.ndarray | None] | None = None) -> dict[str, float]:
    """Mean SM, occupancy, tensor and DRAM activity (GPM) and NVML utilization of one GPU, NaN
    where not recorded. `tables`: the node's node_gpu_tables, when the caller has them."""
    out = {k: float("nan") for k in ("sm_activity", "sm_occupancy", "tensor_activity", "dram_bw_util", "util_gpu")}
    gpm, samples = tables if tables is not None else node_gpu_tables(f, node)
    if gpm is not None:
        rows = gpm[gpm["gpu"] == gpu]
        for k in ("sm_activity", "sm_occupancy", "tensor_activity", "dram_bw_util"):
            out[k] = _mean(rows[k].astype(np.float64))
    if samples is not None:
        out["util_gpu"] = _mean(samples[samples["gpu"] == gpu]["util_gpu"].astype(np.float64))
    return out


def classify(name: str, m: dict[str, float]) -> dict[str, Any]:
    """The class of one GPU from its means (gpu_means), with the reason in words and the flags."""
    sm, tensor, dram, util = m["sm_activity"], m["tensor_activity"], m["dram_bw_util"], m["util_gpu"]
    pk = peaks_of(name)
    has_tensor = pk is None or pk[1][1] > 0  # unknown model: assume tensor cores (every datacenter GPU since V100)
    flags: list[str] = []
    est: dict[str, float | None] = {"mem_tb_s_est": None, "tensor_tflops_bound": None}
    if not np.isfinite(sm):
        if np.isfinite(util) and util < UNDERUSED_PCT:
            return {"roofline": "underused", "why": f"NVML utilization {util:.0f}% (no GPM metrics)",
                    "flags": flags, "peaks_model": pk[0] if pk else None, **est}
        return {"roofline": "unknown", "why": "no GPM metrics recorded (SM/tensor/DRAM activity)", "flags": flags,
                "peaks_model": pk[0] if pk else None, **est}
    if pk is not None:
        est["mem_tb_s_est"] = round(pk[1][2] * (dram if np.isfinite(dram) else 0.0) / 100, 3)
        est["tensor_tflops_bound"] = round(pk[1][1] * (tensor if np.isfinite(tensor) else 0.0) / 100, 1)
    tensor_v = tensor if np.isfinite(tensor) else 0.0
    dram_v = dram if np.isfinite(dram) else 0.0
    if has_tensor and sm >= SM_BUSY_PCT and tensor_v < TENSOR_IDLE_PCT:
        flags.append(f"SM busy ({sm:.0f}%) but tensor pipes idle ({tensor_v:.1f}%): FP32/CUDA-core code where "
                     "tensor cores were expected?")
    compute = max(tensor_v, sm) if tensor_v >= TENSOR_IDLE_PCT else sm
    if sm < UNDERUSED_PCT:
        cls, why = "underused", f"SM activity {sm:.0f}% < {UNDERUSED_PCT:.0f}%"
    elif dram_v >= MEMORY_BOUND_PCT and dram_v >= compute:
        cls, why = "memory-bound", f"DRAM bandwidth {dram_v:.0f}% of peak >= compute pipes {compute:.0f}%"
    elif compute >= COMPUTE_BOUND_PCT:
        cls, why = "compute-bound", f"compute pipes {compute:.0f}% active (tensor {tensor_v:.0f}%), DRAM {dram_v:.0f}%"
    else:
        cls, why = "latency-bound", f"SMs {sm:.0f}% active but neither roof approached (DRAM {dram_v:.0f}%, tensor {tensor_v:.0f}%)"
    return {"roofline": cls, "why": why, "flags": flags, "peaks_model": pk[0] if pk else None, **est}


MAX_PHASES = 8  # NVTX range names classified per GPU (the longest in total)


def _inside(t: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Whether each time lies in the union of the intervals."""
    if not len(starts):
        return np.zeros(len(t), bool)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    i = np.searchsorted(s, t, side="right") - 1
    return (i >= 0) & (t <= e[np.clip(i, 0, None)])


def phase_classes(f: h5py.File, node: str, gpu: int, name: str) -> list[dict[str, Any]]:
    """The class of one GPU within each NVTX range name of its node (GPM samples inside any range of
    that name, on the node's own clock: both tables are CLOCK_MONOTONIC), longest names first."""
    g = f[f"nodes/{node}"]
    if "nvtx/ranges" not in g or not g["nvtx/ranges"].shape[0] or "gpu/gpm" not in g or not g["gpu/gpm"].shape[0]:
        return []
    ranges = g["nvtx/ranges"][()]
    text: dict[tuple[int, int], str] = {}
    if "nvtx/strings" in g:
        strs = g["nvtx/strings"][()]
        has_pid = "pid" in (strs.dtype.names or ())
        for s in strs:
            text[(int(s["pid"]) if has_pid else -1, int(s["string_id"]))] = s["text"].decode(errors="replace")
    names = np.array([text.get((int(r["pid"]), int(r["name_id"])), text.get((-1, int(r["name_id"])), f"[string {int(r['name_id'])}]"))
                      for r in ranges])
    dur = ranges["t_end_ns"].astype(np.float64) - ranges["t_start_ns"].astype(np.float64)
    totals = {n: float(dur[names == n].sum()) for n in np.unique(names)}
    gpm = g["gpu/gpm"][()]
    gpm = gpm[gpm["gpu"] == gpu]
    t = gpm["t_ns"].astype(np.float64)
    out = []
    for n in sorted(totals, key=lambda k: -totals[k])[:MAX_PHASES]:
        mine = names == n
        inside = _inside(t, ranges["t_start_ns"][mine].astype(np.float64), ranges["t_end_ns"][mine].astype(np.float64))
        if not inside.any():
            continue
        means = {k: _mean(gpm[k][inside].astype(np.float64)) for k in ("sm_activity", "sm_occupancy", "tensor_activity",
                                                                         "dram_bw_util")}
        means["util_gpu"] = float("nan")
        c = classify(name, means)
        out.append({"range": n, "range_s": round(totals[n] / 1e9, 6), "samples": int(inside.sum()),
                    "roofline": c["roofline"], "why": c["why"], "flags": c["flags"]})
    return out
