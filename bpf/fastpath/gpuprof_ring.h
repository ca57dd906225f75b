/* The per-process shared-memory ring of the fast path: <job dir>/gpuprof-<job>-<pid>, in the
 * per-job directory /dev/shm/gpuprof-<job>@<node> the prolog makes for the job's uid (docs/probes.md).
 *
 * Producers are the application's threads (any number: a slot is claimed with one CAS on head);
 * the consumer is the collector, which reads slots in order while their seq says "written" and
 * then advances tail. A producer that finds the ring full counts a drop and returns: it never
 * waits. The collector never trusts head; it validates the header and reads seq only.
 */
#ifndef GPUPROF_RING_H
#define GPUPROF_RING_H

#include "../gpuprof_events.h"

#define GP_RING_MAGIC 0x31474e5246504750ULL /* "PGPFRNG1" little-endian */
#define GP_RING_VERSION 2 /* 2: 88-byte records (gp_fp_comm without the 128-byte uid) */
#define GP_RING_DEFAULT_RECORDS 65536 /* 5.6 MiB a process: bursts of small messages (NetPIPE: ~100k calls in a second) fit between two drains */

#define GP_REC_CALL 1
#define GP_REC_COMM 2

struct gp_ring_header {
    u64 magic;
    u32 version;
    u32 record_size;
    u64 capacity; /* records, a power of two */
    u32 pid;
    u32 header_size;
    /* $SLURMD_NODENAME of the writer: several virtual Slurm nodes can share one host and its
     * /dev/shm, and each node's collector drains only its own node's rings. */
    char node[32];
    u64 head; /* next slot to claim (producers): its own cache line */
    u64 pad1[7];
    u64 tail; /* next slot to read (collector) */
    u64 pad2[7];
    u64 dropped; /* records not written because the ring was full */
    u64 pad3[7];
};

/* gp_comm less its 128-byte ncclUniqueId copy: the interposer hashes the id itself (uid_hash),
 * which is all the collector uses, and the record shrinks from 216 to 88 bytes. The drain reads
 * every record the job writes, so its cost follows the bytes (docs/probes.md). */
struct gp_fp_comm {
    GP_COMM_FIELDS
};

struct gp_record {
    u64 seq; /* position + 1 once the record is complete */
    u32 kind; /* GP_REC_CALL or GP_REC_COMM */
    u32 pad;
    union {
        struct gp_call call;
        struct gp_fp_comm comm;
    } u;
};

#endif
