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
The per-sample calls go through pre-bound ctypes functions of that same library
(collector/sources/nvml_direct.py); set-up, the 1 Hz process queries and shutdown through pynvml.
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

from gpuprof.collector import environment, native, schema
from gpuprof.collector.osthread import named_thread
from gpuprof.collector.sources import nvml_direct
from gpuprof.collector.sources.base import Batch, Source, SourceContext, SourceUnavailable

UINT_MAX = 0xFFFFFFFF
MAX_ABANDONED_THREADS = 4
BACKOFF_START_S = 5.0
BACKOFF_MAX_S = 300.0
MAX_EVENTS_PER_SAMPLE = 64

# GPU_SAMPLES columns, in order after (t_ns, gpu)
SAMPLE_COLS = tuple(c.name for c in schema.GPU_SAMPLES.columns[2:])
# position of each column in a GPU_SAMPLES row (t_ns, gpu, *SAMPLE_COLS)
_COL = {c: k + 2 for k, c in enumerate(SAMPLE_COLS)}
_NAN_ROW = (math.nan,) * len(SAMPLE_COLS)
# Table.dtype builds a numpy dtype on every access (~4 us): taken once here.
_DTYPES = {t.path: t.dtype for t in (schema.GPU_SAMPLES, schema.GPU_GPM, schema.GPU_PROCESSES, schema.GPU_EVENTS)}
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
NVML_TEMPERATURE_GPU, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2  # nvml.h enums
EVENT_KIND = {"xid": 0, "ecc_single_bit": 1, "ecc_double_bit": 2, "gpu_lost": 3, "clock_change": 4}
# The metrics of collector/native/nvmltick.c, in the order of its M_* bits, with the NVML function
# each calls (named in timeouts). The names are those of _Gpu.disabled.
NATIVE_METRICS: tuple[tuple[str, str], ...] = (
    ("util_gpu", "nvmlDeviceGetUtilizationRates"), ("mem_used_bytes", "nvmlDeviceGetMemoryInfo"),
    ("power_w", "nvmlDeviceGetPowerUsage"), ("temp_c", "nvmlDeviceGetTemperature"),
    ("sm_clock_mhz", "nvmlDeviceGetClockInfo"), ("mem_clock_mhz", "nvmlDeviceGetClockInfo"),
    ("throttle_reasons", "nvmlDeviceGetCurrentClocksEventReasons"), ("field_values", "nvmlDeviceGetFieldValues"),
    *((col, "nvmlDeviceGetFieldValues") for col, _, _ in FIELDS),
    ("gpm_sample", "nvmlGpmSampleGet"), ("gpm", "nvmlGpmMetricsGet"),
    *((col, "nvmlGpmMetricsGet") for col, _ in GPM_METRICS),
    ("events", "nvmlEventSetWait"),
)
_METRIC_BIT = {name: 1 << k for k, (name, _) in enumerate(NATIVE_METRICS)}
# A native-threaded source hands its rows over this often (the daemon calls sample() at this
# interval); its C buffers hold BUFFER_S seconds of ticks, beyond which rows are counted as dropped.
DRAIN_INTERVAL_S = 1.0
BUFFER_S = 8.0


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
    value = getattr(e, "value", None)
    return code_name(pynvml, value) if isinstance(value, int) else str(e)


def code_name(pynvml: Any, code: int) -> str:
    """NVML_ERROR_... for an nvmlReturn_t."""
    if not _ERROR_NAMES:
        for k in dir(pynvml):
            if k.startswith("NVML_ERROR_"):
                _ERROR_NAMES[getattr(pynvml, k)] = k
    return _ERROR_NAMES.get(code, f"NVML error {code}")


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
    gpm_ptrs: list[Any] = field(default_factory=list)  # the same, as c_void_p for the direct calls
    gpm_prev: int = -1  # index into gpm_samples of the previous GPM sample, -1 before the first
    gpm_prev_t: int = 0
    buf: Any = None  # nvml_direct.DeviceBuffers
    proc_ts: int = 0  # lastSeenTimeStamp for nvmlDeviceGetProcessUtilization


class _Watchdog:
    """Runs one tick's NVML calls on a long-lived worker thread; gives up when no call completes in
    time.

    Why this shape: a thread per tick (or per call) costs a thread start each time, and a
    Condition/Event handoff allocates a waiter lock per wait; at 10 Hz that was measurable. Here one
    worker per source lives as long as the source, and a tick is handed over and back with two raw
    locks used as binary semaphores: the worker blocks on `go` without a timeout (no idle wake-ups),
    the sampling thread blocks on `done` for at most timeout_s, looking again only while calls still
    complete (`progress` moves). A worker stuck in a call is abandoned (generation bumped, its `go`
    released so it exits as soon as the call returns) and the next tick starts a fresh worker."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.gen = 0
        self.progress = 0
        self.call = ""
        self.gpu = -1
        self.abandoned: list[threading.Thread] = []
        # (thread, go, done, slot): slot[0] the job, slot[1] its (ok, value)
        self._worker: tuple[threading.Thread, Any, Any, list[Any]] | None = None

    @property
    def current(self) -> tuple[str, int]:
        return self.call, self.gpu

    def _loop(self, gen: int, go: Any, done: Any, slot: list[Any]) -> None:
        while True:
            go.acquire()
            if self.gen != gen:
                return
            fn = slot[0]
            try:
                slot[1] = (True, fn(gen))
            except _Abandoned:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the sampling thread to report
                slot[1] = (False, e)
            done.release()

    def check(self, gen: int) -> None:
        if gen != self.gen:
            raise _Abandoned()

    def run(self, fn: Callable[[int], Any]) -> Any:
        """fn(gen) must check the generation (check(gen), or gen != self.gen) before each NVML call,
        set call/gpu to the call it makes and bump progress after it."""
        if self.abandoned:
            self.abandoned = [t for t in self.abandoned if t.is_alive()]
        if self._worker is None:
            if len(self.abandoned) >= MAX_ABANDONED_THREADS:
                raise RuntimeError(f"{len(self.abandoned)} NVML calls are still stuck; not calling NVML")
            go, done = threading.Lock(), threading.Lock()
            go.acquire()
            done.acquire()
            slot: list[Any] = [None, None]
            t = named_thread(self._loop, "nvml-call", (self.gen, go, done, slot))
            t.start()
            self._worker = (t, go, done, slot)
        t, go, done, slot = self._worker
        slot[0] = fn
        slot[1] = None
        last = self.progress
        go.release()
        while not done.acquire(timeout=self.timeout_s):
            if self.progress == last:
                self._abandon()
                raise NvmlTimeout(self.call, self.gpu, self.timeout_s)
            last = self.progress
        ok, value = slot[1]
        slot[0] = slot[1] = None
        if ok:
            return value
        raise value

    def _abandon(self) -> None:
        """The worker is stuck in a call: it exits when the call returns (its next generation check
        fails, or its `go`, released here, lets it see the new generation)."""
        assert self._worker is not None
        t, go, _done, _slot = self._worker
        self.gen += 1
        self._worker = None
        self.abandoned.append(t)
        try:
            go.release()
        except RuntimeError:
            pass  # already released: the worker has not taken the tick yet

    def stop(self) -> None:
        self.gen += 1
        if self._worker is not None:
            _t, go, _done, _slot = self._worker
            self._worker = None
            try:
                go.release()
            except RuntimeError:
                pass


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

    def __init__(self, cfg: dict[str, Any], threaded: bool = False) -> None:
        """threaded=True (what the collector runs): the per-sample calls run in a native thread at
        rate_hz (collector/native/nvmltick.c on ticker.c) and sample() drains their rows every
        DRAIN_INTERVAL_S, with the per-process queries; threaded=False, or without the native
        library: each sample() is one tick of pre-bound ctypes calls under the Python watchdog."""
        self.cfg = cfg
        self.sample_interval_s = 1.0 / float(cfg["rate_hz"])
        self.interval_s = self.sample_interval_s
        self.threaded = threaded
        self.sampler = ""  # how the per-sample calls ran: "native thread" or "python (why)"
        self._lib: Any = None  # collector/native's library when the native thread runs
        self._state: int | None = None  # its struct gp_nvml *
        self._ticker: native.Ticker | None = None
        # threads abandoned in a hung call, with their states: freed once the call has returned
        self._stuck: list[tuple[native.Ticker, int]] = []
        self._native_stopped = False
        self._stuck_reported = False
        self._caps: tuple[int, ...] = ()
        self._final_arrays: list[Batch] = []
        self._dropped = 0
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
        self._b: nvml_direct.Bindings | None = None
        self._event_ptr: Any = None
        self._event_data: Any = None
        self._event_ref: Any = None

    # --- helpers --------------------------------------------------------------------------------
    def _call(self, gen: int, name: str, gpu: int, fn: Callable[..., Any], *args: Any) -> Any:
        """A pynvml call (set-up, 1 Hz process queries, shutdown) under the watchdog."""
        wd = self._wd
        if gen != wd.gen:
            raise _Abandoned()
        wd.call, wd.gpu = name, gpu
        try:
            return fn(*args)
        finally:
            wd.progress += 1

    def _direct(self, gen: int, g: _Gpu, metric: str, name: str, fn: Callable[..., int], *args: Any) -> bool:
        """A pre-bound hot-path call under the watchdog; False (and the error classified) unless it
        returned NVML_SUCCESS."""
        wd = self._wd
        if gen != wd.gen:
            raise _Abandoned()
        wd.call = name
        r = fn(*args)
        wd.progress += 1
        if r:
            self._nvml_code(g, metric, r)
            return False
        return True

    def _missing(self, g: _Gpu, metric: str, reason: str) -> None:
        if metric not in g.disabled:
            g.disabled.add(metric)
            assert self._ctx is not None
            self._ctx.report_missing(self.name, g.index, metric, reason)

    def _nvml_error(self, g: _Gpu, metric: str, e: Exception) -> None:
        """Classify an NVML error of one metric: permanent -> missing, lost -> event, else error."""
        self._nvml_name(g, metric, error_name(self.nv, e))

    def _nvml_code(self, g: _Gpu, metric: str, code: int) -> None:
        self._nvml_name(g, metric, code_name(self.nv, code))

    def _nvml_name(self, g: _Gpu, metric: str, name: str) -> None:
        assert self._ctx is not None
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
        try:
            self._b = nvml_direct.Bindings(self.nv)
        except (AttributeError, RuntimeError) as e:
            raise SourceUnavailable(f"NVML library lacks a basic function: {e}") from None
        self.gpus = self._wd.run(self._open_devices)
        if not self.gpus:
            self.stop()  # nvmlShutdown: NVML stays initialised otherwise (and the worker thread alive)
            raise SourceUnavailable(self._no_gpu_reason)
        self._wd.run(self._register_events)
        if self._event_set is not None:
            if self._b.event_wait is None:
                for g in self.gpus:
                    self._missing(g, "events", "NVML_ERROR_FUNCTION_NOT_FOUND (nvmlEventSetWait_v2)")
                self._event_set = None
            else:
                self._event_ptr = ctypes.cast(self._event_set, ctypes.c_void_p)
                self._event_data = nvml_direct.EventData()
                self._event_ref = ctypes.byref(self._event_data)
        if not self.threaded:
            self.sampler = "python (threaded=False)"
            return
        try:
            self._lib = native.sampler()
        except native.NativeUnavailable as e:
            self.sampler = f"python ({e})"
            return
        self._start_native()
        self.sampler = "native thread"
        self.interval_s = DRAIN_INTERVAL_S

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
            g.buf = nvml_direct.DeviceBuffers(nv, h)
            assert self._b is not None
            if self._b.reasons is None:
                self._missing(g, "throttle_reasons", "NVML_ERROR_FUNCTION_NOT_FOUND")
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
                    assert self._b is not None
                    if self._b.gpm_sample_get is None or self._b.gpm_metrics_get is None:
                        raise nv.NVMLError(nv.NVML_ERROR_FUNCTION_NOT_FOUND)
                    g.gpm_samples = [self._call(gen, "nvmlGpmSampleAlloc", g.index, nv.nvmlGpmSampleAlloc)
                                     for _ in range(2)]
                    g.gpm_ptrs = [ctypes.cast(s, ctypes.c_void_p) for s in g.gpm_samples]
                    g.buf.set_gpm(tuple(mid for _, mid in GPM_METRICS))
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
    # --- the native thread ------------------------------------------------------------------------
    def _start_native(self) -> None:
        """A fresh C state for the GPUs not lost, and its thread (at start, and after a hang)."""
        lib, nv, b = self._lib, self.nv, self._b
        assert b is not None
        fns = (ctypes.c_void_p * len(native.NVML_FUNCTIONS))(
            *[ctypes.cast(f, ctypes.c_void_p).value if f is not None else None
              for f in (b.util, b.memory, b.power, b.temperature, b.clock, b.reasons, b.fields, b.gpm_sample_get,
                        b.gpm_metrics_get, b.event_wait)])
        permanent = (ctypes.c_int32 * len(PERMANENT))(*[getattr(nv, n) for n in sorted(PERMANENT)])
        ticks = max(4, math.ceil(BUFFER_S / self.sample_interval_s))
        state = lib.gp_nvml_new(fns, len(self.gpus), self._event_ptr if self._event_set is not None else None, ticks,
                                permanent, len(permanent), nv.NVML_ERROR_GPU_IS_LOST)
        if not state:
            raise SourceUnavailable("no memory for the NVML sampler's buffers")
        ids = (ctypes.c_uint32 * len(FIELDS))(*[fid for _, fid, _ in FIELDS])
        scopes = (ctypes.c_uint32 * len(FIELDS))(*[scope for _, _, scope in FIELDS])
        scales = (ctypes.c_double * len(FIELDS))(*[RATE_SCALE.get(col, 0.0) for col, _, _ in FIELDS])
        gpm_ids = (ctypes.c_uint32 * len(GPM_METRICS))(*[mid for _, mid in GPM_METRICS])
        every = (1 << len(NATIVE_METRICS)) - 1
        for i, g in enumerate(self.gpus):
            disabled = every if g.lost else sum(_METRIC_BIT.get(m, 0) for m in g.disabled)
            s0, s1 = (g.gpm_ptrs[0].value, g.gpm_ptrs[1].value) if g.gpm else (None, None)
            lib.gp_nvml_set_gpu(state, i, g.buf.handle.value, g.index, s0, s1, ids, scopes, scales, gpm_ids, disabled)
            if g.skip_until > time.monotonic():
                lib.gp_nvml_skip_gpu(state, i, int(g.skip_until * 1e9))
        caps = (ctypes.c_int32 * 4)()
        lib.gp_nvml_capacities(state, caps)
        self._caps = tuple(caps)
        self._state = state
        self._ticker = native.Ticker(lib, "gp_nvml_tick", state, self.sample_interval_s, "gp-nvml-tick")

    def drops(self) -> int:
        """Rows the native ticks could not keep because sample() did not drain them in time."""
        return self._dropped

    def _check_hang(self) -> None:
        """A call of the native thread running longer than call_timeout_s: record it, abandon that
        thread (it leaves when the call returns), back the GPU off and start a fresh thread for
        the others, as the Python watchdog does."""
        assert self._ctx is not None and self._state is not None and self._ticker is not None
        metric, gpu = ctypes.c_int32(), ctypes.c_int32()
        since = int(self._lib.gp_nvml_current_call(self._state, ctypes.byref(metric), ctypes.byref(gpu)))
        timeout_s = self._wd.timeout_s
        if not since or time.monotonic_ns() - since < timeout_s * 1e9:
            return
        call = NATIVE_METRICS[metric.value][1] if 0 <= metric.value < len(NATIVE_METRICS) else "NVML call"
        self._lib.gp_nvml_abandon(self._state)
        self._ticker.stop(0.0)  # detached: it is inside the call
        self._stuck.append((self._ticker, self._state))
        self._state = self._ticker = None
        self._back_off(NvmlTimeout(call, gpu.value, timeout_s))

    def _reap_stuck(self) -> None:
        """Free the abandoned threads' states once their call has returned; start a fresh thread
        when none runs and fewer than MAX_ABANDONED_THREADS are still stuck."""
        assert self._ctx is not None
        for ticker, state in list(self._stuck):
            if ticker.reap():
                self._stuck.remove((ticker, state))
                self._lib.gp_nvml_free(state)
        if self._state is None and not self._native_stopped:
            if len(self._stuck) < MAX_ABANDONED_THREADS:
                self._start_native()
            elif not self._stuck_reported:
                self._stuck_reported = True
                self._ctx.report_error(self.name, f"{len(self._stuck)} NVML calls are still stuck; not calling NVML")

    def _drain_native(self, state: int, acc: _Acc) -> None:
        """The rows the ticks of `state` left since the last drain; their failed calls classified
        (missing, lost, or an error) as the Python path does."""
        assert self._ctx is not None
        lib = self._lib
        ns, ng, ne, nerr = self._caps
        samples = np.empty(ns, native.NVML_SAMPLE_ROW_DTYPE)
        gpm = np.empty(ng, native.NVML_GPM_ROW_DTYPE)
        events = np.empty(ne, native.NVML_EVENT_ROW_DTYPE)
        errors = np.empty(nerr, native.NVML_ERROR_ROW_DTYPE)
        counts = np.zeros(6, np.uint64)
        lib.gp_nvml_drain(state, samples.ctypes.data, gpm.ctypes.data, events.ctypes.data, errors.ctypes.data,
                          counts.ctypes.data)
        self._dropped = max(self._dropped, int(counts[4]))
        by_index = {g.index: g for g in self.gpus}
        for t_ns, gi, m, code in errors[: int(counts[3])][["t_ns", "gpu", "metric", "code"]].tolist():
            metric, call = NATIVE_METRICS[m]
            name = code_name(self.nv, code)
            g = by_index.get(gi)
            if g is None:  # not of one GPU: the event set
                self._ctx.report_error(self.name, f"{call}: {name}")
            elif name == "NVML_ERROR_GPU_IS_LOST":
                if not g.lost:  # the tick stopped polling it and wrote its gpu_lost event
                    g.lost = True
                    self._ctx.report_error(self.name, f"GPU {g.index} ({g.uuid}) is lost (NVML_ERROR_GPU_IS_LOST); "
                                                      "no longer sampled")
            elif metric == "gpm_sample":  # any failure ends GPM on this GPU, as in _sample_gpm
                g.gpm = False
                for col, _ in GPM_METRICS:
                    self._missing(g, col, f"nvmlGpmSampleGet: {name}"[:96])
            else:
                self._nvml_name(g, metric, name)  # permanent -> missing, else an error row
                if name in PERMANENT and metric == "util_gpu":
                    self._missing(g, "util_mem", f"{name} (with util_gpu)")
                elif name in PERMANENT and metric == "field_values":
                    for col, _, _ in FIELDS:
                        self._missing(g, col, "nvmlDeviceGetFieldValues not supported")
        s = samples[: int(counts[0])]
        if len(s):
            rows = np.empty(len(s), _DTYPES[schema.GPU_SAMPLES.path])
            rows["t_ns"], rows["gpu"] = s["t_ns"], s["gpu"]
            for k, col in enumerate(SAMPLE_COLS):
                rows[col] = s["v"][:, k]
            acc.arrays.append((schema.GPU_SAMPLES, rows))
            mono = time.monotonic()
            for gi in np.unique(s["gpu"]).tolist():
                g = by_index[gi]
                if g.backoff_s and g.skip_until <= mono:
                    g.backoff_s = 0.0  # sampled again after its back-off
        p = gpm[: int(counts[1])]
        if len(p):
            rows = np.empty(len(p), _DTYPES[schema.GPU_GPM.path])
            rows["t_ns"], rows["gpu"], rows["interval_ns"] = p["t_ns"], p["gpu"], p["interval_ns"]
            for k, (col, _) in enumerate(GPM_METRICS):
                rows[col] = p["v"][:, k]
            acc.arrays.append((schema.GPU_GPM, rows))
        e = events[: int(counts[2])]
        if len(e):
            rows = np.empty(len(e), _DTYPES[schema.GPU_EVENTS.path])
            rows["t_ns"], rows["gpu"], rows["kind"], rows["value"] = e["t_ns"], e["gpu"], e["kind"], e["value"]
            acc.arrays.append((schema.GPU_EVENTS, rows))

    def _native_sample(self, now_ns: int, acc: _Acc) -> None:
        if self._state is not None:
            state = self._state
            self._check_hang()
            self._drain_native(state, acc)  # the old state's rows too, when it was just abandoned
        self._reap_stuck()
        mono = time.monotonic()
        if mono >= self._next_proc_t:
            self._next_proc_t = mono + self.process_interval_s
            active = [g for g in self.gpus if not g.lost and g.skip_until <= mono and "processes" not in g.disabled]
            def query(gen: int) -> None:
                for g in active:
                    acc.procs.extend(self._sample_procs(gen, g, now_ns))

            try:
                self._wd.run(query)
            except NvmlTimeout as e:
                self._back_off(e)

    def _stop_native(self) -> bool:
        """Stop the thread for good and free its state; False when it is stuck in a call."""
        self._native_stopped = True
        if self._ticker is None or self._state is None:
            return True
        ticker, state = self._ticker, self._state
        self._ticker = self._state = None
        if not ticker.stop(max(1.0, self._wd.timeout_s)):
            self._stuck.append((ticker, state))
            return False
        acc = _Acc()
        self._drain_native(state, acc)
        self._final_arrays = acc.arrays
        self._lib.gp_nvml_free(state)
        return True

    def sample(self, now_ns: int) -> Iterable[Batch]:
        out: list[Batch] = []
        if not self._devices_emitted:
            self._devices_emitted = True
            dev = schema.GPU_DEVICES.empty(len(self.gpus))
            for k, g in enumerate(self.gpus):
                dev[k] = (g.index, g.uuid.encode()[:64], g.name.encode()[:64], g.pci_bus_id.encode()[:32], g.arch,
                          g.mem_total, int(g.gpm))
            out.append((schema.GPU_DEVICES, dev))
        acc = _Acc()
        if self.sampler == "native thread":
            self._native_sample(now_ns, acc)
        else:
            mono = time.monotonic()
            active = [g for g in self.gpus if not g.lost and g.skip_until <= mono]
            do_procs = mono >= self._next_proc_t
            if do_procs:
                self._next_proc_t = mono + self.process_interval_s
            try:
                self._wd.run(lambda gen: self._tick(gen, now_ns, active, do_procs, acc))
            except NvmlTimeout as e:
                self._back_off(e)
        for t, rows in ((schema.GPU_SAMPLES, acc.samples), (schema.GPU_GPM, acc.gpm),
                        (schema.GPU_PROCESSES, acc.procs), (schema.GPU_EVENTS, acc.events)):
            if rows:
                out.append((t, np.array(rows, dtype=_DTYPES[t.path])))
        out.extend(acc.arrays)
        return out

    def _back_off(self, e: NvmlTimeout) -> None:
        """A call on e.gpu hung: skip that GPU for a growing while (the others go on)."""
        assert self._ctx is not None
        hung = next((x for x in self.gpus if x.index == e.gpu), None)
        if hung is None:
            self._ctx.report_error(self.name, f"timeout: {e}")
            return
        hung.backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_START_S, hung.backoff_s * 2))
        hung.skip_until = time.monotonic() + hung.backoff_s
        if self._state is not None:  # the native thread skips it as well
            self._lib.gp_nvml_skip_gpu(self._state, self.gpus.index(hung), int(hung.skip_until * 1e9))
        self._ctx.report_error(self.name, f"timeout: {e}; GPU {hung.index} skipped for {hung.backoff_s:g} s")

    def final(self, now_ns: int) -> Iterable[Batch]:
        """Native: the thread stopped, then what its ticks left; else one more sample."""
        if self.sampler != "native thread":
            return self.sample(now_ns)
        self._stop_native()
        out = list(self.sample(now_ns))
        out.extend(self._final_arrays)
        self._final_arrays = []
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
        """One GPU_SAMPLES row through the pre-bound calls (collector/sources/nvml_direct.py)."""
        B, b, d, direct = self._b, g.buf, g.disabled, self._direct
        assert B is not None
        h = b.handle
        self._wd.gpu = g.index
        v = [now_ns, g.index, *_NAN_ROW]
        if "util_gpu" not in d:
            if direct(gen, g, "util_gpu", "nvmlDeviceGetUtilizationRates", B.util, h, b.util_ref):
                u = b.util
                v[2], v[3] = u.gpu, u.memory  # util_gpu, util_mem
            elif "util_gpu" in d:
                self._missing(g, "util_mem", "NVML_ERROR_NOT_SUPPORTED (with util_gpu)")
        if "mem_used_bytes" not in d and direct(gen, g, "mem_used_bytes", "nvmlDeviceGetMemoryInfo", B.memory, h,
                                                b.memory_ref):
            v[4] = b.memory.used
        if "power_w" not in d and direct(gen, g, "power_w", "nvmlDeviceGetPowerUsage", B.power, h, b.power_ref):
            v[5] = b.power.value / 1000.0  # NVML: milliwatts
        if "temp_c" not in d and direct(gen, g, "temp_c", "nvmlDeviceGetTemperature", B.temperature, h,
                                        NVML_TEMPERATURE_GPU, b.temp_ref):
            v[6] = b.temp.value
        if "sm_clock_mhz" not in d and direct(gen, g, "sm_clock_mhz", "nvmlDeviceGetClockInfo", B.clock, h,
                                              NVML_CLOCK_SM, b.clock_sm_ref):
            v[7] = b.clock_sm.value
        if "mem_clock_mhz" not in d and direct(gen, g, "mem_clock_mhz", "nvmlDeviceGetClockInfo", B.clock, h,
                                               NVML_CLOCK_MEM, b.clock_mem_ref):
            v[8] = b.clock_mem.value
        if "throttle_reasons" not in d and direct(gen, g, "throttle_reasons", "nvmlDeviceGetCurrentClocksEventReasons",
                                                  B.reasons, h, b.reasons_ref):
            v[_COL["throttle_reasons"]] = float(b.reasons.value)
        wanted = [f for f in FIELDS if f[0] not in d]
        if wanted:
            if "field_values" in d:
                for col, _, _ in wanted:
                    self._missing(g, col, "nvmlDeviceGetFieldValues not supported")
                return tuple(v)
            ids = [(fid, scope) for _, fid, scope in wanted]
            if b.fields_ids != tuple(ids):
                b.set_fields(ids)
            if direct(gen, g, "field_values", "nvmlDeviceGetFieldValues", B.fields, h, b.fields_n, b.fields_ptr):
                prev_counters = g.prev_counters
                for (col, _fid, _scope), (ret, vtype, raw) in zip(wanted, b.read_fields()):
                    if ret != 0:
                        self._nvml_code(g, col, ret)
                        continue
                    val = nvml_direct.field_value(vtype, raw)
                    scale = RATE_SCALE.get(col)
                    if scale is not None:
                        prev = prev_counters.get(col)
                        prev_counters[col] = (val, now_ns)
                        if prev is not None and now_ns > prev[1] and val >= prev[0]:
                            v[_COL[col]] = (val - prev[0]) * scale / 1000.0 / ((now_ns - prev[1]) / 1e9)
                    else:
                        v[_COL[col]] = val
            elif "field_values" in d:
                for col, _, _ in wanted:
                    self._missing(g, col, "nvmlDeviceGetFieldValues not supported")
        return tuple(v)

    def _sample_gpm(self, gen: int, g: _Gpu, now_ns: int) -> tuple[Any, ...] | None:
        B, wd = self._b, self._wd
        assert B is not None
        k = 1 if g.gpm_prev == 0 else 0
        if gen != wd.gen:
            raise _Abandoned()
        wd.call = "nvmlGpmSampleGet"
        r = B.gpm_sample_get(g.buf.handle, g.gpm_ptrs[k])
        wd.progress += 1
        if r:
            name = code_name(self.nv, r)
            if name == "NVML_ERROR_GPU_IS_LOST":
                raise _GpuLost()
            g.gpm = False
            for col, _ in GPM_METRICS:
                self._missing(g, col, f"nvmlGpmSampleGet: {name}"[:96])
            return None
        prev, prev_t = g.gpm_prev, g.gpm_prev_t
        g.gpm_prev, g.gpm_prev_t = k, now_ns
        if prev < 0:
            return None  # GPM metrics need two samples
        mg = g.buf.gpm_get
        mg.sample1, mg.sample2 = g.gpm_ptrs[prev].value, g.gpm_ptrs[k].value
        if not self._direct(gen, g, "gpm", "nvmlGpmMetricsGet", B.gpm_metrics_get, g.buf.gpm_get_ptr):
            return None
        vals: list[float] = []
        metrics = mg.metrics
        for j, (col, _) in enumerate(GPM_METRICS):
            m = metrics[j]
            if m.nvmlReturn != 0:
                self._nvml_code(g, col, m.nvmlReturn)
                vals.append(math.nan)
            else:
                vals.append(m.value)
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
        nv, B, wd = self.nv, self._b, self._wd
        assert B is not None
        rows = []
        ev = self._event_data
        wd.gpu = -1
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            if gen != wd.gen:
                raise _Abandoned()
            wd.call = "nvmlEventSetWait"
            r = B.event_wait(self._event_ptr, self._event_ref, 0)
            wd.progress += 1
            if r:
                name = code_name(nv, r)
                if name != "NVML_ERROR_TIMEOUT":
                    assert self._ctx is not None
                    self._ctx.report_error(self.name, f"nvmlEventSetWait: {name}")
                break
            idx = self._handle_index.get(ev.device or 0, -1)
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
        if not self._stop_native() or self._stuck:
            # a native call is still stuck and may use the GPM samples or the event set: leave them
            for g in self.gpus:
                g.gpm_samples = []
            self._event_set = None

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
        if schema.GPU_SAMPLES.path in f:
            f[schema.GPU_SAMPLES.path].attrs["sampler"] = self.sampler
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
    arrays: list[Batch] = field(default_factory=list)  # rows already as table arrays (native path)
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
