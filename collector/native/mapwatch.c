/* A watch over a BPF hash map that the BPF program fills with requests for user space (the CFI
 * unwinder's gp_cfi_stale, collector/cfiunwind.py), run by ticker.c: the Python thread that serves
 * the requests sleeps until there is one, instead of waking every tick to look.
 *
 * Why: the CFI registration thread looked at the map at 10 Hz from Python, so that a process the
 * BPF program marked (a fork, an exec, a dlopen) is registered within 0.1 s; on the VMs measured
 * the wake-ups cost twice the registrations (docs/collector.md, "Cost"). Here a C thread asks the
 * kernel for the map's first key each tick (one bpf() call) and calls wake() when there is one; the
 * Python side serves the map as before and acknowledges (gp_mapwatch_ack) before it reads it, so a
 * request made after its read asks for another wake. At most one wake between two
 * acknowledgements: requests that keep coming cost at most one Python pass a tick, as before.
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
#define GP_MAPWATCH_MAX_KEY 64

typedef void (*gp_wake_fn)(void);

struct gp_mapwatch {
    pthread_mutex_t mu; /* guards asked, wakes */
    int map_fd;         /* the caller's: it outlives the watch */
    int key_size;
    int asked;
    gp_wake_fn wake;
    uint64_t wakes;
};

static int map_empty(const struct gp_mapwatch *w)
{
    unsigned char next[GP_MAPWATCH_MAX_KEY];
    union bpf_attr a;
    memset(&a, 0, sizeof(a));
    a.map_fd = (uint32_t)w->map_fd;
    a.key = 0; /* no key: the first one */
    a.next_key = (uint64_t)(uintptr_t)next;
    /* ENOENT: empty. Another error (not expected of a live map) is treated as a request, so that
     * the Python side looks at the map and reports what it finds. */
    return syscall(__NR_bpf, BPF_MAP_GET_NEXT_KEY, &a, sizeof(a)) != 0 && errno == ENOENT;
}

EXPORT void gp_mapwatch_tick(struct gp_mapwatch *w, uint64_t now)
{
    (void)now;
    pthread_mutex_lock(&w->mu);
    int call = !w->asked && !map_empty(w);
    if (call) {
        w->asked = 1;
        w->wakes++;
    }
    pthread_mutex_unlock(&w->mu);
    if (call)
        w->wake(); /* outside the lock: it takes Python's GIL */
}

/* A watch over map_fd (keys of key_size bytes) calling wake() when it holds an entry; NULL (errno
 * set) on failure. */
EXPORT struct gp_mapwatch *gp_mapwatch_new(int map_fd, int key_size, gp_wake_fn wake)
{
    if (map_fd < 0 || key_size <= 0 || key_size > GP_MAPWATCH_MAX_KEY || !wake) {
        errno = EINVAL;
        return NULL;
    }
    struct gp_mapwatch *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    pthread_mutex_init(&w->mu, NULL);
    w->map_fd = map_fd;
    w->key_size = key_size;
    w->wake = wake;
    return w;
}

/* The caller is about to read the map: the next entry may ask for a wake again. */
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
