/* The fast path's watch over its rings (collector/sources/fastpath.py), run by ticker.c: lets the
 * Python drain run once a second instead of five times, and still drain early when a burst needs
 * it.
 *
 * Why: the fast path's 5 Hz Python thread cost more in wake-ups than in the rings' reads (the
 * reads are a few preads of records just written; docs/collector.md, "Cost"), and it ran at 5 Hz
 * only so that a burst (NetPIPE: ~100k calls in a second, one process) cannot fill a ring of 65536
 * records between two drains. Here a C thread looks at each ring's fill every tick (one 72-byte
 * pread of head and tail: no copy of the records, so no buffer beyond the rings themselves) and at
 * the ring directory's mtime (a new ring or `.failed` note), and asks Python for a drain at once
 * (the wake callback: the daemon's wake-up of the source's thread) when a ring holds more than its
 * threshold or the directory changed. The rings are still read, checked and converted by Python's
 * drain (fastpath.Ring.drain), so the rows are the same whichever thread asked for the drain.
 *
 * Who owns what: the ring descriptors and the directory descriptor are the caller's (it opens and
 * closes them); gp_ringwatch_set copies the list of descriptors to watch, under the lock, and the
 * caller calls it again (an empty list) before it closes one. A ring's header is written by the
 * job's user (untrusted): a head behind the tail or a fill beyond the capacity asks for nothing
 * more than a drain, and at most one wake is asked for between two drains (gp_ringwatch_set
 * acknowledges it), so a hostile header cannot make Python drain more often than the ticks.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../../bpf/fastpath/gpuprof_ring.h"

#define EXPORT __attribute__((visibility("default")))

typedef void (*gp_wake_fn)(void);

/* One ring to watch, as the caller lays it out (fastpath.py RINGWATCH_DTYPE). */
struct gp_ringwatch_ring {
    int32_t fd;
    uint32_t pad;
    uint64_t threshold; /* records: more than this between tail and head asks for a drain */
};

struct gp_ringwatch {
    pthread_mutex_t mu; /* guards everything below against gp_ringwatch_set */
    int dir_fd;         /* -1: no directory to watch */
    struct timespec dir_mtime;
    int have_mtime;
    struct gp_ringwatch_ring *rings;
    int n, cap;
    int asked; /* a wake was asked for since the last gp_ringwatch_set: not again */
    gp_wake_fn wake;
    uint64_t wakes_full, wakes_dir; /* drains asked for, by cause */
};

#define HEAD_OFF offsetof(struct gp_ring_header, head)
#define TAIL_OFF offsetof(struct gp_ring_header, tail)
_Static_assert(TAIL_OFF > HEAD_OFF, "head precedes tail in the header");

static int dir_changed(struct gp_ringwatch *w)
{
    struct stat st;
    if (w->dir_fd < 0 || fstat(w->dir_fd, &st) != 0)
        return 0; /* the caller's drain reports an unreadable directory itself */
    int changed = w->have_mtime && (st.st_mtim.tv_sec != w->dir_mtime.tv_sec || st.st_mtim.tv_nsec != w->dir_mtime.tv_nsec);
    w->dir_mtime = st.st_mtim;
    w->have_mtime = 1;
    return changed;
}

/* One tick (ticker.c calls it on its thread). */
EXPORT void gp_ringwatch_tick(struct gp_ringwatch *w, uint64_t now)
{
    (void)now;
    pthread_mutex_lock(&w->mu);
    /* the mtime is followed even while a wake is pending, so that a change seen before the
     * drain's listdir is not asked for again after it */
    int want_dir = dir_changed(w);
    int want_full = 0;
    for (int i = 0; i < w->n && !want_full && !w->asked; i++) {
        unsigned char buf[TAIL_OFF + 8 - HEAD_OFF];
        if (pread(w->rings[i].fd, buf, sizeof(buf), (off_t)HEAD_OFF) != (ssize_t)sizeof(buf))
            continue; /* a truncated ring: the drain finds and reports it */
        uint64_t head, tail;
        memcpy(&head, buf, 8);
        memcpy(&tail, buf + (TAIL_OFF - HEAD_OFF), 8);
        want_full = head > tail && head - tail > w->rings[i].threshold;
    }
    int call = (want_dir || want_full) && !w->asked;
    if (call) {
        w->asked = 1;
        if (want_full)
            w->wakes_full++;
        else
            w->wakes_dir++;
    }
    gp_wake_fn wake = w->wake;
    pthread_mutex_unlock(&w->mu);
    /* outside the lock: the callback takes Python's GIL, whose holder may be in gp_ringwatch_set */
    if (call)
        wake();
}

/* A watch over the rings of directory dir_fd (-1: none) calling wake() when a drain is due;
 * NULL (errno set) on failure. */
EXPORT struct gp_ringwatch *gp_ringwatch_new(int dir_fd, gp_wake_fn wake)
{
    if (!wake) {
        errno = EINVAL;
        return NULL;
    }
    struct gp_ringwatch *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    pthread_mutex_init(&w->mu, NULL);
    w->dir_fd = dir_fd;
    w->wake = wake;
    dir_changed(w); /* the baseline: what the caller's first scan lists */
    return w;
}

/* The rings to watch from now on (copied), and the acknowledgement of a drain: the next wake may
 * be asked for. 0, or -ENOMEM (then the previous list is kept). */
EXPORT int gp_ringwatch_set(struct gp_ringwatch *w, const struct gp_ringwatch_ring *rings, int n, int dir_fd)
{
    pthread_mutex_lock(&w->mu);
    int rc = 0;
    if (n > w->cap) {
        struct gp_ringwatch_ring *r = realloc(w->rings, sizeof(*r) * (size_t)n);
        if (r)
            w->rings = r, w->cap = n;
        else
            rc = -ENOMEM;
    }
    if (rc == 0) {
        if (n > 0)
            memcpy(w->rings, rings, sizeof(*rings) * (size_t)n);
        w->n = n;
    }
    if (dir_fd != w->dir_fd) {
        w->dir_fd = dir_fd;
        w->have_mtime = 0;
        dir_changed(w);
    }
    w->asked = 0;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

/* counts[0..1]: drains asked for because a ring filled, because the directory changed. */
EXPORT void gp_ringwatch_counts(struct gp_ringwatch *w, uint64_t *counts)
{
    pthread_mutex_lock(&w->mu);
    counts[0] = w->wakes_full;
    counts[1] = w->wakes_dir;
    pthread_mutex_unlock(&w->mu);
}

/* Only once no ticker runs it any more. */
EXPORT void gp_ringwatch_free(struct gp_ringwatch *w)
{
    pthread_mutex_destroy(&w->mu);
    free(w->rings);
    free(w);
}

EXPORT int gp_ringwatch_layout(int *ring_entry, int *head_offset, int *tail_offset)
{
    *ring_entry = (int)sizeof(struct gp_ringwatch_ring);
    *head_offset = (int)HEAD_OFF;
    *tail_offset = (int)TAIL_OFF;
    return 0;
}
