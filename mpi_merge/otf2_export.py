"""OTF2 archive of the aligned MPI events of a merged job file (`gpuprof export --format otf2`), for
Vampir and Scalasca (written with the `otf2` package, 3.2: Score-P's OTF2 library and its Python
bindings, a manylinux wheel).

Layout: the system tree is job -> node -> one location group (process) per (node, pid) -> one
location (CPU thread) per thread that made calls. Every communicator of /collectives is an OTF2
communicator over those locations, in its rank order (a COMM_GROUP of the COMM_LOCATIONS group of
all locations, paradigm MPI; NCCL communicators are written the same way, named as such). Each
collective call becomes Enter, MpiCollectiveBegin at its aligned enter time and MpiCollectiveEnd
(op, communicator, root, bytes), Leave at its aligned exit; point-to-point and wait calls become
Enter/Leave of their region only (their messages are not written as MpiSend/MpiRecv records).
Times are the aligned clock in ns (timer resolution 1e9 Hz, offset the earliest event). A call that
never returned (exit -1) is left out, counted in the result: an open region would break readers.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.errors import TraceFormatError
from gpuprof.mpi_merge.matching import P2P_OPS

UNDEFINED_ROOT = 2**32 - 1  # OTF2_UNDEFINED_UINT32: a collective without a root
# schema op name (without MPI_/nccl prefix, lower case) -> OTF2 CollectiveOp member, region role
_OTF2_OPS = {
    "allreduce": ("ALLREDUCE", "COLL_ALL2ALL"), "iallreduce": ("ALLREDUCE", "COLL_ALL2ALL"),
    "reduce": ("REDUCE", "COLL_ALL2ONE"), "ireduce": ("REDUCE", "COLL_ALL2ONE"),
    "bcast": ("BCAST", "COLL_ONE2ALL"), "ibcast": ("BCAST", "COLL_ONE2ALL"), "broadcast": ("BCAST", "COLL_ONE2ALL"),
    "barrier": ("BARRIER", "BARRIER"), "ibarrier": ("BARRIER", "BARRIER"),
    "allgather": ("ALLGATHER", "COLL_ALL2ALL"), "iallgather": ("ALLGATHER", "COLL_ALL2ALL"),
    "allgatherv": ("ALLGATHERV", "COLL_ALL2ALL"),
    "alltoall": ("ALLTOALL", "COLL_ALL2ALL"), "ialltoall": ("ALLTOALL", "COLL_ALL2ALL"),
    "alltoallv": ("ALLTOALLV", "COLL_ALL2ALL"),
    "reduce_scatter": ("REDUCE_SCATTER", "COLL_ALL2ALL"), "ireduce_scatter": ("REDUCE_SCATTER", "COLL_ALL2ALL"),
    "reducescatter": ("REDUCE_SCATTER", "COLL_ALL2ALL"), "reduce_scatter_block": ("REDUCE_SCATTER_BLOCK", "COLL_ALL2ALL"),
    "gather": ("GATHER", "COLL_ALL2ONE"), "igather": ("GATHER", "COLL_ALL2ONE"), "gatherv": ("GATHERV", "COLL_ALL2ONE"),
    "scatter": ("SCATTER", "COLL_ONE2ALL"), "iscatter": ("SCATTER", "COLL_ONE2ALL"), "scatterv": ("SCATTERV", "COLL_ONE2ALL"),
    "scan": ("SCAN", "COLL_OTHER"), "iscan": ("SCAN", "COLL_OTHER"),
}
ROOTED = {"REDUCE", "BCAST", "GATHER", "GATHERV", "SCATTER", "SCATTERV"}


def _otf2() -> Any:
    try:
        import otf2
    except ImportError as e:
        raise TraceFormatError(f"the OTF2 export needs the 'otf2' package (pip install otf2==3.2): {e}") from None
    return otf2


def _op_key(name: str) -> str:
    for prefix in ("MPI_", "nccl"):
        name = name.removeprefix(prefix)
    return name.lower()


@dataclass
class Otf2Counts:
    locations: int = 0
    collectives: int = 0  # MpiCollectiveEnd records
    regions_only: int = 0  # point-to-point and wait calls (Enter/Leave only)
    never_returned: int = 0  # calls left out

    @property
    def events(self) -> int:
        return 4 * self.collectives + 2 * self.regions_only


def export_otf2(f: h5py.File, out: Path) -> Otf2Counts:
    """Writes the archive OUT (a directory: OUT/traces.otf2 is the anchor file readers open)."""
    otf2 = _otf2()
    nodes: list[str] = json.loads(f.attrs["nodes"])
    ops = schema.COLLECTIVE_OPS
    counts = Otf2Counts()
    # every (node, pid, tid) that made calls, and each call's row
    per_node: dict[str, np.ndarray] = {}
    threads: list[tuple[str, int, int]] = []
    for node in nodes:
        g = f[f"nodes/{node}"]
        if "collectives/calls" not in g or "collectives/calls_aligned" not in g or not g["collectives/calls"].shape[0]:
            continue
        calls = g["collectives/calls"][()]
        al = g["collectives/calls_aligned"][()]
        rows = np.zeros(len(calls), [("pid", "<u4"), ("tid", "<u4"), ("op", "<i4"), ("comm_id", "<u8"), ("bytes", "<u8"),
                                     ("root", "<i8"), ("enter", "<i8"), ("exit", "<i8")])
        rows["pid"], rows["tid"], rows["op"] = calls["pid"], calls["tid"], calls["op"]
        rows["comm_id"], rows["bytes"], rows["root"] = calls["comm_id"], calls["bytes"], calls["root_or_peer"]
        rows["enter"], rows["exit"] = al["t_enter_aligned_ns"], al["t_exit_aligned_ns"]
        per_node[node] = rows
        threads += sorted({(node, int(p), int(t)) for p, t in zip(rows["pid"], rows["tid"])})
    if not threads:
        raise TraceFormatError("no collective or point-to-point calls in this job file: nothing for OTF2")
    t_min = min(int(r["enter"][r["enter"] >= 0].min()) for r in per_node.values() if (r["enter"] >= 0).any())
    if out.exists():
        # replaced only when it is an archive (a re-export): never a directory that holds anything else
        if not out.is_dir() or not (out / "traces.otf2").exists() or any(
                p.name not in ("traces.otf2", "traces.def", "traces") for p in out.iterdir()):
            raise TraceFormatError(f"{out}: exists and is not an OTF2 archive (traces.otf2, traces.def, traces/): "
                                   "not replaced; give a new path")
        shutil.rmtree(out)
    with otf2.writer.open(str(out), timer_resolution=1_000_000_000) as trace:
        d = trace.definitions
        root = d.system_tree_node(f"job {f.attrs['job_id']}")
        tree = {n: d.system_tree_node(n, parent=root) for n in nodes}
        groups: dict[tuple[str, int], Any] = {}
        locations: dict[tuple[str, int, int], Any] = {}
        for node, pid, tid in threads:
            if (node, pid) not in groups:
                groups[(node, pid)] = d.location_group(f"{node} pid {pid}", system_tree_parent=tree[node])
            locations[(node, pid, tid)] = d.location(f"{node} pid {pid} tid {tid}", type=otf2.LocationType.CPU_THREAD,
                                                     group=groups[(node, pid)])
        counts.locations = len(locations)
        first_thread: dict[tuple[str, int], Any] = {}
        for k in sorted(locations):
            first_thread.setdefault(k[:2], locations[k])
        all_locs = list(locations.values())
        d.group("all locations", group_type=otf2.GroupType.COMM_LOCATIONS, paradigm=otf2.Paradigm.MPI, members=all_locs)
        comms: dict[int, Any] = {}
        for name in sorted(k for k in f.get("collectives", {}) if k.startswith("comm_")):
            g = f["collectives"][name]
            cid = int(g.attrs["comm_id"])
            node_of = json.loads(g.attrs["node_of_rank_json"])
            pid_of = [int(p) for p in np.asarray(g.attrs["pid_of_rank"]).tolist()]
            # each rank is its process's first thread that called (a rank's calls come from one thread in MPI)
            members = [first_thread[(n, p)] for n, p in zip(node_of, pid_of) if (n, p) in first_thread]
            if not members:
                continue
            grp = d.group(f"comm {cid:#x} ranks", group_type=otf2.GroupType.COMM_GROUP, paradigm=otf2.Paradigm.MPI,
                          members=members)
            comms[cid] = d.comm(f"comm {cid:#x} ({len(node_of)} ranks)", group=grp)
        regions: dict[int, Any] = {}

        def region(op: int) -> Any:
            if op not in regions:
                nm = ops[op] if 0 <= op < len(ops) else f"op {op}"
                key = _OTF2_OPS.get(_op_key(nm))
                role = getattr(otf2.RegionRole, key[1]) if key else (
                    otf2.RegionRole.POINT2POINT if op in P2P_OPS else otf2.RegionRole.FUNCTION)
                regions[op] = d.region(nm, region_role=role, paradigm=otf2.Paradigm.MPI)
            return regions[op]

        for node, rows in per_node.items():
            for key in sorted({(int(p), int(t)) for p, t in zip(rows["pid"], rows["tid"])}):
                mine = rows[(rows["pid"] == key[0]) & (rows["tid"] == key[1])]
                mine = mine[np.argsort(mine["enter"], kind="stable")]
                w = trace.event_writer_from_location(locations[(node, *key)])
                last_exit = -1
                for r in mine:
                    e, x, op = int(r["enter"]), int(r["exit"]), int(r["op"])
                    if e < 0 or x < e:
                        counts.never_returned += 1
                        continue
                    e = max(e, last_exit)  # aligned times of one thread stay in order (readers require it)
                    x = max(x, e)
                    reg = region(op)
                    w.enter(e - t_min, reg)
                    nm = ops[op] if 0 <= op < len(ops) else ""
                    ok = _OTF2_OPS.get(_op_key(nm))
                    comm = comms.get(int(r["comm_id"]))
                    if ok is not None and comm is not None and op not in P2P_OPS:
                        w.mpi_collective_begin(e - t_min)
                        rt = int(r["root"]) if ok[0] in ROOTED and int(r["root"]) >= 0 else UNDEFINED_ROOT
                        w.mpi_collective_end(x - t_min, getattr(otf2.CollectiveOp, ok[0]), comm, rt,
                                             int(r["bytes"]), int(r["bytes"]))
                        counts.collectives += 1
                    else:
                        counts.regions_only += 1
                    w.leave(x - t_min, reg)
                    last_exit = x
    return counts
