"""Mode `stacks`, CPU half, for real: 99 Hz samples of a program with a known hot function, of
JIT-like code named by a perf map, and nothing of a busy process outside the job."""

from __future__ import annotations

import sys
from collections import Counter
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
from gpuprof.collector.sources.bpf_stacks import BpfStacksSource
from gpuprof.collector.symbolize import STACK_LOST, demangle, folded_stacks, stack_names


def _skip() -> None:
    reason = bpf_skip_reason() or native_progs.cc_skip_reason()
    if reason:
        pytest.skip(reason)


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bpf_support, "bpf_unavailable_reason", lambda: "BPF unavailable: running as root failed")
    with pytest.raises(SourceUnavailable, match="running as root"):
        BpfStacksSource().start(make_ctx(lambda: frozenset(), ("stacks",)))


def test_demangle() -> None:
    assert demangle("_Z10vector_addPfS_S_i") == "vector_add(float*, float*, float*, int)"
    assert demangle("main") == "main"


def run_stacks(tmp_path: Path, args: list[str], outsider: list[str] | None = None,
               rate_hz: float | None = None) -> tuple[Any, dict[str, Any], h5py.File, list[str]]:
    return native_progs.run_cpu_work_under(BpfStacksSource(rate_hz), tmp_path, args, outsider,
                                           schema.STACK_SAMPLES)


@pytest.mark.bpf
def test_hot_function_dominates(tmp_path: Path) -> None:
    _skip()
    rows, info, f, errors = run_stacks(tmp_path, ["hot", "2", "3"], outsider=["hot", "1", "3"])
    assert not errors, errors
    assert set(rows["pid"].tolist()) == {info["pid"]}, "samples of a process outside the job"
    names = stack_names(f)
    workers = rows[np.isin(rows["tid"], info["tids"])]
    total = int(workers["count"].sum())
    # 99 Hz of CPU time: the process's CPU time says how many samples to expect
    expect = 99 * info["cpu_s"]
    assert 0.7 * expect <= int(rows["count"].sum()) <= 1.3 * expect, (int(rows["count"].sum()), expect)
    by_leaf: Counter[tuple[str, ...]] = Counter()
    for r in workers:
        by_leaf[tuple(names.get(int(r["user_stack"]), [])[:2])] += int(r["count"])
    top, n = by_leaf.most_common(1)[0]
    assert top == ("hot_function", "hot_thread") and n >= 0.9 * total, by_leaf
    assert int((workers["user_stack"] == STACK_LOST).sum()) == 0
    folded = folded_stacks(f)
    assert any(k.endswith("hot_thread;hot_function") for k in folded), list(folded)[:5]
    sym = f["stacks/symbols"][()]
    assert b"cpu_work" in set(sym["module"][sym["name"] == b"hot_function"].tolist())


@pytest.mark.bpf
def test_perf_map_names_anonymous_code(tmp_path: Path) -> None:
    """Code in anonymous memory (a JIT, Python's -X perf trampolines) is named by /tmp/perf-PID.map,
    read at seal after the process exited."""
    _skip()
    rows, info, f, errors = run_stacks(tmp_path, ["jit", "2"])
    Path(f"/tmp/perf-{info['pid']}.map").unlink(missing_ok=True)
    assert not errors, errors
    names = stack_names(f)
    worker = rows[rows["tid"] == info["tids"][0]]
    leaf = Counter()
    for r in worker:
        leaf[(names.get(int(r["user_stack"])) or ["?"])[0]] += int(r["count"])
    assert leaf.most_common(1)[0][0] == "jit_spin_loop", leaf
    sym = f["stacks/symbols"][()]
    assert sym["module"][sym["name"] == b"jit_spin_loop"][0] == f"perf-{info['pid']}.map".encode()
