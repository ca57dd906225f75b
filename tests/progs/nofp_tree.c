/* A C program with a known call tree, built without frame pointers (-O2 -fomit-frame-pointer) so
 * that the kernel's frame-pointer walk cannot unwind it and the CFI unwinder must
 * (tests/test_bpf_stacks.py, tests/bench/bench_stacks.py):
 *
 *     main -> level_a -> level_b -> level_c -> leaf_spin
 *
 * `nofp_tree SECONDS [sys]`: sleeps 0.3 s (the test reads its mappings after the exec), spins in
 * the tree for SECONDS (with `sys`, the leaf makes system calls, so that most samples are taken in
 * the kernel: MPI's poll), prints {"pid", "tids", "cpu_s"} on stdout. Every call is followed by work on
 * its result, so none is a tail call, and every function is noinline.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;
static int in_kernel;

__attribute__((noinline, noclone)) unsigned long leaf_spin(unsigned long n)
{
    unsigned long x = n;
    if (in_kernel) {
        for (int i = 0; i < 200; i++)
            x += (unsigned long)syscall(SYS_getppid);
    } else {
        for (int i = 0; i < 20000; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
    }
    sink = x;
    return x;
}

__attribute__((noinline, noclone)) unsigned long level_c(unsigned long n)
{
    unsigned long buf[8];
    for (int i = 0; i < 8; i++)
        buf[i] = n + (unsigned long)i; /* a frame of its own on the stack */
    return leaf_spin(buf[n & 7]) * 3 + buf[1];
}

__attribute__((noinline, noclone)) unsigned long level_b(unsigned long n)
{
    return level_c(n + 1) * 5 + n;
}

__attribute__((noinline, noclone)) unsigned long level_a(unsigned long n)
{
    return level_b(n + 2) * 7 + n;
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
    in_kernel = argc > 2 && strcmp(argv[2], "sys") == 0;
    usleep(300000);
    double end = now_s() + seconds;
    unsigned long acc = 0;
    while (now_s() < end)
        acc += level_a(acc);
    sink = acc;
    struct timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"pid\": %d, \"tids\": [%d], \"cpu_s\": %.3f}\n", (int)getpid(), (int)getpid(),
           cpu.tv_sec + cpu.tv_nsec * 1e-9);
    return 0;
}
