"""Mode `kernels`, for real without a GPU: every launch entry point of the CUDA TEST DOUBLE
(tests/progs/fake_cuda.c) decoded (grid, block, shared memory, stream, name, stack), found by the
process scan in a library the job dlopens; the real libcudart of the nvidia-cuda-runtime-cu12
wheel attached and its runtime launches decoded (they fail without a GPU, after the probe fired)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import h5py
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

import native_progs
from harness import GatedProcess, bpf_skip_reason, collect, make_ctx, run_source_over

from gpuprof.collector import bpf_support, schema
from gpuprof.collector.sources.base import SourceUnavailable
from gpuprof.collector.sources.bpf_kernels import LAUNCH_PROBES, BpfKernelsSource
from gpuprof.collector.symbolize import stack_names

APIS = schema.KERNEL_APIS
SOURCES = schema.KERNEL_FUNCTIONS.enums["source"]


def _skip() -> None:
    reason = bpf_skip_reason() or native_progs.cc_skip_reason()
    if reason:
        pytest.skip(reason)


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bpf_support, "bpf_unavailable_reason", lambda: "BPF unavailable: kernel headers failed")
    with pytest.raises(SourceUnavailable, match="kernel headers"):
        BpfKernelsSource().start(make_ctx(lambda: frozenset(), ("kernels",)))


def run_launches(tmp_path: Path, lib: Path, repeat: int = 2, attach_first: bool = False
                 ) -> tuple[Any, dict[str, Any], h5py.File, list[str], list[str]]:
    """The driver under the source; a second driver outside the job runs at the same time."""
    prog = str(native_progs.cuda_launches())
    # the driver dlopens the library, then waits for the collector's scan to attach to it
    env = {**os.environ, "CUDA_LAUNCHES_WAIT_S": "2.0"}
    gated = GatedProcess([prog, str(lib), str(repeat)], env=env)
    other = GatedProcess([prog, str(lib), str(repeat)], env=env)
    errors: list[str] = []
    ctx = make_ctx(lambda: frozenset({gated.pid}), ("kernels",), errors=errors)
    src = BpfKernelsSource()
    attached: list[str] = []
    if attach_first:
        src.start(ctx)
        attached = src.attach_file(str(lib))
        src.start = lambda ctx: None  # type: ignore[method-assign]  # started above
    other.go()
    batches, (rc, out, err) = run_source_over(src, ctx, gated, poll_s=0.2)
    orc, _, oerr = other.wait()
    assert rc == 0 and orc == 0, err + oerr
    path = tmp_path / "node.h5"
    native_progs.sealed_file(path, [src], batches, ("kernels",))
    return (collect(batches, schema.KERNEL_LAUNCHES), json.loads(out.strip().splitlines()[-1]), h5py.File(path),
            errors, attached)


def check_launches(rows: Any, info: dict[str, Any], f: h5py.File) -> None:
    assert set(rows["pid"].tolist()) == {info["pid"]}, "launches of a process outside the job"
    want = info["launches"]
    assert len(rows) == len(want), (rows, want)
    funcs = {(int(r["pid"]), int(r["function"])): r for r in f["kernels/functions"][()]}
    names = stack_names(f)
    for r, w in zip(sorted(rows, key=lambda r: int(r["t_ns"])), want):
        assert APIS[int(r["api"])] == w["api"]
        assert [int(r["grid_x"]), int(r["grid_y"]), int(r["grid_z"])] == w["grid"], w["api"]
        assert [int(r["block_x"]), int(r["block_y"]), int(r["block_z"])] == w["block"], w["api"]
        assert int(r["shared_mem_bytes"]) == w["shared"] and int(r["stream"]) == w["stream"], w["api"]
        assert int(r["function"]) == w["function"], w["api"]
        fn = funcs[(info["pid"], w["function"])]
        assert fn["name"].decode() == w["name"], (w["api"], fn)
        want_src = {"cuLaunchKernel": "cuModuleGetFunction", "cuLaunchKernelEx": "cuLibraryGetKernel"}
        assert SOURCES[int(fn["source"])] == want_src.get(w["api"], "stub_symbol")
        assert "launch_site" in names.get(int(r["user_stack"]), []), names.get(int(r["user_stack"]))


@pytest.mark.bpf
def test_double_every_entry_point_decoded(tmp_path: Path) -> None:
    _skip()
    lib = native_progs.fake_cuda()
    rows, info, f, errors, _ = run_launches(tmp_path, lib)
    assert not errors, errors
    assert info["lookup_ret"] == 0
    assert {w["api"] for w in info["launches"]} == set(APIS)
    check_launches(rows, info, f)


@pytest.mark.bpf
def test_real_libcudart_attached_and_decoded(tmp_path: Path) -> None:
    _skip()
    lib = native_progs.cudart_library()
    if lib is None:
        pytest.skip("nvidia-cuda-runtime-cu12 is not installed in this environment (test extra)")
    rows, info, f, errors, attached = run_launches(tmp_path, lib, attach_first=True)
    assert not errors, errors
    assert {s for s in LAUNCH_PROBES if s.startswith("cuda")} <= set(attached), attached
    # no GPU here: the calls fail (cudaErrorInsufficientDriver / NoDevice) after the probe fired
    assert all(w["ret"] != 0 for w in info["launches"]) or os.path.exists("/dev/nvidia0")
    check_launches(rows, info, f)
