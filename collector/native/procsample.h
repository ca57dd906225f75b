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
    /* kept by the caller between calls (zero at first; carried over when it relists): */
    uint32_t last_threads; /* the last full read's values (see gp_sample_procs) */
    uint64_t last_full_ns; /* when stat, io and the statuses were last read (0: never) */
    uint64_t last_cpu_ns, last_rss_pages, last_read_bytes, last_write_bytes;
    /* The CPU time not in the listed threads' growth since each was first read: their run time
     * before (taken from stat at the full reads, see gp_sample_procs), and what threads ran that
     * exited or that no listing saw. The switch counts of threads that exited: so that the sums
     * over threads never go back when one exits. */
    uint64_t unlisted_runtime_ns, exited_vol, exited_invol;
};

/* One thread of a job process, as the caller last listed /proc/PID/task. */
struct gp_thread_fds {
    int32_t tid;
    int32_t status_fd;    /* -1: opened by path at every read (the caller ran out of descriptors) */
    int32_t schedstat_fd; /* -1: opened by path at every read */
    int32_t gone;         /* set here when the thread has exited (its counts are then in exited_*) */
    /* kept by the caller between calls (zero at first): what the last calls saw */
    uint64_t last_runtime_ns;   /* schedstat's run time at the last call; UINT64_MAX: none yet */
    uint64_t first_runtime_ns;  /* at the first call that read it; UINT64_MAX: none yet */
    uint64_t status_runtime_ns; /* its run time when its status was last read; UINT64_MAX: never */
    uint64_t last_vol, last_invol;
    uint64_t moved_ns; /* the call at which its run time last moved (or was first read); 0: not read yet */
};

struct gp_proc_row {
    uint64_t cpu_ns; /* the threads' run time (schedstat), or utime + stime (stat) without schedstat */
    uint64_t rss_pages;
    uint64_t vol_ctxsw;
    uint64_t invol_ctxsw;
    uint64_t read_bytes;
    uint64_t write_bytes;
    uint32_t threads;      /* from /proc/PID/stat at the last full read */
    uint32_t threads_read; /* listed threads still alive: the caller relists when this differs */
    int32_t status;        /* 0, or -errno of the read that failed (-ESRCH: the process is gone) */
    int32_t pad;
};

/* A /proc file's text, re-read at offset 0 through a descriptor kept open, NUL-terminated. */
ssize_t gp_read_text(int fd, char *buf, size_t size);
/* The unsigned integer after `key` in a "key: value" text; UINT64_MAX when absent. */
uint64_t gp_key_u64(const char *text, const char *key);

/* Whether this kernel has per-thread schedstat files (CONFIG_SCHED_INFO): without them every call
 * is a full read and the CPU time is stat's, in clock ticks. */
int gp_have_schedstat(void);
int gp_sample_procs(struct gp_proc_fds *procs, int n, struct gp_thread_fds *threads, struct gp_proc_row *out,
                    uint64_t now_ns, uint64_t full_interval_ns, int have_schedstat);

#endif
