"""Node trace format v1: the one place where tables, columns, units and root attributes are defined.

The writer creates exactly these tables, the reader checks them, docs/trace-format.md describes
them, and mpi_merge/ reads them through gpuprof.collector.reader. Every table is a 1-D chunked, compressed
HDF5 dataset of a compound type, one row per record, at /<group>/<table>. Times are CLOCK_MONOTONIC
nanoseconds of the node (column names ending in `_ns`); /clock/pairs maps them to the node's
CLOCK_REALTIME. A metric that could not be read is NaN in its column and the reason is a row in
/diagnostics/missing: never a zero.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SCHEMA_NAME = "slurm-gpuprof.node"
SCHEMA_VERSION = 1

# /stacks/samples' gil column (bpf/pyframes.h GP_PY_GIL_*)
GIL_UNKNOWN, GIL_HELD, GIL_NOT_HELD = 0, 1, 2

# Root attributes every node file carries (name -> meaning). Those marked at seal are absent from a
# file whose collector died; the reader reports such a file as partial.
ROOT_ATTRS: dict[str, str] = {
    "schema": "always 'slurm-gpuprof.node'",
    "schema_version": "integer; readers reject a newer major version",
    "job_id": "Slurm job id (string; array jobs as '<array>_<task>')",
    "node": "Slurm node name (SLURMD_NODENAME)",
    "hostname": "the host's name (several virtual nodes may share one host)",
    "boot_id": "/proc/sys/kernel/random/boot_id: monotonic times compare only within one boot",
    "collector_version": "version of slurm-gpuprof that wrote the file",
    "modes": "comma list of the job's --profile-gpu modes",
    "rates_json": "JSON object: source -> sampling rate in Hz",
    "config_json": "JSON of the effective collector configuration",
    "start_monotonic_ns": "collector start, CLOCK_MONOTONIC ns",
    "start_realtime_ns": "collector start, CLOCK_REALTIME ns since the epoch",
    "job_nodelist": "the job's nodes as a Slurm hostlist ('' when not run for a Slurm job)",
    "synthetic": "true only for files written by the synthetic generator (gpuprof.mpi_merge.synthetic)",
    "sealed": "(at seal) true once the final flush completed",
    "end_monotonic_ns": "(at seal) collector end, CLOCK_MONOTONIC ns",
    "end_realtime_ns": "(at seal) collector end, CLOCK_REALTIME ns",
    "drops_json": "(at seal) JSON object: source -> records dropped because the writer fell behind",
    "attach_json": "(at seal) JSON object: source -> {state, attached_ns, probe, late, first_process_ns, "
                   "late_by_s, pids_before, may_have_missed, late_libraries}: when each source was in place "
                   "and what a late probe cannot have seen (see 'Late probes' below)",
    "collector_cpu_json": "(at seal) JSON object: `total_s` (the collector's CPU seconds, every thread, from its "
                          "start in the prolog to the seal), `startup_s` (until no source was starting: imports, "
                          "the BPF compile, the attaches; null when a source never finished starting), "
                          "`after_startup_s` (the rest: what recording the job cost this node), `by_thread_s` (per "
                          "thread, by the names of docs/collector.md, \"Inside\"; the threads that end before the "
                          "seal, the sources' and the native ticks, as they were when the sources were told to stop), "
                          "`catch_up` (the collector's lowered priority lifted while it fell behind, "
                          "collector/catchup.py: `nice`, `active` (false where there was nothing to lift: nice 0, not "
                          "a session leader, or the lift refused, then `problem`), `lifts`, `lifted_s`)",
    "late_sources": "(at seal) JSON list of the sources that attached after the job's first process, or "
                    "probed a library only after job processes had mapped it",
    "fastpath_json": "(at seal, mode collectives with the fast path) JSON object: ring directory, rings "
                     "read, rings refused and processes that could not create one, with the first reasons",
    "unwind_json": "(at seal, mode stacks) JSON object: the user-stack unwinder (cfi or frame_pointers) and, for "
                   "cfi, its status: processes and tables registered, compiles, walks and how they ended",
}


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # numpy dtype string
    unit: str  # '' for identifiers and enums
    doc: str
    # a column added after files without it were written: such a file's table reads it as this
    # value, whose meaning its doc gives ("not known"); None: every file has the column
    absent_reads_as: int | None = None


@dataclass(frozen=True)
class Table:
    group: str
    name: str
    doc: str
    columns: tuple[Column, ...]
    # enum columns: column name -> list of names (stored as a dataset attribute "<col>_names")
    enums: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"/{self.group}/{self.name}"

    @functools.cached_property
    def dtype(self) -> np.dtype:
        # once: every drain and append asks for it (cached_property writes the instance's
        # __dict__ directly, which a frozen dataclass allows)
        return np.dtype([(c.name, c.dtype) for c in self.columns])

    def empty(self, n: int = 0) -> np.ndarray:
        return np.zeros(n, dtype=self.dtype)


def sort_rows(rows: np.ndarray, *fields: str) -> np.ndarray:
    """rows sorted by fields (the first the major key), stably: np.sort(rows, order=fields)
    compares whole structured rows, about ten times a lexsort of the fields' columns (a drain of
    the stacks source, 155 rows: 136 us against 14)."""
    return rows[np.lexsort(tuple(rows[f] for f in reversed(fields)))]


def concat_rows(parts: Sequence[np.ndarray]) -> np.ndarray:
    """np.concatenate of table rows, as bytes when every part has the same structured dtype: numpy
    concatenates structured arrays field by field, about 20 times a byte copy (two halves of a 4 s
    flush of hpcc's calls, 26 000 rows each: 4.4 ms against 0.22). The writer and the fast path
    concatenate every call row at least once."""
    if len(parts) == 1:
        return parts[0]
    dt = parts[0].dtype
    if dt.names is None or any(part.dtype != dt for part in parts):
        return np.concatenate(parts)
    return np.concatenate([np.ascontiguousarray(part).view(np.uint8) for part in parts]).view(dt)


def C(name: str, dtype: str, unit: str, doc: str, absent_reads_as: int | None = None) -> Column:
    return Column(name, dtype, unit, doc, absent_reads_as)


T_NS = C("t_ns", "<u8", "ns", "CLOCK_MONOTONIC time of the sample")

# --- clock -------------------------------------------------------------------------------------
CLOCK_PAIRS = Table(
    "clock",
    "pairs",
    "(monotonic, realtime) pairs at start, every clock_interval_s and at seal",
    (
        C("monotonic_ns", "<u8", "ns", "CLOCK_MONOTONIC"),
        C("realtime_ns", "<i8", "ns", "CLOCK_REALTIME, since the epoch"),
        C("uncertainty_ns", "<u4", "ns", "half the time between the two clock reads"),
    ),
)

# --- diagnostics -------------------------------------------------------------------------------
DIAG_ERRORS = Table(
    "diagnostics",
    "errors",
    "errors of sources and of the writer, in order; a source that failed says why here",
    (T_NS, C("source", "S32", "", "source name"), C("message", "S240", "", "what went wrong")),
)
DIAG_MISSING = Table(
    "diagnostics",
    "missing",
    "metrics a device or process does not provide (their columns hold NaN), with the reason",
    (
        T_NS,
        C("source", "S32", "", "source name"),
        C("device", "<i4", "", "GPU index, or -1 for the node"),
        C("metric", "S32", "", "column name"),
        C("reason", "S96", "", "e.g. NVML_ERROR_NOT_SUPPORTED"),
    ),
)
DIAG_DROPS = Table(
    "diagnostics",
    "drops",
    "running total of records dropped per source (oldest first) because the writer fell behind",
    (T_NS, C("source", "S32", "", "source name"), C("dropped_total", "<u8", "records", "since start")),
)

# --- processes ----------------------------------------------------------------------------------
PROCESS_EVENTS = Table(
    "processes",
    "events",
    "the job's processes as the collector saw them appear and go",
    (
        T_NS,
        C("pid", "<u4", "", "process id"),
        C("ppid", "<u4", "", "parent process id"),
        C("event", "u1", "", "0 = appeared, 1 = gone"),
        C("comm", "S16", "", "/proc/PID/comm"),
        C("cmdline", "S128", "", "start of /proc/PID/cmdline, NULs as spaces"),
    ),
    enums={"event": ("appeared", "gone")},
)

# --- host ---------------------------------------------------------------------------------------
HOST_NODE = Table(
    "host",
    "node",
    "node-wide CPU, memory and network",
    (
        T_NS,
        C("cpu_busy", "<f4", "fraction", "all CPUs, busy time / elapsed between the last two reads of /proc/stat "
          "(the native tick reads it once a second, the rows between repeat it)"),
        C("cpu_iowait", "<f4", "fraction", "iowait share over the same interval"),
        C("mem_used_bytes", "<u8", "bytes", "MemTotal - MemAvailable; this and the columns after it are read once a second, repeated between"),
        C("mem_total_bytes", "<u8", "bytes", "MemTotal"),
        C("net_rx_bytes", "<u8", "bytes", "sum over non-loopback interfaces, cumulative"),
        C("net_tx_bytes", "<u8", "bytes", "sum over non-loopback interfaces, cumulative"),
        C("load1", "<f4", "", "1-minute load average"),
    ),
)
HOST_PROCS = Table(
    "host",
    "procs",
    "per job process counters (cumulative; differentiate to get rates)",
    (
        T_NS,
        C("pid", "<u4", "", "process id"),
        C("cpu_time_ns", "<u8", "ns", "user + system CPU time (the native reader: the threads' run times at every "
          "tick, brought up to /proc/PID/stat's at each full read)"),
        C("rss_bytes", "<u8", "bytes", "resident set size (the native reader: at its full reads, once a second)"),
        C("num_threads", "<u4", "", "threads (the native reader: at its full reads)"),
        C("voluntary_ctxsw", "<u8", "", "voluntary context switches, all threads (the native reader: at its full "
          "reads)"),
        C("involuntary_ctxsw", "<u8", "", "involuntary context switches, all threads (the native reader: at its full "
          "reads)"),
        C("read_bytes", "<u8", "bytes", "/proc/PID/io read_bytes (NaN-free: 0 only if the kernel says 0; the "
          "native reader: at its full reads)"),
        C("write_bytes", "<u8", "bytes", "/proc/PID/io write_bytes (the native reader: at its full reads)"),
    ),
)

# --- GPU (NVML) ---------------------------------------------------------------------------------
GPU_DEVICES = Table(
    "gpu",
    "devices",
    "the GPUs this collector watches (one row each, written at start)",
    (
        C("index", "<i4", "", "NVML index"),
        C("uuid", "S64", "", "GPU UUID"),
        C("name", "S64", "", "product name"),
        C("pci_bus_id", "S32", "", "PCI bus id"),
        C("architecture", "<i4", "", "NVML architecture enum (9 = Hopper)"),
        C("memory_total_bytes", "<u8", "bytes", "framebuffer size"),
        C("gpm_supported", "u1", "", "1 if GPM metrics are sampled"),
    ),
)
GPU_SAMPLES = Table(
    "gpu",
    "samples",
    "per GPU device metrics; NaN = not available (reason in /diagnostics/missing)",
    (
        T_NS,
        C("gpu", "<i4", "", "NVML index"),
        C("util_gpu", "<f4", "percent", "nvmlDeviceGetUtilizationRates.gpu"),
        C("util_mem", "<f4", "percent", "nvmlDeviceGetUtilizationRates.memory"),
        C("mem_used_bytes", "<f8", "bytes", "framebuffer used"),
        C("power_w", "<f4", "W", "power usage"),
        C("temp_c", "<f4", "degC", "GPU temperature"),
        C("sm_clock_mhz", "<f4", "MHz", "SM clock"),
        C("mem_clock_mhz", "<f4", "MHz", "memory clock"),
        C("pcie_tx_kbps", "<f4", "KB/s", "PCIe TX throughput"),
        C("pcie_rx_kbps", "<f4", "KB/s", "PCIe RX throughput"),
        C("nvlink_tx_kbps", "<f4", "KB/s", "NVLink TX, all links (rate from counters)"),
        C("nvlink_rx_kbps", "<f4", "KB/s", "NVLink RX, all links (rate from counters)"),
        C("throttle_reasons", "<f8", "bitmask", "nvmlDeviceGetCurrentClocksThrottleReasons (NaN if n/a)"),
        C("ecc_sbe_total", "<f8", "count", "corrected ECC errors, volatile"),
        C("ecc_dbe_total", "<f8", "count", "uncorrected ECC errors, volatile"),
    ),
)
GPU_GPM = Table(
    "gpu",
    "gpm",
    "GPM metrics (Hopper and newer), each over the interval between two GPM samples",
    (
        T_NS,
        C("gpu", "<i4", "", "NVML index"),
        C("interval_ns", "<u8", "ns", "interval the values cover"),
        C("sm_activity", "<f4", "percent", "NVML_GPM_METRIC_SM_UTIL... SM activity"),
        C("sm_occupancy", "<f4", "percent", "SM occupancy"),
        C("tensor_activity", "<f4", "percent", "any tensor pipe active"),
        C("dram_bw_util", "<f4", "percent", "DRAM bandwidth utilization"),
    ),
)
GPU_PROCESSES = Table(
    "gpu",
    "processes",
    "per job process GPU use",
    (
        T_NS,
        C("gpu", "<i4", "", "NVML index"),
        C("pid", "<u4", "", "process id"),
        C("sm_util", "<f4", "percent", "process SM utilization (NaN if n/a)"),
        C("mem_util", "<f4", "percent", "process memory utilization (NaN if n/a)"),
        C("used_memory_bytes", "<f8", "bytes", "GPU memory used by the process"),
    ),
)
GPU_EVENTS = Table(
    "gpu",
    "events",
    "NVML events: XIDs, ECC errors, lost GPUs",
    (
        T_NS,
        C("gpu", "<i4", "", "NVML index"),
        C("kind", "u1", "", "event kind"),
        C("value", "<u8", "", "XID number or error count"),
    ),
    enums={"kind": ("xid", "ecc_single_bit", "ecc_double_bit", "gpu_lost", "clock_change")},
)

# --- collectives (eBPF uprobes or the user-space fast path) -------------------------------------
COLLECTIVE_OPS: tuple[str, ...] = (
    # MPI collectives (blocking)
    "MPI_Allreduce", "MPI_Reduce", "MPI_Bcast", "MPI_Barrier", "MPI_Allgather", "MPI_Allgatherv",
    "MPI_Alltoall", "MPI_Alltoallv", "MPI_Reduce_scatter", "MPI_Reduce_scatter_block", "MPI_Gather",
    "MPI_Gatherv", "MPI_Scatter", "MPI_Scatterv", "MPI_Scan",
    # MPI non-blocking collectives (their completion is a row with op MPI_Wait/MPI_Test*)
    "MPI_Iallreduce", "MPI_Ireduce", "MPI_Ibcast", "MPI_Ibarrier", "MPI_Iallgather", "MPI_Ialltoall",
    "MPI_Ireduce_scatter", "MPI_Igather", "MPI_Iscatter", "MPI_Iscan",
    # MPI point to point and completions
    "MPI_Send", "MPI_Recv", "MPI_Isend", "MPI_Irecv", "MPI_Sendrecv", "MPI_Wait", "MPI_Waitall",
    "MPI_Test", "MPI_Testall",
    # NCCL
    "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclReduce", "ncclSend",
    "ncclRecv", "ncclGroupStart", "ncclGroupEnd",
    # MPI completions of some of many requests (fast path only; appended: the numbers above are the
    # file format's); one row per completed request, like MPI_Waitall's
    "MPI_Waitany", "MPI_Waitsome", "MPI_Testany", "MPI_Testsome",
    # NCCL operations that only the profiler plugin sees (NCCL 2.28+ AlltoAll, Gather, Scatter)
    "ncclAlltoAll", "ncclGather", "ncclScatter",
)
COMMUNICATOR_OPS: tuple[str, ...] = (
    "MPI_Init", "MPI_Comm_split", "MPI_Comm_dup", "MPI_Comm_create", "MPI_Comm_free",
    "ncclCommInitRank", "ncclCommInitAll", "ncclCommInitRankConfig", "ncclCommSplit",
    "ncclCommDestroy", "ncclCommAbort",
)

COLLECTIVE_CALLS = Table(
    "collectives",
    "calls",
    "one row per collective or point-to-point call of a job process",
    (
        C("t_enter_ns", "<u8", "ns", "CLOCK_MONOTONIC at function entry"),
        C("t_exit_ns", "<u8", "ns", "CLOCK_MONOTONIC at return"),
        C("pid", "<u4", "", "process id"),
        C("tid", "<u4", "", "thread id"),
        C("library", "u1", "", "which library"),
        C("op", "u1", "", "index into op_names"),
        C("comm_id", "<u8", "", "job-wide communicator id, identical on every rank of it"),
        C("seq", "<u8", "", "0-based sequence number of this collective on comm_id (per rank)"),
        C("comm_rank", "<i4", "", "caller's rank in the communicator"),
        C("comm_size", "<i4", "", "communicator size"),
        C("bytes", "<u8", "bytes", "count x datatype size (send side)"),
        C("root_or_peer", "<i4", "", "root of rooted collectives, peer of point to point, else -1"),
        C("tag", "<i4", "", "MPI tag of point to point, else -1"),
        C("ret", "<i4", "", "return code of the call"),
        C("path", "u1", "", "how it was captured"),
        C("handle", "<u8", "", "communicator handle in the process (pointer or MPI_Comm value)"),
    ),
    # nccl_profiler: recorded by NCCL's profiler plugin interface (bpf/fastpath/); t_enter/t_exit are
    # then the host times of the plugin's event start and stop (enqueue), its device-side times are
    # in /collectives/device_times
    enums={"library": ("mpi", "nccl"), "op": COLLECTIVE_OPS, "path": ("uprobe", "fastpath", "nccl_profiler")},
)
# NCCL runs a collective on the GPU after the call returned: the device-side times are what the
# merge aligns and judges NCCL on (docs/merge.md, "NCCL on device times"). Joined to
# /collectives/calls rows of path nccl_profiler on (pid, comm_id, seq, op, root_or_peer).
DEVICE_TIMES = Table(
    "collectives",
    "device_times",
    "device-side start and end of NCCL collectives and point to point recorded by the profiler plugin",
    (
        C("pid", "<u4", "", "process id"),
        C("comm_id", "<u8", "", "job-wide communicator id (as in /collectives/calls)"),
        C("seq", "<u8", "", "sequence number on comm_id (as in /collectives/calls)"),
        C("t_dev_start_ns", "<u8", "ns", "device-side start mapped to CLOCK_MONOTONIC, 0 = not known"),
        C("t_dev_end_ns", "<u8", "ns", "device-side end mapped to CLOCK_MONOTONIC, 0 = not known"),
        C("timing", "u1", "", "which plugin events gave the device-side times"),
        C("algorithm", "u1", "", "NCCL's algorithm"),
        C("protocol", "u1", "", "NCCL's protocol"),
        C("n_channels", "<u2", "", "channels the operation ran on"),
        C("count", "<u8", "", "element count"),
        C("datatype", "u1", "", "NCCL datatype"),
        # appended by the plugin's side: a point-to-point's seq counts per (peer, direction), so
        # (pid, comm_id, seq) alone can name both a collective and a send; with op and peer it cannot
        C("op", "u1", "", "index into op_names, as in /collectives/calls"),
        C("root_or_peer", "<i4", "", "as in /collectives/calls"),
    ),
    enums={
        "op": COLLECTIVE_OPS,
        "timing": ("none", "kernel_channel_gpu_timer", "kernel_channel_host", "proxy_step_host"),
        "algorithm": ("unknown", "tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"),
        "protocol": ("unknown", "ll", "ll128", "simple"),
        "datatype": ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
                     "bfloat16", "float8e4m3", "float8e5m2", "unknown"),
    },
)
COMMUNICATORS = Table(
    "collectives",
    "communicators",
    "communicators created or freed by job processes, with their job-wide ids",
    (
        T_NS,
        C("pid", "<u4", "", "process id"),
        C("library", "u1", "", "which library"),
        C("op", "u1", "", "index into op_names"),
        C("comm_id", "<u8", "", "job-wide id"),
        C("parent_id", "<u8", "", "job-wide id of the parent communicator, 0 if none"),
        C("handle", "<u8", "", "handle in the process"),
        C("comm_rank", "<i4", "", "rank of the process in it"),
        C("comm_size", "<i4", "", "size"),
    ),
    enums={"library": ("mpi", "nccl"), "op": COMMUNICATOR_OPS},
)

# --- NVTX ranges (NVTX's injection interface; docs/probes.md) -------------------------------------
NVTX_RANGES = Table(
    "nvtx",
    "ranges",
    "NVTX ranges of job threads (push/pop and start/end), received through NVTX's injection interface",
    (
        C("t_start_ns", "<u8", "ns", "CLOCK_MONOTONIC at the push or start"),
        C("t_end_ns", "<u8", "ns", "CLOCK_MONOTONIC at the pop or end, 0 = still open when recorded"),
        C("pid", "<u4", "", "process id"),
        C("tid", "<u4", "", "thread id (of the push; of the start for start/end ranges)"),
        C("domain_id", "<u4", "", "string id in /nvtx/strings of the domain's name, 0 = the default domain"),
        C("name_id", "<u4", "", "string id in /nvtx/strings of the range's message"),
        C("category", "<u4", "", "NVTX category, 0 = none"),
        C("kind", "u1", "", "push/pop (nested per thread) or start/end (any thread, may overlap)"),
        C("depth", "<u2", "", "nesting level of a push/pop range on its thread, 0 = outermost"),
        C("color", "<u4", "", "ARGB color the application gave, 0 = none"),
    ),
    enums={"kind": ("push_pop", "start_end")},
)
NVTX_STRINGS = Table(
    "nvtx",
    "strings",
    "the texts of /nvtx/ranges' domains and messages",
    (
        C("pid", "<u4", "", "process id (string ids are per process)"),
        C("string_id", "<u4", "", "as in /nvtx/ranges"),
        C("text", "S128", "", "utf-8, cut at 127 bytes (then ending in '...')"),
        C("truncated", "u1", "", "1 = the application's string was longer (cut as said), 2 = lost: a full ring "
          "dropped part of it"),
    ),
)


# --- CPU stacks, off-CPU time, CUDA launches (eBPF; docs/probes.md) ------------------------------
_STACK_COLS = (
    C("user_stack", "<u4", "", "stack id in /stacks/frames (0 = none, 4294967295 = not captured)"),
    C("kernel_stack", "<u4", "", "stack id in /stacks/frames (0 = none: the thread was in user mode)"),
)
STACK_SAMPLES = Table(
    "stacks",
    "samples",
    "CPU samples of job threads (perf event at sources.stacks.rate_hz per CPU), counted per window "
    "and (pid, tid, cpu, user stack, kernel stack)",
    (
        C("t_ns", "<u8", "ns", "CLOCK_MONOTONIC start of the window (windows end at the next one)"),
        C("pid", "<u4", "", "process id"),
        C("tid", "<u4", "", "thread id"),
        C("cpu", "<u2", "", "CPU the samples were taken on"),
        *_STACK_COLS,
        C("gil", "u1", "", "Python threads: 1 = the sampled thread held the GIL, 2 = it did not (it waited for it, "
          "or ran native code that released it); 0 = not known (no Python frames, a layout without the GIL, or a "
          "file written before the column was added: read as 0)", absent_reads_as=GIL_UNKNOWN),
        C("count", "<u4", "samples", "samples in the window"),
    ),
)
OFFCPU_INTERVALS = Table(
    "offcpu",
    "intervals",
    "off-CPU time of job threads per window and (pid, tid, stacks at switch-out): blocked (switch-out "
    "in a sleeping state to wakeup; an episode counts in the window in which the thread was woken), and "
    "runnable (waiting for a CPU after a wakeup or a preemption, the kernel's per-thread run_delay read "
    "at each window's end, in rows without stacks; files written before 2026-12-04 counted it per "
    "switch, with the blocked episode's stacks)",
    (
        C("t_ns", "<u8", "ns", "CLOCK_MONOTONIC start of the window"),
        C("pid", "<u4", "", "process id (0 in files written before 2026-12-04: a new thread that exited before "
          "its process was read)"),
        C("tid", "<u4", "", "thread id"),
        *_STACK_COLS,
        C("blocked_ns", "<u8", "ns", "time asleep (waiting for I/O, a lock, a timer, a message)"),
        C("runnable_ns", "<u8", "ns", "time runnable but waiting for a CPU (run queue)"),
        C("count", "<u4", "", "off-CPU episodes: blocked episodes, or in a run-queue row the times the thread "
          "was switched in"),
    ),
)
STACK_FRAMES = Table(
    "stacks",
    "frames",
    "frames of every stack id used by /stacks/samples, /offcpu/intervals and /kernels/launches "
    "(written at seal)",
    (
        C("stack_id", "<u4", "", "stack id"),
        C("depth", "<u2", "", "0 = innermost frame (where the thread was), then its callers"),
        C("symbol_id", "<u4", "", "row of /stacks/symbols"),
    ),
)
STACK_SYMBOLS = Table(
    "stacks",
    "symbols",
    "function names of the frames (written at seal; '[unknown MODULE+0xOFF]' = not resolved, where it is; "
    "docs/probes.md)",
    (
        C("symbol_id", "<u4", "", "symbol id"),
        C("name", "S200", "", "function (demangled; inlined functions are frames of their own), Python 'py::' "
                              "frame, '[unknown MODULE+0xOFF]' (OFF: file offset) or '[unknown]' (kernel)"),
        C("module", "S64", "", "file name of the ELF object, '[kernel]', or perf-PID.map"),
    ),
)
KERNEL_APIS: tuple[str, ...] = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaLaunchKernelExC")
KERNEL_LAUNCHES = Table(
    "kernels",
    "launches",
    "CUDA kernel launches of job processes (uprobes at entry of the launch call)",
    (
        T_NS,
        C("pid", "<u4", "", "process id"),
        C("tid", "<u4", "", "thread id"),
        C("api", "u1", "", "launch entry point (the _ptsz forms count as theirs)"),
        C("grid_x", "<u4", "", "grid dimension x"),
        C("grid_y", "<u4", "", "grid dimension y"),
        C("grid_z", "<u4", "", "grid dimension z"),
        C("block_x", "<u4", "", "block dimension x"),
        C("block_y", "<u4", "", "block dimension y"),
        C("block_z", "<u4", "", "block dimension z"),
        C("shared_mem_bytes", "<u4", "bytes", "dynamic shared memory"),
        C("stream", "<u8", "", "CUstream / cudaStream_t handle (0 = default stream)"),
        C("function", "<u8", "", "CUfunction, or the host stub address (runtime API): see /kernels/functions"),
        C("user_stack", "<u4", "", "CPU stack at the launch, id in /stacks/frames"),
    ),
    enums={"api": KERNEL_APIS},
)
KERNEL_FUNCTIONS = Table(
    "kernels",
    "functions",
    "kernel names of the (pid, function) pairs of /kernels/launches (written at seal)",
    (
        C("pid", "<u4", "", "process id"),
        C("function", "<u8", "", "as in /kernels/launches"),
        C("name", "S200", "", "kernel name (demangled), '' when not resolved"),
        C("source", "u1", "", "where the name came from"),
    ),
    enums={"source": ("stub_symbol", "cuModuleGetFunction", "cuLibraryGetKernel", "unresolved")},
)

# CUDA kernel executions through CUPTI's activity API (bpf/fastpath/gpuprof_cupti.c, CUDA_INJECTION64_PATH;
# docs/probes.md "CUDA kernel times (CUPTI)"), drained from the fast path's rings.
KERNEL_ACTIVITY = Table(
    "kernels",
    "activity",
    "CUDA kernels as they ran on the GPU (CUPTI activity records), one row per kernel execution",
    (
        C("t_start_ns", "<u8", "ns", "CLOCK_MONOTONIC of the kernel's start on the GPU (CUPTI's conversion)"),
        C("t_end_ns", "<u8", "ns", "CLOCK_MONOTONIC of its end"),
        C("pid", "<u4", "", "process id"),
        C("device", "<u4", "", "CUDA device id"),
        C("stream", "<u4", "", "CUPTI stream id"),
        C("correlation_id", "<u4", "", "CUPTI's id of the launch API call that enqueued it"),
        C("name_id", "<u4", "", "row of /kernels/activity_names for this pid, 0 = no name"),
        C("grid_x", "<i4", "", "grid dimension x"),
        C("grid_y", "<i4", "", "grid dimension y"),
        C("grid_z", "<i4", "", "grid dimension z"),
        C("block_x", "<i4", "", "block dimension x"),
        C("block_y", "<i4", "", "block dimension y"),
        C("block_z", "<i4", "", "block dimension z"),
        C("dynamic_shared_bytes", "<i4", "bytes", "dynamic shared memory"),
        C("static_shared_bytes", "<i4", "bytes", "static shared memory"),
        C("registers", "<u2", "", "registers per thread"),
        C("clock", "u1", "", "how the times reached CLOCK_MONOTONIC"),
    ),
    enums={"clock": ("monotonic_callback", "realtime_converted")},
)
KERNEL_ACTIVITY_NAMES = Table(
    "kernels",
    "activity_names",
    "names of the kernels of /kernels/activity (mangled, as CUPTI gives them), per process",
    (
        C("pid", "<u4", "", "process id"),
        C("name_id", "<u4", "", "as in /kernels/activity"),
        C("name", "S200", "", "kernel name, cut at 199 bytes (then ending in '...')"),
        C("truncated", "u1", "", "1 = cut, 2 = lost: a full ring dropped part of it"),
    ),
)

KERNEL_ACTIVITY_LAUNCHES = Table(
    "kernels",
    "activity_launches",
    "the launch calls of /kernels/activity's kernels, as CUPTI's callback API saw them at their entry: "
    "correlation_id names the kernel; (pid, tid, t_ns) finds the same call's CPU stack in /kernels/launches",
    (
        T_NS,
        C("pid", "<u4", "", "process id"),
        C("tid", "<u4", "", "thread id of the launching thread"),
        C("correlation_id", "<u4", "", "as in /kernels/activity"),
        C("domain", "u1", "", "which API the call belongs to"),
        C("cbid", "<u4", "", "CUPTI's callback id of the function (cupti_driver_cbid.h, cupti_runtime_cbid.h)"),
    ),
    enums={"domain": ("none", "driver_api", "runtime_api")},
)

# Tables of the eBPF sources (stacks, off-CPU, CUDA kernels).
BPF_TABLES: tuple[Table, ...] = (
    STACK_SAMPLES, OFFCPU_INTERVALS, STACK_FRAMES, STACK_SYMBOLS, KERNEL_LAUNCHES, KERNEL_FUNCTIONS,
)

ALL_TABLES: tuple[Table, ...] = (
    CLOCK_PAIRS,
    DIAG_ERRORS,
    DIAG_MISSING,
    DIAG_DROPS,
    PROCESS_EVENTS,
    HOST_NODE,
    HOST_PROCS,
    GPU_DEVICES,
    GPU_SAMPLES,
    GPU_GPM,
    GPU_PROCESSES,
    GPU_EVENTS,
    COLLECTIVE_CALLS,
    COMMUNICATORS,
    DEVICE_TIMES,
    NVTX_RANGES,
    NVTX_STRINGS,
    KERNEL_ACTIVITY,
    KERNEL_ACTIVITY_NAMES,
    KERNEL_ACTIVITY_LAUNCHES,
) + BPF_TABLES

TABLES_BY_PATH: dict[str, Table] = {t.path: t for t in ALL_TABLES}

# Which tables each --profile-gpu mode brings (the always-on ones are in every file).
ALWAYS = (CLOCK_PAIRS, DIAG_ERRORS, DIAG_MISSING, DIAG_DROPS, PROCESS_EVENTS)
MODE_TABLES: dict[str, tuple[Table, ...]] = {
    "metrics": (HOST_NODE, HOST_PROCS, GPU_DEVICES, GPU_SAMPLES, GPU_GPM, GPU_PROCESSES, GPU_EVENTS),
    # NVTX ranges cross the fast path's rings with the collectives
    "collectives": (COLLECTIVE_CALLS, COMMUNICATORS, DEVICE_TIMES, NVTX_RANGES, NVTX_STRINGS),
    "stacks": (STACK_SAMPLES, OFFCPU_INTERVALS, STACK_FRAMES, STACK_SYMBOLS),
    "kernels": (KERNEL_LAUNCHES, KERNEL_FUNCTIONS, STACK_FRAMES, STACK_SYMBOLS, KERNEL_ACTIVITY,
                KERNEL_ACTIVITY_NAMES, KERNEL_ACTIVITY_LAUNCHES),
}
def tables_for_modes(modes: tuple[str, ...]) -> tuple[Table, ...]:
    out: list[Table] = list(ALWAYS)
    for m in modes:
        out.extend(t for t in MODE_TABLES[m] if t not in out)
    return tuple(out)


# Communicator events of the probes (bpf/gpuprof_ops.h) that are not rows of /collectives/communicators but update rank and size.
INTERNAL_COMM_OPS: dict[str, int] = {
    "MPI_Comm_rank": 100,
    "MPI_Comm_size": 101,
    "ncclCommCount": 102,
    "ncclCommUserRank": 103,
}
