"""GPU metrics through NVML (pynvml from nvidia-ml-py).

What is sampled, per watched GPU, every 1/rate_hz seconds: utilization, memory used, power,
temperature, SM and memory clocks, PCIe and NVLink throughput (from byte counters, so a sample
costs no 20 ms PCIe measurement window as nvmlDeviceGetPcieThroughput would), clock event
(throttle) reasons, volatile ECC totals; on Hopper and newer the GPM metrics from consecutive
pairs of GPM samples; every process_interval_s the job's processes' GPU use; XID and ECC events
from an NVML event set, polled without waiting.

Faults, and why they are handled this way:
  * A metric the GPU does not support (NVML_ERROR_NOT_SUPPORTED and kin) is NaN with one row in
    /diagnostics/missing naming the NVML error, and is not asked again: never a zero.
  * Every NVML call runs on a worker thread under a watchdog: a call that does not return within
    call_timeout_s (a wedged driver) is recorded, its GPU is skipped with exponential back-off, and
    the other GPUs and sources go on. The stuck thread cannot be killed; it is abandoned and exits
    when its call returns.
  * NVML_ERROR_GPU_IS_LOST: a gpu_lost event and an error row, and that GPU is not polled again.
  * No NVML library: SourceUnavailable with the reason; the other sources run.
GPUPROF_NVML_LIBRARY names the library to load instead of libnvidia-ml.so.1 (the tests' double).
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collector import schema
from collector.sources.base import Batch, Source, SourceContext, SourceUnavailable
from slurm_hooks import environment

UINT_MAX = 0xFFFFFFFF
MAX_ABANDONED_THREADS = 4
BACKOFF_START_S = 5.0
BACKOFF_MAX_S = 300.0
MAX_EVENTS_PER_SAMPLE = 64

# GPU_SAMPLES columns, in order after (t_ns, gpu)
SAMPLE_COLS = tuple(c.name for c in schema.GPU_SAMPLES.columns[2:])
# Field-value ids read in one nvmlDeviceGetFieldValues call: (column, field id, scope)
_FI_ECC_SBE, _FI_ECC_DBE, _FI_NVLINK_TX, _FI_NVLINK_RX, _FI_PCIE_TX, _FI_PCIE_RX = 3, 4, 138, 139, 197, 198
FIELDS: tuple[tuple[str, int, int], ...] = (
    ("ecc_sbe_total", _FI_ECC_SBE, 0),
    ("ecc_dbe_total", _FI_ECC_DBE, 0),
    ("nvlink_tx_kbps", _FI_NVLINK_TX, UINT_MAX),  # UINT_MAX scope: summed over all links, KiB
    ("nvlink_rx_kbps", _FI_NVLINK_RX, UINT_MAX),
    ("pcie_tx_kbps", _FI_PCIE_TX, 0),  # bytes, cumulative
    ("pcie_rx_kbps", _FI_PCIE_RX, 0),
)
# counter columns turned into rates: column -> bytes per counter unit
RATE_SCALE = {"nvlink_tx_kbps": 1024.0, "nvlink_rx_kbps": 1024.0, "pcie_tx_kbps": 1.0, "pcie_rx_kbps": 1.0}
GPM_METRICS = (("sm_activity", 2), ("sm_occupancy", 3), ("tensor_activity", 5), ("dram_bw_util", 10))
HOPPER = 9
# errors that mean "this metric will never be there on this GPU"
PERMANENT = {"NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND",
             "NVML_ERROR_INVALID_ARGUMENT"}
EVENT_KIND = {"xid": 0, "ecc_single_bit": 1, "ecc_double_bit": 2, "gpu_lost": 3, "clock_change": 4}


class NvmlTimeout(Exception):
    def __init__(self, call: str, gpu: int, timeout_s: float) -> None:
        super().__init__(f"{call} on GPU {gpu} did not return within {timeout_s:g} s")
        self.call = call
        self.gpu = gpu


class _Abandoned(Exception):
    """Raised in a worker thread whose tick was given up after a timeout."""


def load_nvml() -> Any:
    """Import pynvml, load the library (GPUPROF_NVML_LIBRARY if set) and initialise NVML."""
    try:
        import pynvml
    except ImportError as e:
        raise SourceUnavailable(f"pynvml (nvidia-ml-py) is not installed: {e}") from None
    path = environment.get(environment.GPUPROF_NVML_LIBRARY)
    if path:
        # pynvml loads "libnvidia-ml.so.1" by name; its documented module global nvmlLib is where a
        # loaded library goes, so placing ours there (under its lock) makes every call use it.
        with pynvml.libLoadLock:
            current = pynvml.nvmlLib
            if current is None or getattr(current, "_name", None) != path:
                try:
                    pynvml.nvmlLib = ctypes.CDLL(path)
                except OSError as e:
                    raise SourceUnavailable(f"NVML library {path} (GPUPROF_NVML_LIBRARY) cannot be loaded: {e}") \
                        from None
                pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise SourceUnavailable(f"NVML not available: nvmlInit: {error_name(pynvml, e)}") from None
    return pynvml


_ERROR_NAMES: dict[int, str] = {}


def error_name(pynvml: Any, e: Exception) -> str:
    if not _ERROR_NAMES:
        for k in dir(pynvml):
            if k.startswith("NVML_ERROR_"):
                _ERROR_NAMES[getattr(pynvml, k)] = k
    value = getattr(e, "value", None)
    return _ERROR_NAMES.get(value, f"NVML error {value}") if isinstance(value, int) else str(e)


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    name: str
    pci_bus_id: str
    arch: int
    mem_total: int
    gpm: bool
    disabled: set[str] = field(default_factory=set)  # metrics never asked again
    lost: bool = False
    skip_until: float = 0.0
    backoff_s: float = 0.0
    prev_counters: dict[str, tuple[float, int]] = field(default_factory=dict)  # col -> (value, t_ns)
    gpm_samples: list[Any] = field(default_factory=list)
    gpm_prev: Any = None
    gpm_prev_t: int = 0
    proc_ts: int = 0  # lastSeenTimeStamp for nvmlDeviceGetProcessUtilization


class _Watchdog:
    """Runs one tick's NVML calls on a worker thread; gives up when no call completes in time."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._gen = 0
        self._job: tuple[int, Callable[[], Any], threading.Event, list[Any]] | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.abandoned: list[threading.Thread] = []
        self.progress = 0
        self.current: tuple[str, int] = ("", -1)

    def _worker(self, gen: int) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._gen != gen or self._job is not None)
                if self._gen != gen:
                    return
                assert self._job is not None
                _, fn, done, box = self._job
                self._job = None
            try:
                box.append(("ok", fn()))
            except _Abandoned:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the sampling thread to report
                box.append(("err", e))
            done.set()

    def check(self, gen: int) -> None:
        if gen != self._gen:
            raise _Abandoned()

    def run(self, fn: Callable[[int], Any]) -> Any:
        """fn(gen) must call check(gen) (through _call) before each NVML call."""
        self.abandoned = [t for t in self.abandoned if t.is_alive()]
        if self._thread is None:
            if len(self.abandoned) >= MAX_ABANDONED_THREADS:
                raise RuntimeError(f"{len(self.abandoned)} NVML calls are still stuck; not calling NVML")
            self._thread = threading.Thread(target=self._worker, args=(self._gen,), name="nvml-call", daemon=True)
            self._thread.start()
        gen = self._gen
        done = threading.Event()
        box: list[Any] = []
        with self._cv:
            self._job = (gen, lambda: fn(gen), done, box)
            self._cv.notify_all()
        last = self.progress
        while not done.wait(self.timeout_s):
            if self.progress == last:
                call, gpu = self.current
                with self._cv:
                    self._gen += 1  # the stuck worker exits when its call returns
                    self._cv.notify_all()
                assert self._thread is not None
                self.abandoned.append(self._thread)
                self._thread = None
                raise NvmlTimeout(call, gpu, self.timeout_s)
            last = self.progress
        kind, value = box[0]
        if kind == "err":
            raise value
        return value

    def stop(self) -> None:
        with self._cv:
            self._gen += 1
            self._cv.notify_all()
        self._thread = None


def job_gpu_selectors() -> list[str] | None:
    """The job's GPUs as Slurm/CUDA name them (indices or UUIDs); None when neither is set."""
    for var in (environment.SLURM_JOB_GPUS, environment.CUDA_VISIBLE_DEVICES):
        v = environment.get(var)
        if v is not None and v.strip() not in ("", "NoDevFiles"):
            return [x.strip() for x in v.split(",") if x.strip()]
    return None


class NvmlSource(Source):
    name = "nvml"
    tables = (schema.GPU_DEVICES, schema.GPU_SAMPLES, schema.GPU_GPM, schema.GPU_PROCESSES, schema.GPU_EVENTS)

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.interval_s = 1.0 / float(cfg["rate_hz"])
        self.process_interval_s = float(cfg.get("process_interval_s", 1.0))
        self.nv: Any = None
        self.gpus: list[_Gpu] = []
        self._ctx: SourceContext | None = None
        self._wd = _Watchdog(float(cfg["call_timeout_s"]))
        self._devices_emitted = False
        self._event_set: Any = None
        self._next_proc_t = 0.0
        self._handle_index: dict[int, int] = {}
        self.library = ""

    # --- helpers --------------------------------------------------------------------------------
    def _call(self, gen: int, name: str, gpu: int, fn: Callable[..., Any], *args: Any) -> Any:
        self._wd.check(gen)
        self._wd.current = (name, gpu)
        try:
            return fn(*args)
        finally:
            self._wd.progress += 1

    def _missing(self, g: _Gpu, metric: str, reason: str) -> None:
        if metric not in g.disabled:
            g.disabled.add(metric)
            assert self._ctx is not None
            self._ctx.report_missing(self.name, g.index, metric, reason)

    def _nvml_error(self, g: _Gpu, metric: str, e: Exception) -> None:
        """Classify an NVML error of one metric: permanent -> missing, lost -> event, else error."""
        assert self._ctx is not None
        name = error_name(self.nv, e)
        if name == "NVML_ERROR_GPU_IS_LOST":
            raise _GpuLost()
        if name in PERMANENT:
            self._missing(g, metric, name)
        else:
            self._ctx.report_error(self.name, f"GPU {g.index} {metric}: {name}")

    # --- start ------------------------------------------------------------------------------------
    def start(self, ctx: SourceContext) -> None:
        self._ctx = ctx
        self.nv = load_nvml()
        self.library = environment.get(environment.GPUPROF_NVML_LIBRARY) or "libnvidia-ml.so.1"
        self.gpus = self._wd.run(self._open_devices)
        if not self.gpus:
            raise SourceUnavailable(self._no_gpu_reason)
        self._wd.run(self._register_events)

    def _open_devices(self, gen: int) -> list[_Gpu]:
        nv, c = self.nv, self._call
        count = c(gen, "nvmlDeviceGetCount", -1, nv.nvmlDeviceGetCount)
        selectors = None if self.cfg["gpus"] == "all" else job_gpu_selectors()
        self._no_gpu_reason = f"NVML reports {count} GPUs"
        if selectors is None and self.cfg["gpus"] != "all":
            self._no_gpu_reason = ("no GPUs allocated to the job (SLURM_JOB_GPUS and CUDA_VISIBLE_DEVICES unset); "
                                   "set sources.nvml.gpus = 'all' (or --gpus all) to watch every GPU")
            return []
        out: list[_Gpu] = []
        for i in range(count):
            h = c(gen, "nvmlDeviceGetHandleByIndex", i, nv.nvmlDeviceGetHandleByIndex, i)
            uuid = _s(c(gen, "nvmlDeviceGetUUID", i, nv.nvmlDeviceGetUUID, h))
            if selectors is not None:
                try:
                    minor = int(c(gen, "nvmlDeviceGetMinorNumber", i, nv.nvmlDeviceGetMinorNumber, h))
                except nv.NVMLError:
                    minor = i
                if not any(_selects(s, uuid, minor) for s in selectors):
                    continue
            name = _s(c(gen, "nvmlDeviceGetName", i, nv.nvmlDeviceGetName, h))
            pci = _s(c(gen, "nvmlDeviceGetPciInfo", i, nv.nvmlDeviceGetPciInfo, h).busId)
            try:
                arch = int(c(gen, "nvmlDeviceGetArchitecture", i, nv.nvmlDeviceGetArchitecture, h))
            except nv.NVMLError:
                arch = -1
            mem_total = int(c(gen, "nvmlDeviceGetMemoryInfo", i, nv.nvmlDeviceGetMemoryInfo, h).total)
            g = _Gpu(i, h, uuid, name, pci, arch, mem_total, gpm=False)
            self._handle_index[_addr(h)] = i
            if self.cfg.get("gpm", True):
                self._setup_gpm(gen, g)
            out.append(g)
        if selectors is not None and not out:
            self._no_gpu_reason = f"none of the job's GPUs {selectors} is among the {count} NVML reports"
        return out

    def _setup_gpm(self, gen: int, g: _Gpu) -> None:
        nv = self.nv
        reason = ""
        if g.arch >= 0 and g.arch < HOPPER:
            reason = f"GPM needs Hopper or newer (architecture {g.arch})"
        else:
            try:
                sup = self._call(gen, "nvmlGpmQueryDeviceSupport", g.index, nv.nvmlGpmQueryDeviceSupport, g.handle)
                if not sup.isSupportedDevice:
                    reason = "nvmlGpmQueryDeviceSupport: device not supported"
                else:
                    g.gpm_samples = [self._call(gen, "nvmlGpmSampleAlloc", g.index, nv.nvmlGpmSampleAlloc)
                                     for _ in range(2)]
                    g.gpm = True
            except nv.NVMLError as e:
                reason = f"nvmlGpmQueryDeviceSupport: {error_name(nv, e)}"
        if reason:
            for col, _ in GPM_METRICS:
                self._missing(g, col, reason[:96])

    def _register_events(self, gen: int) -> None:
        nv = self.nv
        wanted = nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeSingleBitEccError | nv.nvmlEventTypeDoubleBitEccError
        try:
            self._event_set = self._call(gen, "nvmlEventSetCreate", -1, nv.nvmlEventSetCreate)
        except nv.NVMLError as e:
            for g in self.gpus:
                self._missing(g, "events", f"nvmlEventSetCreate: {error_name(nv, e)}"[:96])
            return
        for g in self.gpus:
            try:
                types = self._call(gen, "nvmlDeviceGetSupportedEventTypes", g.index,
                                   nv.nvmlDeviceGetSupportedEventTypes, g.handle) & wanted
                if types:
                    self._call(gen, "nvmlDeviceRegisterEvents", g.index, nv.nvmlDeviceRegisterEvents,
                               g.handle, types, self._event_set)
                else:
                    self._missing(g, "events", "no XID/ECC event types supported")
            except nv.NVMLError as e:
                self._missing(g, "events", f"nvmlDeviceRegisterEvents: {error_name(nv, e)}"[:96])

    # --- sampling ---------------------------------------------------------------------------------
    def sample(self, now_ns: int) -> Iterable[Batch]:
        out: list[Batch] = []
        if not self._devices_emitted:
            self._devices_emitted = True
            dev = schema.GPU_DEVICES.empty(len(self.gpus))
            for k, g in enumerate(self.gpus):
                dev[k] = (g.index, g.uuid.encode()[:64], g.name.encode()[:64], g.pci_bus_id.encode()[:32], g.arch,
                          g.mem_total, int(g.gpm))
            out.append((schema.GPU_DEVICES, dev))
        mono = time.monotonic()
        active = [g for g in self.gpus if not g.lost and g.skip_until <= mono]
        do_procs = mono >= self._next_proc_t
        if do_procs:
            self._next_proc_t = mono + self.process_interval_s
        acc = _Acc()
        try:
            self._wd.run(lambda gen: self._tick(gen, now_ns, active, do_procs, acc))
        except NvmlTimeout as e:
            assert self._ctx is not None
            hung = next((x for x in self.gpus if x.index == e.gpu), None)
            if hung is not None:
                hung.backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_START_S, hung.backoff_s * 2))
                hung.skip_until = time.monotonic() + hung.backoff_s
                self._ctx.report_error(self.name,
                                       f"timeout: {e}; GPU {hung.index} skipped for {hung.backoff_s:g} s")
            else:
                self._ctx.report_error(self.name, f"timeout: {e}")
        for t, rows in ((schema.GPU_SAMPLES, acc.samples), (schema.GPU_GPM, acc.gpm),
                        (schema.GPU_PROCESSES, acc.procs), (schema.GPU_EVENTS, acc.events)):
            if rows:
                out.append((t, np.array(rows, dtype=t.dtype)))
        return out

    def _tick(self, gen: int, now_ns: int, gpus: list[_Gpu], do_procs: bool, acc: _Acc) -> None:
        for g in gpus:
            try:
                acc.samples.append(self._sample_gpu(gen, g, now_ns))
                if g.gpm:
                    r = self._sample_gpm(gen, g, now_ns)
                    if r is not None:
                        acc.gpm.append(r)
                if do_procs and "processes" not in g.disabled:
                    acc.procs.extend(self._sample_procs(gen, g, now_ns))
                if g.backoff_s and g.skip_until <= time.monotonic():
                    g.backoff_s = 0.0
            except _GpuLost:
                g.lost = True
                acc.events.append((now_ns, g.index, EVENT_KIND["gpu_lost"], 0))
                assert self._ctx is not None
                self._ctx.report_error(self.name, f"GPU {g.index} ({g.uuid}) is lost (NVML_ERROR_GPU_IS_LOST); "
                                                  "no longer sampled")
        if self._event_set is not None:
            acc.events.extend(self._poll_events(gen, now_ns))

    def _sample_gpu(self, gen: int, g: _Gpu, now_ns: int) -> tuple[Any, ...]:
        nv, h, i, d = self.nv, g.handle, g.index, g.disabled
        v = dict.fromkeys(SAMPLE_COLS, math.nan)

        def get(metric: str, call: str, fn: Callable[..., Any], *args: Any) -> Any:
            if metric in d:
                return None
            try:
                return self._call(gen, call, i, fn, *args)
            except nv.NVMLError as e:
                self._nvml_error(g, metric, e)
                return None

        u = get("util_gpu", "nvmlDeviceGetUtilizationRates", nv.nvmlDeviceGetUtilizationRates, h)
        if u is not None:
            v["util_gpu"], v["util_mem"] = u.gpu, u.memory
        elif "util_gpu" in d:
            self._missing(g, "util_mem", "NVML_ERROR_NOT_SUPPORTED (with util_gpu)")
        m = get("mem_used_bytes", "nvmlDeviceGetMemoryInfo", nv.nvmlDeviceGetMemoryInfo, h)
        if m is not None:
            v["mem_used_bytes"] = m.used
        p = get("power_w", "nvmlDeviceGetPowerUsage", nv.nvmlDeviceGetPowerUsage, h)
        if p is not None:
            v["power_w"] = p / 1000.0  # NVML: milliwatts
        t = get("temp_c", "nvmlDeviceGetTemperature", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        if t is not None:
            v["temp_c"] = t
        sm = get("sm_clock_mhz", "nvmlDeviceGetClockInfo", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        if sm is not None:
            v["sm_clock_mhz"] = sm
        mc = get("mem_clock_mhz", "nvmlDeviceGetClockInfo", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        if mc is not None:
            v["mem_clock_mhz"] = mc
        tr = get("throttle_reasons", "nvmlDeviceGetCurrentClocksEventReasons",
                 nv.nvmlDeviceGetCurrentClocksEventReasons, h)
        if tr is not None:
            v["throttle_reasons"] = float(tr)
        wanted = [(col, fid, scope) for col, fid, scope in FIELDS if col not in d]
        if wanted:
            fv = get("field_values", "nvmlDeviceGetFieldValues", nv.nvmlDeviceGetFieldValues, h,
                     [(fid, scope) for _, fid, scope in wanted])
            if fv is not None:
                for k, (col, _fid, _scope) in enumerate(wanted):
                    item = fv[k]
                    if item.nvmlReturn != 0:
                        err = nv.NVMLError(item.nvmlReturn)
                        self._nvml_error(g, col, err)
                        continue
                    val = _field_value(item)
                    if col in RATE_SCALE:
                        prev = g.prev_counters.get(col)
                        g.prev_counters[col] = (val, now_ns)
                        if prev is not None and now_ns > prev[1] and val >= prev[0]:
                            v[col] = (val - prev[0]) * RATE_SCALE[col] / 1000.0 / ((now_ns - prev[1]) / 1e9)
                    else:
                        v[col] = val
            elif "field_values" in d:
                for col, _, _ in wanted:
                    self._missing(g, col, "nvmlDeviceGetFieldValues not supported")
        return (now_ns, i, *(v[c] for c in SAMPLE_COLS))

    def _sample_gpm(self, gen: int, g: _Gpu, now_ns: int) -> tuple[Any, ...] | None:
        nv = self.nv
        cur = g.gpm_samples[0] if g.gpm_prev is not g.gpm_samples[0] else g.gpm_samples[1]
        try:
            self._call(gen, "nvmlGpmSampleGet", g.index, nv.nvmlGpmSampleGet, g.handle, cur)
        except nv.NVMLError as e:
            if error_name(nv, e) == "NVML_ERROR_GPU_IS_LOST":
                raise _GpuLost() from None
            g.gpm = False
            for col, _ in GPM_METRICS:
                self._missing(g, col, f"nvmlGpmSampleGet: {error_name(nv, e)}"[:96])
            return None
        prev, prev_t = g.gpm_prev, g.gpm_prev_t
        g.gpm_prev, g.gpm_prev_t = cur, now_ns
        if prev is None:
            return None  # GPM metrics need two samples
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(GPM_METRICS)
        mg.sample1, mg.sample2 = prev, cur
        for k, (_, mid) in enumerate(GPM_METRICS):
            mg.metrics[k].metricId = mid
        try:
            self._call(gen, "nvmlGpmMetricsGet", g.index, nv.nvmlGpmMetricsGet, mg)
        except nv.NVMLError as e:
            self._nvml_error(g, "gpm", e)
            return None
        vals = []
        for k, (col, _) in enumerate(GPM_METRICS):
            r = mg.metrics[k]
            if r.nvmlReturn != 0:
                self._nvml_error(g, col, nv.NVMLError(r.nvmlReturn))
                vals.append(math.nan)
            else:
                vals.append(r.value)
        return (now_ns, g.index, now_ns - prev_t, *vals)

    def _sample_procs(self, gen: int, g: _Gpu, now_ns: int) -> list[tuple[Any, ...]]:
        nv = self.nv
        assert self._ctx is not None
        pids = self._ctx.pids()
        try:
            running = self._call(gen, "nvmlDeviceGetComputeRunningProcesses", g.index,
                                 nv.nvmlDeviceGetComputeRunningProcesses, g.handle)
        except nv.NVMLError as e:
            self._nvml_error(g, "processes", e)
            return []
        mem = {int(p.pid): p.usedGpuMemory for p in running if int(p.pid) in pids}
        util: dict[int, tuple[float, float]] = {}
        if "process_util" not in g.disabled:
            try:
                samples = self._call(gen, "nvmlDeviceGetProcessUtilization", g.index,
                                     nv.nvmlDeviceGetProcessUtilization, g.handle, g.proc_ts)
                for s in samples:
                    g.proc_ts = max(g.proc_ts, int(s.timeStamp))
                    if int(s.pid) in pids:
                        util[int(s.pid)] = (float(s.smUtil), float(s.memUtil))
            except nv.NVMLError as e:
                if error_name(nv, e) != "NVML_ERROR_NOT_FOUND":  # NOT_FOUND: no samples since proc_ts
                    self._nvml_error(g, "process_util", e)
        rows = []
        for pid in sorted(set(mem) | set(util)):
            sm, mu = util.get(pid, (math.nan, math.nan))
            used = mem.get(pid)
            rows.append((now_ns, g.index, pid, sm, mu, math.nan if used is None else float(used)))
        return rows

    def _poll_events(self, gen: int, now_ns: int) -> list[tuple[Any, ...]]:
        nv = self.nv
        rows = []
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                ev = self._call(gen, "nvmlEventSetWait", -1, nv.nvmlEventSetWait, self._event_set, 0)
            except nv.NVMLError as e:
                name = error_name(nv, e)
                if name != "NVML_ERROR_TIMEOUT":
                    assert self._ctx is not None
                    self._ctx.report_error(self.name, f"nvmlEventSetWait: {name}")
                break
            idx = self._handle_index.get(_addr(ev.device), -1)
            et = int(ev.eventType)
            if et & nv.nvmlEventTypeXidCriticalError:
                kind = EVENT_KIND["xid"]
            elif et & nv.nvmlEventTypeDoubleBitEccError:
                kind = EVENT_KIND["ecc_double_bit"]
            elif et & nv.nvmlEventTypeSingleBitEccError:
                kind = EVENT_KIND["ecc_single_bit"]
            else:
                continue
            rows.append((now_ns, idx, kind, int(ev.eventData)))
        return rows

    def stop(self) -> None:
        if self.nv is None:
            return
        nv = self.nv

        def release(gen: int) -> None:
            for g in self.gpus:
                for s in g.gpm_samples:
                    try:
                        self._call(gen, "nvmlGpmSampleFree", g.index, nv.nvmlGpmSampleFree, s)
                    except nv.NVMLError:
                        pass  # freeing on a lost GPU: nothing else to do
            if self._event_set is not None:
                try:
                    self._call(gen, "nvmlEventSetFree", -1, nv.nvmlEventSetFree, self._event_set)
                except nv.NVMLError:
                    pass
            try:
                self._call(gen, "nvmlShutdown", -1, nv.nvmlShutdown)
            except nv.NVMLError:
                pass

        try:
            self._wd.run(release)
        except (NvmlTimeout, RuntimeError) as e:
            assert self._ctx is not None
            self._ctx.report_error(self.name, f"shutdown: {e}")
        self._wd.stop()
        self.nv = None  # stop is final: a second call does nothing

    def at_seal(self, f: Any) -> None:
        if "/gpu/devices" in f:
            f["/gpu/devices"].attrs["nvml_library"] = self.library
            emulated = any("test double" in g.name.lower() for g in self.gpus)
            f["/gpu/devices"].attrs["emulated"] = emulated
            if emulated:
                f.attrs["emulated_gpus"] = True


class _GpuLost(Exception):
    pass


@dataclass
class _Acc:
    samples: list[tuple[Any, ...]] = field(default_factory=list)
    gpm: list[tuple[Any, ...]] = field(default_factory=list)
    procs: list[tuple[Any, ...]] = field(default_factory=list)
    events: list[tuple[Any, ...]] = field(default_factory=list)


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _addr(h: Any) -> int:
    return int(ctypes.cast(h, ctypes.c_void_p).value or 0)


def _selects(sel: str, uuid: str, minor: int) -> bool:
    if sel.startswith(("GPU-", "MIG-")):
        return uuid.startswith(sel)
    return sel.isdigit() and int(sel) == minor


def _field_value(item: Any) -> float:
    t = int(item.valueType)
    u = item.value
    # NVML_VALUE_TYPE_*: 0 double, 1 uint, 2 ulong, 3 ulonglong, 4 slonglong, 5 sint, 6 ushort
    return float((u.dVal, u.uiVal, u.ulVal, u.ullVal, u.sllVal, u.siVal, u.usVal)[t] if 0 <= t <= 6 else u.ullVal)
