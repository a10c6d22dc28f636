// key_lengths.cu: cuDNN's sequence lengths from a key-padding mask, for castor's cuDNN
// attention graphs (runtime/src/cuda/sdpa.rs), which take a right-padded batch as cuDNN's own
// padding masks do: per batch, the query rows and the number of keys kept.
//
//   attention_key_lengths(flags [rows, keys] (bytes, nonzero = keep), rows, keys, rows_q,
//                         lengths, kv_offset, bad, dk, dv, heads, dim,
//                         dk_batch, dk_head, dk_row, dv_batch, dv_head, dv_row)
//     One block per mask row r: lengths[r] = rows_q (every query row takes part) and
//     lengths[kv_offset + r] = the keys before the row's first dropped key (all of them when
//     it drops none); block 0 zeroes lengths[rows, kv_offset). A row that cuDNN's lengths
//     cannot express lowers *bad (host-initialized to INT_MAX; nullable) to a position
//     r * keys + j: j = 0 for a row that keeps no key, else the last key it keeps after
//     dropping an earlier one (left padding, holes). castor's attention kernels take such
//     rows; cuDNN's graphs here would not mask them.
//     Before a padded backward (dk and dv non-null, 16-bit, `heads` kv heads of `dim`
//     elements, element strides per batch, head and key row; the last dim dense): the block
//     also zeroes batch r's dK and dV rows from its length on, every head. cuDNN's padded
//     backward writes no gradient for those keys (cudnn-frontend's own tests zero them in its
//     output before comparing), and every other executor gives them zero; a batch with no
//     padding zeroes nothing, where a memset of the gradients would move them all.
// Launch: grid (rows), block (256), no dynamic shared memory.
#include "castor_common.cuh"

extern "C" __global__ void attention_key_lengths(const unsigned char* __restrict__ flags,
                                                 int rows, int keys, int rows_q,
                                                 int* __restrict__ lengths, int kv_offset,
                                                 int* bad, unsigned short* __restrict__ dk,
                                                 unsigned short* __restrict__ dv, int heads,
                                                 int dim, int dk_batch, int dk_head, int dk_row,
                                                 int dv_batch, int dv_head, int dv_row) {
    __shared__ int first_dropped, last_kept;
    const int r = blockIdx.x;
    if (r >= rows) return;
    if (threadIdx.x == 0) {
        first_dropped = keys;
        last_kept = -1;
    }
    __syncthreads();
    const unsigned char* row = flags + i64(r) * keys;
    int dropped = keys, kept = -1;
    // Each thread's keys rise, so its first dropped key is its least and its last kept key
    // its greatest.
    for (int j = threadIdx.x; j < keys; j += blockDim.x) {
        if (row[j] != 0) {
            kept = j;
        } else if (dropped == keys) {
            dropped = j;
        }
    }
    atomicMin(&first_dropped, dropped);
    atomicMax(&last_kept, kept);
    __syncthreads();
    if (threadIdx.x == 0) {
        // The padding between the two arrays (kv_offset >= rows keeps the second aligned).
        if (r == 0) {
            for (int i = rows; i < kv_offset; ++i) lengths[i] = 0;
        }
        lengths[r] = rows_q;
        lengths[kv_offset + r] = first_dropped;
        if (last_kept < 0) {
            report_bad(bad, i64(r) * keys);
        } else if (last_kept > first_dropped) {
            report_bad(bad, i64(r) * keys + last_kept);
        }
    }
    if (dk == nullptr || dv == nullptr) return;
    // The padded keys' gradient rows: (keys - length) rows of `heads` x `dim` elements each.
    const i64 per_key = i64(heads) * dim;
    const i64 count = i64(keys - first_dropped) * per_key;
    for (i64 i = threadIdx.x; i < count; i += blockDim.x) {
        const i64 j = first_dropped + i / per_key;
        const int h = int(i % per_key) / dim;
        const int e = int(i % per_key) % dim;
        dk[i64(r) * dk_batch + i64(h) * dk_head + j * dk_row + e] = 0;
        dv[i64(r) * dv_batch + i64(h) * dv_head + j * dv_row + e] = 0;
    }
}
