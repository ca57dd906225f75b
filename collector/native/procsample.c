/* The host source's per-process hot path (collector/sources/host.py), in C.
 *
 * Why C: at 10 Hz over the job's processes the Python version spent more time parsing the /proc
 * text than the kernel spent making it, and ran with cold caches at every tick. Here one ctypes
 * call per tick reads every process: /proc/PID/stat (CPU time, RSS, threads), each thread's
 * /proc/PID/task/TID/status (context switches: a status counts only its own thread) and
 * /proc/PID/io (storage bytes), through descriptors the caller opened once and re-reads with
 * pread at offset 0 (a /proc file regenerates its text on every such read).
 *
 * A status is the dearest read (about 13 us of kernel time against 2 for a schedstat): a thread
 * whose run time in its schedstat (ns, updated at every switch out) has not moved since the last
 * call has not been switched out since, so its context-switch counts cannot have changed and the
 * last ones are reused instead of re-read. Most threads of a job (sleeping helpers, idle pools,
 * launcher shells) do not run between two ticks: a process of 64 mostly idle threads costs
 * about 64 schedstat reads a tick, not 64 statuses.
 *
 * The same observation spares an idle process's other reads: when none of its listed threads ran
 * since the last call, its CPU time, thread count and I/O counters cannot have moved (each needs
 * one of its threads on a CPU), and its resident set grows only by its own page faults; the last
 * full read's values are repeated instead of reading /proc/PID/stat and io again (~7 us warm,
 * three times that at 10 Hz). A full read still happens every `full_every` calls (once a second
 * in the collector): reclaim can shrink a sleeping process's resident set, and a thread running
 * without a break on a nohz_full CPU updates its schedstat run time only at the residual
 * once-a-second tick.
 *
 * Nothing is allocated; nothing is kept between calls except what the caller passes in (the
 * last counts, in the thread and process entries). A process that exited reports -ESRCH; an unreadable io
 * file (not root) reports the io columns as UINT64_MAX, as the Python path does.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "procsample.h"

#define EXPORT __attribute__((visibility("default")))

ssize_t gp_read_text(int fd, char *buf, size_t size)
{
    ssize_t n = pread(fd, buf, size - 1, 0);
    if (n >= 0)
        buf[n] = 0;
    return n;
}

uint64_t gp_key_u64(const char *text, const char *key)
{
    const char *p = strstr(text, key);
    if (!p)
        return UINT64_MAX;
    return strtoull(p + strlen(key), NULL, 10);
}

static void status_ctxsw(const char *status, uint64_t *vol, uint64_t *invol)
{
    uint64_t v = gp_key_u64(status, "\nvoluntary_ctxt_switches:");
    uint64_t n = gp_key_u64(status, "\nnonvoluntary_ctxt_switches:");
    *vol = v == UINT64_MAX ? 0 : v;
    *invol = n == UINT64_MAX ? 0 : n;
}

/* Add one thread's context switches; returns -1 when it has exited, 1 when it ran since the
 * last call (or that cannot be told), 0 when it did not. */
static int thread_ctxsw(int pid, struct gp_thread_fds *t, uint64_t *vol, uint64_t *invol, char *buf, size_t size)
{
    uint64_t runtime = UINT64_MAX;
    if (t->schedstat_fd >= 0) {
        if (gp_read_text(t->schedstat_fd, buf, size) <= 0)
            return -1;
        runtime = strtoull(buf, NULL, 10);
    }
    int ran = runtime == UINT64_MAX || runtime != t->last_runtime_ns;
    if (ran) {
        ssize_t len;
        if (t->status_fd >= 0) {
            len = gp_read_text(t->status_fd, buf, size);
        } else {
            char path[96];
            snprintf(path, sizeof(path), "/proc/%d/task/%d/status", pid, t->tid);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            len = fd < 0 ? -1 : gp_read_text(fd, buf, size);
            if (fd >= 0)
                close(fd);
        }
        if (len <= 0)
            return -1;
        status_ctxsw(buf, &t->last_vol, &t->last_invol);
        t->last_runtime_ns = runtime;
    } /* else: not switched out since the last call, so its counts cannot have changed */
    *vol += t->last_vol;
    *invol += t->last_invol;
    return ran;
}

/* The fields of /proc/PID/stat the rows use; -1 when the text cannot be parsed. */
static int parse_stat(const char *buf, struct gp_proc_row *r)
{
    /* fields after "(comm) ": state is field 0; utime 11, stime 12, num_threads 17, rss 21 */
    const char *p = strrchr(buf, ')');
    if (!p)
        return -1;
    p += 2;
    uint64_t f[22];
    int k = 0;
    while (k < 22 && *p) {
        while (*p == ' ')
            p++;
        f[k++] = strtoull(p, NULL, 10); /* 0 for the state letter; unused fields may be negative */
        while (*p && *p != ' ')
            p++;
    }
    if (k < 22)
        return -1;
    r->cpu_ticks = f[11] + f[12];
    r->threads = (uint32_t)f[17];
    r->rss_pages = f[21];
    return 0;
}

/* One row per process; returns how many processes were read without error. */
EXPORT int gp_sample_procs(struct gp_proc_fds *procs, int n, struct gp_thread_fds *threads, struct gp_proc_row *out,
                           int full_every)
{
    char buf[4096];
    int ok = 0;
    for (int i = 0; i < n; i++) {
        struct gp_proc_row *r = &out[i];
        struct gp_proc_fds *pf = &procs[i];
        memset(r, 0, sizeof(*r));
        /* the threads first: whether any ran decides what else is read */
        uint32_t live = 0;
        int ran = 0;
        for (int t = pf->first_thread; t < pf->first_thread + pf->n_threads; t++) {
            struct gp_thread_fds *th = &threads[t];
            if (th->gone)
                continue;
            int rc = thread_ctxsw(pf->pid, th, &r->vol_ctxsw, &r->invol_ctxsw, buf, sizeof(buf));
            if (rc < 0) {
                th->gone = 1;
                ran = 1; /* a thread exited: the process's counts moved */
            } else {
                live++;
                ran |= rc;
            }
        }
        r->threads_read = live;
        if (live == 0) {
            r->status = -ESRCH; /* every listed thread exited: the process is gone (or the list is stale) */
            continue;
        }
        if (!ran && pf->idle_ticks > 0 && pf->idle_ticks < full_every) {
            /* none of its threads ran since the last call: the last full read still holds */
            r->cpu_ticks = pf->last_cpu_ticks;
            r->rss_pages = pf->last_rss_pages;
            r->threads = pf->last_threads;
            r->read_bytes = pf->last_read_bytes;
            r->write_bytes = pf->last_write_bytes;
            pf->idle_ticks++;
            ok++;
            continue;
        }
        ssize_t len = gp_read_text(pf->stat_fd, buf, sizeof(buf));
        if (len <= 0) {
            r->status = len == 0 ? -ESRCH : -errno;
            continue;
        }
        if (parse_stat(buf, r) != 0) {
            r->status = -EINVAL;
            continue;
        }
        r->read_bytes = r->write_bytes = UINT64_MAX;
        if (pf->io_fd >= 0) {
            len = gp_read_text(pf->io_fd, buf, sizeof(buf));
            if (len < 0) {
                r->status = -errno;
                continue;
            }
            r->read_bytes = gp_key_u64(buf, "read_bytes:");
            r->write_bytes = gp_key_u64(buf, "\nwrite_bytes:");
        }
        pf->last_cpu_ticks = r->cpu_ticks;
        pf->last_rss_pages = r->rss_pages;
        pf->last_threads = r->threads;
        pf->last_read_bytes = r->read_bytes;
        pf->last_write_bytes = r->write_bytes;
        pf->idle_ticks = 1;
        ok++;
    }
    return ok;
}

/* The layout, so that the Python side checks it matches its numpy dtypes. */
EXPORT int gp_proc_layout(int *fds_size, int *thread_size, int *row_size)
{
    *fds_size = (int)sizeof(struct gp_proc_fds);
    *thread_size = (int)sizeof(struct gp_thread_fds);
    *row_size = (int)sizeof(struct gp_proc_row);
    return 0;
}
