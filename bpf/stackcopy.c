/* Stack copies for the user-space unwinder (issue 13, item 1; collector/native/unwind_dwarf.c):
 * at a CPU_CLOCK sample of a thread of a process in gp_copy_pids that was running in user mode,
 * the registers the call frame information needs (ip, sp, bp) and the top GP_COPY_BYTES of its
 * user stack go to user space in one ring-buffer record, where the stack is walked with the
 * CFI of each mapped file (code built without frame pointers). A first piece, compiled on its
 * own (not part of bpf/gpuprof.c yet): tests/test_bpf_stacks.py and tests/bench/bench_stacks.py.
 *
 * A sample taken in kernel mode (a system call: MPI's poll) takes the user registers saved at the
 * kernel entry (bpf_task_pt_regs); a stack shorter than the copy (near its top) is copied in
 * smaller pieces, down to 512 bytes.
 */
#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf_perf_event.h>

#ifndef GP_COPY_BYTES
#define GP_COPY_BYTES 8192
#endif

struct gp_stack_copy {
    u32 pid;
    u32 tid;
    u64 ip;
    u64 sp;
    u64 bp;
    u32 len; /* bytes of data valid, from sp up */
    u32 pad;
    u8 data[GP_COPY_BYTES];
};

BPF_HASH(gp_copy_pids, u32, u8, 1024);
BPF_RINGBUF_OUTPUT(gp_stack_copies, 1 << 10); /* pages: 4 MB, about 500 copies in flight */
/* [0] copied, [1] no user registers (a kernel thread's sample), [2] ring full, [3] stack not readable */
BPF_PERCPU_ARRAY(gp_copy_counters, u64, 4);

static __always_inline void gp_copy_count(int i)
{
    u64 *c = gp_copy_counters.lookup(&i);
    if (c)
        (*c)++;
}

int gp_copy_sample(struct bpf_perf_event_data *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!gp_copy_pids.lookup(&tgid))
        return 0;
    struct pt_regs user;
    if ((ctx->regs.cs & 3) == 3) {
        __builtin_memcpy(&user, &ctx->regs, sizeof(user));
    } else {
        /* in the kernel: the user registers saved at its entry */
        struct pt_regs *saved = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
        if (!saved || bpf_probe_read_kernel(&user, sizeof(user), saved) != 0 || (user.cs & 3) != 3) {
            gp_copy_count(1);
            return 0;
        }
    }
    struct pt_regs *regs = &user;
    struct gp_stack_copy *rec = gp_stack_copies.ringbuf_reserve(sizeof(struct gp_stack_copy));
    if (!rec) {
        gp_copy_count(2);
        return 0;
    }
    rec->pid = tgid;
    rec->tid = (u32)id;
    rec->ip = regs->ip;
    rec->sp = regs->sp;
    rec->bp = regs->bp;
    rec->pad = 0;
    void *sp = (void *)regs->sp;
    if (bpf_probe_read_user(rec->data, GP_COPY_BYTES, sp) == 0)
        rec->len = GP_COPY_BYTES;
    else if (bpf_probe_read_user(rec->data, 2048, sp) == 0)
        rec->len = 2048;
    else if (bpf_probe_read_user(rec->data, 512, sp) == 0)
        rec->len = 512;
    else {
        gp_copy_count(3);
        gp_stack_copies.ringbuf_discard(rec, 0);
        return 0;
    }
    gp_copy_count(0);
    gp_stack_copies.ringbuf_submit(rec, 0);
    return 0;
}
