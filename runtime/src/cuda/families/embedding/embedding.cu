// embedding.cu: the embedding gather and its deterministic backward (no float atomics).
//
// Forward:
//   embedding_fwd_<t>(table [v, h], ids [n] (i64), out [n, h], n, v, h, bad)
//     out[i] = table[ids[i]], copied in the storage dtype (no arithmetic). An id outside
//     [0, v) lowers *bad (host-initialized to INT_MAX) to its position and its row is zeros.
//     Grid-stride over rows, blockDim.x threads across the row, 16-byte vectors when aligned.
// Backward, dtable [v, h] = for each k, the sum of the rows of dy whose id is k, in increasing
// position order, in F64, rounded once (zeros for ids that do not occur): exactly the CPU
// twin's order (runtime/src/cpu/embedding.rs), so the result is the CPU's bit for bit. Four
// launches, the first three shared by every dtype:
//   1. embedding_bwd_count(ids, n, v, counts, bad): counts[k] = occurrences of k (integer
//      atomics; counts zeroed by the host, v ints). Any grid.
//   2. embedding_bwd_scan(counts, v, starts): starts[0..=v], exclusive prefix sums. One block
//      of 1024 threads.
//   3. embedding_bwd_fill(ids, n, v, starts, positions): positions[starts[k]..starts[k+1]] =
//      the positions of id k in increasing order (a stable counting sort). Grid
//      ceil(v / 256), blockDim 1024 (32 warps; fewer whole warps work too): block b owns ids
//      [256 b, 256 b + 256); warp w scans the w-th 32nd of the positions, counting (shared memory, integer atomics), then
//      the per-warp counts are prefix-summed in warp order and each warp rescans its slice in
//      order, placing equal ids in lane order (__match_any_sync). 32 KiB of shared memory.
//   4. embedding_bwd_accumulate_<t>_<o>(dy [n, h], positions, starts, v, h, dtable): one block
//      per vocabulary row (grid-stride), threads across columns; each column's F64 sum over
//      the row's positions in order, stored as <o> (f32 for parameter gradients).
// Dtypes: <t> table/out/dy storage dtype; <o> the gradient table's dtype.
#include "castor_common.cuh"

template <typename T>
__device__ __forceinline__ void emb_fwd(const T* __restrict__ table, const i64* __restrict__ ids,
                                        T* __restrict__ out, i64 n, i64 v, int h, int* bad) {
    for (i64 i = blockIdx.x; i < n; i += gridDim.x) {
        const i64 id = ids[i];
        T* dst = out + i * h;
        if (id < 0 || id >= v) {
            if (threadIdx.x == 0) report_bad(bad, i);
            for (int j = threadIdx.x; j < h; j += blockDim.x) dst[j] = from_f32<T>(0.0f);
            continue;
        }
        const T* src = table + id * h;
        // Raw 16-byte copies: no conversion, so any dtype moves as uint4.
        const int per = 16 / int(sizeof(T));
        const int units = (aligned16(src) && aligned16(dst)) ? h / per : 0;
        for (int u = threadIdx.x; u < units; u += blockDim.x)
            reinterpret_cast<uint4*>(dst)[u] = reinterpret_cast<const uint4*>(src)[u];
        for (int j = units * per + threadIdx.x; j < h; j += blockDim.x) dst[j] = src[j];
    }
}

extern "C" __global__ void embedding_bwd_count(const i64* __restrict__ ids, i64 n, i64 v,
                                               int* counts, int* bad) {
    for (i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += i64(gridDim.x) * blockDim.x) {
        const i64 id = ids[i];
        if (id < 0 || id >= v) {
            report_bad(bad, i);
        } else {
            atomicAdd(&counts[id], 1);
        }
    }
}

// Exclusive scan of `counts` into starts[0..=v], one block, in chunks of blockDim.x.
extern "C" __global__ void embedding_bwd_scan(const int* __restrict__ counts, i64 v,
                                              int* __restrict__ starts) {
    __shared__ int warp_tot[32];
    __shared__ int carry;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (i64 base = 0; base < v; base += blockDim.x) {
        const i64 k = base + threadIdx.x;
        const int c = k < v ? counts[k] : 0;
        // Inclusive scan within the warp.
        int x = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) warp_tot[warp] = x;
        __syncthreads();
        if (warp == 0) {
            int t = lane < warps ? warp_tot[lane] : 0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, t, o);
                if (lane >= o) t += y;
            }
            if (lane < warps) warp_tot[lane] = t;  // inclusive totals per warp
        }
        __syncthreads();
        const int before = carry + (warp > 0 ? warp_tot[warp - 1] : 0);
        if (k < v) starts[k] = before + x - c;
        __syncthreads();
        if (threadIdx.x == 0) carry += warp_tot[warps - 1];
        __syncthreads();
    }
    if (threadIdx.x == 0) starts[v] = carry;
}

#define FILL_RANGE 256
#define FILL_WARPS 32

extern "C" __global__ void __launch_bounds__(1024)
    embedding_bwd_fill(const i64* __restrict__ ids, i64 n, i64 v, const int* __restrict__ starts,
                       int* __restrict__ positions) {
    __shared__ int cursor[FILL_WARPS][FILL_RANGE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = min(FILL_WARPS, int(blockDim.x >> 5));
    const i64 k0 = i64(blockIdx.x) * FILL_RANGE;
    // Whole warps only (blockDim.x a multiple of 32, up to 1024); any grid of at least
    // ceil(v / 256) blocks works (blocks past the last range return).
    if (k0 >= v || warp >= warps) return;
    for (int i = threadIdx.x; i < FILL_WARPS * FILL_RANGE; i += warps * 32)
        (&cursor[0][0])[i] = 0;
    __syncthreads();
    // Warp w's slice of positions, in whole batches of 32.
    const i64 per = ((n + warps - 1) / warps + 31) / 32 * 32;
    const i64 p0 = warp * per, p1 = min(n, p0 + per);
    for (i64 b = p0; b < p1; b += 32) {
        const i64 p = b + lane;
        const i64 key = p < p1 ? ids[p] - k0 : -1;
        if (key >= 0 && key < FILL_RANGE) atomicAdd(&cursor[warp][key], 1);
    }
    __syncthreads();
    // Prefix over warps, in warp order, from the bucket's global start.
    for (int t = threadIdx.x; t < FILL_RANGE && k0 + t < v; t += warps * 32) {
        int run = starts[k0 + t];
        for (int w = 0; w < warps; ++w) {
            const int c = cursor[w][t];
            cursor[w][t] = run;
            run += c;
        }
    }
    __syncthreads();
    const unsigned lt = (1u << lane) - 1u;
    for (i64 b = p0; b < p1; b += 32) {
        const i64 p = b + lane;
        i64 key = p < p1 ? ids[p] - k0 : -1;
        if (key < 0 || key >= FILL_RANGE) key = -1;
        const unsigned peers = __match_any_sync(0xffffffffu, int(key));
        int slot = 0;
        if (key >= 0) slot = cursor[warp][key] + __popc(peers & lt);
        __syncwarp();
        if (key >= 0) {
            positions[slot] = int(p);
            if ((peers & lt) == 0) cursor[warp][key] += __popc(peers);  // the group's first lane
        }
        __syncwarp();
    }
}

template <typename T, typename O>
__device__ __forceinline__ void emb_bwd_acc(const T* __restrict__ dy, const int* __restrict__ positions,
                                            const int* __restrict__ starts, i64 v, int h,
                                            O* __restrict__ dtable) {
    for (i64 k = blockIdx.x; k < v; k += gridDim.x) {
        const int s0 = starts[k], s1 = starts[k + 1];
        O* dst = dtable + k * h;
        for (int j = threadIdx.x; j < h; j += blockDim.x) {
            double acc = 0.0;
            for (int s = s0; s < s1; ++s) acc += double(to_f32(dy[i64(positions[s]) * h + j]));
            dst[j] = from_f32<O>(float(acc));
        }
    }
}

#define EMBEDDING(T, t)                                                                        \
    extern "C" __global__ void embedding_fwd_##t(const T* table, const i64* ids, T* out, i64 n,\
                                                 i64 v, int h, int* bad) {                     \
        emb_fwd<T>(table, ids, out, n, v, h, bad);                                             \
    }

#define EMBEDDING_BWD(T, O, t, o)                                                              \
    extern "C" __global__ void embedding_bwd_accumulate_##t##_##o(                             \
        const T* dy, const int* positions, const int* starts, i64 v, int h, O* dtable) {       \
        emb_bwd_acc<T, O>(dy, positions, starts, v, h, dtable);                                \
    }

CASTOR_FOR_EACH_T(EMBEDDING)
EMBEDDING_BWD(float, float, f32, f32)
EMBEDDING_BWD(__half, float, f16, f32)
EMBEDDING_BWD(__nv_bfloat16, float, bf16, f32)
EMBEDDING_BWD(__half, __half, f16, f16)
EMBEDDING_BWD(__nv_bfloat16, __nv_bfloat16, bf16, bf16)
