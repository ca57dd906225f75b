/* The host source's per-process hot path (collector/sources/host.py), in C.
 *
 * Why C: at 10 Hz over the job's processes the Python version spent more time parsing the /proc
 * text than the kernel spent making it, and ran with cold caches at every tick. Here one ctypes
 * call per tick reads every process, through descriptors the caller opened once and re-reads with
 * pread at offset 0 (a /proc file regenerates its text on every such read).
 *
 * What is read how often. At every call, each thread's /proc/PID/task/TID/schedstat (about 1.5 us
 * of kernel time): its run time in ns. The process's CPU time is what its listed threads have run
 * since each was first read, plus what they ran before and what threads that exited or that no
 * listing saw ran (`unlisted_runtime_ns`); at each full read that sum is brought up to
 * /proc/PID/stat's utime + stime when stat's is larger (stat's is the whole thread group's, dead
 * threads included, rounded down to clock ticks, so never more than the truth; neither is the
 * sum). Between full reads it grows by the threads' exact run times, where stat's comes in 10 ms
 * clock ticks, a tenth of a 100 ms tick's interval; it never goes back.
 *
 * Once per `full_interval_ns` (a second in the collector), a full read: /proc/PID/stat (resident
 * set, thread count), /proc/PID/io (storage bytes) and the status of each thread that ran since
 * its last one (context switches: a status counts only its own thread, and costs about 9 us, the
 * dearest read; a thread whose run time has not moved has not been switched out since, so its
 * counts cannot have changed); the calls between repeat the last full read's values. On a busy
 * job of 16 MPI ranks of 4 threads this is 4 reads a process per call instead of 7, and the
 * statuses and stat files, most of the kernel's time (perf), once a second instead of ten times.
 * The switches of a thread that lived between two listings are not counted.
 *
 * A thread whose run time has not moved for a full interval is idle: read with the full reads
 * only, until it has run again (gp_sample_procs). On the cost bench's ranks (3 threads, 2 of them
 * Open MPI's sleeping progress threads) that is 1 schedstat read a tick instead of 3.
 *
 * Without schedstat files (a kernel built without CONFIG_SCHED_INFO) every call is a full read and
 * the CPU time is stat's.
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

/* A thread's file through its descriptor, or by path when the caller has none (fd < 0). */
static ssize_t thread_text(int fd, int pid, int tid, const char *name, char *buf, size_t size)
{
    if (fd >= 0)
        return gp_read_text(fd, buf, size);
    char path[96];
    snprintf(path, sizeof(path), "/proc/%d/task/%d/%s", pid, tid, name);
    int own = open(path, O_RDONLY | O_CLOEXEC);
    if (own < 0)
        return -1;
    ssize_t len = gp_read_text(own, buf, size);
    close(own);
    return len;
}

/* A thread's run time (ns) into t->last_runtime_ns (and first_runtime_ns at its first read), and
 * the call's time into moved_ns when it moved; -1 when it has exited. */
static int thread_runtime(int pid, struct gp_thread_fds *t, char *buf, size_t size, uint64_t now_ns)
{
    if (thread_text(t->schedstat_fd, pid, t->tid, "schedstat", buf, size) <= 0)
        return -1;
    uint64_t runtime_ns = strtoull(buf, NULL, 10);
    if (t->moved_ns == 0 || runtime_ns != t->last_runtime_ns)
        t->moved_ns = now_ns;
    t->last_runtime_ns = runtime_ns;
    if (t->first_runtime_ns == UINT64_MAX)
        t->first_runtime_ns = t->last_runtime_ns;
    return 0;
}

/* Whether a thread's run time has stood still for `idle_ns` up to its last read: then its last read
 * stands until the next full read. */
static int thread_idle(const struct gp_thread_fds *t, uint64_t now_ns, uint64_t idle_ns)
{
    return t->moved_ns != 0 && now_ns - t->moved_ns >= idle_ns;
}

/* What a thread has run since it was first read (0 before). */
static uint64_t thread_growth(const struct gp_thread_fds *t)
{
    return t->first_runtime_ns == UINT64_MAX ? 0 : t->last_runtime_ns - t->first_runtime_ns;
}

/* A thread's context switches into t->last_vol/last_invol, re-read only when it ran since its last
 * status (or that cannot be told); -1 when it has exited. */
static int thread_ctxsw(int pid, struct gp_thread_fds *t, char *buf, size_t size)
{
    if (t->last_runtime_ns != UINT64_MAX && t->last_runtime_ns == t->status_runtime_ns)
        return 0; /* not switched out since its last status: its counts cannot have changed */
    if (thread_text(t->status_fd, pid, t->tid, "status", buf, size) <= 0)
        return -1;
    status_ctxsw(buf, &t->last_vol, &t->last_invol);
    t->status_runtime_ns = t->last_runtime_ns;
    return 0;
}

/* A thread found gone: what it had counted stays in the process's sums. */
static void thread_exited(struct gp_proc_fds *pf, struct gp_thread_fds *t)
{
    t->gone = 1;
    pf->unlisted_runtime_ns += thread_growth(t);
    pf->exited_vol += t->last_vol;
    pf->exited_invol += t->last_invol;
}

/* The fields of /proc/PID/stat the rows use; -1 when the text cannot be parsed. */
static int parse_stat(const char *buf, struct gp_proc_row *r, uint64_t ns_per_tick)
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
    r->cpu_ns = (f[11] + f[12]) * ns_per_tick;
    r->threads = (uint32_t)f[17];
    r->rss_pages = f[21];
    return 0;
}

EXPORT int gp_have_schedstat(void)
{
    return access("/proc/thread-self/schedstat", R_OK) == 0;
}

/* stat, io and the threads' statuses into r and the process's last_* values; 0, or -errno. */
static int full_read(struct gp_proc_fds *pf, struct gp_thread_fds *threads, struct gp_proc_row *r, char *buf,
                     size_t size, int have_schedstat)
{
    uint64_t runtime_ns = r->cpu_ns;
    ssize_t len = gp_read_text(pf->stat_fd, buf, size);
    if (len <= 0)
        return len == 0 ? -ESRCH : -errno;
    if (parse_stat(buf, r, (uint64_t)(1000000000L / sysconf(_SC_CLK_TCK))) != 0)
        return -EINVAL;
    if (have_schedstat && r->cpu_ns > runtime_ns) {
        /* stat's utime + stime (the whole thread group's run time, threads that exited included,
         * each rounded down to a clock tick) is never more than the true total; the threads'
         * sum is not either, but it misses what they ran before they were first read and what
         * threads that no listing saw ran: brought up to stat's, then grown by the threads'
         * exact run times until the next full read. */
        pf->unlisted_runtime_ns += r->cpu_ns - runtime_ns;
    } else if (have_schedstat) {
        r->cpu_ns = runtime_ns;
    }
    r->read_bytes = r->write_bytes = UINT64_MAX;
    if (pf->io_fd >= 0) {
        len = gp_read_text(pf->io_fd, buf, size);
        if (len < 0)
            return -errno;
        r->read_bytes = gp_key_u64(buf, "read_bytes:");
        r->write_bytes = gp_key_u64(buf, "\nwrite_bytes:");
    }
    for (int t = pf->first_thread; t < pf->first_thread + pf->n_threads; t++)
        if (!threads[t].gone && thread_ctxsw(pf->pid, &threads[t], buf, size) < 0)
            thread_exited(pf, &threads[t]);
    pf->last_rss_pages = r->rss_pages;
    pf->last_threads = r->threads;
    pf->last_read_bytes = r->read_bytes;
    pf->last_write_bytes = r->write_bytes;
    return 0;
}

/* One row per process; returns how many processes were read without error. `now_ns` is the
 * call's time, on the clock of the caller's last_full_ns. */
EXPORT int gp_sample_procs(struct gp_proc_fds *procs, int n, struct gp_thread_fds *threads, struct gp_proc_row *out,
                           uint64_t now_ns, uint64_t full_interval_ns, int have_schedstat)
{
    char buf[4096];
    int ok = 0;
    for (int i = 0; i < n; i++) {
        struct gp_proc_row *r = &out[i];
        struct gp_proc_fds *pf = &procs[i];
        memset(r, 0, sizeof(*r));
        int full = !have_schedstat || pf->last_full_ns == 0 || now_ns - pf->last_full_ns >= full_interval_ns;
        /* the threads first: their run times are the CPU time, and tell who is alive. A thread
         * that has not run for a full interval is read with the full reads only, until it runs
         * again: most threads of a job (MPI progress threads, a runtime's pools) sleep for
         * seconds, and their reads were most of a tick's (a rank of 3 threads, 2 asleep: 1 read a
         * tick instead of 3). What such a thread runs after it wakes is counted at the next full
         * read, at most full_interval_ns late; the sums stay exact. */
        uint32_t live = 0;
        uint64_t grown_ns = 0;
        for (int t = pf->first_thread; t < pf->first_thread + pf->n_threads; t++) {
            struct gp_thread_fds *th = &threads[t];
            if (th->gone)
                continue;
            int skip = !full && thread_idle(th, now_ns, full_interval_ns);
            if (have_schedstat && !skip && thread_runtime(pf->pid, th, buf, sizeof(buf), now_ns) < 0) {
                thread_exited(pf, th);
                continue;
            }
            live++;
            grown_ns += thread_growth(th);
        }
        r->threads_read = live;
        if (live == 0) {
            r->status = -ESRCH; /* every listed thread exited: the process is gone (or the list is stale) */
            continue;
        }
        r->cpu_ns = pf->unlisted_runtime_ns + grown_ns;
        if (full) {
            int st = full_read(pf, threads, r, buf, sizeof(buf), have_schedstat);
            if (st != 0) {
                r->status = st;
                continue;
            }
            pf->last_full_ns = now_ns;
        } else { /* between full reads: the last one's values */
            r->rss_pages = pf->last_rss_pages;
            r->threads = pf->last_threads;
            r->read_bytes = pf->last_read_bytes;
            r->write_bytes = pf->last_write_bytes;
        }
        /* A safety net: the sum above only grows (what exited threads ran stays in
         * unlisted_runtime_ns, here and when the caller relists), but a cumulative counter must
         * never go back, should a listing ever lose a thread unseen. */
        r->cpu_ns = r->cpu_ns > pf->last_cpu_ns ? r->cpu_ns : pf->last_cpu_ns;
        pf->last_cpu_ns = r->cpu_ns;
        r->vol_ctxsw = pf->exited_vol;
        r->invol_ctxsw = pf->exited_invol;
        for (int t = pf->first_thread; t < pf->first_thread + pf->n_threads; t++) {
            if (!threads[t].gone) {
                r->vol_ctxsw += threads[t].last_vol;
                r->invol_ctxsw += threads[t].last_invol;
            }
        }
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
