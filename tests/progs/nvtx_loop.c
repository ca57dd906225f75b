/* A tight NVTX push/pop loop for tests/bench/bench_gpu_side.py (nvtx_overhead): the same binary
 * is timed with and without NVTX_INJECTION64_PATH. Prints {"ranges": N, "ns": elapsed}.
 * Usage: nvtx_loop N */
#include <nvtx3/nvToolsExt.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 100000;
    nvtxRangePushA("warmup"); /* the first call loads (or not) the injection: outside the timing */
    nvtxRangePop();
    long long t0 = now_ns();
    for (long i = 0; i < n; i++) {
        nvtxRangePushA("iteration");
        nvtxRangePop();
    }
    long long t1 = now_ns();
    printf("{\"ranges\": %ld, \"ns\": %lld}\n", n, t1 - t0);
    return 0;
}
