"""The collector's BPF object (collector/bpf_object.py): compiled by BCC in a child process, then
held, read and attached with libbpf and perf events, with no BCC or LLVM in the collector."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

from harness import bpf_skip_reason

from gpuprof.collector.bpf_object import BpfError, BpfObject
from gpuprof.collector.symbolize import KernelSymbols, kernel_symbol

REPO = Path(__file__).resolve().parents[1]

PROBED_C = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) long probed(long x) { __asm__ volatile(""); return x * 2; }
int main(void) {
    char line[16];
    long sum = 0;
    while (fgets(line, sizeof(line), stdin)) {
        for (int i = 0; i < 5; i++) sum += probed(i + 40);
        printf("%ld\n", sum);
        fflush(stdout);
    }
    return 0;
}
"""

PROBE_PROG = r"""
#include <uapi/linux/ptrace.h>
struct ev { u32 pid; u64 arg; u64 ret; };
BPF_HASH(calls, u32, u64, 16);
BPF_ARRAY(flags, u32, 4);
BPF_PERCPU_ARRAY(per_cpu, u64, 1);
BPF_RINGBUF_OUTPUT(events, 4);
int on_entry(struct pt_regs *ctx) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    calls.increment(pid);
    int zero = 0;
    u64 *c = per_cpu.lookup(&zero);
    if (c) *c += 1;
    struct ev e = {.pid = pid, .arg = PT_REGS_PARM1(ctx)};
    events.ringbuf_output(&e, sizeof(e), 0);
    return 0;
}
int on_return(struct pt_regs *ctx) {
    struct ev e = {.pid = bpf_get_current_pid_tgid() >> 32, .arg = 0, .ret = PT_REGS_RC(ctx)};
    events.ringbuf_output(&e, sizeof(e), 0);
    return 0;
}
int refused(struct pt_regs *ctx) {
    return ((int *)ctx)[100000];  /* past pt_regs: the verifier refuses it */
}
"""


@pytest.fixture
def probed(tmp_path: Path) -> Path:
    src = tmp_path / "probed.c"
    src.write_text(PROBED_C)
    exe = tmp_path / "probed"
    subprocess.run(["cc", "-O1", "-o", str(exe), str(src)], check=True)
    return exe


@pytest.fixture
def skip_without_bpf() -> None:
    reason = bpf_skip_reason()
    if reason:
        pytest.skip(reason)


def test_the_collector_process_never_maps_bcc_or_llvm(skip_without_bpf: None) -> None:
    """The default modes' object is compiled (in a fresh interpreter, as the collector starts):
    every map, program and tracepoint arrives by descriptor, the compile child's cost is known,
    and neither libbcc nor LLVM is mapped into the process that holds the object."""
    script = textwrap.dedent("""
        import json, os
        from gpuprof.collector.bpf_support import BpfHub, defines_for_all
        hub = BpfHub.acquire(("stacks", "collectives"), defines_for_all, "cfi")
        maps = open("/proc/self/maps").read()
        out = {"mapped": sorted({l.split()[-1] for l in maps.splitlines()
                                 if any(n in l for n in ("libbcc", "libLLVM", "libclang"))}),
               "summary": hub.summary(), "attached": sorted(hub.bpf.attached_tracepoints),
               "maps": len(hub.bpf.tables),
               "peak_mb": int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024}
        # this process forks nothing more: the tracepoints add no child of it to the set
        hub.set_pids([os.getpid()])
        out["pid_set"] = [k.value for k in hub.bpf[b"gp_job_pids"].keys()] == [os.getpid()]
        hub.release()
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mapped"] == []
    compile_cost = out["summary"]["bpf_compile"]
    assert compile_cost["programs_not_loaded"] == []
    assert compile_cost["programs"] > 60  # every gp_enter_<symbol> uprobe, gp_return, the samplers
    assert compile_cost["cpu_s"] > 0.3 and compile_cost["peak_rss_mb"] > out["peak_mb"], (compile_cost, out)
    assert {"sched:sched_process_fork", "sched:sched_process_exit", "sched_switch"} <= set(out["attached"])
    assert out["maps"] > 20 and out["pid_set"]


def test_a_compile_error_is_named(skip_without_bpf: None) -> None:
    with pytest.raises(BpfError, match="undefined_thing"):
        BpfObject.compile("int f(struct pt_regs *ctx) { return undefined_thing; }", [])


def test_uprobes_tables_and_ring_buffers(skip_without_bpf: None, probed: Path) -> None:
    """A uprobe and a return probe at a function's file offset: each call counted in a hash, a
    per-CPU array and a ring buffer whose records decode as the program's struct; a program the
    verifier refused is named with its reason and the others work; after the detach, no more."""
    from gpuprof.collector.bpf_support import function_file_offset

    obj = BpfObject.compile(PROBE_PROG, [], symbol_offset=function_file_offset)
    proc = subprocess.Popen([str(probed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert "refused" in obj.program_errors
        with pytest.raises(BpfError, match="program refused did not load"):
            obj.attach_uprobe(name=str(probed).encode(), sym=b"probed", fn_name=b"refused")
        with pytest.raises(BpfError, match="no function nowhere"):
            obj.attach_uprobe(name=str(probed).encode(), sym=b"nowhere", fn_name=b"on_entry")
        obj.attach_uprobe(name=str(probed).encode(), sym=b"probed", fn_name=b"on_entry")
        obj.attach_uretprobe(name=str(probed).encode(), sym=b"probed", fn_name=b"on_return")
        got: list[tuple[int, int, int]] = []

        def on_event(_ctx: object, data: int, _size: int) -> None:
            ev = obj[b"events"].event(data)
            got.append((ev.pid, ev.arg, ev.ret))

        obj[b"events"].open_ring_buffer(on_event)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == str(sum(2 * (40 + i) for i in range(5)))
        obj.ring_buffer_consume()
        calls = obj[b"calls"]
        assert calls[calls.Key(proc.pid)].value == 5
        assert sum(obj[b"per_cpu"][obj[b"per_cpu"].Key(0)]) == 5
        assert sorted(a for p, a, r in got if r == 0) == [40, 41, 42, 43, 44]
        assert sorted(r for p, a, r in got if r) == [80, 82, 84, 86, 88]
        assert {p for p, _, _ in got} == {proc.pid}

        obj.detach_uprobe(name=str(probed).encode(), sym=b"probed")
        obj.detach_uretprobe(name=str(probed).encode(), sym=b"probed")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        proc.stdout.readline()
        assert calls[calls.Key(proc.pid)].value == 5
        with pytest.raises(BpfError, match="no probe on"):
            obj.detach_uprobe(name=str(probed).encode(), sym=b"probed")

        # the table interface the sources use
        del calls[calls.Key(proc.pid)]
        assert calls.get(calls.Key(proc.pid)) is None and len(calls) == 0
        with pytest.raises(KeyError):
            del calls[calls.Key(proc.pid)]
        flags = obj[b"flags"]
        flags[flags.Key(2)] = flags.Leaf(7)
        assert [v.value for v in flags.values()] == [0, 0, 7, 0]
        del flags[flags.Key(2)]  # an array's entry is zeroed, not removed
        assert flags[flags.Key(2)].value == 0 and len(flags) == 4
        calls[calls.Key(1)] = calls.Leaf(1)
        calls[calls.Key(2)] = calls.Leaf(2)
        assert sorted((k.value, v.value) for k, v in calls.items()) == [(1, 1), (2, 2)]
        calls.clear()
        assert calls.items() == []
    finally:
        proc.kill()
        proc.wait()
        obj.cleanup()


def test_a_ring_buffer_callback_error_is_raised_after_the_others_ran(skip_without_bpf: None, probed: Path) -> None:
    from gpuprof.collector.bpf_support import function_file_offset

    obj = BpfObject.compile(PROBE_PROG, [], symbol_offset=function_file_offset)
    proc = subprocess.Popen([str(probed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    seen = []

    def fails(_ctx: object, data: int, _size: int) -> None:
        seen.append(obj[b"events"].event(data).arg)
        raise ValueError("callback failed")

    try:
        obj.attach_uprobe(name=str(probed).encode(), sym=b"probed", fn_name=b"on_entry")
        obj[b"events"].open_ring_buffer(fails)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        proc.stdout.readline()
        with pytest.raises(ValueError, match="callback failed"):
            obj.ring_buffer_consume()
        assert sorted(seen) == [40, 41, 42, 43, 44]  # every record reached the callback
        obj.ring_buffer_consume()  # the error was raised once
    finally:
        proc.kill()
        proc.wait()
        obj.cleanup()


def test_cpu_clock_sampling_on_every_cpu(skip_without_bpf: None) -> None:
    prog = r"""
    BPF_HASH(samples, u32, u64, 64);
    int on_sample(struct bpf_perf_event_data *ctx) {
        u32 pid = bpf_get_current_pid_tgid() >> 32;
        if (pid == TGID) samples.increment(pid);
        return 0;
    }
    """
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    obj = BpfObject.compile(prog.replace("TGID", str(busy.pid)), [], program_types={"on_sample": "perf_event"})
    try:
        obj.attach_perf_event(ev_type=1, ev_config=0, fn_name=b"on_sample", sample_freq=199)  # software CPU clock
        time.sleep(1.0)
        obj.detach_perf_event(ev_type=1, ev_config=0)
        samples = obj[b"samples"]
        n = samples[samples.Key(busy.pid)].value
        assert 50 < n < 400, n  # ~199 a second while it ran
        time.sleep(0.3)
        assert samples[samples.Key(busy.pid)].value == n  # detached
    finally:
        busy.kill()
        busy.wait()
        obj.cleanup()


def test_kernel_symbols_from_kallsyms(tmp_path: Path) -> None:
    """The function an address is in: the last code symbol at or below it, modules' and the
    kernel's, in any order in the file; data symbols do not name code; all-zero addresses (read
    without root) name nothing."""
    f = tmp_path / "kallsyms"
    f.write_text("ffffffff81000000 T _stext\n"
                 "ffffffff81000100 t helper\n"
                 "ffffffff81000180 D some_data\n"
                 "ffffffffc0001000 t mod_fn\t[mymod]\n"
                 "ffffffff81000200 W weak_fn\n")
    k = KernelSymbols(str(f))
    assert k.name(0xFFFFFFFF81000000) == "_stext"
    assert k.name(0xFFFFFFFF81000181) == "helper"  # some_data is not code
    assert k.name(0xFFFFFFFF81000204) == "weak_fn"
    assert k.name(0xFFFFFFFFC0001010) == "mod_fn"
    assert k.name(0xFFFFFFFF80000000) is None
    f.write_text("0000000000000000 T _stext\n0000000000000000 t helper\n")
    assert KernelSymbols(str(f)).name(0xFFFFFFFF81000000) is None
    if os.geteuid() == 0:
        with open("/proc/kallsyms") as kallsyms:
            found = [line.split()[0] for line in kallsyms if line.split()[1:3] in (["T", "schedule"], ["t", "schedule"])]
        assert found and kernel_symbol(int(found[0], 16) + 4) == "schedule"


def test_percpu_values_are_one_per_possible_cpu(skip_without_bpf: None) -> None:
    obj = BpfObject.compile("BPF_PERCPU_ARRAY(c, u64, 2);", [])
    try:
        values = obj[b"c"][obj[b"c"].Key(1)]
        assert isinstance(values, list) and all(v == 0 for v in values)
        assert len(values) >= (os.cpu_count() or 1)  # possible CPUs, at least the online ones
        with pytest.raises(BpfError, match="per-CPU"):
            obj[b"c"][obj[b"c"].Key(0)] = ctypes.c_uint64(1)
    finally:
        obj.cleanup()


IMAGE_PROG = r"""
#include <uapi/linux/ptrace.h>
struct ev { u32 pid; u64 arg; u64 ret; };
BPF_HASH(forks, u32, u64, 64);
BPF_ARRAY(switches, u64, 1);
BPF_HASH(calls, u32, u64, 16);
BPF_PROG_ARRAY(jump, 4);
BPF_RINGBUF_OUTPUT(events, 4);
TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 parent = args->parent_pid;
    forks.increment(parent);
    return 0;
}
RAW_TRACEPOINT_PROBE(sched_switch) {
    int zero = 0;
    u64 *n = switches.lookup(&zero);
    if (n) __sync_fetch_and_add(n, 1);
    return 0;
}
int on_entry(struct pt_regs *ctx) {
    struct ev e = {.pid = bpf_get_current_pid_tgid() >> 32, .arg = PT_REGS_PARM1(ctx)};
    events.ringbuf_output(&e, sizeof(e), 0);
    jump.call(ctx, 1);
    return 0;
}
int counted(struct pt_regs *ctx) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    calls.increment(pid);
    return 0;
}
int refused(struct pt_regs *ctx) {
    return ((int *)ctx)[100000];
}
"""


def _image_object(images: object) -> BpfObject:
    from gpuprof.collector.bpf_support import function_file_offset

    return BpfObject.compile(IMAGE_PROG, ["-DIMAGE_TEST=1"], tail_calls=[("jump", 1, "counted")],
                             symbol_offset=function_file_offset, images=images)  # type: ignore[arg-type]


def _check_object(obj: BpfObject, probed: Path) -> None:
    """Every part of IMAGE_PROG works in obj: the tracepoint and raw tracepoint programs count into
    obj's own maps, the uprobe program's ring buffer records decode, its tail call runs."""
    assert "refused" in obj.program_errors and sorted(obj.programs) == ["counted", "on_entry"]
    assert sorted(obj.attached_tracepoints) == ["sched:sched_process_fork", "sched_switch"]
    obj.attach_uprobe(name=str(probed).encode(), sym=b"probed", fn_name=b"on_entry")
    got: list[int] = []
    obj[b"events"].open_ring_buffer(lambda _c, data, _s: got.append(obj[b"events"].event(data).arg))
    proc = subprocess.Popen([str(probed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        proc.stdout.readline()
        obj.ring_buffer_consume()
        assert sorted(got) == [40, 41, 42, 43, 44]
        calls = obj[b"calls"]
        assert calls[calls.Key(proc.pid)].value == 5  # through the tail call
    finally:
        proc.kill()
        proc.wait()
    forks = obj[b"forks"]
    assert forks[forks.Key(os.getpid())].value >= 1  # the probed process's fork
    assert obj[b"switches"][obj[b"switches"].Key(0)].value > 0


def test_an_object_is_loaded_again_from_its_image(skip_without_bpf: None, probed: Path, tmp_path: Path) -> None:
    """The first compile keeps the object's image; the second load of the same source on this
    kernel makes it from the image, with no compile child (no BCC, a few ms), and everything works
    as in the compiled one: maps of its own, programs with their tail call, tracepoints attached."""
    from gpuprof.collector.bpf_image import ImageCache

    images = ImageCache(tmp_path / "bpf-objects")
    first = _image_object(images)
    try:
        assert not first.cost.from_image and first.cost.peak_rss_mb > 50
        kept = list((tmp_path / "bpf-objects").glob("*.json"))
        assert len(kept) == 1 and kept[0].stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "bpf-objects").stat().st_mode & 0o777 == 0o700
    finally:
        first.cleanup()
    again = _image_object(images)
    try:
        assert again.cost.from_image and again.cost.peak_rss_mb == 0 and again.cost.wall_s < 1.0, again.cost
        assert images.errors == []
        _check_object(again, probed)
    finally:
        again.cleanup()
    # another source or other flags: another key, compiled
    other = BpfObject.compile(IMAGE_PROG, ["-DIMAGE_TEST=2"], images=images)
    other.cleanup()
    assert not other.cost.from_image and len(list((tmp_path / "bpf-objects").glob("*.json"))) == 2


def test_a_bad_image_is_named_and_the_object_compiled(skip_without_bpf: None, probed: Path, tmp_path: Path) -> None:
    """An image the kernel refuses (its instructions damaged), one that is not ours (a symlink),
    and a directory others may write: each said in the cache's errors, and the object compiled."""
    import json

    from gpuprof.collector.bpf_image import ImageCache

    d = tmp_path / "bpf-objects"
    images = ImageCache(d)
    _image_object(images).cleanup()
    [path] = d.glob("*.json")
    entry = json.loads(path.read_text())
    entry["image"]["programs"][0]["insns"] = "AAAAAAAAAAA="  # one instruction, opcode 0: not a program
    path.write_text(json.dumps(entry))
    obj = _image_object(images)
    try:
        assert not obj.cost.from_image
        assert any("did not load" in e and "compiling anew" in e for e in images.errors), images.errors
        _check_object(obj, probed)
    finally:
        obj.cleanup()
    assert json.loads(path.read_text())["image"]["programs"][0]["insns"] != "AAAAAAAAAAA="  # kept anew

    real = tmp_path / "elsewhere.json"
    path.rename(real)
    path.symlink_to(real)
    images = ImageCache(d)
    _image_object(images).cleanup()
    assert any("symlink" in e for e in images.errors), images.errors

    d.chmod(0o755)
    images = ImageCache(d)
    obj = _image_object(images)
    obj.cleanup()
    assert not obj.cost.from_image and any("mode 0700" in e for e in images.errors), images.errors


def test_kept_images_are_the_most_recently_used(tmp_path: Path) -> None:
    """Past KEEP_IMAGES, storing one removes the least recently used; an image read is used."""
    from gpuprof.collector.bpf_image import KEEP_IMAGES, ImageCache

    images = ImageCache(tmp_path / "bpf-objects")
    reply = {"maps": [], "programs": [], "program_errors": {}, "attached": [], "image": {"programs": []}}
    keys = [f"{i:064x}" for i in range(KEEP_IMAGES + 1)]
    for n, key in enumerate(keys[:KEEP_IMAGES]):
        images.store(key, reply)
        os.utime(images.path(key), ns=(n * 10**9, n * 10**9))  # stored one a second apart, long ago
    assert images.load(keys[0]) is not None
    images.store(keys[-1], reply)
    left = {p.stem for p in (tmp_path / "bpf-objects").glob("*.json")}
    assert len(left) == KEEP_IMAGES and keys[0] in left and keys[1] not in left and keys[-1] in left
    assert images.errors == []


def test_prepare_keeps_the_object_a_jobs_sources_load(skip_without_bpf: None, tmp_path: Path) -> None:
    """`gpuprof prepare` on a node (etc/gpuprof-prepare.service): the default modes' object compiled
    and its image kept, the CFI prewarm run to its end; run again, loaded from the image, the tables
    found; a job's BPF sources, acquiring the object for those modes with the same config, load it
    too (no compile on the node's first job), and `doctor`'s kept_image finds it.
    Metrics alone need no object; with collector.bpf_object_cache off nothing would be kept: exit 1."""
    from click.testing import CliRunner

    from gpuprof.collector import config as config_mod
    from gpuprof.collector.bpf_support import BpfHub, defines_of, images_dir_for, kept_image, stack_unwinder
    from gpuprof.collector.modes import DEFAULT_MODES
    from gpuprof.slurm_hooks.cli import cli

    cfg = tmp_path / "gpuprof.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{tmp_path / "state"}"\n')
    config = config_mod.load(str(cfg))
    assert kept_image(config, DEFAULT_MODES) == ""  # `gpuprof doctor`: not prepared
    first = CliRunner().invoke(cli, ["--config", str(cfg), "prepare", "--json"])
    assert first.exit_code == 0, first.output
    done = json.loads(first.output)
    assert done["state"] == "compiled and kept" and done["problems"] == [], done
    assert Path(done["image"]).is_file() and Path(done["image"]).parent == tmp_path / "state" / "bpf-objects"
    assert kept_image(config, DEFAULT_MODES) == done["image"]
    doctor = CliRunner().invoke(cli, ["--config", str(cfg), "doctor", "--json"])
    prepared = next(c for c in json.loads(doctor.stdout) if c["name"] == "bpf-object-prepared")
    assert prepared["ok"] and prepared["detail"] == done["image"], prepared
    # the prewarm ran to its end: the runtime libraries' tables are in the host's disk cache now
    assert done["cfi_prewarm"] == "done" and done["cfi_prewarm_files"] >= 2, done
    assert done["cfi_tables_compiled"] >= 1 and any((tmp_path / "state" / "cfi-tables").iterdir()), done
    again = CliRunner().invoke(cli, ["--config", str(cfg), "prepare"])
    assert again.exit_code == 0 and "kept already: loaded from its image" in again.output, again.output
    assert "0 tables compiled now" in again.output, again.output  # found on disk

    hub = BpfHub.acquire(DEFAULT_MODES, defines_of(config), stack_unwinder(config), images_dir_for(config))
    try:
        assert hub.bpf.cost.from_image and hub.bpf.image_key == Path(done["image"]).stem
    finally:
        hub.release()

    metrics = CliRunner().invoke(cli, ["--config", str(cfg), "prepare", "--modes", "metrics"])
    assert metrics.exit_code == 0 and "nothing to prepare" in metrics.output, metrics.output
    cfg.write_text(f'[paths]\nstate_dir = "{tmp_path / "state"}"\n[collector]\nbpf_object_cache = false\n')
    off = CliRunner().invoke(cli, ["--config", str(cfg), "prepare"])
    assert off.exit_code == 1 and "collector.bpf_object_cache is false" in off.output, off.output
