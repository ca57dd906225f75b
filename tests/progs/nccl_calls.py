"""Calls every probed NCCL entry point of a real libnccl once, with a NULL communicator.

Without a GPU NCCL rejects them (ncclInvalidArgument and friends) but its entry is reached, which
is where the probes and the interposer read the arguments. A non-NULL bogus communicator crashes
NCCL, so NULL it is. Prints one JSON line: what each call was given and returned.
Usage: nccl_calls.py LIBNCCL [--global]   (--global: resolve through the dynamic linker, as an
application linked against libnccl does, so that an LD_PRELOAD interposer sees the calls)
"""

from __future__ import annotations

import ctypes
import json
import sys

STREAM = 0x5151
# name -> (count, ncclDataType_t, element size, root or peer or -1)
COLLECTIVES = {
    "ncclAllReduce": (1001, 7, 4, -1),
    "ncclAllGather": (1002, 8, 8, -1),
    "ncclReduceScatter": (1003, 2, 4, -1),
    "ncclBroadcast": (1004, 1, 1, 3),
    "ncclReduce": (1005, 6, 2, 5),  # root is argument 6, comm 7 and stream 8 are on the stack
    "ncclSend": (1006, 4, 8, 7),
    "ncclRecv": (1007, 9, 2, 9),
}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def main() -> int:
    path = sys.argv[1]
    mode = ctypes.RTLD_GLOBAL if "--global" in sys.argv else ctypes.DEFAULT_MODE
    lib = ctypes.CDLL(path, mode=mode)
    api = ctypes.CDLL(None) if "--global" in sys.argv else lib
    vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    out: dict = {"calls": {}, "order": [], "stream": STREAM}

    def call(name: str, *args: object) -> int:
        rc = getattr(api, name)(*args)
        out["order"].append(name)
        return int(rc)

    for name, (count, dt, esize, peer) in COLLECTIVES.items():
        f = getattr(api, name)
        if name in ("ncclSend", "ncclRecv"):
            f.argtypes = [vp, sz, i32, i32, vp, vp]
            rc = call(name, 0x1000, count, dt, peer, None, STREAM)
        elif name == "ncclAllGather":
            f.argtypes = [vp, vp, sz, i32, vp, vp]
            rc = call(name, 0x1000, 0x2000, count, dt, None, STREAM)
        elif name == "ncclBroadcast":
            f.argtypes = [vp, vp, sz, i32, i32, vp, vp]
            rc = call(name, 0x1000, 0x2000, count, dt, peer, None, STREAM)
        elif name == "ncclReduce":
            f.argtypes = [vp, vp, sz, i32, i32, i32, vp, vp]
            rc = call(name, 0x1000, 0x2000, count, dt, 0, peer, None, STREAM)
        else:
            f.argtypes = [vp, vp, sz, i32, i32, vp, vp]
            rc = call(name, 0x1000, 0x2000, count, dt, 0, None, STREAM)
        out["calls"][name] = {"bytes": count * esize, "peer": peer, "ret": rc}
    for name in ("ncclGroupStart", "ncclGroupEnd"):
        out["calls"][name] = {"bytes": 0, "peer": -1, "ret": call(name)}

    uid = UniqueId()
    uid.internal = bytes((i * 7 + 3) % 251 for i in range(128))
    comm = vp()
    api.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i32, UniqueId, i32]
    out["init"] = {"nranks": 3, "rank": 2, "uid": bytes(uid.internal).ljust(128, b"\0").hex(),
                   "ret": call("ncclCommInitRank", ctypes.byref(comm), 3, uid, 2)}
    api.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(vp), i32, UniqueId, i32, vp]
    out["init"]["ret_config"] = call("ncclCommInitRankConfig", ctypes.byref(comm), 3, uid, 2, None)
    comms = (vp * 2)()
    api.ncclCommInitAll.argtypes = [ctypes.POINTER(vp), i32, vp]
    out["initall"] = {"ndev": 2, "ret": call("ncclCommInitAll", comms, 2, None)}
    newcomm = vp()
    api.ncclCommSplit.argtypes = [vp, i32, i32, ctypes.POINTER(vp), vp]
    out["split"] = {"color": 11, "key": 13, "ret": call("ncclCommSplit", None, 11, 13, ctypes.byref(newcomm), None)}
    n = i32(-5)
    for name in ("ncclCommCount", "ncclCommUserRank"):
        getattr(api, name).argtypes = [vp, ctypes.POINTER(i32)]
        out[name] = call(name, None, ctypes.byref(n))
    for name in ("ncclCommDestroy", "ncclCommAbort"):
        getattr(api, name).argtypes = [vp]
        out[name] = call(name, None)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
