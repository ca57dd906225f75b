"""The stacks behind a finding: where a straggler's processes spent their extra time, from CPU
samples and off-CPU intervals of its flagged windows against its peers' (docs/merge.md, "Stacks
behind a finding").

Per finding, the node files of its node and of up to PEER_NODES other nodes of its communicator
are read (their stack tables only, the flagged windows only), each read an item dealt over the merge
ranks (common.Task), so no rank holds more than one node's stack tables at a time. The late
processes are the finding's ranks; the peers, the other ranks of those nodes, its own included. Per table
(`stacks/samples` weighted by samples, `offcpu/intervals` by blocked ns) the folded stacks are
averaged per process: the late processes' mean against the peers' mean, in the same windows. The
differential is walked from the root, always into the child with the largest excess, while that
child holds at least half of the whole excess: the path it stops at is where the extra time went
("71 % of the extra samples in train_step -> load_batch -> read"). Takes paths; no MPI.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.symbolize import stack_names
from gpuprof.mpi_merge.clock import NodeClockModel
from gpuprof.mpi_merge.loading import ClockMap, clock_map_of, row_window_ns

PEER_NODES = 8  # peer nodes read per finding (evenly spread over the communicator's other nodes)
FLAME_TOP = 2000  # folded stacks kept per finding and table, the largest by late + peer weight
PATH_SHOWN = 4  # frames of the path named in the evidence (the innermost)
# An extra under this share of the late processes' own rate is named as no place to look: a late
# rank blocked 3.8 ms/s against its peers' 2106.6 had 0.04 ms/s more than them in one stack, and the
# line said "82 % in __futex_wait" of that (the demo's report, 2026-12-06).
EXTRA_MIN_SHARE = 0.05
TABLES = (("cpu", schema.STACK_SAMPLES, "count"), ("offcpu", schema.OFFCPU_INTERVALS, "blocked_ns"))


@dataclass
class NodeRead:
    """One node file's part of a finding: which processes, in which aligned spans."""

    path: str
    node: str
    pids: list[int]
    spans: np.ndarray  # [k, 2] aligned ns from the epoch
    kernel: str = ""  # the finding's kernel (CUPTI): the CPU stacks its launches came from are read too

    def overlaps(self, t: np.ndarray, length: float) -> np.ndarray:
        """[len(t)] bool: [t, t + length) meets one of the spans (length 0: t lies in one)."""
        inside = np.zeros(len(t), bool)
        for lo, hi in self.spans:
            inside |= (t < hi) & (t + length > lo) if length > 0 else (t >= lo) & (t < hi)
        return inside

    def overlap_ns(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """[len(lo)] how much of each [lo, hi) lies in the spans (ns; the spans are disjoint)."""
        out = np.zeros(len(lo))
        for a, b in self.spans:
            out += np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0.0, None)
        return out


def _aligned(t_ns: np.ndarray, cm: ClockMap, model: NodeClockModel | None, epoch_rt: int) -> np.ndarray:
    """A node file's CLOCK_MONOTONIC times -> aligned ns from the epoch (the merge's mapping)."""
    t = (cm.to_realtime(t_ns) - epoch_rt).astype(np.float64)
    return model.align(t) if model is not None and model.aligned else t


def read_folded(item: NodeRead, model: NodeClockModel | None, epoch_rt: int) -> dict[str, dict[int, Counter[str]]]:
    """table name -> pid -> folded stacks (root first; user frames, then kernel frames) weighted as
    the table says, of the rows of `item.pids` whose window overlaps one of `item.spans`; and "gil"
    -> pid -> its Python threads' CPU samples by GIL state (_gil_counts), where the file records it."""
    out: dict[str, dict[int, Counter[str]]] = {name: {} for name, _, _ in TABLES}
    with h5py.File(item.path, "r") as f:
        names = stack_names(f)
        pairs = f[schema.CLOCK_PAIRS.path][()] if schema.CLOCK_PAIRS.path in f else None
        cm = clock_map_of(pairs, f.attrs)
        for name, table, weight in TABLES:
            if table.path not in f:
                continue
            window_ns = row_window_ns(f.attrs, table.path)
            if window_ns is None:
                continue  # its windows' length unknown: a partial reason of the node (loading.unknown_row_windows)
            rows = f[table.path][()]
            rows = rows[np.isin(rows["pid"], item.pids)]
            if not len(rows):
                continue
            if name == "offcpu":
                rows = _caller_threads(f, rows)
                t = _aligned(rows["t_ns"], cm, model, epoch_rt)
                # An episode is counted whole in the window its thread woke in (bpf/offcpu.c), and one
                # still asleep at the end in the last window: spread back from that window's end over
                # its length, so that a span gets what the thread slept in it. Counted where it woke,
                # a helper thread woken by every SIGSTOP of its process (its sleeps cut into episodes
                # inside the windows) had seconds "more" blocked than its peers' helpers, whose one
                # sleep ended with the job: GROMACS's stopped rank read "87% of the extra in
                # __clone3 -> start_thread" (its idle progress threads), not its stop.
                end = t + window_ns
                weights = item.overlap_ns(end - rows[weight].astype(np.float64), end)
                inside = weights > 0
            else:
                inside = item.overlaps(_aligned(rows["t_ns"], cm, model, epoch_rt), window_ns)
                weights = rows[weight].astype(np.float64)
            if name == "cpu" and "gil" in (rows.dtype.names or ()):
                out["gil"] = _gil_counts(rows[inside])
            per = out[name]
            for r, w in zip(rows[inside], weights[inside].tolist()):
                user = names.get(int(r["user_stack"]), [])
                kern = names.get(int(r["kernel_stack"]), [])
                key = ";".join([*reversed(user), *reversed(kern)]) or "[no stack]"
                per.setdefault(int(r["pid"]), Counter())[key] += w
        if item.kernel:
            out["kernel_launch"] = _launch_stacks(f, item, names, cm, model, epoch_rt)
    return out


def _caller_threads(f: h5py.File, rows: np.ndarray) -> np.ndarray:
    """The off-CPU rows of the threads that called collectives or messages, in the processes that
    have such threads (the others' rows as they are). A process's idle helper threads (MPI's
    progress and PMIx threads, data loaders) sleep all the time and say nothing of its lateness,
    and the kernel closes their sleeps unevenly: a SIGSTOP wakes every thread of the stopped
    process, so its helpers' sleeps were counted in every window, its peers' (one sleep to the end
    of the job) in none. The per-process off-CPU series read the same threads (loading.py)."""
    if schema.COLLECTIVE_CALLS.path not in f:
        return rows
    calls = f[schema.COLLECTIVE_CALLS.path].fields(["pid", "tid"])[()]
    keep = np.ones(len(rows), bool)
    for pid in np.unique(rows["pid"]).tolist():
        callers = np.unique(calls["tid"][calls["pid"] == pid])
        if len(callers):
            mine = rows["pid"] == pid
            keep[mine] = np.isin(rows["tid"][mine], callers)
    return rows[keep]


GIL_STATES = {schema.GIL_HELD: "held", schema.GIL_NOT_HELD: "not_held"}


def _gil_counts(rows: np.ndarray) -> dict[int, Counter[str]]:
    """pid -> CPU samples of its Python threads by GIL state ("held", "not_held"; unknown left out)."""
    out: dict[int, Counter[str]] = {}
    for state, key in GIL_STATES.items():
        sel = rows[rows["gil"] == state]
        for pid in np.unique(sel["pid"]).tolist():
            out.setdefault(int(pid), Counter())[key] += int(sel["count"][sel["pid"] == pid].sum())
    return out


def gil_summary(late: Counter[str], peers: Counter[str]) -> dict[str, Any] | None:
    """The share of the Python samples taken with the GIL held, late processes against peers (None
    when the late processes have no Python sample with a known GIL state)."""
    n_late, n_peers = late["held"] + late["not_held"], peers["held"] + peers["not_held"]
    if n_late <= 0:
        return None
    return {"late_held_share": round(late["held"] / n_late, 4),
            "peers_held_share": round(peers["held"] / n_peers, 4) if n_peers > 0 else None,
            "late_python_samples_per_process": round(n_late, 3), "peers_python_samples_per_process": round(n_peers, 3)}


def gil_line(g: dict[str, Any]) -> str:
    peers = (f", their peers in {g['peers_held_share']:.0%}" if g["peers_held_share"] is not None
             else ", no Python sample of their peers")
    return (f"the late processes' Python threads held the GIL in {g['late_held_share']:.0%} of their CPU samples"
            f"{peers} (the rest: waiting for it, or native code that released it)")


LAUNCH_MATCH_NS = 1_000_000  # a launch call (CUPTI) and the uprobe's launch row at most this far apart


def _launch_stacks(f: h5py.File, item: NodeRead, names: dict[int, list[str]], cm: ClockMap, model: NodeClockModel | None,
                   epoch_rt: int) -> dict[int, Counter[str]]:
    """pid -> folded CPU stacks of the launches of item.kernel's executions in the spans: CUPTI's
    kernel record names its launch call (correlation id -> /kernels/activity_launches: pid, tid,
    time), and the uprobe's row of the same thread's launch at (or just before) that time carries the
    CPU stack (/kernels/launches). A launch no uprobe row matches is counted as such."""
    paths = (schema.KERNEL_ACTIVITY.path, schema.KERNEL_ACTIVITY_NAMES.path, schema.KERNEL_ACTIVITY_LAUNCHES.path)
    if any(p not in f for p in paths):
        return {}
    act, knames, calls = (f[p][()] for p in paths)
    launches = f[schema.KERNEL_LAUNCHES.path][()] if schema.KERNEL_LAUNCHES.path in f else schema.KERNEL_LAUNCHES.empty()
    out: dict[int, Counter[str]] = {}
    for pid in item.pids:
        ids = knames["name_id"][(knames["pid"] == pid) & (knames["name"] == item.kernel.encode())]
        mine = act[(act["pid"] == pid) & np.isin(act["name_id"], ids)]
        if not len(mine):
            continue
        inside = item.overlaps(_aligned(mine["t_start_ns"], cm, model, epoch_rt), 0.0)
        call = calls[(calls["pid"] == pid) & np.isin(calls["correlation_id"], mine["correlation_id"][inside])]
        c: Counter[str] = Counter()
        for tid in np.unique(call["tid"]):
            at = np.sort(call["t_ns"][call["tid"] == tid].astype(np.int64))
            ul = launches[(launches["pid"] == pid) & (launches["tid"] == tid)]
            ul = ul[np.argsort(ul["t_ns"], kind="stable")]
            j = np.searchsorted(ul["t_ns"].astype(np.int64), at, side="right") - 1
            for k, tj in zip(j, at):
                if k < 0 or tj - int(ul["t_ns"][k]) > LAUNCH_MATCH_NS:
                    c["[launch stack not recorded]"] += 1
                else:
                    c[";".join(reversed(names.get(int(ul["user_stack"][k]), []))) or "[no stack]"] += 1
        if c:
            out[pid] = c
    return out


@dataclass
class FlameReads:
    """Task: one NodeRead per item; the clock models come from the rank's context (every rank holds
    them after the fit)."""

    items: list[NodeRead]
    epoch_rt: int

    def __call__(self, ctx: Any, i: int) -> dict[str, dict[int, Counter[str]]]:
        it = self.items[i]
        return read_folded(it, ctx.models.get(it.node), self.epoch_rt)


def mean_per_process(parts: Sequence[dict[int, Counter[str]]],
                     pids: Sequence[tuple[int, int]]) -> tuple[Counter[str], int]:
    """The folded stacks of the processes (read index, pid) averaged over them; how many there were."""
    total: Counter[str] = Counter()
    for ri, pid in pids:
        total.update(parts[ri].get(pid, Counter()))
    n = len(pids)
    return Counter({k: v / n for k, v in total.items()}) if n else Counter(), n


def extra_stacks(late: Counter[str], peers: Counter[str]) -> dict[str, float]:
    """What the late processes have more than the peers, stack by stack (the positive part of the
    difference), of the stacks where they have more: Counter's subtraction keeps exactly those."""
    return dict(late - peers)


def excess_path(late: Counter[str], peers: Counter[str]) -> tuple[list[str], float, float]:
    """(path from the root, its share of the extra, the extra) of the walk down the differential
    (module docstring). The extra is what the late processes have more than the peers, stack by
    stack (the positive part of the difference): busy-polling ranks take as many samples as a
    computing one, so a late rank's extra time shows as samples moved from the peers' polling into
    its own functions, not as more samples. ([], 0, 0) when it has no stack more than the peers."""
    incl: dict[tuple[str, ...], float] = {}
    for key, extra in extra_stacks(late, peers).items():
        frames = tuple(key.split(";"))
        for d in range(1, len(frames) + 1):
            incl[frames[:d]] = incl.get(frames[:d], 0.0) + extra
    total = float(sum(v for k, v in incl.items() if len(k) == 1))
    if total <= 0:
        return [], 0.0, 0.0
    children: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for p in incl:
        children.setdefault(p[:-1], []).append(p)
    node: tuple[str, ...] = ()
    while True:
        kids = children.get(node, [])
        if not kids:
            break
        best = max(kids, key=lambda k: (incl[k], k))
        if incl[best] < 0.5 * total:
            break
        node = best
    share = incl[node] / total if node else 1.0
    return list(node), share, total


def summarize(late: Counter[str], peers: Counter[str], n_late: int, n_peers: int, seconds: float) -> dict[str, Any]:
    """The walk's result and the per-process rates (per second of the flagged windows). An extra
    under EXTRA_MIN_SHARE of the late processes' own rate names no path (and no share): the JSON,
    the report's "where the time went" and the evidence line all read this one decision."""
    path, share, total = excess_path(late, peers)
    if total < EXTRA_MIN_SHARE * float(sum(late.values())):
        path, share = [], 0.0
    per_s = 1.0 / seconds if seconds > 0 else float("nan")
    return {"path": path[-PATH_SHOWN:], "depth": len(path), "share_of_extra": round(share, 4),
            "extra_per_s": round(total * per_s, 3), "late_per_s": round(float(sum(late.values())) * per_s, 3),
            "peers_per_s": round(float(sum(peers.values())) * per_s, 3), "late_processes": n_late,
            "peer_processes": n_peers, "seconds": round(seconds, 3)}


def top_stacks(late: Counter[str], peers: Counter[str]) -> list[tuple[str, float, float]]:
    """The FLAME_TOP folded stacks of the largest late + peer weight: (stack, late, peers), for the job file."""
    keys = sorted(set(late) | set(peers), key=lambda k: (-(late.get(k, 0.0) + peers.get(k, 0.0)), k))[:FLAME_TOP]
    return [(k, float(late.get(k, 0.0)), float(peers.get(k, 0.0))) for k in keys]


# The scheduler's own kernel frames, inside the one that says why a thread slept (do_signal_stop,
# futex_wait_queue, do_epoll_wait, do_nanosleep, io_schedule, ...): an off-CPU stack ends in them
SCHEDULER_FRAMES = frozenset({"__schedule", "schedule", "schedule_timeout", "schedule_hrtimeout_range",
                              "schedule_hrtimeout_range_clock", "schedule_preempt_disabled", "preempt_schedule",
                              "preempt_schedule_common", "freezable_schedule"})


def asleep_in(late: Counter[str], peers: Counter[str]) -> dict[str, Any] | None:
    """Why the late processes' extra off-CPU time slept: per stack of the extra (what they have
    more than the peers), its innermost frame outside the scheduler; the frame with the largest
    share of the extra, and that share. The walk from the root (excess_path) stops where the extra
    splits, often in the application's own code (a SIGSTOP lands wherever a rank runs); the
    innermost frames agree on the reason (do_signal_stop, a futex, a poll, disk I/O). None when
    the late processes have no extra."""
    by: dict[str, float] = {}
    for key, extra in extra_stacks(late, peers).items():
        frames = key.split(";")
        reason = next((f for f in reversed(frames) if f not in SCHEDULER_FRAMES), frames[-1])
        by[reason] = by.get(reason, 0.0) + extra
    total = float(sum(by.values()))
    if total <= 0:
        return None
    frame, weight = max(by.items(), key=lambda kv: (kv[1], kv[0]))
    return {"frame": frame, "share_of_extra": round(weight / total, 4)}


def evidence_line(name: str, s: dict[str, Any]) -> str:
    unit, scale = ("samples/s", 1.0) if name == "cpu" else ("ms/s blocked", 1e-6)
    what = "CPU stacks" if name == "cpu" else "off-CPU stacks"
    head = (f"{what} in the flagged windows ({s['seconds']:.1f} s): {s['late_per_s'] * scale:.1f} {unit} per late "
            f"process vs {s['peers_per_s'] * scale:.1f} per peer process ({s['peer_processes']} processes)")
    if not s["path"]:
        if s["extra_per_s"] <= 0:
            return head + ": no stack where it has more than the peers"
        return head + (f": no stack where it has more than the peers by {EXTRA_MIN_SHARE:.0%} of its own "
                       f"({s['extra_per_s'] * scale:.1f} {unit} more in all)")
    line = (head + f"; of what it has more than the peers ({s['extra_per_s'] * scale:.1f} {unit}), "
            f"{s['share_of_extra']:.0%} in " + path_text(s["path"]))
    if s.get("asleep_in"):
        line += f", asleep in {s['asleep_in']['frame']} ({s['asleep_in']['share_of_extra']:.0%} of it)"
    return line


# C++'s operator names, whose symbols would read as brackets: "operator()", "operator<<", "operator->"
_OPERATOR = re.compile(r"operator(?:\(\)|\[\]|<=>|<<=?|>>=?|->\*?|&&|\|\||\+\+|--|[-+*/%^&|~!=<>,]=?"
                       r"| new(?:\[\])?| delete(?:\[\])?)")


def short_frame(name: str) -> str:
    """A frame's name as the one-line path of a report shows it: a demangled C++ name without its
    parameter list and what follows it ("gmx_pme_do(gmx_pme_t*, gmx::ArrayRef<gmx::BasicVector<float>
    const>, ...)" is "gmx_pme_do", "Foo::operator()(int) const" is "Foo::operator()"); template
    arguments, lambdas ("{lambda(int)#1}") and "(anonymous namespace)" are kept. Other names (C,
    Fortran, Python) are returned as they are. The job file keeps the full names."""
    angle = brace = 0
    i = 0
    while i < len(name):
        op = _OPERATOR.match(name, i) if name.startswith("operator", i) else None
        if op is not None:
            if angle == brace == 0 and name.startswith("(", op.end()):
                return name[:op.end()]
            i = op.end()
            continue
        c = name[i]
        if c == "<":
            angle += 1
        elif c == ">":
            angle = max(0, angle - 1)
        elif c == "{":
            brace += 1
        elif c == "}":
            brace = max(0, brace - 1)
        elif c == "(" and angle == brace == 0:
            close = _closing(name, i)
            if close < 0:  # cut short by the symbol table: the list is all that is missing
                return name[:i] if i > 0 and (name[i - 1].isalnum() or name[i - 1] in "_>") else name
            if name.startswith("::", close + 1):  # a function's local scope: "foo()::{lambda(int)#1}"
                i = close + 1
                continue
            if i > 0 and (name[i - 1].isalnum() or name[i - 1] in "_>"):
                return name[:i]  # the parameter list
            i = close + 1  # a part of the name: "(anonymous namespace)"
            continue
        i += 1
    return name


def _closing(name: str, i: int) -> int:
    """The index of the parenthesis closing the one at i, or -1."""
    depth = 0
    for j in range(i, len(name)):
        if name[j] == "(":
            depth += 1
        elif name[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    return -1


def path_text(frames: Sequence[str], sep: str = " → ") -> str:
    """Frames (outermost first) as the evidence and the text report write them."""
    return sep.join(short_frame(f) for f in frames)


def peer_nodes(nodes: Sequence[int], own: set[int]) -> list[int]:
    """Up to PEER_NODES of the communicator's other nodes, evenly spread (the same on every rank count)."""
    others = sorted(set(nodes) - own)
    if len(others) <= PEER_NODES:
        return others
    return [others[i] for i in np.linspace(0, len(others) - 1, PEER_NODES).round().astype(int)]


def _node_ranks(comms: Sequence[Any], node: int) -> tuple[Any, list[int]]:
    """(the widest communicator with ranks on node, those ranks); (None, []) when none has."""
    best, ranks = None, []
    for c in comms:
        mine = np.flatnonzero(np.asarray(c.node_of_rank, np.int64) == node).tolist() if node >= 0 else []
        if mine and (best is None or c.size > best.size):
            best, ranks = c, mine
    return best, ranks


def stack_evidence(findings: Sequence[Any], comms: Sequence[Any], node_files: Sequence[str], node_names: Sequence[str],
                   epoch_rt: int, pool: Any) -> dict[int, dict[str, list[tuple[str, float, float]]]]:
    """For each finding (stragglers.Finding) on a communicator (comms: waitstates.CommSummary): the
    reads of its node and its peer nodes dealt over `pool`, its `stacks` summaries and an evidence
    line per table; returns, per finding index, the top folded stacks (late, peers) per table for
    the job file. A point-to-point finding (a node whose messages were late: no communicator, no
    ranks) is read on the widest communicator that has ranks on its node, every rank of its node
    late, as the stragglers' ranks of a collective finding are."""
    items: list[NodeRead] = []
    plan: list[tuple[int, list[tuple[int, int]], list[tuple[int, int]]]] = []  # finding, late and peer (read, pid)
    for fi, f in enumerate(findings):
        spans = getattr(f, "evidence_spans", None)
        if spans is None or not len(spans):
            continue
        if f.kind == "late sender":
            c, late_ranks = _node_ranks(comms, list(node_names).index(f.node) if f.node in node_names else -1)
        else:
            c = next((c for c in comms if c.comm_id == f.comm_id), None)
            late_ranks = list(f.ranks)
        if c is None:
            continue
        node_of = np.asarray(c.node_of_rank, np.int64)
        own = {int(node_of[r]) for r in late_ranks if node_of[r] >= 0}
        others = peer_nodes([int(n) for n in node_of if n >= 0], own)
        # The peers: the other ranks of the culprit's own nodes too (read with them), not only of
        # other nodes; a job on one node had none and compared its late rank with nothing (MEEP:
        # "1725.6 ms/s blocked per late process vs 0.0 per peer process (0 processes)", its MPI
        # library's helper threads blocked, as the other rank's were).
        late_pids: list[tuple[int, int]] = []
        peer_pids: list[tuple[int, int]] = []
        for ni in sorted(own) + others:
            ranks = [r for r in range(c.size) if node_of[r] == ni]
            late_here = {int(c.pid_of_rank[r]) for r in ranks if r in late_ranks}
            ri = len(items)
            items.append(NodeRead(node_files[ni], node_names[ni], sorted({int(c.pid_of_rank[r]) for r in ranks}),
                                  np.asarray(spans, np.float64), kernel=getattr(f, "kernel", "") if ni in own else ""))
            late_pids += [(ri, pid) for pid in sorted(late_here)]
            peer_pids += [(ri, pid) for pid in sorted({int(c.pid_of_rank[r]) for r in ranks} - late_here)]
        plan.append((fi, late_pids, peer_pids))
    if not items:
        return {}
    parts = list(pool.map(FlameReads(items, epoch_rt), len(items)))
    out: dict[int, dict[str, list[tuple[str, float, float]]]] = {}
    for fi, late_pids, peer_pids in plan:
        f = findings[fi]
        out[fi] = {}
        for name, _, _ in TABLES:
            per = [p[name] for p in parts]
            late, n_late = mean_per_process(per, late_pids)
            peers, n_peers = mean_per_process(per, peer_pids)
            if not late and not peers:
                continue
            spans = np.asarray(f.evidence_spans, np.float64)
            s = summarize(late, peers, n_late, n_peers, float((spans[:, 1] - spans[:, 0]).sum()) / 1e9)
            if name == "offcpu" and s["path"]:
                s["asleep_in"] = asleep_in(late, peers)
            f.stacks[name] = s
            f.evidence.append(evidence_line(name, s))
            out[fi][name] = top_stacks(late, peers)
        gil = [p.get("gil", {}) for p in parts]
        g = gil_summary(*(mean_per_process(gil, group)[0] for group in (late_pids, peer_pids)))
        if g is not None:
            f.stacks["gil"] = g
            f.evidence.append(gil_line(g))
        launch: Counter[str] = Counter()
        for ri, pid in late_pids:
            launch.update(parts[ri].get("kernel_launch", {}).get(pid, Counter()))
        if launch:
            top, n = min(launch.items(), key=lambda kv: (-kv[1], kv[0]))
            total = sum(launch.values())
            frames = top.split(";")
            f.stacks["kernel_launch"] = {"kernel": f.kernel, "path": frames[-PATH_SHOWN:], "depth": len(frames),
                                         "share_of_launches": round(n / total, 4), "launches": total}
            f.evidence.append(f"its {f.kernel!r} kernels in the flagged windows were launched from "
                              f"{path_text(frames[-PATH_SHOWN:])} ({n / total:.0%} of {total} launches)")
    return out
