/* Shared by every gpuprof BPF program: which processes belong to the job.
 *
 * The collector adds the job's pids (from its process tracker) to gp_job_pids; the fork tracepoint
 * adds every child of a job process at once, so a rank forked by mpirun is covered before the
 * collector's next process scan. Probes look the current tgid up here and do nothing for other
 * processes: no event, no map entry, no user memory read.
 */
#ifndef GPUPROF_COMMON_H
#define GPUPROF_COMMON_H

#include <uapi/linux/ptrace.h>

BPF_HASH(gp_job_pids, u32, u8, 65536);

static __always_inline int gp_in_job(u32 tgid)
{
    return gp_job_pids.lookup(&tgid) != NULL;
}

/* Id seeds of the stack records user space interns by id: the CFI walks' pc lists (gp_cfi_stacks)
 * and the Python stacks (gp_py_stacks) are keyed by a 64-bit FNV hash of their content, in maps the
 * CPU sampler (bpf/stacks.c) and off-CPU (bpf/offcpu.c) share. Each source's drain frees the ids
 * its finished window used, unless its own in-flight state still needs them: the seed in the
 * hash's start gives the same content a different id per source, so that one source's drain
 * never frees a record the other one still has to read. */
#define GP_IDS_CPU 0
#define GP_IDS_OFFCPU 1

static __always_inline u64 gp_ids_hash_start(u32 tgid, u32 ids)
{
    /* tgid < 2^22 (PID_MAX_LIMIT): the seed's bits never overlap it; every later step of the hash
     * (xor a word, multiply by an odd prime) is a bijection, so equal content gives unequal ids */
    return (0xcbf29ce484222325ULL ^ tgid) ^ ((u64)ids << 32);
}

/* Runs in the parent's context: child_pid is a new process or a new thread of a job process.
 * A thread's tid in the set is harmless (it is never a tgid of another process while alive). */
TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!gp_in_job(parent))
        return 0;
    u32 child = args->child_pid;
    u8 one = 1;
    gp_job_pids.update(&child, &one);
    return 0;
}

/* Keep the set bounded in jobs that create many threads: forget a task when it exits. The
 * collector re-adds live pids from its process tracker at every sample. */
TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (tid != tgid)
        gp_job_pids.delete(&tid);
    return 0;
}

#endif
