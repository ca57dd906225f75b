/* Driver of the CUDA launch TEST DOUBLE (fake_cuda.c): calls each launch entry point with known
 * arguments and prints what it passed as one JSON line, for tests/test_bpf_kernels.py.
 *
 *   cuda_launches LIB [REPEAT]     LIB: the double (or a real libcudart, runtime calls only)
 *
 * The library is dlopen'ed so that the same driver runs against the double and a real library.
 * vector_add below plays nvcc's host stub of a __global__ kernel: its (mangled) symbol is what
 * the collector resolves a runtime launch's function pointer to.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct dim3 {
    unsigned int x, y, z;
} dim3;
typedef struct {
    unsigned int gx, gy, gz, bx, by, bz, shared;
    void *stream;
    void *attrs;
    unsigned int nattrs;
} cu_config;
typedef struct {
    dim3 grid, block;
    size_t shared;
    void *stream;
    void *attrs;
    unsigned int nattrs;
} cuda_config;

typedef int (*mod_get_fn)(void **, void *, const char *);
typedef int (*kern_get_fn)(void **, void *);
typedef int (*cu_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            void *, void **, void **);
typedef int (*cu_launch_ex_fn)(const cu_config *, void *, void **, void **);
typedef int (*cuda_launch_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*cuda_launch_exc_fn)(const cuda_config *, const void *, void **);

/* the host stub of `__global__ void vector_add(float*, float*, float*, int)` */
__attribute__((noinline)) void vector_add_stub(void) __asm__("_Z10vector_addPfS_S_i");
__attribute__((noinline)) void vector_add_stub(void) { __asm__ volatile(""); }

__attribute__((noinline)) int launch_site(void **sym, int repeat)
{
    char out[8192];
    int n = 0, ret = 0;
    n += snprintf(out + n, sizeof(out) - n, "{\"pid\": %d, \"launches\": [", (int)getpid());
    const char *sep = "";
/* the launches of the first 4 repeats are listed (benchmark runs repeat many times) */
#define LIST(...)                                                                                   \
    do {                                                                                            \
        if (r < 4)                                                                                  \
            n += snprintf(out + n, sizeof(out) - n, __VA_ARGS__);                                   \
    } while (0)
    cuda_launch_fn cuda_launch = (cuda_launch_fn)sym[4];
    cuda_launch_exc_fn cuda_launch_exc = (cuda_launch_exc_fn)sym[5];
    for (int r = 0; r < repeat; r++) {
        if (sym[0]) { /* the driver API: handles from the lookup calls */
            void *fa = NULL, *kb = NULL, *fb = NULL;
            ret |= ((mod_get_fn)sym[0])(&fa, (void *)0x10, "fake_kernel_a");
            ret |= ((mod_get_fn)sym[1])(&kb, (void *)0x20, "_Z13fake_kernel_bPKfi");
            ret |= ((kern_get_fn)sym[2])(&fb, kb);
            ret |= ((cu_launch_fn)sym[3])(fa, 7, 8, 9, 32, 4, 2, 1024, (void *)0x5151, NULL, NULL);
            LIST(
                          "%s{\"api\": \"cuLaunchKernel\", \"function\": %lu, \"grid\": [7, 8, 9], "
                          "\"block\": [32, 4, 2], \"shared\": 1024, \"stream\": %lu, \"name\": \"fake_kernel_a\"}",
                          sep, (unsigned long)fa, 0x5151UL);
            sep = ", ";
            cu_config c = {11, 12, 13, 64, 2, 1, 4096, (void *)0x6262, NULL, 0};
            ret |= ((cu_launch_ex_fn)sym[6])(&c, fb, NULL, NULL);
            LIST(
                          "%s{\"api\": \"cuLaunchKernelEx\", \"function\": %lu, \"grid\": [11, 12, 13], "
                          "\"block\": [64, 2, 1], \"shared\": 4096, \"stream\": %lu, "
                          "\"name\": \"fake_kernel_b(float const*, int)\"}",
                          sep, (unsigned long)fb, 0x6262UL);
        }
        dim3 g = {100, 200, 3}, b = {128, 1, 4};
        int rc = cuda_launch((const void *)vector_add_stub, g, b, NULL, 256, (void *)0x7373);
        LIST(
                      "%s{\"api\": \"cudaLaunchKernel\", \"function\": %lu, \"grid\": [100, 200, 3], "
                      "\"block\": [128, 1, 4], \"shared\": 256, \"stream\": %lu, "
                      "\"name\": \"vector_add(float*, float*, float*, int)\", \"ret\": %d}",
                      sep, (unsigned long)vector_add_stub, 0x7373UL, rc);
        sep = ", ";
        cuda_config cc = {{5, 6, 7}, {8, 9, 10}, 8192, (void *)0x8484, NULL, 0};
        rc = cuda_launch_exc(&cc, (const void *)vector_add_stub, NULL);
        LIST(
                      "%s{\"api\": \"cudaLaunchKernelExC\", \"function\": %lu, \"grid\": [5, 6, 7], "
                      "\"block\": [8, 9, 10], \"shared\": 8192, \"stream\": %lu, "
                      "\"name\": \"vector_add(float*, float*, float*, int)\", \"ret\": %d}",
                      sep, (unsigned long)vector_add_stub, 0x8484UL, rc);
    }
    printf("%s], \"lookup_ret\": %d}\n", out, ret);
    return ret;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: cuda_launches LIB [REPEAT]\n");
        return 2;
    }
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "cuda_launches: %s\n", dlerror());
        return 2;
    }
    int repeat = argc > 2 ? atoi(argv[2]) : 1;
    const char *names[] = {"cuModuleGetFunction", "cuLibraryGetKernel", "cuKernelGetFunction", "cuLaunchKernel",
                           "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"};
    void *sym[7];
    for (int i = 0; i < 7; i++)
        sym[i] = dlsym(h, names[i]);
    if (!sym[4] || !sym[5]) {
        fprintf(stderr, "cuda_launches: no runtime launch functions in %s\n", argv[1]);
        return 2;
    }
    if (!sym[0] || !sym[1] || !sym[2] || !sym[3] || !sym[6])
        sym[0] = NULL; /* a real libcudart: runtime calls only */
    /* wait for the collector to attach to the library just mapped */
    const char *wait = getenv("CUDA_LAUNCHES_WAIT_S");
    if (wait)
        usleep((useconds_t)(atof(wait) * 1e6));
    fflush(stdout);
    launch_site(sym, repeat);
    fflush(stdout);
    return 0;
}
