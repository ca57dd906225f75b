/* A program that polls the clock, as an MPI progress loop or a training step's timer does: most of
 * its samples are taken in the vDSO's clock_gettime (tests/test_cfi_unwind.py).
 *
 *     main -> poll_a -> poll_clock -> clock_gettime (libc) -> the vDSO
 *
 * `vdso_loop SECONDS`: sleeps 0.3 s, polls for SECONDS, prints {"pid", "tids", "cpu_s"}.
 * Built -O2 -fomit-frame-pointer (native_progs.vdso_loop): the walk out of the vDSO needs its CFI.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static volatile long sink;

__attribute__((noinline, noclone)) double poll_clock(void)
{
    struct timespec ts;
    long s = 0;
    for (int i = 0; i < 1000; i++) {
        clock_gettime(CLOCK_MONOTONIC, &ts);
        s += ts.tv_nsec;
    }
    sink = s;
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

__attribute__((noinline, noclone)) double poll_a(void)
{
    double t = poll_clock();
    sink += (long)t;
    return t;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    usleep(300000);
    double end = poll_a() + seconds;
    while (poll_a() < end)
        ;
    struct timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"pid\": %d, \"tids\": [%d], \"cpu_s\": %.3f}\n", (int)getpid(), (int)getpid(),
           cpu.tv_sec + cpu.tv_nsec * 1e-9);
    return 0;
}
