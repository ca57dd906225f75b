/* dlopen()s a library after its start (tests/test_cfi_unwind.py), everything -O2
 * -fomit-frame-pointer: `nofp_dlopen LIBRARY SECONDS` sleeps 1.5 s (the collector registers its
 * mappings without the library), opens LIBRARY and spins in main -> run_plugin -> plugin_work ->
 * plugin_leaf for SECONDS; prints {"pid", "tids", "cpu_s"}. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;
typedef unsigned long (*work_fn)(unsigned long);

__attribute__((noinline, noclone)) unsigned long run_plugin(work_fn f, unsigned long n)
{
    return f(n + 1) * 7 + n;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    usleep(1500000);
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    work_fn f = (work_fn)dlsym(h, "plugin_work");
    double end = now_s() + atof(argv[2]);
    unsigned long acc = 0;
    while (now_s() < end)
        acc += run_plugin(f, acc);
    sink = acc;
    struct timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"pid\": %d, \"tids\": [%d], \"cpu_s\": %.3f}\n", (int)getpid(), (int)getpid(),
           cpu.tv_sec + cpu.tv_nsec * 1e-9);
    return 0;
}
