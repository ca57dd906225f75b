"""Two threads with a known GIL state, for the GIL column of the Python stack tests.

    holds_gil      a pure Python loop: the thread holds the GIL whenever it runs
    releases_gil   hashlib.sha256 over 8 MiB at a time: the C code releases the GIL while it hashes

`python py_gil.py SECONDS`. It sleeps 1 s first (the collector finds the interpreter at its next
drain). Prints one JSON line at the end: pid, the native thread id of each thread by its function,
and when the work started (CLOCK_MONOTONIC ns).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time

DATA = b"\x5a" * (8 << 20)


def holds_gil(end: float) -> None:
    total = 0
    while time.monotonic() < end:
        for i in range(10000):
            total += i * i % 7


def releases_gil(end: float) -> None:
    while time.monotonic() < end:
        hashlib.sha256(DATA).digest()  # OpenSSL's code, the GIL released for buffers over 2 KiB


def main() -> None:
    seconds = float(sys.argv[1])
    time.sleep(1.0)
    tids: dict[str, int] = {}
    t_work_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    end = time.monotonic() + seconds

    def run(fn: object) -> None:
        tids[fn.__name__] = threading.get_native_id()  # type: ignore[attr-defined]
        fn(end)  # type: ignore[operator]

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (holds_gil, releases_gil)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"pid": os.getpid(), "tids": tids, "t_work_ns": t_work_ns}))


if __name__ == "__main__":
    main()
