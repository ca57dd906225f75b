/* CUDA kernel launches of the job's processes (mode `kernels`): entry uprobes on the driver's
 * cuLaunchKernel(Ex) and the runtime's cudaLaunchKernel(ExC) (and their _ptsz forms) in every
 * mapped object that defines them, attached by collector/sources/bpf_kernels.py. Each launch is one
 * gp_launch in the ring gp_launches with grid, block, shared memory, stream, the function (a
 * CUfunction, or the runtime's host stub address) and the user stack id at the launch.
 * Kernel names: the stub's ELF symbol (resolved by the collector at seal), or the name passed to
 * cuModuleGetFunction / cuLibraryGetKernel, linked to handles by cuKernelGetFunction (gp_kfuncs).
 *
 * Arguments (System V x86-64: 1..6 in registers, 7.. on the stack at SP+8, SP+16, ... at entry):
 *   cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sharedMemBytes, hStream, kernelParams, extra)
 *   cuLaunchKernelEx(const CUlaunchConfig *config, f, kernelParams, extra)
 *   cudaLaunchKernel(func, dim3 grid, dim3 block, args, size_t sharedMem, cudaStream_t stream):
 *     a 12-byte dim3 by value takes two registers (x | y << 32, then z): grid in 2-3, block in
 *     4-5, args in 6, sharedMem and stream in the first two stack slots
 *   cudaLaunchKernelExC(const cudaLaunchConfig_t *config, func, args)
 */
#include "gpuprof_events.h"

#ifndef GP_LAUNCH_PAGES
#define GP_LAUNCH_PAGES 512 /* 2 MiB: about 20,000 launches between two drains (0.2 s) */
#endif
#ifndef GP_LAUNCH_STACK_ENTRIES
#define GP_LAUNCH_STACK_ENTRIES 4096
#endif

/* CUlaunchConfig (driver) */
struct gp_cu_launch_config {
    u32 grid[3];
    u32 block[3];
    u32 shared_mem;
    u32 pad;
    u64 stream;
    u64 attrs;
    u32 num_attrs;
};

/* cudaLaunchConfig_t (runtime) */
struct gp_cuda_launch_config {
    u32 grid[3];
    u32 block[3];
    u64 shared_mem;
    u64 stream;
    u64 attrs;
    u32 num_attrs;
};

struct gp_kf_saved {
    u64 out;  /* where the call writes the handle */
    u64 name; /* const char * */
    u64 parent;
    u32 kind;
};

BPF_STACK_TRACE(gp_launch_stacks, GP_LAUNCH_STACK_ENTRIES);
BPF_RINGBUF_OUTPUT(gp_launches, GP_LAUNCH_PAGES);
BPF_RINGBUF_OUTPUT(gp_kfuncs, 16);
BPF_HASH(gp_kf_inflight, u64, struct gp_kf_saved, 4096);
BPF_PERCPU_ARRAY(gp_launch_drops, u64, 2); /* [0] launches ring full, [1] kfuncs ring full */

static __always_inline u64 gp_stack_arg(struct pt_regs *ctx, int slot)
{
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * slot));
    return v;
}

static __always_inline struct gp_launch *gp_launch_begin(struct pt_regs *ctx, u32 api)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!gp_in_job(tgid))
        return NULL;
    struct gp_launch *e = gp_launches.ringbuf_reserve(sizeof(struct gp_launch));
    if (!e) {
        int zero = 0;
        u64 *d = gp_launch_drops.lookup(&zero);
        if (d)
            (*d)++;
        return NULL;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->t_ns = bpf_ktime_get_ns();
    e->pid = tgid;
    e->tid = (u32)id;
    e->api = api;
    e->user_stack = gp_launch_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    e->ret_addr = gp_stack_arg(ctx, 0);
    return e;
}

int gp_cu_launch_kernel(struct pt_regs *ctx)
{
    struct gp_launch *e = gp_launch_begin(ctx, GP_API_CU_LAUNCH_KERNEL);
    if (!e)
        return 0;
    e->function = PT_REGS_PARM1(ctx);
    e->grid[0] = PT_REGS_PARM2(ctx);
    e->grid[1] = PT_REGS_PARM3(ctx);
    e->grid[2] = PT_REGS_PARM4(ctx);
    e->block[0] = PT_REGS_PARM5(ctx);
    e->block[1] = PT_REGS_PARM6(ctx);
    e->block[2] = gp_stack_arg(ctx, 1);
    e->shared_mem = gp_stack_arg(ctx, 2);
    e->stream = gp_stack_arg(ctx, 3);
    gp_launches.ringbuf_submit(e, 0);
    return 0;
}

/* cuLaunchKernelEx and cudaLaunchKernelExC pass a config struct; both name their fields alike. */
#define GP_LAUNCH_FROM_CONFIG(e, c)                                                                  \
    do {                                                                                             \
        (e)->grid[0] = (c).grid[0];                                                                  \
        (e)->grid[1] = (c).grid[1];                                                                  \
        (e)->grid[2] = (c).grid[2];                                                                  \
        (e)->block[0] = (c).block[0];                                                                \
        (e)->block[1] = (c).block[1];                                                                \
        (e)->block[2] = (c).block[2];                                                                \
        (e)->shared_mem = (c).shared_mem;                                                            \
        (e)->stream = (c).stream;                                                                    \
    } while (0)

int gp_cu_launch_kernel_ex(struct pt_regs *ctx)
{
    struct gp_launch *e = gp_launch_begin(ctx, GP_API_CU_LAUNCH_KERNEL_EX);
    if (!e)
        return 0;
    struct gp_cu_launch_config c = {};
    bpf_probe_read_user(&c, sizeof(c), (void *)PT_REGS_PARM1(ctx));
    e->function = PT_REGS_PARM2(ctx);
    GP_LAUNCH_FROM_CONFIG(e, c);
    gp_launches.ringbuf_submit(e, 0);
    return 0;
}

int gp_cuda_launch_kernel(struct pt_regs *ctx)
{
    struct gp_launch *e = gp_launch_begin(ctx, GP_API_CUDA_LAUNCH_KERNEL);
    if (!e)
        return 0;
    u64 gxy = PT_REGS_PARM2(ctx), bxy = PT_REGS_PARM4(ctx);
    e->function = PT_REGS_PARM1(ctx);
    e->grid[0] = (u32)gxy;
    e->grid[1] = gxy >> 32;
    e->grid[2] = PT_REGS_PARM3(ctx);
    e->block[0] = (u32)bxy;
    e->block[1] = bxy >> 32;
    e->block[2] = PT_REGS_PARM5(ctx);
    e->shared_mem = gp_stack_arg(ctx, 1);
    e->stream = gp_stack_arg(ctx, 2);
    gp_launches.ringbuf_submit(e, 0);
    return 0;
}

int gp_cuda_launch_kernel_exc(struct pt_regs *ctx)
{
    struct gp_launch *e = gp_launch_begin(ctx, GP_API_CUDA_LAUNCH_KERNEL_EXC);
    if (!e)
        return 0;
    struct gp_cuda_launch_config c = {};
    bpf_probe_read_user(&c, sizeof(c), (void *)PT_REGS_PARM1(ctx));
    e->function = PT_REGS_PARM2(ctx);
    GP_LAUNCH_FROM_CONFIG(e, c);
    gp_launches.ringbuf_submit(e, 0);
    return 0;
}

/* Handle lookups: the handle is written through an out-parameter, read at return. */
static __always_inline int gp_kf_enter(struct pt_regs *ctx, u32 kind, u64 name, u64 parent)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!gp_in_job(id >> 32))
        return 0;
    struct gp_kf_saved s = {};
    s.out = PT_REGS_PARM1(ctx);
    s.name = name;
    s.parent = parent;
    s.kind = kind;
    gp_kf_inflight.update(&id, &s);
    return 0;
}

int gp_cu_module_get_function(struct pt_regs *ctx)
{
    return gp_kf_enter(ctx, GP_KF_MODULE_GET_FUNCTION, PT_REGS_PARM3(ctx), PT_REGS_PARM2(ctx));
}

int gp_cu_library_get_kernel(struct pt_regs *ctx)
{
    return gp_kf_enter(ctx, GP_KF_LIBRARY_GET_KERNEL, PT_REGS_PARM3(ctx), PT_REGS_PARM2(ctx));
}

int gp_cu_kernel_get_function(struct pt_regs *ctx)
{
    return gp_kf_enter(ctx, GP_KF_KERNEL_GET_FUNCTION, 0, PT_REGS_PARM2(ctx));
}

int gp_kf_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gp_kf_saved *s = gp_kf_inflight.lookup(&id);
    if (!s)
        return 0;
    struct gp_kfunc *e = gp_kfuncs.ringbuf_reserve(sizeof(struct gp_kfunc));
    if (!e) {
        int one = 1;
        u64 *d = gp_launch_drops.lookup(&one);
        if (d)
            (*d)++;
        gp_kf_inflight.delete(&id);
        return 0;
    }
    e->t_ns = bpf_ktime_get_ns();
    e->pid = id >> 32;
    e->kind = s->kind;
    e->parent = s->parent;
    e->ret = PT_REGS_RC(ctx);
    e->pad = 0;
    e->handle = 0;
    bpf_probe_read_user(&e->handle, sizeof(e->handle), (void *)s->out);
    e->name[0] = 0;
    if (s->name)
        bpf_probe_read_user_str(e->name, sizeof(e->name), (void *)s->name);
    gp_kf_inflight.delete(&id);
    gp_kfuncs.ringbuf_submit(e, 0);
    return 0;
}
