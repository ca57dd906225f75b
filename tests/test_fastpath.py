"""Fast path of mode `collectives`: the LD_PRELOAD interposers and the ring drain, for real.

The same checks as the uprobe path (tests/progs/harness.py check_mpi_plan / check_nccl) on the
same programs: a 4-rank Open MPI job and the real libnccl called with a NULL communicator. No
root needed: the rings live in a temporary directory of the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

from harness import (
    PROGS,
    REPO,
    GatedProcess,
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
    ring_bytes,
    run_source_over,
)

from gpuprof.collector import fastpath_env as fe
from gpuprof.collector import schema
from gpuprof.collector.proctrack import process_tree
from gpuprof.collector.sources import fastpath as fp

FASTPATH = {"sources.collectives": {"mpi_path": "fastpath", "nccl_path": "fastpath"}}


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build bpf/fastpath")
    proc = subprocess.run(["make", "-C", str(REPO / "bpf" / "fastpath")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    libs = fe.built_libraries()
    assert libs["mpi"] and libs["nccl"]
    return {k: v for k, v in libs.items() if v}


@pytest.fixture(params=["native", "numpy"])
def drain(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways records become rows: C (collector/native/ringrows.c, built by make setup) and numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(fp, "_native_ring_rows", lambda: None)
    else:
        assert fp._native_ring_rows() is not None, "collector/native not built (make setup builds it)"
    return str(request.param)


def fastpath_env(ring_dir: Path, job: str, lib: Path, records: int | None = None) -> dict[str, str]:
    env = {"LD_PRELOAD": str(lib), "GPUPROF_FASTPATH_JOB": job, "GPUPROF_FASTPATH_DIR": str(ring_dir)}
    if records:
        env["GPUPROF_FASTPATH_RECORDS"] = str(records)
    return env


def run_mpi(built: dict[str, Path], tmp_path: Path, repeat: int = 1, records: int | None = None,
            sample: bool = True, extra: tuple[str, ...] = (), program: list[str] | None = None,
            output: list[str] | None = None) -> tuple[Any, Any, fp.FastpathSource, list[str]]:
    """Run mpi_collectives.py (or `program`) on 4 ranks under the interposer and the fast-path
    source; its standard output is appended to `output`."""
    reason = mpi_skip_reason()
    if reason:
        pytest.skip(reason)
    job = f"t{uuid.uuid4().hex[:8]}"
    env = fastpath_env(tmp_path, job, built["mpi"], records)
    if program is None:
        program = [python(), str(PROGS / "mpi_collectives.py"), "--repeat", str(repeat), *extra]
    gated = GatedProcess(mpirun_cmd(4, program, env=env))
    errors: list[str] = []
    # The collector reads only rings of job processes, which its tracker finds (collector/proctrack.py):
    # here a thread keeps the process tree under mpirun, as the tracker would, while nothing is drained.
    seen = {gated.pid}
    done = threading.Event()

    def track() -> None:
        while not done.wait(0.05):
            seen.update(process_tree(gated.pid))

    tracker = threading.Thread(target=track, daemon=True)
    tracker.start()
    ctx = make_ctx(lambda: frozenset(seen), ("collectives",), errors=errors, config=FASTPATH, job_id=job)
    src = fp.FastpathSource(ring_dir=str(tmp_path))
    try:
        batches, (rc, out, err) = run_source_over(src, ctx, gated, sample=sample)
    finally:
        done.set()
        tracker.join()
    assert rc == 0, err[-2000:]
    if output is not None:
        output.extend(out.splitlines())
    return collect(batches, schema.COLLECTIVE_CALLS), collect(batches, schema.COMMUNICATORS), src, errors


@pytest.mark.mpi
def test_mpi_job_every_call_once(built: dict[str, Path], tmp_path: Path, drain: str) -> None:
    calls, comms, _, errors = run_mpi(built, tmp_path)
    assert not errors, errors
    assert set(calls["path"]) == {1}
    check_mpi_plan(calls, comms, 4)
    assert not list(tmp_path.iterdir()), "rings are removed when the source stops"


@pytest.mark.mpi
def test_full_ring_drops_and_never_stalls(built: dict[str, Path], tmp_path: Path) -> None:
    """A ring of 64 records, drained only at the end: the job runs to completion, the surplus is
    counted as dropped, and what was kept is a prefix in order."""
    calls, _comms, src, _ = run_mpi(built, tmp_path, repeat=20, records=64, sample=False)
    assert 0 < len(calls) <= 4 * 64
    assert src.dropped_total > 20 * 4 * 10  # the plan makes > 25 calls per repeat and rank
    assert src.fill == 1.0  # its last drain found a ring full: the collector's priority is lifted (catchup.py)
    # The newest records are the ones dropped: each rank kept its first calls, seq 0, 1, 2...
    import mpi_collectives as plan

    names = {*plan.WORLD_PLAN, *plan.SPLIT_PLAN, *plan.DUP_PLAN}
    coll = np.isin(calls["op"], [schema.COLLECTIVE_OPS.index(o) for o in names])
    for pid, cid in set(zip(calls["pid"][coll], calls["comm_id"][coll])):
        mine = calls[coll & (calls["pid"] == pid) & (calls["comm_id"] == cid)]
        assert list(mine["seq"]) == list(range(len(mine)))


@pytest.mark.mpi
def test_completions_of_some_of_many_requests(built: dict[str, Path], tmp_path: Path) -> None:
    """Isend/Irecv completed by MPI_Waitany, Waitsome, Testany and Testsome (as MEEP's halo exchange
    does with Waitsome), and by Testany on one request at a time (hpcc's polls): every request gets exactly one completion row, of that call, carrying the
    request's communicator, seq, peer and tag, so the merge can time the message; so too in a burst
    of small sends, which MPI completes at once under one handle (Open MPI's ompi_request_empty; a
    completion named no request for all but one of them before). A test is recorded at its return (enter = exit: a test never waits, and the interposer reads no clock
    for the tests of a polling loop that complete nothing)."""
    import mpi_collectives as plan

    calls, _, _, errors = run_mpi(built, tmp_path, extra=("--completions", "--burst"))
    assert not errors, errors
    check_completions(calls, 4, [call for call, _, _ in plan.COMPLETION_PLAN], tests_at_return=True)
    check_bursts(calls, 4, [call for call, _ in plan.BURST_PLAN])


@pytest.mark.mpi
def test_a_completion_names_the_request_of_its_array_element(built: dict[str, Path], tmp_path: Path) -> None:
    """tests/progs/mpi_burst.c: three small sends that may share one handle, posted out of their
    array's order and completed one by one by MPI_Waitany: each completion row names the send of
    the element MPI completed, in the order the program saw (not the order they were posted)."""
    if shutil.which("mpicc") is None:
        pytest.skip("no mpicc")
    exe = tmp_path / "mpi_burst"
    subprocess.run(["mpicc", "-O2", "-o", str(exe), str(PROGS / "mpi_burst.c")], check=True)
    lines: list[str] = []
    calls, _, _, errors = run_mpi(built, tmp_path, program=[str(exe)], output=lines)
    assert not errors, errors
    ranks = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(ranks) == 4
    waitany = calls[calls["op"] == schema.COLLECTIVE_OPS.index("MPI_Waitany")]
    assert len(waitany) == 4 * 6 and (waitany["comm_id"] != 0).all()
    for rank in ranks:
        mine = waitany[(waitany["pid"] == rank["pid"]) & (waitany["root_or_peer"] == rank["right"])]
        mine = mine[np.argsort(mine["t_enter_ns"], kind="stable")]
        assert mine["tag"].tolist() == rank["send_tags"], rank
        assert sorted(mine["seq"].tolist()) == [0, 0, 0]  # one send on each (peer, tag) channel


@pytest.mark.mpi
def test_threads_completing_requests_at_once_each_get_their_own(built: dict[str, Path], tmp_path: Path) -> None:
    """tests/progs/mpi_threads.c, under MPI_THREAD_MULTIPLE: four threads of each rank start and
    complete small sends (one shared handle under Open MPI) and receives at the same time, each on
    its own tag. Every completion row a thread makes names its own request: its tag, its peer, and
    the rounds of that channel in order; none names no request, or another thread's."""
    if shutil.which("mpicc") is None:
        pytest.skip("no mpicc")
    exe = tmp_path / "mpi_threads"
    subprocess.run(["mpicc", "-O2", "-pthread", "-o", str(exe), str(PROGS / "mpi_threads.c")], check=True)
    rounds = 3000
    lines: list[str] = []
    calls, _, _, errors = run_mpi(built, tmp_path, program=[str(exe), str(rounds)], output=lines,
                                  records=1 << 18)
    assert not errors, errors
    ranks = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(ranks) == 4 and all("tids" in r for r in ranks), lines
    wait = calls[calls["op"] == schema.COLLECTIVE_OPS.index("MPI_Wait")]
    assert len(wait) == 4 * 4 * 2 * rounds
    for rank in ranks:
        for t, tid in enumerate(rank["tids"]):
            mine = wait[(wait["pid"] == rank["pid"]) & (wait["tid"] == tid)]
            mine = mine[np.argsort(mine["t_enter_ns"], kind="stable")]
            where = f"rank {rank['rank']} thread {t}"
            assert (mine["comm_id"] != 0).all(), f"{where}: completions naming no request"
            assert set(mine["tag"].tolist()) == {100 + t}, where
            assert mine["root_or_peer"].tolist() == [rank["right"], rank["left"]] * rounds, where
            assert mine["seq"][0::2].tolist() == list(range(rounds)), where  # its sends, in order
            assert mine["seq"][1::2].tolist() == list(range(rounds)), where  # its receives


def test_exports_contract(built: dict[str, Path]) -> None:
    lines = fe.fastpath_exports(("metrics", "collectives"), make_ctx(lambda: frozenset(), ()).config | FASTPATH,
                                "77", existing_ld_preload="/opt/x.so")
    assert lines[0] == f"export LD_PRELOAD={built['mpi']}:{built['nccl']}:/opt/x.so"
    assert "export GPUPROF_FASTPATH_JOB=77" in lines
    assert fe.fastpath_exports(("metrics",), make_ctx(lambda: frozenset(), ()).config, "77") == []
    uprobe = {"sources.collectives": {"mpi_path": "uprobe", "nccl_path": "uprobe"}}
    assert fe.fastpath_exports(("collectives",), make_ctx(lambda: frozenset(), ()).config | uprobe, "77") == []


def test_foreign_and_corrupt_rings_ignored(built: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "gpuprof-99-123").write_bytes(b"\0" * 100)  # never initialized: retried, not read
    (tmp_path / "gpuprof-99-124").write_bytes(b"junk" * 100)  # no magic: treated as not ready
    os.symlink("/etc/passwd", tmp_path / "gpuprof-99-125")
    errors: list[str] = []
    src = fp.FastpathSource(ring_dir=str(tmp_path))
    src.start(make_ctx(lambda: frozenset(), ("collectives",), errors=errors, config=FASTPATH, job_id="99"))
    batches = src.sample(0)
    assert all(len(rows) == 0 for _, rows in batches)
    assert len(errors) == 1 and "gpuprof-99-125" in errors[0]  # O_NOFOLLOW refuses the link
    src.stop()


def test_a_ring_listed_before_its_header_is_looked_at_again_soon(built: dict[str, Path], tmp_path: Path) -> None:
    """A process creates its ring at its first call and writes the header's magic last: listed in
    between, the ring is looked at again after RING_RETRY_S (retry_s), not at the next drain 2 s
    later, by which time MEEP's ranks had filled theirs; one never initialized is refused after the
    grace, with the reason."""
    ring = tmp_path / f"gpuprof-99-{os.getpid()}"
    ring.write_bytes(b"\0" * 100)
    errors: list[str] = []
    src = fp.FastpathSource(ring_dir=str(tmp_path))
    src.start(make_ctx(lambda: frozenset({os.getpid()}), ("collectives",), errors=errors, config=FASTPATH,
                       job_id="99"))
    try:
        src.sample(0)
        assert src.retry_s == fp.RING_RETRY_S and not src.rings
        ring.write_bytes(ring_bytes(os.getpid(), capacity=64))
        src.sample(0)
        assert src.retry_s is None and len(src.rings) == 1 and not errors
        late = tmp_path / f"gpuprof-99-{os.getpid()}.1"
        late.write_bytes(b"\0" * 100)
        src.pid_grace_s = 0.0
        src.sample(0)
        assert src.retry_s is None and late.name in src.refused
        assert len(errors) == 1 and "not initialized" in errors[0] and late.name in errors[0]
    finally:
        src.stop()


def test_watch_asks_for_early_drains_only_when_needed(built: dict[str, Path], tmp_path: Path) -> None:
    """With a caller that can be asked for a sample (the daemon), Python drains once a second and
    the native watch (collector/native/ringwatch.c) asks for a drain at once when a ring is past a
    quarter of its capacity or a file appears; once per drain at most, whatever a header says."""
    assert fp._native_ring_rows() is not None, "collector/native not built (make setup builds it)"
    lay = fp.layout()
    ring = tmp_path / f"gpuprof-99-{os.getpid()}"
    ring.write_bytes(ring_bytes(os.getpid(), capacity=64))
    asked = threading.Event()
    errors: list[str] = []
    ctx = make_ctx(lambda: frozenset({os.getpid()}), ("collectives",), errors=errors, config=FASTPATH, job_id="99")
    ctx.request_sample = asked.set
    src = fp.FastpathSource(ring_dir=str(tmp_path))
    src.start(ctx)
    head = next(f[1] for f in lay["header"] if f[0] == "head")
    try:
        assert src.interval_s == fp.DRAIN_INTERVAL_S and src.drain_how.startswith("native watch"), src.drain_how
        assert len(src.rings) == 1
        assert not asked.wait(5 * fp.WATCH_INTERVAL_S), "nothing to drain: no early drain"
        with ring.open("r+b") as f:
            os.pwrite(f.fileno(), (64 // fp.WATCH_FILL).to_bytes(8, "little"), head)  # exactly a quarter
            assert not asked.wait(3 * fp.WATCH_INTERVAL_S), "a quarter full is not past it"
            os.pwrite(f.fileno(), (64 // fp.WATCH_FILL + 1).to_bytes(8, "little"), head)
            assert asked.wait(2.0)
            asked.clear()
            # no records behind that head (a hostile header): no second request until a drain,
            # and a drain that reads none is no reason to lift the collector's priority
            assert not asked.wait(3 * fp.WATCH_INTERVAL_S)
            src.sample(0)
            assert src.fill == 0.0
            assert asked.wait(2.0), "still past a quarter after the drain: asked again"
            os.pwrite(f.fileno(), (0).to_bytes(8, "little"), head)
        src.sample(0)
        asked.clear()
        assert src.early_drains()["directory"] == 0
        (tmp_path / "unrelated").write_bytes(b"")
        assert asked.wait(2.0), "a new file in the directory asks for a drain"
        assert src.early_drains() == {"ring_full": 2, "directory": 1}
        assert not errors, errors
    finally:
        src.stop()
    assert src.summary()["early_drains"] == {"ring_full": 2, "directory": 1}


def test_without_an_early_wake_python_drains_at_5_hz(built: dict[str, Path], tmp_path: Path) -> None:
    src = fp.FastpathSource(ring_dir=str(tmp_path))
    src.start(make_ctx(lambda: frozenset(), ("collectives",), config=FASTPATH, job_id="99"))
    try:
        assert src.interval_s == fp.PYTHON_DRAIN_INTERVAL_S
        assert "cannot be asked" in src.summary()["drain"]
    finally:
        src.stop()


def test_layout_matches_bpf_struct(built: dict[str, Path]) -> None:
    """The decoded field names of the ring records are those of the BPF path."""
    from gpuprof.collector.sources.collective_calls import CALL_FIELDS

    lay = fp.layout()
    assert [f[0] for f in lay["call"]] == list(CALL_FIELDS)
    offsets = [f[1] for f in lay["call"]]
    assert offsets == sorted(offsets) and lay["record_size"] >= offsets[-1]


def test_nccl_arguments_decoded(built: dict[str, Path], tmp_path: Path, drain: str) -> None:
    lib = nccl_library()
    if lib is None:
        pytest.skip("nvidia-nccl-cu12 is not installed in this environment (test extra)")
    job = f"t{uuid.uuid4().hex[:8]}"
    env = {**os.environ, **fastpath_env(tmp_path, job, built["nccl"])}
    gated = GatedProcess([python(), str(PROGS / "nccl_calls.py"), str(lib), "--global"], env=env)
    errors: list[str] = []
    ctx = make_ctx(lambda: frozenset({gated.pid}), ("collectives",), errors=errors, config=FASTPATH, job_id=job)
    src = fp.FastpathSource(ring_dir=str(tmp_path))
    src.keep_raw = True
    batches, (rc, out, err) = run_source_over(src, ctx, gated)
    assert rc == 0, err
    assert not errors, errors
    expected = json.loads(out.strip().splitlines()[-1])
    calls = collect(batches, schema.COLLECTIVE_CALLS)
    assert set(calls["path"]) == {1}
    check_nccl(calls, np.concatenate(src.raw_calls), src.events_comm, expected)


@pytest.mark.mpi
def test_comm_create_on_disjoint_groups_gives_each_group_its_communicator(built: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """MPI_Comm_create with disjoint groups (ranks 0-1 and 2-3) makes two communicators from one call:
    each gets its own id, the same on both of its members, so the merge never mixes their instances."""
    import mpi_collectives as plan

    calls, comms, _, errors = run_mpi(built, tmp_path, extra=("--create",))
    assert not errors, errors
    created = comms[comms["op"] == schema.COMMUNICATOR_OPS.index("MPI_Comm_create")]
    ops = schema.COLLECTIVE_OPS
    n_allreduce = plan.CREATE_PLAN["MPI_Allreduce"][0]
    world_and_split = {int(c) for c in calls["comm_id"][calls["comm_size"] == 4]}
    on_created = calls[(calls["op"] == ops.index("MPI_Allreduce")) & (calls["comm_size"] == 2)
                       & (calls["bytes"] == 4 * 8)]
    by_comm: dict[int, set[int]] = {}
    for cid, pid in zip(on_created["comm_id"], on_created["pid"]):
        by_comm.setdefault(int(cid), set()).add(int(pid))
    assert len(by_comm) == 2, by_comm  # one communicator per group
    assert all(len(p) == 2 for p in by_comm.values())  # both members of a group share its id
    assert not set(by_comm) & world_and_split
    assert len(on_created) == 4 * n_allreduce
    # the communicator table names them alike: two ids, two ranks each, created by MPI_Comm_create
    assert {int(c) for c in created["comm_id"]} == set(by_comm)


@pytest.mark.mpi
def test_persistent_requests_each_start_is_a_message(built: dict[str, Path], tmp_path: Path) -> None:
    """MPI_Send_init / MPI_Recv_init once, then MPI_Startall and MPI_Waitall five times (as halo codes
    do): every start is recorded as the MPI_Isend / MPI_Irecv it starts, numbered in its channel
    (0..4), and completed by its Waitall row with the same communicator, seq, peer and tag, so the
    merge matches and times each message."""
    import mpi_collectives as plan

    calls, _, _, errors = run_mpi(built, tmp_path, extra=("--persistent",))
    assert not errors, errors
    ops = schema.COLLECTIVE_OPS
    tagged = calls[calls["tag"] == plan.PERSISTENT_TAG]
    for op in ("MPI_Isend", "MPI_Irecv"):
        posted = tagged[tagged["op"] == ops.index(op)]
        assert len(posted) == 4 * plan.PERSISTENT_STARTS, (op, len(posted))
        for pid in set(posted["pid"].tolist()):
            assert sorted(posted["seq"][posted["pid"] == pid].tolist()) == list(range(plan.PERSISTENT_STARTS))
    done = tagged[tagged["op"] == ops.index("MPI_Waitall")]
    key = ("pid", "comm_id", "seq", "root_or_peer", "tag")
    posted = tagged[np.isin(tagged["op"], [ops.index("MPI_Isend"), ops.index("MPI_Irecv")])]
    assert sorted(tuple(int(r[k]) for k in key) for r in done) == sorted(tuple(int(r[k]) for k in key) for r in posted)
