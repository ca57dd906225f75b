"""Mode `kernels`: CUDA kernel launches of the job's processes through uprobes (bpf/kernels.c).

Entry uprobes on cuLaunchKernel(Ex) and cudaLaunchKernel(ExC) (and their _ptsz forms) in every
ELF object mapped by a job process that exports them (libcuda, libcudart, a static cudart in the
executable, a test double), plus the system's libcuda/libcudart from the start. One row per launch
in /kernels/launches: grid, block, dynamic shared memory, stream, the function and the user stack
at the launch (stack ids shared with /stacks/frames). Kernel names go to /kernels/functions at
seal: the name given to cuModuleGetFunction / cuLibraryGetKernel for a handle (uretprobes; a
cuKernelGetFunction handle inherits its kernel's name), else the ELF symbol of the host stub a
runtime launch passes (demangled).
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import (
    BpfHub,
    HubSource,
    attach_symbols,
    detach_symbols,
    dynamic_functions,
    elf_symbols,
    read_maps,
)
from gpuprof.collector.sources.base import Batch, SourceContext
from gpuprof.collector.sources.bpf_stacks import own_stack, stack_store
from gpuprof.collector.symbolize import StackStore, demangle

# symbol -> BPF program (the _ptsz forms take the same arguments)
LAUNCH_PROBES: dict[str, str] = {
    "cuLaunchKernel": "gp_cu_launch_kernel",
    "cuLaunchKernel_ptsz": "gp_cu_launch_kernel",
    "cuLaunchKernelEx": "gp_cu_launch_kernel_ex",
    "cuLaunchKernelEx_ptsz": "gp_cu_launch_kernel_ex",
    "cudaLaunchKernel": "gp_cuda_launch_kernel",
    "cudaLaunchKernel_ptsz": "gp_cuda_launch_kernel",
    "cudaLaunchKernelExC": "gp_cuda_launch_kernel_exc",
    "cudaLaunchKernelExC_ptsz": "gp_cuda_launch_kernel_exc",
}
LOOKUP_PROBES: dict[str, str] = {
    "cuModuleGetFunction": "gp_cu_module_get_function",
    "cuLibraryGetKernel": "gp_cu_library_get_kernel",
    "cuKernelGetFunction": "gp_cu_kernel_get_function",
}
SYSTEM_LIBRARIES = re.compile(r"^lib(cuda|cudart)\.so(\.\d+)*$")
KF_MODULE_GET_FUNCTION, KF_LIBRARY_GET_KERNEL, KF_KERNEL_GET_FUNCTION = 0, 1, 2
NAME_SOURCES = schema.KERNEL_FUNCTIONS.enums["source"]



class BpfKernelsSource(HubSource):
    """CUDA launch uprobes of the job's processes."""

    name = "kernels"
    attaches = True  # sees only what happens after it started (a late start is recorded)
    tables = (schema.KERNEL_LAUNCHES, schema.KERNEL_FUNCTIONS, schema.STACK_FRAMES, schema.STACK_SYMBOLS)
    interval_s = 0.2  # the 2 MiB launch ring holds about 0.2 s at 100,000 launches/s
    scan_interval_s = 1.0  # new libraries of job processes are looked for this often
    drops_map = b"gp_launch_drops"  # [0] launches ring full, [1] kernel functions ring full

    def __init__(self) -> None:
        self.store: StackStore | None = None
        self.attached: set[tuple[str, str]] = set()
        self.checked: set[str] = set()
        self._launches: list[tuple[Any, ...]] = []
        self._kfuncs: list[tuple[int, int, int, int, int, str]] = []
        self.names: dict[tuple[int, int], tuple[str, int]] = {}  # (pid, handle) -> (name, source)
        self.kernel_of: dict[tuple[int, int], int] = {}  # (pid, CUfunction) -> CUkernel
        self.functions: set[tuple[int, int]] = set()  # (pid, function) launched
        self.stub_names: dict[tuple[int, int], str] = {}
        self._last_scan_ns = 0

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        hub = self.take_hub(ctx, "kernels", "GP_WITH_KERNELS", "kernels")
        self.store = stack_store(hub, ctx)
        b = hub.bpf
        b[b"gp_launches"].open_ring_buffer(self._on_launch)
        b[b"gp_kfuncs"].open_ring_buffer(self._on_kfunc)
        self.stacks = b[b"gp_launch_stacks"]
        hub.set_pids(ctx.pids())
        from gpuprof.collector.sources.collective_calls import system_libraries

        for path in system_libraries(SYSTEM_LIBRARIES):
            self.attach_file(path)
        self._refresh(set(ctx.pids()))

    def _on_launch(self, _cpu: int, data: Any, _size: int) -> None:
        ev = self.hub.bpf[b"gp_launches"].event(data)  # type: ignore[union-attr]
        self._launches.append((ev.t_ns, ev.function, ev.stream, ev.pid, ev.tid, tuple(ev.grid), tuple(ev.block),
                               ev.shared_mem, ev.user_stack, ev.api, ev.ret_addr))

    def _on_kfunc(self, _cpu: int, data: Any, _size: int) -> None:
        ev = self.hub.bpf[b"gp_kfuncs"].event(data)  # type: ignore[union-attr]
        self._kfuncs.append((int(ev.pid), int(ev.kind), int(ev.handle), int(ev.parent), int(ev.ret),
                             bytes(ev.name).split(b"\0", 1)[0].decode(errors="replace")))

    def _refresh(self, pids: set[int]) -> None:
        """New job pids into the kernel's set; attach to every new object a job process maps."""
        assert self.hub is not None and self.store is not None
        self.hub.set_pids(pids)
        pids = pids | {k.value for k in self.hub.job_pids if os.path.isdir(f"/proc/{k.value}/task")}
        tgids = {p for p in pids if _is_tgid(p)}
        for pid in tgids:
            exe = _readlink(f"/proc/{pid}/exe")
            maps = read_maps(pid)
            if maps:
                self.store.update_maps(pid, maps)  # launch stacks may be read after the process exits
            for m in maps:
                if "x" not in m.perms or not m.path.startswith("/"):
                    continue
                path = m.path if os.path.exists(m.path) else f"/proc/{pid}/root{m.path}"
                if path in self.checked:
                    continue
                self.checked.add(path)
                self.attach_file(path, static=(m.path == exe))

    def attach_file(self, path: str, static: bool = False) -> list[str]:
        """Attach to the launch and lookup functions an ELF file defines (exported ones; static=True
        also reads .symtab: a statically linked cudart in an executable). Returns those attached."""
        assert self.hub is not None
        wanted = (*LAUNCH_PROBES, *LOOKUP_PROBES)
        have = set(dynamic_functions(path)) & set(wanted)
        if static:
            try:
                have |= {n for n in wanted if n in elf_symbols(path).by_name}
            except (OSError, ValueError):
                pass
        def attach(bpf: Any, name: bytes, sym: bytes) -> None:
            s = sym.decode()
            if s in LAUNCH_PROBES:
                bpf.attach_uprobe(name=name, sym=sym, fn_name=LAUNCH_PROBES[s].encode())
            else:
                bpf.attach_uprobe(name=name, sym=sym, fn_name=LOOKUP_PROBES[s].encode())
                bpf.attach_uretprobe(name=name, sym=sym, fn_name=b"gp_kf_return")

        return attach_symbols(self.hub, path, [s for s in wanted if s in have], self.attached, attach,
                              lambda msg: self.ctx.report_error(self.name, msg))

    def _drain(self) -> list[Batch]:
        assert self.hub is not None and self.store is not None
        with self.hub.ring_lock:
            self.hub.bpf.ring_buffer_consume()
            launches, kfuncs = self._launches, self._kfuncs
            self._launches, self._kfuncs = [], []
        for pid, kind, handle, parent, ret, name in kfuncs:
            if ret != 0:
                continue
            if kind == KF_KERNEL_GET_FUNCTION:
                self.kernel_of[(pid, handle)] = parent
            else:
                src = NAME_SOURCES.index("cuModuleGetFunction" if kind == KF_MODULE_GET_FUNCTION
                                         else "cuLibraryGetKernel")
                self.names[(pid, handle)] = (demangle(name), src)
        rows = schema.KERNEL_LAUNCHES.empty(len(launches))
        if not launches:
            return []
        ids = {ev[8] for ev in launches if ev[8] >= 0}
        frames: dict[int, list[int] | None] = {}
        for sid in ids:
            try:
                frames[sid] = list(self.stacks.walk(sid))
            except KeyError:
                frames[sid] = None
        self.store.new_drain()
        for i, (t, fn, stream, pid, tid, grid, block, shared, ustack, api, ret) in enumerate(launches):
            # at entry the probed function has no frame: the walk skips its caller, which is at SP
            walked = frames.get(ustack) if ustack >= 0 else None
            sid = (self.store.intern_user(pid, [walked[0], ret, *walked[1:]]) if walked and ret
                   else own_stack(self.store, ustack, frames, pid))
            rows[i] = (t, pid, tid, api, *grid, *block, shared, stream, fn, sid)
            key = (int(pid), int(fn))
            if key not in self.functions:
                self.functions.add(key)
                if api >= 2:  # runtime API: a host stub address, resolved now (the process may exit)
                    self.stub_names[key] = self._stub_name(*key)
        return [(schema.KERNEL_LAUNCHES, rows)]

    def _stub_name(self, pid: int, addr: int) -> str:
        assert self.store is not None
        where = self.store.module_frame_address(pid, addr)
        if where is None:
            return ""
        try:
            syms = elf_symbols(where[0])
        except (OSError, ValueError):
            return ""
        vaddr = syms.offset_to_vaddr(where[1])
        hit = syms.function_at(vaddr) if vaddr is not None else None
        return demangle(hit[0]) if hit and hit[1] == 0 else ""

    def function_rows(self) -> np.ndarray:
        """/kernels/functions: a name for every (pid, function) launched."""
        rows = schema.KERNEL_FUNCTIONS.empty(len(self.functions))
        for i, (pid, fn) in enumerate(sorted(self.functions)):
            name, src = self.names.get((pid, fn), ("", -1))
            if src < 0 and (pid, fn) in self.kernel_of:
                name, src = self.names.get((pid, self.kernel_of[(pid, fn)]), ("", -1))
            if src < 0 and self.stub_names.get((pid, fn)):
                name, src = self.stub_names[(pid, fn)], NAME_SOURCES.index("stub_symbol")
            if src < 0:
                src = NAME_SOURCES.index("unresolved")
            b = name.encode(errors="replace")
            rows[i] = (pid, fn, b if len(b) <= 200 else b[:197] + b"...", src)
        return rows

    def sample(self, now_ns: int) -> list[Batch]:
        if now_ns - self._last_scan_ns >= self.scan_interval_s * 1e9:
            self._last_scan_ns = now_ns
            self._refresh(set(self.ctx.pids()))
        return self._drain()

    def final(self, now_ns: int) -> list[Batch]:
        return self._drain()

    def detach(self, hub: BpfHub) -> None:
        def detach(bpf: Any, path: bytes, sym: bytes) -> None:
            if sym.decode() in LOOKUP_PROBES:
                bpf.detach_uretprobe(name=path, sym=sym)
            bpf.detach_uprobe(name=path, sym=sym)

        detach_symbols(hub, self.attached, detach)

    def at_seal(self, f: Any) -> None:
        path = schema.KERNEL_FUNCTIONS.path
        if path in f:
            rows = self.function_rows()
            ds = f[path]
            n = ds.shape[0]
            ds.resize((n + len(rows),))
            ds[n:] = rows
        if self.store is not None:
            self.store.write(f)


def _is_tgid(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1]) == pid
    except (OSError, ValueError):
        pass
    return False


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""

