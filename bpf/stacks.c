/* CPU stacks of the job's threads (mode `stacks`): a perf event at sources.stacks.rate_hz on every
 * CPU (CPU_CLOCK, attached by collector/sources/bpf_stacks.py) runs gp_cpu_sample, which counts one
 * sample per (window, pid, tid, cpu, user stack, kernel stack) in gp_cpu_counts. Nothing leaves the
 * kernel per sample: the collector flips gp_cpu_gen once per window and drains the other half.
 * Other processes' samples return at the first lookup (gp_in_job).
 * Threads of a Python process the collector registered (gp_py_procs) also get the id of their
 * Python stack (bpf/pyframes.h) in the key: user space merges it into the native user stack.
 * Processes the collector registered CFI tables for (bpf/cfiunwind.h) get their user stack walked by
 * those tables instead of the kernel's frame-pointer walk: the id of that pc list goes into the key
 * (cfi_stack) and the frame-pointer walk is skipped (user_stack = -EFAULT); when the walk fails at
 * the leaf (cfi_stack = 0) the sample keeps the frame-pointer stack. That part is compiled only
 * with GP_WITH_CFI (sources.stacks.unwinder = "cfi"): it doubles the compile and load time of the
 * object and its maps take ~20 MB of kernel memory; without it cfi_stack is always 0.
 */
#include <uapi/linux/bpf_perf_event.h>
#include <uapi/linux/ptrace.h>

#include "gpuprof_events.h"
#include "pyframes.h"
#ifdef GP_WITH_CFI
#include "cfiunwind.h"
#endif

#ifndef GP_CPU_STACK_ENTRIES
#define GP_CPU_STACK_ENTRIES 8192
#endif
#ifndef GP_CPU_COUNT_ENTRIES
#define GP_CPU_COUNT_ENTRIES 32768
#endif

BPF_STACK_TRACE(gp_cpu_stacks, GP_CPU_STACK_ENTRIES);
/* struct gp_stack_key, then the Python stack and the CFI stack (0: none); WindowedCounts reads
 * both alike */
struct gp_cpu_key {
    u32 gen;
    u32 pid;
    u32 tid;
    u32 cpu;
    s32 user_stack;
    s32 kernel_stack;
    u64 py_stack;
    u64 cfi_stack;
};

BPF_HASH(gp_cpu_counts, struct gp_cpu_key, u64, GP_CPU_COUNT_ENTRIES);
BPF_ARRAY(gp_cpu_gen, u32, 1);
BPF_PERCPU_ARRAY(gp_cpu_drops, u64, 2); /* [0] counts map full, [1] stack not stored (collision/full) */

#ifdef GP_WITH_CFI
/* The key of a sample whose CFI walk is in progress, per CPU (gp_cfi_cont finishes it) */
BPF_PERCPU_ARRAY(gp_cpu_pending, struct gp_cpu_key, 1);
/* [0]: gp_cfi_cont, loaded by the collector when it registers CFI tables */
BPF_PROG_ARRAY(gp_cfi_progs, 1);
#endif

static __always_inline void gp_cpu_count_key(struct gp_cpu_key *key)
{
    int zero = 0;
    if (key->user_stack == -EEXIST || key->user_stack == -ENOMEM || key->kernel_stack == -EEXIST
        || key->kernel_stack == -ENOMEM) {
        int one = 1;
        u64 *d = gp_cpu_drops.lookup(&one);
        if (d)
            (*d)++;
    }
    u64 init = 0;
    u64 *n = gp_cpu_counts.lookup_or_try_init(key, &init);
    if (n) {
        __sync_fetch_and_add(n, 1);
    } else {
        u64 *d = gp_cpu_drops.lookup(&zero);
        if (d)
            (*d)++;
    }
}

int gp_cpu_sample(struct bpf_perf_event_data *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (tgid == 0 || !gp_in_job(tgid))
        return 0;
    int zero = 0;
    u32 *gen = gp_cpu_gen.lookup(&zero);
    struct gp_cpu_key key = {};
    key.gen = gen ? *gen : 0;
    key.pid = tgid;
    key.tid = (u32)id;
    key.cpu = bpf_get_smp_processor_id();
    /* a sample in user mode has no kernel stack: -EFAULT, what get_stackid returns for it after
     * 1.6 us of looking (GROMACS, 9 samples in 10) */
    key.kernel_stack = (ctx->regs.cs & 3) == 3 ? -EFAULT : gp_cpu_stacks.get_stackid(ctx, 0);
    key.py_stack = gp_py_walk(tgid, key.tid, GP_IDS_CPU);
#ifdef GP_WITH_CFI
    if (gp_cfi_begin(ctx, tgid)) {
        struct gp_cpu_key *pending = gp_cpu_pending.lookup(&zero);
        if (pending) {
            __builtin_memcpy(pending, &key, sizeof(key));
            gp_cfi_progs.call(ctx, 0); /* does not return when gp_cfi_cont is loaded */
        }
    }
#endif
    key.user_stack = gp_cpu_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    gp_cpu_count_key(&key);
    return 0;
}

#ifdef GP_WITH_CFI
/* GP_CFI_STEPS frames of the sample's CFI walk; again by a tail call of itself until the walk is
 * over (at most GP_CFI_MAX_FRAMES / GP_CFI_STEPS programs: 16, under the kernel's 33), then the
 * sample is counted with its CFI stack (or its frame-pointer stack when its leaf is in no
 * registered mapping). */
int gp_cfi_cont(struct bpf_perf_event_data *ctx)
{
    int zero = 0;
    struct gp_cfi_state *s = gp_cfi_scratch_state.lookup(&zero);
    struct gp_cpu_key *pending = gp_cpu_pending.lookup(&zero);
    if (!s || !pending)
        return 0;
    if (!gp_cfi_steps(s))
        gp_cfi_progs.call(ctx, 0); /* a tail call fails past the kernel's limit: the walk is cut */
    struct gp_cpu_key key;
    __builtin_memcpy(&key, pending, sizeof(key));
    key.cfi_stack = gp_cfi_store(s);
    key.user_stack = key.cfi_stack ? -EFAULT : gp_cpu_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    gp_cpu_count_key(&key);
    return 0;
}
#endif
