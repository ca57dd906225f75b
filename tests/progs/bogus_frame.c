/* A leaf in code without CFI whose rbp points at a made-up frame on the stack: its saved return
 * address is in no mapping. The CFI unwinder's frame-pointer rule (the only one for code without
 * CFI) then steps to a pc in no registered mapping, as it does through the vDSO or hand-written
 * assembly when rbp is not a frame pointer (tests/test_cfi_unwind.py: such a guess must not ask
 * the collector to read the process's mappings again at every sample).
 *
 * `bogus_frame SECONDS`: sleeps 0.3 s, spins for SECONDS, prints {"pid", "tids", "cpu_s"}.
 * Built without .eh_frame and without frame pointers (native_progs.bogus_frame).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* n iterations with rbp = frame (saved rbp, then the return address), rbp restored after */
__attribute__((noinline, noclone)) void spin_under(unsigned long *frame, unsigned long n)
{
    __asm__ volatile("push %%rbp\n\t"
                     "mov %1, %%rbp\n\t"
                     "1: dec %0\n\t"
                     "jnz 1b\n\t"
                     "pop %%rbp"
                     : "+r"(n)
                     : "r"(frame)
                     : "memory", "cc");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    /* on this stack, above the leaf's stack pointer, as a caller's frame would be: a saved rbp of
     * 0 and a return address in the first page, which nothing maps */
    volatile unsigned long frame[2] = {0, 0x10};
    usleep(300000);
    double end = now_s() + seconds;
    while (now_s() < end)
        spin_under((unsigned long *)frame, 20000000);
    struct timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"pid\": %d, \"tids\": [%d], \"cpu_s\": %.3f}\n", (int)getpid(), (int)getpid(),
           cpu.tv_sec + cpu.tv_nsec * 1e-9);
    return 0;
}
