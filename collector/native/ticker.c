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
