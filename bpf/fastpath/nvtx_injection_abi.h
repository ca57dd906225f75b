/* NVTX v3's tool injection interface, re-declared from NVIDIA's documentation of it (the NVTX v3
 * headers, nvtxDetail/nvtxInit.h and nvtxTypes.h, Apache-2.0): the application's NVTX loader
 * dlopens $NVTX_INJECTION64_PATH at its first NVTX call, calls InitializeInjectionNvtx2 with a
 * function giving export tables, and the tool writes its own functions into the slots of the
 * callback modules it handles (CORE: the classic nvtxRangePush... calls; CORE2: the domain calls).
 * Only what gpuprof_nvtx.c uses is declared here.
 */
#ifndef GPUPROF_NVTX_INJECTION_ABI_H
#define GPUPROF_NVTX_INJECTION_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <wchar.h>

typedef void (*gp_NvtxFunctionPointer)(void);
typedef gp_NvtxFunctionPointer **gp_NvtxFunctionTable; /* table[cbid] points at the slot of that call */
typedef const void *(*gp_NvtxGetExportTableFunc_t)(uint32_t exportTableId);

#define GP_NVTX_ETID_CALLBACKS 1
#define GP_NVTX_ETID_VERSIONINFO 3

typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int callback_module, gp_NvtxFunctionTable *out_table, unsigned int *out_size);
} gp_NvtxExportTableCallbacks;

typedef struct {
    size_t struct_size;
    uint32_t version;
    uint32_t reserved0;
    void (*SetInjectionNvtxVersion)(uint32_t version);
} gp_NvtxExportTableVersionInfo;

#define GP_NVTX_CB_MODULE_CORE 1
#define GP_NVTX_CB_MODULE_CORE2 5

/* NVTX_CBID_CORE_* */
enum {
    GP_CORE_MarkEx = 1,
    GP_CORE_MarkA = 2,
    GP_CORE_MarkW = 3,
    GP_CORE_RangeStartEx = 4,
    GP_CORE_RangeStartA = 5,
    GP_CORE_RangeStartW = 6,
    GP_CORE_RangeEnd = 7,
    GP_CORE_RangePushEx = 8,
    GP_CORE_RangePushA = 9,
    GP_CORE_RangePushW = 10,
    GP_CORE_RangePop = 11,
    GP_CORE_NameCategoryA = 12,
    GP_CORE_NameCategoryW = 13,
};

/* NVTX_CBID_CORE2_* */
enum {
    GP_CORE2_DomainMarkEx = 1,
    GP_CORE2_DomainRangeStartEx = 2,
    GP_CORE2_DomainRangeEnd = 3,
    GP_CORE2_DomainRangePushEx = 4,
    GP_CORE2_DomainRangePop = 5,
    GP_CORE2_DomainNameCategoryA = 8,
    GP_CORE2_DomainNameCategoryW = 9,
    GP_CORE2_DomainRegisterStringA = 10,
    GP_CORE2_DomainRegisterStringW = 11,
    GP_CORE2_DomainCreateA = 12,
    GP_CORE2_DomainCreateW = 13,
    GP_CORE2_DomainDestroy = 14,
};

#define GP_NVTX_MESSAGE_TYPE_ASCII 1
#define GP_NVTX_MESSAGE_TYPE_UNICODE 2
#define GP_NVTX_MESSAGE_TYPE_REGISTERED 3
#define GP_NVTX_COLOR_ARGB 1

typedef union {
    const char *ascii;
    const wchar_t *unicode;
    const void *registered; /* a handle DomainRegisterString returned */
} gp_nvtxMessageValue_t;

/* nvtxEventAttributes_v2; `size` says how much of it the caller filled in */
typedef struct {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t colorType;
    uint32_t color;
    int32_t payloadType;
    int32_t reserved0;
    uint64_t payload;
    int32_t messageType;
    gp_nvtxMessageValue_t message;
} gp_nvtxEventAttributes_t;

typedef uint64_t gp_nvtxRangeId_t;

#endif
