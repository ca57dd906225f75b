"""The interface every collector source implements (NVML, /proc, eBPF, the fast-path drain).

The daemon gives each source its own thread: it calls `start` once, then `sample` every
`interval_s` seconds, and pushes what `sample` returns into that source's own bounded ring; the
writer thread drains the rings. A source never blocks another: a slow or failing `sample` only
delays its own thread. `SourceUnavailable` from `start` disables the source with the reason
recorded in /diagnostics/errors; the other sources go on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from gpuprof.collector.schema import Table


class SourceUnavailable(Exception):
    """This source cannot run on this node or job (no GPU, no BPF, symbol missing...): say why."""


@dataclass
class SourceContext:
    job_id: str
    node: str
    modes: tuple[str, ...]
    config: dict[str, dict[str, Any]]
    # The job's current process ids (kept up to date by the process tracker).
    pids: Callable[[], frozenset[int]]
    # Those and the job's pids gone within the last minute (proctrack.RECENTLY_GONE_S): what the
    # fast path checks a ring's writer against, since a ring outlives its writer.
    recent_pids: Callable[[], frozenset[int]]
    # The job's cgroup directories (one per controller that has one), empty when none is known.
    cgroup_dirs: Callable[[], tuple[str, ...]]
    # Record an error row for this source in /diagnostics/errors (never raises).
    report_error: Callable[[str, str], None]
    # Record a metric that is not available: (source, device, metric, reason).
    report_missing: Callable[[str, int, str, str], None]
    extra: dict[str, Any] = field(default_factory=dict)
    # The job owner's uid (--uid), None when not known (a process tree observed by hand).
    uid: int | None = None
    # Ask for this source's next sample now instead of at its next tick (the daemon ends the wait
    # of the source's thread; callable from any thread, a native one included). None when the
    # caller samples by hand (tests): a source that needs early samples then samples at its
    # fastest rate instead, and says so.
    request_sample: Callable[[], None] | None = None


Batch = tuple[Table, np.ndarray]

# The ring share of the sources of collective and point-to-point calls (Source.ring_share).
CALL_SOURCE_SHARE = 4


class Source(ABC):
    name: str = "source"
    tables: tuple[Table, ...] = ()
    interval_s: float = 1.0
    # Its share of collector.memory_limit_mb for the rows waiting for the writer, against 1 for
    # each other ring (collector/ring.py split_capacity): CALL_SOURCE_SHARE for the sources of calls.
    ring_share: int = 1
    # How full its fullest buffer was at its last sample (0..1; the fast path: an interposer's
    # ring): more than half lifts the collector's priority for a while (collector/catchup.py).
    fill: float = 0.0
    # Set by a source that waits for something about to appear (the fast path: a ring whose header
    # its process has not finished writing): its next sample comes after this many seconds instead
    # of its interval; None: the interval.
    retry_s: float | None = None
    # True for a probe that sees only what happens after its start (uprobes, perf events): when it
    # starts after the job's first process, the collector records it as attached late (what it
    # may have missed: docs/trace-format.md, attach_json). The fast path is not one: the
    # interposers write their rings from a process's first call, whenever the collector reads them.
    attaches: bool = False
    # True for a source whose sample cannot wedge (no driver call) and that does not use retry_s:
    # started, it is sampled on one thread with the others of its interval (collector/daemon.py
    # _DrainGroup: one wake-up a tick for all of them)
    shares_drain_thread: bool = False

    @abstractmethod
    def start(self, ctx: SourceContext) -> None:
        """Open what the source needs; raise SourceUnavailable(reason) when it cannot run."""

    @abstractmethod
    def sample(self, now_ns: int) -> Iterable[Batch]:
        """Read once; return rows per table. Called on the source's own thread."""

    def stop(self) -> None:
        """Release resources. Called once, after the last sample."""

    def final(self, now_ns: int) -> Iterable[Batch]:
        """Last rows at seal (drain kernel maps, rings). Default: one more sample."""
        return self.sample(now_ns)

    def late_attachments(self) -> list[dict[str, Any]]:
        """Libraries probed only after job processes had mapped them (the uprobe path): each
        {"library", "attached_ns", "pids"}; calls made there before attached_ns are missing."""
        return []

    def summary(self) -> dict[str, Any] | None:
        """Source-specific state for `status` (e.g. the fast path's ring counts); None = nothing."""
        return None

    def at_seal(self, f: h5py.File) -> None:
        """Write what is only known at the end (string tables, symbols) into the closed-SWMR file."""
