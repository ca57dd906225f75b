/* A watch over the requests a BPF program makes to user space (the CFI unwinder's gp_cfi_stale and
 * gp_cfi_wanted, collector/cfiunwind.py), run by ticker.c: the Python thread that serves the
 * requests sleeps until there is one, instead of waking every tick to look.
 *
 * Why: the CFI registration thread looked at the maps at 10 Hz from Python, so that a process the
 * BPF program marked (a fork, an exec, a dlopen) is registered within 0.1 s; on the VMs measured
 * the wake-ups cost twice the registrations (docs/collector.md, "Cost"). Here a C thread reads the
 * program's request counter each tick (gp_cfi_asks: key 0 of an array of one u64, raised after
 * each request's entry is made; one bpf() lookup) and calls wake() when it moved; the Python side
 * serves the maps as before and acknowledges (gp_mapwatch_ack) before it reads them, so a request
 * made after its read asks for another wake. At most one wake between two acknowledgements:
 * requests that keep coming cost at most one Python pass a tick, as before.
 *
 * Until 2026-12-07 the watch asked each request hash for its first key instead: the kernel walks
 * every bucket of an empty hash for that (4096 each), an eighth of the tick's time (perf).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/bpf.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef void (*gp_wake_fn)(void);

struct gp_mapwatch {
    pthread_mutex_t mu; /* guards asked, seen, have_seen, wakes */
    int map_fd;         /* the caller's: it outlives the watch */
    int asked;
    int have_seen; /* 0 until the first read: the first tick wakes (requests made before the watch) */
    uint64_t seen; /* the counter when the last wake was asked for */
    gp_wake_fn wake;
    uint64_t wakes;
};

/* The counter, or 0 with *ok = 0 when the lookup failed (not expected of a live map: treated as a
 * request, so that the Python side looks at the maps and reports what it finds). */
static uint64_t read_counter(const struct gp_mapwatch *w, int *ok)
{
    uint32_t key = 0;
    uint64_t value = 0;
    union bpf_attr a;
    memset(&a, 0, sizeof(a));
    a.map_fd = (uint32_t)w->map_fd;
    a.key = (uint64_t)(uintptr_t)&key;
    a.value = (uint64_t)(uintptr_t)&value;
    *ok = syscall(__NR_bpf, BPF_MAP_LOOKUP_ELEM, &a, sizeof(a)) == 0;
    return value;
}

EXPORT void gp_mapwatch_tick(struct gp_mapwatch *w, uint64_t now)
{
    (void)now;
    pthread_mutex_lock(&w->mu);
    int call = 0;
    if (!w->asked) {
        int ok;
        uint64_t n = read_counter(w, &ok);
        call = !ok || !w->have_seen || n != w->seen;
        if (call) {
            w->seen = n, w->have_seen = 1;
            w->asked = 1;
            w->wakes++;
        }
    }
    pthread_mutex_unlock(&w->mu);
    if (call)
        w->wake(); /* outside the lock: it takes Python's GIL */
}

/* A watch over map_fd (an array whose key 0 holds a u64 request counter) calling wake() when the
 * counter moves; NULL (errno set) on failure. */
EXPORT struct gp_mapwatch *gp_mapwatch_new(int map_fd, gp_wake_fn wake)
{
    if (map_fd < 0 || !wake) {
        errno = EINVAL;
        return NULL;
    }
    struct gp_mapwatch *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    pthread_mutex_init(&w->mu, NULL);
    w->map_fd = map_fd;
    w->wake = wake;
    return w;
}

/* The caller is about to read the maps: the next request may ask for a wake again. */
EXPORT void gp_mapwatch_ack(struct gp_mapwatch *w)
{
    pthread_mutex_lock(&w->mu);
    w->asked = 0;
    pthread_mutex_unlock(&w->mu);
}

EXPORT uint64_t gp_mapwatch_wakes(struct gp_mapwatch *w)
{
    pthread_mutex_lock(&w->mu);
    uint64_t n = w->wakes;
    pthread_mutex_unlock(&w->mu);
    return n;
}

/* Only once no ticker runs it any more. */
EXPORT void gp_mapwatch_free(struct gp_mapwatch *w)
{
    pthread_mutex_destroy(&w->mu);
    free(w);
}
