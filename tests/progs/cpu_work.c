/* Test program of the stacks and off-CPU sources: known functions that burn CPU, sleep, compete
 * for one CPU, or run from JIT-like anonymous memory named in /tmp/perf-PID.map.
 *
 *   cpu_work hot THREADS SECONDS     THREADS threads spin in hot_function
 *   cpu_work sleepy SECONDS          one thread sleeps in sleepy_wait (nanosleep 5 ms at a time)
 *   cpu_work contend SECONDS         two threads spin in contend_spin, both pinned to CPU 0
 *   cpu_work yield SECONDS           two threads call sched_yield in a loop, both pinned to CPU 0
 *                                    (an MPI rank polling on a shared core: a switch per call)
 *   cpu_work jit SECONDS             one thread spins in anonymous code named jit_spin_loop
 *
 * Prints one JSON line at the end: {"pid": ..., "tids": [...], "cpu_s": ...} (the worker threads,
 * the process's CPU time), and at exit {"iterations": N} on stderr (hot mode: hot_function calls).
 * Built with -fno-omit-frame-pointer -mno-omit-leaf-frame-pointer so that
 * user stacks walk through every frame.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static volatile int stop_flag;
static volatile int never;
static double seconds;
static pid_t tids[64];
static unsigned long iterations[64]; /* hot_function calls per worker (work done, for benchmarks) */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Not a leaf (the call below never happens): GCC 12 keeps no frame pointer in leaf
 * functions even with -mno-omit-leaf-frame-pointer, which hides the leaf's caller from the unwinder. */
__attribute__((noinline)) unsigned long hot_function(unsigned long n)
{
    unsigned long x = n;
    for (unsigned long i = 0; i < 200000; i++) {
        x = x * 6364136223846793005UL + i;
        if (never)
            sched_yield();
    }
    return x;
}

__attribute__((noinline)) unsigned long contend_spin(unsigned long n)
{
    return hot_function(n);
}

/* nanosleep through an inline system call: glibc's wrapper keeps no frame pointer, which would
 * hide its caller (sleepy_wait) from the unwinder (docs/probes.md). */
__attribute__((noinline)) long raw_nanosleep(const struct timespec *ts)
{
    long ret;
    if (never) /* not a leaf: GCC 12 keeps no frame pointer in leaves (see hot_function) */
        sched_yield();
    __asm__ volatile("syscall" : "=a"(ret) : "0"((long)SYS_nanosleep), "D"(ts), "S"(0L) : "rcx", "r11", "memory");
    return ret;
}

__attribute__((noinline)) void sleepy_wait(void)
{
    struct timespec ts = {0, 5 * 1000 * 1000};
    raw_nanosleep(&ts);
}

static void *hot_thread(void *arg)
{
    tids[(long)arg] = (pid_t)syscall(SYS_gettid);
    unsigned long x = 1, n = 0;
    while (!stop_flag) {
        x += hot_function(x);
        n++;
    }
    iterations[(long)arg] = n;
    return (void *)x;
}

/* The calling thread, on CPU 0 only (threads that contend for one CPU) */
static void pin_to_cpu0(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(0, &set);
    sched_setaffinity(0, sizeof(set), &set);
}

static void *contend_thread(void *arg)
{
    tids[(long)arg] = (pid_t)syscall(SYS_gettid);
    pin_to_cpu0();
    unsigned long x = 1;
    while (!stop_flag)
        x += contend_spin(x);
    return (void *)x;
}

static void *yield_thread(void *arg)
{
    tids[(long)arg] = (pid_t)syscall(SYS_gettid);
    pin_to_cpu0();
    unsigned long n = 0;
    while (!stop_flag) {
        sched_yield();
        n++;
    }
    iterations[(long)arg] = n;
    return NULL;
}

static void *sleepy_thread(void *arg)
{
    tids[(long)arg] = (pid_t)syscall(SYS_gettid);
    while (!stop_flag)
        sleepy_wait();
    return NULL;
}

static void *jit_thread(void *arg)
{
    tids[(long)arg] = (pid_t)syscall(SYS_gettid);
    /* 'pause; jmp back' forever: code without a symbol table, named only by the perf map */
    unsigned char code[] = {0xf3, 0x90, 0xeb, 0xfc};
    unsigned char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    memcpy(p, code, sizeof(code));
    char path[64];
    snprintf(path, sizeof(path), "/tmp/perf-%d.map", (int)getpid());
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "%lx %zx jit_spin_loop\n", (unsigned long)p, sizeof(code));
        fclose(f);
    }
    ((void (*)(void))p)();
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: cpu_work hot|sleepy|contend|yield|jit [THREADS] SECONDS\n");
        return 2;
    }
    const char *mode = argv[1];
    int n = 1;
    void *(*fn)(void *) = NULL;
    if (!strcmp(mode, "hot")) {
        n = atoi(argv[2]);
        seconds = atof(argv[3]);
        fn = hot_thread;
    } else {
        seconds = atof(argv[2]);
        if (!strcmp(mode, "sleepy"))
            fn = sleepy_thread;
        else if (!strcmp(mode, "contend")) {
            n = 2;
            fn = contend_thread;
        } else if (!strcmp(mode, "yield")) {
            n = 2;
            fn = yield_thread;
        } else if (!strcmp(mode, "jit"))
            fn = jit_thread;
    }
    if (!fn || n < 1 || n > 64) {
        fprintf(stderr, "cpu_work: bad arguments\n");
        return 2;
    }
    pthread_t th[64];
    for (long i = 0; i < n; i++)
        pthread_create(&th[i], NULL, fn, (void *)i);
    double end = now_s() + seconds;
    while (now_s() < end)
        usleep(10000);
    printf("{\"pid\": %d, \"tids\": [", (int)getpid());
    for (int i = 0; i < n; i++)
        printf("%s%d", i ? ", " : "", (int)tids[i]);
    struct timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("], \"cpu_s\": %.3f}\n", cpu.tv_sec + cpu.tv_nsec * 1e-9);
    fflush(stdout);
    if (!strcmp(mode, "jit"))
        _exit(0); /* the JIT thread never returns; its perf map stays for symbolization */
    stop_flag = 1;
    unsigned long total = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        total += iterations[i];
    }
    fprintf(stderr, "{\"iterations\": %lu}\n", total);
    return 0;
}
