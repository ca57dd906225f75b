/* A user-space unwinder over a copy of a thread's stack (issue 13, item 1, design "copy of the top
 * of the user stack plus registers", as `perf --call-graph dwarf` does): the BPF program
 * (bpf/stackcopy.c) copies the registers the CFI needs (ip, sp, bp) and the top of the user stack
 * at a sample; this library walks it with the call frame information of each mapped file
 * (.eh_frame, or .debug_frame of a separate debug file) through elfutils' libdwfl.
 *
 * One gp_unwinder per process: libdwfl keeps each mapped file's ELF and CFI for the life of the
 * Dwfl, so a file's tables are parsed once per process (not once per sample). gp_unwinder_refresh
 * re-reads the process's mappings (a dlopen after start). The stack copy is the only memory read:
 * a saved register or return address outside it ends the walk there.
 *
 * Built by `make -C collector/native unwind` (needs libdw-dev); loaded with ctypes by
 * collector/symbolize.py (DwarfUnwinder).
 */
#define _GNU_SOURCE
#include <elfutils/libdwfl.h>
#include <dwarf.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#define GP_EXPORT __attribute__((visibility("default")))

/* DWARF register numbers of x86-64 (System V psABI): rbp 6, rsp 7. */
#define DW_X86_64_RBP 6
#define DW_X86_64_RSP 7

struct gp_unwinder {
    Dwfl *dwfl;
    pid_t pid;
    /* the sample being walked */
    uint64_t ip, sp, bp;
    const uint8_t *stack;
    uint64_t stack_base;
    size_t stack_len;
    uint64_t *out;
    int max, n;
};

static char *gp_debuginfo_path = NULL;

static const Dwfl_Callbacks gp_proc_callbacks = {
    .find_elf = dwfl_linux_proc_find_elf,
    .find_debuginfo = dwfl_standard_find_debuginfo,
    .debuginfo_path = &gp_debuginfo_path,
};

static pid_t gp_next_thread(Dwfl *dwfl, void *arg, void **thread_argp)
{
    (void)dwfl;
    struct gp_unwinder *u = arg;
    if (*thread_argp != NULL)
        return 0;
    *thread_argp = arg;
    return u->pid;
}

static bool gp_get_thread(Dwfl *dwfl, pid_t tid, void *arg, void **thread_argp)
{
    (void)dwfl;
    (void)tid;
    *thread_argp = arg;
    return true;
}

static bool gp_memory_read(Dwfl *dwfl, Dwarf_Addr addr, Dwarf_Word *result, void *arg)
{
    (void)dwfl;
    struct gp_unwinder *u = arg;
    if (addr < u->stack_base || addr - u->stack_base + sizeof(Dwarf_Word) > u->stack_len)
        return false; /* outside the copy: the walk stops at this frame */
    memcpy(result, u->stack + (addr - u->stack_base), sizeof(Dwarf_Word));
    return true;
}

static bool gp_set_initial_registers(Dwfl_Thread *thread, void *arg)
{
    struct gp_unwinder *u = arg;
    Dwarf_Word bp = u->bp, sp = u->sp;
    /* only rbp and rsp: the CFA of x86-64 code is rsp- or rbp-relative; a frame whose rule needs
     * another callee-saved register the copy lacks ends the walk */
    if (!dwfl_thread_state_registers(thread, DW_X86_64_RBP, 1, &bp)
        || !dwfl_thread_state_registers(thread, DW_X86_64_RSP, 1, &sp))
        return false;
    dwfl_thread_state_register_pc(thread, u->ip);
    return true;
}

static const Dwfl_Thread_Callbacks gp_thread_callbacks = {
    .next_thread = gp_next_thread,
    .get_thread = gp_get_thread,
    .memory_read = gp_memory_read,
    .set_initial_registers = gp_set_initial_registers,
};

static int gp_frame(Dwfl_Frame *state, void *arg)
{
    struct gp_unwinder *u = arg;
    Dwarf_Addr pc;
    bool activation;
    if (u->n >= u->max || !dwfl_frame_pc(state, &pc, &activation))
        return DWARF_CB_ABORT;
    u->out[u->n++] = pc;
    return DWARF_CB_OK;
}

static int gp_report(struct gp_unwinder *u)
{
    dwfl_report_begin(u->dwfl);
    int rc = dwfl_linux_proc_report(u->dwfl, u->pid);
    if (dwfl_report_end(u->dwfl, NULL, NULL) != 0 || rc != 0)
        return -1;
    return 0;
}

/* An unwinder for process pid (its mappings read now), or NULL. */
GP_EXPORT struct gp_unwinder *gp_unwinder_new(int pid)
{
    struct gp_unwinder *u = calloc(1, sizeof(*u));
    if (!u)
        return NULL;
    u->pid = pid;
    u->dwfl = dwfl_begin(&gp_proc_callbacks);
    if (!u->dwfl || gp_report(u) != 0 || !dwfl_attach_state(u->dwfl, NULL, pid, &gp_thread_callbacks, u)) {
        if (u->dwfl)
            dwfl_end(u->dwfl);
        free(u);
        return NULL;
    }
    return u;
}

/* Read the process's mappings again (a library mapped since). 0 on success. */
GP_EXPORT int gp_unwinder_refresh(struct gp_unwinder *u)
{
    return gp_report(u);
}

/* Walk one sample: registers, the stack copy starting at address stack_base (= sp at the
 * sample). Writes up to max program counters, innermost first (the leaf exact, the others
 * return addresses); returns how many. */
GP_EXPORT int gp_unwind(struct gp_unwinder *u, uint64_t ip, uint64_t sp, uint64_t bp, const uint8_t *stack,
                        uint64_t stack_base, size_t stack_len, uint64_t *out, int max)
{
    u->ip = ip;
    u->sp = sp;
    u->bp = bp;
    u->stack = stack;
    u->stack_base = stack_base;
    u->stack_len = stack_len;
    u->out = out;
    u->max = max;
    u->n = 0;
    dwfl_getthread_frames(u->dwfl, u->pid, gp_frame, u);
    return u->n;
}

GP_EXPORT void gp_unwinder_free(struct gp_unwinder *u)
{
    if (!u)
        return;
    dwfl_end(u->dwfl);
    free(u);
}
