/* The NVML source's per-sample calls (collector/sources/nvml.py) in C, run by ticker.c at the
 * source's rate: per watched GPU utilization, memory, power, temperature, clocks, clock event
 * reasons, field values (ECC totals; PCIe and NVLink byte counters turned into rates), the GPM
 * metrics from consecutive pairs of GPM samples, and the XID/ECC events of the event set, polled
 * without waiting. Rows go to buffers the Python source drains about once a second.
 *
 * The library is the one pynvml loaded: the Python side hands over its function addresses
 * (gp_nvml_fns), so GPUPROF_NVML_LIBRARY and the tests' double work unchanged, and the set-up,
 * the 1 Hz per-process queries and the shutdown stay in pynvml.
 *
 * Faults, as the Python path handles them:
 *   - a call that fails is one error record (time, GPU, metric, nvmlReturn_t) for the drain to
 *     classify and report; a permanent code (the caller's list: NOT_SUPPORTED and kin) also
 *     disables that metric here, so it is never asked again and stays NaN, never zero;
 *   - NVML_ERROR_GPU_IS_LOST (the caller's lost_code) marks the GPU lost: not polled again;
 *   - a hung call: `call_since_ns` says since when the current call runs, `cur_metric`/`cur_gpu`
 *     which it is; the Python side abandons this state (gp_nvml_abandon) and starts a new one
 *     that skips that GPU for a while. An abandoned tick returns as soon as its call does,
 *     without touching its buffers again.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

typedef int (*fn_h_p)(void *, void *);
typedef int (*fn_h_i_p)(void *, int, void *);
typedef int (*fn_p)(void *);
typedef int (*fn_wait)(void *, void *, unsigned int);

/* The library's entry points (NULL: absent in this driver; the metrics it serves are disabled
 * by the caller before the first tick). */
struct gp_nvml_fns {
    void *util, *memory, *power, *temperature, *clock, *reasons, *fields, *gpm_sample_get, *gpm_metrics_get,
        *event_wait;
};

/* The metrics a tick asks for, one bit each in gp_nvml_gpu.disabled; collector/sources/nvml.py's
 * NATIVE_METRICS lists their names in this order. */
enum {
    M_UTIL, M_MEMORY, M_POWER, M_TEMP, M_SM_CLOCK, M_MEM_CLOCK, M_REASONS, M_FIELDS,
    M_FIELD0, /* .. M_FIELD0 + N_FIELDS - 1 */
    M_GPM_SAMPLE = M_FIELD0 + 6, M_GPM, M_GPM_METRIC0, /* .. + N_GPM - 1 */
    M_EVENTS = M_GPM_METRIC0 + 4,
    N_METRICS
};
#define N_FIELDS 6
#define N_GPM 4
#define N_COLS 14
/* /gpu/samples columns after (t_ns, gpu), as in collector/schema.py */
enum { C_UTIL_GPU, C_UTIL_MEM, C_MEM_USED, C_POWER, C_TEMP, C_SM_CLOCK, C_MEM_CLOCK, C_PCIE_TX, C_PCIE_RX,
       C_NVLINK_TX, C_NVLINK_RX, C_REASONS, C_ECC_SBE, C_ECC_DBE };

/* nvml.h's layouts (x86_64 and aarch64) */
struct nvml_utilization { unsigned int gpu, memory; };
struct nvml_memory { unsigned long long total, free, used; };
struct nvml_field_value {
    uint32_t field_id, scope_id;
    int64_t timestamp, latency_usec;
    int value_type, ret;
    union { double d; unsigned int ui; unsigned long ul; unsigned long long ull; long long sll; int si;
            unsigned short us; } value;
};
struct nvml_gpm_metric {
    unsigned int metric_id;
    int ret;
    double value;
    char *short_name, *long_name, *unit;
};
#define NVML_GPM_METRIC_MAX 477
struct nvml_gpm_metrics_get {
    unsigned int version, num_metrics;
    void *sample1, *sample2;
    struct nvml_gpm_metric metrics[NVML_GPM_METRIC_MAX];
};
struct nvml_event_data {
    void *device;
    unsigned long long event_type, event_data;
    unsigned int gpu_instance_id, compute_instance_id;
};
#define EV_SBE 0x1ULL
#define EV_DBE 0x2ULL
#define EV_XID 0x8ULL
enum { KIND_XID = 0, KIND_SBE = 1, KIND_DBE = 2, KIND_GPU_LOST = 3 };
#define MAX_EVENTS_PER_TICK 64
#define NVML_ERROR_TIMEOUT 10
#define NVML_TEMPERATURE_GPU 0
#define NVML_CLOCK_SM 1
#define NVML_CLOCK_MEM 2

/* One watched GPU. The caller fills the first part before the first tick. */
struct gp_nvml_gpu {
    void *handle;
    int32_t index;
    int32_t gpm;              /* GPM set up: two samples allocated */
    void *gpm_samples[2];
    uint32_t field_ids[N_FIELDS], field_scopes[N_FIELDS];
    uint32_t gpm_metric_ids[N_GPM];
    double field_rate_scale[N_FIELDS]; /* > 0: a byte counter turned into KB/s, times this */
    uint32_t disabled;        /* bit per metric: not asked (again) */
    int32_t lost;
    uint64_t skip_until_ns;   /* not polled before (a call on it hung) */
    /* the tick's own */
    int gpm_prev;             /* index of the previous GPM sample, -1 before the first */
    uint64_t gpm_prev_t;
    double prev_counter[N_FIELDS];
    uint64_t prev_counter_t[N_FIELDS];
    struct nvml_field_value fv[N_FIELDS];
    struct nvml_gpm_metrics_get gm;
};

struct gp_nvml_sample_row { uint64_t t_ns; int32_t gpu; int32_t pad; double v[N_COLS]; };
struct gp_nvml_gpm_row { uint64_t t_ns; int32_t gpu; int32_t pad; uint64_t interval_ns; double v[N_GPM]; };
struct gp_nvml_event_row { uint64_t t_ns; int32_t gpu; uint32_t kind; uint64_t value; };
struct gp_nvml_error_row { uint64_t t_ns; int32_t gpu; int32_t metric; int32_t code; int32_t pad; };

struct gp_nvml {
    struct gp_nvml_fns fn;
    struct gp_nvml_gpu *gpus;
    int n_gpus;
    void *event_set;
    int32_t permanent[16];
    int n_permanent;
    int32_t lost_code;
    /* the watchdog's view */
    uint64_t call_since_ns;
    int32_t cur_metric, cur_gpu;
    int32_t abandoned;
    /* output, under mu */
    pthread_mutex_t mu;
    struct gp_nvml_sample_row *samples;
    struct gp_nvml_gpm_row *gpm;
    struct gp_nvml_event_row *events;
    struct gp_nvml_error_row *errors;
    int samples_cap, samples_n, gpm_cap, gpm_n, events_cap, events_n, errors_cap, errors_n;
    uint64_t dropped, errors_dropped;
    /* the tick's scratch, as large as the buffers' per-tick share */
    struct gp_nvml_sample_row *t_samples;
    struct gp_nvml_gpm_row *t_gpm;
    struct gp_nvml_event_row t_events[MAX_EVENTS_PER_TICK + 16];
    struct gp_nvml_error_row t_errors[64];
    int t_samples_n, t_gpm_n, t_events_n, t_errors_n;
};

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void call_begins(struct gp_nvml *s, int metric, int gpu)
{
    s->cur_metric = metric;
    s->cur_gpu = gpu;
    __atomic_store_n(&s->call_since_ns, mono_ns(), __ATOMIC_RELEASE);
}

static int call_ends(struct gp_nvml *s)
{
    __atomic_store_n(&s->call_since_ns, 0, __ATOMIC_RELEASE);
    return __atomic_load_n(&s->abandoned, __ATOMIC_ACQUIRE);
}

static void error_row(struct gp_nvml *s, uint64_t now, int gpu, int metric, int code)
{
    if (s->t_errors_n < (int)(sizeof(s->t_errors) / sizeof(s->t_errors[0])))
        s->t_errors[s->t_errors_n++] = (struct gp_nvml_error_row){now, gpu, metric, code, 0};
}

/* 1: the call succeeded; 0: it failed (recorded; a permanent code disables the metric);
 * -1: the GPU is lost. */
static int check(struct gp_nvml *s, struct gp_nvml_gpu *g, uint64_t now, int metric, int ret)
{
    if (ret == 0)
        return 1;
    error_row(s, now, g->index, metric, ret);
    if (ret == s->lost_code) {
        g->lost = 1;
        if (s->t_events_n < (int)(sizeof(s->t_events) / sizeof(s->t_events[0])))
            s->t_events[s->t_events_n++] = (struct gp_nvml_event_row){now, g->index, KIND_GPU_LOST, 0};
        return -1;
    }
    for (int i = 0; i < s->n_permanent; i++)
        if (ret == s->permanent[i])
            g->disabled |= 1u << metric;
    return 0;
}

static double field_value(const struct nvml_field_value *f)
{
    switch (f->value_type) {
    case 0: return f->value.d;
    case 1: return (double)f->value.ui;
    case 2: return (double)f->value.ul;
    case 3: return (double)f->value.ull;
    case 4: return (double)f->value.sll;
    case 5: return (double)f->value.si;
    case 6: return (double)f->value.us;
    default: return (double)f->value.ull;
    }
}

#define ASK(metric) (!(g->disabled & (1u << (metric))))
/* one call: its metric noted for the watchdog; leaves the tick when abandoned, the GPU when lost */
#define CALL(metric, expr)                                                                        \
    ({                                                                                            \
        call_begins(s, (metric), g->index);                                                       \
        int ret_ = (expr);                                                                        \
        if (call_ends(s))                                                                         \
            return -2;                                                                            \
        int ok_ = check(s, g, now, (metric), ret_);                                               \
        if (ok_ < 0)                                                                              \
            return -1;                                                                            \
        ok_;                                                                                      \
    })

/* 0 done, -1 GPU lost, -2 state abandoned */
static int sample_gpu(struct gp_nvml *s, struct gp_nvml_gpu *g, uint64_t now)
{
    struct gp_nvml_sample_row *r = &s->t_samples[s->t_samples_n];
    r->t_ns = now;
    r->gpu = g->index;
    r->pad = 0;
    for (int c = 0; c < N_COLS; c++)
        r->v[c] = NAN;
    if (ASK(M_UTIL)) {
        struct nvml_utilization u;
        if (CALL(M_UTIL, ((fn_h_p)s->fn.util)(g->handle, &u)))
            r->v[C_UTIL_GPU] = u.gpu, r->v[C_UTIL_MEM] = u.memory;
    }
    if (ASK(M_MEMORY)) {
        struct nvml_memory m;
        if (CALL(M_MEMORY, ((fn_h_p)s->fn.memory)(g->handle, &m)))
            r->v[C_MEM_USED] = (double)m.used;
    }
    unsigned int ui;
    if (ASK(M_POWER) && CALL(M_POWER, ((fn_h_p)s->fn.power)(g->handle, &ui)))
        r->v[C_POWER] = ui / 1000.0; /* NVML: milliwatts */
    if (ASK(M_TEMP) && CALL(M_TEMP, ((fn_h_i_p)s->fn.temperature)(g->handle, NVML_TEMPERATURE_GPU, &ui)))
        r->v[C_TEMP] = ui;
    if (ASK(M_SM_CLOCK) && CALL(M_SM_CLOCK, ((fn_h_i_p)s->fn.clock)(g->handle, NVML_CLOCK_SM, &ui)))
        r->v[C_SM_CLOCK] = ui;
    if (ASK(M_MEM_CLOCK) && CALL(M_MEM_CLOCK, ((fn_h_i_p)s->fn.clock)(g->handle, NVML_CLOCK_MEM, &ui)))
        r->v[C_MEM_CLOCK] = ui;
    unsigned long long reasons;
    if (ASK(M_REASONS) && CALL(M_REASONS, ((fn_h_p)s->fn.reasons)(g->handle, &reasons)))
        r->v[C_REASONS] = (double)reasons;
    static const int field_col[N_FIELDS] = {C_ECC_SBE, C_ECC_DBE, C_NVLINK_TX, C_NVLINK_RX, C_PCIE_TX, C_PCIE_RX};
    int n = 0, which[N_FIELDS];
    for (int k = 0; k < N_FIELDS; k++) {
        if (!ASK(M_FIELD0 + k))
            continue;
        memset(&g->fv[n], 0, sizeof(g->fv[n]));
        g->fv[n].field_id = g->field_ids[k];
        g->fv[n].scope_id = g->field_scopes[k];
        which[n++] = k;
    }
    if (n && ASK(M_FIELDS) && CALL(M_FIELDS, ((fn_h_i_p)s->fn.fields)(g->handle, n, g->fv))) {
        for (int j = 0; j < n; j++) {
            int k = which[j];
            if (g->fv[j].ret != 0) {
                if (check(s, g, now, M_FIELD0 + k, g->fv[j].ret) < 0)
                    return -1;
                continue;
            }
            double val = field_value(&g->fv[j]);
            if (g->field_rate_scale[k] > 0) {
                /* a cumulative byte counter: the rate since the previous sample, KB/s */
                if (g->prev_counter_t[k] && now > g->prev_counter_t[k] && val >= g->prev_counter[k])
                    r->v[field_col[k]] = (val - g->prev_counter[k]) * g->field_rate_scale[k] / 1000.0 /
                                         ((double)(now - g->prev_counter_t[k]) / 1e9);
                g->prev_counter[k] = val;
                g->prev_counter_t[k] = now;
            } else {
                r->v[field_col[k]] = val;
            }
        }
    }
    s->t_samples_n++;
    if (!g->gpm || !ASK(M_GPM_SAMPLE))
        return 0;
    int k = g->gpm_prev == 0 ? 1 : 0;
    if (!CALL(M_GPM_SAMPLE, ((fn_h_p)s->fn.gpm_sample_get)(g->handle, g->gpm_samples[k]))) {
        g->disabled |= 1u << M_GPM_SAMPLE; /* any failure: no more GPM on this GPU (as nvml.py) */
        return 0;
    }
    int prev = g->gpm_prev;
    uint64_t prev_t = g->gpm_prev_t;
    g->gpm_prev = k, g->gpm_prev_t = now;
    if (prev < 0 || !ASK(M_GPM))
        return 0; /* GPM metrics need two samples */
    struct nvml_gpm_metrics_get *gm = &g->gm;
    gm->version = 1;
    gm->num_metrics = N_GPM;
    gm->sample1 = g->gpm_samples[prev];
    gm->sample2 = g->gpm_samples[k];
    for (int j = 0; j < N_GPM; j++) {
        gm->metrics[j].metric_id = g->gpm_metric_ids[j];
        gm->metrics[j].ret = 0;
    }
    if (!CALL(M_GPM, ((fn_p)s->fn.gpm_metrics_get)(gm)))
        return 0;
    struct gp_nvml_gpm_row *gr = &s->t_gpm[s->t_gpm_n++];
    gr->t_ns = now;
    gr->gpu = g->index;
    gr->pad = 0;
    gr->interval_ns = now - prev_t;
    for (int j = 0; j < N_GPM; j++) {
        gr->v[j] = NAN;
        if (!ASK(M_GPM_METRIC0 + j))
            continue;
        if (gm->metrics[j].ret != 0) {
            if (check(s, g, now, M_GPM_METRIC0 + j, gm->metrics[j].ret) < 0)
                return -1;
        } else {
            gr->v[j] = gm->metrics[j].value;
        }
    }
    return 0;
}

static int poll_events(struct gp_nvml *s, uint64_t now)
{
    struct nvml_event_data ev;
    for (int i = 0; i < MAX_EVENTS_PER_TICK; i++) {
        call_begins(s, M_EVENTS, -1);
        int ret = ((fn_wait)s->fn.event_wait)(s->event_set, &ev, 0);
        if (call_ends(s))
            return -2;
        if (ret != 0) {
            if (ret != NVML_ERROR_TIMEOUT) /* TIMEOUT: no event pending */
                error_row(s, now, -1, M_EVENTS, ret);
            return 0;
        }
        uint32_t kind;
        if (ev.event_type & EV_XID)
            kind = KIND_XID;
        else if (ev.event_type & EV_DBE)
            kind = KIND_DBE;
        else if (ev.event_type & EV_SBE)
            kind = KIND_SBE;
        else
            continue;
        int idx = -1;
        for (int g = 0; g < s->n_gpus; g++)
            if (s->gpus[g].handle == ev.device)
                idx = s->gpus[g].index;
        if (s->t_events_n < MAX_EVENTS_PER_TICK)
            s->t_events[s->t_events_n++] = (struct gp_nvml_event_row){now, idx, kind, ev.event_data};
    }
    return 0;
}

#define APPEND(dst, n, cap, src, k)                                                               \
    do {                                                                                          \
        int fit_ = (cap) - (n) < (k) ? (cap) - (n) : (k);                                         \
        memcpy(&(dst)[n], (src), sizeof(*(src)) * (size_t)fit_);                                  \
        (n) += fit_;                                                                              \
        s->dropped += (uint64_t)((k) - fit_);                                                     \
    } while (0)

/* One tick over the watched GPUs (ticker.c calls it on its thread). */
EXPORT void gp_nvml_tick(struct gp_nvml *s, uint64_t now)
{
    s->t_samples_n = s->t_gpm_n = s->t_events_n = s->t_errors_n = 0;
    for (int i = 0; i < s->n_gpus; i++) {
        struct gp_nvml_gpu *g = &s->gpus[i];
        if (g->lost || __atomic_load_n(&g->skip_until_ns, __ATOMIC_ACQUIRE) > now)
            continue;
        if (sample_gpu(s, g, now) == -2)
            return;
    }
    if (s->event_set && poll_events(s, now) == -2)
        return;
    pthread_mutex_lock(&s->mu);
    APPEND(s->samples, s->samples_n, s->samples_cap, s->t_samples, s->t_samples_n);
    APPEND(s->gpm, s->gpm_n, s->gpm_cap, s->t_gpm, s->t_gpm_n);
    APPEND(s->events, s->events_n, s->events_cap, s->t_events, s->t_events_n);
    int fit = s->errors_cap - s->errors_n < s->t_errors_n ? s->errors_cap - s->errors_n : s->t_errors_n;
    memcpy(&s->errors[s->errors_n], s->t_errors, sizeof(s->t_errors[0]) * (size_t)fit);
    s->errors_n += fit;
    s->errors_dropped += (uint64_t)(s->t_errors_n - fit);
    pthread_mutex_unlock(&s->mu);
}

/* A state for n_gpus GPUs (the caller describes each with gp_nvml_set_gpu) keeping up to `ticks` ticks
 * between drains. permanent: the nvmlReturn_t codes that mean "never there on this GPU". */
EXPORT struct gp_nvml *gp_nvml_new(const struct gp_nvml_fns *fns, int n_gpus, void *event_set, int ticks,
                                   const int32_t *permanent, int n_permanent, int32_t lost_code)
{
    struct gp_nvml *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->fn = *fns;
    s->n_gpus = n_gpus;
    s->event_set = event_set;
    s->n_permanent = n_permanent < 16 ? n_permanent : 16;
    memcpy(s->permanent, permanent, sizeof(int32_t) * (size_t)s->n_permanent);
    s->lost_code = lost_code;
    pthread_mutex_init(&s->mu, NULL);
    int per_tick = n_gpus > 0 ? n_gpus : 1;
    s->gpus = calloc((size_t)per_tick, sizeof(*s->gpus));
    s->samples_cap = s->gpm_cap = ticks * per_tick;
    s->events_cap = ticks * 4 + MAX_EVENTS_PER_TICK;
    s->errors_cap = 256;
    s->samples = calloc((size_t)s->samples_cap, sizeof(*s->samples));
    s->gpm = calloc((size_t)s->gpm_cap, sizeof(*s->gpm));
    s->events = calloc((size_t)s->events_cap, sizeof(*s->events));
    s->errors = calloc((size_t)s->errors_cap, sizeof(*s->errors));
    s->t_samples = calloc((size_t)per_tick, sizeof(*s->t_samples));
    s->t_gpm = calloc((size_t)per_tick, sizeof(*s->t_gpm));
    if (!s->gpus || !s->samples || !s->gpm || !s->events || !s->errors || !s->t_samples || !s->t_gpm) {
        free(s->gpus), free(s->samples), free(s->gpm), free(s->events), free(s->errors);
        free(s->t_samples), free(s->t_gpm), free(s);
        return NULL;
    }
    return s;
}

/* GPU i of the state, before the first tick. fields: (id, scope, rate scale) of each of the
 * N_FIELDS field values in the order of M_FIELD0..; disabled: bits of the metrics not to ask. */
EXPORT void gp_nvml_set_gpu(struct gp_nvml *s, int i, void *handle, int32_t index, void *gpm_sample0,
                            void *gpm_sample1, const uint32_t *field_ids, const uint32_t *field_scopes,
                            const double *field_rate_scale, const uint32_t *gpm_metric_ids, uint32_t disabled)
{
    struct gp_nvml_gpu *g = &s->gpus[i];
    g->handle = handle;
    g->index = index;
    g->gpm = gpm_sample0 && gpm_sample1;
    g->gpm_samples[0] = gpm_sample0;
    g->gpm_samples[1] = gpm_sample1;
    memcpy(g->field_ids, field_ids, sizeof(g->field_ids));
    memcpy(g->field_scopes, field_scopes, sizeof(g->field_scopes));
    memcpy(g->field_rate_scale, field_rate_scale, sizeof(g->field_rate_scale));
    memcpy(g->gpm_metric_ids, gpm_metric_ids, sizeof(g->gpm_metric_ids));
    g->disabled = disabled;
    g->gpm_prev = -1;
}

/* Skip GPU i until `until_ns` (a call on it hung). */
EXPORT void gp_nvml_skip_gpu(struct gp_nvml *s, int i, uint64_t until_ns)
{
    __atomic_store_n(&s->gpus[i].skip_until_ns, until_ns, __ATOMIC_RELEASE);
}

/* The call in progress: since when (0: none), which metric, which GPU. */
EXPORT uint64_t gp_nvml_current_call(struct gp_nvml *s, int32_t *metric, int32_t *gpu)
{
    uint64_t since = __atomic_load_n(&s->call_since_ns, __ATOMIC_ACQUIRE);
    *metric = s->cur_metric;
    *gpu = s->cur_gpu;
    return since;
}

/* A call of this state hung: its tick leaves as soon as the call returns, touching nothing. */
EXPORT void gp_nvml_abandon(struct gp_nvml *s)
{
    __atomic_store_n(&s->abandoned, 1, __ATOMIC_RELEASE);
}

/* Copy out and clear the rows of the ticks since the last drain; the caller's buffers hold the
 * capacities gp_nvml_capacities gave. counts: samples, gpm, events, errors, rows dropped,
 * errors dropped (the last two since the start). */
EXPORT void gp_nvml_drain(struct gp_nvml *s, struct gp_nvml_sample_row *samples, struct gp_nvml_gpm_row *gpm,
                          struct gp_nvml_event_row *events, struct gp_nvml_error_row *errors, uint64_t *counts)
{
    pthread_mutex_lock(&s->mu);
    memcpy(samples, s->samples, sizeof(*samples) * (size_t)s->samples_n);
    memcpy(gpm, s->gpm, sizeof(*gpm) * (size_t)s->gpm_n);
    memcpy(events, s->events, sizeof(*events) * (size_t)s->events_n);
    memcpy(errors, s->errors, sizeof(*errors) * (size_t)s->errors_n);
    counts[0] = (uint64_t)s->samples_n, counts[1] = (uint64_t)s->gpm_n;
    counts[2] = (uint64_t)s->events_n, counts[3] = (uint64_t)s->errors_n;
    counts[4] = s->dropped, counts[5] = s->errors_dropped;
    s->samples_n = s->gpm_n = s->events_n = s->errors_n = 0;
    pthread_mutex_unlock(&s->mu);
}

EXPORT void gp_nvml_capacities(struct gp_nvml *s, int32_t *caps)
{
    caps[0] = s->samples_cap, caps[1] = s->gpm_cap, caps[2] = s->events_cap, caps[3] = s->errors_cap;
}

/* Only once no ticker runs it any more: for an abandoned state, once gp_ticker_reap said so. */
EXPORT void gp_nvml_free(struct gp_nvml *s)
{
    pthread_mutex_destroy(&s->mu);
    free(s->gpus), free(s->samples), free(s->gpm), free(s->events), free(s->errors);
    free(s->t_samples), free(s->t_gpm), free(s);
}

EXPORT int gp_nvml_layout(int *sizes)
{
    sizes[0] = (int)sizeof(struct gp_nvml_fns);
    sizes[1] = N_FIELDS;
    sizes[2] = (int)sizeof(struct gp_nvml_sample_row);
    sizes[3] = (int)sizeof(struct gp_nvml_gpm_row);
    sizes[4] = (int)sizeof(struct gp_nvml_event_row);
    sizes[5] = (int)sizeof(struct gp_nvml_error_row);
    sizes[6] = N_METRICS;
    return 0;
}
