"""Prometheus metrics of the continuous collector: a node-exporter textfile (written to a temporary
file and renamed into [prometheus] textfile_dir, so node-exporter never reads half a file) and an
optional HTTP /metrics endpoint, both through the `prometheus_client` package.

What is exported (names and units by Prometheus' conventions: base units, `_ratio` for 0..1,
`_total` for counters; docs/continuous.md has the table):
  per GPU       gpuprof_gpu_utilization_ratio, gpuprof_gpu_power_watts, gpuprof_gpu_memory_used_bytes,
                gpuprof_gpu_temperature_celsius      {node, gpu, gpu_uuid, job, user}
  per node      gpuprof_node_cpu_busy_ratio, gpuprof_node_memory_used_bytes, gpuprof_retained_seconds,
                gpuprof_exports_total, gpuprof_triggers_refused_total, gpuprof_requests_refused_total
  per job       gpuprof_job_processes                {job, user, node}
  per rank      gpuprof_collective_seconds_total, gpuprof_collective_calls_total (counters: time in and
                number of blocking collectives), gpuprof_collective_lateness_seconds (gauge: mean
                arrival after the earliest rank of this node at the same instance, last interval)
                                                     {job, user, node, rank}
Lateness here is node-local (the node's clock alone): across nodes it is `gpuprof watch`'s and the
merge's, whose clocks are aligned. Per-rank divergence across nodes is a query on the collective
time: the rank that arrives last waits least, so its rate of gpuprof_collective_seconds_total is
the lowest of its job.

The metric building takes a plain snapshot (dicts), so it is tested without a collector.
"""

from __future__ import annotations

import logging
import os
import pwd
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from gpuprof.collector import schema
from gpuprof.collector.errors import CollectorError
from gpuprof.collector.watch import COLLECTIVE_OP_CODES

log = logging.getLogger("gpuprof.collector")

TEXTFILE_NAME = "gpuprof.prom"
GPU_LABELS = ["node", "gpu", "gpu_uuid", "job", "user"]
RANK_LABELS = ["job", "user", "node", "rank"]


def user_name(uid: int | None) -> str:
    if uid is None:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def families(snap: dict[str, Any]) -> list[Metric]:
    """The metric families of one snapshot (see snapshot_of for its fields)."""
    node = str(snap["node"])
    out: list[Metric] = []
    gpu_defs = [
        ("gpuprof_gpu_utilization_ratio", "GPU utilization (NVML utilization.gpu / 100)", "util_ratio"),
        ("gpuprof_gpu_power_watts", "GPU power draw", "power_w"),
        ("gpuprof_gpu_memory_used_bytes", "GPU framebuffer memory used", "mem_used_bytes"),
        ("gpuprof_gpu_temperature_celsius", "GPU temperature", "temp_c"),
    ]
    for name, doc, key in gpu_defs:
        g = GaugeMetricFamily(name, doc, labels=GPU_LABELS)
        for gpu in snap.get("gpus", []):
            v = gpu.get(key)
            if v is None or not np.isfinite(v):
                continue  # not provided by this GPU: no sample rather than a made-up one
            g.add_metric([node, str(gpu["index"]), gpu.get("uuid", ""), gpu.get("job", ""), gpu.get("user", "")],
                         float(v))
        out.append(g)
    host = snap.get("host") or {}
    for name, doc, key in (("gpuprof_node_cpu_busy_ratio", "Node CPU busy fraction", "cpu_busy"),
                           ("gpuprof_node_memory_used_bytes", "Node memory used (MemTotal - MemAvailable)",
                            "mem_used_bytes")):
        g = GaugeMetricFamily(name, doc, labels=["node"])
        if key in host and np.isfinite(host[key]):
            g.add_metric([node], float(host[key]))
        out.append(g)
    col = snap.get("collector", {})
    g = GaugeMetricFamily("gpuprof_retained_seconds", "Seconds of the past the continuous collector holds",
                          labels=["node"])
    g.add_metric([node], float(col.get("retained_s", 0.0)))
    out.append(g)
    for name, doc, key in (("gpuprof_exports", "Exports written", "exports"),
                           ("gpuprof_triggers_refused", "Rule triggers refused by the rate limit", "triggers_refused"),
                           ("gpuprof_requests_refused", "API requests refused (authentication or rate limit)",
                            "requests_refused"),
                           ("gpuprof_dropped_records", "Records dropped before retention (all sources)", "drops")):
        c = CounterMetricFamily(name, doc, labels=["node"])
        c.add_metric([node], float(col.get(key, 0)))
        out.append(c)
    g = GaugeMetricFamily("gpuprof_job_processes", "Processes of the job on this node", labels=["job", "user", "node"])
    for job in snap.get("jobs", []):
        g.add_metric([job["job"], job.get("user", ""), node], float(job["processes"]))
    out.append(g)
    secs = CounterMetricFamily("gpuprof_collective_seconds", "Time spent in blocking collectives",
                               labels=RANK_LABELS)
    calls = CounterMetricFamily("gpuprof_collective_calls", "Blocking collectives completed", labels=RANK_LABELS)
    late = GaugeMetricFamily("gpuprof_collective_lateness_seconds",
                             "Mean arrival after the earliest rank of this node at the same instance (last interval)",
                             labels=RANK_LABELS)
    for r in snap.get("ranks", []):
        labels = [r["job"], r.get("user", ""), node, str(r["rank"])]
        secs.add_metric(labels, float(r["seconds_total"]))
        calls.add_metric(labels, float(r["calls_total"]))
        if r.get("lateness_s") is not None:
            late.add_metric(labels, float(r["lateness_s"]))
    out += [secs, calls, late]
    return out


class SnapshotCollector(PromCollector):
    """A prometheus_client collector that builds the families from a fresh snapshot at each scrape."""

    def __init__(self, snapshot: Any) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from families(self.snapshot())


def registry_of(snapshot: Any) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(snapshot))
    return reg


def write_textfile(directory: Path, registry: CollectorRegistry) -> Path:
    """Atomic: prometheus_client writes a temporary file beside the target and renames it."""
    path = directory / TEXTFILE_NAME
    write_to_textfile(str(path), registry)
    return path


class RankAccounting:
    """Running totals per (job, rank) of the collectives the writer thread sees, and the last
    interval's node-local lateness. pid -> job from the tracker; rank = the pid's rank in the
    largest communicator it called on (MPI_COMM_WORLD, or the NCCL world communicator)."""

    def __init__(self, job_of_pid: Any) -> None:
        self.job_of_pid = job_of_pid
        self.totals: dict[tuple[str, int], list[float]] = {}  # -> [seconds, calls]
        self.lateness: dict[tuple[str, int], float] = {}
        self._rank_of: dict[int, tuple[int, int]] = {}  # pid -> (comm_size, rank)

    def observe(self, path: str, rows: np.ndarray) -> None:
        if path != schema.COLLECTIVE_CALLS.path or not len(rows):
            return
        rows = rows[np.isin(rows["op"], COLLECTIVE_OP_CODES) & (rows["t_exit_ns"] > rows["t_enter_ns"])]
        for pid in np.unique(rows["pid"]):
            pr = rows[rows["pid"] == pid]
            big = int(np.argmax(pr["comm_size"]))
            size, rank = int(pr["comm_size"][big]), int(pr["comm_rank"][big])
            if size >= self._rank_of.get(int(pid), (0, 0))[0]:
                self._rank_of[int(pid)] = (size, rank)
        lateness: dict[tuple[str, int], list[float]] = {}
        for cid in np.unique(rows["comm_id"]):
            c = rows[rows["comm_id"] == cid]
            for seq in np.unique(c["seq"]):
                inst = c[c["seq"] == seq]
                if len(inst) < 2:
                    continue
                first = int(inst["t_enter_ns"].min())
                for r in inst:
                    key = self._key(int(r["pid"]))
                    if key is not None:
                        lateness.setdefault(key, []).append((int(r["t_enter_ns"]) - first) / 1e9)
        for r in rows:
            key = self._key(int(r["pid"]))
            if key is None:
                continue
            t = self.totals.setdefault(key, [0.0, 0.0])
            t[0] += (int(r["t_exit_ns"]) - int(r["t_enter_ns"])) / 1e9
            t[1] += 1
        self.lateness = {k: float(np.mean(v)) for k, v in lateness.items()}

    def _key(self, pid: int) -> tuple[str, int] | None:
        job = self.job_of_pid(pid)
        rank = self._rank_of.get(pid)
        if job is None or rank is None:
            return None
        return job, rank[1]


def snapshot_of(c: Any, ranks: RankAccounting) -> dict[str, Any]:
    """What the families need from a ContinuousCollector (collector/continuous.py)."""
    node = c.opts.node or os.uname().nodename
    jobs = c.jobs_tracker.jobs()
    users = {j: user_name(info["uid"]) for j, info in jobs.items()}
    devices = c.retention.window(0, 0).get(schema.GPU_DEVICES.path)
    uuid = {int(d["index"]): d["uuid"].decode(errors="replace") for d in devices} if devices is not None else {}
    gpu_job = c.metrics_gpu_jobs() if hasattr(c, "metrics_gpu_jobs") else {}
    gpus = []
    for idx, r in sorted(c.metrics.gpu_latest.items()):
        job = gpu_job.get(idx, "")
        gpus.append({"index": idx, "uuid": uuid.get(idx, ""), "job": job, "user": users.get(job, ""),
                     "util_ratio": float(r["util_gpu"]) / 100.0, "power_w": float(r["power_w"]),
                     "mem_used_bytes": float(r["mem_used_bytes"]), "temp_c": float(r["temp_c"])})
    h = c.metrics.host_latest
    host = {"cpu_busy": float(h["cpu_busy"]), "mem_used_bytes": float(h["mem_used_bytes"])} if h is not None else {}
    st = c.retention.status()
    collector = {"retained_s": st["retained_s"], "exports": len(c.exports), "triggers_refused":
                 c.trigger_limiter.refused_total(), "requests_refused": c.request_limiter.refused_total()
                 + c.auth_refused, "drops": sum(c.drops().values())}
    running = [{"job": j, "user": users[j], "processes": info["pids"]} for j, info in jobs.items() if info["running"]]
    rank_rows = [{"job": j, "user": users.get(j, ""), "rank": r, "seconds_total": t[0], "calls_total": t[1],
                  "lateness_s": ranks.lateness.get((j, r))} for (j, r), t in sorted(ranks.totals.items())]
    return {"node": node, "gpus": gpus, "host": host, "collector": collector, "jobs": running, "ranks": rank_rows}


def attach_prometheus(c: Any, cfg: dict[str, Any]) -> None:
    """Wire the textfile writer (on the writer thread, after a flush, at most every interval_s) and
    the HTTP endpoint (prometheus_client's own thread) to a ContinuousCollector, as configured."""
    directory = str(cfg["textfile_dir"])
    port = int(cfg["http_port"])
    if not directory and not port:
        return
    ranks = RankAccounting(c.jobs_tracker.job_of)
    c.retention_observers_add(ranks.observe)
    registry = registry_of(lambda: snapshot_of(c, ranks))
    if port:
        try:
            start_http_server(port, addr=str(cfg["http_addr"]), registry=registry)
        except OSError as e:
            raise CollectorError(f"prometheus: cannot serve on {cfg['http_addr']}:{port}: {e.strerror}") from None
    if directory:
        d = Path(directory)
        if not d.is_dir():
            raise CollectorError(f"prometheus.textfile_dir {d}: not a directory")
        interval = float(cfg["interval_s"])
        last = [0.0]

        def write() -> None:
            now = time.monotonic()
            if now - last[0] >= interval:
                last[0] = now
                write_textfile(d, registry)

        c.flush_hooks.append(write)
