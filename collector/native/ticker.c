/* A sampling thread without Python: calls one C tick function on the collector's tick grid.
 *
 * Why: on the VMs measured, a 10 Hz Python thread spent several times the work of its sample
 * just waking up (interpreter and caches cold after each 100 ms sleep, the GIL taken and given
 * back), and the collector's CPU followed the number of Python wake-ups more than the work done.
 * Here the 10 Hz loop is C: the tick (hosttick.c, nvmltick.c) appends rows to its own buffer,
 * and the Python source drains them once a second.
 *
 * The grid: ticks fall on multiples of the interval on CLOCK_MONOTONIC, as collector/daemon.py's
 * next_tick puts the Python sources, so the rows of every source of one rate share timestamps.
 * A tick that ran long skips the ticks it missed instead of bursting.
 *
 * A tick stuck in a call (an NVML call in a wedged driver; nvmltick.c tells the Python side
 * which call and since when) cannot be cancelled safely: gp_ticker_stop gives up on it after
 * its timeout and leaves it detached, its ticker and tick state still in use by the stuck call;
 * gp_ticker_reap frees the ticker once the thread has left (then the tick state is the caller's
 * to free).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

typedef void (*gp_tick_fn)(void *state, uint64_t now_ns);

struct gp_ticker {
    pthread_t thread;
    pthread_mutex_t mu; /* guards stop, exited; cv wakes the sleeping thread at stop */
    pthread_cond_t cv;
    int stop;
    int exited;
    int64_t interval_ns;
    gp_tick_fn tick;
    void *state;
    char name[16]; /* the thread's kernel name (comm), as top -H and perf show it */
};

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *ticker_loop(void *arg)
{
    struct gp_ticker *t = arg;
    pthread_setname_np(pthread_self(), t->name); /* fails only for a name too long: cut below */
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        uint64_t now = mono_ns();
        uint64_t next = (now / (uint64_t)t->interval_ns + 1) * (uint64_t)t->interval_ns;
        struct timespec at = {.tv_sec = (time_t)(next / 1000000000ull), .tv_nsec = (long)(next % 1000000000ull)};
        while (!t->stop && pthread_cond_timedwait(&t->cv, &t->mu, &at) != ETIMEDOUT)
            ; /* spurious wake-ups: wait on until the tick or the stop */
        if (t->stop)
            break;
        pthread_mutex_unlock(&t->mu);
        t->tick(t->state, mono_ns());
        pthread_mutex_lock(&t->mu);
    }
    t->exited = 1;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Start calling tick(state, now) every interval_ns on the grid, on a thread named `name` (cut to
 * 15 characters); NULL (errno set) on failure. */
EXPORT struct gp_ticker *gp_ticker_start(int64_t interval_ns, gp_tick_fn tick, void *state, const char *name)
{
    if (interval_ns <= 0 || !tick) {
        errno = EINVAL;
        return NULL;
    }
    struct gp_ticker *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&t->mu, NULL);
    t->interval_ns = interval_ns;
    t->tick = tick;
    t->state = state;
    snprintf(t->name, sizeof(t->name), "%s", name ? name : "gp-tick");
    /* created with every signal blocked (a thread inherits its creator's mask): signals are for
     * Python's main thread, never for a sampler */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&t->thread, NULL, ticker_loop, t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        pthread_cond_destroy(&t->cv);
        pthread_mutex_destroy(&t->mu);
        free(t);
        errno = rc;
        return NULL;
    }
    return t;
}

/* Stop the thread: 0 when it has exited (the ticker is freed; its tick state is the caller's
 * again), -ETIMEDOUT when it is still inside a tick after timeout_ns (it is detached and the
 * ticker and its tick state must never be freed: the stuck call still uses them). */
EXPORT int gp_ticker_stop(struct gp_ticker *t, int64_t timeout_ns)
{
    uint64_t deadline = mono_ns() + (uint64_t)(timeout_ns > 0 ? timeout_ns : 0);
    struct timespec at = {.tv_sec = (time_t)(deadline / 1000000000ull), .tv_nsec = (long)(deadline % 1000000000ull)};
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_broadcast(&t->cv);
    int timed_out = 0;
    while (!t->exited && !timed_out)
        timed_out = pthread_cond_timedwait(&t->cv, &t->mu, &at) == ETIMEDOUT;
    int exited = t->exited;
    pthread_mutex_unlock(&t->mu);
    if (!exited) {
        pthread_detach(t->thread);
        return -ETIMEDOUT;
    }
    pthread_join(t->thread, NULL);
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
    return 0;
}

/* After a gp_ticker_stop that timed out: 0 when the thread has left since (the ticker is freed,
 * and its tick state is no longer used), -EBUSY while it is still inside its tick. */
EXPORT int gp_ticker_reap(struct gp_ticker *t)
{
    pthread_mutex_lock(&t->mu);
    int exited = t->exited;
    pthread_mutex_unlock(&t->mu);
    if (!exited)
        return -EBUSY;
    /* the thread's last touch of t was the unlock after setting exited */
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
    return 0;
}

/* Ticks that share one thread (gp_multi_tick on a gp_ticker): the host tick, the fast path's ring
 * watch and the CFI map watch all run at 10 Hz, on one thread that wakes 10 times a second instead
 * of three that wake 30 times. On a node the job keeps busy, each wake-up of the collector also
 * preempts a job thread; in the collector's own CPU the saving measured small (about 0.02 % of a
 * core: the watches' reads, not their wake-ups, are most of their cost). The ticks of a round run
 * in the order they were added, with the round's time.
 *
 * The mutex is held for the whole round, so gp_multi_remove returns only once its tick is no
 * longer running (its state is then the caller's to free). A tick stuck in its call keeps the
 * mutex: gp_multi_remove gives up after its timeout, marks the entry dead (skipped from then on)
 * and leaves it linked; gp_multi_reap unlinks it once the round has ended. */
struct gp_multi_entry {
    gp_tick_fn tick;
    void *state;
    int dead; /* written by a remove that timed out, read by the rounds: atomics */
    struct gp_multi_entry *next;
};

struct gp_multi {
    pthread_mutex_t mu;
    struct gp_multi_entry *head;
};

EXPORT void gp_multi_tick(void *arg, uint64_t now_ns)
{
    struct gp_multi *m = arg;
    pthread_mutex_lock(&m->mu);
    for (struct gp_multi_entry *e = m->head; e; e = e->next)
        if (!__atomic_load_n(&e->dead, __ATOMIC_ACQUIRE))
            e->tick(e->state, now_ns);
    pthread_mutex_unlock(&m->mu);
}

EXPORT struct gp_multi *gp_multi_new(void)
{
    struct gp_multi *m = calloc(1, sizeof(*m));
    if (m)
        pthread_mutex_init(&m->mu, NULL);
    return m;
}

/* Free a gp_multi without entries (its ticker stopped first). */
EXPORT void gp_multi_free(struct gp_multi *m)
{
    pthread_mutex_destroy(&m->mu);
    free(m);
}

/* Add tick(state, now) at the end of the rounds; NULL (errno set) on failure. */
EXPORT struct gp_multi_entry *gp_multi_add(struct gp_multi *m, gp_tick_fn tick, void *state)
{
    struct gp_multi_entry *e = calloc(1, sizeof(*e));
    if (!e)
        return NULL;
    e->tick = tick;
    e->state = state;
    pthread_mutex_lock(&m->mu);
    struct gp_multi_entry **p = &m->head;
    while (*p)
        p = &(*p)->next;
    *p = e;
    pthread_mutex_unlock(&m->mu);
    return e;
}

static void multi_unlink(struct gp_multi *m, struct gp_multi_entry *e)
{
    for (struct gp_multi_entry **p = &m->head; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    free(e);
}

/* Take the entry out of the rounds: 0 once it is out (no round is running it), -ETIMEDOUT when a
 * round did not end within timeout_ns (the entry is dead, its state still in use by the round:
 * gp_multi_reap tells when it is not). */
EXPORT int gp_multi_remove(struct gp_multi *m, struct gp_multi_entry *e, int64_t timeout_ns)
{
    struct timespec at;
    clock_gettime(CLOCK_REALTIME, &at); /* pthread_mutex_timedlock's clock */
    uint64_t ns = (uint64_t)at.tv_nsec + (uint64_t)(timeout_ns > 0 ? timeout_ns : 0);
    at.tv_sec += (time_t)(ns / 1000000000ull);
    at.tv_nsec = (long)(ns % 1000000000ull);
    if (pthread_mutex_timedlock(&m->mu, &at) != 0) {
        __atomic_store_n(&e->dead, 1, __ATOMIC_RELEASE);
        return -ETIMEDOUT;
    }
    multi_unlink(m, e);
    pthread_mutex_unlock(&m->mu);
    return 0;
}

/* After a gp_multi_remove that timed out: 0 once the entry is unlinked (its state is no longer
 * used), -EBUSY while the round is still running. */
EXPORT int gp_multi_reap(struct gp_multi *m, struct gp_multi_entry *e)
{
    if (pthread_mutex_trylock(&m->mu) != 0)
        return -EBUSY;
    multi_unlink(m, e);
    pthread_mutex_unlock(&m->mu);
    return 0;
}

/* Whether the rounds have no entry left; 0 while a round runs (the caller asks again later). */
EXPORT int gp_multi_empty(struct gp_multi *m)
{
    if (pthread_mutex_trylock(&m->mu) != 0)
        return 0;
    int empty = m->head == NULL;
    pthread_mutex_unlock(&m->mu);
    return empty;
}
