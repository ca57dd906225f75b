"""The suite's one config file (TOML): schema, defaults, lookup order, validation.

Lookup order (docs/config.md):
  1. the path given on the command line (`gpuprof --config FILE`),
  2. $GPUPROF_CONFIG,
  3. /etc/gpuprof/gpuprof.toml when it exists,
  4. the built-in defaults below (identical to the shipped etc/gpuprof.toml; a test checks it).
A path named in 1 or 2 must exist: a missing file there is an error, not a silent fallback.
Unknown sections or keys and wrong types are rejected with the key named.
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuprof.collector import environment
from gpuprof.collector.errors import ConfigError

SITE_CONFIG = Path("/etc/gpuprof/gpuprof.toml")


@dataclass(frozen=True)
class Key:
    type: type | tuple[type, ...]
    default: Any
    doc: str
    choices: tuple[str, ...] = ()  # the only values a string key accepts (empty: any)


# section -> key -> Key. Sections named "a.b" are TOML sub-tables.
SCHEMA: dict[str, dict[str, Key]] = {
    "paths": {
        "state_dir": Key(str, "/var/lib/gpuprof", "root-only directory for hook state, sockets, node files"),
        "log_file": Key(str, "", "extra log file for hooks and collector ('' = syslog and stderr only)"),
    },
    "hooks": {
        "output_dir_template": Key(
            str,
            "{stdout_dir}/{stdout_stem}.gpuprof.d",
            "where the epilog places <node>.h5; fields: stdout_dir, stdout_stem, work_dir, job_id, user",
        ),
        "collector_ready_timeout_s": Key((int, float), 2.0, "prolog waits this long for the collector"),
        "attach_timeout_s": Key(
            (int, float), 10.0,
            "prolog waits at most this long for every source to attach; late ones are marked (docs/slurm.md)",
        ),
        "seal_timeout_s": Key((int, float), 10.0, "epilog waits this long for the collector to seal"),
        "collector_nice": Key(int, 10, "nice value of the collector (low priority): its threads' and its session's "
                              "autogroup's; the session's is lifted to 0 while the collector falls behind (a buffer "
                              "past half full) and back 30 s after (collector/catchup.py)"),
        "collector_python": Key(str, "", "python that runs the collector ('' = the one running the hook)"),
        "undelivered_max_mb": Key(
            int, 4096,
            "node files root keeps when they could not reach the user (<state_dir>/undelivered): "
            "the oldest are removed past this size",
        ),
    },
    "dcgm": {
        "enabled": Key(bool, True, "pause DCGM profiling while profiled jobs run"),
        "dcgmi": Key(str, "/usr/bin/dcgmi", "path of the dcgmi command"),
        "timeout_s": Key((int, float), 5.0, "timeout of one dcgmi call"),
    },
    "collector": {
        "memory_limit_mb": Key(int, 64, "cap on all sources' in-memory rings together"),
        "flush_interval_s": Key((int, float), 4.0, "writer flushes at least this often (<= 5 s)"),
        "clock_interval_s": Key((int, float), 1.0, "(monotonic, realtime) pair every N s"),
        "process_scan_interval_s": Key((int, float), 1.0, "how often new job processes are picked up"),
        "compression": Key(str, "gzip", "HDF5 filter: gzip, lzf or none (docs/trace-format.md)"),
        "job_check_interval_s": Key(
            (int, float), 10.0,
            "while the job has no process on this node, ask Slurm this often whether it is over (0 = never)",
        ),
        "orphan_timeout_s": Key(
            (int, float), 3600.0,
            "stop when the job has had no process here and Slurm could not be asked for this long (0 = never)",
        ),
        "bpf_object_cache": Key(
            bool, True,
            "keep the compiled BPF object's image in <state_dir>/bpf-objects, per source and kernel, and load "
            "it instead of compiling again (docs/collector.md)",
        ),
        "sched_batch": Key(
            bool, True,
            "run the collector's threads under SCHED_BATCH: one that wakes never preempts a running rank, it runs "
            "when the rank yields, blocks or ends its slice (docs/collector.md)",
        ),
        "test_slow_attach_s": Key(
            (int, float), 0.0, "test hook: every source but the clock starts this much later (0 = off)"
        ),
    },
    "sources.nvml": {
        "rate_hz": Key((int, float), 10.0, "GPU metric sampling rate"),
        "gpus": Key(str, "job", "'job' = only the job's GPUs (by UUID), 'all' = every GPU of the node"),
        "call_timeout_s": Key((int, float), 0.5, "timeout of one NVML call"),
        "gpm": Key(bool, True, "sample GPM metrics on Hopper and newer"),
        "process_interval_s": Key((int, float), 1.0, "per process GPU use (job processes only) every N s"),
    },
    "sources.host": {
        "rate_hz": Key((int, float), 10.0, "host and per-process metric sampling rate"),
    },
    "sources.stacks": {
        "rate_hz": Key(int, 19, "CPU stack sampling rate per CPU (Hz; 19: docs/probes.md, \"The sampling rate\")"),
        "unwinder": Key(str, "cfi", "user stacks: cfi (CFI tables walked in the BPF program: code without "
                                    "frame pointers too) or frame_pointers (the kernel's walk only)",
                        choices=("cfi", "frame_pointers")),
        "cfi_max_rows": Key(int, 1048576, "cap on the CFI table rows loaded (12 bytes each; at most 1048576, the "
                                          "BPF map's size); a file whose table does not fit gets none"),
        "cfi_cache_mb": Key(int, 64, "compiled CFI tables kept on disk in <state_dir>/cfi-tables, by build id "
                                     "(else the file's SHA-256; 0 = none)"),
        "cfi_prewarm": Key(bool, True, "compile the tables of the node's common runtime libraries (C, C++ and "
                                        "Fortran runtimes, MPI, the Python interpreter, numpy's BLAS) into the "
                                        "disk cache when a collector starts, once per host"),
        "debug_roots": Key(list, ["/usr/lib/debug"], "where separate debug files are looked for at seal "
                                                     "(ROOT/.build-id/xx/rest.debug, ROOT/<dir>/<debuglink>); "
                                                     "root's directories, absolute paths"),
    },
    "sources.collectives": {
        "mpi_path": Key(str, "auto", "auto, uprobe or fastpath (PMPI interposer)"),
        "nccl_path": Key(str, "auto", "auto, uprobe or fastpath (interposer)"),
        "ring_pages": Key(int, 256, "BPF ring buffer pages per CPU"),
        "nccl_profiler": Key(str, "auto", "auto or off: NCCL's profiler plugin (NCCL_PROFILER_PLUGIN, NCCL 2.23+; "
                                          "auto = when built)"),
    },
    "sources.nvtx": {
        "inject": Key(str, "job", "NVTX ranges (NVTX_INJECTION64_PATH, needs mode collectives): job = when the "
                                  "job's environment has GPUPROF_NVTX=1, on, or off"),
    },
    "sources.kernels": {
        "cupti": Key(str, "auto", "auto or off: CUDA kernel times in mode kernels through CUPTI's activity API "
                                  "(CUDA_INJECTION64_PATH; auto = when built)"),
    },
    "sources.offcpu": {
        "flush_interval_s": Key((int, float), 1.0, "off-CPU kernel maps are drained this often"),
    },
    "merge": {
        "reference_node": Key(str, "", "node whose clock is the reference ('' = first in sort order)"),
        "mpirun": Key(str, "mpirun", "launcher of the automatic merge at job end: an mpirun (Open MPI, MPICH "
                                     "hydra), or srun with its PMI, e.g. 'srun --mpi=pmix'"),
        "auto": Key(bool, True, "merge automatically at job end (a merge job submitted as the job's user)"),
        "submit_from": Key(str, "node_epilog",
                           "who submits the merge job: the Epilog of the job's first node (root, any SlurmUser) "
                           "or EpilogSlurmctld (only with SlurmUser=root); docs/slurm.md",
                           choices=("node_epilog", "epilog_slurmctld")),
        "max_ranks": Key(int, 4, "MPI ranks of the automatic merge (at most one per node file)"),
        "time_limit_min": Key(int, 30, "time limit of the automatic merge job, minutes"),
        "clock_window_s": Key((int, float), 2.0, "clock fit window: one offset estimate per window (docs/merge.md)"),
        "clock_max_bound_width_us": Key(
            (int, float), 200.0, "bounds_center method: causality intervals up to this wide are used by their centre"
        ),
        "straggler_window_s": Key((int, float), 10.0, "stragglers are judged per window of this length"),
        "straggler_score_threshold": Key(
            (int, float), 0.9, "median-ratio slowness score below which a rank is a straggler (1 = fastest)"
        ),
    },
    # always-on node collector (`gpuprof collect --continuous`, docs/continuous.md)
    "continuous": {
        "modes": Key(str, "metrics", "what the always-on collector records (modes as --profile-gpu; collectives "
                                     "come from the uprobes, measured at 26 % of a core on 16 busy ranks: "
                                     "docs/continuous.md)"),
        "retention_min": Key((int, float), 10.0, "minutes of the past kept for export (memory, then the spill)"),
        "memory_limit_mb": Key(int, 64, "cap on the retained segments held in memory; older ones live in the spill"),
        "spill_dir": Key(str, "/var/lib/gpuprof/continuous", "root-only node-local directory of spilled segments "
                                                             "(survives a collector restart; '' = memory only)"),
        "spill_limit_mb": Key(int, 512, "cap on the spill directory; the oldest segments go first"),
        "segment_s": Key((int, float), 30.0, "retained data is cut into segments this long (the eviction unit)"),
        "socket": Key(str, "/run/gpuprof/continuous.sock", "the local API (unix socket, SO_PEERCRED; docs/continuous.md)"),
        "export_dir": Key(str, "/var/lib/gpuprof/exports", "root-only directory of the exports that rules trigger"),
        "nvml_rate_hz": Key((int, float), 1.0, "GPU metric rate in continuous mode (sources.nvml.rate_hz is the job mode's)"),
        "host_rate_hz": Key((int, float), 1.0, "host metric rate in continuous mode"),
        "stacks_rate_hz": Key(int, 19, "CPU stack sampling rate in continuous mode (when modes has stacks)"),
        "process_scan_interval_s": Key((int, float), 2.0, "how often the node's Slurm jobs' processes are rescanned"),
        "rules": Key(list, [], "export triggers, e.g. \"gpu_util_percent < 10 for 300 s\" (grammar: docs/continuous.md)"),
        "trigger_window_min": Key((int, float), 5.0, "minutes before the trigger that a rule's export covers"),
        "trigger_min_interval_s": Key((int, float), 600.0, "at most one rule-triggered export per this; more are counted"),
        "request_min_interval_s": Key((int, float), 30.0, "a non-root user's API exports: at most one per this"),
    },
    "prometheus": {
        "textfile_dir": Key(str, "", "node-exporter textfile directory for gpuprof.prom ('' = off)"),
        "interval_s": Key((int, float), 15.0, "how often the textfile is rewritten"),
        "http_port": Key(int, 0, "serve /metrics on this port (0 = off)"),
        "http_addr": Key(str, "127.0.0.1", "address of the /metrics endpoint"),
    },
}


def defaults() -> dict[str, dict[str, Any]]:
    return {sec: {k: copy.copy(v.default) for k, v in keys.items()} for sec, keys in SCHEMA.items()}


def _flatten(doc: dict[str, Any], origin: str) -> dict[str, dict[str, Any]]:
    """TOML nested tables -> {"sources.nvml": {...}} with unknown names rejected."""
    out: dict[str, dict[str, Any]] = {}

    def walk(table: dict[str, Any], prefix: str) -> None:
        for name, value in table.items():
            dotted = f"{prefix}.{name}" if prefix else name
            if dotted in SCHEMA:
                if not isinstance(value, dict):
                    raise ConfigError(f"{origin}: [{dotted}] must be a table")
                values = {k: v for k, v in value.items() if not isinstance(v, dict)}
                out[dotted] = values
                walk({k: v for k, v in value.items() if isinstance(v, dict)}, dotted)
            elif isinstance(value, dict) and any(s.startswith(dotted + ".") for s in SCHEMA):
                walk(value, dotted)
            else:
                raise ConfigError(f"{origin}: unknown key or section '{dotted}'")

    walk(doc, "")
    return out


def validate(doc: dict[str, Any], origin: str) -> dict[str, dict[str, Any]]:
    """Merge a parsed TOML document over the defaults; reject unknown keys and wrong types."""
    merged = defaults()
    for section, values in _flatten(doc, origin).items():
        for key, value in values.items():
            spec = SCHEMA[section].get(key)
            if spec is None:
                raise ConfigError(f"{origin}: unknown key '{section}.{key}'")
            # bool is an int in Python; a number key must not accept true/false.
            if isinstance(value, bool) and spec.type is not bool:
                raise ConfigError(f"{origin}: '{section}.{key}' must be {_type_name(spec.type)}, got a boolean")
            if not isinstance(value, spec.type):
                raise ConfigError(
                    f"{origin}: '{section}.{key}' must be {_type_name(spec.type)}, got {type(value).__name__}"
                )
            if spec.choices and value not in spec.choices:
                raise ConfigError(f"{origin}: '{section}.{key}' must be one of {', '.join(spec.choices)}, got {value!r}")
            merged[section][key] = value
    return merged


def _type_name(t: type | tuple[type, ...]) -> str:
    if isinstance(t, tuple):
        return "a number" if set(t) == {int, float} else " or ".join(x.__name__ for x in t)
    return {str: "a string", bool: "true or false", int: "an integer", float: "a number", list: "a list"}[t]


def config_path(explicit: str | None = None) -> Path | None:
    """The file to read, by the documented lookup order; None means built-in defaults."""
    named = explicit or environment.get(environment.GPUPROF_CONFIG)
    if named:
        return Path(named)
    return SITE_CONFIG if SITE_CONFIG.exists() else None


def load(explicit: str | None = None) -> dict[str, dict[str, Any]]:
    path = config_path(explicit)
    if path is None:
        return defaults()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return validate(doc, str(path))


def render_defaults() -> str:
    """The shipped etc/gpuprof.toml: every key with its default and what it means."""
    lines = ["# slurm-gpuprof configuration. Every key, with its default. Lookup order: docs/config.md", ""]
    for section, keys in SCHEMA.items():
        lines.append(f"[{section}]")
        for key, spec in keys.items():
            lines.append(f"# {spec.doc}" + (f" (one of: {', '.join(spec.choices)})" if spec.choices else ""))
            lines.append(f"{key} = {_toml_value(spec.default)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)
