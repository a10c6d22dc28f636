// grad_norm.cu: the global L2 norm of the unscaled gradients over many buffers, and the
// found-inf flag, deterministic in two stages (no atomics).
//
//   grad_norm_partials(tensors, chunks, n_chunks, scale, partials)
//     tensors: device table of NormTensor { const void* data; i64 numel; i32 dtype; i32 pad }
//     (24 bytes; dtype 0 = f32, 1 = f16, 2 = bf16, so F32 master-precision gradients and
//     gradients kept in the compute dtype share one launch); chunks: TensorChunk
//     (castor_common.cuh). partials[c] = sum over chunk c of (F64(g) * F64(1/scale))^2,
//     one F64 value per chunk whatever the grid size.
//   grad_norm_finalize(partials, n_chunks, grad_norm, found_inf), one block:
//     *grad_norm = F32(sqrt(sum of partials)) with the sum in a fixed order (thread-strided,
//     then the block tree); *found_inf (nullable) = 1 when the norm is not finite, else 0.
//     The optimizers and the loss scaler read grad_norm itself: "not finite" is found-inf, and
//     the clip coefficient min(1, max_norm / (norm + 1e-6)) is formed from it in the
//     optimizer, as the CPU twin does.
// Rounding points, as runtime/src/cpu/optimizer.rs grad_norm: 1/scale in F32, then the square
// of each unscaled gradient and every sum in F64, one rounding of the square root to F32. Use
// 16384-element chunks to group the F64 sums as the CPU twin does (the order inside a chunk and
// across chunks still differs: the F64 results agree to ~1e-16 relative, far below F32).
// An inf or NaN gradient makes its partial, and so the norm, inf or NaN.
// Launch: partials: any grid and blockDim.x (a multiple of 32); finalize: one block.
#include "castor_common.cuh"

struct NormTensor {
    const void* data;
    i64 numel;
    int dtype;
    int pad;
};

template <typename T>
__device__ __forceinline__ double sum_sq(const T* p, int len, double inv) {
    double acc = 0.0;
    const int units = aligned16(p) ? len / UNIT : 0;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        float x[UNIT];
        load8(p + u * UNIT, x);
#pragma unroll
        for (int k = 0; k < UNIT; ++k) {
            const double v = double(x[k]) * inv;
            acc += v * v;
        }
    }
    for (int i = units * UNIT + threadIdx.x; i < len; i += blockDim.x) {
        const double v = double(to_f32(p[i])) * inv;
        acc += v * v;
    }
    return acc;
}

extern "C" __global__ void grad_norm_partials(const NormTensor* __restrict__ tensors,
                                              const TensorChunk* __restrict__ chunks, int n_chunks,
                                              const float* scale, double* __restrict__ partials) {
    __shared__ double scratch[32];
    const double inv = double(1.0f / *scale);
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const TensorChunk ch = chunks[c];
        const NormTensor t = tensors[ch.tensor];
        const int len = int(min(i64(ch.len), t.numel - ch.start));
        double acc;
        if (t.dtype == 1) {
            acc = sum_sq(static_cast<const __half*>(t.data) + ch.start, len, inv);
        } else if (t.dtype == 2) {
            acc = sum_sq(static_cast<const __nv_bfloat16*>(t.data) + ch.start, len, inv);
        } else {
            acc = sum_sq(static_cast<const float*>(t.data) + ch.start, len, inv);
        }
        acc = block_sum(acc, scratch);
        if (threadIdx.x == 0) partials[c] = acc;
    }
}

extern "C" __global__ void grad_norm_finalize(const double* __restrict__ partials, int n_chunks,
                                              float* grad_norm, int* found_inf) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) acc += partials[c];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        const float norm = float(sqrt(acc));
        *grad_norm = norm;
        if (found_inf) *found_inf = isfinite(norm) ? 0 : 1;
    }
}
