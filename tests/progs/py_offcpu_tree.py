"""A Python program whose known call tree blocks, for the off-CPU stacks (tests/test_bpf_offcpu.py):

    main -> outer -> middle -> leaf_sleep (time.sleep 2 ms)       mode `sleep`
    main -> outer -> middle -> leaf_read (os.read of a pipe)      mode `pipe`: a thread writes a
                                                                  byte every 2 ms
    two processes (a fork) spin in spin_outer -> spin_leaf,        mode `spin`: runnable time only
    both on CPU 0 (each with its own GIL, so neither waits on a lock)

`py_offcpu_tree.py MODE SECONDS`: spins 1 s first (the collector registers the interpreter at its
next drain after the exec: a sleep there would be blocked time without Python frames), runs the tree for SECONDS, prints one JSON line: pid, tids (the
threads of the tree; in `spin`, the two processes' only threads), iterations (calls of the tree).
"""

import json
import os
import sys
import threading
import time


def leaf_sleep():
    time.sleep(0.002)


def leaf_read(fd):
    os.read(fd, 1)


def middle(fd):
    if fd is None:
        leaf_sleep()
    else:
        leaf_read(fd)


def outer(fd):
    middle(fd)


def spin_leaf(end):
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


def spin_outer(end):
    os.sched_setaffinity(0, {0})
    spin_leaf(end)


def writer(fd, stop):
    while not stop.is_set():
        time.sleep(0.002)
        os.write(fd, b"x")


def main():
    mode, seconds = sys.argv[1], float(sys.argv[2])
    spin_leaf(time.monotonic() + 1.0)
    end = time.monotonic() + seconds
    tids = []
    iterations = 0
    if mode == "spin":
        child = os.fork()
        if child == 0:
            spin_outer(end)
            os._exit(0)
        spin_outer(end)
        os.waitpid(child, 0)
        tids += [os.getpid(), child]
    else:
        fd = None
        stop = threading.Event()
        if mode == "pipe":
            r, w = os.pipe()
            fd = r
            wt = threading.Thread(target=writer, args=(w, stop))
            wt.start()
        tids.append(threading.get_native_id())
        while time.monotonic() < end:
            outer(fd)
            iterations += 1
        stop.set()
        if mode == "pipe":
            wt.join()
    print(json.dumps({"pid": os.getpid(), "tids": tids, "iterations": iterations}), flush=True)


main()
