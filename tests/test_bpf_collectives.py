"""Uprobe path of mode `collectives`, for real: a 4-rank Open MPI job, and the real libnccl."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

from harness import (
    PROGS,
    GatedProcess,
    bpf_skip_reason,
    check_bursts,
    check_completions,
    check_mpi_plan,
    check_nccl,
    collect,
    make_ctx,
    mpi_skip_reason,
    mpirun_cmd,
    nccl_library,
    python,
    run_source_over,
)

NCCL_LIB = nccl_library()

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import OPS_HEADER, ops_header
from gpuprof.collector.sources import bpf_collectives as bc
from gpuprof.collector.sources import collective_calls as cc
from gpuprof.collector.sources import probe_table as pt

NRANKS = 4


def test_ops_header_matches_schema() -> None:
    assert OPS_HEADER.read_text() == ops_header(), "regenerate: python -m gpuprof.collector.bpf_support > bpf/gpuprof_ops.h"


def test_probe_table_is_consistent() -> None:
    assert len(pt.PROBES) <= 128 and len(pt.PROBE_IDS) == len(pt.PROBES)
    for p in pt.PROBES:
        p.op_code  # every op is a schema enum value  # noqa: B018
        args = [getattr(p, f) for f in ("comm", "count", "dtype", "peer", "tag", "request", "stream")]
        assert all(0 <= a <= 14 for a in args), p


def test_ids_rules() -> None:
    reg = cc.CommRegistry("n1", environ=lambda pid: {"PMIX_NAMESPACE": "ns", "OMPI_COMM_WORLD_RANK": str(pid),
                                                     "OMPI_COMM_WORLD_SIZE": "2"},
                          mpi_handles=lambda pid: {"world": 0x10, "self": 0x20, "null": 0x30})
    init = schema.COMMUNICATOR_OPS.index("MPI_Init")
    split = schema.COMMUNICATOR_OPS.index("MPI_Comm_split")
    ev = {"t_ns": 1, "pid": 0, "handle": 0, "parent": 0, "index": 0, "uid_hash": 0, "color": 0, "key": 0, "rank": -1, "size": -1,
              "ret": 0, "op": init, "library": 0, "uid": b""}
    for pid in (1, 2):
        reg.on_comm({**ev, "pid": pid})
        reg.on_comm({**ev, "pid": pid, "op": split, "t_ns": 2, "handle": 0x99 + pid, "parent": 0x10,
                     "color": 5})
    w1, w2 = reg.lookup(1, 0x10, 3, 0), reg.lookup(2, 0x10, 3, 0)
    assert w1.comm_id == w2.comm_id and (w1.rank, w1.size) == (1, 2)
    assert reg.lookup(1, 0x9A, 3, 0).comm_id == reg.lookup(2, 0x9B, 3, 0).comm_id != w1.comm_id
    assert cc.fnv1a64(b"") == 0xCBF29CE484222325


def registry_with_a_reused_handle() -> cc.CommRegistry:
    """Process 7's registry: MPI_Init (world 0x10), then handle 0x99 split off, freed at 500 ns and
    reused for another split at 700 ns."""
    reg = cc.CommRegistry("n1", environ=lambda pid: {"PMIX_NAMESPACE": "ns", "OMPI_COMM_WORLD_RANK": "0",
                                                     "OMPI_COMM_WORLD_SIZE": "2"},
                          mpi_handles=lambda pid: {"world": 0x10, "self": 0x20, "null": 0x30})
    ops = schema.COMMUNICATOR_OPS
    ev = {"t_ns": 1, "pid": 7, "handle": 0, "parent": 0, "index": 0, "uid_hash": 0, "color": 0, "key": 0,
          "rank": -1, "size": -1, "ret": 0, "op": ops.index("MPI_Init"), "library": 0, "uid": b""}
    reg.on_comm(ev)
    reg.on_comm({**ev, "op": ops.index("MPI_Comm_split"), "t_ns": 100, "handle": 0x99, "parent": 0x10, "color": 1})
    reg.on_comm({**ev, "op": ops.index("MPI_Comm_free"), "t_ns": 500, "handle": 0x99})
    reg.on_comm({**ev, "op": ops.index("MPI_Comm_split"), "t_ns": 700, "handle": 0x99, "parent": 0x10, "color": 2,
                 "index": 1})
    return reg


def test_call_rows_resolve_reused_handles() -> None:
    """A handle freed and reused: each call row gets the communicator live at its entry, as a
    per-row lookup() gives it; calls without a communicator get id 0."""
    reg = registry_with_a_reused_handle()
    calls = np.zeros(7, dtype=cc.CALL_DTYPE)
    calls["pid"] = [7, 7, 7, 7, 7, 7, 8]  # pid 8: MPI_Init before the collector looked (made up from its world)
    calls["t_enter_ns"] = [200, 800, 300, 900, 50, 400, 300]
    calls["handle"] = [0x99, 0x99, 0x10, 0x99, 0x10, 0, 0x10]
    calls["seq"] = [0, 0, 0, 1, 1, pt.GP_SEQ_NONE, 0]
    rows = reg.call_rows(calls, "fastpath")
    real = [i for i in range(7) if i != 5]
    want = [reg.lookup(int(calls["pid"][i]), int(calls["handle"][i]), int(calls["t_enter_ns"][i]), 0) for i in real]
    assert list(rows["comm_id"][real]) == [w.comm_id for w in want]
    assert rows["comm_id"][0] != rows["comm_id"][1] == rows["comm_id"][3] != rows["comm_id"][2]
    assert (rows["comm_id"][5], rows["comm_rank"][5], rows["comm_size"][5]) == (0, -1, -1)
    assert rows["comm_size"][2] == 2
    assert rows["comm_id"][6] == rows["comm_id"][2]  # the same MPI_COMM_WORLD on both processes


@pytest.mark.parametrize("n_handles", [3, cc.FEW_HANDLES + 2])
def test_one_process_batch_resolves_as_a_per_row_lookup(n_handles: int) -> None:
    """The fast path's batch is one process's: its rows are grouped by handle a pass per handle
    (up to FEW_HANDLES), by a sort beyond; either way each row gets the communicator a per-row
    lookup() gives, and each group's rows stay in batch order."""
    reg = registry_with_a_reused_handle()
    rng = np.random.default_rng(n_handles)
    handles = np.array([0x10, 0x99, 0x20, *range(0x1000, 0x1000 + n_handles - 3)], np.uint64)
    calls = np.zeros(2000, dtype=cc.CALL_DTYPE)
    calls["pid"] = 7
    calls["t_enter_ns"] = rng.integers(0, 1000, len(calls))
    calls["handle"] = handles[rng.integers(0, n_handles, len(calls))]
    calls["seq"] = np.where(rng.random(len(calls)) < 0.2, pt.GP_SEQ_NONE, 0)
    calls["handle"][calls["seq"] == pt.GP_SEQ_NONE] = 0  # MPI_Wait and the like: no communicator
    groups = reg._groups(calls["pid"], calls["handle"], slice(None))
    assert sorted(int(h) for _, h, _ in groups) == sorted(set(calls["handle"].tolist()))
    for pid, handle, rows_of in groups:
        assert pid == 7 and np.all(np.diff(rows_of) > 0) and np.all(calls["handle"][rows_of] == handle)
    rows = reg.call_rows(calls, "fastpath")
    real = np.flatnonzero(calls["seq"] != pt.GP_SEQ_NONE)
    want = [reg.lookup(7, int(calls["handle"][i]), int(calls["t_enter_ns"][i]), 0) for i in real]
    assert list(rows["comm_id"][real]) == [w.comm_id for w in want]
    assert list(rows["comm_rank"][real]) == [w.rank for w in want]
    assert np.all(rows["comm_id"][calls["seq"] == pt.GP_SEQ_NONE] == 0)


@pytest.fixture(scope="module")
def mpi_run() -> tuple[Any, Any, list[str]]:
    reason = bpf_skip_reason() or mpi_skip_reason()
    if reason:
        pytest.skip(reason)
    gated = GatedProcess(mpirun_cmd(NRANKS, [python(), str(PROGS / "mpi_collectives.py"), "--burst", "--completions"]))
    # An MPI job outside the job's pid set runs at the same time: none of its calls may show up.
    outsider = GatedProcess(mpirun_cmd(1, [python(), str(PROGS / "mpi_collectives.py")]))
    errors: list[str] = []
    ctx = make_ctx(lambda: frozenset({gated.pid}), ("collectives",), errors=errors,
                   config={"sources.collectives": {"mpi_path": "uprobe", "nccl_path": "uprobe"}})
    src = bc.BpfCollectivesSource()
    outsider.go()
    batches, (rc, _out, err) = run_source_over(src, ctx, gated)
    outsider.wait()
    assert rc == 0, err[-2000:]
    return collect(batches, schema.COLLECTIVE_CALLS), collect(batches, schema.COMMUNICATORS), errors


@pytest.mark.bpf
@pytest.mark.mpi
def test_mpi_job_every_call_once(mpi_run: tuple[Any, Any, list[str]]) -> None:
    calls, comms, errors = mpi_run
    assert not errors, errors
    assert set(calls["path"]) == {0} and set(calls["library"]) == {0}
    check_mpi_plan(calls, comms, NRANKS)


@pytest.mark.bpf
@pytest.mark.mpi
def test_mpi_burst_of_sends_under_one_handle(mpi_run: tuple[Any, Any, list[str]]) -> None:
    """The uprobe path keeps several requests of one handle too (bpf/collectives.c gp_req_put)."""
    calls, _, errors = mpi_run
    assert not errors, errors
    check_bursts(calls, NRANKS, ["MPI_Waitall", "MPI_Waitsome"])


@pytest.mark.bpf
@pytest.mark.mpi
def test_mpi_waitany_and_waitsome_name_the_requests_they_completed(mpi_run: tuple[Any, Any, list[str]]) -> None:
    """MPI_Waitany and MPI_Waitsome (MEEP's halo exchange completes its messages so) write a row
    per request they completed, by the index or indices they returned; their test forms are not
    probed on this path (a trap at every poll of a polling loop), so they write none."""
    calls, _, errors = mpi_run
    assert not errors, errors
    check_completions(calls, NRANKS, ["MPI_Waitany", "MPI_Waitsome"], tests_at_return=False)
    ops = schema.COLLECTIVE_OPS
    assert not np.isin(calls["op"], [ops.index("MPI_Testany"), ops.index("MPI_Testsome")]).any()


@pytest.mark.bpf
@pytest.mark.mpi
def test_mpi_times_ordered(mpi_run: tuple[Any, Any, list[str]]) -> None:
    calls, _, _ = mpi_run
    assert np.all(calls["t_exit_ns"] >= calls["t_enter_ns"]) and np.all(calls["t_enter_ns"] > 0)


# --- NCCL: the real library, called through ctypes with a NULL communicator ------------------------


def nccl_skip_reason() -> str | None:
    if NCCL_LIB is None:
        return "nvidia-nccl-cu12 is not installed in this environment (test extra)"
    return bpf_skip_reason()


@pytest.mark.bpf
def test_nccl_arguments_decoded() -> None:
    reason = nccl_skip_reason()
    if reason:
        pytest.skip(reason)
    gated = GatedProcess([python(), str(PROGS / "nccl_calls.py"), str(NCCL_LIB)])
    errors: list[str] = []
    ctx = make_ctx(lambda: frozenset({gated.pid}), ("collectives",), errors=errors)
    src = bc.BpfCollectivesSource(("nccl",))
    src.keep_raw = True
    src.start(ctx)
    try:
        # The wheel's libnccl is not in the linker cache: attach to it as the process scan would.
        attached = src.attach_library("nccl", str(NCCL_LIB))
        assert {p.symbol for p in pt.PROBES if p.library == "nccl"} <= set(attached)
        gated.go()
        rc, out, err = gated.wait()
        assert rc == 0, err
        batches = list(src.final(0))
    finally:
        src.stop()
    assert not errors, errors
    expected = json.loads(out.strip().splitlines()[-1])
    calls = collect(batches, schema.COLLECTIVE_CALLS)
    raw = np.concatenate(src.raw_calls)
    check_nccl(calls, raw, src.events_comm, expected)


@pytest.mark.bpf
@pytest.mark.mpi
def test_full_bpf_ring_counts_its_drops(tmp_path: Path) -> None:
    """A call ring of 2 pages that is never drained while 3000 calls are made: what does not fit
    is counted by the BPF program (gp_coll_drops), kept by the source when it stops
    (dropped_total, what the benches print), and nothing is lost without being counted."""
    import subprocess

    reason = bpf_skip_reason() or mpi_skip_reason()
    if reason:
        pytest.skip(reason)
    exe = tmp_path / "mpi_bench"
    subprocess.run(["mpicc", "-O2", "-o", str(exe), str(PROGS / "mpi_bench.c")], check=True)
    n = 3000
    gated = GatedProcess(mpirun_cmd(1, [str(exe), "tight", str(n)]))
    ctx = make_ctx(lambda: frozenset({gated.pid}), ("collectives",),
                   config={"sources.collectives": {"mpi_path": "uprobe", "nccl_path": "uprobe", "ring_pages": 1}})
    src = bc.BpfCollectivesSource(("mpi",))
    batches, (rc, _out, err) = run_source_over(src, ctx, gated, sample=False)
    assert rc == 0, err[-2000:]
    calls = collect(batches, schema.COLLECTIVE_CALLS)
    allreduce = int((calls["op"] == schema.COLLECTIVE_OPS.index("MPI_Allreduce")).sum())
    assert src.dropped_total > 0 and src.drops() == src.dropped_total
    assert allreduce < n and allreduce + src.dropped_total >= n, (allreduce, src.dropped_total)
    assert len(calls) + src.dropped_total <= n + 10  # the loop's calls and a few of MPI_Init's


def test_the_calls_ring_is_the_configs_whichever_source_compiles_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stacks and collectives sources share one BPF object, compiled by whichever starts first:
    both hand BpfHub.acquire the same constants, the calls ring's size from the config included
    (it once came from the collectives source alone, so a stacks-first compile had 256 pages)."""
    import os
    from types import SimpleNamespace

    from gpuprof.collector import config as config_mod
    from gpuprof.collector.bpf_support import BpfHub, acquire_hub

    cfg = config_mod.defaults()
    cfg["sources.collectives"] = {**cfg["sources.collectives"], "ring_pages": 4, "mpi_path": "uprobe"}
    seen: list[dict[str, str]] = []

    def acquire(modes: Any, defines_for: Any, unwinder: str, images_dir: Any = None) -> Any:
        seen.append(defines_for(("GP_WITH_STACKS", "GP_WITH_COLLECTIVES")))
        raise RuntimeError("acquire seen")  # stops start() here: the constants are what this test wants

    monkeypatch.setattr(BpfHub, "acquire", acquire)
    ctx = SimpleNamespace(modes=("stacks", "collectives"), config=cfg)
    with pytest.raises(RuntimeError, match="acquire seen"):
        acquire_hub(ctx.modes, cfg)
    with pytest.raises(RuntimeError, match="acquire seen"):
        bc.BpfCollectivesSource(("mpi",)).start(ctx)
    pages = 4 * (os.cpu_count() or 1)
    want = str(1 << (pages - 1).bit_length())
    assert [d["GP_CALLS_PAGES"] for d in seen] == [want, want] and seen[0] == seen[1]
