"""The NVML source against the NVML test double (tests/nvml_double): no GPU needed.

Values here are emulated, never measurements."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "nvml_double"))
import double

from gpuprof.collector import schema
from gpuprof.collector.config import defaults
from gpuprof.collector.sources.base import SourceContext, SourceUnavailable
from gpuprof.collector.sources.nvml import NvmlSource

pytestmark = pytest.mark.nvml


@pytest.fixture(scope="module")
def library() -> Path:
    try:
        return double.build()
    except double.DoubleUnavailable as e:
        pytest.skip(str(e))


class Recorder:
    def __init__(self, pids: frozenset[int] = frozenset()) -> None:
        self.errors: list[tuple[str, str]] = []
        self.missing: list[tuple[str, int, str, str]] = []
        self.pids = pids

    def ctx(self) -> SourceContext:
        return SourceContext(
            job_id="1", node="n", modes=("metrics",), config={}, pids=lambda: self.pids,
            recent_pids=lambda: self.pids, cgroup_dirs=lambda: (),
            report_error=lambda s, m: self.errors.append((s, m)),
            report_missing=lambda *a: self.missing.append(a),
        )


@pytest.fixture
def nvml(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Factory: nvml(**double_config, cfg overrides) -> (source, recorder), source started."""
    started: list[NvmlSource] = []
    monkeypatch.setenv("GPUPROF_NVML_LIBRARY", str(library))
    monkeypatch.delenv("SLURM_JOB_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def make(cfg: dict[str, Any] | None = None, job_pids: frozenset[int] = frozenset(), threaded: bool = False,
             **fake: object) -> Any:
        conf = double.write_config(tmp_path / f"fake{len(started)}.conf", **fake)
        monkeypatch.setenv("GPUPROF_FAKE_NVML_CONFIG", str(conf))
        c = defaults()["sources.nvml"] | {"gpus": "all"} | (cfg or {})
        src = NvmlSource(c, threaded=threaded)
        rec = Recorder(job_pids)
        src.start(rec.ctx())
        started.append(src)
        return src, rec

    yield make
    for s in started:
        s.stop()


def collect(src: NvmlSource, n: int, pause: float = 0.0) -> dict[str, np.ndarray]:
    out: dict[str, list[np.ndarray]] = {}
    for _ in range(n):
        for t, rows in src.sample(time.monotonic_ns()):
            out.setdefault(t.path, []).append(rows)
        if pause:
            time.sleep(pause)
    return {k: np.concatenate(v) for k, v in out.items()}


def test_several_gpus_values_and_units(nvml: Any) -> None:
    src, rec = nvml(gpus=3, pids=[4242, 999], power_mw=123456, temp=71)
    src.process_interval_s = 0.0
    got = collect(src, 4, pause=0.02)
    dev = got[schema.GPU_DEVICES.path]
    assert list(dev["index"]) == [0, 1, 2] and len(set(dev["uuid"])) == 3
    assert all(b"test double" in n for n in dev["name"])
    s = got[schema.GPU_SAMPLES.path]
    assert len(s) == 12 and set(s["gpu"]) == {0, 1, 2}
    assert np.allclose(s["power_w"], 123.456)  # mW -> W
    assert np.all(s["temp_c"] == 71) and np.all(s["sm_clock_mhz"] == 1980)
    assert np.all(s["mem_used_bytes"][s["gpu"] == 1] == 11 * 2**30)
    later = s[s["t_ns"] > s["t_ns"].min()]
    assert np.all(later["pcie_tx_kbps"] > 0) and np.all(later["nvlink_rx_kbps"] > 0)  # rates from counters
    assert np.all(np.isnan(s[s["t_ns"] == s["t_ns"].min()]["pcie_tx_kbps"]))  # first: no rate yet
    gpm = got[schema.GPU_GPM.path]
    assert len(gpm) == 9 and np.all(gpm["interval_ns"] > 0)  # 4 samples -> 3 pairs per GPU
    assert np.allclose(gpm["sm_activity"][gpm["gpu"] == 2], 57.0)
    assert schema.GPU_PROCESSES.path not in got  # no job processes: none of the GPU's are reported
    assert rec.missing == [] and rec.errors == []
    src.stop()
    src2, _ = nvml(job_pids=frozenset({4242}), gpus=1, pids=[4242, 999])
    src2.process_interval_s = 0.0
    p = collect(src2, 1)[schema.GPU_PROCESSES.path]
    assert list(p["pid"]) == [4242] and p["sm_util"][0] == 40 and p["used_memory_bytes"][0] == 2**30


def test_unsupported_is_nan_with_missing_row_never_zero(nvml: Any) -> None:
    src, rec = nvml(gpus=2, gpu1__unsupported="power,temp,pcie,gpm")
    s = collect(src, 3)[schema.GPU_SAMPLES.path]
    g1, g0 = s[s["gpu"] == 1], s[s["gpu"] == 0]
    assert np.all(np.isnan(g1["power_w"])) and np.all(np.isnan(g1["temp_c"]))
    assert np.all(np.isnan(g1["pcie_tx_kbps"])) and not np.any(np.isnan(g0["power_w"]))
    reasons = {(d, m): r for _, d, m, r in rec.missing}
    assert reasons[(1, "power_w")] == "NVML_ERROR_NOT_SUPPORTED"
    assert reasons[(1, "temp_c")] == "NVML_ERROR_NOT_SUPPORTED"
    assert reasons[(1, "pcie_tx_kbps")] == "NVML_ERROR_NOT_SUPPORTED"
    assert "not supported" in reasons[(1, "sm_activity")]  # GPM unsupported on this GPU
    assert (0, "power_w") not in reasons
    assert sum(1 for _, d, m, _ in rec.missing if (d, m) == (1, "power_w")) == 1  # reported once


def test_gpm_unsupported_before_hopper(nvml: Any) -> None:
    src, rec = nvml(gpus=2, gpu0__arch=8)
    got = collect(src, 3)
    assert set(got[schema.GPU_GPM.path]["gpu"]) == {1}
    assert list(got[schema.GPU_DEVICES.path]["gpm_supported"]) == [0, 1]
    assert any(d == 0 and m == "sm_activity" and "Hopper" in r for _, d, m, r in rec.missing)


def test_gpu_lost_mid_run_others_go_on(nvml: Any) -> None:
    src, rec = nvml(gpus=3, gpu1__lost_after=40)
    got = collect(src, 12)
    s = got[schema.GPU_SAMPLES.path]
    n1 = int(np.sum(s["gpu"] == 1))
    assert 0 < n1 < 12 and np.sum(s["gpu"] == 0) == 12 and np.sum(s["gpu"] == 2) == 12
    ev = got[schema.GPU_EVENTS.path]
    lost = ev[ev["kind"] == schema.GPU_EVENTS.enums["kind"].index("gpu_lost")]
    assert list(lost["gpu"]) == [1]
    assert any("GPU 1" in m and "NVML_ERROR_GPU_IS_LOST" in m for _, m in rec.errors)


def test_xid_event(nvml: Any) -> None:
    src, _ = nvml(gpus=2, gpu1__xid_after=20, gpu0__xid_after=0, xid=48)
    ev = collect(src, 6)[schema.GPU_EVENTS.path]
    xid = ev[ev["kind"] == 0]
    assert list(xid["gpu"]) == [1] and list(xid["value"]) == [48]


def test_hanging_call_times_out_and_others_go_on(nvml: Any) -> None:
    src, rec = nvml({"call_timeout_s": 0.3}, gpus=3, gpu1__hang_after=25, hang_ms=3000)
    t0 = time.monotonic()
    got = collect(src, 10)
    elapsed = time.monotonic() - t0
    assert elapsed < 2.5, elapsed  # one 0.3 s timeout, not the 3 s hang
    s = got[schema.GPU_SAMPLES.path]
    assert np.sum(s["gpu"] == 0) >= 9 and np.sum(s["gpu"] == 2) >= 9  # the others go on
    assert np.sum(s["gpu"] == 1) < 10  # GPU 1 backed off
    msgs = [m for _, m in rec.errors if "timeout" in m]
    assert msgs and "GPU 1" in msgs[0] and "did not return within 0.3 s" in msgs[0]


def test_job_gpus_by_index_and_uuid(nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_GPUS", "1,3")
    src, _ = nvml({"gpus": "job"}, gpus=4)
    assert [g.index for g in src.gpus] == [1, 3]
    monkeypatch.delenv("SLURM_JOB_GPUS")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000-fake-0000-0000-000000000002")
    src, _ = nvml({"gpus": "job"}, gpus=4)
    assert [g.index for g in src.gpus] == [2]


def test_no_job_gpus_is_unavailable_with_reason(nvml: Any) -> None:
    with pytest.raises(SourceUnavailable, match="no GPUs allocated"):
        nvml({"gpus": "job"}, gpus=2)


def test_nvml_absent(library: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUPROF_NVML_LIBRARY", str(tmp_path / "no-such-libnvidia-ml.so.1"))
    src = NvmlSource(defaults()["sources.nvml"] | {"gpus": "all"})
    with pytest.raises(SourceUnavailable, match="cannot be loaded"):
        src.start(Recorder().ctx())


def test_missing_values_are_nan_not_zero_in_float_columns() -> None:
    # every metric column of /gpu/samples must be able to hold NaN
    for c in schema.GPU_SAMPLES.columns[2:]:
        assert np.dtype(c.dtype).kind == "f", c.name
    assert math.isnan(float(np.array(np.nan, dtype=schema.GPU_SAMPLES.dtype["power_w"])))


def test_one_long_lived_call_thread_and_stuck_ones_exit(nvml: Any) -> None:
    # The watchdog hands ticks to one worker that lives as long as the source (no thread per tick
    # or per call); a worker stuck in a hung call is abandoned and exits once the call returns.
    import threading

    before = set(threading.enumerate())  # other tests' abandoned workers may still be in a hang
    src, rec = nvml({"call_timeout_s": 0.2}, gpus=2, gpu1__hang_after=40, hang_ms=600)
    collect(src, 3)
    workers = [t for t in threading.enumerate() if t.name == "nvml-call" and t not in before]
    assert len(workers) == 1
    first = workers[0]
    collect(src, 3)  # the hang (call 40 on GPU 1: tick 4) falls in here: that worker is abandoned
    assert any("timeout" in m for _, m in rec.errors)
    assert first in src._wd.abandoned
    collect(src, 2)
    live = [t for t in threading.enumerate() if t.name == "nvml-call" and t is not first and t not in before]
    assert len(live) == 1  # one fresh worker took over
    first.join(2.0)
    assert not first.is_alive()  # the stuck one left when its call returned


def test_field_value_union_decoding() -> None:
    import struct

    from gpuprof.collector.sources.nvml_direct import field_value

    def raw(fmt: str, v: float) -> int:
        return int.from_bytes(struct.pack("<" + fmt, v).ljust(8, b"\0"), "little")

    assert field_value(0, raw("d", 1.5)) == 1.5
    assert field_value(1, raw("I", 4_000_000_000)) == 4_000_000_000
    assert field_value(2, raw("Q", 2**40)) == 2**40
    assert field_value(3, raw("Q", 2**63 + 5)) == float(2**63 + 5)
    assert field_value(4, raw("q", -7)) == -7
    assert field_value(5, raw("i", -3)) == -3
    assert field_value(6, raw("H", 65535)) == 65535


# --- the native sampling thread (collector/native/nvmltick.c): what the collector runs ---------------
def drain_for(src: NvmlSource, seconds: float) -> dict[str, np.ndarray]:
    """The rows of `seconds` of native ticks, drained every 0.5 s as the daemon would (every 1 s)."""
    out: dict[str, list[np.ndarray]] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.5)
        for t, rows in src.sample(time.monotonic_ns()):
            out.setdefault(t.path, []).append(rows)
    return {k: np.concatenate(v) for k, v in out.items()}


def test_native_thread_values_rates_gpm_on_the_grid(nvml: Any) -> None:
    """The same values and units as the Python path, at the configured rate on the tick grid, GPM
    from consecutive pairs, counter rates from the second sample on, processes at 1 Hz."""
    src, rec = nvml({"rate_hz": 20}, job_pids=frozenset({4242}), threaded=True, gpus=3, pids=[4242, 999],
                    power_mw=123456, temp=71)
    assert src.sampler == "native thread" and src.interval_s == 1.0 and src.sample_interval_s == 0.05
    got = drain_for(src, 2.0)
    s = got[schema.GPU_SAMPLES.path]
    per_gpu = np.bincount(s["gpu"], minlength=3)
    t0 = s["t_ns"][s["gpu"] == 0].astype(np.int64)
    assert per_gpu.min() == per_gpu.max() >= 30, per_gpu  # 20 Hz for about 2 s, every GPU each tick
    assert abs(np.median(np.diff(t0)) - 50_000_000) < 2_000_000, np.diff(t0)  # at the rate
    assert len(t0) >= 0.9 * ((t0[-1] - t0[0]) / 50_000_000 + 1)  # no tick missing on a quiet machine
    assert np.median(t0 % 50_000_000) < 5_000_000, t0 % 50_000_000  # just after multiples of 50 ms
    assert np.allclose(s["power_w"], 123.456) and np.all(s["temp_c"] == 71)
    assert np.all(s["mem_used_bytes"][s["gpu"] == 1] == 11 * 2**30)
    first = s["t_ns"] == s["t_ns"].min()
    assert np.all(np.isnan(s[first]["pcie_tx_kbps"])) and np.all(s[~first]["nvlink_rx_kbps"] > 0)
    gpm = got[schema.GPU_GPM.path]
    assert np.bincount(gpm["gpu"], minlength=3).tolist() == (per_gpu - 1).tolist()  # pairs
    assert np.allclose(gpm["sm_activity"][gpm["gpu"] == 2], 57.0)
    assert np.all(np.abs(gpm["interval_ns"].astype(np.int64) - 50_000_000) < 20_000_000)
    p = got[schema.GPU_PROCESSES.path]
    assert set(p["pid"].tolist()) == {4242} and 2 <= len(p) // 3 <= 3  # 1 Hz per GPU (4 drains in 2 s)
    assert rec.missing == [] and rec.errors == []


def test_native_thread_unsupported_lost_and_xid(nvml: Any) -> None:
    """Unsupported metrics NaN with one missing row each; a lost GPU stops being polled with its
    event and error while the others go on; an XID event reaches /gpu/events."""
    src, rec = nvml({"rate_hz": 20}, threaded=True, gpus=3, gpu1__lost_after=60, gpu2__unsupported="power,pcie,gpm",
                    gpu0__xid_after=30, xid=48)
    got = drain_for(src, 2.0)
    s = got[schema.GPU_SAMPLES.path]
    n = np.bincount(s["gpu"], minlength=3)
    assert n[0] >= 32 and n[2] >= 32 and 0 < n[1] < 10, n
    g2 = s[s["gpu"] == 2]
    assert np.all(np.isnan(g2["power_w"])) and np.all(np.isnan(g2["pcie_rx_kbps"])) and np.all(g2["temp_c"] == 62)
    missing = [(d, m, r) for _, d, m, r in rec.missing]
    for metric in ("power_w", "pcie_tx_kbps", "pcie_rx_kbps"):
        assert missing.count((2, metric, "NVML_ERROR_NOT_SUPPORTED")) == 1, missing
    assert any(d == 2 and m == "sm_activity" and "not supported" in r for d, m, r in missing)
    assert 2 not in set(got[schema.GPU_GPM.path]["gpu"].tolist())
    ev = got[schema.GPU_EVENTS.path]
    kinds = schema.GPU_EVENTS.enums["kind"]
    assert ev[ev["kind"] == kinds.index("gpu_lost")]["gpu"].tolist() == [1]
    xid = ev[ev["kind"] == kinds.index("xid")]
    assert 0 in xid["gpu"].tolist() and set(xid["value"].tolist()) == {48}
    assert any("GPU 1" in m and "NVML_ERROR_GPU_IS_LOST" in m for _, m in rec.errors)


def test_native_thread_hung_call_is_abandoned_and_others_go_on(nvml: Any) -> None:
    """A call that hangs: seen at the next drain, recorded with the function and GPU, that thread
    abandoned and a fresh one samples the other GPUs while the hung one backs off; once the call
    returns, the abandoned thread leaves and its state is freed (memory stays bounded)."""
    src, rec = nvml({"rate_hz": 20, "call_timeout_s": 0.3}, threaded=True, gpus=3, gpu1__hang_after=25,
                    hang_ms=2500)
    got = drain_for(src, 2.5)
    msgs = [m for _, m in rec.errors if "timeout" in m]
    assert len(msgs) == 1 and "GPU 1" in msgs[0] and "did not return within 0.3 s" in msgs[0], rec.errors
    assert len(src._stuck) == 1
    s = got[schema.GPU_SAMPLES.path]
    late = s[s["t_ns"] > s["t_ns"].min() + 1_000_000_000]  # after the hang was seen
    n = np.bincount(late["gpu"], minlength=3)
    assert n[0] >= 15 and n[2] >= 15 and n[1] == 0, n  # GPU 1 skipped for its back-off (5 s)
    drain_for(src, 1.0)  # the hung call returns 2.5 s after it began
    assert src._stuck == []  # that thread left, and its state was freed
    assert len([m for _, m in rec.errors if "timeout" in m]) == 1


def test_native_thread_buffer_is_bounded(nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ticks not drained in time are counted as dropped rows, never kept."""
    import gpuprof.collector.sources.nvml as nvml_module

    monkeypatch.setattr(nvml_module, "BUFFER_S", 0.05)  # the minimum of 4 ticks
    src, _ = nvml({"rate_hz": 50}, threaded=True, gpus=2)
    time.sleep(1.0)
    got = {t.path: rows for t, rows in src.sample(time.monotonic_ns())}
    assert len(got[schema.GPU_SAMPLES.path]) == 8  # 4 ticks of 2 GPUs
    assert src.drops() >= 60, src.drops()  # ~46 ticks of 2 GPUs' samples and GPM rows
