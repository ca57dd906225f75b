"""A Python program blocked in a known call tree, for the Python frame tests (CPython 3.10-3.13):
three threads in outer -> middle -> leaf -> Event.wait, the main thread in main <- <module>, until
a line comes on stdin. The `# MARKER` comments name the lines the frames are expected at.

Prints one JSON line first: pid, the main thread's and the workers' native ids and pthread ids
(threading.get_ident: what 3.10's thread states hold), the version, and the id() of leaf's code
object and of the objects the collector reads from it (name: co_qualname on 3.11+, co_name on 3.10).
"""

import json
import os
import sys
import threading


def leaf(ev):
    ev.wait()  # LEAF


def middle(ev):
    leaf(ev)  # MIDDLE


def outer(ev):
    middle(ev)  # OUTER


def main():
    ev = threading.Event()
    threads = [threading.Thread(target=outer, args=(ev,), name=f"w{i}") for i in range(3)]
    for t in threads:
        t.start()
    while sum(t.native_id is not None for t in threads) < 3:
        pass
    code = leaf.__code__
    name = code.co_qualname if sys.version_info >= (3, 11) else code.co_name
    print(json.dumps({"pid": os.getpid(), "main": threading.get_native_id(), "main_ident": threading.get_ident(),
                      "workers": [t.native_id for t in threads], "worker_idents": [t.ident for t in threads],
                      "version": list(sys.version_info[:2]), "code": id(code), "name": id(name),
                      "filename": id(code.co_filename), "linetable": id(code.co_linetable),
                      "firstlineno": code.co_firstlineno}), flush=True)
    sys.stdin.readline()  # MAIN
    ev.set()
    for t in threads:
        t.join()


main()  # MODULE
