"""The trace exports read back by their own tools' readers: Perfetto's protobuf (parsed with the
`perfetto` package's Trace message), OTF2 (read with the `otf2` package's reader), and the Chrome
JSON export's tracks (no two communicators' ranks on one thread)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from gpuprof.collector import schema
from gpuprof.collector.symbolize import folded_stacks
from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.cli import export as export_cmd
from gpuprof.mpi_merge.jobclock import node_time_mapper
from gpuprof.mpi_merge.merge import merge

perfetto_pb2 = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")
otf2 = pytest.importorskip("otf2")

RECORDING = Path(__file__).parent / "recordings" / "demo-4nodes"


@pytest.fixture(scope="module")
def demo_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("demo") / "demo.gpuprof.d"
    shutil.copytree(RECORDING, d)
    res = merge(str(d))
    assert res is not None
    return res.job_file


@pytest.fixture(scope="module")
def gpu_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic job (GPU metrics, two communicators) with NVTX ranges and kernel launches added
    to node000's tables in the job file (the generator writes none)."""
    d = tmp_path_factory.mktemp("syn") / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=2, gpus_per_node=2, disjoint_comms=2, seed=9), d)
    res = merge(str(d))
    assert res is not None
    with h5py.File(res.job_file, "r+") as f:
        g = f["nodes/node000"]
        t0 = int(g["gpu/samples"][0]["t_ns"])
        for path in ("nvtx/ranges", "nvtx/strings", "kernels/launches", "kernels/functions"):
            if path in g:
                del g[path]
        r = np.zeros(3, schema.TABLES_BY_PATH["/nvtx/ranges"].dtype)
        r["t_start_ns"] = [t0, t0 + 1000, t0 + 5_000_000]
        r["t_end_ns"] = [t0 + 4_000_000, t0 + 2_000_000, t0 + 6_000_000]
        r["pid"], r["tid"], r["name_id"], r["depth"] = 77, 77, [1, 2, 1], [0, 1, 0]
        g.create_dataset("nvtx/ranges", data=r)
        s = np.zeros(2, schema.TABLES_BY_PATH["/nvtx/strings"].dtype)
        s["pid"], s["string_id"], s["text"] = 77, [1, 2], [b"step <b>", b"forward"]
        g.create_dataset("nvtx/strings", data=s)
        k = np.zeros(4, schema.TABLES_BY_PATH["/kernels/launches"].dtype)
        k["t_ns"] = t0 + np.arange(4) * 1_000_000
        k["pid"], k["tid"], k["function"], k["grid_x"], k["grid_y"], k["grid_z"] = 77, 77, 0xABC, 8, 1, 1
        g.create_dataset("kernels/launches", data=k)
        fn = np.zeros(1, schema.TABLES_BY_PATH["/kernels/functions"].dtype)
        fn["pid"], fn["function"], fn["name"] = 77, 0xABC, b"gemm_kernel"
        g.create_dataset("kernels/functions", data=fn)
    return res.job_file


def export(job: Path, fmt: str, out: Path) -> None:
    r = CliRunner().invoke(export_cmd, [str(job), "--format", fmt, "-o", str(out)])
    assert r.exit_code == 0, r.output


def calls_in_tables(job: Path) -> dict[str, int]:
    """Calls per communicator group with an enter and an exit (what both exports must hold)."""
    out = {}
    with h5py.File(job, "r") as f:
        for name in f["collectives"]:
            g = f["collectives"][name]
            e, x = g["enter_aligned_ns"][()], g["exit_aligned_ns"][()]
            out[f"{int(g.attrs['comm_id']):#x}"] = int(((e >= 0) & (x >= e)).sum())
    return out


def read_perfetto(path: Path) -> list:
    return list(perfetto_pb2.Trace.FromString(path.read_bytes()).packet)


def test_perfetto_proto_collectives_and_flows(demo_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pftrace"
    export(demo_job, "perfetto-proto", out)
    pk = read_perfetto(out)
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in pk if p.HasField("track_descriptor")}
    procs = {u: t.process.process_name for u, t in tracks.items() if t.HasField("process")}
    assert sorted(procs.values()) == ["node1", "node2", "node3", "node4"]
    assert len({t.process.pid for t in tracks.values() if t.HasField("process")}) == 4
    rank_tracks = {u: t for u, t in tracks.items() if t.name.startswith("comm ")}
    assert len({t.name for t in rank_tracks.values()}) == len(rank_tracks) == 2 + 4 + 2  # no two ranks share a track
    assert all(t.parent_uuid in procs for t in rank_tracks.values())
    begins = Counter()
    flows_out, flows_in = Counter(), Counter()
    for p in pk:
        if p.HasField("track_event") and p.track_event.type == perfetto_pb2.TrackEvent.TYPE_SLICE_BEGIN:
            e = p.track_event
            if e.track_uuid in rank_tracks:
                begins[rank_tracks[e.track_uuid].name.split(" ")[1]] += 1
                flows_in.update(e.terminating_flow_ids)
            flows_out.update(e.flow_ids)
    assert dict(begins) == calls_in_tables(demo_job)
    # every rank's slice ends one flow from its instance's slice, each flow used once
    assert flows_in == flows_out and set(flows_in.values()) == {1} and sum(flows_in.values()) == sum(begins.values())
    # host counters per node, raw samples
    counters = {u: t for u, t in tracks.items() if t.HasField("counter")}
    cpu = [u for u, t in counters.items() if t.name == "cpu_busy"]
    assert len(cpu) == 4
    # a value is its event's own (track_uuid) or one of its extra counter values
    n_cpu = sum((p.track_event.track_uuid in set(cpu)) + sum(u in set(cpu) for u in p.track_event.extra_double_counter_track_uuids)
                for p in pk if p.HasField("track_event"))
    with h5py.File(demo_job, "r") as f:
        assert n_cpu == sum(int(np.isfinite(f[f"nodes/{n}/host/node"]["cpu_busy"]).sum()) for n in ("node1", "node2", "node3", "node4"))


def test_perfetto_proto_stack_samples(demo_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pftrace"
    export(demo_job, "perfetto-proto", out)
    pk = read_perfetto(out)
    names, frames, stacks = {}, {}, {}
    for p in pk:
        if p.HasField("interned_data"):
            names.update({s.iid: s.str.decode() for s in p.interned_data.function_names})
            frames.update({fr.iid: fr.function_name_id for fr in p.interned_data.frames})
            stacks.update({c.iid: list(c.frame_ids) for c in p.interned_data.callstacks})
    samples = [p.perf_sample for p in pk if p.HasField("perf_sample")]
    threads = {p.track_descriptor.thread.tid: p.track_descriptor.thread for p in pk
               if p.HasField("track_descriptor") and p.track_descriptor.HasField("thread")}
    assert all(s.tid in threads and threads[s.tid].pid == s.pid for s in samples)  # each a thread of its node
    with h5py.File(demo_job, "r") as f:
        total = sum(int(f[f"nodes/{n}/stacks/samples"]["count"].sum()) for n in ("node1", "node2", "node3", "node4"))
    assert len(samples) == total
    assert all(s.callstack_iid in stacks for s in samples)
    # node3's samples (pid = node index + 1), as folded stacks, are the collector's own folding
    got = Counter(";".join(names[frames[i]] for i in stacks[s.callstack_iid]) or "[no stack]"
                  for s in samples if s.pid == 3)
    with h5py.File(demo_job, "r") as f:
        want = folded_stacks(f["nodes/node3"])
    assert got == want


def test_perfetto_proto_gpu_counters_nvtx_kernels(gpu_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "g.pftrace"
    export(gpu_job, "perfetto-proto", out)
    pk = read_perfetto(out)
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in pk if p.HasField("track_descriptor")}
    node = {u: t.process.process_name for u, t in tracks.items() if t.HasField("process")}
    names = Counter((node[t.parent_uuid], t.name) for t in tracks.values() if t.HasField("counter"))
    for n in ("node000", "node003"):
        for m in ("gpu0 util_gpu", "gpu1 util_gpu", "gpu0 sm_activity", "gpu1 power_w", "cpu_busy"):
            assert names[(n, m)] == 1, (n, m)
    # node000 gpu1's power: every finite sample, at its aligned time, with its value
    n0 = next(u for u, t in tracks.items() if t.HasField("process") and t.process.process_name == "node000")
    tr = next(u for u, t in tracks.items() if t.parent_uuid == n0 and t.name == "gpu1 power_w")
    got = []
    for p in pk:
        if not p.HasField("track_event"):
            continue
        e = p.track_event
        if e.track_uuid == tr:
            got.append((p.timestamp, e.double_counter_value))
        got += [(p.timestamp, v) for u, v in zip(e.extra_double_counter_track_uuids, e.extra_double_counter_values) if u == tr]
    with h5py.File(gpu_job, "r") as f:
        rows = f["nodes/node000/gpu/samples"][()]
        rows = rows[(rows["gpu"] == 1) & np.isfinite(rows["power_w"])]
        want = list(zip(node_time_mapper(f, "node000")(rows["t_ns"]).tolist(), rows["power_w"].astype(float).tolist()))
    assert sorted(got) == sorted(want)
    # two disjoint communicators: each rank on its own track
    assert len([t for t in tracks.values() if t.name.startswith("comm ")]) == 4
    ev = [p for p in pk if p.HasField("track_event")]
    nvtx_tracks = {u for u, t in tracks.items() if t.name.startswith("NVTX tid 77")}
    assert len(nvtx_tracks) == 2  # depths 0 and 1
    nv = [p.track_event.name for p in ev if p.track_event.track_uuid in nvtx_tracks and p.track_event.name]
    assert sorted(nv) == ["forward", "step <b>", "step <b>"]
    kt = {u for u, t in tracks.items() if t.name == "kernel launches"}
    ks = [p for p in ev if p.track_event.track_uuid in kt]
    assert len(ks) == 4 and {p.track_event.name for p in ks} == {"gemm_kernel"}
    conv = node_time_mapper(h5py.File(gpu_job, "r"), "node000")
    with h5py.File(gpu_job, "r") as f:
        want = conv(f["nodes/node000/kernels/launches"]["t_ns"])
    assert sorted(p.timestamp for p in ks) == sorted(int(x) for x in want)


def test_chrome_json_ranks_of_two_communicators_on_distinct_threads(gpu_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    export(gpu_job, "chrome-json", out)
    ev = json.loads(out.read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(names) == 4 and len(set(names.values())) == 4
    used = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "X"}
    assert used == set(names)


def test_otf2_read_back(demo_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "demo.otf2"
    export(demo_job, "otf2", out)
    with otf2.reader.open(str(out / "traces.otf2")) as tr:
        comms = {c.name: len(c.group.members) for c in tr.definitions.comms}
        locs = list(tr.definitions.locations)
        kinds = Counter()
        per_comm = Counter()
        last: dict[str, int] = {}
        for loc, e in tr.events:
            kinds[type(e).__name__] += 1
            assert e.time >= last.get(loc.name, 0), "events of a location out of time order"
            last[loc.name] = e.time
            if isinstance(e, otf2.events.MpiCollectiveEnd):
                per_comm[e.communicator.name.split(" ")[1]] += 1
    want = calls_in_tables(demo_job)
    assert dict(per_comm) == want
    assert comms == {f"comm {c} ({n} ranks)": n for c, n in
                     (("0x6f7bab889a2962a9", 2), ("0x7719e74e427bcdfd", 4), ("0xa15d191a3fdcc331", 2))}
    assert len(locs) == 4  # one MPI process (one calling thread) per node
    assert kinds["Enter"] == kinds["Leave"] == kinds["MpiCollectiveBegin"] == kinds["MpiCollectiveEnd"] == sum(want.values())


def test_otf2_replaces_its_own_archive_only(demo_job: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.otf2"
    export(demo_job, "otf2", out)
    export(demo_job, "otf2", out)  # a re-export replaces it
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    r = CliRunner().invoke(export_cmd, [str(demo_job), "--format", "otf2", "-o", str(keep)])
    assert r.exit_code == 1 and "is not an OTF2 archive" in r.output
    assert (keep / "notes.txt").read_text() == "precious"
    r = CliRunner().invoke(export_cmd, [str(demo_job), "--format", "perfetto-proto", "-o", str(keep)])
    assert r.exit_code == 1 and "is a directory" in r.output
