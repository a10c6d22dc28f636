// host_model.cu: kernels for kernels/tests/host.rs, which checks the host build's execution
// model (host/castor_host.h, host/runtime.cpp) against CUDA's documented semantics, and
// kernels with seeded bugs it must catch. Not part of castor's kernels.

// Every warp operation, each lane's results in out[14 * thread ..]: the shuffles with `width`,
// the votes, the matches, the reductions.
extern "C" __global__ void warp_ops(const int* in, int* out, int width) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int v = in[t];
    int* o = out + 14 * t;
    o[0] = __shfl_sync(0xffffffffu, v, 3, width);
    o[1] = __shfl_up_sync(0xffffffffu, v, 1, width);
    o[2] = __shfl_down_sync(0xffffffffu, v, 2, width);
    o[3] = __shfl_xor_sync(0xffffffffu, v, 5, width);
    o[4] = __all_sync(0xffffffffu, v > 0);
    o[5] = __any_sync(0xffffffffu, v > 90);
    o[6] = int(__ballot_sync(0xffffffffu, v & 1));
    o[7] = int(__match_any_sync(0xffffffffu, v % 4));
    int pred = -1;
    o[8] = int(__match_all_sync(0xffffffffu, v / 1000, &pred));
    o[9] = pred;
    o[10] = __shfl_sync(0xffffffffu, (long long)v * 3000000000ll, 7) / 1000000;  // 8 bytes
    o[11] = int(__activemask() >> (threadIdx.x & 31) & 1u);  // the active mask holds the caller
    o[12] = __reduce_min_sync(0xffffffffu, v - 50);
    o[13] = __reduce_max_sync(0xffffffffu, v - 50);
}

// Two half-warps, each with its own mask: lanes 0-15 and 16-31 exchange separately.
extern "C" __global__ void half_warps(const int* in, int* out) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    const int v = in[threadIdx.x];
    out[threadIdx.x] = __shfl_xor_sync(mask, v, 1) + 1000 * __popc(__ballot_sync(mask, v & 1));
}

// Shared memory and barriers: the block's values reversed, twice through shared memory.
extern "C" __global__ void reverse_block(const float* in, float* out) {
    __shared__ float s[1024];
    const int n = blockDim.x;
    const int i = threadIdx.x;
    s[i] = in[blockIdx.x * n + i];
    __syncthreads();
    const float r = s[n - 1 - i];
    __syncthreads();
    s[i] = r * 2.0f;
    __syncthreads();
    out[blockIdx.x * n + i] = s[n - 1 - i];
}

// The seeded race: reverse_block's first barrier missing. A thread reads a value another
// thread may not have written yet.
extern "C" __global__ void reverse_block_racy(const float* in, float* out) {
    __shared__ float s[1024];
    const int n = blockDim.x;
    const int i = threadIdx.x;
    s[i] = in[blockIdx.x * n + i];
    const float r = s[n - 1 - i];
    __syncthreads();
    s[i] = r * 2.0f;
    __syncthreads();
    out[blockIdx.x * n + i] = s[n - 1 - i];
}

// Atomics across the grid: counts of each value mod 7, the minimum, a CAS chain.
extern "C" __global__ void atomics(const int* in, int n, int* counts, int* minimum,
                                   unsigned long long* sum, int* cas_hits) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        atomicAdd(&counts[in[i] % 7], 1);
        atomicMin(minimum, in[i]);
        atomicAdd(sum, (unsigned long long)in[i]);
        // Exactly one thread swaps 0 -> 1.
        if (atomicCAS(&cas_hits[1], 0, 1) == 0) atomicAdd(&cas_hits[0], 1);
    }
}

// Each float in, every conversion of castor_host.h: 8 halves and bfloat16s (rn, rz, rd, ru
// each), and the integer conversions.
extern "C" __global__ void conversions(const float* x, int n, unsigned short* h, long long* ll,
                                       float* back) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = x[i];
        unsigned short* o = h + 8 * i;
        o[0] = __half_as_ushort(__float2half_rn(v));
        o[1] = __half_as_ushort(__float2half_rz(v));
        o[2] = __half_as_ushort(__float2half_rd(v));
        o[3] = __half_as_ushort(__float2half_ru(v));
        o[4] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
        o[5] = __bfloat16_as_ushort(__float2bfloat16_rz(v));
        o[6] = __bfloat16_as_ushort(__float2bfloat16_rd(v));
        o[7] = __bfloat16_as_ushort(__float2bfloat16_ru(v));
        ll[i] = isnan(v) ? 0 : __float2ll_rz(v);
        back[2 * i] = __ll2float_rn(ll[i]);
        back[2 * i + 1] = __half2float(__float2half_rn(v));
    }
}

// Every half and bfloat16 bit pattern widened to F32.
extern "C" __global__ void widen(int n, float* f16, float* bf16) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        f16[i] = __half2float(__ushort_as_half((unsigned short)i));
        bf16[i] = __bfloat162float(__ushort_as_bfloat16((unsigned short)i));
    }
}

// Misuse the device leaves undefined, each of which must be an error naming the thread.
// kind 0: a shuffle naming lanes that exited; 1: a shuffle naming a lane that waits at
// __syncthreads; 2: a mask without the calling lane; 3: two lanes of a warp at different warp
// operations; 4: a shuffle reading a lane outside its mask.
extern "C" __global__ void misuse(int kind, int* out) {
    const int lane = threadIdx.x & 31;
    int v = lane;
    if (kind == 0) {
        if (lane >= 16) return;
        v = __shfl_sync(0xffffffffu, v, 0);
    } else if (kind == 1) {
        if (lane == 0) __syncthreads();
        v = __shfl_sync(0xffffffffu, v, 0);
    } else if (kind == 2) {
        v = __shfl_sync(1u << ((lane + 1) & 31), v, 0);
    } else if (kind == 3) {
        v = lane < 8 ? __shfl_xor_sync(0xffffffffu, v, 1) : __shfl_up_sync(0xffffffffu, v, 1);
    } else if (kind == 4) {
        if (lane < 16) v = __shfl_sync(0x0000ffffu, v, 20);
    }
    out[threadIdx.x] = v;
}

// The seeded out-of-bounds write: one element past the end of `out` (n elements).
extern "C" __global__ void write_past_end(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = 1.0f;
}

// Blocks in a chain: block b waits until `count` reaches b (castor_common.cuh's wait_flag on
// the host), appends its index to `order`, and raises the count. Run in index order it
// completes; run in the reverse order the first block's wait can never end, which is an error.
extern "C" __global__ void chained_blocks(int* count, int* order) {
    if (threadIdx.x == 0) {
        castor_host_wait_flag(count, int(blockIdx.x));
        order[blockIdx.x] = *count;
        __threadfence();
        atomicAdd(count, 1);
    }
}

#include "castor_common.cuh"

// castor_common.cuh's warp matrix operations in the host build, one warp per 32 threads. The
// product: d_out[8 t ..] = the host form (castor_host_warp_mma, one warp operation), then the
// shuffle form (warp_mma_by_shuffles), both from d[4 t ..], a[8 t ..] and b[4 t ..]. ldmatrix:
// each warp copies its 256 values of `tiles` (four 8 x 8 matrices, row-major) into shared
// memory, lane l names row l % 8 of matrix l / 8, and r_out[12 t ..] receives ldsm_x4,
// ldsm_x4_t, ldsm_x2 and ldsm_x2_t's registers in that order.
extern "C" __global__ void warp_matrix_ops(const float* a, const float* b, const float* d,
                                           float* d_out, const unsigned short* tiles,
                                           unsigned* r_out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float fa[8], fb[4], fast[4], slow[4];
    for (int i = 0; i < 8; ++i) fa[i] = a[8 * t + i];
    for (int i = 0; i < 4; ++i) {
        fb[i] = b[4 * t + i];
        fast[i] = slow[i] = d[4 * t + i];
    }
    warp_mma_shuffle<float>(fast, fa, fb);
    warp_mma_by_shuffles(slow, fa, fb);
    for (int i = 0; i < 4; ++i) {
        d_out[8 * t + i] = fast[i];
        d_out[8 * t + 4 + i] = slow[i];
    }
    __shared__ unsigned short tile[32][256];
    const unsigned short* mine = tiles + 256 * (t >> 5);
    for (int i = lane; i < 256; i += 32) tile[warp][i] = mine[i];
    __syncwarp();
    const void* row = &tile[warp][8 * lane];
    unsigned x4[4], x4t[4], x2[2], x2t[2];
    ldsm_x4(x4, row);
    ldsm_x4_t(x4t, row);
    ldsm_x2(x2, row);
    ldsm_x2_t(x2t, row);
    unsigned* o = r_out + 12 * t;
    for (int i = 0; i < 4; ++i) {
        o[i] = x4[i];
        o[4 + i] = x4t[i];
    }
    for (int i = 0; i < 2; ++i) {
        o[8 + i] = x2[i];
        o[10 + i] = x2t[i];
    }
}
