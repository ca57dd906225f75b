"""Prometheus metrics (collector/prometheus.py): the families of a snapshot, written as a
node-exporter textfile and read back with prometheus_client's own parser; the rank accounting
from collective rows; the HTTP endpoint. The collector end to end writes one too
(tests/test_continuous.py)."""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from gpuprof.collector import schema
from gpuprof.collector.prometheus import TEXTFILE_NAME, RankAccounting, registry_of, write_textfile


def snapshot() -> dict[str, Any]:
    return {
        "node": "node7",
        "gpus": [{"index": 0, "uuid": "GPU-aa", "job": "42", "user": "alice", "util_ratio": 0.93, "power_w": 310.0,
                  "mem_used_bytes": 7.5e9, "temp_c": 61.0},
                 {"index": 1, "uuid": "GPU-bb", "job": "", "user": "", "util_ratio": 0.0, "power_w": float("nan"),
                  "mem_used_bytes": 0.0, "temp_c": 35.0}],
        "host": {"cpu_busy": 0.25, "mem_used_bytes": 1.0e10},
        "collector": {"retained_s": 600.0, "exports": 3, "triggers_refused": 17, "requests_refused": 2, "drops": 0},
        "jobs": [{"job": "42", "user": "alice", "processes": 9}],
        "ranks": [{"job": "42", "user": "alice", "rank": 0, "seconds_total": 12.5, "calls_total": 1000,
                   "lateness_s": 0.002},
                  {"job": "42", "user": "alice", "rank": 1, "seconds_total": 3.0, "calls_total": 1000,
                   "lateness_s": None}],
    }


def parsed(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_textfile_parses_back_with_names_units_and_labels(tmp_path: Path) -> None:
    path = write_textfile(tmp_path, registry_of(snapshot))
    assert path.name == TEXTFILE_NAME and [p.name for p in tmp_path.iterdir()] == [TEXTFILE_NAME]
    fams = parsed(path.read_text())
    util = {s.labels["gpu_uuid"]: s for s in fams["gpuprof_gpu_utilization_ratio"].samples}
    assert util["GPU-aa"].value == 0.93 and util["GPU-aa"].labels == {
        "node": "node7", "gpu": "0", "gpu_uuid": "GPU-aa", "job": "42", "user": "alice"}
    # a metric the GPU does not give is absent, not zero
    assert [s.labels["gpu"] for s in fams["gpuprof_gpu_power_watts"].samples] == ["0"]
    assert fams["gpuprof_node_cpu_busy_ratio"].samples[0].value == 0.25
    assert fams["gpuprof_job_processes"].samples[0].labels == {"job": "42", "user": "alice", "node": "node7"}
    # counters by the conventions: the family without _total, the sample with it
    secs = fams["gpuprof_collective_seconds"]
    assert secs.type == "counter"
    by_rank = {s.labels["rank"]: s.value for s in secs.samples if s.name.endswith("_total")}
    assert by_rank == {"0": 12.5, "1": 3.0}
    late = fams["gpuprof_collective_lateness_seconds"].samples
    assert [(s.labels["rank"], s.value) for s in late] == [("0", 0.002)]  # rank 1: no lateness known
    refused = [s for s in fams["gpuprof_triggers_refused"].samples if s.name.endswith("_total")]
    assert refused[0].value == 17
    for name in fams:
        assert name.startswith("gpuprof_") and name == name.lower()


def test_textfile_is_replaced_atomically(tmp_path: Path) -> None:
    path = write_textfile(tmp_path, registry_of(snapshot))
    with open(path) as reader:  # node-exporter in the middle of a read
        before = os.fstat(reader.fileno()).st_ino
        write_textfile(tmp_path, registry_of(snapshot))
        assert "gpuprof_gpu_utilization_ratio" in reader.read()  # the old file, whole
    assert os.stat(path).st_ino != before  # a new file renamed into place
    assert not [p for p in tmp_path.iterdir() if p.name != TEXTFILE_NAME]


def calls(rows: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    """(pid, rank, seq, t_enter_ms, t_exit_ms) of MPI_Allreduce on one 2-rank communicator."""
    a = schema.COLLECTIVE_CALLS.empty(len(rows))
    for i, (pid, rank, seq, t0, t1) in enumerate(rows):
        a[i]["pid"], a[i]["comm_rank"], a[i]["seq"] = pid, rank, seq
        a[i]["t_enter_ns"], a[i]["t_exit_ns"] = t0 * 1_000_000, t1 * 1_000_000
    a["comm_size"], a["comm_id"], a["op"] = 2, 5, schema.COLLECTIVE_OPS.index("MPI_Allreduce")
    return a


def test_rank_accounting_totals_and_lateness() -> None:
    jobs = {100: "42", 101: "42"}
    acc = RankAccounting(jobs.get)
    # rank 1 arrives 30 ms late each time; rank 0 waits for it
    acc.observe(schema.COLLECTIVE_CALLS.path, calls([(100, 0, 0, 0, 40), (101, 1, 0, 30, 40),
                                                     (100, 0, 1, 100, 140), (101, 1, 1, 130, 140)]))
    assert acc.totals[("42", 0)] == [0.08, 2] and acc.totals[("42", 1)] == [0.02, 2]
    assert acc.lateness[("42", 1)] == 0.03 and acc.lateness[("42", 0)] == 0.0
    acc.observe(schema.HOST_NODE.path, schema.HOST_NODE.empty(3))  # other tables: ignored
    assert len(acc.totals) == 2


def test_http_endpoint_serves_the_same_families() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry_of(snapshot))
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        thread.join(5)
    assert parsed(text)["gpuprof_job_processes"].samples[0].value == 9
