// dropout.cu: inverted dropout, forward and backward (the backward is the same kernel on dy:
// the mask is regenerated from the key, never stored).
//
// Entry points (suffix = storage dtype of x and y: f32, f16, bf16):
//   dropout_<t>(const T* x, T* y, const i64* key, i64 n, unsigned stream, u64 threshold,
//               double scale)
//     y[i] = x[i] * (draw(i) < threshold ? scale : 0), with draw(i) element i % 4 of the
//     Philox draws of block i / 4 keyed by key = (seed, offset) and stream
//     (castor_common.cuh), threshold = round((1 - p) 2^32) and scale the F32 1 / (1 - p)
//     (given as a double holding that F32). The product by 0 keeps NaN and Inf visible to
//     the overflow check, as PyTorch's x * mask * scale does. A negative offset is evaluation
//     mode: y = x (rounded to T, which changes nothing).
// Arithmetic in F32, one rounding at the store: bit for bit the CPU twin
// (runtime/src/cpu/dropout.rs). The key is read from device memory, so a captured graph
// draws a new mask each time the key's offset changes.
// In place is allowed (y == x): each element is read before it is written by the same thread.
// Launch: any 1-D grid and block, grid-stride over blocks of 4 elements (one Philox call).
#include "castor_common.cuh"

template <typename T>
__device__ __forceinline__ void dropout(const T* x, T* y, const i64* key, i64 n,
                                        unsigned stream, u64 threshold, float scale) {
    const u64 seed = (u64)key[0];
    const i64 offset = key[1];
    const i64 blocks = (n + 3) / 4;
    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    if (offset < 0) {
        for (i64 i = tid; i < n; i += stride) y[i] = x[i];
        return;
    }
    for (i64 b = tid; b < blocks; b += stride) {
        unsigned r[4];
        dropout_draws(r, seed, offset, stream, (u64)b);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const i64 i = 4 * b + k;
            if (i < n) {
                const float m = (u64)r[k] < threshold ? scale : 0.0f;
                y[i] = from_f32<T>(to_f32(x[i]) * m);
            }
        }
    }
}

#define DROPOUT(T, t)                                                                          \
    extern "C" __global__ void dropout_##t(const T* x, T* y, const i64* key, i64 n,           \
                                           unsigned stream, u64 threshold, double scale) {    \
        dropout<T>(x, y, key, n, stream, threshold, (float)scale);                             \
    }
CASTOR_FOR_EACH_T(DROPOUT)
