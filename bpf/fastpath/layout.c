/* Prints the byte layout of the ring and its records as JSON: collector/sources/fastpath.py reads
 * it (build/layout.json) instead of restating the C structs in Python. */
#include <stddef.h>
#include <stdio.h>

#include "gpuprof_ring.h"

#define F(s, f, t) printf("%s[\"%s\", %zu, \"%s\"]", first++ ? ", " : "", #f, offsetof(s, f), t)

int main(void)
{
    int first = 0;
    printf("{\"magic\": %llu, \"version\": %d, \"header_size\": %zu, \"record_size\": %zu, ",
           (unsigned long long)GP_RING_MAGIC, GP_RING_VERSION, sizeof(struct gp_ring_header),
           sizeof(struct gp_record));
    printf("\"default_records\": %d, \"rec_call\": %d, \"rec_comm\": %d, ", GP_RING_DEFAULT_RECORDS, GP_REC_CALL,
           GP_REC_COMM);
    printf("\"header\": [");
    F(struct gp_ring_header, magic, "<u8");
    F(struct gp_ring_header, version, "<u4");
    F(struct gp_ring_header, record_size, "<u4");
    F(struct gp_ring_header, capacity, "<u8");
    F(struct gp_ring_header, pid, "<u4");
    F(struct gp_ring_header, header_size, "<u4");
    F(struct gp_ring_header, node, "S32");
    F(struct gp_ring_header, head, "<u8");
    F(struct gp_ring_header, tail, "<u8");
    F(struct gp_ring_header, dropped, "<u8");
    printf("], \"record\": [");
    first = 0;
    F(struct gp_record, seq, "<u8");
    F(struct gp_record, kind, "<u4");
    printf("], \"call_offset\": %zu, \"call\": [", offsetof(struct gp_record, u));
    first = 0;
    F(struct gp_call, t_enter_ns, "<u8");
    F(struct gp_call, t_exit_ns, "<u8");
    F(struct gp_call, handle, "<u8");
    F(struct gp_call, seq, "<u8");
    F(struct gp_call, bytes, "<u8");
    F(struct gp_call, aux, "<u8");
    F(struct gp_call, pid, "<u4");
    F(struct gp_call, tid, "<u4");
    F(struct gp_call, peer, "<i4");
    F(struct gp_call, tag, "<i4");
    F(struct gp_call, ret, "<i4");
    F(struct gp_call, op, "<u2");
    F(struct gp_call, library, "u1");
    F(struct gp_call, flags, "u1");
    printf("], \"comm\": [");
    first = 0;
    F(struct gp_fp_comm, t_ns, "<u8");
    F(struct gp_fp_comm, handle, "<u8");
    F(struct gp_fp_comm, parent, "<u8");
    F(struct gp_fp_comm, index, "<u8");
    F(struct gp_fp_comm, uid_hash, "<u8");
    F(struct gp_fp_comm, pid, "<u4");
    F(struct gp_fp_comm, tid, "<u4");
    F(struct gp_fp_comm, color, "<i4");
    F(struct gp_fp_comm, key, "<i4");
    F(struct gp_fp_comm, rank, "<i4");
    F(struct gp_fp_comm, size, "<i4");
    F(struct gp_fp_comm, ret, "<i4");
    F(struct gp_fp_comm, op, "<u2");
    F(struct gp_fp_comm, library, "u1");
    F(struct gp_fp_comm, flags, "u1");
    printf("]}\n");
    return 0;
}
