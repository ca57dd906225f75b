"""Threads whose kernel name says what they are.

Python names its threads for itself only: in `top -H`, `ps -L`, perf and /proc every thread of
the collector is "python". An operator looking at a node, and the cost bench splitting the
collector's CPU by thread, need to tell the writer from the stacks drain, so each thread sets its
kernel name (comm, 15 characters at most) when it starts: "gp-" and its Python name without the
"source-" / "gpuprof-" prefix (gp-writer, gp-drains-1s, gp-collectives_, gp-cfi-register). The
native sampling threads name themselves the same way (collector/native/ticker.c).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

PR_SET_NAME = 15  # <linux/prctl.h>
COMM_LEN = 15  # TASK_COMM_LEN less the NUL

_libc = ctypes.CDLL(None, use_errno=True)


def os_name(name: str) -> str:
    return ("gp-" + name.removeprefix("source-").removeprefix("gpuprof-"))[:COMM_LEN]


def set_os_name(name: str) -> None:
    """Name the calling thread in the kernel. A failure (not Linux) leaves the name as it was:
    the name is for people looking, never for the collector's own logic."""
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(os_name(name).encode()), 0, 0, 0)


def named_thread(target: Callable[..., None], name: str, args: tuple[Any, ...] = (),
                 daemon: bool = True) -> threading.Thread:
    """threading.Thread(target, args, name, daemon), not started, whose kernel name is set too."""
    def run(*a: Any) -> None:
        set_os_name(name)
        target(*a)

    return threading.Thread(target=run, args=args, name=name, daemon=daemon)
