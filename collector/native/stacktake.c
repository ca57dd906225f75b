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

/* Entries read per BPF_MAP_LOOKUP_BATCH call (their values: about 1 KB each). */
#define GP_CFI_TAKE_BATCH 256

static long find_sorted_u64(const uint64_t *a, long n, uint64_t id)
{
    long lo = 0, hi = n;
    while (lo < hi) {
        long mid = lo + (hi - lo) / 2;
        if (a[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && a[lo] == id ? lo : -1;
}

/* The CFI walker's stacks (bpf/cfiunwind.h gp_cfi_stacks, read by collector/cfiunwind.py
 * CfiUnwinder.take): a hash map of u64 ids whose values (value_size bytes) are a u32 depth and a
 * u32 end reason, then the pcs. ids[0..n) sorted: for each, status[i] = 0 and its first `depth`
 * pcs (innermost first, at most value_size / 8 - 1) in words[i * stride .. i * stride + lens[i]),
 * stride = value_size / 8 - 1; or status[i] = -ENOENT when the map does not hold it. Then the ids
 * found and not in keep[0..n_keep) (sorted) are deleted.
 *
 * The map is read whole by BPF_MAP_LOOKUP_BATCH and the ids freed by one BPF_MAP_DELETE_BATCH:
 * a few system calls a drain, where a lookup and a delete per id were two each (about 4 us an id on
 * this VM: half a millisecond a second of a deep C++ code's drains at 99 Hz). The other source's
 * ids in the map are read and left alone (each source's ids are its own: bpf/common.h GP_IDS_*).
 * Returns 0, or -errno when the kernel refuses the batch calls (the caller reads id by id then;
 * nothing was deleted). */
EXPORT long gp_cfi_stacks_take(int map_fd, long value_size, const uint64_t *ids, long n, const uint64_t *keep,
                               long n_keep, uint64_t *words, int64_t *lens, int32_t *status)
{
    if (value_size <= 8 || value_size % 8 || value_size / 8 > GP_STACK_MAX_WORDS)
        return -EINVAL;
    long stride = value_size / 8 - 1;
    uint64_t *keys = malloc(GP_CFI_TAKE_BATCH * sizeof(uint64_t));
    uint64_t *values = malloc((size_t)GP_CFI_TAKE_BATCH * (size_t)value_size);
    uint64_t *gone = malloc((size_t)(n > 0 ? n : 1) * sizeof(uint64_t));
    long err = 0, n_gone = 0;
    if (!keys || !values || !gone) {
        err = -ENOMEM;
        goto out;
    }
    for (long i = 0; i < n; i++) {
        status[i] = -ENOENT;
        lens[i] = 0;
    }
    uint64_t in_token = 0, out_token = 0;
    int first = 1;
    for (;;) {
        union bpf_attr a;
        memset(&a, 0, sizeof(a));
        a.batch.in_batch = first ? 0 : (uint64_t)(uintptr_t)&in_token;
        a.batch.out_batch = (uint64_t)(uintptr_t)&out_token;
        a.batch.keys = (uint64_t)(uintptr_t)keys;
        a.batch.values = (uint64_t)(uintptr_t)values;
        a.batch.count = GP_CFI_TAKE_BATCH;
        a.batch.map_fd = (uint32_t)map_fd;
        long r = syscall(__NR_bpf, BPF_MAP_LOOKUP_BATCH, &a, sizeof(a));
        int done = r != 0 && errno == ENOENT; /* the last entries (count may be 0) */
        if (r != 0 && !done) {
            err = -errno; /* ENOSPC: a bucket longer than a batch; EINVAL: an old kernel */
            goto out;
        }
        for (uint32_t e = 0; e < a.batch.count; e++) {
            long i = find_sorted_u64(ids, n, keys[e]);
            if (i < 0 || status[i] == 0)
                continue;
            const uint64_t *v = (const uint64_t *)((const char *)values + (size_t)e * (size_t)value_size);
            uint32_t depth;
            memcpy(&depth, v, sizeof(depth)); /* the struct's first member */
            long d = (long)depth < stride ? (long)depth : stride;
            memcpy(words + i * stride, v + 1, (size_t)d * 8);
            lens[i] = d;
            status[i] = 0;
            if (find_sorted_u64(keep, n_keep, keys[e]) < 0)
                gone[n_gone++] = keys[e];
        }
        if (done)
            break;
        in_token = out_token;
        first = 0;
    }
    if (n_gone) {
        union bpf_attr a;
        memset(&a, 0, sizeof(a));
        a.batch.keys = (uint64_t)(uintptr_t)gone;
        a.batch.count = (uint32_t)n_gone;
        a.batch.map_fd = (uint32_t)map_fd;
        if (syscall(__NR_bpf, BPF_MAP_DELETE_BATCH, &a, sizeof(a)) != 0) {
            /* stopped at an id deleted meanwhile (not by us: never expected): the rest one by one */
            for (long k = a.batch.count; k < n_gone; k++)
                bpf_elem(BPF_MAP_DELETE_ELEM, map_fd, &gone[k], NULL);
        }
    }
out:
    free(keys);
    free(values);
    free(gone);
    return err;
}
