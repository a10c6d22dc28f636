// key_lengths.cu: cuDNN's sequence lengths from a key-padding mask, for castor's cuDNN
// attention graphs (runtime/src/cuda/sdpa.rs), which take a right-padded batch as cuDNN's own
// padding masks do: per batch, the query rows and the number of keys kept.
//
//   attention_key_lengths(flags [rows, keys] (bytes, nonzero = keep), rows, keys, rows_q,
//                         lengths, kv_offset, bad)
//     One block per mask row r: lengths[r] = rows_q (every query row takes part) and
//     lengths[kv_offset + r] = the keys before the row's first dropped key (all of them when
//     it drops none); block 0 zeroes lengths[rows, kv_offset). A row that cuDNN's lengths cannot express lowers *bad (host-initialized
//     to INT_MAX; nullable) to a position r * keys + j: j = 0 for a row that keeps no key,
//     else the last key it keeps after dropping an earlier one (left padding, holes).
//     castor's attention kernels take such rows; cuDNN's graphs here would not mask them.
// Launch: grid (rows), block (256), no dynamic shared memory.
#include "castor_common.cuh"

extern "C" __global__ void attention_key_lengths(const unsigned char* __restrict__ flags,
                                                 int rows, int keys, int rows_q,
                                                 int* __restrict__ lengths, int kv_offset,
                                                 int* bad) {
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
}
