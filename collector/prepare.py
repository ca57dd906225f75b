"""`gpuprof prepare`: what a node's first profiled job would otherwise do at its start, done ahead.

A collector compiles the shared BPF object its job's modes need (BCC, in a child: 7-13 s of CPU on
the development VMs while the prolog waits) and keeps its image (bpf_image.py), and the CFI unwinder
compiles the tables of the node's common runtime libraries into the host's disk cache (the prewarm,
sources.stacks.cfi_prewarm: 25 s of a core here, beside the job's first minute). Every later job
finds both. Run at boot (etc/gpuprof-prepare.service) and after an upgrade of gpuprof or BCC, the
first job is like the others.
"""

from __future__ import annotations

import os
import time
from typing import Any

from gpuprof.collector.bpf_support import acquire_hub, hub_switches, images_dir_for, stack_unwinder
from gpuprof.collector.cfiunwind import start_compiler
from gpuprof.collector.sources.base import SourceUnavailable

# the prewarm of this VM's 12 runtime libraries (libpython and OpenBLAS the largest) took 25 s
PREWARM_TIMEOUT_S = 900.0


class _PrepareContext:
    """What start_compiler reads of a source's context: the config, and where problems go."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.problems: list[str] = []

    def report_error(self, source: str, message: str) -> None:
        self.problems.append(f"{source}: {message}")


def prepare_node(config: dict[str, Any], modes: tuple[str, ...]) -> dict[str, Any]:
    """The shared object a job of `modes` would use on this node, compiled now and its image kept
    (or, kept already, loaded and checked by the kernel's verifier as a job's collector would), then
    the CFI prewarm when the modes walk stacks by CFI. Raises SourceUnavailable (its text says why)
    when BPF cannot run here or collector.bpf_object_cache is off (nothing would be kept)."""
    images = images_dir_for(config)
    if images is None:
        raise SourceUnavailable("collector.bpf_object_cache is false or paths.state_dir is empty: "
                                "no image would be kept")
    unwinder = stack_unwinder(config)
    out: dict[str, Any] = {"modes": ",".join(modes), "switches": list(hub_switches(modes, unwinder)),
                           "images_dir": images}
    if not out["switches"]:
        return {**out, "state": "nothing to prepare: these modes use no BPF object", "kept": False}
    hub = acquire_hub(modes, config)
    try:
        cost, key = hub.bpf.cost, hub.bpf.image_key
        problems = list(hub.images.errors) if hub.images is not None else []
    finally:
        hub.release()
    state = ("kept already: loaded from its image" if cost.from_image
             else "compiled and kept" if key else "compiled, NOT kept (see the problems)")
    out.update(state=state, kept=bool(key), image=os.path.join(images, f"{key}.json") if key else "",
               cpu_s=round(cost.cpu_s, 3), wall_s=round(cost.wall_s, 3),
               compile_peak_rss_mb=round(cost.peak_rss_mb, 1))
    if "stacks" in modes:
        out.update(_prewarm_tables(config, problems))
    return {**out, "problems": problems}


def _prewarm_tables(config: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The CFI prewarm a stacks source starts (cfiunwind.start_compiler), waited for to its end."""
    ctx = _PrepareContext(config)
    t0 = time.monotonic()
    compiler = start_compiler(ctx, None)
    if compiler is None:
        return {"cfi_prewarm": "not used: the unwinder is frame pointers"}
    try:
        if not config["sources.stacks"]["cfi_prewarm"] or compiler.cache.disk_dir is None:
            return {"cfi_prewarm": "off (sources.stacks.cfi_prewarm, cfi_cache_mb or paths.state_dir)"}
        deadline = t0 + PREWARM_TIMEOUT_S
        while not compiler.idle() and time.monotonic() < deadline:
            time.sleep(0.2)
        finished = compiler.idle()
    finally:
        compiler.close()
    problems += ctx.problems + list(compiler.cache.disk_errors)
    if not finished:
        problems.append(f"CFI prewarm not finished within {PREWARM_TIMEOUT_S:.0f} s: the next job goes on with it")
    return {"cfi_prewarm": "done" if finished else "cut short", "cfi_prewarm_files": compiler.done,
            "cfi_tables_compiled": compiler.cache.warmed, "cfi_prewarm_child_cpu_s": round(compiler.cache.child_cpu_s, 3),
            "cfi_prewarm_wall_s": round(time.monotonic() - t0, 3)}
