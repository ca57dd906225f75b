/*
 * TEST DOUBLE of libnvidia-ml (NVML) for slurm-gpuprof's tests and benchmarks. Not a driver, not a
 * measurement: every value it returns is scripted. It lives only under tests/ and is loaded either
 * through GPUPROF_NVML_LIBRARY or as libnvidia-ml.so.1 on LD_LIBRARY_PATH (pynvml's own loading).
 *
 * It exports the nvml* symbols collector/sources/nvml.py calls through pynvml, with the struct
 * layouts of nvml.h (x86_64), and emulates N GPUs configured by the file named in
 * GPUPROF_FAKE_NVML_CONFIG (read at every nvmlInit), lines "key = value", '#' comments:
 *
 *   gpus = 4                   number of emulated GPUs (default 2)
 *   arch = 9                   NVML architecture (9 = Hopper; < 9 means no GPM)
 *   gpm = 1                    nvmlGpmQueryDeviceSupport answer
 *   unsupported = power,temp   metrics answering NVML_ERROR_NOT_SUPPORTED: util, memory, power, temp,
 *                              clocks, throttle, fields, ecc, nvlink, pcie, processes, process_util,
 *                              events, gpm
 *   lost_after = 50            after this many calls on the GPU, NVML_ERROR_GPU_IS_LOST (0 = never)
 *   hang_after = 10            the call with this number on the GPU sleeps hang_ms first (0 = never)
 *   hang_ms = 5000
 *   xid_after = 20             an XID event (value xid) is queued after this many calls on the GPU
 *   xid = 79
 *   pids = 123,456             processes "running" on every GPU
 *   power_mw, temp, util_gpu, util_mem, mem_used, mem_total, sm_clock, mem_clock: fixed values
 * Any key may be given for one GPU as gpuK.key (e.g. gpu1.lost_after = 30).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_GPUS 16
#define MAX_PIDS 64

typedef int nvmlReturn_t;
enum {
    SUCCESS = 0, E_UNINIT = 1, E_INVALID = 2, E_NOT_SUPPORTED = 3, E_NOT_FOUND = 6,
    E_INSUFFICIENT = 7, E_TIMEOUT = 10, E_GPU_LOST = 15, E_UNKNOWN = 999
};

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef union {
    double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal;
    long long sllVal; int siVal; unsigned short usVal;
} nvmlValue_t;
typedef struct {
    uint32_t fieldId, scopeId;
    int64_t timestamp, latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
struct gpu;
typedef struct gpu *nvmlDevice_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;
typedef struct { unsigned int version, isSupportedDevice; } nvmlGpmSupport_t;
typedef struct gpm_sample { struct gpu *g; unsigned long long t_ns, counter; } *nvmlGpmSample_t;
typedef struct { char *shortName, *longName, *unit; } nvmlGpmMetricInfo_t;
typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    nvmlGpmMetricInfo_t metricInfo;
} nvmlGpmMetric_t;
typedef struct {
    unsigned int version, numMetrics;
    nvmlGpmSample_t sample1, sample2;
    nvmlGpmMetric_t metrics[477];
} nvmlGpmMetricsGet_t;
typedef struct eventset { unsigned long long mask[MAX_GPUS]; } *nvmlEventSet_t;

#define EV_SBE 0x1ULL
#define EV_DBE 0x2ULL
#define EV_XID 0x8ULL

struct gpu {
    int index;
    int arch, gpm;
    char unsupported[512];
    long lost_after, hang_after, hang_ms, xid_after, xid;
    long power_mw, temp, util_gpu, util_mem, sm_clock, mem_clock;
    unsigned long long mem_used, mem_total;
    long calls;
    int xid_pending, xid_done;
    unsigned long long pcie_tx, pcie_rx, nvlink_tx, nvlink_rx;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static int ngpus = 2;
static struct gpu gpus[MAX_GPUS];
static unsigned int pids[MAX_PIDS];
static int npids;

static unsigned long long now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL + ts.tv_nsec / 1000;
}

static void set_key(struct gpu *g, const char *k, const char *v) {
    long n = strtol(v, NULL, 0);
    if (!strcmp(k, "arch")) g->arch = (int)n;
    else if (!strcmp(k, "gpm")) g->gpm = (int)n;
    else if (!strcmp(k, "unsupported")) snprintf(g->unsupported, sizeof g->unsupported, ",%s,", v);
    else if (!strcmp(k, "lost_after")) g->lost_after = n;
    else if (!strcmp(k, "hang_after")) g->hang_after = n;
    else if (!strcmp(k, "hang_ms")) g->hang_ms = n;
    else if (!strcmp(k, "xid_after")) g->xid_after = n;
    else if (!strcmp(k, "xid")) g->xid = n;
    else if (!strcmp(k, "power_mw")) g->power_mw = n;
    else if (!strcmp(k, "temp")) g->temp = n;
    else if (!strcmp(k, "util_gpu")) g->util_gpu = n;
    else if (!strcmp(k, "util_mem")) g->util_mem = n;
    else if (!strcmp(k, "sm_clock")) g->sm_clock = n;
    else if (!strcmp(k, "mem_clock")) g->mem_clock = n;
    else if (!strcmp(k, "mem_used")) g->mem_used = strtoull(v, NULL, 0);
    else if (!strcmp(k, "mem_total")) g->mem_total = strtoull(v, NULL, 0);
    else fprintf(stderr, "fake_nvml: unknown key '%s' ignored\n", k);
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    char *e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\n' || e[-1] == '\r')) *--e = 0;
    return s;
}

static void load_config(void) {
    ngpus = 2;
    npids = 0;
    for (int i = 0; i < MAX_GPUS; i++) {
        struct gpu *g = &gpus[i];
        memset(g, 0, sizeof *g);
        g->index = i; g->arch = 9; g->gpm = 1; g->hang_ms = 5000; g->xid = 79;
        g->power_mw = 250000 + 1000 * i; g->temp = 60 + i; g->util_gpu = -1; g->util_mem = -1;
        g->sm_clock = 1980; g->mem_clock = 2619;
        g->mem_total = 80ULL << 30; g->mem_used = (10ULL + i) << 30;
    }
    const char *path = getenv("GPUPROF_FAKE_NVML_CONFIG");
    if (!path || !*path) return;
    FILE *f = fopen(path, "r");
    if (!f) { fprintf(stderr, "fake_nvml: cannot open %s\n", path); return; }
    char line[1024];
    /* two passes: global keys first, so gpuK.key overrides them whatever the order */
    for (int pass = 0; pass < 2; pass++) {
        rewind(f);
        while (fgets(line, sizeof line, f)) {
            char *hash = strchr(line, '#');
            if (hash) *hash = 0;
            char *eq = strchr(line, '=');
            if (!eq) continue;
            *eq = 0;
            char *k = trim(line), *v = trim(eq + 1);
            int per_gpu = !strncmp(k, "gpu", 3) && k[3] >= '0' && k[3] <= '9';
            if (pass == 0 && !per_gpu) {
                if (!strcmp(k, "gpus")) { ngpus = atoi(v); if (ngpus > MAX_GPUS) ngpus = MAX_GPUS; }
                else if (!strcmp(k, "pids")) {
                    for (char *t = strtok(v, ","); t && npids < MAX_PIDS; t = strtok(NULL, ","))
                        pids[npids++] = (unsigned)atoi(t);
                } else for (int i = 0; i < MAX_GPUS; i++) set_key(&gpus[i], k, v);
            } else if (pass == 1 && per_gpu) {
                char *dot = strchr(k, '.');
                int i = atoi(k + 3);
                if (dot && i >= 0 && i < MAX_GPUS) set_key(&gpus[i], dot + 1, v);
            }
        }
    }
    fclose(f);
}

static int unsupported(struct gpu *g, const char *metric) {
    char key[64];
    snprintf(key, sizeof key, ",%s,", metric);
    return strstr(g->unsupported, key) != NULL;
}

/* Every per-GPU call goes through here: counts the call, then applies lost/hang/xid scripts. */
static nvmlReturn_t enter(struct gpu *g, const char *metric) {
    if (!init_count) return E_UNINIT;
    if (!g || g < gpus || g >= gpus + ngpus) return E_INVALID;
    pthread_mutex_lock(&lock);
    long n = ++g->calls;
    if (g->xid_after && n >= g->xid_after && !g->xid_done) { g->xid_pending = 1; g->xid_done = 1; }
    pthread_mutex_unlock(&lock);
    if (g->lost_after && n > g->lost_after) return E_GPU_LOST;
    if (g->hang_after && n == g->hang_after) usleep((useconds_t)g->hang_ms * 1000);
    if (metric && unsupported(g, metric)) return E_NOT_SUPPORTED;
    return SUCCESS;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    if (init_count++ == 0) load_config();
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    if (init_count > 0) init_count--;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}
EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case SUCCESS: return "Success";
    case E_NOT_SUPPORTED: return "Not Supported";
    case E_GPU_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}
EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len) {
    snprintf(v, len, "999.99-gpuprof-test-double");
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!init_count) return E_UNINIT;
    *count = (unsigned)ngpus;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *dev) {
    if (!init_count) return E_UNINIT;
    if (i >= (unsigned)ngpus) return E_INVALID;
    *dev = &gpus[i];
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t g, char *uuid, unsigned int len) {
    nvmlReturn_t r = enter(g, NULL);
    if (r) return r;
    snprintf(uuid, len, "GPU-00000000-fake-0000-0000-%012d", g->index);
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t g, char *name, unsigned int len) {
    nvmlReturn_t r = enter(g, NULL);
    if (r) return r;
    snprintf(name, len, "Emulated GPU (gpuprof test double)");
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t g, unsigned int *minor) {
    nvmlReturn_t r = enter(g, NULL);
    if (r) return r;
    *minor = (unsigned)g->index;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t g, nvmlPciInfo_t *p) {
    nvmlReturn_t r = enter(g, NULL);
    if (r) return r;
    memset(p, 0, sizeof *p);
    p->bus = 0x10 + (unsigned)g->index;
    snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", p->bus);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "0000:%02X:00.0", p->bus);
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t g, unsigned int *arch) {
    nvmlReturn_t r = enter(g, NULL);
    if (r) return r;
    *arch = (unsigned)g->arch;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t g, nvmlMemory_t *m) {
    nvmlReturn_t r = enter(g, "memory");
    if (r) return r;
    m->total = g->mem_total;
    m->used = g->mem_used;
    m->free = g->mem_total - g->mem_used;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t g, nvmlUtilization_t *u) {
    nvmlReturn_t r = enter(g, "util");
    if (r) return r;
    u->gpu = g->util_gpu >= 0 ? (unsigned)g->util_gpu : (unsigned)((g->calls / 16 + 10 * g->index) % 101);
    u->memory = g->util_mem >= 0 ? (unsigned)g->util_mem : u->gpu / 2;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t g, unsigned int *mw) {
    nvmlReturn_t r = enter(g, "power");
    if (r) return r;
    *mw = (unsigned)g->power_mw;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t g, int sensor, unsigned int *t) {
    (void)sensor;
    nvmlReturn_t r = enter(g, "temp");
    if (r) return r;
    *t = (unsigned)g->temp;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t g, int type, unsigned int *mhz) {
    nvmlReturn_t r = enter(g, "clocks");
    if (r) return r;
    *mhz = (unsigned)(type == 2 ? g->mem_clock : g->sm_clock);
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t g, unsigned long long *reasons) {
    nvmlReturn_t r = enter(g, "throttle");
    if (r) return r;
    *reasons = 0x1ULL; /* GPU idle */
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t g, unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(g, reasons);
}
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t g, int n, nvmlFieldValue_t *v) {
    nvmlReturn_t r = enter(g, "fields");
    if (r) return r;
    pthread_mutex_lock(&lock);
    g->pcie_tx += 12500000; g->pcie_rx += 25000000;    /* bytes per call */
    g->nvlink_tx += 100000; g->nvlink_rx += 50000;     /* KiB per call */
    for (int i = 0; i < n; i++) {
        const char *metric = NULL;
        unsigned long long val = 0;
        switch (v[i].fieldId) {
        case 3: metric = "ecc"; val = 0; break;
        case 4: metric = "ecc"; val = 0; break;
        case 138: metric = "nvlink"; val = g->nvlink_tx; break;
        case 139: metric = "nvlink"; val = g->nvlink_rx; break;
        case 197: metric = "pcie"; val = g->pcie_tx; break;
        case 198: metric = "pcie"; val = g->pcie_rx; break;
        default: v[i].nvmlReturn = E_NOT_SUPPORTED; continue;
        }
        v[i].timestamp = (int64_t)now_us();
        v[i].latencyUsec = 0;
        v[i].valueType = 3;
        v[i].nvmlReturn = unsupported(g, metric) ? E_NOT_SUPPORTED : SUCCESS;
        v[i].value.ullVal = val;
    }
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t g, unsigned int *count,
                                                            nvmlProcessInfo_t *infos) {
    nvmlReturn_t r = enter(g, "processes");
    if (r) return r;
    if (!infos || *count < (unsigned)npids) {
        unsigned int need = (unsigned)npids;
        *count = need;
        return need ? E_INSUFFICIENT : SUCCESS;
    }
    for (int i = 0; i < npids; i++) {
        infos[i].pid = pids[i];
        infos[i].usedGpuMemory = (1ULL << 30) * (unsigned)(i + 1);
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFF;
    }
    *count = (unsigned)npids;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t g, nvmlProcessUtilizationSample_t *s,
                                                    unsigned int *count, unsigned long long last) {
    nvmlReturn_t r = enter(g, "process_util");
    if (r) return r;
    (void)last;
    if (npids == 0) return E_NOT_FOUND;
    if (!s || *count < (unsigned)npids) { *count = (unsigned)npids; return E_INSUFFICIENT; }
    unsigned long long t = now_us();
    for (int i = 0; i < npids; i++) {
        s[i].pid = pids[i]; s[i].timeStamp = t;
        s[i].smUtil = 40u + (unsigned)i; s[i].memUtil = 20u + (unsigned)i; s[i].encUtil = s[i].decUtil = 0;
    }
    *count = (unsigned)npids;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t g, nvmlGpmSupport_t *s) {
    nvmlReturn_t r = enter(g, NULL);
    if (r) return r;
    s->isSupportedDevice = g->gpm && g->arch >= 9 && !unsupported(g, "gpm");
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *s) {
    if (!init_count) return E_UNINIT;
    *s = calloc(1, sizeof **s);
    return *s ? SUCCESS : E_UNKNOWN;
}
EXPORT nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t s) { free(s); return SUCCESS; }
EXPORT nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t g, nvmlGpmSample_t s) {
    nvmlReturn_t r = enter(g, "gpm");
    if (r) return r;
    if (!s) return E_INVALID;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    s->g = g;
    s->t_ns = (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
    s->counter = (unsigned long long)g->calls;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m) {
    if (!init_count) return E_UNINIT;
    if (!m || m->version != 1 || !m->sample1 || !m->sample2 || m->numMetrics > 477) return E_INVALID;
    /* NVML requires two samples of the same GPU, the second one later */
    if (m->sample1->g != m->sample2->g || m->sample2->t_ns <= m->sample1->t_ns) return E_INVALID;
    struct gpu *g = m->sample1->g;
    for (unsigned i = 0; i < m->numMetrics; i++) {
        m->metrics[i].nvmlReturn = SUCCESS;
        switch (m->metrics[i].metricId) {
        case 2: m->metrics[i].value = 55.0 + g->index; break;   /* SM activity */
        case 3: m->metrics[i].value = 30.0; break;              /* SM occupancy */
        case 5: m->metrics[i].value = 12.5; break;              /* tensor activity */
        case 10: m->metrics[i].value = 40.0; break;             /* DRAM bandwidth */
        default: m->metrics[i].nvmlReturn = E_NOT_SUPPORTED; m->metrics[i].value = 0;
        }
    }
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!init_count) return E_UNINIT;
    *set = calloc(1, sizeof **set);
    return *set ? SUCCESS : E_UNKNOWN;
}
EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { free(set); return SUCCESS; }
EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t g, unsigned long long *types) {
    nvmlReturn_t r = enter(g, "events");
    if (r) return r;
    *types = EV_SBE | EV_DBE | EV_XID;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t g, unsigned long long types, nvmlEventSet_t set) {
    nvmlReturn_t r = enter(g, "events");
    if (r) return r;
    set->mask[g->index] |= types;
    return SUCCESS;
}
EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms) {
    if (!init_count) return E_UNINIT;
    for (int i = 0; i < ngpus; i++) {
        struct gpu *g = &gpus[i];
        pthread_mutex_lock(&lock);
        int pending = g->xid_pending && (set->mask[i] & EV_XID);
        if (pending) g->xid_pending = 0;
        pthread_mutex_unlock(&lock);
        if (pending) {
            memset(data, 0, sizeof *data);
            data->device = g;
            data->eventType = EV_XID;
            data->eventData = (unsigned long long)g->xid;
            return SUCCESS;
        }
    }
    if (timeout_ms) usleep(timeout_ms * 1000);
    return E_TIMEOUT;
}
