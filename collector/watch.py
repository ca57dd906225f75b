"""Live watch, the node's side: small summaries of the last collective instances (the continuous
collector's `summary` command). The job-wide view of them, `gpuprof watch JOB`, is
mpi_merge/live_watch.py (it uses the merge's statistics, and the collector imports nothing of the
merge).

A node's summary is per communicator the last MAX_INSTANCES instances (seq) of each of its local
ranks, with the arrival (t_enter) and return (t_exit) on the node's CLOCK_REALTIME: a few KB per
node, so the watch costs the compute network nothing beyond that. Lateness of a rank at an
instance = its arrival minus the earliest arrival of that instance over every rank (all nodes):
the same per-instance arrival spread the merge's straggler analysis starts from. The clocks here
are the nodes' own realtime clocks, not the merge's aligned ones, so a lateness below the nodes'
clock agreement (NTP, often a few ms) is not a finding; the watch says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuprof.collector import schema

MAX_INSTANCES = 256  # per rank: about 8 KB of JSON, a few seconds of a busy job
# blocking collectives only: the instances every rank of a communicator enters (no point to point,
# no completions of non-blocking ones, whose arrival is not the rank's)
COLLECTIVE_OP_CODES = np.array([i for i, name in enumerate(schema.COLLECTIVE_OPS)
                                if not any(k in name for k in ("Send", "Recv", "Wait", "Test", "Group", "_I"))])


def node_summary(data: dict[str, np.ndarray], *, node: str) -> dict[str, Any]:
    """The summary of one node's retained window (Retention.window's result)."""
    pairs = data.get(schema.CLOCK_PAIRS.path)
    if pairs is None or not len(pairs):
        return {"ok": False, "error": "no clock pair retained"}
    offset = int(pairs["realtime_ns"][-1]) - int(pairs["monotonic_ns"][-1])
    calls = data.get(schema.COLLECTIVE_CALLS.path)
    comms: dict[str, Any] = {}
    if calls is not None and len(calls):
        calls = calls[np.isin(calls["op"], COLLECTIVE_OP_CODES) & (calls["comm_size"] > 1)]
        for cid in np.unique(calls["comm_id"]):
            c = calls[calls["comm_id"] == cid]
            ranks: dict[str, list[list[int]]] = {}
            for r in np.unique(c["comm_rank"]):
                rc = c[c["comm_rank"] == r]
                rc = rc[np.argsort(rc["seq"])][-MAX_INSTANCES:]
                ranks[str(int(r))] = [[int(s), int(a) + offset, int(b) + offset if b else 0]
                                      for s, a, b in zip(rc["seq"], rc["t_enter_ns"], rc["t_exit_ns"], strict=True)]
            comms[str(int(cid))] = {"comm_size": int(c["comm_size"].max()), "ranks": ranks, "node": node}
    return {"ok": True, "node": node, "communicators": comms}


def socket_for(template: str, node: str) -> str:
    """continuous.socket, with {node} replaced (several slurmd on one host: one collector each)."""
    return template.replace("{node}", node)
