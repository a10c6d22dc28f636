// rope.cu: rotary position embedding (rotate-half layout, LLaMA/HF), forward and backward.
//
// Entry points:
//   rope_table(cs [t, d/2] float2, t, d, theta): (cos, sin) of angle = pos * inv_freq[i],
//     inv_freq[i] = 1 / theta_f32^(2i / d), all in F32 as HF's LlamaRotaryEmbedding computes
//     them. Built once per plan (constant); the executor may instead upload the CPU twin's
//     table (runtime/src/cpu/rope.rs) for bit-identical angles: CUDA's powf/sincosf are within
//     a few ulp of the host libm's, not always equal.
//   rope_fwd_<t>(x, y, cs, rows, t, d): x, y [rows, d] with rows = (leading dims) * t and the
//     position of row r = r % t:
//       y[i]       = x[i] cos - x[i + d/2] sin
//       y[i + d/2] = x[i + d/2] cos + x[i] sin            (i < d/2)
//   rope_bwd_<t>(dy, dx, cs, rows, t, d): the transpose (rotation by the negated angle),
//       dx[i] = dy[i] cos + dy[i + d/2] sin, dx[i + d/2] = dy[i + d/2] cos - dy[i] sin.
// Fuses: the rotation of both halves with one read and one write of each element.
// Dtypes: <t> storage dtype of x/y (dy/dx); the table is F32. Rounding: the rotation in F32
// from F32 cos/sin, rounded once to <t>, as the CPU twin (HF rounds cos/sin to the activation
// dtype and after each multiply and add; castor rounds once).
// In place is allowed (y == x): each thread reads both elements of its pair before writing.
// Launch: any 1-D grid and block, one thread per (row, i) pair, grid-stride; consecutive
// threads take consecutive i, so both halves are read coalesced.
#include "castor_common.cuh"

extern "C" __global__ void rope_table(float2* __restrict__ cs, int t, int d, double theta) {
    const int half = d / 2;
    const float base = float(theta);
    const i64 total = i64(t) * half;
    for (i64 idx = i64(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += i64(gridDim.x) * blockDim.x) {
        const int pos = int(idx / half), i = int(idx % half);
        const float inv_freq = 1.0f / powf(base, float(2 * i) / float(d));
        const float angle = float(pos) * inv_freq;
        float s, c;
        sincosf(angle, &s, &c);
        cs[idx] = make_float2(c, s);
    }
}

template <typename T, bool BWD>
__device__ __forceinline__ void rope(const T* x, T* y, const float2* __restrict__ cs, i64 rows,
                                     int t, int d) {
    const int half = d / 2;
    const i64 total = rows * half;
    for (i64 idx = i64(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += i64(gridDim.x) * blockDim.x) {
        const i64 row = idx / half;
        const int i = int(idx % half);
        const float2 a = cs[(row % t) * half + i];
        const float c = a.x, s = a.y;
        const i64 lo = row * d + i, hi = lo + half;
        const float x1 = to_f32(x[lo]), x2 = to_f32(x[hi]);
        if (BWD) {
            y[lo] = from_f32<T>(x1 * c + x2 * s);
            y[hi] = from_f32<T>(x2 * c - x1 * s);
        } else {
            y[lo] = from_f32<T>(x1 * c - x2 * s);
            y[hi] = from_f32<T>(x2 * c + x1 * s);
        }
    }
}

#define ROPE(T, t)                                                                             \
    extern "C" __global__ void rope_fwd_##t(const T* x, T* y, const float2* cs, i64 rows,      \
                                            int t, int d) {                                    \
        rope<T, false>(x, y, cs, rows, t, d);                                                  \
    }                                                                                          \
    extern "C" __global__ void rope_bwd_##t(const T* dy, T* dx, const float2* cs, i64 rows,    \
                                            int t, int d) {                                    \
        rope<T, true>(dy, dx, cs, rows, t, d);                                                 \
    }

CASTOR_FOR_EACH_T(ROPE)
