/* TEST DOUBLE of the CUDA driver's side of tool injection: loads the library CUDA_INJECTION64_PATH
 * names and calls its InitializeInjection() as cuInit does, then "runs" kernels by handing their
 * activity to the CUPTI double (cupti_activity_double.c, the library GPUPROF_CUPTI_LIBRARY names:
 * the same dlopen handle the injection got). Prints what it ran as JSON lines ("truth") for
 * tests/test_cupti.py. No GPU, not CUDA: nothing here is a measurement.
 * Usage: cuda_driver_double N_KERNELS
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 10;
    const char *inj = getenv("CUDA_INJECTION64_PATH");
    void *lib = inj ? dlopen(inj, RTLD_NOW | RTLD_LOCAL) : NULL;
    int (*init)(void) = lib ? (int (*)(void))dlsym(lib, "InitializeInjection") : NULL;
    int loaded = init ? init() : 0;
    printf("{\"truth\": \"init\", \"loaded\": %d}\n", loaded);
    void *cupti = dlopen(getenv("GPUPROF_CUPTI_LIBRARY"), RTLD_NOW | RTLD_LOCAL);
    void (*kernel)(const char *, uint32_t, uint32_t, int, int, uint64_t, uint64_t) =
        cupti ? (void (*)(const char *, uint32_t, uint32_t, int, int, uint64_t, uint64_t))dlsym(cupti, "gp_double_kernel")
              : NULL;
    void (*launch)(uint32_t, uint32_t, uint32_t, const char *) =
        cupti ? (void (*)(uint32_t, uint32_t, uint32_t, const char *))dlsym(cupti, "gp_double_launch") : NULL;
    if (!kernel || !launch) { /* no CUPTI double to hand activity to: the kernels "run" unobserved */
        printf("{\"truth\": \"done\", \"kernels\": %d}\n", n);
        return 0;
    }
    static char huge[3000];
    memset(huge, 'K', sizeof(huge) - 1);
    const char *names[] = {"_Z6matmulPfS_S_i", "void at::native::vectorized_elementwise_kernel<4>(int)", huge};
    uint64_t t = now_ns();
    for (int i = 0; i < n; i++) {
        /* the launch call (cudaLaunchKernel: runtime API, callback id 211; every 5th through the
         * driver API, cuLaunchKernel 307), then its kernel's activity with the same id */
        if (i % 5 == 4)
            launch(1, 307, (uint32_t)(i + 1), "cuLaunchKernel");
        else
            launch(2, 211, (uint32_t)(i + 1), "cudaLaunchKernel_v7000");
        uint64_t start = t + (uint64_t)i * 10000, end = start + 5000 + (uint64_t)(i % 3) * 1000;
        kernel(names[i % 3], (uint32_t)(i + 1), (uint32_t)(7 + i % 2), 128 + i % 3, 256, start, end);
        if (i < 50)
            printf("{\"truth\": \"kernel\", \"correlation\": %d, \"start\": %llu, \"end\": %llu, \"name\": %d}\n",
                   i + 1, (unsigned long long)start, (unsigned long long)end, i % 3);
    }
    printf("{\"truth\": \"done\", \"kernels\": %d, \"ns\": %llu}\n", n, (unsigned long long)(now_ns() - t));
    return 0; /* the injection's atexit flush delivers what CUPTI still holds */
}
