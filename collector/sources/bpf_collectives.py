"""Mode `collectives` through uprobes: MPI and NCCL calls of the job's processes (bpf/collectives.c).

The probe table is in probe_table.py, the call record and communicator registry both paths share
in collective_calls.py; which path each library takes is fastpath.resolve_paths.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import (
    BpfHub,
    HubSource,
    attach_symbols,
    defined_functions,
    detach_symbols,
    mapped_libraries,
    read_environ,
    read_maps,
)
from gpuprof.collector.fastpath_env import resolve_paths
from gpuprof.collector.sources.base import CALL_SOURCE_SHARE, Batch, SourceContext, SourceUnavailable
from gpuprof.collector.sources.collective_calls import (
    CALL_DTYPE,
    CALL_FIELDS,
    CommRegistry,
    predefined_mpi_handles,
    system_libraries,
)
from gpuprof.collector.sources.probe_table import LIB_CODES, LIBRARY_PATTERNS, MPICH_COMM_WORLD, PROBES, Probe


class BpfCollectivesSource(HubSource):
    """Uprobes on the MPI and NCCL libraries mapped into the job's processes."""

    name = "collectives_uprobe"
    attaches = True  # sees only what happens after it started (a late start is recorded)
    ring_share = CALL_SOURCE_SHARE  # calls come fast: collector/ring.py split_capacity
    tables = (schema.COLLECTIVE_CALLS, schema.COMMUNICATORS)
    interval_s = 0.2
    drops_map = b"gp_coll_drops"  # [0] calls ring full, [1] communicators ring full

    def __init__(self, libraries: tuple[str, ...] | None = None) -> None:
        # libraries: which to probe; None = those the config routes to uprobes.
        self.libraries = libraries
        self.attached: set[tuple[str, str]] = set()
        self.missing: dict[str, set[str]] = {}
        self._calls: list[Any] = []
        self._comms: list[Any] = []
        # Decoded records as they came, kept only when asked (tests check fields not stored in
        # the file, like the NCCL stream, and the raw communicator records).
        self.keep_raw = False
        self._late: list[dict[str, Any]] = []  # libraries first probed while job processes mapped them
        self.raw_calls: list[np.ndarray] = []
        self.events_comm: list[dict[str, Any]] = []

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        if self.libraries is None:
            paths = resolve_paths(ctx.config)
            self.libraries = tuple(lib for lib in ("mpi", "nccl") if paths[lib] == "uprobe")
        if not self.libraries:
            raise SourceUnavailable("collectives of every library go through the fast path (config)")
        hub = self.take_hub(ctx, "collectives", "GP_WITH_COLLECTIVES", "collectives")
        b = hub.bpf
        descs = b[b"gp_descs"]
        for i, p in enumerate(PROBES):
            leaf = descs.Leaf()
            for f in Probe.__dataclass_fields__:
                if f in ("symbol", "library", "op", "kind"):
                    continue
                setattr(leaf, f, getattr(p, f))
            leaf.op = p.op_code
            leaf.kind = 0 if p.kind == "call" else 1
            leaf.library = LIB_CODES[p.library]
            descs[descs.Key(i)] = leaf
        self.environs: dict[int, dict[str, str]] = {}
        self.maps: dict[int, list[Any]] = {}
        self.handles: dict[int, dict[str, int]] = {}
        self.registry = CommRegistry(ctx.node, environ=self._environ, mpi_handles=self._mpi_handles,
                                     maps=self._maps)
        b[b"gp_calls"].open_ring_buffer(self._on_call)
        b[b"gp_comms"].open_ring_buffer(self._on_comm)
        # Libraries the system linker knows are probed from the start, so that calls a rank makes
        # before the collector's next process scan (MPI_Init, communicator splits) are seen.
        for lib in self.libraries:
            for path in system_libraries(LIBRARY_PATTERNS[lib]):
                self.attach_library(lib, path)
        self._refresh(set(ctx.pids()))

    def late_attachments(self) -> list[dict[str, Any]]:
        return [dict(late, pids=list(late["pids"])) for late in self._late]

    def _on_call(self, _cpu: int, data: Any, _size: int) -> None:
        ev = self.hub.bpf[b"gp_calls"].event(data)  # type: ignore[union-attr]
        self._calls.append(tuple(getattr(ev, f) for f in CALL_FIELDS))

    def _on_comm(self, _cpu: int, data: Any, _size: int) -> None:
        ev = self.hub.bpf[b"gp_comms"].event(data)  # type: ignore[union-attr]
        d = {f: getattr(ev, f) for f, _ in ev._fields_}
        d["uid"] = bytes(ev.uid)
        self._comms.append(d)

    def _environ(self, pid: int) -> dict[str, str]:
        """A rank's environment (launch namespace, world rank and size), read while it is alive."""
        env = self.environs.get(pid)
        if env is None:
            env = read_environ(pid)
            if env:
                self.environs[pid] = env
        return env

    def _maps(self, pid: int) -> list[Any]:
        """The process's mappings as last seen alive (handles are resolved after it exited)."""
        return self.maps.get(pid) or read_maps(pid)

    def _mpi_handles(self, pid: int) -> dict[str, int]:
        h = self.handles.get(pid)
        if h is None:
            h = predefined_mpi_handles(pid, self._maps(pid))
            if h:
                self.handles[pid] = h
        return h

    def _refresh(self, pids: set[int]) -> None:
        """Put new job pids into the kernel's set; for every job process (the kernel's set also
        holds the children it saw forked) keep its environment and attach to libraries it maps."""
        assert self.hub is not None
        self.hub.set_pids(pids)
        pids = pids | {k.value for k in self.hub.job_pids if os.path.isdir(f"/proc/{k.value}/task")}
        mpich = self.hub.bpf[b"gp_mpich"]
        fresh: dict[str, dict[str, Any]] = {}
        for pid in pids:
            self._environ(pid)
            maps = read_maps(pid)
            for lib in self.libraries or ():
                for path in mapped_libraries(pid, LIBRARY_PATTERNS[lib], maps):
                    self.maps[pid] = maps
                    if lib == "mpi" and self._mpi_handles(pid).get("world") == MPICH_COMM_WORLD:
                        mpich[mpich.Key(pid)] = mpich.Leaf(1)
                    if self.attach_library(lib, path):
                        # probed only now although this job process maps it: its calls so far are
                        # missing and its counters start here (docs/trace-format.md, Late probes)
                        late = fresh[path] = {"library": path, "attached_ns": now_ns(), "pids": [pid]}
                        self._late.append(late)
                        self.ctx.report_error(self.name, f"{path} probed late (t_ns={late['attached_ns']}): pid "
                                              f"{pid} mapped it before; its earlier calls are missing"[:240])
                    elif path in fresh and len(fresh[path]["pids"]) < 64:
                        fresh[path]["pids"].append(pid)  # mapped it before this pass attached it too

    def attach_library(self, lib: str, path: str) -> list[str]:
        """Attach entry and return probes to every probed symbol the file defines (all processes
        mapping it trap; only job processes are recorded). Returns the symbols attached now."""
        assert self.hub is not None
        wanted = [p.symbol for p in PROBES if p.library == lib]
        have = defined_functions(path, wanted)
        self.missing[path] = set(wanted) - have
        def attach(bpf: Any, name: bytes, sym: bytes) -> None:
            bpf.attach_uprobe(name=name, sym=sym, fn_name=b"gp_enter_" + sym)
            bpf.attach_uretprobe(name=name, sym=sym, fn_name=b"gp_return")

        return attach_symbols(self.hub, path, [s for s in wanted if s in have], self.attached, attach,
                              lambda msg: self.ctx.report_error(self.name, msg))

    def _drain(self) -> tuple[np.ndarray, list[dict[str, Any]]]:
        assert self.hub is not None
        # Calls first, then communicators: a communicator created before a call entered is already
        # in its ring when the call is read, so it is applied first (CommRegistry.lookup).
        # One BPF object serves every eBPF source, and consuming runs all their callbacks: take the
        # hub's lock so another source's drain cannot append while this one swaps its lists.
        with self.hub.ring_lock:
            self.hub.bpf.ring_buffer_consume()
            calls = np.array(self._calls, dtype=CALL_DTYPE)
            comms = self._comms
            self._calls, self._comms = [], []
        return calls, comms

    def sample(self, now_ns: int) -> list[Batch]:
        self._refresh(set(self.ctx.pids()))
        return self._rows(now_ns, final=False)

    def _rows(self, now_ns: int, final: bool) -> list[Batch]:
        calls, comms = self._drain()
        for ev in comms:
            self.registry.on_comm(ev)
        if self.keep_raw:
            self.events_comm.extend(comms)
            self.raw_calls.append(calls)
        rows = self.registry.call_rows(calls, "uprobe")
        return [(schema.COLLECTIVE_CALLS, rows),
                (schema.COMMUNICATORS, self.registry.communicator_rows(now_ns, final))]

    def final(self, now_ns: int) -> list[Batch]:
        return self._rows(now_ns, final=True)

    def detach(self, hub: BpfHub) -> None:
        def detach(bpf: Any, path: bytes, sym: bytes) -> None:
            bpf.detach_uretprobe(name=path, sym=sym)
            bpf.detach_uprobe(name=path, sym=sym)

        detach_symbols(hub, self.attached, detach)


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)
