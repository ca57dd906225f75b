"""Where the collector's peak RSS comes from with BPF modes (issue 11): one JSON line with VmHWM,
VmRSS, RssAnon and RssFile (MB) after each step of a collector's start with the default modes:
the interpreter, the collector's imports, `import bcc`, the BPF compile (BpfHub.acquire), and
malloc_trim(0) as BpfHub does after it. Needs root and BCC.

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
    import bcc  # noqa: F401

    steps["import_bcc"] = status_mb()
    from gpuprof.collector import bpf_support

    trim = bpf_support.release_freed_heap
    bpf_support.release_freed_heap = lambda: False  # type: ignore[assignment]  # the compile alone first
    try:
        from gpuprof.collector import config

        hub = bpf_support.BpfHub.acquire(("metrics", "stacks", "collectives"), bpf_support.defines_for_all,
                                         bpf_support.stack_unwinder(config.defaults()))  # the default modes
    finally:
        bpf_support.release_freed_heap = trim  # type: ignore[assignment]
    steps["bpf_compile"] = status_mb()
    trim()
    steps["malloc_trim"] = status_mb()
    hub.release()
    print(json.dumps({"bench": "collector_rss_steps", "modes": "metrics,stacks,collectives", "mb": steps}), flush=True)


if __name__ == "__main__":
    main()
