"""Pre-bound ctypes entry points of libnvidia-ml for the NVML source's per-sample path.

Why: pynvml's wrappers look the function up in a dict, build a fresh ctypes structure or c_uint,
call, check and return, every time; at 10 Hz over 8 GPUs (~80 calls a tick) that Python work was
most of the source's cost. Here each hot function is resolved once from the library pynvml loaded
(so GPUPROF_NVML_LIBRARY and pynvml's own search still decide which library: the test double
works unchanged), with argtypes/restype set once on our own function objects (pynvml's cached
ones are left untouched), and each GPU gets its output buffers and their byref() arguments
allocated once. A call is then one foreign call returning an int nvmlReturn_t.

Only the per-sample calls are here; set-up, per-process queries (1 Hz) and shutdown go through
pynvml. Struct layouts are pynvml's (nvml.h, x86_64 and aarch64 alike).
"""

from __future__ import annotations

import ctypes
import struct
from ctypes import POINTER, Structure, byref, c_char_p, c_double, c_int, c_uint, c_ulonglong, c_void_p
from typing import Any

# nvmlFieldValue_t: fieldId u32, scopeId u32, timestamp i64, latencyUsec i64, valueType i32,
# nvmlReturn i32, value (8-byte union); read back in one unpack per call.
_FV = struct.Struct("<IIqqiiQ")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


# Plain ctypes structures with nvml.h's layouts. pynvml's own classes override __getattribute__ in
# Python (for printing), which made every field read cost about a microsecond.
class Utilization(Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class Memory(Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class FieldValue(Structure):
    _fields_ = [("fieldId", c_uint), ("scopeId", c_uint), ("timestamp", ctypes.c_int64),
                ("latencyUsec", ctypes.c_int64), ("valueType", c_int), ("nvmlReturn", c_int), ("value", c_ulonglong)]


class GpmMetric(Structure):
    _fields_ = [("metricId", c_uint), ("nvmlReturn", c_int), ("value", c_double),
                ("shortName", c_char_p), ("longName", c_char_p), ("unit", c_char_p)]


NVML_GPM_METRIC_MAX = 477  # size of nvmlGpmMetricsGet_t.metrics in nvml.h
NVML_GPM_METRICS_GET_VERSION = 1


class GpmMetricsGet(Structure):
    _fields_ = [("version", c_uint), ("numMetrics", c_uint), ("sample1", c_void_p), ("sample2", c_void_p),
                ("metrics", GpmMetric * NVML_GPM_METRIC_MAX)]


class EventData(Structure):
    _fields_ = [("device", c_void_p), ("eventType", c_ulonglong), ("eventData", c_ulonglong),
                ("gpuInstanceId", c_uint), ("computeInstanceId", c_uint)]


class Bindings:
    """The hot NVML functions of one loaded library, typed once."""

    def __init__(self, nv: Any) -> None:
        lib = nv.nvmlLib
        if lib is None:
            raise RuntimeError("NVML library not loaded")
        self.nv = nv

        def bind(name: str, *argtypes: Any) -> Any:
            f = lib[name]  # a new function object each time: pynvml's cached one keeps its settings
            f.restype = c_int
            f.argtypes = argtypes
            return f

        h = c_void_p
        self.util = bind("nvmlDeviceGetUtilizationRates", h, POINTER(Utilization))
        self.memory = bind("nvmlDeviceGetMemoryInfo", h, POINTER(Memory))
        self.power = bind("nvmlDeviceGetPowerUsage", h, POINTER(c_uint))
        self.temperature = bind("nvmlDeviceGetTemperature", h, c_int, POINTER(c_uint))
        self.clock = bind("nvmlDeviceGetClockInfo", h, c_int, POINTER(c_uint))
        # the newer name first; drivers before 535 have only the older one (same signature)
        self.reasons = (_optional(bind, "nvmlDeviceGetCurrentClocksEventReasons", h, POINTER(c_ulonglong))
                        or _optional(bind, "nvmlDeviceGetCurrentClocksThrottleReasons", h, POINTER(c_ulonglong)))
        self.fields = bind("nvmlDeviceGetFieldValues", h, c_int, c_void_p)
        self.gpm_sample_get = _optional(bind, "nvmlGpmSampleGet", h, c_void_p)
        self.gpm_metrics_get = _optional(bind, "nvmlGpmMetricsGet", c_void_p)
        self.event_wait = _optional(bind, "nvmlEventSetWait_v2", c_void_p, POINTER(EventData), c_uint)


def _optional(bind: Any, name: str, *argtypes: Any) -> Any:
    """None when the library lacks the symbol (an old driver): the caller reports it as missing."""
    try:
        return bind(name, *argtypes)
    except AttributeError:
        return None


class DeviceBuffers:
    """One GPU's output buffers and their byref() arguments, allocated once."""

    __slots__ = ("clock_mem", "clock_mem_ref", "clock_sm", "clock_sm_ref", "fields", "fields_ids", "fields_n",
                 "fields_ptr", "gpm_get", "gpm_get_ptr", "handle", "memory", "memory_ref", "power", "power_ref",
                 "reasons", "reasons_ref", "temp", "temp_ref", "util", "util_ref")

    def __init__(self, nv: Any, handle: Any) -> None:
        self.handle = c_void_p(ctypes.cast(handle, c_void_p).value)
        self.util = Utilization()
        self.util_ref = byref(self.util)
        self.memory = Memory()
        self.memory_ref = byref(self.memory)
        self.power = c_uint()
        self.power_ref = byref(self.power)
        self.temp = c_uint()
        self.temp_ref = byref(self.temp)
        self.clock_sm = c_uint()
        self.clock_sm_ref = byref(self.clock_sm)
        self.clock_mem = c_uint()
        self.clock_mem_ref = byref(self.clock_mem)
        self.reasons = c_ulonglong()
        self.reasons_ref = byref(self.reasons)
        self.fields: Any = None
        self.fields_ptr: Any = None
        self.fields_n = 0
        self.fields_ids: tuple[tuple[int, int], ...] = ()
        self.gpm_get: Any = None
        self.gpm_get_ptr: Any = None

    def set_fields(self, ids: list[tuple[int, int]]) -> None:
        """The (field id, scope) list read in one nvmlDeviceGetFieldValues call."""
        self.fields_ids = tuple(ids)
        self.fields_n = len(ids)
        self.fields = (FieldValue * max(1, len(ids)))()
        for k, (fid, scope) in enumerate(ids):
            self.fields[k].fieldId = fid
            self.fields[k].scopeId = scope
        self.fields_ptr = ctypes.cast(self.fields, c_void_p)

    def read_fields(self) -> list[tuple[int, int, int]]:
        """(nvmlReturn, valueType, raw 8 value bytes as u64) per field of the last call."""
        buf = self.fields
        out = []
        for k in range(self.fields_n):
            _fid, _scope, _ts, _lat, vtype, ret, raw = _FV.unpack_from(buf, k * _FV.size)
            out.append((ret, vtype, raw))
        return out

    def set_gpm(self, metric_ids: tuple[int, ...]) -> None:
        mg = GpmMetricsGet()
        mg.version = NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(metric_ids)
        for k, mid in enumerate(metric_ids):
            mg.metrics[k].metricId = mid
        self.gpm_get = mg
        self.gpm_get_ptr = ctypes.cast(byref(mg), c_void_p)


def field_value(vtype: int, raw: int) -> float:
    """The value of an nvmlValue_t union read as 8 raw bytes (little-endian), by NVML_VALUE_TYPE_*:
    0 double, 1 uint, 2 ulong, 3 ulonglong, 4 slonglong, 5 sint, 6 ushort."""
    if vtype == 3 or vtype == 2:
        return float(raw)
    if vtype == 1:
        return float(raw & 0xFFFFFFFF)
    if vtype == 0:
        return _F64.unpack(_U64.pack(raw))[0]
    if vtype == 4:
        return float(raw - (1 << 64) if raw >= 1 << 63 else raw)
    if vtype == 5:
        v = raw & 0xFFFFFFFF
        return float(v - (1 << 32) if v >= 1 << 31 else v)
    if vtype == 6:
        return float(raw & 0xFFFF)
    return float(raw)


assert ctypes.sizeof(FieldValue) == _FV.size
