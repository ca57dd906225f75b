"""A Python function running in a subinterpreter beside one in the main interpreter, for the
Python stack tests of 3.12+ (each interpreter its own GIL).

    main_spin    a pure Python loop in the main interpreter (the main thread)
    sub_spin     a pure Python loop in a subinterpreter (another thread, in run_string)

`python py_subinterp.py SECONDS`. It sleeps 1 s first (the collector finds the interpreter at its
next drain). Prints one JSON line at the end: pid, the native thread id of each loop, and when the
work started (CLOCK_MONOTONIC ns).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

try:
    import _interpreters as interpreters  # 3.13
except ImportError:
    import _xxsubinterpreters as interpreters  # 3.12

SUB_CODE = """
import time

def sub_spin(end):
    total = 0
    while time.monotonic() < end:
        for i in range(10000):
            total += i * i % 7

sub_spin(END)
"""


def main_spin(end: float) -> None:
    total = 0
    while time.monotonic() < end:
        for i in range(10000):
            total += i * i % 7


def main() -> None:
    seconds = float(sys.argv[1])
    time.sleep(1.0)
    sub = interpreters.create()
    tids = {"main_spin": threading.get_native_id()}
    t_work_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    end = time.monotonic() + seconds

    def in_sub() -> None:
        tids["sub_spin"] = threading.get_native_id()
        interpreters.run_string(sub, SUB_CODE.replace("END", repr(end)))

    t = threading.Thread(target=in_sub)
    t.start()
    main_spin(end)
    t.join()
    print(json.dumps({"pid": os.getpid(), "tids": tids, "t_work_ns": t_work_ns}))


if __name__ == "__main__":
    main()
