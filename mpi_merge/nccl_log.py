"""NCCL's own log (`NCCL_DEBUG=INFO` or `TRACE`) -> topology, per-operation counts and sizes, and the
durations the log has; written into the job file as the group /nccl_log (docs/job-format.md).

Where the log is: the job's stdout/stderr (NCCL writes there by default, every rank of a node
interleaved), or one file per process when NCCL_DEBUG_FILE is set (the TaskProlog can set it to
`<dir>/nccl.%h.%p.log`: NCCL replaces %h by the host name and %p by the pid).

The line format (NCCL's src/debug.cc, and logs users paste in NVIDIA/nccl issues, e.g. #226, #671,
#1027, #1238, #1412, nccl-tests #252; the test fixtures are short excerpts rewritten from those):

  <host>:<pid>:<tid> [<cudaDev>] NCCL INFO <message>
  <host>:<pid>:<tid> [<cudaDev>] <ms since init> <file/func>:<line> NCCL TRACE <message>

Messages read here:
  comm 0x55.. rank 3 nranks 8 cudaDev 3 nvmlDev 3 busId 3c000 commId 0x.. - Init COMPLETE   (also nRanks)
  Init timings: rank 2 nranks 16 total 1.08 (kernels 0.51, bootstrap 0.22, ...)              (seconds)
  Channel 00/02 :    0   1   2   3                                                           (a ring)
  Trees [0] 1/-1/-1->0->-1 [1] ...       (children/parent as down0/down1/down2->rank->up; old form up->rank->down)
  Channel 00/0 : 0[6000] -> 1[7000] via P2P/IPC/read   ... [send] via NET/Socket/0   ... via NET/IB/0/GDRDMA
  Ring 00 : 35 -> 34 [send] via NET/Socket/0                                            (NCCL 2.4 and older)
  AllReduce: opCount 1b sendbuff 0x.. recvbuff 0x.. count 237184 datatype 7 op 0 root 0 comm 0x.. [nranks=2] stream 0x..
             (NCCL_DEBUG_SUBSYS=COLL; some versions put "[<n>] " before the name)
  NCCL version 2.18.3+cuda12.2

Robustness: ranks writing to one stdout interleave; a line may hold the start of one record and a
whole other one after it (no newline between), or stop short (a killed job). Each physical line is
split at every record prefix; a fragment whose message does not parse is counted (`malformed`,
with a few samples kept), never guessed at; an op line cut before its `comm` field is counted, not
kept with a made-up size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GROUP = "nccl_log"
MAX_OPS = 5_000_000  # op rows kept (counted past that): a long job at INFO/COLL logs millions
MAX_SAMPLES = 20
# ncclDataType_t -> bytes (nccl.h: int8, uint8, int32, uint32, int64, uint64, float16, float32, float64,
# bfloat16, fp8 e4m3, fp8 e5m2)
DATATYPE_BYTES = (1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1)
OPS = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv", "AllToAll", "Gather",
       "Scatter")

_PREFIX = re.compile(
    r"(?P<host>[A-Za-z0-9_.<>\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
    r"(?:(?P<ms>\d+\.\d+) (?P<where>\S+:\d+) )?NCCL (?P<level>INFO|WARN|TRACE|ABORT) ")
_INIT = re.compile(r"(?:ncclCommInit\w* )?comm (?P<comm>0x[0-9a-f]+) rank (?P<rank>\d+) n[Rr]anks (?P<nranks>\d+)"
                   r"(?: cudaDev (?P<cudadev>-?\d+))?(?: nvmlDev (?P<nvmldev>-?\d+))?(?: busId (?P<busid>[0-9a-fx]+))?"
                   r"(?: commId (?P<commid>0x[0-9a-f]+))?(?: localRanks \d+ localRank \d+)?.*?(?P<done>- Init COMPLETE)?\s*$")
_TIMINGS = re.compile(r"Init timings: rank (?P<rank>\d+) nranks (?P<nranks>\d+) total (?P<total>\d+(?:\.\d+)?)"
                      r"(?: \((?P<parts>[^)]*)\))?\s*$")
_RING = re.compile(r"Channel (?P<ch>\d+)/(?P<nch>\d+) :(?P<order>(?:\s+\d+)+)\s*$")
_TREES = re.compile(r"Trees((?: \[\d+\] \S+)+)\s*$")
_TREE_NEW = re.compile(r"\[(\d+)\] (-?\d+)/(-?\d+)/(-?\d+)->(-?\d+)->(-?\d+)")
_TREE_OLD = re.compile(r"\[(\d+)\] (-?\d+)->(-?\d+)->(-?\d+)/(-?\d+)/(-?\d+)")
_CONN = re.compile(r"(?:Channel|Ring) (?P<ch>\d+)(?:/\d+)? : (?P<src>\d+)(?:\[[0-9a-f]+\])? -> (?P<dst>\d+)"
                   r"(?:\[[0-9a-f]+\])?(?: \[(?P<dir>send|receive)\])? via (?P<via>\S+)")
_OP = re.compile(r"(?:\[\d+\] )?(?P<op>[A-Za-z]+): opCount (?P<opcount>[0-9a-f]+) sendbuff 0x[0-9a-f]+ "
                 r"recvbuff 0x[0-9a-f]+ count (?P<count>\d+) datatype (?P<dt>\d+) op (?P<redop>\d+) "
                 r"root (?P<root>-?\d+) comm (?P<comm>0x[0-9a-f]+)(?: \[nranks=(?P<nranks>\d+)\])?"
                 r"(?: stream (?P<stream>0x[0-9a-f]+))?")
_VERSION = re.compile(r"NCCL version (\S+)")

OP_DTYPE = np.dtype([
    ("host", "S64"), ("pid", "<u4"), ("tid", "<u4"), ("rank", "<i4"), ("nranks", "<i4"), ("op", "S16"),
    ("op_count", "<u8"), ("count", "<u8"), ("datatype", "<i4"), ("bytes", "<u8"), ("root", "<i4"),
    ("comm", "<u8"), ("t_ms", "<f8"),
])


@dataclass
class Communicator:
    host: str
    pid: int
    comm: int  # the communicator's address in that process
    rank: int
    nranks: int
    cuda_dev: int | None = None
    bus_id: str = ""
    comm_id: str = ""  # NCCL's commId, the same on every rank (newer versions)
    init_complete: bool = False
    init_total_s: float | None = None
    init_parts_s: dict[str, float] = field(default_factory=dict)


@dataclass
class NcclLog:
    versions: set[str] = field(default_factory=set)
    communicators: dict[tuple[str, int, int], Communicator] = field(default_factory=dict)
    rings: list[dict[str, Any]] = field(default_factory=list)
    trees: list[dict[str, Any]] = field(default_factory=list)
    connections: list[dict[str, Any]] = field(default_factory=list)
    ops: list[tuple[Any, ...]] = field(default_factory=list)
    pending_timings: list[tuple[str, int, int, int, float, dict[str, float]]] = field(default_factory=list)
    lines: int = 0
    records: int = 0
    parsed: int = 0
    interleaved: int = 0  # physical lines that held more than one record
    malformed: int = 0
    ops_dropped: int = 0
    samples: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def ops_array(self) -> np.ndarray:
        return np.array(self.ops, dtype=OP_DTYPE) if self.ops else np.zeros(0, OP_DTYPE)

    def op_summary(self) -> list[dict[str, Any]]:
        """Per (host, pid, rank, communicator, op): calls and bytes (the per-operation counts and sizes)."""
        a = self.ops_array()
        out: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in a:
            key = (r["host"].decode(), int(r["pid"]), int(r["rank"]), int(r["comm"]), r["op"].decode())
            s = out.setdefault(key, {"host": key[0], "pid": key[1], "rank": key[2], "comm": f"{key[3]:#x}",
                                     "op": key[4], "nranks": int(r["nranks"]), "calls": 0, "bytes": 0,
                                     "min_bytes": None, "max_bytes": 0})
            s["calls"] += 1
            s["bytes"] += int(r["bytes"])
            s["min_bytes"] = int(r["bytes"]) if s["min_bytes"] is None else min(s["min_bytes"], int(r["bytes"]))
            s["max_bytes"] = max(s["max_bytes"], int(r["bytes"]))
        return sorted(out.values(), key=lambda s: (s["host"], s["pid"], s["comm"], s["op"]))

    def counters(self) -> dict[str, Any]:
        return {"lines": self.lines, "records": self.records, "parsed": self.parsed, "interleaved": self.interleaved,
                "malformed": self.malformed, "ops": len(self.ops), "ops_dropped": self.ops_dropped,
                "malformed_samples": self.samples}


def _note_malformed(log: NcclLog, text: str) -> None:
    log.malformed += 1
    if len(log.samples) < MAX_SAMPLES:
        log.samples.append(text[:200])


def parse_lines(lines: Iterable[str], log: NcclLog | None = None, *, source: str = "") -> NcclLog:
    """Parse NCCL log lines (any mix of ranks, other program output in between) into `log`."""
    log = log if log is not None else NcclLog()
    if source:
        log.sources.append(source)
    for line in lines:
        log.lines += 1
        starts = list(_PREFIX.finditer(line))
        if not starts:
            continue  # the program's own output
        if len(starts) > 1:
            log.interleaved += 1
        for i, m in enumerate(starts):
            log.records += 1
            if i + 1 < len(starts):
                # another record starts before this one's newline: this one was cut by a write of
                # another rank (its rest, if any, is a later line without a prefix): not guessed at
                _note_malformed(log, line[m.start():starts[i + 1].start()])
                continue
            _record(log, m, line[m.end():].rstrip("\r\n"))
    _apply_timings(log)
    return log


def _record(log: NcclLog, m: re.Match[str], msg: str) -> None:
    host, pid, tid = m.group("host"), int(m.group("pid")), int(m.group("tid"))
    t_ms = float(m.group("ms")) if m.group("ms") else float("nan")
    if m.group("level") != "INFO" and m.group("level") != "TRACE":
        log.parsed += 1  # WARN/ABORT lines: counted as read; their text is the user's to see in the log
        return
    op = _OP.match(msg)
    if op is not None:
        _add_op(log, host, pid, tid, op, t_ms)
        return
    if _looks_like_op(msg):
        _note_malformed(log, msg)  # an op line cut short: its size or communicator is missing
        return
    v = _VERSION.match(msg)
    if v is not None:
        log.versions.add(v.group(1))
        log.parsed += 1
        return
    t = _TIMINGS.match(msg)
    if t is not None:
        parts: dict[str, float] = {}
        for item in (t.group("parts") or "").split(","):
            k, _, val = item.strip().partition(" ")
            try:
                parts[k] = float(val)
            except ValueError:
                continue
        log.pending_timings.append((host, pid, int(t.group("rank")), int(t.group("nranks")),
                                    float(t.group("total")), parts))
        log.parsed += 1
        return
    ring = _RING.match(msg)
    if ring is not None:
        order = [int(x) for x in ring.group("order").split()]
        log.rings.append({"host": host, "pid": pid, "channel": int(ring.group("ch")),
                          "channels": int(ring.group("nch")), "order": order})
        log.parsed += 1
        return
    trees = _TREES.match(msg)
    if trees is not None:
        _add_trees(log, host, pid, trees.group(1))
        return
    conn = _CONN.match(msg)
    if conn is not None:
        via = conn.group("via")
        log.connections.append({"host": host, "pid": pid, "channel": int(conn.group("ch")),
                                "src": int(conn.group("src")), "dst": int(conn.group("dst")),
                                "direction": conn.group("dir") or "", "via": via, "transport": transport_of(via)})
        log.parsed += 1
        return
    init = _INIT.match(msg)
    if init is not None and msg.startswith(("comm ", "ncclCommInit")):
        key = (host, pid, int(init.group("comm"), 16))
        c = log.communicators.get(key)
        if c is None:
            c = log.communicators[key] = Communicator(host, pid, key[2], int(init.group("rank")),
                                                      int(init.group("nranks")))
        if init.group("cudadev") is not None:
            c.cuda_dev = int(init.group("cudadev"))
        c.bus_id = init.group("busid") or c.bus_id
        c.comm_id = init.group("commid") or c.comm_id
        c.init_complete = c.init_complete or init.group("done") is not None
        log.parsed += 1
        return
    if msg.startswith(("Channel ", "Ring ", "Trees", "comm 0x", "Init timings")):
        _note_malformed(log, msg)  # a topology line we know, cut short or garbled
    # every other INFO line (environment, plugin, proxy threads...) is not ours to read


def _looks_like_op(msg: str) -> bool:
    head = msg.split(":", 1)[0].lstrip("[0123456789] ")
    return head in OPS and "opCount" in msg


def _add_op(log: NcclLog, host: str, pid: int, tid: int, m: re.Match[str], t_ms: float) -> None:
    log.parsed += 1
    if len(log.ops) >= MAX_OPS:
        log.ops_dropped += 1
        return
    dt = int(m.group("dt"))
    size = DATATYPE_BYTES[dt] if 0 <= dt < len(DATATYPE_BYTES) else 0
    comm = int(m.group("comm"), 16)
    c = log.communicators.get((host, pid, comm))
    rank = c.rank if c is not None else -1
    nranks = int(m.group("nranks")) if m.group("nranks") else (c.nranks if c else -1)
    count = int(m.group("count"))
    log.ops.append((host.encode()[:64], pid, tid, rank, nranks, m.group("op").encode()[:16], int(m.group("opcount"), 16),
                    count, dt, count * size, int(m.group("root")), comm, t_ms))


def _add_trees(log: NcclLog, host: str, pid: int, body: str) -> None:
    new = _TREE_NEW.findall(body)
    old = _TREE_OLD.findall(body) if not new else []
    if not new and not old:
        _note_malformed(log, "Trees" + body)
        return
    for ch, d0, d1, d2, rank, up in new:
        log.trees.append({"host": host, "pid": pid, "channel": int(ch), "rank": int(rank), "up": int(up),
                          "down": [int(x) for x in (d0, d1, d2) if int(x) >= 0]})
    for ch, up, rank, d0, d1, d2 in old:
        log.trees.append({"host": host, "pid": pid, "channel": int(ch), "rank": int(rank), "up": int(up),
                          "down": [int(x) for x in (d0, d1, d2) if int(x) >= 0]})
    log.parsed += 1


def _apply_timings(log: NcclLog) -> None:
    """An 'Init timings' line names the rank, not the communicator: it belongs to the process's
    communicator of that rank and size whose init completed last without timings."""
    rest = []
    for host, pid, rank, nranks, total, parts in log.pending_timings:
        cands = [c for c in log.communicators.values() if c.host == host and c.pid == pid and c.rank == rank
                 and c.nranks == nranks and c.init_total_s is None]
        if cands:
            cands[-1].init_total_s, cands[-1].init_parts_s = total, parts
        else:
            rest.append((host, pid, rank, nranks, total, parts))
    log.pending_timings = rest


def transport_of(via: str) -> str:
    """'P2P/IPC/read' -> 'P2P', 'NET/IB/0/GDRDMA' -> 'NET/IB', 'NET/IBext_v8/0' -> 'NET/IB', 'SHM/direct' -> 'SHM'."""
    parts = via.split("/")
    if parts[0] == "NET" and len(parts) > 1:
        return "NET/IB" if parts[1].startswith("IB") else f"NET/{parts[1]}"
    return parts[0]


def parse_files(paths: Iterable[Path]) -> NcclLog:
    """Every file (job stdout, per-rank NCCL_DEBUG_FILE files) into one NcclLog; undecodable bytes
    are replaced, a file that cannot be read is an OSError naming it."""
    log = NcclLog()
    for p in paths:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                parse_lines(f, log, source=str(p))
        except OSError as e:
            raise OSError(e.errno, f"NCCL log {p}: {e.strerror}") from None
    return log


def find_logs(node_dir: Path, stdout_paths: Iterable[Path] = ()) -> list[Path]:
    """The NCCL logs of a job: per-process files under <node_dir>/nccl/ (the TaskProlog's
    NCCL_DEBUG_FILE), then the job's stdout/stderr files that contain NCCL lines."""
    found = sorted((node_dir / "nccl").glob("*.log")) if (node_dir / "nccl").is_dir() else []
    for p in stdout_paths:
        try:
            with open(p, "rb") as f:
                head = f.read(4 << 20)
        except OSError:
            continue
        if b"] NCCL INFO " in head or b" NCCL TRACE " in head:
            found.append(p)
    return found


def _table(rows: list[dict[str, Any]], spec: list[tuple[str, str, Any]]) -> np.ndarray:
    dtype = np.dtype([(name, t) for name, t, _ in spec])
    out = np.zeros(len(rows), dtype)
    for i, r in enumerate(rows):
        out[i] = tuple(get(r) for _n, _t, get in spec)
    return out


def write_group(parent: Any, log: NcclLog) -> Any:
    """Write /nccl_log under an open h5py File/Group (docs/job-format.md); returns the group."""
    import h5py

    if GROUP in parent:
        del parent[GROUP]
    g = parent.create_group(GROUP)
    s = h5py.string_dtype()
    g.attrs["versions"] = json.dumps(sorted(log.versions))
    g.attrs["sources_json"] = json.dumps(log.sources)
    g.attrs["counters_json"] = json.dumps(log.counters(), sort_keys=True)
    comms = list(log.communicators.values())
    g.create_dataset("communicators", data=_table([c.__dict__ for c in comms], [
        ("host", "S64", lambda r: r["host"].encode()[:64]), ("pid", "<u4", lambda r: r["pid"]),
        ("comm", "<u8", lambda r: r["comm"]), ("rank", "<i4", lambda r: r["rank"]),
        ("nranks", "<i4", lambda r: r["nranks"]),
        ("cuda_dev", "<i4", lambda r: -1 if r["cuda_dev"] is None else r["cuda_dev"]),
        ("bus_id", "S16", lambda r: r["bus_id"].encode()[:16]), ("comm_id", "S24", lambda r: r["comm_id"].encode()[:24]),
        ("init_complete", "u1", lambda r: int(r["init_complete"])),
        ("init_total_s", "<f8", lambda r: np.nan if r["init_total_s"] is None else r["init_total_s"]),
    ]))
    g["communicators"].attrs["init_parts_json"] = json.dumps([c.init_parts_s for c in comms])
    g.create_dataset("rings", data=_table(log.rings, [
        ("host", "S64", lambda r: r["host"].encode()[:64]), ("pid", "<u4", lambda r: r["pid"]),
        ("channel", "<i4", lambda r: r["channel"]), ("channels", "<i4", lambda r: r["channels"]),
    ]))
    g.create_dataset("ring_orders", data=np.array([" ".join(map(str, r["order"])) for r in log.rings], dtype=s))
    g.create_dataset("trees", data=_table(log.trees, [
        ("host", "S64", lambda r: r["host"].encode()[:64]), ("pid", "<u4", lambda r: r["pid"]),
        ("channel", "<i4", lambda r: r["channel"]), ("rank", "<i4", lambda r: r["rank"]),
        ("up", "<i4", lambda r: r["up"]),
        ("down0", "<i4", lambda r: r["down"][0] if len(r["down"]) > 0 else -1),
        ("down1", "<i4", lambda r: r["down"][1] if len(r["down"]) > 1 else -1),
        ("down2", "<i4", lambda r: r["down"][2] if len(r["down"]) > 2 else -1),
    ]))
    g.create_dataset("connections", data=_table(log.connections, [
        ("host", "S64", lambda r: r["host"].encode()[:64]), ("pid", "<u4", lambda r: r["pid"]),
        ("channel", "<i4", lambda r: r["channel"]), ("src", "<i4", lambda r: r["src"]),
        ("dst", "<i4", lambda r: r["dst"]), ("direction", "S8", lambda r: r["direction"].encode()),
        ("transport", "S16", lambda r: r["transport"].encode()[:16]), ("via", "S48", lambda r: r["via"].encode()[:48]),
    ]))
    g.create_dataset("ops", data=log.ops_array(), compression="gzip", shuffle=True,
                     chunks=True if log.ops else None)
    summary = log.op_summary()
    g.create_dataset("op_summary", data=_table(summary, [
        ("host", "S64", lambda r: r["host"].encode()[:64]), ("pid", "<u4", lambda r: r["pid"]),
        ("rank", "<i4", lambda r: r["rank"]), ("nranks", "<i4", lambda r: r["nranks"]),
        ("comm", "<u8", lambda r: int(r["comm"], 16)), ("op", "S16", lambda r: r["op"].encode()),
        ("calls", "<u8", lambda r: r["calls"]), ("bytes", "<u8", lambda r: r["bytes"]),
        ("min_bytes", "<u8", lambda r: r["min_bytes"] or 0), ("max_bytes", "<u8", lambda r: r["max_bytes"]),
    ]))
    return g


def write_into_job_file(job_file: Path, log: NcclLog) -> None:
    """For the merge: add /nccl_log to a written job file."""
    import h5py

    with h5py.File(job_file, "r+") as f:
        write_group(f, log)


def summary_text(log: NcclLog) -> list[str]:
    """Report lines: versions, communicators, transports, the ops counted (for report.py)."""
    comms = list(log.communicators.values())
    transports: dict[str, int] = {}
    for c in log.connections:
        transports[c["transport"]] = transports.get(c["transport"], 0) + 1
    ops: dict[str, list[int]] = {}
    for s in log.op_summary():
        t = ops.setdefault(s["op"], [0, 0])
        t[0] += s["calls"]
        t[1] += s["bytes"]
    lines = [(f"NCCL log: {', '.join(sorted(log.versions)) or 'version not logged'}; {len(log.sources)} file(s), "
              f"{log.records} records, {log.malformed} malformed, {log.interleaved} interleaved lines")]
    lines.append(f"  communicators: {len(comms)} (ranks seen), {len({c.comm_id for c in comms if c.comm_id})} "
                 f"distinct commId; rings {len(log.rings)}, tree entries {len(log.trees)}")
    if transports:
        lines.append("  transports: " + ", ".join(f"{k} {v}" for k, v in sorted(transports.items())))
    slow = [c for c in comms if c.init_total_s is not None]
    if slow:
        worst = max(slow, key=lambda c: c.init_total_s or 0.0)
        lines.append(f"  init: slowest rank {worst.rank} on {worst.host} {worst.init_total_s:.2f} s")
    for op, (n, b) in sorted(ops.items()):
        lines.append(f"  {op}: {n} calls, {b / 1e6:.1f} MB")
    return lines


def our_nccl_calls(hostname: str, calls: np.ndarray) -> dict[tuple[str, int, str], tuple[int, int]]:
    """(host, pid, NCCL op) -> (calls, bytes) of a node file's /collectives/calls NCCL rows, keyed as
    the log names them ('ncclAllReduce' -> 'AllReduce'), for match_calls."""
    from gpuprof.collector import schema

    out: dict[tuple[str, int, str], tuple[int, int]] = {}
    lib = schema.COLLECTIVE_CALLS.enums["library"].index("nccl")
    rows = calls[calls["library"] == lib]
    for pid in np.unique(rows["pid"]):
        mine = rows[rows["pid"] == pid]
        for op in np.unique(mine["op"]):
            name = schema.COLLECTIVE_OPS[int(op)]
            if not name.startswith("nccl") or name in ("ncclGroupStart", "ncclGroupEnd"):
                continue
            sel = mine[mine["op"] == op]
            out[(hostname, int(pid), name[4:])] = (len(sel), int(sel["bytes"].sum()))
    return out


def match_calls(log: NcclLog, ours: dict[tuple[str, int, str], tuple[int, int]]) -> list[dict[str, Any]]:
    """NCCL's own count of each process's operations against ours: per (host, pid, op) the calls and
    bytes of both, and whether they agree. Host names compare up to the first dot (NCCL logs the
    short host name)."""
    theirs: dict[tuple[str, int, str], list[int]] = {}
    for s in log.op_summary():
        t = theirs.setdefault((s["host"].split(".")[0], s["pid"], s["op"]), [0, 0])
        t[0] += s["calls"]
        t[1] += s["bytes"]
    ours_short = {(h.split(".")[0], p, o): v for (h, p, o), v in ours.items()}
    rows = []
    for key in sorted(set(theirs) | set(ours_short)):
        lc, lb = theirs.get(key, [0, 0])
        oc, ob = ours_short.get(key, (0, 0))
        rows.append({"host": key[0], "pid": key[1], "op": key[2], "log_calls": lc, "our_calls": oc,
                     "log_bytes": lb, "our_bytes": ob, "agree": lc == oc and lb == ob})
    return rows


MATCH_ROWS_SHOWN = 200  # rows of the log-against-ours table in the report (all are in the job file's counters)


def for_merge(node_dir: Path, nodes: list[tuple[str, str, Path]]) -> tuple[NcclLog, dict[str, Any]] | None:
    """What the merge adds when the job logged NCCL_DEBUG (per-rank files under <node_dir>/nccl/, or
    the job's own stdout/stderr beside the node directory, `<stem>.out`/`.err` for
    `<stem>.gpuprof.d`): the parsed log, and the report's `nccl_log` entry, the log's summary and
    NCCL's own count of each process's operations against the collectors' (nodes: (node,
    hostname, node file)). None when no log is found."""
    from gpuprof.collector import schema
    from gpuprof.collector.reader import open_node_trace

    stem = node_dir.name[: -len(".gpuprof.d")] if node_dir.name.endswith(".gpuprof.d") else ""
    outputs = [node_dir.parent / f"{stem}{ext}" for ext in (".out", ".err")] if stem else []
    files = find_logs(node_dir, outputs)
    if not files:
        return None
    log = parse_files(files)
    ours: dict[tuple[str, int, str], tuple[int, int]] = {}
    for _node, hostname, path in nodes:
        calls = open_node_trace(path, tables=(schema.COLLECTIVE_CALLS.path,)).tables.get(schema.COLLECTIVE_CALLS.path)
        if calls is not None and len(calls):
            ours.update(our_nccl_calls(hostname, calls))
    matched = match_calls(log, ours)
    entry = {"files": [p.name for p in files], "summary": summary_text(log), "counters": log.counters(),
             "processes_agreeing": sum(1 for m in matched if m["agree"]), "processes_compared": len(matched),
             "calls_against_ours": matched[:MATCH_ROWS_SHOWN]}
    return log, entry
