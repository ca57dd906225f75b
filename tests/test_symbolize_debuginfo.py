"""Names of native frames on real programs built here (collector/debuginfo.py, collector/symbolize.py):
separate debug files by build id and debuglink, build-id mismatches refused, inlined frames from
DWARF, Fortran and C++ names, `[unknown MODULE+0xOFF]` for what nothing names, and files read as
root never through a symlink (a dead process's library swapped for one).

The resolver is driven directly (no Slurm, no BPF): addresses are computed from the ELF files
(their .symtab and DWARF, read with pyelftools), so the tests are fast and deterministic.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from gpuprof.collector import debuginfo, safeio, schema, symbolize
from gpuprof.collector.symbolize import Module, Resolver, StackStore, folded_stacks, is_unknown, stack_names

PROGS = Path(__file__).resolve().parent / "progs"

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("objcopy") is None,
                               reason="gcc and binutils needed (apt-get install build-essential)")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (apt-get install g++)")
needs_gfortran = pytest.mark.skipif(shutil.which("gfortran") is None, reason="gfortran not found (apt-get install gfortran)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="/proc/PID/map_files needs root (CAP_SYS_ADMIN)")


# --- helpers ----------------------------------------------------------------------------------------
def build(out: Path, compiler: str, sources: list[Path], *flags: str) -> Path:
    subprocess.run([compiler, *flags, "-o", str(out), *map(str, sources)], check=True, cwd=out.parent)
    return out


def lib_variant(tmp: Path, name: str, variant: int = 1) -> Path:
    return build(tmp / name, "gcc", [PROGS / "sym_lib.c"], "-O2", "-g", "-fPIC", "-shared",
                 f"-DSYMLIB_VARIANT={variant}")


def split_debug(lib: Path, debug_root: Path | None) -> tuple[Path, str]:
    """Split lib's debug info off (objcopy --only-keep-debug, strip, --add-gnu-debuglink); the
    debug file goes to debug_root/.build-id/xx/rest.debug (None: stays beside lib as lib.debug).
    Returns (the debug file, the build id)."""
    dbg = lib.with_name(lib.name + ".debug")
    subprocess.run(["objcopy", "--only-keep-debug", str(lib), str(dbg)], check=True)
    subprocess.run(["strip", "--strip-debug", "--strip-unneeded", str(lib)], check=True)
    subprocess.run(["objcopy", f"--add-gnu-debuglink={dbg}", str(lib)], check=True, cwd=lib.parent)
    bid = build_id(lib)
    if debug_root is None:
        return dbg, bid
    dest = debug_root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(dbg), dest)
    return dest, bid


def build_id(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        bid = debuginfo.read_elf_fd(fd, str(path)).build_id
    finally:
        os.close(fd)
    assert bid, f"{path}: no build id (the toolchain should add one: -Wl,--build-id)"
    return bid


def symbol_vaddr(path: Path, name: str) -> int:
    """Address of a symbol in the file's .symtab (read before stripping), with pyelftools."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        for sec in ELFFile(f).iter_sections():
            if sec["sh_type"] in ("SHT_SYMTAB", "SHT_DYNSYM"):
                for s in sec.iter_symbols():
                    if s.name == name and s["st_value"]:
                        return int(s["st_value"])
    raise AssertionError(f"{name} not in {path}")


def to_offset(path: Path, vaddr: int) -> int:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]:
                return vaddr - int(seg["p_vaddr"]) + int(seg["p_offset"])
    raise AssertionError(f"{vaddr:#x} in no PT_LOAD of {path}")


def resolve(path: Path, offset: int, roots: list[Path] | tuple[()] = (), **kw: object) -> list[str]:
    """Names of one frame of path at offset (innermost first), through a fresh Resolver."""
    mods = [Module("kernel", name="[kernel]"), Module("elf", str(path), 0, path.name)]
    r = Resolver(mods, debug_roots=[str(p) for p in roots], **kw)  # type: ignore[arg-type]
    try:
        return [n for n, _ in r.resolve_frames(1, offset)]
    finally:
        r.close()


def inlined_site(path: Path, inner: str, outer_inlined: str) -> int:
    """An address (low end of a range) of an inlined `inner` nested in an inlined `outer_inlined`,
    from the program's DWARF (pyelftools, walked here independently of the resolver)."""
    from elftools.elf.elffile import ELFFile

    def origin_name(die: object) -> str:
        d = die.get_DIE_from_attribute("DW_AT_abstract_origin")  # type: ignore[attr-defined]
        return d.attributes["DW_AT_name"].value.decode()

    with open(path, "rb") as f:
        dwarf = ELFFile(f).get_dwarf_info()
        for cu in dwarf.iter_CUs():
            for die in cu.iter_DIEs():
                if die.tag != "DW_TAG_inlined_subroutine" or origin_name(die) != inner:
                    continue
                parent = die.get_parent()
                if parent.tag != "DW_TAG_inlined_subroutine" or origin_name(parent) != outer_inlined:
                    continue
                if "DW_AT_low_pc" in die.attributes:
                    return int(die.attributes["DW_AT_low_pc"].value)
                rl = dwarf.range_lists().get_range_list_at_offset(die.attributes["DW_AT_ranges"].value, cu=cu)
                base = int(cu.get_top_DIE().attributes["DW_AT_low_pc"].value)
                for e in rl:
                    if hasattr(e, "base_address"):  # DW_RLE_base_address(x): later pairs are relative to it
                        base = int(e.base_address)
                    elif e.end_offset > e.begin_offset:
                        return int(e.begin_offset) + (0 if e.is_absolute else base)
    raise AssertionError(f"no {inner} inlined in {outer_inlined} in {path}")


# --- separate debug files -----------------------------------------------------------------------
@needs_gcc
def test_stripped_library_is_named_from_its_debug_file_by_build_id(tmp_path: Path) -> None:
    lib = lib_variant(tmp_path, "libsym.so")
    hidden = to_offset(lib, symbol_vaddr(lib, "symlib_hidden_work"))
    entry = to_offset(lib, symbol_vaddr(lib, "symlib_entry"))
    root = tmp_path / "debug"
    dbg, bid = split_debug(lib, root)
    assert dbg == root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    # the stripped file alone: the exported function by .dynsym, the static one unknown, by where it is
    assert resolve(lib, entry + 4) == ["symlib_entry"]
    assert resolve(lib, hidden + 4) == [f"[unknown libsym.so+{hidden:#x}]"]
    # with the debug root: the debug file's .symtab names it
    assert resolve(lib, hidden + 4, [root])[-1] == "symlib_hidden_work"
    assert resolve(lib, entry + 4, [root]) == ["symlib_entry"]


@needs_gcc
def test_debug_file_of_another_build_is_refused(tmp_path: Path) -> None:
    lib = lib_variant(tmp_path, "libsym.so", 1)
    hidden = to_offset(lib, symbol_vaddr(lib, "symlib_hidden_work"))
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = lib_variant(other_dir, "libsym.so", 2)
    root = tmp_path / "debug"
    _, bid = split_debug(lib, None)
    other_dbg, other_bid = split_debug(other, None)
    assert other_bid != bid
    # the other build's debug file put where this build's is looked for
    dest = root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    dest.parent.mkdir(parents=True)
    shutil.copy(other_dbg, dest)
    (tmp_path / "libsym.so.debug").unlink()  # no debuglink fallback beside it either
    mods = [Module("kernel", name="[kernel]"), Module("elf", str(lib), 0, lib.name)]
    r = Resolver(mods, debug_roots=[str(root)])
    try:
        assert [n for n, _ in r.resolve_frames(1, hidden + 4)] == [f"[unknown libsym.so+{hidden:#x}]"]
        assert any(f"build id {other_bid}, not {bid}" in why for why in r.debug.refused), r.debug.refused
    finally:
        r.close()


@needs_gcc
def test_debuglink_in_dot_debug_beside_the_file_and_no_symlink_there(tmp_path: Path) -> None:
    lib = lib_variant(tmp_path, "libsym.so")
    hidden = to_offset(lib, symbol_vaddr(lib, "symlib_hidden_work"))
    dbg, _ = split_debug(lib, None)
    (tmp_path / ".debug").mkdir()
    beside = tmp_path / ".debug" / dbg.name
    shutil.move(str(dbg), beside)
    assert resolve(lib, hidden + 4, [tmp_path / "no-such-root"])[-1] == "symlib_hidden_work"
    # the same file through a symlink (the job's user could point it anywhere): not followed
    real = tmp_path / "elsewhere.debug"
    shutil.move(str(beside), real)
    beside.symlink_to(real)
    mods = [Module("kernel", name="[kernel]"), Module("elf", str(lib), 0, lib.name)]
    r = Resolver(mods, debug_roots=[])
    try:
        assert r.resolve_frames(1, hidden + 4)[0][0].startswith("[unknown libsym.so+")
        assert any("symlink" in why for why in r.debug.refused), r.debug.refused
    finally:
        r.close()


@needs_gcc
def test_library_without_debug_info_anywhere_keeps_module_and_offset(tmp_path: Path) -> None:
    lib = lib_variant(tmp_path, "libsym.so")
    hidden = to_offset(lib, symbol_vaddr(lib, "symlib_hidden_work"))
    split_debug(lib, None)
    (tmp_path / "libsym.so.debug").unlink()
    # every address of the function gives the one name: the start of the function its CFI lists
    names = {resolve(lib, hidden + d)[0] for d in (0, 3, 9, 17)}
    assert names == {f"[unknown libsym.so+{hidden:#x}]"}
    assert is_unknown(names.pop()) and is_unknown("[unknown]") and not is_unknown("py::main (a.py:3)")


# --- inlined frames -----------------------------------------------------------------------------
@needs_gcc
def test_inlined_functions_are_frames_of_their_own(tmp_path: Path) -> None:
    prog = build(tmp_path / "sym_inline", "gcc", [PROGS / "sym_inline.c"], "-O2", "-g")
    site = inlined_site(prog, "leaf_step", "mid_step")
    off = to_offset(prog, site)
    assert resolve(prog, off) == ["leaf_step", "mid_step", "outer_loop"]
    # addr2line, where installed, says the same chain
    if shutil.which("addr2line"):
        out = subprocess.run(["addr2line", "-i", "-f", "-e", str(prog), hex(site)], capture_output=True, text=True,
                             check=True).stdout.split()
        assert out[0::2] == ["leaf_step", "mid_step", "outer_loop"], out
    # no budget for DWARF: the real function alone, still named
    assert resolve(prog, off, die_budget=0) == ["outer_loop"]
    # the same from a debug file by build id, the program stripped
    root = tmp_path / "debug"
    split_debug(prog, root)
    assert resolve(prog, off, [root]) == ["leaf_step", "mid_step", "outer_loop"]


@needs_gcc
def test_stack_table_writes_inlined_frames_as_rows_the_readers_use(tmp_path: Path) -> None:
    """A stack whose leaf is in inlined code is written as one row per frame (depths in order) and
    read back by stack_names / folded_stacks (what mpi_merge/flames.py and the reports use)."""
    prog = build(tmp_path / "sym_inline", "gcc", [PROGS / "sym_inline.c"], "-O2", "-g")
    off = to_offset(prog, inlined_site(prog, "leaf_step", "mid_step"))
    main = to_offset(prog, symbol_vaddr(prog, "main"))
    store = StackStore(debug_roots=())
    mod = store._module(Module("elf", str(prog), 0, prog.name))
    sid = store._intern(((mod, off), (mod, main + 8), (mod, 1 << 40)))  # the last one in no segment
    frames, symbols = store.symbol_tables()
    mine = frames[frames["stack_id"] == sid]
    assert list(mine["depth"]) == [0, 1, 2, 3, 4]
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("stacks")
        g.create_dataset("frames", data=frames)
        g.create_dataset("symbols", data=symbols)
        samples = schema.STACK_SAMPLES.empty(1)
        samples["user_stack"], samples["count"] = sid, 7
        g.create_dataset("samples", data=samples)
    with h5py.File(path, "r") as f:
        names = stack_names(f)[sid]
        folded = folded_stacks(f)
    assert names == ["leaf_step", "mid_step", "outer_loop", "main", f"[unknown sym_inline+{1 << 40:#x}]"]
    assert folded == {f"[unknown sym_inline+{1 << 40:#x}];main;outer_loop;mid_step;leaf_step": 7}


# --- names of languages -------------------------------------------------------------------------
def test_fortran_and_cpp_name_rules() -> None:
    assert debuginfo.fortran_name("__mymod_MOD_compute") == "mymod::compute"
    assert debuginfo.fortran_name("__my_mod_MOD_do_it") == "my_mod::do_it"
    assert debuginfo.fortran_name("compute_") is None and debuginfo.fortran_name("__MOD_x") is None
    assert symbolize.demangle("__physics_MOD_compute") == "physics::compute"
    assert symbolize.demangle("_ZN3geo3BoxIdLi3EE3sumEv") == "geo::Box<double, 3>::sum()"
    assert symbolize.demangle("memcpy") == "memcpy"


@needs_gfortran
def test_fortran_module_procedures_and_the_program(tmp_path: Path) -> None:
    prog = build(tmp_path / "sym_mod", "gfortran", [PROGS / "sym_mod.f90"], "-O1", "-g")
    compute = to_offset(prog, symbol_vaddr(prog, "__physics_MOD_compute"))
    main = to_offset(prog, symbol_vaddr(prog, "MAIN__"))
    assert resolve(prog, compute + 4) == ["physics::compute"]
    assert resolve(prog, main + 4) == ["program sym_prog"]
    # without DWARF the main program keeps gfortran's name
    subprocess.run(["strip", "--strip-debug", str(prog)], check=True)
    assert resolve(prog, main + 4) == ["MAIN__"]
    assert resolve(prog, compute + 4) == ["physics::compute"]


@needs_gxx
def test_cpp_templates_are_demangled(tmp_path: Path) -> None:
    prog = build(tmp_path / "sym_templates", "g++", [PROGS / "sym_templates.cpp"], "-O2", "-g")
    from elftools.elf.elffile import ELFFile

    with open(prog, "rb") as f:
        syms = {s.name: int(s["st_value"]) for s in ELFFile(f).get_section_by_name(".symtab").iter_symbols()}
    box = next(n for n in syms if n.startswith("_ZNK3geo3BoxIdLi3EE3sumEv"))
    twice = next(n for n in syms if n.startswith("_ZN3geo11apply_twiceIZ4mainEUldE_EEdT_d"))
    assert resolve(prog, to_offset(prog, syms[box]) + 2) == ["geo::Box<double, 3>::sum() const"]
    # GCC's specialised copies keep their clone suffix, as the demangler writes it
    assert resolve(prog, to_offset(prog, syms[twice]) + 2)[-1].startswith(
        "double geo::apply_twice<main::{lambda(double)#1}>(main::{lambda(double)#1}, double)")


# --- files read as root -------------------------------------------------------------------------
def _start_mapper(lib: Path) -> subprocess.Popen[str]:
    """A process that maps lib (dlopen) and waits."""
    code = ("import ctypes, sys; l = ctypes.CDLL(sys.argv[1]); l.symlib_entry(10); "
            "print('ready', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(lib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _lib_base(pid: int, lib: Path) -> int:
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == str(lib) and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    raise AssertionError(f"{lib} not mapped by {pid}")


@needs_gcc
@needs_root
@pytest.mark.parametrize("held", [True, False], ids=["held-since-first-sight", "by-path-at-seal"])
def test_dead_process_library_swapped_for_a_symlink_is_not_followed(tmp_path: Path, held: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's library, mapped by a process that then exits, is replaced by a symlink to a
    root-only ELF file whose functions have other names. Held since first sight: the names come
    from the object the process mapped. Not held: the path is refused (a symlink), the frames stay
    `[unknown libsym.so+0x...]`, and no name of the target appears."""
    lib = lib_variant(tmp_path, "libsym.so")
    entry_v = symbol_vaddr(lib, "symlib_entry")
    entry = to_offset(lib, entry_v)
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = build(secret_dir / "libsecret.so", "gcc", [PROGS / "sym_lib.c"], "-O2", "-fPIC", "-shared",
                   "-Dsymlib_entry=secret_entry", "-Dsymlib_hidden_work=secret_hidden")
    secret.chmod(0o600)
    if not held:
        monkeypatch.setattr(symbolize, "HELD_FILES_MAX", 0)
    store = StackStore(debug_roots=())
    p = _start_mapper(lib)
    try:
        store.watch([p.pid])
        sid = store.intern_user(p.pid, [_lib_base(p.pid, lib) + entry_v + 2])
        assert bool(store.held) == held
    finally:
        p.stdin.close()  # type: ignore[union-attr]
        p.send_signal(signal.SIGKILL)
        p.wait()
    lib.unlink()
    lib.symlink_to(secret)
    frames, symbols = store.symbol_tables()
    store.close()
    names = [s["name"].decode() for s in symbols]
    assert not any("secret" in n for n in names), names
    sym = int(frames[frames["stack_id"] == sid]["symbol_id"][0])
    name = symbols[symbols["symbol_id"] == sym]["name"][0].decode()
    if held:
        assert name == "symlib_entry"
    else:
        assert name == f"[unknown libsym.so+{entry + 2:#x}]"


@needs_gcc
def test_path_replaced_by_another_file_is_not_named_as_the_mapped_one(tmp_path: Path) -> None:
    """No descriptor held and the path now names another regular file (not the device and inode
    the process mapped): refused."""
    lib = lib_variant(tmp_path, "libsym.so")
    entry = to_offset(lib, symbol_vaddr(lib, "symlib_entry"))
    st = lib.stat()
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    mods = [Module("kernel", name="[kernel]"), Module("elf", str(lib), 0, lib.name, os.geteuid(), ident)]
    r = Resolver(mods)
    assert r.resolve_frames(1, entry + 2) == [("symlib_entry", "libsym.so")]
    r.close()
    shutil.copy(lib, tmp_path / "copy.so")
    os.replace(tmp_path / "copy.so", lib)  # same bytes, another inode
    r = Resolver(mods)
    assert r.resolve_frames(1, entry + 2) == [(f"[unknown libsym.so+{entry + 2:#x}]", "libsym.so")]
    assert "not the file the process mapped" in r.refused[1]
    r.close()


def test_no_symlinks_opener_refuses_a_symlinked_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "f").write_bytes(b"x")
    (tmp_path / "link").symlink_to(real)
    fd, _ = safeio.open_user_file(str(real / "f"), owners=None, max_bytes=10, no_symlinks=True)
    os.close(fd)
    with pytest.raises(safeio.UnsafeFile, match="symlink"):
        safeio.open_user_file(str(tmp_path / "link" / "f"), owners=None, max_bytes=10, no_symlinks=True)
    # the last component alone is what the plain opener checks: a directory link passes there
    fd, _ = safeio.open_user_file(str(tmp_path / "link" / "f"), owners=None, max_bytes=10)
    os.close(fd)


def test_kernel_frames_nothing_names_keep_no_address() -> None:
    """A kernel address is not written (the node file goes to the job's user: KASLR)."""
    r = Resolver([Module("kernel", name="[kernel]")])
    assert r.resolve_frames(0, 0x1234) == [("[unknown]", "[kernel]")]


@needs_gcc
@pytest.mark.skipif(shutil.which("xz") is None, reason="xz not found (apt-get install xz-utils)")
def test_mini_debuginfo_names_static_functions(tmp_path: Path) -> None:
    """A stripped library carrying .gnu_debugdata (an xz-compressed ELF with .symtab, as Fedora's
    MiniDebugInfo): its static functions are named without any debug file."""
    lib = lib_variant(tmp_path, "libsym.so")
    hidden = to_offset(lib, symbol_vaddr(lib, "symlib_hidden_work"))
    mini = tmp_path / "mini"
    subprocess.run(["objcopy", "--strip-debug", "--remove-section=.comment", str(lib), str(mini)], check=True)
    subprocess.run(["xz", "-k", str(mini)], check=True)
    subprocess.run(["strip", "--strip-all", str(lib)], check=True)
    assert resolve(lib, hidden + 4)[0].startswith("[unknown libsym.so+")
    subprocess.run(["objcopy", f"--add-section=.gnu_debugdata={mini}.xz", str(lib)], check=True)
    assert resolve(lib, hidden + 4) == ["symlib_hidden_work"]


@needs_gcc
def test_broken_files_give_unknown_frames_never_an_error(tmp_path: Path) -> None:
    """A library cut short, one with garbage after its ELF header, a FIFO and a directory at the
    path: each frame `[unknown NAME+0xOFF]`, the reason recorded, nothing raised or blocked."""
    lib = lib_variant(tmp_path, "libsym.so")
    data = lib.read_bytes()
    (tmp_path / "cut.so").write_bytes(data[: len(data) // 3])
    (tmp_path / "garbage.so").write_bytes(data[:64] + os.urandom(4096))
    os.mkfifo(tmp_path / "fifo.so")
    (tmp_path / "dir.so").mkdir()
    names = ["cut.so", "garbage.so", "fifo.so", "dir.so", "absent.so"]
    mods = [Module("kernel", name="[kernel]"), *(Module("elf", str(tmp_path / n), 0, n) for n in names)]
    r = Resolver(mods, debug_roots=[str(tmp_path)])
    try:
        for i, n in enumerate(names, start=1):
            got = r.resolve_frames(i, 0x1234)
            assert len(got) == 1 and got[0][0].startswith(f"[unknown {n}+0x"), (n, got)
        assert set(r.refused) >= {3, 4, 5}, r.refused  # the FIFO, the directory, the absent file
        assert "not a regular file" in r.refused[3]
    finally:
        r.close()


@needs_root
def test_store_holds_only_the_files_a_stack_goes_through() -> None:
    """This very process maps dozens of files: reading its maps holds none of them; a stack through
    the C library holds that file alone (a job maps far more than it runs)."""
    store = StackStore(debug_roots=())
    pid = os.getpid()
    store.watch([pid])
    assert not store.held and not store.held_refused
    import ctypes

    addr = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    assert addr is not None
    sid = store.intern_user(pid, [addr + 1])
    libc = store.modules[store.stacks[sid][0][0]]
    assert libc.kind == "elf" and "libc" in libc.name, libc
    assert set(store.held) == {libc.ident}, (store.held, store.held_refused)
    store.intern_user(pid, [addr + 2])  # the same file again: nothing more held
    assert set(store.held) == {libc.ident}
    store.close()


def test_store_names_a_live_process_through_its_held_descriptor() -> None:
    """This very process: its maps read, its python executable held through map_files (as root),
    one of its exported functions named from an address in it."""
    store = StackStore(debug_roots=())
    pid = os.getpid()
    store.watch([pid])
    import ctypes

    libc = ctypes.CDLL(None)
    addr = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    assert addr is not None
    sid = store.intern_user(pid, [addr + 1])
    frames, symbols = store.symbol_tables()
    sym = int(frames[frames["stack_id"] == sid]["symbol_id"][0])
    name = symbols[symbols["symbol_id"] == sym]["name"][0].decode()
    assert name in ("getpid", "__getpid"), name
    if os.geteuid() == 0:
        assert store.held, store.held_refused
    assert store.last_resolver_stats["frames"] >= 1
    store.close()
    assert not store.held
