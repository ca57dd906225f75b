"""Mode `stacks`, off-CPU half, for real: blocked time attributed to the call a thread sleeps in,
run-queue time of two threads sharing one CPU, and nothing of a process outside the job."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

import native_progs
from harness import bpf_skip_reason, make_ctx

from gpuprof.collector import bpf_support, schema
from gpuprof.collector.sources.base import SourceUnavailable
from gpuprof.collector.sources.bpf_offcpu import BpfOffcpuSource
from gpuprof.collector.symbolize import STACK_NONE, folded_stacks, stack_names

SECONDS = 3.0


def _skip() -> None:
    reason = bpf_skip_reason() or native_progs.cc_skip_reason()
    if reason:
        pytest.skip(reason)


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bpf_support, "bpf_unavailable_reason", lambda: "BPF unavailable: tracefs failed")
    with pytest.raises(SourceUnavailable, match="tracefs"):
        BpfOffcpuSource().start(make_ctx(lambda: frozenset(), ("stacks",)))


def run_offcpu(tmp_path: Path, args: list[str], outsider: list[str] | None = None
               ) -> tuple[Any, dict[str, Any], h5py.File, list[str]]:
    return native_progs.run_cpu_work_under(BpfOffcpuSource(flush_interval_s=0.5), tmp_path, args, outsider,
                                           schema.OFFCPU_INTERVALS)


@pytest.mark.bpf
def test_blocked_time_attributed_to_the_sleeping_call(tmp_path: Path) -> None:
    _skip()
    rows, info, f, errors = run_offcpu(tmp_path, ["sleepy", str(SECONDS)], outsider=["sleepy", str(SECONDS)])
    assert not errors, errors
    assert set(rows["pid"].tolist()) == {info["pid"]}, "rows of a process outside the job"
    names = stack_names(f)
    mine = rows[rows["tid"] == info["tids"][0]]
    blocked = int(mine["blocked_ns"].sum())
    assert blocked >= 0.8 * SECONDS * 1e9, blocked
    in_call = sum(int(r["blocked_ns"]) for r in mine
                  if names.get(int(r["user_stack"]), [])[:2] == ["raw_nanosleep", "sleepy_wait"])
    assert in_call >= 0.95 * blocked, [(names.get(int(r["user_stack"])), int(r["blocked_ns"])) for r in mine]
    kernel = {n for r in mine for n in names.get(int(r["kernel_stack"]), [])}
    assert any("nanosleep" in n for n in kernel), kernel
    # every 5 ms sleep is one episode: about 3 s / (5 ms + wake-up) of them
    assert 200 <= int(mine["count"].sum()) <= 700
    folded = folded_stacks(f, "offcpu/intervals", "blocked_ns")
    assert any("sleepy_wait;raw_nanosleep" in k for k in folded)


@pytest.mark.bpf
def test_runnable_time_of_threads_sharing_a_cpu(tmp_path: Path) -> None:
    _skip()
    if os.cpu_count() is None:
        pytest.skip("CPU count unknown")
    rows, info, _, errors = run_offcpu(tmp_path, ["contend", str(SECONDS)])
    assert not errors, errors
    total = 0
    for tid in info["tids"]:
        mine = rows[rows["tid"] == tid]
        runnable = int(mine["runnable_ns"].sum())
        blocked = int(mine["blocked_ns"].sum())
        total += runnable
        # two busy threads pinned to CPU 0: each waits for the other about half of the time, more
        # when other work of the machine runs on CPU 0 too
        assert 0.3 * SECONDS * 1e9 <= runnable <= 1.05 * SECONDS * 1e9, (tid, runnable)
        assert blocked < 0.1 * runnable, (tid, blocked)
        # a runnable switch-out keeps no stack (an MPI rank polling with sched_yield switches
        # hundreds of thousands of times a second; two stack walks at each slowed hpcc by 40 %)
        preempted = mine[mine["blocked_ns"] == 0]
        assert len(preempted) and np.all(preempted["user_stack"] == STACK_NONE), preempted
        assert np.all(preempted["kernel_stack"] == STACK_NONE)
    assert np.all(rows["pid"] == info["pid"])
    # what the threads did not run of their lives they waited for CPU 0, whatever the machine's load:
    # their waits and their CPU time add up to the two lifetimes
    lives = 2 * SECONDS * 1e9
    assert abs(total + info["cpu_s"] * 1e9 - lives) <= 0.15 * lives, (total, info["cpu_s"])
