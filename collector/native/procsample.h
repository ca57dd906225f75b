/* The per-process reader's structures (procsample.c), shared with the host tick (hosttick.c) and
 * mirrored by numpy dtypes in collector/native/__init__.py (checked at load by gp_proc_layout). */
#ifndef GP_PROCSAMPLE_H
#define GP_PROCSAMPLE_H
#include <stdint.h>
#include <sys/types.h>

struct gp_proc_fds {
    int32_t pid;
    int32_t stat_fd;
    int32_t io_fd;        /* -1 when /proc/PID/io could not be opened */
    int32_t first_thread; /* this process's threads: threads[first_thread .. + n_threads] */
    int32_t n_threads;
    /* kept by the caller between calls (zero at first): the last full read of stat and io, and
     * the calls since, for the processes none of whose threads ran (see gp_sample_procs) */
    int32_t idle_ticks;
    uint32_t last_threads;
    uint32_t pad;
    uint64_t last_cpu_ticks, last_rss_pages, last_read_bytes, last_write_bytes;
};

/* One thread of a job process, as the caller last listed /proc/PID/task. */
struct gp_thread_fds {
    int32_t tid;
    int32_t status_fd;    /* -1: opened by path at every read (the caller ran out of descriptors) */
    int32_t schedstat_fd; /* -1 when it could not be opened: status is read at every tick */
    int32_t gone;         /* set here when the thread has exited */
    /* kept by the caller between calls (zero at first): what the last call saw */
    uint64_t last_runtime_ns; /* schedstat's run time; UINT64_MAX: none yet */
    uint64_t last_vol, last_invol;
};

struct gp_proc_row {
    uint64_t cpu_ticks; /* utime + stime, clock ticks */
    uint64_t rss_pages;
    uint64_t vol_ctxsw;
    uint64_t invol_ctxsw;
    uint64_t read_bytes;
    uint64_t write_bytes;
    uint32_t threads;      /* from /proc/PID/stat */
    uint32_t threads_read; /* listed threads still alive: the caller relists when this differs */
    int32_t status;        /* 0, or -errno of the read that failed (-ESRCH: the process is gone) */
    int32_t pad;
};

/* A /proc file's text, re-read at offset 0 through a descriptor kept open, NUL-terminated. */
ssize_t gp_read_text(int fd, char *buf, size_t size);
/* The unsigned integer after `key` in a "key: value" text; UINT64_MAX when absent. */
uint64_t gp_key_u64(const char *text, const char *key);

int gp_sample_procs(struct gp_proc_fds *procs, int n, struct gp_thread_fds *threads, struct gp_proc_row *out,
                    int full_every);

#endif
