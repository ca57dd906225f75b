"""Helpers of the BPF and fast-path tests: drive a source directly, without the daemon.

`GatedProcess` starts a command that waits on its stdin before exec'ing, so the test can put its
pid into the source's job set first; the kernel's fork tracking then covers every child (mpirun's
ranks) from their first instruction.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpuprof.collector import config as gpuprof_config
from gpuprof.collector import schema
from gpuprof.collector.bpf_support import bpf_unavailable_reason
from gpuprof.collector.sources.base import Batch, Source, SourceContext

REPO = Path(__file__).resolve().parents[2]
PROGS = REPO / "tests" / "progs"
PYTHON = str(REPO / ".venv" / "bin" / "python")


def ring_bytes(pid: int, node: str = "node1", capacity: int = 64) -> bytes:
    """A valid, empty fast-path ring of the current layout whose header names pid."""
    import numpy as np

    from gpuprof.collector.sources import fastpath as fp

    lay = fp.layout()
    hdr = np.zeros(1, dtype=fp._dtype(lay["header"], 0, lay["header_size"]))
    hdr["magic"], hdr["version"], hdr["record_size"] = lay["magic"], lay["version"], lay["record_size"]
    hdr["capacity"], hdr["pid"], hdr["header_size"], hdr["node"] = capacity, pid, lay["header_size"], node.encode()
    return hdr.tobytes() + b"\0" * (capacity * lay["record_size"])


def bpf_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "BPF tests need root"
    return bpf_unavailable_reason()


def mpi_skip_reason() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed"
    return None


def make_ctx(pids: Callable[[], frozenset[int]], modes: tuple[str, ...], *,
             config: dict[str, dict[str, Any]] | None = None, errors: list[str] | None = None,
             job_id: str = "4242") -> SourceContext:
    cfg = gpuprof_config.defaults()
    # A source under test compiles only the tables of the processes it samples: the prewarm of the
    # node's libraries (seconds of CPU, into paths.state_dir) is tested on its own and under Slurm.
    cfg["sources.stacks"]["cfi_prewarm"] = False
    for sec, vals in (config or {}).items():
        cfg[sec].update(vals)
    errs = errors if errors is not None else []
    return SourceContext(
        job_id=job_id, node="node1", modes=modes, config=cfg, pids=pids, recent_pids=pids,
        cgroup_dirs=lambda: (),
        report_error=lambda src, msg: errs.append(f"{src}: {msg}"),
        report_missing=lambda *a: errs.append(f"missing {a}"),
    )


class GatedProcess:
    """`cmd` started behind `read`: runs only after go()."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", 'read _go; exec "$@"', "gated", *cmd],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=cwd,
        )
        self.pid = self.proc.pid

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        self.proc.stdin = None

    def wait(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


def mpirun_cmd(n: int, prog: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n)]
    for k, v in (env or {}).items():
        cmd += ["-x", f"{k}={v}"]
    return cmd + list(prog)


def collect(batches: list[Batch], table: schema.Table) -> Any:
    import numpy as np

    parts = [rows for t, rows in batches if t is table and len(rows)]
    return np.concatenate(parts) if parts else table.empty()


def run_source_over(source: Source, ctx: SourceContext, proc: GatedProcess, timeout: float = 120,
                    poll_s: float = 0.2, sample: bool = True) -> tuple[list[Batch], tuple[int, str, str]]:
    """Start the source, release the process, sample until it ends (sample=False: not at all),
    then take the final rows."""
    import time

    source.start(ctx)
    batches: list[Batch] = []
    try:
        proc.go()
        deadline = time.monotonic() + timeout
        while sample and proc.proc.poll() is None and time.monotonic() < deadline:
            batches.extend(source.sample(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
            time.sleep(poll_s)
        result = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        time.sleep(0.1)
        batches.extend(source.final(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
    finally:
        source.stop()
    return batches, result


def python() -> str:
    return PYTHON if Path(PYTHON).exists() else sys.executable


# --- the MPI plan of tests/progs/mpi_collectives.py, checked on /collectives rows ---------------------
def check_completions(calls: Any, nranks: int, completion_calls: list[str], tests_at_return: bool) -> None:
    """mpi_collectives.py --completions: each Isend and Irecv of the ring exchange of each call of
    COMPLETION_PLAN in completion_calls completed by exactly one row of that call, naming its
    request (communicator, seq, peer and tag), so the merge can time the message. tests_at_return:
    a test's row is timed at its return (enter = exit: the fast path reads no clock before a test)."""
    import numpy as np

    sys.path.insert(0, str(PROGS))
    import mpi_collectives as plan

    ops = schema.COLLECTIVE_OPS
    key = ("pid", "comm_id", "seq", "root_or_peer", "tag")
    for call, tag, _ in plan.COMPLETION_PLAN:
        if call not in completion_calls:
            continue
        posted = calls[np.isin(calls["op"], [ops.index("MPI_Isend"), ops.index("MPI_Irecv")]) & (calls["tag"] == tag)]
        done = calls[(calls["op"] == ops.index(call)) & (calls["tag"] == tag)]
        assert len(posted) == 2 * nranks, (call, len(posted))  # one Isend and one Irecv a rank
        want = sorted(tuple(int(r[k]) for k in key) for r in posted)
        got = sorted(tuple(int(r[k]) for k in key) for r in done)
        assert got == want, (call, got, want)
        if tests_at_return and call.startswith("MPI_Test"):
            assert (done["t_exit_ns"] == done["t_enter_ns"]).all(), call
        else:
            assert (done["t_exit_ns"] >= done["t_enter_ns"]).all(), call


def check_bursts(calls: Any, nranks: int, completion_calls: list[str]) -> None:
    """mpi_collectives.py --burst: every Isend and Irecv of each burst completed by its call, each
    completion row naming its request (communicator, seq, peer and tag), none naming no request;
    under Open MPI the burst's sends share one handle (ompi_request_empty)."""
    import numpy as np

    sys.path.insert(0, str(PROGS))
    import mpi_collectives as plan

    ops = schema.COLLECTIVE_OPS
    key = ("pid", "comm_id", "seq", "root_or_peer", "tag")
    for call, tags in plan.BURST_PLAN:
        if call not in completion_calls:
            continue
        posted = calls[np.isin(calls["op"], [ops.index("MPI_Isend"), ops.index("MPI_Irecv")])
                       & np.isin(calls["tag"], tags)]
        done = calls[calls["op"] == ops.index(call)]
        done = done[np.isin(done["tag"], tags) | (done["comm_id"] == 0)]
        assert len(posted) == nranks * 2 * len(tags), (call, len(posted))
        want = sorted(tuple(int(r[k]) for k in key) for r in posted)
        got = sorted(tuple(int(r[k]) for k in key) for r in done)
        assert got == want, (call, got, want)


def check_mpi_plan(calls: Any, comms: Any, nranks: int, repeat: int = 1) -> None:
    """Assert that the rows hold every call of the plan exactly once, with contiguous sequence
    numbers per communicator, ids equal across ranks, bytes, roots, peers and tags right."""
    import collections

    import numpy as np

    sys.path.insert(0, str(PROGS))
    import mpi_collectives as plan

    ops = schema.COLLECTIVE_OPS
    cops = schema.COMMUNICATOR_OPS
    init = comms[comms["op"] == cops.index("MPI_Init")]
    assert len(init) == nranks, f"MPI_Init rows: {init}"
    pid_rank = {int(r["pid"]): int(r["comm_rank"]) for r in init}
    assert sorted(pid_rank.values()) == list(range(nranks))
    assert set(init["comm_size"]) == {nranks}
    world_ids = {int(x) for x in init["comm_id"]}
    assert len(world_ids) == 1, "MPI_COMM_WORLD id differs between ranks"
    world = world_ids.pop()
    assert {int(p) for p in calls["pid"]} == set(pid_rank), "rows from processes outside the job"

    coll_ops = {ops.index(o) for o in (*plan.WORLD_PLAN, *plan.SPLIT_PLAN, *plan.DUP_PLAN)}
    by_pid_comm: dict[tuple[int, int], list[Any]] = collections.defaultdict(list)
    for r in calls:
        if int(r["op"]) in coll_ops:
            by_pid_comm[(int(r["pid"]), int(r["comm_id"]))].append(r)
    # Every communicator's collectives: seq 0..n-1 in call order, exactly once each.
    for (pid, cid), rows in by_pid_comm.items():
        rows.sort(key=lambda r: int(r["t_enter_ns"]))
        assert [int(r["seq"]) for r in rows] == list(range(len(rows))), f"seq of pid {pid} comm {cid:#x}"

    def expect(comm_id_of: Callable[[int], int], plan_: dict, size: int, rank_of: Callable[[int], int]) -> None:
        for pid, wrank in pid_rank.items():
            cid = comm_id_of(wrank)
            rows = by_pid_comm[(pid, cid)]
            got = collections.Counter(ops[int(r["op"])] for r in rows)
            want = {op: n * repeat for op, (n, _, _) in plan_.items()}
            assert dict(got) == want, f"rank {wrank} comm {cid:#x}: {dict(got)} != {want}"
            for r in rows:
                op = ops[int(r["op"])]
                _, elems, dt = plan_[op]
                nbytes = 0 if dt is None else elems * np.dtype(dt).itemsize
                assert int(r["bytes"]) == nbytes, f"{op} bytes {int(r['bytes'])} != {nbytes}"
                assert int(r["comm_size"]) in (size, -1) and int(r["comm_rank"]) in (rank_of(wrank), -1)
                want_root = {"MPI_Reduce": 1 % size, "MPI_Bcast": 0, "MPI_Gather": 2 % size}.get(op, -1)
                assert int(r["root_or_peer"]) == want_root, f"{op} root {int(r['root_or_peer'])}"
                assert int(r["ret"]) == 0

    expect(lambda _: world, plan.WORLD_PLAN, nranks, lambda r: r)
    for r in calls[calls["comm_id"] == world]:
        assert int(r["comm_rank"]) == pid_rank[int(r["pid"])] and int(r["comm_size"]) == nranks

    # Split by parity: one id per color, equal on the ranks of that color.
    split_rows = comms[comms["op"] == cops.index("MPI_Comm_split")]
    dup_rows = comms[comms["op"] == cops.index("MPI_Comm_dup")]
    assert len(split_rows) == nranks and len(dup_rows) == nranks
    split_id = {pid_rank[int(r["pid"])]: int(r["comm_id"]) for r in split_rows}
    dup_id = {pid_rank[int(r["pid"])]: int(r["comm_id"]) for r in dup_rows}
    assert {int(x) for x in split_rows["parent_id"]} == {world}
    for ids in (split_id, dup_id):
        for a in range(nranks):
            for b in range(nranks):
                assert (ids[a] == ids[b]) == (a % 2 == b % 2), f"ids {ids}"
    assert not set(split_id.values()) & set(dup_id.values()) and world not in split_id.values()
    for r in dup_rows:
        assert int(r["parent_id"]) == split_id[pid_rank[int(r["pid"])]]
    for r in split_rows:
        wrank = pid_rank[int(r["pid"])]
        assert int(r["comm_rank"]) == wrank // 2 and int(r["comm_size"]) == len(range(wrank % 2, nranks, 2))
    expect(lambda w: split_id[w], plan.SPLIT_PLAN, 2, lambda w: w // 2)
    expect(lambda w: dup_id[w], plan.DUP_PLAN, 2, lambda w: w // 2)
    frees = comms[comms["op"] == cops.index("MPI_Comm_free")]
    assert sorted(int(x) for x in frees["comm_id"]) == sorted([*split_id.values(), *dup_id.values()])

    # Non-blocking: the MPI_Wait row names its MPI_Iallreduce (same comm and seq).
    for pid, wrank in pid_rank.items():
        mine = calls[calls["pid"] == pid]
        ia = mine[mine["op"] == ops.index("MPI_Iallreduce")]
        wt = mine[mine["op"] == ops.index("MPI_Wait")]
        assert len(wt) == len(ia) == repeat
        assert list(wt["seq"]) == list(ia["seq"]) and list(wt["comm_id"]) == list(ia["comm_id"])
        assert list(wt["bytes"]) == list(ia["bytes"])
        # Point to point: the Sendrecv ring and one Send/Recv pair from rank 0 to rank 1.
        sr = mine[mine["op"] == ops.index("MPI_Sendrecv")]
        assert len(sr) == 1 and int(sr["root_or_peer"][0]) == (wrank + 1) % nranks
        assert int(sr["tag"][0]) == plan.SENDRECV_TAG and int(sr["bytes"][0]) == 36 and int(sr["seq"][0]) == 0
        rv = mine[mine["op"] == ops.index("MPI_Recv")]
        half = rv[rv["tag"] == plan.SENDRECV_TAG]
        assert len(half) == 1 and int(half["root_or_peer"][0]) == (wrank - 1) % nranks
        assert int(half["bytes"][0]) == 36 and int(half["t_enter_ns"][0]) == int(sr["t_enter_ns"][0])
        sends = mine[mine["op"] == ops.index("MPI_Send")]
        plain_recv = rv[rv["tag"] == 3]
        assert len(sends) == (1 if wrank == 0 else 0) and len(plain_recv) == (1 if wrank == 1 else 0)
        for r in (*sends, *plain_recv):
            assert int(r["bytes"]) == 88 and int(r["root_or_peer"]) == (1 if wrank == 0 else 0)
            assert int(r["comm_id"]) == world and int(r["seq"]) == 0


# --- the NCCL calls of tests/progs/nccl_calls.py --------------------------------------------------
def nccl_library() -> Path | None:
    """libnccl.so.2 of the nvidia-nccl-cu12 wheel in this environment, if installed."""
    found = sorted((REPO / ".venv" / "lib").glob("python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"))
    return found[0] if found else None


def check_nccl(calls: Any, raw: Any, comm_events: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    """Each NCCL entry point once, every argument as given (stack-passed ones included)."""
    from gpuprof.collector.sources import collective_calls as cc
    from gpuprof.collector.sources import probe_table as pt

    ops = schema.COLLECTIVE_OPS
    got = {ops[int(r["op"])]: r for r in calls}
    for name, want in expected["calls"].items():
        assert name in got, f"{name} not captured: {sorted(got)}"
        r = got[name]
        assert sum(1 for x in calls if ops[int(x["op"])] == name) == 1, name
        assert int(r["library"]) == 1 and int(r["handle"]) == 0
        assert int(r["ret"]) == want["ret"], name
        assert int(r["bytes"]) == want["bytes"], (name, int(r["bytes"]), want["bytes"])
        assert int(r["root_or_peer"]) == want["peer"], (name, int(r["root_or_peer"]))
    # The stream (argument 6, 7 or 8; on the stack for all but ncclAllGather/Send/Recv) is in aux.
    for r in raw:
        name = ops[int(r["op"])]
        if name not in ("ncclGroupStart", "ncclGroupEnd"):
            assert int(r["aux"]) == expected["stream"], name
    # One counter for the collectives of a communicator, one per (peer, direction) for send/recv.
    colls = [n for n in expected["order"] if n in expected["calls"] and n not in
             ("ncclGroupStart", "ncclGroupEnd", "ncclSend", "ncclRecv")]
    assert [int(got[n]["seq"]) for n in colls] == list(range(len(colls)))
    assert int(got["ncclSend"]["seq"]) == 0 and int(got["ncclRecv"]["seq"]) == 0
    for n in ("ncclGroupStart", "ncclGroupEnd"):
        assert int(got[n]["seq"]) == pt.GP_SEQ_NONE
    by_op = {cc.comm_op_name(int(e["op"])): e for e in comm_events}
    init = by_op["ncclCommInitRank"]
    assert (init["size"], init["rank"]) == (expected["init"]["nranks"], expected["init"]["rank"])
    cfg = by_op["ncclCommInitRankConfig"]
    assert (cfg["size"], cfg["rank"]) == (expected["init"]["nranks"], expected["init"]["rank"])
    # The ncclUniqueId, passed by value on the stack: the BPF path copies its bytes, the fast path
    # sends their FNV-1a hash (its records have no room for them); either is checked exactly.
    uid = bytes.fromhex(expected["init"]["uid"])
    for ev in (init, cfg):
        if ev.get("uid_hash"):
            assert ev["uid_hash"] == cc.fnv1a64(uid)
        else:
            assert bytes(ev["uid"]) == uid
    split = by_op["ncclCommSplit"]
    assert (split["color"], split["key"]) == (expected["split"]["color"], expected["split"]["key"])
    assert split["ret"] == expected["split"]["ret"] and init["ret"] == expected["init"]["ret"]
    for name in ("ncclCommDestroy", "ncclCommAbort"):
        assert by_op[name]["handle"] == 0 and by_op[name]["ret"] == expected[name]
    # ncclCommInitAll reports one communicator per device (rank i of ndev).
    initall = [e for e in comm_events if cc.comm_op_name(int(e["op"])) == "ncclCommInitAll"]
    assert [(e["rank"], e["size"]) for e in initall] == [(i, 2) for i in range(expected["initall"]["ndev"])]


def own_cgroup_dir() -> str | None:
    """A cgroup directory this process is in, named as find_job_cgroups names the job's (under
    /sys/fs/cgroup); None when it is in none but the roots."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if path.strip("/"):
            hierarchy = controllers.removeprefix("name=")
            return f"/sys/fs/cgroup/{hierarchy}{path}" if hierarchy else f"/sys/fs/cgroup{path}"
    return None
