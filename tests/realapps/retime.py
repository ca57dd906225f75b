"""Re-timing real recordings: copies of a recorded run's node files whose clocks carry a known error,
so that the merge's clock fit is judged against exact truth (the `clock_real` figure).

On the local cluster every virtual node shares one host clock, so the recorded (monotonic, realtime)
pairs of /clock/pairs are the truth. The copy rewrites, per node, the realtime column of /clock/pairs
(and the root attributes start_realtime_ns / end_realtime_ns) as realtime + error(realtime), where

    error(t) = offset + drift * (t - t0) + sum_k rate_k * clamp(t - start_k, 0, length_k)

(offset in ns, drift and the NTP-like slews' rate changes rate_k in ppm; t0 the job's first pair), and
gives each node its own hostname and boot_id (`<host>-retimed-<node>`, a uuid5 of the old boot id and
the node) so the merge treats them as separate hosts. Monotonic times and every other table are left
as they are. The injected errors are saved as `retime_truth.json` beside the copies.

`clock_errors()` scores a merge of the copy: per collective call of each non-reference node, the
aligned entry time against what the reference node's (re-timed) clock read at the call's true instant.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gpuprof.collector.schema import CLOCK_PAIRS, COLLECTIVE_CALLS
from gpuprof.mpi_merge.clock import NodeClockModel

TRUTH_FILE = "retime_truth.json"


class RetimeError(RuntimeError):
    """A node file could not be re-timed or scored (the message names the file)."""


@dataclass
class Slew:
    start_s: float  # since t0
    length_s: float
    rate_ppm: float


@dataclass
class ClockError:
    offset_us: float
    drift_ppm: float
    slews: list[Slew] = field(default_factory=list)

    def error_ns(self, t_ns: np.ndarray, t0_ns: int) -> np.ndarray:
        dt_s = (np.asarray(t_ns, dtype=np.int64) - t0_ns).astype(np.float64) / 1e9
        e_us = self.offset_us + self.drift_ppm * dt_s
        for s in self.slews:
            e_us = e_us + s.rate_ppm * np.clip(dt_s - s.start_s, 0.0, s.length_s)
        return np.rint(e_us * 1e3).astype(np.int64)


def random_errors(nodes: list[str], seed: int, span_s: float, max_offset_us: float = 5000.0,
                  max_drift_ppm: float = 50.0, slews: int = 2, max_slew_ppm: float = 40.0) -> dict[str, ClockError]:
    """NTP-like errors: offsets of milliseconds, drifts of tens of ppm, a few rate changes of tens of
    ppm lasting a part of the run (|drift| + |slews| stays far inside the kernel's 500 ppm)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in nodes:
        sl = []
        for _ in range(slews):
            start = float(rng.uniform(0.1, 0.7) * span_s)
            sl.append(Slew(start, float(rng.uniform(0.1, 0.3) * span_s), float(rng.uniform(-max_slew_ppm, max_slew_ppm))))
        out[n] = ClockError(float(rng.uniform(-max_offset_us, max_offset_us)),
                            float(rng.uniform(-max_drift_ppm, max_drift_ppm)), sl)
    return out


def _pairs(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        if CLOCK_PAIRS.path not in f:
            raise RetimeError(f"{path}: no {CLOCK_PAIRS.path} table")
        pairs = f[CLOCK_PAIRS.path][()]
    if len(pairs) < 2:
        raise RetimeError(f"{path}: {len(pairs)} clock pairs, need 2")
    return pairs


def t0_of(files: list[Path]) -> int:
    return int(min(int(_pairs(p)["realtime_ns"][0]) for p in files))


def retime_file(src: Path, dst: Path, err: ClockError, t0_ns: int, node: str) -> None:
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        if CLOCK_PAIRS.path not in f:
            raise RetimeError(f"{src}: no {CLOCK_PAIRS.path} table")
        ds = f[CLOCK_PAIRS.path]
        pairs = ds[()]
        pairs["realtime_ns"] = pairs["realtime_ns"] + err.error_ns(pairs["realtime_ns"], t0_ns)
        ds[...] = pairs
        for key in ("start_realtime_ns", "end_realtime_ns"):
            if key in f.attrs:
                v = int(f.attrs[key])
                f.attrs[key] = np.int64(v + int(err.error_ns(np.array([v]), t0_ns)[0]))
        host = f.attrs.get("hostname", "host")
        host = host.decode() if isinstance(host, bytes) else str(host)
        boot = f.attrs.get("boot_id", "")
        boot = boot.decode() if isinstance(boot, bytes) else str(boot)
        f.attrs["hostname"] = f"{host}-retimed-{node}"
        f.attrs["boot_id"] = str(uuid.uuid5(uuid.NAMESPACE_OID, f"{boot}/{node}"))


def retime_recording(src_dir: Path, dst_dir: Path, errors: dict[str, ClockError] | None = None,
                     seed: int = 0) -> dict[str, Any]:
    """Copy every nodeN.h5 of src_dir into dst_dir re-timed; returns (and saves) the truth."""
    files = sorted(src_dir.glob("node*.h5"))
    if not files:
        raise RetimeError(f"{src_dir}: no node*.h5 files")
    nodes = [p.stem for p in files]
    t0 = t0_of(files)
    span_s = max(float(_pairs(p)["realtime_ns"][-1] - t0) / 1e9 for p in files)
    if errors is None:
        errors = random_errors(nodes, seed, span_s)
    missing = [n for n in nodes if n not in errors]
    if missing:
        raise RetimeError(f"no clock error given for {', '.join(missing)}")
    dst_dir.mkdir(parents=True, exist_ok=True)
    for p in files:
        retime_file(p, dst_dir / p.name, errors[p.stem], t0, p.stem)
    truth = {"source": str(src_dir), "t0_ns": t0, "seed": seed, "span_s": span_s,
             "errors": {n: asdict(e) for n, e in errors.items()}}
    (dst_dir / TRUTH_FILE).write_text(json.dumps(truth, indent=1) + "\n")
    return truth


def load_errors(truth: dict[str, Any]) -> dict[str, ClockError]:
    return {n: ClockError(e["offset_us"], e["drift_ppm"], [Slew(**s) for s in e["slews"]])
            for n, e in truth["errors"].items()}


def mono_to_real(mono: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """The node's monotonic -> realtime map as the merge uses it (linear between pairs, extended
    linearly beyond the first and last)."""
    m = pairs["monotonic_ns"].astype(np.float64)
    r = pairs["realtime_ns"].astype(np.float64)
    x = mono.astype(np.float64)
    y = np.interp(x, m, r)
    lo, hi = x < m[0], x > m[-1]
    y[lo] = r[0] + (x[lo] - m[0]) * (r[1] - r[0]) / (m[1] - m[0])
    y[hi] = r[-1] + (x[hi] - m[-1]) * (r[-1] - r[-2]) / (m[-1] - m[-2])
    return y


@dataclass
class ClockScore:
    rms_error_us: float | None
    raw_wall_clock_us: float | None
    interval_coverage: float | None
    causality_violations: int | None
    per_node: dict[str, dict[str, Any]]
    # calls whose interval is at most PINNED_US wide: how many (a share of all) and their RMS error
    pinned: dict[str, Any] = field(default_factory=dict)


PINNED_US = 20.0


def _pinned(errs: list[np.ndarray], n_all: int) -> dict[str, Any]:
    e = np.concatenate(errs) if errs else np.zeros(0)
    return {"width_us": PINNED_US, "calls": len(e), "share": round(len(e) / n_all, 4) if n_all else None,
            "rms_error_us": round(float(np.sqrt(np.mean(e**2))), 3) if len(e) else None}


def clock_errors(original_dir: Path, retimed_dir: Path, job_file: Path, report: dict[str, Any]) -> ClockScore:
    """Aligned-time error of every collective call of the non-reference nodes (see the module doc)."""
    truth = json.loads((retimed_dir / TRUTH_FILE).read_text())
    errors = load_errors(truth)
    t0 = int(truth["t0_ns"])
    ref = report["clock"]["reference"]
    if ref not in errors:
        raise RetimeError(f"{job_file}: reference node {ref!r} not among the re-timed nodes")
    ref_err = errors[ref]
    per_node: dict[str, dict[str, Any]] = {}
    all_err, all_raw = [], []
    covered = []
    pinned_err: list[np.ndarray] = []
    clocks = {n["node"]: n["clock"] for n in report["nodes"]}
    with h5py.File(job_file, "r") as jf:
        for node, err in errors.items():
            if node == ref:
                continue
            grp = f"nodes/{node}/collectives"
            if f"{grp}/calls_aligned" not in jf:
                per_node[node] = {"calls": 0, "note": f"{job_file}: no {grp}/calls_aligned"}
                continue
            calls = jf[f"{grp}/calls"]["t_enter_ns"]
            aligned = jf[f"{grp}/calls_aligned"]["t_enter_aligned_ns"]
            ok = aligned >= 0
            if not ok.any():
                per_node[node] = {"calls": 0}
                continue
            true_rt = mono_to_real(calls[ok], _pairs(original_dir / f"{node}.h5"))
            expect = true_rt + ref_err.error_ns(np.rint(true_rt).astype(np.int64), t0)
            e_us = (aligned[ok].astype(np.float64) - expect) / 1e3
            raw_us = (err.error_ns(np.rint(true_rt).astype(np.int64), t0)
                      - ref_err.error_ns(np.rint(true_rt).astype(np.int64), t0)) / 1e3
            all_err.append(e_us)
            all_raw.append(raw_us)
            k = clocks.get(node, {})
            entry: dict[str, Any] = {"calls": int(ok.sum()), "rms_error_us": float(np.sqrt(np.mean(e_us**2))),
                                     "raw_rms_us": float(np.sqrt(np.mean(raw_us**2))),
                                     "fit_offset_us": k.get("offset_us"), "fit_drift_ppm": k.get("drift_ppm")}
            # the truth inside the model's interval at every call (the intervals the constraints
            # allow at the model's points, widened by the slew limit between them: interval_ns)
            model = _model_of(jf, node, t0)
            if model is not None:
                node_rt = true_rt + err.error_ns(np.rint(true_rt).astype(np.int64), t0)
                lo, hi = model.interval_ns(node_rt - t0)
                inside = (lo <= raw_us * 1e3 + 1.0) & (raw_us * 1e3 - 1.0 <= hi)
                entry["interval_coverage"] = float(np.mean(inside))
                covered.append(inside)
                # where the constraints pin the clock (an interval at most PINNED_US wide), the error
                # the fit leaves there: the "recovered to <= 10 us where collectives pin it"
                pinned_err.append(e_us[(hi - lo) <= PINNED_US * 1e3])
            per_node[node] = entry
    if not all_err:
        return ClockScore(None, None, None, report["clock"].get("causality_violations"), per_node)
    e = np.concatenate(all_err)
    r = np.concatenate(all_raw)
    return ClockScore(
        rms_error_us=round(float(np.sqrt(np.mean(e**2))), 3),
        raw_wall_clock_us=round(float(np.sqrt(np.mean(r**2))), 3),
        interval_coverage=round(float(np.mean(np.concatenate(covered))), 4) if covered else None,
        pinned=_pinned(pinned_err, len(e)),
        causality_violations=report["clock"].get("causality_violations"),
        per_node=per_node,
    )


def _model_of(jf: h5py.File, node: str, t0_ns: int) -> NodeClockModel | None:
    """The node's clock model from the job file's /clock/segments (times relative to t0_ns), None when
    the method keeps no intervals."""
    if "clock/segments" not in jf:
        return None
    seg = jf["clock/segments"][()]
    names = np.array([x.decode() if isinstance(x, bytes) else str(x) for x in seg["node"]])
    rows = seg[names == node]
    if not len(rows) or not np.isfinite(rows["offset_lo_ns"]).any():
        return None
    start = (rows["t_start_ns"].astype(np.int64) - t0_ns).astype(np.float64)
    return NodeClockModel(node, True, "", start, rows["offset_ns"].astype(np.float64),
                          rows["drift_ppm"].astype(np.float64), point_lo=rows["offset_lo_ns"].astype(np.float64),
                          point_hi=rows["offset_hi_ns"].astype(np.float64))


def calls_count(path: Path) -> int:
    with h5py.File(path, "r") as f:
        return int(f[COLLECTIVE_CALLS.path].shape[0]) if COLLECTIVE_CALLS.path in f else 0
