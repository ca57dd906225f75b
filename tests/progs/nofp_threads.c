/* Three threads in a known tree, -O2 -fomit-frame-pointer (tests/test_cfi_unwind.py):
 * start_thread -> worker -> work_a -> work_b -> spin. `nofp_threads SECONDS` prints
 * {"pid", "tids", "cpu_s"}. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define NT 3
static volatile unsigned long sink;
static double seconds;
static int tids[NT];

__attribute__((noinline, noclone)) unsigned long spin(unsigned long x)
{
    for (int i = 0; i < 20000; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    sink = x;
    return x;
}

__attribute__((noinline, noclone)) unsigned long work_b(unsigned long n)
{
    unsigned long buf[5];
    for (int i = 0; i < 5; i++)
        buf[i] = n + (unsigned long)i;
    return spin(buf[n % 5]) + buf[3];
}

__attribute__((noinline, noclone)) unsigned long work_a(unsigned long n)
{
    return work_b(n + 3) * 11 + n;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

__attribute__((noinline)) void *worker(void *arg)
{
    tids[(long)arg] = (int)syscall(SYS_gettid);
    double end = now_s() + seconds;
    unsigned long acc = 0;
    while (now_s() < end)
        acc += work_a(acc);
    sink = acc;
    return 0;
}

int main(int argc, char **argv)
{
    seconds = argc > 1 ? atof(argv[1]) : 2.0;
    usleep(300000);
    pthread_t th[NT];
    for (long i = 0; i < NT; i++)
        pthread_create(&th[i], 0, worker, (void *)i);
    for (int i = 0; i < NT; i++)
        pthread_join(th[i], 0);
    struct timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"pid\": %d, \"tids\": [%d, %d, %d], \"cpu_s\": %.3f}\n", (int)getpid(), tids[0], tids[1], tids[2],
           cpu.tv_sec + cpu.tv_nsec * 1e-9);
    return 0;
}
