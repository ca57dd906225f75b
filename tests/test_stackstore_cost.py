"""The stack store's shortcuts (issue 11, collector cost): a process's maps are not read again for
addresses that lie outside every executable mapping (PROCMAP_QUERY says so), not parsed again when
their text did not change, and stacks are cached by address; every id and frame is the same as
without them (a fresh store, which reads the maps of the moment)."""

from __future__ import annotations

import ctypes
import os

import pytest

from gpuprof.collector import symbolize
from gpuprof.collector.symbolize import STACK_NONE, ProcmapQuery, StackStore

PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_PRIVATE, MAP_ANONYMOUS, MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000
PAGE = os.sysconf("SC_PAGE_SIZE")

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

PID = os.getpid()
CODE = ctypes.cast(libc.getpid, ctypes.c_void_p).value or 0  # an address in libc's text
GARBAGE = 0x74697728206C6C6E  # what a frame-pointer walk through code without them returns


def _mmap(addr: int, prot: int, flags: int = 0) -> int:
    p = libc.mmap(addr or None, PAGE, prot, MAP_PRIVATE | MAP_ANONYMOUS | flags, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(p)


def _frames(store: StackStore, sid: int) -> tuple[tuple[str, str, int], ...]:
    """A stack's frames as (module kind, module name, offset): comparable across stores."""
    return tuple((store.modules[m].kind, store.modules[m].name, off) for m, off in store.stacks[sid])


def _query_works() -> bool:
    return ProcmapQuery().executable(PID, CODE) is True


def test_procmap_query_tells_code_from_data() -> None:
    if not _query_works():
        pytest.skip("this kernel has no PROCMAP_QUERY (Linux 6.11): the store reads the maps again instead")
    q = ProcmapQuery()
    data = _mmap(0, PROT_READ | PROT_WRITE)
    try:
        assert q.executable(PID, CODE) is True
        assert q.executable(PID, data + 8) is False  # mapped, not executable
        assert q.executable(PID, GARBAGE) is False  # not an address at all
    finally:
        q.close()
        libc.munmap(data, PAGE)


def test_addresses_outside_do_not_read_the_maps_again() -> None:
    store = StackStore()
    store.watch([PID])
    reads = store.maps_reads
    stack = (CODE, GARBAGE, GARBAGE + 16, CODE + 1)
    ids = []
    for _ in range(3):  # three drains
        store.new_drain()
        ids.append(store.intern_user(PID, stack))
    assert len(set(ids)) == 1 and ids[0] != STACK_NONE
    kinds = [store.modules[m].kind for m, _ in store.stacks[ids[0]]]
    assert kinds == ["elf", "none", "none", "elf"]
    if _query_works():
        assert store.maps_reads == reads  # the kernel said: outside every executable mapping
    else:
        assert store.maps_reads == reads + 3  # once a drain, as before
    fresh = StackStore()
    fresh.watch([PID])
    assert _frames(fresh, fresh.intern_user(PID, stack)) == _frames(store, ids[0])


def test_maps_read_again_unchanged_are_not_parsed() -> None:
    store = StackStore()
    store.watch([PID])
    parses = store.maps_parses
    store._refreshed.clear()
    store._read_maps(PID)  # what a miss does where the kernel cannot be asked
    assert store.maps_reads >= 2 and store.maps_parses == parses


def test_a_mapping_made_later_is_found_and_the_cache_follows_it() -> None:
    """An address outside the maps at one drain and in a new executable mapping at the next (JIT
    code, a dlopen) is named from the new mapping, as a fresh store names it, though the stack
    was cached with it outside."""
    hole = _mmap(0, PROT_READ)
    libc.munmap(hole, PAGE)  # an address free now, at which a mapping is made below
    store = StackStore()
    store.watch([PID])
    stack = (CODE, hole + 64)
    store.new_drain()
    before = store.intern_user(PID, stack)
    assert [store.modules[m].kind for m, _ in store.stacks[before]] == ["elf", "none"]
    try:
        code = _mmap(hole, PROT_READ | PROT_EXEC, MAP_FIXED_NOREPLACE)
    except OSError:
        pytest.skip("the freed page was taken again before the test could map it")
    try:
        assert code == hole
        store.new_drain()
        after = store.intern_user(PID, stack)
        assert after != before
        assert [store.modules[m].kind for m, _ in store.stacks[after]] == ["elf", "perfmap"]
        fresh = StackStore()
        fresh.watch([PID])
        assert _frames(fresh, fresh.intern_user(PID, stack)) == _frames(store, after)
        store.new_drain()
        assert store.intern_user(PID, stack) == after  # cached again, now all inside
    finally:
        libc.munmap(code, PAGE)


def test_kernel_stacks_cached_by_address() -> None:
    store = StackStore()
    a = store.intern_kernel([0xFFFFFFFF81000010, 0xFFFFFFFF81000020])
    b = store.intern_kernel((0xFFFFFFFF81000010, 0xFFFFFFFF81000020))
    c = store.intern_kernel([0xFFFFFFFF81000010])
    assert a == b != c
    assert store.stacks[a] == ((0, 0xFFFFFFFF81000010), (0, 0xFFFFFFFF8100001F))


def test_ids_in_order_of_first_use_as_before() -> None:
    """Interleaved user and kernel stacks, repeated: ids are handed out in the order of first use."""
    store = StackStore()
    store.watch([PID])
    seq = [store.intern_user(PID, (CODE,)), store.intern_kernel((0xFFFFFFFF81000010,)),
           store.intern_user(PID, (CODE, GARBAGE)), store.intern_user(PID, (CODE,)),
           store.intern_kernel((0xFFFFFFFF81000010,))]
    assert seq == [1, 2, 3, 1, 2]


def count_mapping_searches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The addresses the stack store searches its mappings for (its bisect_right calls), from now on."""
    searches: list[int] = []
    real = symbolize.bisect.bisect_right

    class CountingBisect:
        @staticmethod
        def bisect_right(a: list[int], x: int) -> int:
            searches.append(x)
            return real(a, x)

    monkeypatch.setattr(symbolize, "bisect", CountingBisect)
    return searches


def test_a_new_stack_of_frames_seen_before_looks_no_address_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deep stack nearly always differs from the last as a whole, rarely frame by frame: a stack
    whose addresses all came in earlier stacks is interned from the frames cached by address,
    without a search of the mappings; its frames (return addresses stepped back into their call,
    the leaf exact) and id are those a fresh store gives, and a cache emptied for room is refilled."""
    searches = count_mapping_searches(monkeypatch)
    store = StackStore()
    store.watch([PID])
    a, b, c = CODE, CODE + 64, CODE + 128
    # return addresses step back into their call: (a, b + 1, c + 1) is at a, b and c
    stacks = [(a, b + 1, c + 1), (c, a + 1), (b, c + 1, a + 1, b + 1)]
    ids = [store.intern_user(PID, stacks[0])]
    assert len(searches) == 3  # each address once
    searches.clear()
    ids += [store.intern_user(PID, s) for s in stacks[1:]]
    assert not searches and len(set(ids)) == 3
    fresh = StackStore()
    fresh.watch([PID])
    for sid, stack in zip(ids, stacks):
        assert _frames(store, sid) == _frames(fresh, fresh.intern_user(PID, stack))
    monkeypatch.setattr(symbolize, "STACK_CACHE_MAX_ADDRS", 0)  # the next miss empties every cache
    store.intern_user(PID, (CODE + 256,))
    searches.clear()
    assert store.intern_user(PID, stacks[2]) == ids[2]  # looked up again, same id
    assert len(searches) == 4


def test_a_stack_whose_leaf_alone_is_new_looks_up_the_leaf_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next most usual stack: its callers' return addresses came before, its leaf (a sample
    lands on any instruction of a hot function) did not: one search of the mappings, for the leaf;
    the frames and id are those a fresh store gives, and the stack is cached whole."""
    searches = count_mapping_searches(monkeypatch)
    store = StackStore()
    store.watch([PID])
    a, b, c = CODE, CODE + 64, CODE + 128
    first = store.intern_user(PID, (a, b + 1, c + 1))
    searches.clear()
    stack = (a + 8, b + 1, c + 1)  # another instruction of the leaf's function, the same callers
    sid = store.intern_user(PID, stack)
    assert searches == [a + 8] and sid != first
    fresh = StackStore()
    fresh.watch([PID])
    assert _frames(store, sid) == _frames(fresh, fresh.intern_user(PID, stack))
    searches.clear()
    assert store.intern_user(PID, stack) == sid and not searches  # cached whole
    assert store.intern_user(PID, (a + 8, c + 1)) != sid and not searches  # the leaf cached by address too
    # a leaf outside every mapping takes the frame by frame path, as before
    outside = (GARBAGE, b + 1, c + 1)
    assert _frames(store, store.intern_user(PID, outside)) == _frames(fresh, fresh.intern_user(PID, outside))
