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
    /* the NCCL profiler plugin's and the NVTX injection's records (gpuprof_ring.h) */
    printf("], \"rec_nccl_op\": %d, \"rec_nccl_dev\": %d, \"rec_nccl_comm\": %d, \"rec_nvtx_range\": %d, "
           "\"rec_nvtx_string\": %d, \"nvtx_part_bytes\": %d, \"nvtx_string_max\": %d, \"nccl_op\": [",
           GP_REC_NCCL_OP, GP_REC_NCCL_DEV, GP_REC_NCCL_COMM, GP_REC_NVTX_RANGE, GP_REC_NVTX_STRING,
           GP_NVTX_PART_BYTES, GP_NVTX_STRING_MAX);
    first = 0;
    F(struct gp_nccl_op, t_start_ns, "<u8");
    F(struct gp_nccl_op, t_stop_ns, "<u8");
    F(struct gp_nccl_op, comm_hash, "<u8");
    F(struct gp_nccl_op, seq, "<u8");
    F(struct gp_nccl_op, count, "<u8");
    F(struct gp_nccl_op, context, "<u8");
    F(struct gp_nccl_op, tid, "<u4");
    F(struct gp_nccl_op, peer, "<i4");
    F(struct gp_nccl_op, rank, "<i4");
    F(struct gp_nccl_op, nranks, "<i4");
    F(struct gp_nccl_op, op, "<u2");
    F(struct gp_nccl_op, datatype, "u1");
    F(struct gp_nccl_op, flags, "u1");
    F(struct gp_nccl_op, nccl_seq, "<u4");
    printf("], \"nccl_dev\": [");
    first = 0;
    F(struct gp_nccl_dev, comm_hash, "<u8");
    F(struct gp_nccl_dev, seq, "<u8");
    F(struct gp_nccl_dev, count, "<u8");
    F(struct gp_nccl_dev, dev_start, "<u8");
    F(struct gp_nccl_dev, dev_end, "<u8");
    F(struct gp_nccl_dev, pair_host, "<u8");
    F(struct gp_nccl_dev, pair_delta, "<i8");
    F(struct gp_nccl_dev, op, "<u2");
    F(struct gp_nccl_dev, n_channels, "<u2");
    F(struct gp_nccl_dev, peer, "<i4");
    F(struct gp_nccl_dev, timing, "u1");
    F(struct gp_nccl_dev, algorithm, "u1");
    F(struct gp_nccl_dev, protocol, "u1");
    F(struct gp_nccl_dev, datatype, "u1");
    printf("], \"nccl_comm\": [");
    first = 0;
    F(struct gp_nccl_comm, t_ns, "<u8");
    F(struct gp_nccl_comm, comm_hash, "<u8");
    F(struct gp_nccl_comm, context, "<u8");
    F(struct gp_nccl_comm, pid, "<u4");
    F(struct gp_nccl_comm, tid, "<u4");
    F(struct gp_nccl_comm, rank, "<i4");
    F(struct gp_nccl_comm, nranks, "<i4");
    F(struct gp_nccl_comm, nnodes, "<i4");
    F(struct gp_nccl_comm, version, "<u4");
    F(struct gp_nccl_comm, name, "S24");
    printf("], \"nvtx_range\": [");
    first = 0;
    F(struct gp_nvtx_range, t_start_ns, "<u8");
    F(struct gp_nvtx_range, t_end_ns, "<u8");
    F(struct gp_nvtx_range, tid, "<u4");
    F(struct gp_nvtx_range, domain_id, "<u4");
    F(struct gp_nvtx_range, name_id, "<u4");
    F(struct gp_nvtx_range, category, "<u4");
    F(struct gp_nvtx_range, depth, "<u2");
    F(struct gp_nvtx_range, kind, "u1");
    F(struct gp_nvtx_range, flags, "u1");
    F(struct gp_nvtx_range, color, "<u4");
    printf("], \"nvtx_string\": [");
    first = 0;
    F(struct gp_nvtx_string, string_id, "<u4");
    F(struct gp_nvtx_string, total_len, "<u2");
    F(struct gp_nvtx_string, part, "u1");
    F(struct gp_nvtx_string, flags, "u1");
    F(struct gp_nvtx_string, text, "S60");
    printf("], \"rec_cuda_kernel\": %d, \"rec_cuda_name\": %d, \"cuda_kernel\": [", GP_REC_CUDA_KERNEL,
           GP_REC_CUDA_NAME);
    first = 0;
    F(struct gp_cuda_kernel, t_start_ns, "<u8");
    F(struct gp_cuda_kernel, t_end_ns, "<u8");
    F(struct gp_cuda_kernel, correlation_id, "<u4");
    F(struct gp_cuda_kernel, device, "<u4");
    F(struct gp_cuda_kernel, stream, "<u4");
    F(struct gp_cuda_kernel, name_id, "<u4");
    F(struct gp_cuda_kernel, grid, "(3,)<i4");
    F(struct gp_cuda_kernel, block, "(3,)<i4");
    F(struct gp_cuda_kernel, dynamic_shared, "<i4");
    F(struct gp_cuda_kernel, static_shared, "<i4");
    F(struct gp_cuda_kernel, registers, "<u2");
    F(struct gp_cuda_kernel, flags, "u1");
    /* its names use the string record's layout (nvtx_string) */
    printf("], \"rec_cuda_launch\": %d, \"cuda_launch\": [", GP_REC_CUDA_LAUNCH);
    first = 0;
    F(struct gp_cuda_launch, t_ns, "<u8");
    F(struct gp_cuda_launch, tid, "<u4");
    F(struct gp_cuda_launch, correlation_id, "<u4");
    F(struct gp_cuda_launch, cbid, "<u4");
    F(struct gp_cuda_launch, domain, "u1");
    printf("]}\n");
    return 0;
}
