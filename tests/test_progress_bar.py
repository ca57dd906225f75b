"""`gpuprof merge`'s progress: tqdm bars on a terminal (mpi_merge/progress_bar.py), plain lines in a
batch log (merge.Progress, tests/test_merge_badinput.py), nothing when off."""

from __future__ import annotations

import io
import re

from gpuprof.mpi_merge.progress_bar import TerminalProgress


def test_a_bar_per_step_with_counts_and_rate() -> None:
    out = io.StringIO()
    p = TerminalProgress(True, file=out)
    p("reading node files", 0, 4, "files read")
    for i in range(1, 5):
        p("reading node files", i, 4, "files read")
    p("clock fit", 10, 10, "instances", force=True)
    p("wait states", 0, 1000, "instances analysed")
    p("wait states", 400, 1000, "instances analysed", force=True)
    p.close()
    text = out.getvalue()
    assert "gpuprof merge: reading node files" in text and "4/4" in text
    assert "gpuprof merge: clock fit" in text and "10/10" in text
    assert re.search(r"gpuprof merge: wait states: +40%.*400/1000", text)
    assert " files read/s" in text or "s/ files read" in text  # tqdm's rate, in the step's unit


def test_off_prints_nothing() -> None:
    out = io.StringIO()
    p = TerminalProgress(False, file=out)
    p("reading node files", 1, 4, "files read", force=True)
    assert not p.due() and out.getvalue() == ""


def test_due_is_rate_limited() -> None:
    p = TerminalProgress(True, file=io.StringIO())
    assert p.due() and not p.due()  # the second within MIN_INTERVAL_S
