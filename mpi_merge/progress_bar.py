"""`gpuprof merge` progress on a terminal: one tqdm bar per step (files read, instances scanned,
clock fit, wait states...), with its rate and ETA. merge.py uses it in place of its Progress
lines when rank 0's stderr is a terminal; in a batch log (stderr a file) the merge keeps the plain
lines, one every second at most, or none without --progress.

Same interface as merge.Progress (`on`, `due()`, calling it with step, done, total, unit, force),
so the merge calls it the same way; not a subclass, to keep merge.py's imports one-way.
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any


class TerminalProgress:
    """A bar per step, closed (left on screen) when the step is done or the next step begins."""

    MIN_INTERVAL_S = 0.2  # tqdm redraws at most this often

    def __init__(self, on: bool, file: IO[str] | None = None):
        self.on = on
        self.file = file if file is not None else sys.stderr
        self._step: str | None = None
        self._bar: Any = None
        self._last_due = -math.inf

    def due(self) -> bool:
        """Whether a count is worth making now: the merge counts files read (a directory listing)
        only then; the bar redraws at most every MIN_INTERVAL_S anyway."""
        if not self.on:
            return False
        now = time.monotonic()
        if now - self._last_due < self.MIN_INTERVAL_S:
            return False
        self._last_due = now
        return True

    def __call__(self, step: str, done: int, total: int, unit: str, force: bool = False) -> None:
        if not self.on:
            return
        from tqdm import tqdm

        if step != self._step:
            self.close()
            self._step = step
            self._bar = tqdm(total=max(total, 0), desc=f"gpuprof merge: {step}", unit=f" {unit}", file=self.file,
                             mininterval=self.MIN_INTERVAL_S, dynamic_ncols=True, leave=True)
        bar = self._bar
        if total != bar.total:
            bar.total = total
        bar.update(max(0, done - bar.n))
        if force:
            bar.refresh()
        if total > 0 and done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._step = None
