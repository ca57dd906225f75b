"""NCCL_DEBUG ingestion (mpi_merge/nccl_log.py): topology, ops, init timings, and lines that two
ranks interleaved or a dying job cut short.

The fixtures are short excerpts rewritten (host names, pids, addresses changed) from NCCL_DEBUG=INFO
logs pasted in public issues: NVIDIA/nccl #226 (NCCL 2.4 "Ring ... via NET/Socket"), #671 and
#1027 (P2P channels, rings, trees), #1412 (init timings, Init COMPLETE), nccl-tests #252
(NET/IBext GDRDMA, trees), pytorch/torchtitan #1369 and NVIDIA/nccl #203 (COLL op lines).
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from gpuprof.mpi_merge.nccl_log import (
    NcclLog,
    find_logs,
    parse_files,
    parse_lines,
    summary_text,
    transport_of,
    write_group,
    write_into_job_file,
)

NODE_A = """\
gpuA:4100:4100 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
gpuA:4100:4130 [0] NCCL INFO comm 0x55a0000010 rank 0 nRanks 4 nNodes 2 localRanks 2 localRank 0 MNNVL 0
gpuA:4101:4131 [1] NCCL INFO comm 0x55b0000020 rank 1 nRanks 4 nNodes 2 localRanks 2 localRank 1 MNNVL 0
gpuA:4100:4130 [0] NCCL INFO Channel 00/02 :    0   1   2   3
gpuA:4100:4130 [0] NCCL INFO Channel 01/02 :    0   1   2   3
gpuA:4100:4130 [0] NCCL INFO Trees [0] 1/2/-1->0->-1 [1] 1/-1/-1->0->2
gpuA:4101:4131 [1] NCCL INFO Trees [0] -1/-1/-1->1->0 [1] -1/-1/-1->1->0
gpuA:4100:4130 [0] NCCL INFO Channel 00/0 : 0[1000] -> 1[2000] via P2P/IPC/read
gpuA:4101:4131 [1] NCCL INFO Channel 00/0 : 1[2000] -> 2[1000] [send] via NET/IBext_v8/0/GDRDMA
gpuA:4100:4130 [0] NCCL INFO Channel 01/0 : 3[2000] -> 0[1000] [receive] via NET/IB/1
gpuA:4101:4131 [1] NCCL INFO Channel 01 : 1[2000] -> 0[1000] via SHM/direct/direct
gpuA:4100:4130 [0] NCCL INFO ncclCommInitRank comm 0x55a0000010 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 1000 commId 0x9f00aa11bb22cc33 - Init COMPLETE
gpuA:4100:4130 [0] NCCL INFO Init timings: rank 0 nranks 4 total 0.71 (kernels 0.40, bootstrap 0.12, allgathers 0.01, topo 0.10, graphs 0.05, connections 0.03, rest 0.00)
gpuA:4101:4131 [1] NCCL INFO ncclCommInitRank comm 0x55b0000020 rank 1 nranks 4 cudaDev 1 nvmlDev 1 busId 2000 commId 0x9f00aa11bb22cc33 - Init COMPLETE
gpuA:4101:4131 [1] NCCL INFO Init timings: rank 1 nranks 4 total 2.35 (kernels 0.41, bootstrap 1.80, allgathers 0.01, topo 0.08, graphs 0.03, connections 0.02, rest 0.00)
step 10 loss 3.21
gpuA:4100:4100 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7f0000000000 recvbuff 0x7f0000000000 count 1048576 datatype 7 op 0 root 0 comm 0x55a0000010 [nranks=4] stream 0x55a00000f0
gpuA:4101:4101 [1] NCCL INFO AllReduce: opCount 0 sendbuff 0x7f1000000000 recvbuff 0x7f1000000000 count 1048576 datatype 7 op 0 root 0 comm 0x55b0000020 [nranks=4] stream 0x55b00000f0
gpuA:4100:4100 [0] NCCL INFO AllGather: opCount 1 sendbuff 0x7f0000100000 recvbuff 0x7f0000200000 count 2097152 datatype 9 op 0 root 0 comm 0x55a0000010 [nranks=4] stream 0x55a00000f0
gpuA:4100:4100 [0] NCCL INFO [0] AllReduce: opCount 2 sendbuff 0x7f0000000000 recvbuff 0x7f0000000000 count 1048576 datatype 7 op 0 root 0 comm 0x55a0000010 [nranks=4] stream 0x55a00000f0
"""
# NCCL 2.4: rings with the old "Ring" wording and the old tree form (up->rank->down)
OLD = """\
cpuB:900:905 [0] NCCL INFO Ring 00 : 3 -> 2 [send] via NET/Socket/0
cpuB:900:905 [0] NCCL INFO Trees [0] 1->2->3/-1/-1
cpuB:900:905 [0] NCCL INFO comm 0x7e00 rank 2 nranks 4 cudaDev 0 nvmlDev 0 - Init COMPLETE
"""


def test_topology_ops_and_init_timings() -> None:
    log = parse_lines(NODE_A.splitlines(keepends=True))
    assert log.versions == {"2.21.5+cuda12.4"}
    assert log.malformed == 0 and log.interleaved == 0
    rings = [(r["pid"], r["channel"], r["channels"], r["order"]) for r in log.rings]
    assert rings == [(4100, 0, 2, [0, 1, 2, 3]), (4100, 1, 2, [0, 1, 2, 3])]
    t0 = next(t for t in log.trees if t["pid"] == 4100 and t["channel"] == 0)
    assert (t0["rank"], t0["up"], t0["down"]) == (0, -1, [1, 2])
    t1 = next(t for t in log.trees if t["pid"] == 4101 and t["channel"] == 1)
    assert (t1["rank"], t1["up"], t1["down"]) == (1, 0, [])
    conns = {(c["src"], c["dst"]): (c["transport"], c["direction"]) for c in log.connections}
    assert conns == {(0, 1): ("P2P", ""), (1, 2): ("NET/IB", "send"), (3, 0): ("NET/IB", "receive"),
                     (1, 0): ("SHM", "")}
    comms = {c.pid: c for c in log.communicators.values()}
    assert comms[4100].rank == 0 and comms[4100].nranks == 4 and comms[4100].init_complete
    assert comms[4100].comm_id == comms[4101].comm_id == "0x9f00aa11bb22cc33"
    assert comms[4101].init_total_s == 2.35 and comms[4101].init_parts_s["bootstrap"] == 1.80
    ops = log.ops_array()
    assert len(ops) == 4 and set(ops["rank"]) == {0, 1}  # ranks from the init lines of the same comm
    ar = ops[(ops["op"] == b"AllReduce") & (ops["pid"] == 4100)]
    assert list(ar["op_count"]) == [0, 2] and set(ar["bytes"]) == {4 * 1048576}  # float32
    ag = ops[ops["op"] == b"AllGather"][0]
    assert ag["bytes"] == 2 * 2097152 and ag["nranks"] == 4  # bfloat16
    assert np.isnan(ag["t_ms"])  # INFO lines carry no time
    summ = {(s["pid"], s["op"]): s for s in log.op_summary()}
    assert summ[(4100, "AllReduce")]["calls"] == 2 and summ[(4100, "AllReduce")]["bytes"] == 8 * 1048576
    text = "\n".join(summary_text(log))
    assert "AllReduce: 3 calls" in text and "NET/IB 2" in text and "slowest rank 1 on gpuA 2.35 s" in text


def test_old_ring_and_tree_forms() -> None:
    log = parse_lines(OLD.splitlines())
    assert log.connections[0]["transport"] == "NET/Socket" and log.connections[0]["direction"] == "send"
    assert (log.trees[0]["up"], log.trees[0]["rank"], log.trees[0]["down"]) == (1, 2, [3])
    assert log.malformed == 0


def test_trace_lines_keep_their_time() -> None:
    line = ("gpuC:77:78 [3] 1234.567890 enqueue.cc:1850 NCCL TRACE AllReduce: opCount 5 sendbuff 0x1 recvbuff 0x2 "
            "count 10 datatype 4 op 0 root 0 comm 0xabc [nranks=8] stream 0x9\n")
    log = parse_lines([line])
    op = log.ops_array()[0]
    assert op["t_ms"] == pytest.approx(1234.56789) and op["bytes"] == 80 and op["rank"] == -1  # no init seen


def test_interleaved_and_truncated_lines_are_counted_not_guessed() -> None:
    lines = [
        # rank 1's record starts before rank 0's newline: rank 0's ring line is cut
        "gpuA:4100:4130 [0] NCCL INFO Channel 00/02 :    0   1gpuA:4101:4131 [1] NCCL INFO Trees [0] -1/-1/-1->1->0\n",
        "   2   3\n",  # the rest of the cut line: no prefix, not ours
        # an op line cut before its communicator (a killed job)
        "gpuA:4100:4100 [0] NCCL INFO AllReduce: opCount 7 sendbuff 0x7f00 recvbuff 0x7f00 count 1048",
        "gpuA:4100:4130 [0] NCCL INFO Trees [0] 1/2/",  # a tree line cut short
        ("gpuA:4100:4100 [0] NCCL INFO AllReduce: opCount 8 sendbuff 0x7f00 recvbuff 0x7f00 count 16 datatype 7 op 0 "
        "root 0 comm 0x55a0000010 [nranks=4] stream 0x55a00000f0\n"),
        "\x00\x00garbage \xff line\n",
    ]
    log = parse_lines(lines)
    assert log.interleaved == 1 and log.malformed == 3
    assert not log.rings  # the cut ring is not kept with a made-up order
    assert len(log.trees) == 1 and log.trees[0]["rank"] == 1  # the whole record after the cut one
    ops = log.ops_array()
    assert list(ops["op_count"]) == [8] and ops["bytes"][0] == 64
    assert any("count 1048" in s for s in log.counters()["malformed_samples"])


def test_transport_names() -> None:
    assert transport_of("P2P/CUMEM") == "P2P" and transport_of("NET/Socket/3") == "NET/Socket"
    assert transport_of("NET/IBext_v8/0/GDRDMA") == "NET/IB" and transport_of("CollNet/0") == "CollNet"


def test_files_found_parsed_and_written_to_the_job_file(tmp_path: Path) -> None:
    node_dir = tmp_path / "slurm-5.gpuprof.d"
    (node_dir / "nccl").mkdir(parents=True)
    # per-process NCCL_DEBUG_FILE files (the TaskProlog's nccl/%h.%p.log) and the job's stdout
    a_lines = NODE_A.splitlines(keepends=True)
    (node_dir / "nccl" / "gpuA.4100.log").write_text("".join(line for line in a_lines if ":4100:" in line))
    (node_dir / "nccl" / "gpuA.4101.log").write_text("".join(line for line in a_lines if ":4101:" in line))
    out = tmp_path / "slurm-5.out"
    out.write_text("hello\n" + OLD)
    (tmp_path / "other.out").write_text("no nccl here\n")
    files = find_logs(node_dir, [out, tmp_path / "other.out", tmp_path / "absent.out"])
    assert [f.name for f in files] == ["gpuA.4100.log", "gpuA.4101.log", "slurm-5.out"]
    log = parse_files(files)
    assert len(log.ops) == 4 and len(log.communicators) == 3
    job = tmp_path / "slurm-5.gpuprof.h5"
    with h5py.File(job, "w") as f:
        f.attrs["schema"] = "test"
    write_into_job_file(job, log)
    write_into_job_file(job, log)  # again: replaced, not duplicated
    with h5py.File(job) as f:
        g = f["nccl_log"]
        assert json.loads(g.attrs["versions"]) == ["2.21.5+cuda12.4"]
        assert len(json.loads(g.attrs["sources_json"])) == 3
        assert json.loads(g.attrs["counters_json"])["malformed"] == 0
        assert len(g["ops"]) == 4 and len(g["op_summary"]) == 3
        assert sorted(g["ring_orders"].asstr()[:]) == ["0 1 2 3", "0 1 2 3"]
        assert set(g["connections"]["transport"]) == {b"P2P", b"NET/IB", b"SHM", b"NET/Socket"}
        c = g["communicators"][:]
        assert sorted(c["rank"]) == [0, 1, 2] and np.nanmax(c["init_total_s"]) == 2.35


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="absent.log"):
        parse_files([tmp_path / "absent.log"])


def test_empty_log_writes_empty_tables(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "j.h5", "w") as f:
        g = write_group(f, NcclLog())
        assert len(g["ops"]) == 0 and json.loads(g.attrs["counters_json"])["records"] == 0


def test_matched_to_our_collective_records() -> None:
    from gpuprof.collector import schema
    from gpuprof.mpi_merge.nccl_log import match_calls, our_nccl_calls

    log = parse_lines(NODE_A.splitlines())
    calls = schema.COLLECTIVE_CALLS.empty(3)
    calls["library"] = schema.COLLECTIVE_CALLS.enums["library"].index("nccl")
    calls["pid"] = [4100, 4100, 4101]
    calls["op"] = [schema.COLLECTIVE_OPS.index("ncclAllReduce")] * 2 + [schema.COLLECTIVE_OPS.index("ncclAllReduce")]
    calls["bytes"] = 4 * 1048576
    rows = {(r["pid"], r["op"]): r for r in match_calls(log, our_nccl_calls("gpuA.cluster", calls))}
    assert rows[(4100, "AllReduce")]["agree"] and rows[(4101, "AllReduce")]["agree"]
    # the AllGather our probes did not see: said, with both counts
    ag = rows[(4100, "AllGather")]
    assert not ag["agree"] and (ag["log_calls"], ag["our_calls"]) == (1, 0)


def test_the_merge_reads_the_jobs_nccl_log(tmp_path: Path) -> None:
    """A job that ran with NCCL_DEBUG=INFO (its stdout beside the node directory): the merge puts the
    parsed log into the job file, its summary into the reports, and NCCL's own operation counts
    beside the collectors' (SYNTHETIC NCCL-only job: gpuprof.mpi_merge.synthetic, nccl=True)."""
    from gpuprof.collector import schema
    from gpuprof.mpi_merge import synthetic as syn
    from gpuprof.mpi_merge.merge import merge

    node_dir = tmp_path / "slurm-7.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=2, duration_s=1.0, seed=5, nccl=True, write_bulk=False), node_dir)
    calls = h5py.File(node_dir / "node000.h5")["collectives/calls"][()]
    ours = int((calls["op"] == schema.COLLECTIVE_OPS.index("ncclAllReduce")).sum())
    lines = ["node000-host:10000:10000 [0] NCCL INFO NCCL version 2.21.5+cuda12.4"] + [
        f"node000-host:10000:10000 [0] NCCL INFO AllReduce: opCount {i:x} sendbuff 0x7f00 recvbuff 0x7f00 count 1048576 "
        "datatype 7 op 0 root 0 comm 0x55a0000010 [nranks=2] stream 0x55a00000f0" for i in range(3)]
    (tmp_path / "slurm-7.out").write_text("step 1\n" + "\n".join(lines) + "\n")
    res = merge(str(node_dir), output_stem=str(tmp_path / "slurm-7"))
    assert res is not None
    report = json.loads(res.reports["json"].read_text())
    nl = report["nccl_log"]
    assert nl["files"] == ["slurm-7.out"] and nl["counters"]["malformed"] == 0
    row = next(r for r in nl["calls_against_ours"] if r["pid"] == 10000 and r["op"] == "AllReduce")
    assert (row["log_calls"], row["our_calls"], row["agree"]) == (3, ours, False)
    assert "NCCL log: 2.21.5+cuda12.4" in res.reports["txt"].read_text()
    assert "2.21.5+cuda12.4" in res.reports["html"].read_text()  # the page's NCCL section has it (browser: test_browser)
    with h5py.File(res.job_file) as f:
        assert len(f["nccl_log/ops"]) == 3
