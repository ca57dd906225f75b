"""Builds the C test programs of the stacks, off-CPU and kernels tests into tests/progs/build/
(git-ignored) and reads their stack tables back; shared by those tests and tests/bench."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import h5py

from gpuprof.collector import schema

PROGS = Path(__file__).resolve().parent
BUILD = PROGS / "build"
# Frame pointers everywhere (leaves included) so that the BPF unwinder sees every frame.
CFLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]


def cc_skip_reason() -> str | None:
    return None if shutil.which("gcc") else "gcc not found (apt-get install build-essential)"


def _cc(out: Path, args: list[str], sources: list[Path]) -> Path:
    BUILD.mkdir(parents=True, exist_ok=True)
    if not out.exists() or any(s.stat().st_mtime > out.stat().st_mtime for s in sources):
        subprocess.run(["gcc", *CFLAGS, "-o", str(out), *map(str, sources), *args], check=True)
    return out


def cpu_work() -> Path:
    return _cc(BUILD / "cpu_work", ["-pthread"], [PROGS / "cpu_work.c"])


def fake_cuda() -> Path:
    """The CUDA launch TEST DOUBLE (a shared library)."""
    return _cc(BUILD / "libgpuprof_fake_cuda.so", ["-shared", "-fPIC"], [PROGS / "fake_cuda.c"])


def cuda_launches() -> Path:
    return _cc(BUILD / "cuda_launches", ["-ldl"], [PROGS / "cuda_launches.c"])


def cudart_library() -> Path | None:
    """libcudart.so.12 of the nvidia-cuda-runtime-cu12 wheel, when installed."""
    try:
        import nvidia.cuda_runtime as m  # type: ignore[import-untyped]
    except ImportError:
        return None
    for base in getattr(m, "__path__", []):
        p = Path(base) / "lib" / "libcudart.so.12"
        if p.exists():
            return p
    return None


def sealed_file(path: Path, sources: list[Any], batches: list[Any], modes: tuple[str, ...]) -> None:
    """A minimal file with the modes' tables, the batches appended and every source's at_seal."""
    tables = schema.tables_for_modes(modes)
    with h5py.File(path, "w") as f:
        for t in tables:
            f.create_dataset(t.path, shape=(0,), maxshape=(None,), dtype=t.dtype, chunks=True, compression="gzip")
        for table, rows in batches:
            ds = f[table.path]
            n = ds.shape[0]
            ds.resize((n + len(rows),))
            ds[n:] = rows
        for s in sources:
            s.at_seal(f)



def run_cpu_work_under(source: Any, tmp_path: Path, args: list[str], outsider: list[str] | None,
                       table: Any) -> tuple[Any, dict[str, Any], Any, list[str]]:
    """Run tests/progs/cpu_work ARGS as the job (and, when given, a second copy outside the job) under
    one eBPF source of mode `stacks`; returns the table's rows, the program's last JSON line, the
    sealed node file (open) and the errors the source reported."""
    import json

    from harness import GatedProcess, collect, make_ctx, run_source_over

    prog = str(cpu_work())
    gated = GatedProcess([prog, *args])
    other = GatedProcess([prog, *outsider]) if outsider else None
    errors: list[str] = []
    ctx = make_ctx(lambda: frozenset({gated.pid}), ("stacks",), errors=errors)
    if other:
        other.go()
    batches, (rc, out, err) = run_source_over(source, ctx, gated, poll_s=0.5)
    if other:
        other.wait()
    assert rc == 0, err
    path = tmp_path / "node.h5"
    sealed_file(path, [source], batches, ("stacks",))
    return collect(batches, table), json.loads(out.strip().splitlines()[-1]), h5py.File(path), errors


# --- programs built without frame pointers, for the CFI unwinder (tests/test_cfi_unwind.py) ---------
NOFP_CFLAGS = ["-O2", "-g", "-fomit-frame-pointer"]
NO_CFI_FLAGS = ["-fno-asynchronous-unwind-tables", "-fno-unwind-tables"]


def _build(compiler: str, out: Path, flags: list[str], sources: list[Path], libs: tuple[str, ...] = ()) -> Path:
    BUILD.mkdir(parents=True, exist_ok=True)
    if not out.exists() or any(s.stat().st_mtime > out.stat().st_mtime for s in sources):
        subprocess.run([compiler, *flags, "-o", str(out), *map(str, sources), *libs], check=True)
    return out


def nofp_cpp() -> Path:
    """C++ with templates and an exception, -O2 -fomit-frame-pointer."""
    return _build("g++", BUILD / "nofp_cpp", NOFP_CFLAGS, [PROGS / "nofp_cpp.cpp"])


def nofp_dlopen() -> tuple[Path, Path]:
    """(program, library it dlopen()s after its start), both without frame pointers."""
    lib = _build("gcc", BUILD / "libgpuprof_nofp_plugin.so", [*NOFP_CFLAGS, "-shared", "-fPIC"],
                 [PROGS / "nofp_plugin.c"])
    return _build("gcc", BUILD / "nofp_dlopen", NOFP_CFLAGS, [PROGS / "nofp_dlopen.c"], ("-ldl",)), lib


def nofp_threads() -> Path:
    return _build("gcc", BUILD / "nofp_threads", NOFP_CFLAGS, [PROGS / "nofp_threads.c"], ("-pthread",))


def fortran_skip_reason() -> str | None:
    return None if shutil.which("gfortran") else "gfortran not found (apt-get install gfortran)"


def nofp_fortran() -> Path:
    # -fno-inline: gfortran -O2 would inline the module's subroutines into MAIN__
    # -J: the module file (tree.mod) goes to the build folder, not the current directory
    BUILD.mkdir(parents=True, exist_ok=True)
    return _build("gfortran", BUILD / "nofp_fortran", [*NOFP_CFLAGS, "-fno-inline", "-J", str(BUILD)],
                  [PROGS / "nofp_tree.f90"])


def no_cfi_tree(frame_pointers: bool, debug_frame: bool = False) -> Path:
    """tests/progs/nofp_tree.c without .eh_frame of its own (-fno-asynchronous-unwind-tables
    -fno-unwind-tables), with or without frame pointers; debug_frame: with -g, whose .debug_frame
    is then the only CFI of its code."""
    fp = ["-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"] if frame_pointers else ["-fomit-frame-pointer"]
    name = f"no_cfi_tree_{'fp' if frame_pointers else 'nofp'}{'_debug_frame' if debug_frame else ''}"
    return _build("gcc", BUILD / name, ["-O2", *(["-g"] if debug_frame else []), *fp, *NO_CFI_FLAGS],
                  [PROGS / "nofp_tree.c"])


def bogus_frame() -> Path:
    """tests/progs/bogus_frame.c: a leaf without CFI under a made-up frame whose return address is
    in no mapping (no .eh_frame, no frame pointers)."""
    return _build("gcc", BUILD / "bogus_frame", ["-O2", "-fomit-frame-pointer", *NO_CFI_FLAGS],
                  [PROGS / "bogus_frame.c"])


def vdso_loop() -> Path:
    """tests/progs/vdso_loop.c (main -> poll_a -> poll_clock -> clock_gettime in the vDSO),
    -O2 -fomit-frame-pointer."""
    return _build("gcc", BUILD / "vdso_loop", NOFP_CFLAGS, [PROGS / "vdso_loop.c"])


def nofp_block(frame_pointers: bool = False) -> Path:
    """tests/progs/nofp_block.c (main -> block_a -> block_b -> block_c -> a blocking call),
    -O2 -fomit-frame-pointer, or -O2 with frame pointers (leaves included)."""
    fp = ["-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"] if frame_pointers else ["-fomit-frame-pointer"]
    return _build("gcc", BUILD / f"nofp_block_{'fp' if frame_pointers else 'nofp'}", ["-O2", "-g", *fp],
                  [PROGS / "nofp_block.c"], ("-pthread",))


def warm_cfi_tables(state: Path, patterns: tuple[str, ...], extra: tuple[str, ...] = ()) -> Path:
    """The CFI tables of the system libraries matching patterns (under /lib/x86_64-linux-gnu) and of
    the files in extra, compiled into state's disk cache (what a node's prewarm does at the
    collector's start), so that a test walks by CFI from the first drain instead of waiting for a
    cold compile (libc about 0.6 s of CPU, python3.11 about 2 s). Returns state."""
    from gpuprof.collector import cfitables as ct

    cache = ct.TableCache(1 << 20, str(state / "cfi-tables"), 64 << 20)
    paths = [p for pat in patterns for p in glob.glob(f"/lib/x86_64-linux-gnu/{pat}")]
    for path in [*paths, *extra]:
        fd = os.open(path, os.O_RDONLY)
        try:
            cache.get(fd, os.fstat(fd))
        except ct.NoTable:
            pass
        finally:
            os.close(fd)
    return state
