/* TEST DOUBLE: a profiler plugin that does nothing (every version's entry points return at once),
 * the baseline of tests/bench/bench_gpu_side.py's nccl_plugin_overhead: the test double of NCCL
 * (nccl_profiler_host.c) driving it costs what the double itself costs, which the bench subtracts. */
#include "../../bpf/fastpath/nccl_profiler_abi.h"

static int sentinel;
static ncclResult_t init1(void **c, int *m) { *c = &sentinel; *m = 0x47; return 0; }
static ncclResult_t init4(void **c, int *m, const char *n, uint64_t h, int nn, int nr, int r, ncclDebugLogger_t l)
{
    *c = &sentinel;
    *m = 0x47;
    return 0;
}
static ncclResult_t init5(void **c, uint64_t id, int *m, const char *n, int nn, int nr, int r, ncclDebugLogger_t l)
{
    *c = &sentinel;
    *m = 0x47;
    return 0;
}
static ncclResult_t start(void *c, void **h, void *d) { *h = &sentinel; return 0; }
static ncclResult_t stop(void *h) { return 0; }
static ncclResult_t record(void *h, int s, void *a) { return 0; }
static ncclResult_t fin(void *c) { return 0; }

__attribute__((visibility("default"))) gp_ncclProfiler_v1_t ncclProfiler_v3 = {"null", init1, start, stop, record, fin};
__attribute__((visibility("default"))) gp_ncclProfiler_v4_t ncclProfiler_v4 = {"null", init4, start, stop, record, fin};
__attribute__((visibility("default"))) gp_ncclProfiler_v5_t ncclProfiler_v6 = {"null", init5, start, stop, record, fin};
__attribute__((visibility("default"))) gp_ncclProfiler_v5_t ncclProfiler_v7 = {"null", init5, start, stop, record, fin};
