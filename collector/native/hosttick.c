/* The host source's tick (collector/sources/host.py) in C, run by ticker.c at the source's rate
 * or called once by hand: one /host/node row and one /host/procs row per job process, appended
 * to buffers the Python source drains (gp_host_drain) about once a second.
 *
 * Who owns what: the descriptors of /proc/stat, meminfo, net/dev and loadavg are opened here;
 * the job processes' descriptors and thread entries are the caller's arrays (it opens, lists and
 * closes them), handed over with gp_host_set_procs while it holds the lock (gp_host_lock), so a
 * tick never reads a descriptor being closed. What the reader keeps per thread and process
 * between ticks (last run time, switch counts, last full read; procsample.c) lives in those
 * arrays, so the caller carries it over when it relists.
 *
 * What a tick cannot fix it flags per process for the drain: threads came or went (relist), the
 * process is gone (close), or a read failed (its -errno). Buffers are bounded: when the caller
 * does not drain in time, new rows are counted as dropped, never grown.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "procsample.h"

#define EXPORT __attribute__((visibility("default")))

enum { GP_PROC_STALE = 1, GP_PROC_GONE = 2 };

/* /host/node before unit conversion (the drain makes the table's row) */
struct gp_host_node_row {
    uint64_t t_ns;
    double cpu_busy, cpu_iowait; /* NaN: no previous sample */
    uint64_t mem_used_kb, mem_total_kb, net_rx, net_tx;
    double load1;
    int32_t status; /* 0, or -errno of the node read that failed */
    int32_t pad;
};

/* /host/procs before unit conversion */
struct gp_host_proc_row {
    uint64_t t_ns;
    int32_t pid;
    uint32_t threads;
    uint64_t cpu_ns, rss_pages, vol_ctxsw, invol_ctxsw, read_bytes, write_bytes;
};

struct gp_host {
    pthread_mutex_t mu;
    int stat_fd, meminfo_fd, netdev_fd, loadavg_fd;
    uint64_t prev_total, prev_idle, prev_iowait;
    int have_prev;
    struct gp_host_node_row slow; /* the last read of memory, network and load (node_row) */
    uint64_t slow_ns;             /* when it was made; 0: never */
    /* the caller's arrays (gp_host_set_procs) */
    struct gp_proc_fds *procs;
    int n_procs;
    uint64_t full_interval_ns; /* between full reads of a process (procsample.c) */
    int have_schedstat;
    struct gp_thread_fds *threads;
    /* ours, sized for n_procs */
    struct gp_proc_row *scratch;
    int32_t *flags, *errors; /* per process since the last drain */
    struct gp_host_node_row *node;
    struct gp_host_proc_row *rows;
    int node_cap, node_n, rows_cap, rows_n;
    uint64_t dropped;
};

/* -errno of a read that failed, or -ENODATA for one that returned nothing */
static int read_failed(void)
{
    return errno ? -errno : -ENODATA;
}

/* /proc/stat's CPU line into the row's busy and iowait fractions (against the previous tick's). */
static int node_cpu(struct gp_host *h, struct gp_host_node_row *r, char *buf)
{
    errno = 0; /* read_failed() tells an error from an empty read by it */
    if (gp_read_text(h->stat_fd, buf, 512) <= 0)
        return read_failed();
    /* "cpu  user nice system idle iowait irq softirq steal ..." */
    uint64_t v[8] = {0};
    char *p = buf + 3;
    for (int i = 0; i < 8; i++)
        v[i] = strtoull(p, &p, 10);
    uint64_t total = 0;
    for (int i = 0; i < 8; i++)
        total += v[i];
    uint64_t idle = v[3], iowait = v[4];
    if (h->have_prev && total > h->prev_total) {
        double dt = (double)(total - h->prev_total);
        r->cpu_busy = ((double)(total - idle - iowait) - (double)(h->prev_total - h->prev_idle - h->prev_iowait)) / dt;
        r->cpu_iowait = (double)(iowait - h->prev_iowait) / dt;
    }
    h->prev_total = total, h->prev_idle = idle, h->prev_iowait = iowait, h->have_prev = 1;
    return 0;
}

/* Memory, network bytes and load average into r; 0, or -errno of the read that failed. */
static int node_slow(struct gp_host *h, struct gp_host_node_row *r, char *buf, size_t size)
{
    errno = 0;
    if (gp_read_text(h->meminfo_fd, buf, 4096) <= 0)
        return read_failed();
    uint64_t mt = gp_key_u64(buf, "MemTotal:"), ma = gp_key_u64(buf, "MemAvailable:");
    if (mt == UINT64_MAX || ma == UINT64_MAX)
        return -ENODATA; /* a kernel without MemAvailable (< 3.14): no figure rather than a wrong one */
    r->mem_total_kb = mt;
    r->mem_used_kb = mt > ma ? mt - ma : 0;
    if (gp_read_text(h->netdev_fd, buf, size) < 0)
        return read_failed();
    /* two header lines, then "  ifname: rx_bytes packets ... (8 fields) tx_bytes ..." */
    char *line = strchr(buf, '\n');
    line = line ? strchr(line + 1, '\n') : NULL;
    while (line && *++line) {
        char *colon = strchr(line, ':');
        char *eol = strchr(line, '\n');
        if (!colon || (eol && colon > eol))
            break;
        char *name = line;
        while (*name == ' ')
            name++;
        int loopback = colon - name == 2 && name[0] == 'l' && name[1] == 'o';
        char *f = colon + 1;
        uint64_t rx = strtoull(f, &f, 10);
        for (int i = 0; i < 7; i++)
            strtoull(f, &f, 10);
        uint64_t tx = strtoull(f, &f, 10);
        if (!loopback)
            r->net_rx += rx, r->net_tx += tx;
        line = eol;
    }
    if (gp_read_text(h->loadavg_fd, buf, 128) <= 0)
        return read_failed();
    r->load1 = strtod(buf, NULL);
    return 0;
}

/* The node row: /proc/stat's CPU line, memory, network and load once per full interval (the ticks
 * between repeat that read, status included). Why: memory, network and load were two thirds of
 * the node row's kernel time (perf) for figures that move slowly, that the report reads as a
 * maximum (memory) or not at all (network bytes, load); and /proc/stat, read for its first line,
 * makes the kernel format every CPU's line and every interrupt's count at each read: 14 % of the
 * tick's time on GROMACS here (perf), and more on a node of many cores and interrupts. The CPU
 * fractions are the node's over the last full interval (USER_HZ counts: at 10 Hz on 2 CPUs one
 * tick's fraction moved in steps of 5 %). */
static int node_row(struct gp_host *h, uint64_t now, struct gp_host_node_row *r)
{
    char buf[16384];
    memset(r, 0, sizeof(*r));
    r->t_ns = now;
    if (h->slow_ns == 0 || now - h->slow_ns >= h->full_interval_ns) {
        memset(&h->slow, 0, sizeof(h->slow));
        h->slow.cpu_busy = h->slow.cpu_iowait = NAN;
        int st = node_cpu(h, &h->slow, buf);
        int slow = node_slow(h, &h->slow, buf, sizeof(buf));
        h->slow.status = st != 0 ? st : slow;
        h->slow_ns = now;
    }
    r->cpu_busy = h->slow.cpu_busy, r->cpu_iowait = h->slow.cpu_iowait;
    r->mem_used_kb = h->slow.mem_used_kb, r->mem_total_kb = h->slow.mem_total_kb;
    r->net_rx = h->slow.net_rx, r->net_tx = h->slow.net_tx, r->load1 = h->slow.load1;
    return h->slow.status;
}

/* One tick: the node row and one row per job process (ticker.c calls it on its thread). */
EXPORT void gp_host_tick(struct gp_host *h, uint64_t now)
{
    pthread_mutex_lock(&h->mu);
    struct gp_host_node_row nr;
    nr.status = 0;
    int st = node_row(h, now, &nr);
    nr.status = st;
    if (h->node_n < h->node_cap)
        h->node[h->node_n++] = nr;
    else
        h->dropped++;
    if (h->n_procs > 0) {
        gp_sample_procs(h->procs, h->n_procs, h->threads, h->scratch, now, h->full_interval_ns, h->have_schedstat);
        for (int i = 0; i < h->n_procs; i++) {
            const struct gp_proc_row *s = &h->scratch[i];
            if (s->status == -ESRCH || s->status == -ENOENT) {
                h->flags[i] |= GP_PROC_GONE;
                continue;
            }
            if (s->status != 0) {
                h->errors[i] = s->status;
                continue;
            }
            if (s->threads_read != s->threads)
                h->flags[i] |= GP_PROC_STALE;
            if (h->rows_n >= h->rows_cap) {
                h->dropped++;
                continue;
            }
            struct gp_host_proc_row *r = &h->rows[h->rows_n++];
            r->t_ns = now;
            r->pid = h->procs[i].pid;
            r->threads = s->threads;
            r->cpu_ns = s->cpu_ns;
            r->rss_pages = s->rss_pages;
            r->vol_ctxsw = s->vol_ctxsw;
            r->invol_ctxsw = s->invol_ctxsw;
            r->read_bytes = s->read_bytes;
            r->write_bytes = s->write_bytes;
        }
    }
    pthread_mutex_unlock(&h->mu);
}

static int open_ro(const char *path)
{
    return open(path, O_RDONLY | O_CLOEXEC);
}

/* A host sampler holding up to `ticks` ticks between drains, reading each process in full every
 * `full_interval_ns` (its threads' run times at every tick); NULL (errno set) when /proc is not
 * readable. */
EXPORT struct gp_host *gp_host_new(int ticks, uint64_t full_interval_ns)
{
    struct gp_host *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    pthread_mutex_init(&h->mu, NULL);
    h->stat_fd = open_ro("/proc/stat");
    h->meminfo_fd = open_ro("/proc/meminfo");
    h->netdev_fd = open_ro("/proc/net/dev");
    h->loadavg_fd = open_ro("/proc/loadavg");
    h->node_cap = ticks > 0 ? ticks : 1;
    h->full_interval_ns = full_interval_ns;
    h->have_schedstat = gp_have_schedstat();
    h->node = calloc((size_t)h->node_cap, sizeof(*h->node));
    if (h->stat_fd < 0 || h->meminfo_fd < 0 || h->netdev_fd < 0 || h->loadavg_fd < 0 || !h->node) {
        int e = errno;
        for (int *fd = &h->stat_fd; fd <= &h->loadavg_fd; fd++)
            if (*fd >= 0)
                close(*fd);
        free(h->node);
        free(h);
        errno = e;
        return NULL;
    }
    return h;
}

EXPORT void gp_host_lock(struct gp_host *h)
{
    pthread_mutex_lock(&h->mu);
}

EXPORT void gp_host_unlock(struct gp_host *h)
{
    pthread_mutex_unlock(&h->mu);
}

/* With the lock held: the job's processes from now on (the caller's arrays, kept alive by it
 * until the next call). Rows not yet drained are kept while they fit. 0, or -ENOMEM. */
EXPORT int gp_host_set_procs(struct gp_host *h, struct gp_proc_fds *procs, int n, struct gp_thread_fds *threads)
{
    int cap = h->node_cap * (n > 0 ? n : 1);
    if (n > h->n_procs || cap > h->rows_cap) {
        struct gp_proc_row *scratch = realloc(h->scratch, sizeof(*scratch) * (size_t)(n > 0 ? n : 1));
        if (scratch)
            h->scratch = scratch;
        struct gp_host_proc_row *rows = realloc(h->rows, sizeof(*rows) * (size_t)cap);
        if (rows)
            h->rows = rows, h->rows_cap = cap;
        int32_t *flags = realloc(h->flags, sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
        if (flags)
            h->flags = flags;
        int32_t *errors = realloc(h->errors, sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
        if (errors)
            h->errors = errors;
        if (!scratch || !rows || !flags || !errors)
            return -ENOMEM;
    }
    h->procs = procs;
    h->n_procs = n;
    h->threads = threads;
    memset(h->flags, 0, sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    memset(h->errors, 0, sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    return 0;
}

/* With the lock held: copy out and clear what the ticks since the last drain left. The caller's
 * buffers hold node_cap node rows, node_cap * n_procs process rows and n_procs flags and errors.
 * counts[0..2]: node rows, process rows, rows dropped since the start. */
EXPORT void gp_host_drain(struct gp_host *h, struct gp_host_node_row *node, struct gp_host_proc_row *rows,
                          int32_t *flags, int32_t *errors, uint64_t *counts)
{
    memcpy(node, h->node, sizeof(*node) * (size_t)h->node_n);
    memcpy(rows, h->rows, sizeof(*rows) * (size_t)h->rows_n);
    if (h->n_procs > 0) {
        memcpy(flags, h->flags, sizeof(int32_t) * (size_t)h->n_procs);
        memcpy(errors, h->errors, sizeof(int32_t) * (size_t)h->n_procs);
        memset(h->flags, 0, sizeof(int32_t) * (size_t)h->n_procs);
        memset(h->errors, 0, sizeof(int32_t) * (size_t)h->n_procs);
    }
    counts[0] = (uint64_t)h->node_n;
    counts[1] = (uint64_t)h->rows_n;
    counts[2] = h->dropped;
    h->node_n = h->rows_n = 0;
}

/* Only once no ticker runs it any more. */
EXPORT void gp_host_free(struct gp_host *h)
{
    close(h->stat_fd);
    close(h->meminfo_fd);
    close(h->netdev_fd);
    close(h->loadavg_fd);
    pthread_mutex_destroy(&h->mu);
    free(h->scratch);
    free(h->flags);
    free(h->errors);
    free(h->node);
    free(h->rows);
    free(h);
}

EXPORT int gp_host_layout(int *node_row, int *proc_row)
{
    *node_row = (int)sizeof(struct gp_host_node_row);
    *proc_row = (int)sizeof(struct gp_host_proc_row);
    return 0;
}
