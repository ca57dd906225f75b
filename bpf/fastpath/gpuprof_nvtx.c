/* NVTX v3 injection library (libgpuprof_nvtx.so; NVTX_INJECTION64_PATH=<its path>, set by the
 * TaskProlog when the job asks for NVTX, docs/config.md): every NVTX range of the application,
 * without touching it, into this process's shared-memory ring (fp_common.c), which the collector
 * drains into /nvtx/ranges and /nvtx/strings (collector/sources/fastpath.py).
 *
 * Handled: push/pop and start/end ranges of the default domain and of created domains (ASCII,
 * wide and registered messages), registered strings, categories and colors, per thread. Marks
 * and resource naming are ignored. A range is one record written when it ends; a string (domain
 * name, registered string, message) is sent once per process under a 32-bit id, in 60-byte parts,
 * at most GP_NVTX_STRING_MAX bytes (cut on a UTF-8 boundary and flagged truncated beyond).
 * Ranges still open when the process exits are written by the library's destructor with
 * t_end_ns = 0 (docs/probes.md, "NVTX").
 *
 * Never blocking the application: fixed tables, no allocation; a push deeper than STACK_DEPTH, a
 * start/end range when OPEN_MAX are open, a string when the string table is full, or a record
 * when the ring is full, is dropped and counted in the ring's drop counter.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "fp_common.h"
#include "fp_resolve.h"
#include "nvtx_injection_abi.h"

#define STACK_DEPTH 64
#define THREADS 512
#define OPEN_MAX 4096   /* start/end ranges open at once */
#define STRINGS 16384   /* distinct strings of a process (a power of two) */
#define DOMAINS 256
#define REGISTERED 8192 /* registered string handles */

#define F_OPEN_AT_EXIT 1 /* gp_nvtx_range.flags: still open when the process (or thread) ended */
#define F_HAS_COLOR 2

struct entry {
    u64 t_start;
    u32 domain_id, name_id, category, color;
    u8 flags;
};

struct stack {
    u32 used; /* 0 free, 1 claimed by a live thread */
    u32 tid;
    u32 depth;
    struct entry e[STACK_DEPTH];
};

struct open_range {
    u32 state; /* 0 free, 1 claiming, 2 open */
    u32 gen;
    u32 tid;
    struct entry e;
};

struct handle {
    u32 id; /* string id */
};

static struct stack stacks[THREADS];
static struct open_range opens[OPEN_MAX];
static u64 open_cursor;
static struct {
    u64 hash; /* 0 empty */
    u32 id;
} strings[STRINGS];
static u32 next_string_id = 1;
static struct handle domains[DOMAINS], registered[REGISTERED];
static u32 n_domains, n_registered;
static __thread struct stack *my_stack;
static __thread int my_stack_none; /* no slot left for this thread: its pushes are dropped */
static pthread_key_t stack_key;

static void drop(void)
{
    gp_count_drop();
}

/* --- strings -------------------------------------------------------------------------------------- */
/* The length to keep of s (n bytes): at most GP_NVTX_STRING_MAX, cut before a UTF-8 continuation. */
static size_t keep_len(const char *s, size_t n, int *truncated)
{
    *truncated = n > GP_NVTX_STRING_MAX;
    if (!*truncated)
        return n;
    size_t k = GP_NVTX_STRING_MAX;
    while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80)
        k--;
    return k;
}

static void send_string(u32 id, const char *s, size_t n, int truncated)
{
    gp_send_string(GP_REC_NVTX_STRING, id, s, n, truncated);
}

/* The id of a string's text, sent the first time this process names it; 0 when the table is full. */
static u32 string_id(const char *s)
{
    if (!s)
        return 0;
    size_t n = strnlen(s, GP_NVTX_STRING_MAX + 1);
    int truncated;
    n = keep_len(s, n, &truncated);
    u64 h = gp_fnv1a64(s, n) ^ ((u64)truncated << 63);
    if (!h)
        h = 1;
    for (u32 i = 0; i < 64; i++) {
        u32 slot = (u32)(h + i) & (STRINGS - 1);
        u64 cur = __atomic_load_n(&strings[slot].hash, __ATOMIC_ACQUIRE);
        if (cur == h) {
            /* the claiming thread is sending the string and then stores its id: wait a little, never
             * long (it may be preempted): this range then goes without its name, counted */
            for (u32 spin = 0; spin < 4096; spin++) {
                u32 id = __atomic_load_n(&strings[slot].id, __ATOMIC_ACQUIRE);
                if (id)
                    return id;
                __builtin_ia32_pause();
            }
            drop();
            return 0;
        }
        if (cur == 0) {
            u64 zero = 0;
            if (__atomic_compare_exchange_n(&strings[slot].hash, &zero, h, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                u32 id = __atomic_fetch_add(&next_string_id, 1, __ATOMIC_RELAXED);
                send_string(id, s, n, truncated);
                __atomic_store_n(&strings[slot].id, id, __ATOMIC_RELEASE);
                return id;
            }
            if (zero == h) {
                i--; /* another thread claimed it for this very string: read its id */
                continue;
            }
        }
    }
    drop();
    return 0;
}

/* wchar_t (UTF-32 on Linux) -> UTF-8, at most GP_NVTX_STRING_MAX + 1 bytes (so a cut shows). */
static const char *utf8_of(const wchar_t *w, char *buf, size_t size)
{
    size_t k = 0;
    for (; w && *w && k + 4 < size; w++) {
        u32 c = (u32)*w;
        if (c < 0x80) {
            buf[k++] = (char)c;
        } else if (c < 0x800) {
            buf[k++] = (char)(0xC0 | (c >> 6));
            buf[k++] = (char)(0x80 | (c & 0x3F));
        } else if (c < 0x10000) {
            buf[k++] = (char)(0xE0 | (c >> 12));
            buf[k++] = (char)(0x80 | ((c >> 6) & 0x3F));
            buf[k++] = (char)(0x80 | (c & 0x3F));
        } else if (c < 0x110000) {
            buf[k++] = (char)(0xF0 | (c >> 18));
            buf[k++] = (char)(0x80 | ((c >> 12) & 0x3F));
            buf[k++] = (char)(0x80 | ((c >> 6) & 0x3F));
            buf[k++] = (char)(0x80 | (c & 0x3F));
        }
    }
    buf[k] = 0;
    return buf;
}

static u32 wstring_id(const wchar_t *w)
{
    char buf[GP_NVTX_STRING_MAX + 8];
    return w ? string_id(utf8_of(w, buf, sizeof(buf))) : 0;
}

static u32 handle_id(const void *h, struct handle *pool, u32 n)
{
    const struct handle *p = h;
    if (!p || p < pool || p >= pool + n)
        return 0;
    return p->id;
}

static u32 domain_id(const void *domain)
{
    return handle_id(domain, domains, DOMAINS); /* 0: the default domain (or not one of ours) */
}

/* --- ranges ------------------------------------------------------------------------------------------ */
static void fill(struct entry *e, u32 domain, const gp_nvtxEventAttributes_t *a)
{
    e->domain_id = domain;
    e->name_id = 0;
    e->category = 0;
    e->color = 0;
    e->flags = 0;
    if (!a)
        return;
    /* fields past `size` were not filled in by an older caller */
    if (a->size >= offsetof(gp_nvtxEventAttributes_t, colorType))
        e->category = a->category;
    if (a->size >= offsetof(gp_nvtxEventAttributes_t, payloadType) && a->colorType == GP_NVTX_COLOR_ARGB) {
        e->color = a->color;
        e->flags |= F_HAS_COLOR;
    }
    if (a->size < sizeof(gp_nvtxEventAttributes_t))
        return;
    switch (a->messageType) {
    case GP_NVTX_MESSAGE_TYPE_ASCII:
        e->name_id = string_id(a->message.ascii);
        break;
    case GP_NVTX_MESSAGE_TYPE_UNICODE:
        e->name_id = wstring_id(a->message.unicode);
        break;
    case GP_NVTX_MESSAGE_TYPE_REGISTERED:
        e->name_id = handle_id(a->message.registered, registered, REGISTERED);
        break;
    default:
        break;
    }
}

static void emit(const struct entry *e, u64 t_end, u32 tid, u16 depth, u8 kind, u8 flags)
{
    u64 pos;
    struct gp_record *r = gp_claim(GP_REC_NVTX_RANGE, &pos);
    if (!r)
        return;
    struct gp_nvtx_range *g = &r->u.nvtx_range;
    g->t_start_ns = e->t_start;
    g->t_end_ns = t_end;
    g->tid = tid;
    g->domain_id = e->domain_id;
    g->name_id = e->name_id;
    g->category = e->category;
    g->depth = depth;
    g->kind = kind;
    g->flags = (u8)(e->flags | flags);
    g->color = e->color;
    gp_publish(r, pos);
}

/* A thread's open push/pop ranges, written (open) when it ends. */
static void flush_stack(struct stack *s)
{
    for (u32 i = 0; i < s->depth && i < STACK_DEPTH; i++)
        emit(&s->e[i], 0, s->tid, (u16)i, 0, F_OPEN_AT_EXIT);
    s->depth = 0;
}

static void thread_gone(void *p)
{
    struct stack *s = p;
    flush_stack(s);
    __atomic_store_n(&s->used, 0, __ATOMIC_RELEASE);
}

static struct stack *stack_of_thread(void)
{
    if (my_stack)
        return my_stack;
    if (my_stack_none)
        return NULL;
    for (u32 i = 0; i < THREADS; i++) {
        u32 zero = 0;
        if (__atomic_compare_exchange_n(&stacks[i].used, &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            stacks[i].tid = gp_tid();
            stacks[i].depth = 0;
            my_stack = &stacks[i];
            pthread_setspecific(stack_key, my_stack);
            return my_stack;
        }
    }
    my_stack_none = 1;
    return NULL;
}

static int push(u32 domain, const gp_nvtxEventAttributes_t *a, const char *ascii)
{
    struct stack *s = stack_of_thread();
    if (!s) {
        drop();
        return -1;
    }
    u32 level = s->depth++;
    if (level >= STACK_DEPTH) {
        drop(); /* deeper than recorded: counted, and its pop is matched by depth */
        return (int)level;
    }
    struct entry *e = &s->e[level];
    fill(e, domain, a);
    if (ascii)
        e->name_id = string_id(ascii);
    e->t_start = gp_now();
    return (int)level;
}

static int pop(u32 domain)
{
    u64 now = gp_now();
    struct stack *s = my_stack;
    if (!s || s->depth == 0)
        return -1; /* a pop without a push: NVTX's own answer */
    u32 level = --s->depth;
    if (level >= STACK_DEPTH)
        return (int)level;
    /* NVTX keeps one stack per domain; this is one per thread: the depth counts the thread's
     * ranges of the same domain below this one. */
    u16 depth = 0;
    for (u32 i = 0; i < level; i++)
        depth += s->e[i].domain_id == s->e[level].domain_id;
    emit(&s->e[level], now, s->tid, depth, 0, 0);
    return (int)level;
}

static gp_nvtxRangeId_t start(u32 domain, const gp_nvtxEventAttributes_t *a, const char *ascii)
{
    for (u32 i = 0; i < 16; i++) {
        u32 slot = (u32)(__atomic_fetch_add(&open_cursor, 1, __ATOMIC_RELAXED) % OPEN_MAX);
        struct open_range *o = &opens[slot];
        u32 zero = 0;
        if (!__atomic_compare_exchange_n(&o->state, &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;
        fill(&o->e, domain, a);
        if (ascii)
            o->e.name_id = string_id(ascii);
        o->tid = gp_tid();
        u32 gen = o->gen + 1;
        o->gen = gen ? gen : 1;
        o->e.t_start = gp_now();
        __atomic_store_n(&o->state, 2, __ATOMIC_RELEASE);
        return ((u64)o->gen << 32) | (slot + 1);
    }
    drop();
    return 0;
}

static void end(gp_nvtxRangeId_t id)
{
    u64 now = gp_now();
    u32 slot = (u32)(id & 0xffffffffu);
    if (slot == 0 || slot > OPEN_MAX)
        return;
    struct open_range *o = &opens[slot - 1];
    u32 two = 2;
    if (o->gen != (u32)(id >> 32) || !__atomic_compare_exchange_n(&o->state, &two, 1, 0, __ATOMIC_ACQ_REL,
                                                                   __ATOMIC_RELAXED))
        return; /* ended twice, or not one of ours */
    emit(&o->e, now, o->tid, 0, 1, 0);
    __atomic_store_n(&o->state, 0, __ATOMIC_RELEASE);
}

/* --- the NVTX calls ----------------------------------------------------------------------------------- */
static int RangePushEx(const gp_nvtxEventAttributes_t *a) { return push(0, a, NULL); }
static int RangePushA(const char *m) { return push(0, NULL, m); }
static int RangePushW(const wchar_t *m)
{
    char buf[GP_NVTX_STRING_MAX + 8];
    return push(0, NULL, m ? utf8_of(m, buf, sizeof(buf)) : NULL);
}
static int RangePop(void) { return pop(0); }
static gp_nvtxRangeId_t RangeStartEx(const gp_nvtxEventAttributes_t *a) { return start(0, a, NULL); }
static gp_nvtxRangeId_t RangeStartA(const char *m) { return start(0, NULL, m); }
static gp_nvtxRangeId_t RangeStartW(const wchar_t *m)
{
    char buf[GP_NVTX_STRING_MAX + 8];
    return start(0, NULL, m ? utf8_of(m, buf, sizeof(buf)) : NULL);
}
static void RangeEnd(gp_nvtxRangeId_t id) { end(id); }
static void MarkEx(const gp_nvtxEventAttributes_t *a) {}
static void MarkA(const char *m) {}
static void MarkW(const wchar_t *m) {}
static void NameCategoryA(uint32_t c, const char *name) {}
static void NameCategoryW(uint32_t c, const wchar_t *name) {}

static int DomainRangePushEx(const void *d, const gp_nvtxEventAttributes_t *a) { return push(domain_id(d), a, NULL); }
static int DomainRangePop(const void *d) { return pop(domain_id(d)); }
static gp_nvtxRangeId_t DomainRangeStartEx(const void *d, const gp_nvtxEventAttributes_t *a)
{
    return start(domain_id(d), a, NULL);
}
static void DomainRangeEnd(const void *d, gp_nvtxRangeId_t id) { end(id); }
static void DomainMarkEx(const void *d, const gp_nvtxEventAttributes_t *a) {}
static void DomainNameCategoryA(const void *d, uint32_t c, const char *name) {}
static void DomainNameCategoryW(const void *d, uint32_t c, const wchar_t *name) {}

static void *new_handle(struct handle *pool, u32 *n, u32 max, u32 id)
{
    u32 i = __atomic_fetch_add(n, 1, __ATOMIC_RELAXED);
    if (i >= max || !id) {
        drop();
        return NULL; /* NVTX treats a NULL domain as the default one, a NULL string as no message */
    }
    pool[i].id = id;
    return &pool[i];
}

static void *DomainCreateA(const char *name) { return new_handle(domains, &n_domains, DOMAINS, string_id(name)); }
static void *DomainCreateW(const wchar_t *name) { return new_handle(domains, &n_domains, DOMAINS, wstring_id(name)); }
static void DomainDestroy(const void *d) {}
static void *DomainRegisterStringA(const void *d, const char *s)
{
    return new_handle(registered, &n_registered, REGISTERED, string_id(s));
}
static void *DomainRegisterStringW(const void *d, const wchar_t *s)
{
    return new_handle(registered, &n_registered, REGISTERED, wstring_id(s));
}

/* size: the highest callback id of the module (NVTX gives the table's length less one) */
static void set(gp_NvtxFunctionTable table, unsigned int size, unsigned int cbid, void *fn)
{
    if (cbid <= size && table[cbid])
        *table[cbid] = (gp_NvtxFunctionPointer)fn;
}

/* Open ranges of the threads still alive and start/end ranges never ended: written at exit. */
__attribute__((destructor)) static void flush_at_exit(void)
{
    for (u32 i = 0; i < THREADS; i++)
        if (__atomic_load_n(&stacks[i].used, __ATOMIC_ACQUIRE))
            flush_stack(&stacks[i]);
    for (u32 i = 0; i < OPEN_MAX; i++) {
        u32 two = 2;
        if (__atomic_compare_exchange_n(&opens[i].state, &two, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            emit(&opens[i].e, 0, opens[i].tid, 0, 1, F_OPEN_AT_EXIT);
    }
}

/* A forked child starts with no open range of its own. */
static void nvtx_atfork_child(void)
{
    memset(stacks, 0, sizeof(stacks));
    memset(opens, 0, sizeof(opens));
    memset(strings, 0, sizeof(strings));
    my_stack = NULL;
    my_stack_none = 0;
}

GP_EXPORT int InitializeInjectionNvtx2(gp_NvtxGetExportTableFunc_t get_table)
{
    /* Not a profiled job step (no ring directory named): decline, NVTX stays inert. */
    const char *dir = getenv("GPUPROF_FASTPATH_DIR");
    if (!dir || !*dir || !get_table)
        return 0;
    const gp_NvtxExportTableCallbacks *cb = get_table(GP_NVTX_ETID_CALLBACKS);
    if (!cb || cb->struct_size < sizeof(*cb) || !cb->GetModuleFunctionTable)
        return 0;
    const gp_NvtxExportTableVersionInfo *vi = get_table(GP_NVTX_ETID_VERSIONINFO);
    if (vi && vi->struct_size >= sizeof(*vi) && vi->SetInjectionNvtxVersion)
        vi->SetInjectionNvtxVersion(3);
    gp_NvtxFunctionTable t;
    unsigned int n;
    if (!cb->GetModuleFunctionTable(GP_NVTX_CB_MODULE_CORE, &t, &n) || !t)
        return 0;
    pthread_key_create(&stack_key, thread_gone);
    pthread_atfork(NULL, NULL, nvtx_atfork_child);
    set(t, n, GP_CORE_MarkEx, MarkEx);
    set(t, n, GP_CORE_MarkA, MarkA);
    set(t, n, GP_CORE_MarkW, MarkW);
    set(t, n, GP_CORE_RangeStartEx, RangeStartEx);
    set(t, n, GP_CORE_RangeStartA, RangeStartA);
    set(t, n, GP_CORE_RangeStartW, RangeStartW);
    set(t, n, GP_CORE_RangeEnd, RangeEnd);
    set(t, n, GP_CORE_RangePushEx, RangePushEx);
    set(t, n, GP_CORE_RangePushA, RangePushA);
    set(t, n, GP_CORE_RangePushW, RangePushW);
    set(t, n, GP_CORE_RangePop, RangePop);
    set(t, n, GP_CORE_NameCategoryA, NameCategoryA);
    set(t, n, GP_CORE_NameCategoryW, NameCategoryW);
    if (cb->GetModuleFunctionTable(GP_NVTX_CB_MODULE_CORE2, &t, &n) && t) {
        set(t, n, GP_CORE2_DomainMarkEx, DomainMarkEx);
        set(t, n, GP_CORE2_DomainRangeStartEx, DomainRangeStartEx);
        set(t, n, GP_CORE2_DomainRangeEnd, DomainRangeEnd);
        set(t, n, GP_CORE2_DomainRangePushEx, DomainRangePushEx);
        set(t, n, GP_CORE2_DomainRangePop, DomainRangePop);
        set(t, n, GP_CORE2_DomainNameCategoryA, DomainNameCategoryA);
        set(t, n, GP_CORE2_DomainNameCategoryW, DomainNameCategoryW);
        set(t, n, GP_CORE2_DomainRegisterStringA, DomainRegisterStringA);
        set(t, n, GP_CORE2_DomainRegisterStringW, DomainRegisterStringW);
        set(t, n, GP_CORE2_DomainCreateA, DomainCreateA);
        set(t, n, GP_CORE2_DomainCreateW, DomainCreateW);
        set(t, n, GP_CORE2_DomainDestroy, DomainDestroy);
    }
    return 1;
}
