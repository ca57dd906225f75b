/* The windowed drains' stack reads (collector/sources/bpf_stacks.py WindowedCounts, used by the
 * stacks and off-CPU sources), in C: the frames of many stack ids of a BPF stack-trace map read,
 * and the ids freed, in one call.
 *
 * Why: each drain reads every stack id its finished window uses (a few hundred with 16 busy
 * processes) and frees those the new window does not use. Through BCC's ctypes tables that was two
 * ctypes calls and a numpy scan per id, most of the drain's own time (docs/collector.md, "Cost");
 * here it is two bpf() calls per id, and Python slices one list of all the frames.
 *
 * What it does is what the Python path did, id by id, in the same order: a lookup (a failed one is
 * reported, its frames are then unknown), the frames up to the first 0 word, and a delete unless the
 * id is in `keep` (a delete that fails means the id is gone already: nothing to free). Memory is the
 * caller's fixed buffers: the call stops before an id whose frames might not fit and says how many
 * ids it took, and the caller calls again for the rest.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/bpf.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* A stack-trace map's value: up to this many u64 addresses (BCC's StackTrace.MAX_DEPTH is 127;
 * the kernel's sysctl kernel.perf_event_max_stack caps it at 127 by default too). */
#define GP_STACK_MAX_WORDS 1024

static long bpf_elem(int cmd, int fd, const void *key, void *value)
{
    union bpf_attr a;
    memset(&a, 0, sizeof(a));
    a.map_fd = (uint32_t)fd;
    a.key = (uint64_t)(uintptr_t)key;
    a.value = (uint64_t)(uintptr_t)value;
    return syscall(__NR_bpf, cmd, &a, sizeof(a));
}

static int in_sorted(const int32_t *keep, long n, int32_t id)
{
    long lo = 0, hi = n;
    while (lo < hi) {
        long mid = lo + (hi - lo) / 2;
        if (keep[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && keep[lo] == id;
}

/* ids[0..n): stack ids (>= 0) of map_fd, whose values are value_size bytes, of which the first
 * max_depth words at most are frames (BCC's walk stops there too). keep[0..n_keep):
 * sorted ids not to free. For each id taken: status[i] = 0 and its addresses, innermost first, in
 * words[offsets[i] .. offsets[i+1]); or status[i] = -errno of the failed lookup (no words).
 * offsets[0] = 0. Returns the number of ids taken (fewer than n when words_cap would not hold the
 * next one's frames: call again with the rest), or -EINVAL for a value size it cannot read. */
EXPORT long gp_stacks_take(int map_fd, long value_size, long max_depth, const int32_t *ids, long n, const int32_t *keep,
                           long n_keep, uint64_t *words, long words_cap, int64_t *offsets, int32_t *status)
{
    uint64_t leaf[GP_STACK_MAX_WORDS];
    if (value_size <= 0 || value_size % 8 || value_size / 8 > GP_STACK_MAX_WORDS || max_depth <= 0)
        return -EINVAL;
    long max_words = value_size / 8 < max_depth ? value_size / 8 : max_depth;
    long used = 0, i = 0;
    offsets[0] = 0;
    for (; i < n && used + max_words <= words_cap; i++) {
        int32_t id = ids[i];
        if (bpf_elem(BPF_MAP_LOOKUP_ELEM, map_fd, &id, leaf) != 0) {
            status[i] = -errno;
        } else {
            status[i] = 0;
            long d = 0;
            while (d < max_words && leaf[d] != 0)
                d++;
            memcpy(words + used, leaf, (size_t)d * 8);
            used += d;
        }
        offsets[i + 1] = used;
        if (!in_sorted(keep, n_keep, id))
            bpf_elem(BPF_MAP_DELETE_ELEM, map_fd, &id, NULL); /* -ENOENT: gone already, fine */
    }
    return i;
}
