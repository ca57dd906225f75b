/* A C job annotated with NVTX v3 (header-only: NVIDIA's headers from the nvidia-nvtx-cu12 wheel),
 * for tests/test_nvtx.py: nested push/pop ranges on two threads, start/end ranges ended on
 * another thread, a created domain with a registered string and categories, wide strings, a huge
 * string and one with markup, and a range left open at exit. It does not know about gpuprof:
 * NVTX_INJECTION64_PATH alone decides whether anything is recorded.
 * Usage: nvtx_job <iterations> [linger_ms]   (linger: stay alive that long at the end, so the
 *        collector's process tracker, which scans once a second, sees a process this short)
 */
#include <nvtx3/nvToolsExt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <wchar.h>

static void spin_us(long us)
{
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do
        clock_gettime(CLOCK_MONOTONIC, &b);
    while ((b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000 < us);
}

static nvtxRangeId_t handed_over;

static void *worker(void *arg)
{
    int n = *(int *)arg;
    for (int i = 0; i < n; i++) {
        nvtxRangePushA("worker_step");
        spin_us(50);
        nvtxRangePop();
    }
    nvtxRangeEnd(handed_over); /* started on the main thread */
    return NULL;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 10;
    nvtxDomainHandle_t dom = nvtxDomainCreateA("training");
    nvtxStringHandle_t fwd = nvtxDomainRegisterStringA(dom, "forward");
    nvtxEventAttributes_t a = {0};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.colorType = NVTX_COLOR_ARGB;
    a.color = 0xFF00FF00u;
    a.category = 7;
    a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    a.message.registered = fwd;

    handed_over = nvtxRangeStartA("handed_over");
    pthread_t t;
    pthread_create(&t, NULL, worker, &n);
    for (int i = 0; i < n; i++) {
        nvtxRangePushA("step");
        nvtxDomainRangePushEx(dom, &a);
        spin_us(100);
        nvtxDomainRangePop(dom);
        nvtxRangePushW(L"backward \u00e9\u4e2d");
        spin_us(200);
        nvtxRangePop();
        nvtxRangePop();
    }
    pthread_join(t, NULL);

    char huge[5000];
    memset(huge, 'x', sizeof(huge) - 1);
    huge[sizeof(huge) - 1] = 0;
    nvtxRangePushA(huge);
    nvtxRangePop();
    nvtxRangePushA("<b>markup</b> & \"quotes\" ' \\n %s %n \x1b[31mred");
    nvtxRangePop();
    for (int d = 0; d < 70; d++) /* deeper than the injection records (64): the rest is counted */
        nvtxRangePushA("deep");
    for (int d = 0; d < 70; d++)
        nvtxRangePop();
    nvtxRangeId_t id = nvtxRangeStartA("start_end");
    spin_us(30);
    nvtxRangeEnd(id);
    nvtxRangePushA("left_open_at_exit");
    if (argc > 2)
        spin_us(atol(argv[2]) * 1000L);
    printf("done %d\n", n);
    return 0;
}
