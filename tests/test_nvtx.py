"""NVTX ranges through NVTX's own injection interface, for real: the NVTX v3 headers in a C job and
NVIDIA's `nvtx` Python package in a Python job load bpf/fastpath/build/libgpuprof_nvtx.so from
NVTX_INJECTION64_PATH as they would any tool, and the collector drains its ring into /nvtx/ranges
and /nvtx/strings. No GPU is involved: NVTX needs none. First in-process over a ring directory of
the test, then on the local cluster under `sbatch --profile-gpu=collectives`.
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

from harness import REPO, collect, make_ctx, python

from gpuprof.collector import fastpath_env as fe
from gpuprof.collector import schema
from gpuprof.collector.sources import fastpath as fp

PROGS = REPO / "tests" / "progs"
NVTX_CFG = {"sources.nvtx": {"inject": "on"}}
KIND = schema.NVTX_RANGES.enums["kind"]


def nvtx_headers() -> Path | None:
    """NVIDIA's NVTX v3 headers from the nvidia-nvtx-cu12 wheel (the test extra)."""
    found = sorted((REPO / ".venv" / "lib").glob("python3*/site-packages/nvidia/nvtx/include"))
    return found[0] if found and (found[0] / "nvtx3" / "nvToolsExt.h").exists() else None


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The injection library and the C job (built with NVIDIA's headers)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    proc = subprocess.run(["make", "-C", str(REPO / "bpf" / "fastpath")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    headers = nvtx_headers()
    assert headers is not None, "pip install nvidia-nvtx-cu12 (the test extra): the NVTX v3 headers"
    out = tmp_path_factory.mktemp("nvtx") / "nvtx_job"
    proc = subprocess.run(["cc", "-O2", "-Wall", f"-I{headers}", "-o", str(out), str(PROGS / "nvtx_job.c"),
                           "-ldl", "-lpthread"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    out.parent.chmod(0o755)
    return out


def run_injected(cmd: list[str], rings: Path, job: str, inject: bool = True) -> int:
    env = {**os.environ, "GPUPROF_FASTPATH_DIR": str(rings), "GPUPROF_FASTPATH_JOB": job}
    if inject:
        env[fp.NVTX_INJECTION64_PATH] = str(fe.NVTX_INJECTION)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return proc.pid


def drain(rings: Path, job: str, pids: set[int]) -> tuple[np.ndarray, dict[tuple[int, int], tuple[str, int]], int]:
    ctx = make_ctx(lambda: frozenset(pids), ("collectives",), config=NVTX_CFG, job_id=job)
    ctx = dataclasses.replace(ctx, uid=os.getuid())
    src = fp.FastpathSource(ring_dir=str(rings))
    src.start(ctx)
    batches = src.final(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    src.stop()
    return collect(batches, schema.NVTX_RANGES), strings_of(collect(batches, schema.NVTX_STRINGS)), \
        src.dropped_total


def strings_of(rows: np.ndarray) -> dict[tuple[int, int], tuple[str, int]]:
    return {(int(r["pid"]), int(r["string_id"])): (bytes(r["text"]).decode("utf-8"), int(r["truncated"]))
            for r in rows}


def named(ranges: np.ndarray, strings: dict[tuple[int, int], tuple[str, int]], name: str) -> np.ndarray:
    """The ranges whose message is `name` (string ids are per process)."""
    keys = {key for key, (text, _) in strings.items() if text == name}
    return ranges[[(int(r["pid"]), int(r["name_id"])) in keys for r in ranges]] if len(ranges) else ranges


def domain_name(row: Any, strings: dict[tuple[int, int], tuple[str, int]]) -> str:
    return strings[(int(row["pid"]), int(row["domain_id"]))][0] if row["domain_id"] else ""


def check_c_job(ranges: np.ndarray, strings: dict[tuple[int, int], tuple[str, int]], pid: int, n: int) -> None:
    mine = ranges[ranges["pid"] == pid]
    step = named(mine, strings, "step")
    assert len(step) == n and (step["kind"] == KIND.index("push_pop")).all() and (step["depth"] == 0).all()
    fwd = named(mine, strings, "forward")  # a registered string in a created domain
    assert len(fwd) == n and {domain_name(r, strings) for r in fwd} == {"training"}
    assert set(fwd["category"].tolist()) == {7} and set(fwd["color"].tolist()) == {0xFF00FF00}
    assert (fwd["depth"] == 0).all()  # the first of its own domain on the thread
    bwd = named(mine, strings, "backward \u00e9\u4e2d")  # a wide string, as UTF-8
    assert len(bwd) == n and (bwd["depth"] == 1).all()
    assert (bwd["t_end_ns"] - bwd["t_start_ns"] >= 200_000).all()  # spun 200 us inside it
    for s, b in zip(np.sort(step["t_start_ns"]), np.sort(bwd["t_start_ns"])):
        assert s <= b
    worker = named(mine, strings, "worker_step")
    assert len(worker) == n and len(set(worker["tid"].tolist())) == 1
    assert set(worker["tid"].tolist()) != set(step["tid"].tolist())  # another thread
    [handed] = named(mine, strings, "handed_over")  # started on main, ended on the worker
    assert handed["kind"] == KIND.index("start_end") and handed["t_end_ns"] > handed["t_start_ns"]
    assert handed["tid"] == step["tid"][0]
    [huge] = [(text, t) for (p, _), (text, t) in strings.items() if p == pid and text.startswith("xxxx")]
    assert huge[1] == 1 and huge[0].endswith("...") and len(huge[0].encode()) <= 127
    markup = '<b>markup</b> & "quotes" \' \\n %s %n \x1b[31mred'
    assert len(named(mine, strings, markup)) == 1  # kept byte for byte, nothing interpreted
    deep = named(mine, strings, "deep")  # 70 nested: the 64 outermost recorded, 6 counted as dropped
    assert sorted(deep["depth"].tolist()) == list(range(64))
    [left] = named(mine, strings, "left_open_at_exit")
    assert left["t_end_ns"] == 0  # still open when the process exited


def test_c_job_ranges(built: Path, tmp_path: Path) -> None:
    rings = tmp_path / "rings"
    rings.mkdir(mode=0o700)
    pid = run_injected([str(built), "6"], rings, "91")
    ranges, strings, dropped = drain(rings, "91", {pid})
    assert dropped == 6  # the pushes deeper than 64
    check_c_job(ranges, strings, pid, 6)


def check_python_job(ranges: np.ndarray, strings: dict[tuple[int, int], tuple[str, int]], pid: int,
                     steps: int) -> None:
    mine = ranges[ranges["pid"] == pid]
    for name, depth in (("step", 0), ("forward", 1), ("backward", 1), ("optimizer", 1)):
        rows = named(mine, strings, name)
        assert len(rows) == steps, name
        assert {domain_name(r, strings) for r in rows} == {"train"}, name
        assert (rows["depth"] == depth).all(), name
    assert set(named(mine, strings, "step")["category"].tolist()) == {3}
    fwd = named(mine, strings, "forward")
    assert (fwd["t_end_ns"] - fwd["t_start_ns"] >= 2_000_000).all()  # busy 2 ms inside
    [ev] = named(mine, strings, "evaluation")
    assert ev["kind"] == KIND.index("start_end") and ev["domain_id"] == 0
    [cut] = [(text, t) for (p, _), (text, t) in strings.items() if p == pid and text.startswith("<phase")]
    assert cut[0].startswith("<phase name='x&y'>\u00fcber long") and cut[1] == 1 and cut[0].endswith("...")


def test_python_nvtx_package_ranges(built: Path, tmp_path: Path) -> None:
    pytest.importorskip("nvtx")
    rings = tmp_path / "rings"
    rings.mkdir(mode=0o700)
    pid = run_injected([python(), str(PROGS / "nvtx_train.py"), "5"], rings, "92")
    ranges, strings, dropped = drain(rings, "92", {pid})
    assert dropped == 0
    check_python_job(ranges, strings, pid, 5)


def test_without_injection_nothing_is_recorded(built: Path, tmp_path: Path) -> None:
    rings = tmp_path / "rings"
    rings.mkdir(mode=0o700)
    run_injected([str(built), "3"], rings, "93", inject=False)
    assert list(rings.iterdir()) == []  # NVTX stayed inert: no tool, no ring


def test_exports_nvtx_when_the_job_asks_and_steps_aside_for_its_own(tmp_path: Path) -> None:
    assert fe.NVTX_INJECTION.exists(), "make -C bpf/fastpath"
    cfg = make_ctx(lambda: frozenset(), ()).config
    asked = fe.fastpath_exports(("collectives",), cfg, "94", existing_ld_preload="", ring_dir=tmp_path,
                                job_env={"GPUPROF_NVTX": "1"})
    assert f"export NVTX_INJECTION64_PATH={fe.NVTX_INJECTION}" in asked
    quiet = fe.fastpath_exports(("collectives",), cfg, "94", existing_ld_preload="", ring_dir=tmp_path, job_env={})
    assert not any("NVTX_INJECTION64_PATH" in line for line in quiet)
    theirs = fe.fastpath_exports(("collectives",), cfg, "94", existing_ld_preload="", ring_dir=tmp_path,
                                 job_env={"GPUPROF_NVTX": "1", "NVTX_INJECTION64_PATH": "/opt/nsys/libinj.so"})
    assert not any(line.startswith("export NVTX_INJECTION64_PATH") for line in theirs)
    assert any(line.startswith("print gpuprof: NVTX_INJECTION64_PATH is already set") for line in theirs)
    with pytest.raises(ValueError, match="sources.nvtx.inject"):
        fe.nvtx_on({"sources.nvtx": {"inject": "sometimes"}}, {})


# --- on the local cluster ----------------------------------------------------------------------------
@pytest.mark.slurm
def test_nvtx_jobs_on_the_cluster(built: Path, cluster: Any, test_user: str, user_tmpdir: Path) -> None:
    pytest.importorskip("nvtx")
    from gpuprof.collector.reader import open_node_trace

    # the job's user reads everything from its own directory (pytest's tmp tree is root's, 0700)
    work = user_tmpdir
    job_bin = work / "nvtx_job"
    shutil.copy(built, job_bin)
    script = work / "job.sh"
    # each lingers 1.5 s: the collector reads a ring only of a process its tracker saw (1 s scans);
    # it may have ended before the next drain, 2 s apart: the fast path asks the tracker for recent pids
    script.write_text(f"#!/bin/sh\nexport GPUPROF_NVTX=1\nsrun -n1 {job_bin} 4 1500\nsrun -n1 {python()} "
                      f"{PROGS / 'nvtx_train.py'} 3 1.5\n")
    for f in (job_bin, script):
        f.chmod(0o755)
    job = cluster.sbatch(["-N1", "--profile-gpu=collectives", f"--chdir={work}", str(script)], user=test_user,
                         cwd=work)
    info = cluster.wait_job(job, timeout=300)
    assert info["JobState"] == "COMPLETED", (work / f"slurm-{job}.out").read_text()
    node_dir = work / f"slurm-{job}.gpuprof.d"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(node_dir.glob("*.h5")):
        time.sleep(0.5)
    [node_file] = list(node_dir.glob("*.h5"))
    trace = open_node_trace(node_file)
    ranges = trace.table(schema.NVTX_RANGES.path)
    strings = strings_of(trace.table(schema.NVTX_STRINGS.path))
    pids = sorted(set(ranges["pid"].tolist()))
    fastpath = json.loads(trace.attrs["fastpath_json"])
    # what a failure needs first (CI prints only the start): refused rings, then the errors
    why = (pids, fastpath["rings"], fastpath["refused_detail"],
           [bytes(m).decode() for m in trace.table(schema.DIAG_ERRORS.path)["message"]],
           trace.table(schema.PROCESS_EVENTS.path)[["pid", "event", "comm"]].tolist(),
           (work / f"slurm-{job}.out").read_text())
    assert len(pids) == 2, why
    by_pid = {pid: {text for (p, _), (text, _) in strings.items() if p == pid} for pid in pids}
    c_pid = next(p for p in pids if "worker_step" in by_pid[p])
    py_pid = next(p for p in pids if "optimizer" in by_pid[p])
    check_c_job(ranges, strings, c_pid, 4)
    check_python_job(ranges, strings, py_pid, 3)
