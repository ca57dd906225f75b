"""Where the collector's resident set comes from with BPF modes (issue 11): one JSON line with VmHWM,
VmRSS, RssAnon and RssFile (MB) after each step of a collector's start with the default modes: the
interpreter, the collector's imports, the BPF object (BpfHub.acquire: BCC's compile in a child
process, the descriptors received), and the kernel's symbols (read at the off-CPU source's start);
beside them, the compile child's own CPU and peak resident set, which the collector never holds.
Needs root and BCC.

    .venv/bin/python tests/bench/bench_rss.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def status_mb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) // 1024
    return out


def main() -> None:
    if os.geteuid() != 0:
        print(json.dumps({"bench": "collector_rss_steps", "missing": "needs root (BPF)"}), flush=True)
        return
    steps = {"interpreter": status_mb()}
    import h5py  # noqa: F401
    import numpy  # noqa: F401

    from gpuprof.collector import daemon  # noqa: F401

    steps["collector_imports"] = status_mb()
    from gpuprof.collector import bpf_support, config, symbolize

    hub = bpf_support.BpfHub.acquire(("metrics", "stacks", "collectives"), bpf_support.defines_for_all,
                                     bpf_support.stack_unwinder(config.defaults()))  # the default modes
    steps["bpf_object"] = status_mb()
    symbolize.kernel_symbol(0)
    steps["kernel_symbols"] = status_mb()
    child = hub.summary()["bpf_compile"]
    hub.release()
    print(json.dumps({"bench": "collector_rss_steps", "modes": "metrics,stacks,collectives", "mb": steps,
                      "compile_child": {"peak_rss_mb": child["peak_rss_mb"], "cpu_s": child["cpu_s"],
                                        "wall_s": child["wall_s"]}}), flush=True)


if __name__ == "__main__":
    main()
