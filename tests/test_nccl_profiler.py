"""The NCCL profiler plugin (bpf/fastpath/gpuprof_nccl_profiler.c) driven by the ABI-level test
double of NCCL (tests/doubles/nccl_profiler_host.c), through the real ring and the collector's
real drain (collector/sources/fastpath.py). The double is not NCCL: what it prints is the truth
it played (GPU timer with an offset and a drift, late observations), and the tests compare the
collector's rows with it; nothing here measures NCCL.
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

from harness import REPO, collect, make_ctx, nccl_library

from gpuprof.collector import fastpath_env as fe
from gpuprof.collector import schema
from gpuprof.collector.sources import fastpath as fp

PLUGIN = fe.NCCL_PROFILER
DOUBLE_SRC = REPO / "tests" / "doubles" / "nccl_profiler_host.c"
OPS = schema.COLLECTIVE_OPS
TIMING = schema.DEVICE_TIMES.enums["timing"]
PLUGIN_CFG = {"sources.collectives": {"nccl_profiler": "auto"}}


@pytest.fixture(scope="module")
def double(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build bpf/fastpath")
    proc = subprocess.run(["make", "-C", str(REPO / "bpf" / "fastpath")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path_factory.mktemp("double") / "nccl_profiler_host"
    proc = subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-std=gnu11", "-o", str(out), str(DOUBLE_SRC), "-ldl"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return out


def ring_dir(tmp_path: Path) -> Path:
    d = tmp_path / "rings"
    d.mkdir(mode=0o700)
    return d


def run_ranks(double: Path, rings: Path, job: str, nranks: int, *extra: str, env: dict[str, str] | None = None,
              records: int | None = None) -> list[tuple[int, list[dict[str, Any]]]]:
    """nranks processes of the double, one rank each, at the same time; (pid, truth lines) per rank."""
    e = {**os.environ, "GPUPROF_FASTPATH_DIR": str(rings), "GPUPROF_FASTPATH_JOB": job, **(env or {})}
    if records:
        e["GPUPROF_FASTPATH_RECORDS"] = str(records)
    procs = [subprocess.Popen([str(double), str(PLUGIN), "--rank", str(r), "--nranks", str(nranks), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
             for r in range(nranks)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode in (0, 3), stderr
        out.append((p.pid, [json.loads(line) for line in stdout.splitlines()]))
    return out


def drain(rings: Path, job: str, pids: set[int], errors: list[str] | None = None) -> tuple[list[Any], Any]:
    """The collector's fast-path source over the ring directory: its final rows, and the source."""
    ctx = make_ctx(lambda: frozenset(pids), ("collectives",), config=PLUGIN_CFG, errors=errors, job_id=job)
    ctx = dataclasses.replace(ctx, uid=os.getuid())  # the rings' writers have exited: name the owner
    src = fp.FastpathSource(ring_dir=str(rings))
    src.start(ctx)
    batches = src.final(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    src.stop()
    return batches, src


def test_every_version_exported_and_the_real_libnccl_finds_one() -> None:
    assert PLUGIN.exists(), "make -C bpf/fastpath"
    syms = subprocess.run(["nm", "-D", "--defined-only", str(PLUGIN)], capture_output=True, text=True,
                          check=True).stdout
    exported = {int(line.rsplit("_v", 1)[1]) for line in syms.splitlines() if " ncclProfiler_v" in line}
    assert exported == {1, 2, 3, 4, 5, 6, 7}
    lib = nccl_library()
    if lib is None:
        pytest.skip("no nvidia-nccl-cu12 wheel: cannot see which versions a real libnccl looks up")
    strings = subprocess.run(["strings", str(lib)], capture_output=True, text=True, check=True).stdout.split()
    looked_up = {int(s.rsplit("_v", 1)[1]) for s in strings if s.startswith("ncclProfiler_v") and s[14:].isdigit()}
    # NCCL takes the newest it knows that the plugin exports: that must be one of ours
    assert max(looked_up & exported) == max(looked_up), looked_up


@pytest.mark.parametrize("version", [7, 6, 5, 4])
def test_ranks_get_one_communicator_sequences_and_device_times_on_the_host_clock(
        double: Path, tmp_path: Path, version: int) -> None:
    rings, nranks, ops = ring_dir(tmp_path), 3, 24
    ranks = run_ranks(double, rings, "81", nranks, "--knows", str(version), "--ops", str(ops), "--sleep-us", "40000",
                      "--hash", "0xfeedbeef", "--drift-ppm", "60")
    batches, src = drain(rings, "81", {pid for pid, _ in ranks})
    calls = collect(batches, schema.COLLECTIVE_CALLS)
    dev = collect(batches, schema.DEVICE_TIMES)
    comms = collect(batches, schema.COMMUNICATORS)
    cid = fp.nccl_comm_id(0xFEEDBEEF)
    assert src.drops() == 0
    assert len(comms) == nranks and set(comms["comm_id"].tolist()) == {cid}
    assert sorted(comms["comm_rank"].tolist()) == list(range(nranks)) and set(comms["comm_size"].tolist()) == {nranks}
    assert (calls["path"] == fp.PLUGIN_PATH).all() and (calls["library"] == fp.NCCL_LIB).all()
    worst = 0
    errs: list[int] = []
    for rank, (pid, truth) in enumerate(ranks):
        assert truth[0] == {"truth": "init", "version": version, "rc": 0, "mask": truth[0]["mask"], "pid": pid}
        mine = calls[calls["pid"] == pid]
        ar = mine[mine["op"] == OPS.index("ncclAllReduce")]
        assert ar["seq"].tolist() == list(range(ops))  # the same on every rank: NCCL's order
        assert set(ar["comm_id"].tolist()) == {cid} and set(ar["comm_rank"].tolist()) == {rank}
        assert set(ar["bytes"].tolist()) == {4096}  # 1024 x ncclFloat32
        played = [t for t in truth if t["truth"] == "op"]
        assert ar["t_enter_ns"].tolist() >= [t["enqueue_start"] for t in played]
        sends = mine[mine["op"] == OPS.index("ncclSend")]
        recvs = mine[mine["op"] == OPS.index("ncclRecv")]
        assert sends["seq"].tolist() == list(range(ops // 4)) == recvs["seq"].tolist()
        assert set(sends["root_or_peer"].tolist()) == {(rank + 1) % nranks}
        assert set(recvs["root_or_peer"].tolist()) == {(rank - 1) % nranks}
        d = dev[dev["pid"] == pid]
        # one row per operation: the PXN proxy op of another process's operation adds none
        assert len(d) == len(mine)
        assert set(d["timing"].tolist()) == {TIMING.index("kernel_channel_gpu_timer")}
        d_ar = d[d["op"] == OPS.index("ncclAllReduce")]
        d_ar = d_ar[np.argsort(d_ar["seq"])]
        assert d_ar["seq"].tolist() == list(range(ops))
        assert set(d_ar["n_channels"].tolist()) == {2}
        assert set(d_ar["algorithm"].tolist()) == {schema.DEVICE_TIMES.enums["algorithm"].index("ring")}
        assert set(d_ar["protocol"].tolist()) == {schema.DEVICE_TIMES.enums["protocol"].index("simple")}
        assert set(d_ar["datatype"].tolist()) == {schema.DEVICE_TIMES.enums["datatype"].index("float32")}
        err = np.abs(np.concatenate([d_ar["t_dev_start_ns"].astype(np.int64) - [t["dev_start"] for t in played],
                                     d_ar["t_dev_end_ns"].astype(np.int64) - [t["dev_end"] for t in played]]))
        worst = max(worst, int(err.max()))
        errs.extend(err.tolist())
    # The drift (60 ppm over ~1 s: ~60 us) is followed; what is left is the delay of the best pair of
    # each neighbourhood (the double's delays are 1..30 us, some 2 ms), so the worst bound sits above
    # 30 us (25 us failed once in CI, at 25.8: a neighbourhood whose best pair was that late on a
    # busy VM) and catches a 2 ms pair taken for a good one. A constant offset, wherever it were
    # fitted, would leave a median error of 15 us or more over the ~60 us the drift makes: the
    # median's bound catches that.
    assert worst < 40_000, worst
    assert np.median(errs) < 5_000, np.median(errs)
    # what the merge makes of them (mpi_merge/loading.call_rows): every operation, collective or
    # point to point, takes its own kernel's times (the join names the op and the peer)
    from gpuprof.mpi_merge.loading import ClockMap, call_rows

    rows = call_rows(calls, ClockMap(np.zeros(1, np.int64), np.zeros(1, np.int64), "pairs"), dev)
    assert rows["device_timed"].all()
    for r, c in zip(rows, calls):
        d = dev[(dev["pid"] == c["pid"]) & (dev["seq"] == c["seq"]) & (dev["op"] == c["op"])
                & (dev["root_or_peer"] == c["root_or_peer"])]
        assert len(d) == 1 and r["enter_rt"] == int(d["t_dev_start_ns"][0]) and r["exit_rt"] == int(d["t_dev_end_ns"][0])
        assert r["host_enter_rt"] == int(c["t_enter_ns"])


def test_device_clock_mapping_follows_offset_and_drift() -> None:
    """DeviceClock alone: pairs with random non-negative delays of a timer that runs 80 ppm fast."""
    rng = np.random.default_rng(3)
    host = np.sort(rng.uniform(1e9, 5e9, 4000)).astype(np.int64)
    gpu = (1_700_000_000_000_000_000 + host + (host - 1e9) * 80e-6).astype(np.int64)
    delay = rng.exponential(10_000, len(host)).astype(np.int64) + 500
    clock = fp.DeviceClock()
    clock.add((host + delay).astype(np.uint64), (host + delay) - gpu)
    mapped = clock.to_host(gpu.astype(np.uint64)).astype(np.int64)
    err = np.abs(mapped - host)
    assert err.max() < 5_000, err.max()
    naive = np.abs(gpu + np.min((host + delay) - gpu) - host)  # one offset for the whole run
    assert naive.max() > 100_000  # what the drift does without the windows


@pytest.mark.parametrize("version,timing", [(3, "kernel_channel_host"), (2, "proxy_step_host"),
                                            (1, "proxy_step_host")])
def test_older_versions_give_host_observed_device_times(double: Path, tmp_path: Path, version: int,
                                                        timing: str) -> None:
    rings, ops = ring_dir(tmp_path), 8
    ranks = run_ranks(double, rings, "82", 2, "--knows", str(version), "--ops", str(ops), "--hash", "77")
    batches, _ = drain(rings, "82", {pid for pid, _ in ranks})
    calls = collect(batches, schema.COLLECTIVE_CALLS)
    dev = collect(batches, schema.DEVICE_TIMES)
    comms = collect(batches, schema.COMMUNICATORS)
    # v1..v3 have no commHash in init: the communicator is announced at its first operation
    assert len(comms) == 2 and set(comms["comm_id"].tolist()) == {fp.nccl_comm_id(77)}
    assert set(comms["comm_size"].tolist()) == {-1}  # those versions do not say the size
    for pid, truth in ranks:
        assert truth[0]["version"] == version
        ar = calls[(calls["pid"] == pid) & (calls["op"] == OPS.index("ncclAllReduce"))]
        assert ar["seq"].tolist() == list(range(ops))
        d = dev[(dev["pid"] == pid) & (dev["op"] == OPS.index("ncclAllReduce"))]
        assert len(d) == ops and set(d["timing"].tolist()) == {TIMING.index(timing)}
        d = d[np.argsort(d["seq"])]
        assert (d["t_dev_end_ns"] > d["t_dev_start_ns"]).all()
        assert (d["t_dev_start_ns"] >= ar["t_enter_ns"]).all()  # host clock: after the enqueue began


def test_unknown_interface_version_is_declined_cleanly(double: Path, tmp_path: Path) -> None:
    rings = ring_dir(tmp_path)
    [(_, truth)] = run_ranks(double, rings, "83", 1, "--knows", "99")
    assert truth == [{"truth": "declined", "reason": "no known ncclProfiler version"}]
    assert list(rings.iterdir()) == []  # nothing loaded, nothing written


def test_plugin_declines_outside_a_profiled_step(double: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPROF_")}
    out = subprocess.run([str(double), str(PLUGIN), "--ops", "3"], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout
    init = json.loads(out.splitlines()[0])
    assert init["truth"] == "init" and init["rc"] != 0  # NCCL unloads the plugin and goes on


def test_full_ring_drops_and_counts_and_never_blocks(double: Path, tmp_path: Path) -> None:
    rings, ops = ring_dir(tmp_path), 3000
    t0 = time.monotonic()
    [(pid, truth)] = run_ranks(double, rings, "84", 1, "--ops", str(ops), "--bench", records=64)
    assert time.monotonic() - t0 < 30
    assert truth[-1]["truth"] == "done"
    batches, src = drain(rings, "84", {pid})
    kept = len(collect(batches, schema.COLLECTIVE_CALLS)) + len(collect(batches, schema.DEVICE_TIMES)) + \
        len(collect(batches, schema.COMMUNICATORS))
    assert kept == 64  # the ring's capacity: nobody drained it while the rank ran
    assert src.dropped_total == 1 + 2 * ops - 64  # every record not written is counted


@pytest.mark.parametrize("conversion", ["native", "numpy"])
def test_forked_process_writes_its_own_ring(double: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            conversion: str) -> None:
    """Also: the plugin's records beside the calls' conversion, in C (ringrows.c skips them) and numpy."""
    if conversion == "numpy":
        monkeypatch.setattr(fp, "_native_ring_rows", lambda: None)
    else:
        assert fp._native_ring_rows() is not None, "collector/native not built (make setup builds it)"
    rings, ops = ring_dir(tmp_path), 6
    [(pid, truth)] = run_ranks(double, rings, "85", 1, "--ops", str(ops), "--fork")
    child = next(t["pid"] for t in truth if t["truth"] == "child")
    batches, _ = drain(rings, "85", {pid, child})
    calls = collect(batches, schema.COLLECTIVE_CALLS)
    dev = collect(batches, schema.DEVICE_TIMES)
    for p in (pid, child):
        ar = calls[(calls["pid"] == p) & (calls["op"] == OPS.index("ncclAllReduce"))]
        assert ar["seq"].tolist() == list(range(ops)), p
        assert len(dev[dev["pid"] == p]) == ops, p
    assert {r.name for r in rings.iterdir()} == set()  # drained rings are removed by stop()


def test_job_with_its_own_plugin_keeps_it_and_is_told(tmp_path: Path) -> None:
    assert PLUGIN.exists(), "make -C bpf/fastpath"
    cfg = make_ctx(lambda: frozenset(), ()).config
    lines = fe.fastpath_exports(("collectives",), cfg, "86", existing_ld_preload="", ring_dir=tmp_path,
                                job_env={"NCCL_PROFILER_PLUGIN": "/opt/inspector/libnccl-profiler-inspector.so"})
    assert not any(line.startswith("export NCCL_PROFILER_PLUGIN=") for line in lines)
    assert any(line.startswith("print gpuprof: NCCL_PROFILER_PLUGIN is already set by the job") for line in lines)
    ours = fe.fastpath_exports(("collectives",), cfg, "86", existing_ld_preload="", ring_dir=tmp_path, job_env={})
    assert f"export NCCL_PROFILER_PLUGIN={PLUGIN}" in ours
    # the collector says so too, for the process that has it (/diagnostics/errors)
    rings = ring_dir(tmp_path)
    env = {**os.environ, "NCCL_PROFILER_PLUGIN": "/opt/inspector/libnccl-profiler-inspector.so"}
    proc = subprocess.Popen(["sleep", "30"], env=env)
    try:
        errors: list[str] = []
        drain(rings, "86", {proc.pid}, errors)
    finally:
        proc.kill()
        proc.wait()
    assert any("sets NCCL_PROFILER_PLUGIN=/opt/inspector" in e and "stepped aside" in e for e in errors), errors


def _node_file(path: Path, node: str, rows: dict[str, np.ndarray], wall_offset_ns: int) -> None:
    """One node's file of what the collector drained, its wall clock `wall_offset_ns` off the host's
    (an NTP error injected into the clock pairs: the double's ranks share one host clock)."""
    from gpuprof.collector.writer import NodeMeta, NodeTraceWriter

    mono0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    boot = time.clock_gettime_ns(time.CLOCK_REALTIME) - mono0 + wall_offset_ns
    meta = NodeMeta(job_id="84", node=node, modes=("collectives",), hostname=node, boot_id=f"boot-of-{node}",
                    job_nodelist="nodeA,nodeB")
    w = NodeTraceWriter(path, meta, schema.tables_for_modes(("collectives",)), compression="none",
                        start_monotonic_ns=int(rows["t0"]), start_realtime_ns=int(rows["t0"]) + boot)
    pairs = schema.CLOCK_PAIRS.empty(60)
    pairs["monotonic_ns"] = np.linspace(int(rows["t0"]), mono0, 60).astype(np.int64)
    pairs["realtime_ns"] = pairs["monotonic_ns"].astype(np.int64) + boot
    pairs["uncertainty_ns"] = 200
    w.append(schema.CLOCK_PAIRS.path, pairs)
    for table in (schema.COLLECTIVE_CALLS, schema.DEVICE_TIMES, schema.COMMUNICATORS):
        w.append(table.path, rows[table.path])
    w.seal(drops={"collectives": 0})  # the drain counted none (asserted by the caller)


@pytest.mark.parametrize("cause", ["gpu", "host"])
def test_an_nccl_only_job_through_the_plugin_is_aligned_and_its_straggler_named(
        double: Path, tmp_path: Path, cause: str) -> None:
    """Issue 14's end to end on the double: 4 ranks whose AllReduce kernels wait for each other
    (--coord), rank 2 late in ops 60..120 (its GPU busy, or its host late), through the plugin, the
    rings and the collector's drain, written as two nodes' files with node B's wall clock 2.5 ms off;
    the merge finds the offset from the kernels' device times and names rank 2's node, with its cause
    from the enqueue."""
    from gpuprof.mpi_merge.analysis import analyze
    from gpuprof.mpi_merge.loading import discover, summarize_node

    rings, nranks, ops = ring_dir(tmp_path), 4, 160
    coord = tmp_path / "coord"
    coord.write_bytes(bytes(ops * nranks * 8))
    env = {**os.environ, "GPUPROF_FASTPATH_DIR": str(rings), "GPUPROF_FASTPATH_JOB": "84"}
    late = ["--late-gpu-us" if cause == "gpu" else "--late-host-us", "3000", "--late-ops", "60:120"]
    procs = [subprocess.Popen([str(double), str(PLUGIN), "--rank", str(r), "--nranks", str(nranks), "--ops", str(ops),
                               "--hash", "0xc0ffee", "--sleep-us", "6000", "--coord", str(coord),
                               *(late if r == 2 else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(nranks)]
    pids = []
    for p in procs:
        _, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        pids.append(p.pid)
    batches, src = drain(rings, "84", set(pids))
    assert src.drops() == 0
    tables = {t.path: collect(batches, t) for t in (schema.COLLECTIVE_CALLS, schema.DEVICE_TIMES, schema.COMMUNICATORS)}
    t0 = int(tables[schema.COLLECTIVE_CALLS.path]["t_enter_ns"].min()) - 1_000_000_000
    job = tmp_path / "job"
    job.mkdir()
    for node, ranks, off in (("nodeA", pids[:2], 0), ("nodeB", pids[2:], 2_500_000)):
        mine = {path: rows[np.isin(rows["pid"], ranks)] for path, rows in tables.items()}
        _node_file(job / f"{node}.h5", node, {**mine, "t0": np.int64(t0)}, off)
    a = analyze([summarize_node(p) for p in discover(job)])
    assert a.clock.causality_violations == 0 and a.clock.instances_used >= ops - 5
    b = a.clock.model("nodeB")
    assert b.aligned
    # the injected 2.5 ms found from the kernels' ends (the double's are synchronous; what is left
    # is the plugin's GPU-timer-to-host mapping on a busy 2-core machine)
    x = np.median(tables[schema.COLLECTIVE_CALLS.path]["t_enter_ns"].astype(np.float64)) - t0
    assert abs(float(b.offset_ns(x)) - 2_500_000) < 20_000, b.offset_ns(x)  # about 1 us when the machine is quiet
    assert [(f.node, f.cause) for f in a.findings] == [("nodeB", cause)], [(f.node, f.cause, f.evidence)
                                                                           for f in a.findings]
