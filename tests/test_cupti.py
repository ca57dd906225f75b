"""CUDA kernel times through CUPTI's activity API (bpf/fastpath/gpuprof_cupti.c), driven by two TEST
DOUBLES: of the CUDA driver's injection (tests/doubles/cuda_driver_double.c loads
CUDA_INJECTION64_PATH and calls InitializeInjection as cuInit does) and of libcupti's activity
buffers (tests/doubles/cupti_activity_double.c: the tool hands out buffers, the double fills them
with kernel records and gives them back). The ring and the collector's drain are the real ones.
No GPU and not CUPTI: the times are the double's, nothing here is a measurement.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

from harness import REPO, collect, make_ctx

from gpuprof.collector import fastpath_env as fe
from gpuprof.collector import schema
from gpuprof.collector.sources import fastpath as fp

DOUBLES = REPO / "tests" / "doubles"
CFG = {"sources.kernels": {"cupti": "auto"}}


@pytest.fixture(scope="module")
def doubles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    proc = subprocess.run(["make", "-C", str(REPO / "bpf" / "fastpath")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path_factory.mktemp("cupti")
    built = {"cupti": out / "libcupti_double.so", "driver": out / "cuda_driver_double"}
    for cmd in (["cc", "-O2", "-Wall", "-Werror", "-std=gnu11", "-shared", "-fPIC", "-o", str(built["cupti"]),
                 str(DOUBLES / "cupti_activity_double.c")],
                ["cc", "-O2", "-Wall", "-Werror", "-std=gnu11", "-o", str(built["driver"]),
                 str(DOUBLES / "cuda_driver_double.c"), "-ldl"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
    return built


def run(doubles: dict[str, Path], rings: Path, job: str, kernels: int, **env: str) -> tuple[int, list[dict[str, Any]]]:
    e = {**os.environ, "GPUPROF_FASTPATH_DIR": str(rings), "GPUPROF_FASTPATH_JOB": job,
         "CUDA_INJECTION64_PATH": str(fe.CUPTI_INJECTION), "GPUPROF_CUPTI_LIBRARY": str(doubles["cupti"]), **env}
    proc = subprocess.run([str(doubles["driver"]), str(kernels)], capture_output=True, text=True, env=e,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout.splitlines()[0])["loaded"]), [json.loads(x) for x in proc.stdout.splitlines()]


def drain(rings: Path, job: str) -> tuple[list[Any], Any]:
    pids = {int(p.name.rsplit("-", 1)[1]) for p in rings.iterdir()}
    ctx = make_ctx(lambda: frozenset(pids), ("kernels",), config=CFG, job_id=job)
    ctx = dataclasses.replace(ctx, uid=os.getuid())
    src = fp.FastpathSource(ring_dir=str(rings))
    src.start(ctx)
    batches = src.final(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    src.stop()
    return batches, src


def rings_dir(tmp_path: Path) -> Path:
    d = tmp_path / "rings"
    d.mkdir(mode=0o700)
    return d


@pytest.mark.parametrize("callback", [True, False])
def test_kernel_times_names_and_launch_ids(doubles: dict[str, Path], tmp_path: Path, callback: bool) -> None:
    rings, n = rings_dir(tmp_path), 300
    env = {} if callback else {"GP_DOUBLE_NO_TIMESTAMP_CALLBACK": "1"}
    loaded, truth = run(doubles, rings, "95", n, **env)
    assert loaded == 1
    batches, src = drain(rings, "95")
    rows = collect(batches, schema.KERNEL_ACTIVITY)
    names = collect(batches, schema.KERNEL_ACTIVITY_NAMES)
    assert src.dropped_total == 0
    assert len(rows) == n and sorted(rows["correlation_id"].tolist()) == list(range(1, n + 1))
    rows = rows[np.argsort(rows["correlation_id"])]
    played = [t for t in truth if t["truth"] == "kernel"]
    start = rows["t_start_ns"][: len(played)].astype(np.int64) - [t["start"] for t in played]
    end = rows["t_end_ns"][: len(played)].astype(np.int64) - [t["end"] for t in played]
    # (the double's kernels "ran" at planned times after their launches, not measured ones)
    # CLOCK_MONOTONIC through the timestamp callback (the double's two clock reads apart); converted
    # from CLOCK_REALTIME without it (the injection's two reads at the delivery: microseconds)
    bound = 1_000 if callback else 50_000
    assert np.abs(start).max() <= bound and np.abs(end).max() <= bound, (start.max(), end.max())
    clock = schema.KERNEL_ACTIVITY.enums["clock"]
    assert set(rows["clock"].tolist()) == {clock.index("monotonic_callback" if callback else "realtime_converted")}
    assert set(rows["stream"].tolist()) == {7, 8} and set(rows["grid_x"].tolist()) == {128, 129, 130}
    assert set(rows["block_x"].tolist()) == {256} and set(rows["registers"].tolist()) == {32}
    # every kernel's launch call, on the launching thread, before its kernel, with its API named
    launches = collect(batches, schema.KERNEL_ACTIVITY_LAUNCHES)
    assert sorted(launches["correlation_id"].tolist()) == list(range(1, n + 1))
    launches = launches[np.argsort(launches["correlation_id"])]
    domain = schema.KERNEL_ACTIVITY_LAUNCHES.enums["domain"]
    driver = (np.arange(n) % 5) == 4
    assert (launches["domain"][driver] == domain.index("driver_api")).all() and (launches["cbid"][driver] == 307).all()
    assert (launches["domain"][~driver] == domain.index("runtime_api")).all()
    assert (launches["cbid"][~driver] == 211).all() and len(set(launches["tid"].tolist())) == 1
    assert set(launches["pid"].tolist()) == set(rows["pid"].tolist())
    text = {int(r["name_id"]): (bytes(r["name"]).decode(), int(r["truncated"])) for r in names}
    assert len(text) == 3  # each name once per process
    by_kernel = [text[int(i)][0] for i in rows["name_id"][:3]]
    assert by_kernel[0] == "_Z6matmulPfS_S_i"
    assert by_kernel[1] == "void at::native::vectorized_elementwise_kernel<4>(int)"
    assert by_kernel[2].startswith("KKKK") and by_kernel[2].endswith("...") and text[int(rows["name_id"][2])][1] == 1


def test_buffers_that_run_out_drop_and_count(doubles: dict[str, Path], tmp_path: Path) -> None:
    """A tool whose buffers are all held (CUPTI delivers none back): CUPTI drops, the counts reach the ring."""
    rings, n = rings_dir(tmp_path), 60_000
    loaded, _ = run(doubles, rings, "96", n, GP_DOUBLE_HOLD_BUFFERS="1", GPUPROF_FASTPATH_RECORDS=str(1 << 17))
    assert loaded == 1
    batches, src = drain(rings, "96")
    kept = len(collect(batches, schema.KERNEL_ACTIVITY))
    per_buffer = (512 * 1024) // 160  # the injection's buffer / the double's record size
    assert kept == 16 * per_buffer  # the injection's whole pool, delivered at the exit flush
    assert src.dropped_total == n - kept  # every kernel CUPTI could not store is counted


def test_declines_without_a_job_or_a_cupti(doubles: dict[str, Path], tmp_path: Path) -> None:
    rings = rings_dir(tmp_path)
    loaded, _ = run(doubles, rings, "97", 5, GPUPROF_CUPTI_LIBRARY="/nonexistent/libcupti.so")
    assert loaded == 0  # the driver goes on without the tool
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPROF_FASTPATH")}
    proc = subprocess.run([str(doubles["driver"]), "5"], capture_output=True, text=True, timeout=60, check=False,
                          env={**env, "CUDA_INJECTION64_PATH": str(fe.CUPTI_INJECTION),
                               "GPUPROF_CUPTI_LIBRARY": str(doubles["cupti"])})
    assert json.loads(proc.stdout.splitlines()[0])["loaded"] == 0
    assert list(rings.iterdir()) == []


def test_exports_in_mode_kernels_and_steps_aside(tmp_path: Path) -> None:
    assert fe.CUPTI_INJECTION.exists(), "make -C bpf/fastpath"
    cfg = make_ctx(lambda: frozenset(), ()).config
    lines = fe.fastpath_exports(("kernels",), cfg, "98", existing_ld_preload="", ring_dir=tmp_path, job_env={})
    assert f"export CUDA_INJECTION64_PATH={fe.CUPTI_INJECTION}" in lines
    assert not any(x.startswith(("export LD_PRELOAD", "export NCCL_PROFILER_PLUGIN")) for x in lines)
    theirs = fe.fastpath_exports(("kernels",), cfg, "98", existing_ld_preload="", ring_dir=tmp_path,
                                 job_env={"CUDA_INJECTION64_PATH": "/opt/nsight/libToolsInjection64.so"})
    assert not any(x.startswith("export CUDA_INJECTION64_PATH") for x in theirs)
    assert any(x.startswith("print gpuprof: CUDA_INJECTION64_PATH is already set") for x in theirs)
    assert fe.fastpath_exports(("metrics",), cfg, "98", ring_dir=tmp_path, job_env={}) == []
