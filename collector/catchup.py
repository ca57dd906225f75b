"""The collector's priority while it falls behind: hooks.collector_nice lifted for a while.

Why: the prolog starts the collector in a session of its own and lowers that session's autogroup to
hooks.collector_nice (daemon.lower_priority), so against a job whose ranks keep both cores busy
it gets about a tenth of a core. That is what most jobs need of it, and its heavy moments (a first
job's compiles, the seal on a busy node) then cost the job little. But a call-intensive code needs
more: MEEP's halo exchange records 130k calls a second per rank, and a fast-path drain that takes
5 ms of CPU waited up to 0.75 s for it, while a rank's ring holds 0.5 s of calls. The rings
overflowed: 49k to 413k records lost per 8 s run (docs/collector.md, "Keeping up with a
call-intensive code"). With the session at nice 0 the same runs lost none.

Lifting the priority does not change what a record costs the collector, only when it is processed:
what the job pays more is the cost of the records that were lost before, the profile's
completeness. So: when a source's sample finds one of its buffers (an interposer's ring, or the
collector's own ring for that source) more than BEHIND_FILL full, the session's autogroup goes to
nice 0; once none has been for HOLD_S, back to hooks.collector_nice. The lifts and the time spent
lifted are in status and in the node file (collector_cpu_json)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BEHIND_FILL = 0.5  # a buffer more than half full: the collector is falling behind
HOLD_S = 30.0  # lifted this long after the last buffer found more than half full: a code that
# falls behind once mostly does again, and each time it may lose records before a drain sees it


def parse_autogroup(text: str) -> int | None:
    """The nice of an autogroup file's contents ("/autogroup-123 nice 10"); None when not that."""
    fields = text.split()
    if len(fields) != 3 or fields[1] != "nice" or not fields[2].lstrip("-").isdigit():
        return None
    return int(fields[2])


def autogroup_nice(path: Path) -> int | None:
    """The nice of the autogroup file; None when unreadable or not one."""
    try:
        return parse_autogroup(path.read_text())
    except OSError:
        return None


class CatchUp:
    """Lifts the session's autogroup from `nice` to 0 while the collector falls behind (observe)."""

    def __init__(self, nice: int, autogroup: Path | None, clock: Callable[[], float] = time.monotonic) -> None:
        """autogroup: the file of the session's autogroup, already at `nice` (lower_priority did
        it); None: nothing to lift (not a session leader, no autogroups, or nice 0)."""
        self.nice = nice
        self.autogroup = autogroup if nice > 0 else None
        self.clock = clock
        self.lock = threading.Lock()
        self.lifted_since: float | None = None
        self.last_behind = 0.0
        self.lifts = 0
        self.lifted_s = 0.0
        self.problem = ""

    def observe(self, fill: float) -> None:
        """A source's sample found its fullest buffer `fill` full (0..1)."""
        if self.autogroup is None:
            return
        now = self.clock()
        with self.lock:
            if fill > BEHIND_FILL:
                self.last_behind = now
                if self.lifted_since is None and self._write(0):
                    self.lifted_since = now
                    self.lifts += 1
            elif self.lifted_since is not None and now - self.last_behind > HOLD_S and self._write(self.nice):
                self.lifted_s += now - self.lifted_since
                self.lifted_since = None

    def _write(self, nice: int) -> bool:
        assert self.autogroup is not None
        try:
            self.autogroup.write_text(str(nice))
        except OSError as e:  # no CAP_SYS_NICE to lift it: said once, never tried again
            self.problem = f"{self.autogroup}: cannot set the session's nice to {nice}: {e}"
            self.autogroup = None
            return False
        return True

    def summary(self) -> dict[str, Any]:
        with self.lock:
            lifted = self.lifted_s + (self.clock() - self.lifted_since if self.lifted_since is not None else 0.0)
            return {"nice": self.nice, "active": self.autogroup is not None, "lifts": self.lifts,
                    "lifted_s": round(lifted, 3), **({"problem": self.problem} if self.problem else {})}
