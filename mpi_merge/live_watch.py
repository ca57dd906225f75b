"""`gpuprof watch JOB`: the job-wide live view of the continuous collectors' summaries
(collector/watch.py node_summary): per communicator the ranks arriving last and their lateness,
refreshed, and a finding when the merge's count test (mpi_merge/stragglers.py) is confident.
docs/continuous.md, "Live watch".
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuprof.collector.watch import socket_for


@dataclass
class LiveFinding:
    comm: str
    unit: str  # the node (a communicator across nodes is judged per node, as the merge does) or rank
    ranks: list[int]
    held_s: float  # total time it held the others back over the instances seen
    held_share: float  # of the time the instances span
    p_value: float  # Bonferroni over the levels, BH-adjusted over every unit of every communicator
    late_instances: int
    instances: int
    cause: str

    def line(self) -> str:
        return (f"STRAGGLER {self.unit} (ranks {','.join(map(str, self.ranks))}) on comm {self.comm}: held the others "
                f"back {self.held_s * 1e3:.1f} ms ({self.held_share:.1%} of the time), last in "
                f"{self.late_instances}/{self.instances} instances, p={self.p_value:.2g}; cause: {self.cause}")


def combine(summaries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per communicator: rank -> node, and per rank its instances {seq: (enter, exit)} from every node."""
    out: dict[str, dict[str, Any]] = {}
    for s in summaries:
        if not s.get("ok"):
            continue
        for cid, c in s.get("communicators", {}).items():
            d = out.setdefault(cid, {"comm_size": c["comm_size"], "node_of": {}, "ranks": {}})
            d["comm_size"] = max(d["comm_size"], c["comm_size"])
            for r, inst in c["ranks"].items():
                d["node_of"][int(r)] = s["node"]
                d["ranks"][int(r)] = {int(seq): (a, b) for seq, a, b in inst}
    for d in out.values():
        d["seq_shift"] = align_sequences(d["ranks"])
    return out


MAX_SHIFT = 512  # instances


def align_sequences(ranks: dict[int, dict[int, tuple[int, int]]]) -> dict[int, int]:
    """Renumber each rank's instances onto the reference rank's (the one with the most), in place;
    returns the shift applied per rank. Why: a rank whose process the probes reached after its first
    collectives counts its seq from the first call seen (docs/trace-format.md, late probes), so the
    same seq names different instances on different ranks. The shift is the one under which the
    ranks leave their instances together (the exits of one collective instance are within the
    collective's own time of each other; of consecutive instances, a step apart)."""
    if len(ranks) < 2:
        return {}
    ref = max(ranks, key=lambda r: len(ranks[r]))
    ref_seq = np.array(sorted(ranks[ref]), np.int64)
    ref_exit = np.array([ranks[ref][q][1] for q in ref_seq], np.float64)
    shifts: dict[int, int] = {}
    for r, inst in ranks.items():
        if r == ref or not inst:
            continue
        seq = np.array(sorted(inst), np.int64)
        ex = np.array([inst[q][1] for q in seq], np.float64)
        best, best_cost = 0, np.inf
        for d in range(-MAX_SHIFT, MAX_SHIFT + 1):
            common, i_ref, i_r = np.intersect1d(ref_seq, seq - d, return_indices=True)
            if len(common) < 3:
                continue
            cost = float(np.median(np.abs(ex[i_r] - ref_exit[i_ref])))
            if cost < best_cost or (cost == best_cost and abs(d) < abs(best)):
                best, best_cost = d, cost
        if best:
            ranks[r] = {q - best: v for q, v in inst.items()}
        shifts[r] = best
    return shifts


def live_findings(combined: dict[str, dict[str, Any]], params: Any = None,
                  clock_slack_ns: float = 1e6) -> tuple[list[LiveFinding], list[dict[str, Any]]]:
    """The merge's count test on the last instances (mpi_merge/stragglers.py: units, held-back time,
    LEVELS thresholds from min_effect x the typical compute interval, exact binomial per level,
    Bonferroni, then Benjamini-Hochberg at fdr_q over every unit; effect: min_held_share and
    dominance). Differences, said in the output: the nodes' own realtime clocks instead of aligned
    ones (held-back times below clock_slack_ns are not counted), no root-cause split of the waits
    (a rank that arrived last is the culprit of that instance), one window: the instances seen.
    Returns (findings, per communicator the latest arrivals and lateness per rank)."""
    from gpuprof.mpi_merge.rootcause import benjamini_hochberg, binom_sf_many
    from gpuprof.mpi_merge.stragglers import DEFAULT_STRAGGLER_PARAMS, LEVEL_STEP, LEVELS

    p = params or DEFAULT_STRAGGLER_PARAMS
    tests: list[tuple[float, dict[str, Any]]] = []
    views: list[dict[str, Any]] = []
    for cid, c in sorted(combined.items()):
        size = int(c["comm_size"])
        ranks = sorted(c["ranks"])
        if len(ranks) < size or size < 2:
            views.append({"comm": cid, "ranks_seen": len(ranks), "comm_size": size, "note": "not every rank seen"})
            continue
        seqs = sorted(set.intersection(*(set(c["ranks"][r]) for r in ranks)))
        if len(seqs) < 3:
            views.append({"comm": cid, "comm_size": size, "note": "fewer than 3 instances seen by every rank"})
            continue
        enter = np.array([[c["ranks"][r][s][0] for r in ranks] for s in seqs], np.float64)
        exit_ = np.array([[c["ranks"][r][s][1] for r in ranks] for s in seqs], np.float64)
        nodes = sorted({c["node_of"][r] for r in ranks})
        per_node = len(nodes) > 1
        unit_names = nodes if per_node else [str(r) for r in ranks]
        unit_of_rank = np.array([unit_names.index(c["node_of"][r]) if per_node else i for i, r in enumerate(ranks)])
        n_units = len(unit_names)
        arrival = np.full((len(seqs), n_units), -np.inf)
        for u in range(n_units):
            arrival[:, u] = enter[:, unit_of_rank == u].max(axis=1)
        order = np.argsort(arrival, axis=1)
        last = order[:, -1]
        held = arrival[np.arange(len(seqs)), last] - arrival[np.arange(len(seqs)), order[:, -2]]
        held_ok = held > clock_slack_ns
        compute = enter[1:] - exit_[:-1]  # on each rank: its compute interval between two instances
        typical = float(np.median(compute[compute > 0])) if (compute > 0).any() else 0.0
        floor = max(p.min_effect * typical, clock_slack_ns)
        span = float(exit_.max() - enter.min()) or 1.0
        share = np.bincount(unit_of_rank, minlength=n_units) / len(ranks)
        lateness = enter - enter.min(axis=1, keepdims=True)
        views.append({"comm": cid, "comm_size": size, "instances": len(seqs), "last_seq": int(seqs[-1]),
                      "lateness_ms": {str(r): round(float(np.median(lateness[:, i])) / 1e6, 3)
                                      for i, r in enumerate(ranks)},
                      "last_arrivals": [{"seq": int(seqs[k]), "unit": unit_names[int(last[k])],
                                         "held_ms": round(float(held[k]) / 1e6, 3)} for k in range(-min(5, len(seqs)), 0)]})
        for u in range(n_units):
            best = 1.0
            k_best = 0
            for lv in range(LEVELS):
                above = held_ok & (held > floor * LEVEL_STEP ** lv)
                n = int(above.sum())
                if not n:
                    break
                k = int((above & (last == u)).sum())
                if k:
                    pv = float(binom_sf_many(np.array([k]), np.array([n]), np.array([share[u]]))[0])
                    if pv < best:
                        best, k_best = pv, k
            held_u = float(held[(last == u) & held_ok].sum())
            others = [float(held[(last == v) & held_ok].sum()) for v in range(n_units) if v != u]
            tests.append((min(1.0, LEVELS * best), {
                "comm": cid, "unit": unit_names[u], "ranks": [r for i, r in enumerate(ranks) if unit_of_rank[i] == u],
                "held_s": held_u / 1e9, "held_share": held_u / span, "late": k_best, "instances": len(seqs),
                "dominant": held_u >= p.dominance * max(others, default=0.0),
                "compute_ms": float(np.median(compute[:, unit_of_rank == u])) / 1e6 if len(compute) else 0.0,
                "peer_compute_ms": float(np.median(compute[:, unit_of_rank != u])) / 1e6 if len(compute) else 0.0,
            }))
    if not tests:
        return [], views
    rejected, adjusted = benjamini_hochberg(np.array([t[0] for t in tests]), p.fdr_q)
    found = []
    for (_p, t), rej, q in zip(tests, rejected, adjusted, strict=True):
        if rej and t["held_share"] >= p.min_held_share and t["dominant"]:
            cause = ("compute: its ranks spend longer between collectives "
                     f"({t['compute_ms']:.1f} ms vs {t['peer_compute_ms']:.1f} ms on the others)"
                     if t["compute_ms"] > t["peer_compute_ms"] + t["held_s"] * 1e3 / max(1, t["late"]) / 2
                     else "arrives late without computing longer (delayed, descheduled or stopped; "
                          "see the node's CPU and GPU metrics)")
            found.append(LiveFinding(t["comm"], t["unit"], t["ranks"], t["held_s"], t["held_share"], float(q),
                                     t["late"], t["instances"], cause))
    return found, views


def job_nodes(job: str, timeout_s: float = 5.0) -> tuple[str, list[str]]:
    """(Slurm's state verdict, the job's nodes) from `scontrol show job -o`."""
    import re
    import shutil
    import subprocess

    from gpuprof.collector.jobwatch import job_state
    from gpuprof.mpi_merge.loading import expand_hostlist

    verdict, why = job_state(job, timeout_s)
    if verdict != "live":
        return verdict, [why]
    exe = shutil.which("scontrol")
    assert exe is not None  # job_state found it
    out = subprocess.run([exe, "show", "job", "-o", job], capture_output=True, text=True, timeout=timeout_s,
                         check=False).stdout
    m = re.search(r"(?:^|\s)NodeList=(\S+)", out)
    if m is None or m.group(1) in ("(null)", ""):
        return "pending", ["the job has no nodes yet"]
    return "live", expand_hostlist(m.group(1))


def gather(job: str, nodes: list[str], socket_template: str, *, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """Every node's summary: through its socket when it is reachable here (this node, or several
    slurmd on one host), else through a `srun --overlap` step of the job on that node, all at once."""
    import os
    import subprocess
    import sys

    from gpuprof.collector.continuous import client_request
    from gpuprof.collector.errors import CollectorError

    out: list[dict[str, Any]] = []
    remote: list[tuple[str, subprocess.Popen[str]]] = []
    for n in nodes:
        sock = socket_for(socket_template, n)
        if os.path.exists(sock):
            try:
                out.append(client_request(sock, {"cmd": "summary", "job": job}, timeout_s=timeout_s))
            except CollectorError as e:
                out.append({"ok": False, "node": n, "error": str(e)})
            continue
        cmd = ["srun", "--overlap", "--jobid", job, "-N1", "-n1", "-w", n, "--quiet", sys.executable, "-m",
               "gpuprof.slurm_hooks.cli", "watch", job, "--node-summary", "--socket", sock]
        remote.append((n, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for n, proc in remote:
        try:
            so, se = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            so, se = proc.communicate()
        try:
            out.append(json.loads(so.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            out.append({"ok": False, "node": n, "error": (se.strip() or "no summary")[-300:]})
    for s, n in zip(out, nodes, strict=False):
        s.setdefault("node", n)
    return out


def watch_once(job: str, socket_template: str, params: Any = None) -> dict[str, Any]:
    """One refresh: the job's state, its nodes' summaries, the live findings."""
    state, nodes = job_nodes(job)
    if state != "live":
        return {"job": job, "state": state, "reason": nodes[0], "findings": [], "communicators": []}
    summaries = gather(job, nodes, socket_template)
    findings, views = live_findings(combine(summaries), params)
    return {"job": job, "state": "live", "nodes": nodes, "findings": [f.__dict__ | {"line": f.line()} for f in findings],
            "communicators": views, "nodes_without_summary": {s["node"]: s.get("error", "") for s in summaries
                                                              if not s.get("ok")}}


def format_view(v: dict[str, Any]) -> str:
    if v["state"] != "live":
        return f"job {v['job']}: {v['reason']}; nothing to watch"
    lines = [f"job {v['job']} on {','.join(v['nodes'])}  ({time.strftime('%H:%M:%S')})"]
    for n, why in v["nodes_without_summary"].items():
        lines.append(f"  {n}: no summary ({why})")
    for c in v["communicators"]:
        if "note" in c:
            lines.append(f"  comm {c['comm']}: {c['note']}")
            continue
        late = sorted(c["lateness_ms"].items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"  comm {c['comm']} ({c['comm_size']} ranks, {c['instances']} instances to seq {c['last_seq']}): "
                     "median lateness " + ", ".join(f"rank {r} {ms:.2f} ms" for r, ms in late))
        lines.append("    last arrivals: " + ", ".join(f"#{a['seq']} {a['unit']} +{a['held_ms']:.2f} ms"
                                                       for a in c["last_arrivals"]))
    lines += [f"  {f['line']}" for f in v["findings"]] or ["  no confident finding"]
    return "\n".join(lines)
