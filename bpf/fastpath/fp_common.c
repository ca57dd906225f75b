/* Fast path runtime: opens this process's ring lazily, claims and publishes records, counts.
 * Nothing here blocks or allocates after the ring is mapped; every failure degrades to "no
 * record" and never changes what the intercepted call does or returns. */
#define _GNU_SOURCE
#include "fp_common.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static struct gp_ring_header *ring;     /* NULL until opened; (void*)-1 when it cannot be */
static struct gp_record *slots;
static u64 mask;
static u32 my_pid;
static __thread u32 my_tid;

#define GP_TABLE 4096
struct gp_counter {
    u64 key; /* 0 empty; else a 64-bit mix of (kind, handle, peer, tag) */
    u64 value;
};
static struct gp_counter counters[GP_TABLE];
/* The requests outstanding (gp_req_put) and the persistent requests' definitions (gp_preq_put): a
 * slot a cache line, its state (REQ_FREE...) read with it. */
struct req_slot {
    struct gp_req_info info;
    u32 state;
} __attribute__((aligned(64)));
static struct req_slot reqs[GP_TABLE];
static struct req_slot preqs[GP_TABLE];

u64 gp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (u64)ts.tv_sec * 1000000000ULL + (u64)ts.tv_nsec;
}

u32 gp_pid(void)
{
    if (!my_pid)
        my_pid = (u32)getpid();
    return my_pid;
}

u32 gp_tid(void)
{
    if (!my_tid)
        my_tid = (u32)syscall(SYS_gettid);
    return my_tid;
}

/* A forked child writes to its own ring, with its own counters. */
static void gp_atfork_child(void)
{
    ring = NULL;
    slots = NULL;
    my_pid = 0;
    my_tid = 0;
    memset(counters, 0, sizeof(counters));
    memset(reqs, 0, sizeof(reqs));
    memset(preqs, 0, sizeof(preqs));
}

__attribute__((constructor)) static void gp_init(void)
{
    pthread_atfork(NULL, NULL, gp_atfork_child);
}

/* Leave a note that this process has no ring, so the collector counts it instead of never
 * knowing: <dir>/gpuprof-<job>-<pid>.failed, holding the failed step and its errno. Created
 * like the ring (no symlink followed, never an existing file), in the same checked directory. */
static void gp_mark_failed(int dfd, const char *job, const char *step, int err)
{
    if (dfd < 0)
        return;
    char name[160], text[128];
    snprintf(name, sizeof(name), "gpuprof-%s-%u.failed", job, gp_pid());
    int fd = openat(dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return;
    int n = snprintf(text, sizeof(text), "%s: errno %d\n", step, err);
    if (n > 0 && write(fd, text, (size_t)n) < 0)
        n = 0; /* nothing more to do: the file's existence is the count */
    close(fd);
}

/* The ring directory: the per-job directory the prolog made (GPUPROF_FASTPATH_DIR), opened
 * without following a symlink and accepted only when it is ours and nobody else can write into
 * it (docs/probes.md, "Who may write a ring"). -1 (errno set) otherwise. */
static int gp_open_dir(const char *dir)
{
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0)
        return -1;
    struct stat st;
    if (fstat(dfd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH))) {
        close(dfd);
        errno = EPERM;
        return -1;
    }
    return dfd;
}

static int gp_open(void)
{
    const char *dir = getenv("GPUPROF_FASTPATH_DIR");
    const char *job = getenv("GPUPROF_FASTPATH_JOB");
    const char *recs = getenv("GPUPROF_FASTPATH_RECORDS");
    if (!job || !*job)
        job = getenv("SLURM_JOB_ID");
    if (!dir || !*dir || !job || !*job || strchr(job, '/'))
        return -1; /* no per-job directory named: not a profiled job step */
    u64 cap = recs ? strtoull(recs, NULL, 10) : GP_RING_DEFAULT_RECORDS;
    if (cap < 64 || cap > (1ULL << 24) || (cap & (cap - 1)))
        cap = GP_RING_DEFAULT_RECORDS;
    int dfd = gp_open_dir(dir);
    if (dfd < 0)
        return -1; /* the collector sees the bad directory itself and reports it */
    char path[160];
    size_t size = sizeof(struct gp_ring_header) + cap * sizeof(struct gp_record);
    int fd = -1;
    /* gpuprof-<job>-<pid>, or .1 ... .7 when a process of the same pid had one before (pids are
     * reused in long jobs); never an existing file, never through a symlink. */
    for (int i = 0; i < 8 && fd < 0; i++) {
        if (i == 0)
            snprintf(path, sizeof(path), "gpuprof-%s-%u", job, gp_pid());
        else
            snprintf(path, sizeof(path), "gpuprof-%s-%u.%d", job, gp_pid(), i);
        fd = openat(dfd, path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0 && errno != EEXIST)
            break;
    }
    if (fd < 0) {
        gp_mark_failed(dfd, job, "create", errno);
        close(dfd);
        return -1;
    }
    if (ftruncate(fd, (off_t)size) != 0) {
        int err = errno;
        close(fd);
        unlinkat(dfd, path, 0);
        gp_mark_failed(dfd, job, "ftruncate", err);
        close(dfd);
        return -1;
    }
    /* MAP_POPULATE: the ring's pages are allocated here, once, at the process's first record
     * (MPI_Init, a communicator's creation) instead of one page fault every 19 records inside
     * the application's calls; on a VM a first touch costs several microseconds. */
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    int map_err = errno;
    close(fd);
    if (p == MAP_FAILED) {
        unlinkat(dfd, path, 0);
        gp_mark_failed(dfd, job, "mmap", map_err);
        close(dfd);
        return -1;
    }
    close(dfd);
    struct gp_ring_header *h = p;
    h->version = GP_RING_VERSION;
    h->record_size = sizeof(struct gp_record);
    h->capacity = cap;
    h->pid = gp_pid();
    h->header_size = sizeof(struct gp_ring_header);
    const char *node = getenv("SLURMD_NODENAME");
    if (node)
        strncpy(h->node, node, sizeof(h->node) - 1);
    slots = (struct gp_record *)((char *)p + sizeof(struct gp_ring_header));
    mask = cap - 1;
    /* magic last: the collector reads a ring only once it is complete */
    __atomic_store_n(&h->magic, GP_RING_MAGIC, __ATOMIC_RELEASE);
    ring = h;
    return 0;
}

struct gp_record *gp_claim(u32 kind, u64 *pos_out)
{
    struct gp_ring_header *h = __atomic_load_n(&ring, __ATOMIC_ACQUIRE);
    if (h == (void *)-1)
        return NULL;
    if (!h) {
        static int opening;
        /* first record of the process: one thread opens, the others skip their record */
        if (__atomic_exchange_n(&opening, 1, __ATOMIC_ACQ_REL))
            return NULL;
        if (gp_open() != 0)
            __atomic_store_n(&ring, (void *)-1, __ATOMIC_RELEASE);
        __atomic_store_n(&opening, 0, __ATOMIC_RELEASE);
        h = __atomic_load_n(&ring, __ATOMIC_ACQUIRE);
        if (!h || h == (void *)-1)
            return NULL;
    }
    u64 pos = __atomic_load_n(&h->head, __ATOMIC_RELAXED);
    for (;;) {
        u64 tail = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
        if (pos - tail > mask) {
            __atomic_fetch_add(&h->dropped, 1, __ATOMIC_RELAXED);
            return NULL;
        }
        if (__atomic_compare_exchange_n(&h->head, &pos, pos + 1, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            break;
    }
    struct gp_record *rec = &slots[pos & mask];
    rec->kind = kind;
    *pos_out = pos;
    return rec;
}

void gp_count_drops(u64 n)
{
    struct gp_ring_header *h = __atomic_load_n(&ring, __ATOMIC_ACQUIRE);
    if (n && h && h != (void *)-1)
        __atomic_fetch_add(&h->dropped, n, __ATOMIC_RELAXED);
}

void gp_count_drop(void)
{
    gp_count_drops(1);
}

void gp_publish(struct gp_record *rec, u64 pos)
{
    __atomic_store_n(&rec->seq, pos + 1, __ATOMIC_RELEASE);
}

void gp_emit_call_span(u8 library, u16 op, u64 t0, u64 t1, u64 handle, u64 seq, u64 bytes, s32 peer, s32 tag, int rc,
                       u64 aux, u8 flags)
{
    u64 pos;
    struct gp_record *r = gp_claim(GP_REC_CALL, &pos);
    if (!r)
        return;
    struct gp_call *c = &r->u.call;
    c->t_enter_ns = t0;
    c->t_exit_ns = t1;
    c->handle = handle;
    c->seq = seq;
    c->bytes = bytes;
    c->aux = aux;
    c->pid = gp_pid();
    c->tid = gp_tid();
    c->peer = peer;
    c->tag = tag;
    c->ret = rc;
    c->op = op;
    c->library = library;
    c->flags = flags;
    gp_publish(r, pos);
}

void gp_emit_call(u8 library, u16 op, u64 t0, u64 handle, u64 seq, u64 bytes, s32 peer, s32 tag, int rc, u64 aux,
                  u8 flags)
{
    gp_emit_call_span(library, op, t0, gp_now(), handle, seq, bytes, peer, tag, rc, aux, flags);
}

static u64 gp_mix(u32 kind, u64 handle, s32 peer, s32 tag)
{
    u64 x = handle * 0x9E3779B97F4A7C15ULL;
    x ^= ((u64)kind << 56) ^ ((u64)(u32)peer << 24) ^ (u64)(u32)tag;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 32;
    return x | 1;
}

static struct gp_counter *gp_counter(u32 kind, u64 handle, s32 peer, s32 tag)
{
    u64 key = gp_mix(kind, handle, peer, tag);
    for (u32 i = 0; i < 64; i++) {
        struct gp_counter *c = &counters[(key + i) & (GP_TABLE - 1)];
        u64 cur = __atomic_load_n(&c->key, __ATOMIC_ACQUIRE);
        if (cur == key)
            return c;
        if (cur == 0) {
            u64 zero = 0;
            if (__atomic_compare_exchange_n(&c->key, &zero, key, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                return c;
            if (zero == key)
                return c;
        }
    }
    return NULL;
}

u64 gp_next(u32 kind, u64 handle, s32 peer, s32 tag)
{
    struct gp_counter *c = gp_counter(kind, handle, peer, tag);
    return c ? __atomic_fetch_add(&c->value, 1, __ATOMIC_RELAXED) : GP_SEQ_NONE;
}

void gp_reset(u32 kind, u64 handle)
{
    struct gp_counter *c = gp_counter(kind, handle, 0, 0);
    if (c)
        __atomic_store_n(&c->value, 0, __ATOMIC_RELAXED);
}

/* A request is kept in the first free slot of GP_REQ_PROBES from its handle's: the same handle
 * outstanding several times (fp_common.h) takes as many slots. A slot that holds the same handle
 * written to the same variable is an earlier request completed where no wrapper saw it (a send
 * freed by MPI_Request_free), and is reused; a full window loses its first slot's request. */
#define GP_REQ_PROBES 8
static u64 req_puts; /* the order of puts (a race between threads costs only a tie) */

/* Each slot's state. A thread writes or reads a slot only after it moved the slot's state to
 * REQ_BUSY: in a process given MPI_THREAD_MULTIPLE by a compare-and-swap, so that two threads
 * putting requests of one handle at once (Open MPI's sends completed at once share one) never fill
 * the same slot, and no thread takes a request half written; in any other process, where one
 * thread at a time calls MPI, by a plain store (a compare-and-swap costs about as much as the rest
 * of a put, on every request of a code that makes 100 000 a second). */
enum { REQ_FREE, REQ_FULL, REQ_BUSY };
static int req_concurrent;

void gp_req_set_concurrent(int concurrent)
{
    req_concurrent = concurrent;
}

static inline int slot_claim(struct req_slot *slot, u32 from)
{
    if (!req_concurrent) {
        if (slot->state != from)
            return 0;
        slot->state = REQ_BUSY;
        return 1;
    }
    return __atomic_compare_exchange_n(&slot->state, &from, REQ_BUSY, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
}

static inline void slot_release(struct req_slot *slot, u32 to)
{
    __atomic_store_n(&slot->state, to, __ATOMIC_RELEASE);
}

static inline u32 slot_state(const struct req_slot *slot)
{
    return __atomic_load_n(&slot->state, __ATOMIC_ACQUIRE);
}

/* A slot's field read before the slot is claimed: another thread may be writing it (checked again
 * once claimed). */
#define PEEK(field) __atomic_load_n(&(field), __ATOMIC_RELAXED)

static inline int same_request(const struct req_slot *slot, u64 req, u64 where)
{
    return PEEK(slot->info.req) == req && PEEK(slot->info.where) == where;
}

void gp_req_put(const struct gp_req_info *info)
{
    u64 home = gp_mix(9, info->req, 0, 0);
    struct req_slot *slot = NULL;
    for (u32 k = 0; k < GP_REQ_PROBES && !slot; k++) {
        struct req_slot *r = &reqs[(home + k) & (GP_TABLE - 1)];
        u32 state = slot_state(r);
        if (state == REQ_FREE && slot_claim(r, REQ_FREE))
            slot = r;
        else if (state == REQ_FULL && same_request(r, info->req, info->where) && slot_claim(r, REQ_FULL)) {
            if (same_request(r, info->req, info->where))
                slot = r;
            else
                slot_release(r, REQ_FULL); /* taken and put again by another thread meanwhile */
        }
    }
    if (!slot) {
        slot = &reqs[home & (GP_TABLE - 1)]; /* the window is full: its first request is lost */
        if (!slot_claim(slot, REQ_FULL))
            return; /* ...or, being taken or written by another thread, this one: its completion names none */
    }
    slot->info = *info;
    slot->info.order = ++req_puts;
    slot_release(slot, REQ_FULL);
}

/* The request of handle `req` written to `where`; else the latest of that handle in the window: a
 * caller that waits on copies of its variables (mpi4py) has the latest one outstanding, an older
 * one of the same handle may be a request completed where no wrapper saw it. */
int gp_req_take(u64 req, u64 where, struct gp_req_info *out)
{
    if (req == 0)
        return 0;
    u64 home = gp_mix(9, req, 0, 0);
    /* A slot chosen and then claimed by another thread first is looked for again: a few times, as
     * each retry follows another thread's completed put or take. */
    for (int attempt = 0; attempt < 4; attempt++) {
        struct req_slot *found = NULL;
        int exact = 0;
        u64 latest = 0;
        for (u32 k = 0; k < GP_REQ_PROBES; k++) {
            struct req_slot *r = &reqs[(home + k) & (GP_TABLE - 1)];
            if (slot_state(r) != REQ_FULL || PEEK(r->info.req) != req)
                continue;
            if (PEEK(r->info.where) == where) {
                found = r;
                exact = 1;
                break;
            }
            u64 order = PEEK(r->info.order);
            if (!found || order > latest) {
                found = r;
                latest = order;
            }
        }
        if (!found)
            return 0;
        if (!slot_claim(found, REQ_FULL))
            continue;
        if (found->info.req != req || (exact && found->info.where != where)) {
            slot_release(found, REQ_FULL);
            continue;
        }
        *out = found->info;
        found->info.req = 0;
        slot_release(found, REQ_FREE);
        return 1;
    }
    return 0;
}

/* A persistent request's definition: one slot a request, by its handle; a later definition of
 * another request in the same slot replaces it (its starts then record nothing). A slot another
 * thread holds is waited for by yielding, a few times: it holds it for a copy of 56 bytes. */
#define PREQ_ATTEMPTS 4

static inline struct req_slot *preq_slot(u64 req)
{
    return &preqs[gp_mix(10, req, 0, 0) & (GP_TABLE - 1)];
}

void gp_preq_put(const struct gp_req_info *info)
{
    struct req_slot *slot = preq_slot(info->req);
    for (int attempt = 0; attempt < PREQ_ATTEMPTS; attempt++) {
        u32 state = slot_state(slot);
        if (state != REQ_BUSY && slot_claim(slot, state)) {
            slot->info = *info;
            slot_release(slot, REQ_FULL);
            return;
        }
        sched_yield();
    }
    gp_count_drop(); /* the definition is lost: counted with the ring's drops */
}

int gp_preq_get(u64 req, struct gp_req_info *out)
{
    if (req == 0)
        return 0;
    struct req_slot *slot = preq_slot(req);
    for (int attempt = 0; attempt < PREQ_ATTEMPTS; attempt++) {
        u32 state = slot_state(slot);
        if (state == REQ_FREE || (state == REQ_FULL && PEEK(slot->info.req) != req))
            return 0;
        if (state == REQ_FULL && slot_claim(slot, REQ_FULL)) {
            int mine = slot->info.req == req;
            if (mine)
                *out = slot->info;
            slot_release(slot, REQ_FULL);
            return mine;
        }
        sched_yield();
    }
    return 0;
}

void gp_preq_drop(u64 req)
{
    struct req_slot *slot = preq_slot(req);
    if (slot_state(slot) == REQ_FULL && PEEK(slot->info.req) == req && slot_claim(slot, REQ_FULL))
        slot_release(slot, slot->info.req == req ? REQ_FREE : REQ_FULL);
}

u64 gp_fnv1a64(const void *data, unsigned long len)
{
    const unsigned char *p = data;
    u64 h = 0xCBF29CE484222325ULL;
    for (unsigned long i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001B3ULL;
    }
    return h;
}

void gp_send_string(u32 kind, u32 id, const char *s, size_t n, int truncated)
{
    u8 parts = (u8)(n ? (n + GP_NVTX_PART_BYTES - 1) / GP_NVTX_PART_BYTES : 1);
    for (u8 p = 0; p < parts; p++) {
        u64 pos;
        struct gp_record *r = gp_claim(kind, &pos);
        if (!r)
            return;
        struct gp_nvtx_string *m = &r->u.nvtx_string;
        size_t off = (size_t)p * GP_NVTX_PART_BYTES, len = n - off < GP_NVTX_PART_BYTES ? n - off : GP_NVTX_PART_BYTES;
        m->string_id = id;
        m->total_len = (u16)n;
        m->part = p;
        m->flags = truncated ? GP_NVTX_S_TRUNCATED : 0;
        m->pad = 0;
        memset(m->text, 0, sizeof(m->text));
        if (n)
            memcpy(m->text, s + off, len);
        gp_publish(r, pos);
    }
}
