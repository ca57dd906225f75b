/* TEST DOUBLE of the CUDA driver and runtime launch entry points, for tests/test_bpf_kernels.py:
 * libgpuprof_fake_cuda.so defines cuLaunchKernel, cuLaunchKernelEx, cudaLaunchKernel,
 * cudaLaunchKernelExC (and the _ptsz forms), cuModuleGetFunction, cuLibraryGetKernel and
 * cuKernelGetFunction with the real signatures (types restated from cuda.h / cuda_runtime_api.h
 * of CUDA 12, since no CUDA headers are installed here). Nothing runs on a GPU: lookups hand out
 * made-up handles and launches return success, so the uprobes see real calls with known arguments.
 */
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int cudaError_t;
typedef struct CUfunc_st *CUfunction;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUstream_st *CUstream;
typedef struct CUstream_st *cudaStream_t;

typedef struct CUlaunchAttribute_st {
    int id;
    char pad[4];
    char value[64];
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef struct dim3 {
    unsigned int x, y, z;
} dim3;

typedef struct cudaLaunchAttribute_st cudaLaunchAttribute;
typedef struct cudaLaunchConfig_st {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;

static uintptr_t next_handle = 0x7e570000;
static volatile unsigned long launches;

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    (void)hmod;
    if (!hfunc || !name)
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    next_handle += 0x100;
    *hfunc = (CUfunction)next_handle;
    return 0;
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    (void)library;
    if (!pKernel || !name)
        return 1;
    next_handle += 0x100;
    *pKernel = (CUkernel)next_handle;
    return 0;
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    if (!pFunc || !kernel)
        return 1;
    *pFunc = (CUfunction)((uintptr_t)kernel + 0x10);
    return 0;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    (void)f, (void)gridDimX, (void)gridDimY, (void)gridDimZ, (void)blockDimX, (void)blockDimY;
    (void)blockDimZ, (void)sharedMemBytes, (void)hStream, (void)kernelParams, (void)extra;
    launches++;
    return 0;
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                             unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                             unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    return cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                          hStream, kernelParams, extra);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    (void)config, (void)f, (void)kernelParams, (void)extra;
    launches++;
    return 0;
}

cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem,
                             cudaStream_t stream)
{
    (void)func, (void)gridDim, (void)blockDim, (void)args, (void)sharedMem, (void)stream;
    launches++;
    return 0;
}

cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func, void **args)
{
    (void)config, (void)func, (void)args;
    launches++;
    return 0;
}
