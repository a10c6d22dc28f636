// elementwise.cu: pointwise activations, their gradients, and add/mul with a trailing bias.
//
// Fuses: the activation and its storage rounding (one read, one write); for gradients the
// recomputation of f'(x) from the saved input with the multiply by dy (two reads, one write).
// Entry points (suffix = storage dtype of every tensor: f32, f16, bf16):
//   gelu_tanh_fwd_<t>, gelu_erf_fwd_<t>, silu_fwd_<t>      (const T* x, T* y, i64 n)
//   gelu_tanh_bwd_<t>, gelu_erf_bwd_<t>, silu_bwd_<t>      (const T* x, const T* dy, T* dx, i64 n)
//   add_<t>, mul_<t>       (const T* a, const T* b, T* out, i64 n, i64 nb)
//     out[i] = a[i] op b[i % nb]: nb == n is a plain elementwise op, nb == the last dim a
//     trailing bias broadcast over rows, nb == 1 a scalar.
// Arithmetic in F32, one rounding at the store. The formulas are the CPU executor's
// (runtime/src/cpu/elementwise.rs), evaluated in the same order: GELU-tanh in HF's gelu_new
// order with tanh(u) = 1 - 2 / (e^{2u} + 1); GELU-erf 0.5 x (1 + erf(x / sqrt 2)); SiLU
// x / (1 + e^-x); the gradients as PyTorch's backward kernels. Differences from the CPU twin:
// expf/erff are CUDA's (within 2 ulp, like the CPU's Cephes exp and libm erff), so results may
// differ in the last bit before rounding to the storage dtype.
// In place is allowed (y == x, dx == dy, out == a): each element is read before it is written
// by the same thread.
// Launch: any 1-D grid and block (grid-stride), 8 elements per step with 16-byte vectors when
// every pointer is 16-byte aligned (and for add/mul, nb == n), scalar otherwise and for the tail.
#include "castor_common.cuh"

// The scalar functions (GeluTanh, GeluErf, Silu, ...) are in castor_common.cuh, shared with
// the fused kernels that castor generates.

template <typename Op, typename T>
__device__ __forceinline__ void unary_fwd(const T* x, T* y, i64 n) {
    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    i64 done = 0;
    if (aligned16(x) && aligned16(y)) {
        const i64 units = n / UNIT;
        for (i64 u = tid; u < units; u += stride) {
            float v[UNIT];
            load8(x + u * UNIT, v);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) v[k] = Op::f(v[k]);
            store8(y + u * UNIT, v);
        }
        done = units * UNIT;
    }
    for (i64 i = done + tid; i < n; i += stride) y[i] = from_f32<T>(Op::f(to_f32(x[i])));
}

template <typename Op, typename T>
__device__ __forceinline__ void unary_bwd(const T* x, const T* dy, T* dx, i64 n) {
    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    i64 done = 0;
    if (aligned16(x) && aligned16(dy) && aligned16(dx)) {
        const i64 units = n / UNIT;
        for (i64 u = tid; u < units; u += stride) {
            float v[UNIT], d[UNIT];
            load8(x + u * UNIT, v);
            load8(dy + u * UNIT, d);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) d[k] = d[k] * Op::df(v[k]);
            store8(dx + u * UNIT, d);
        }
        done = units * UNIT;
    }
    for (i64 i = done + tid; i < n; i += stride)
        dx[i] = from_f32<T>(to_f32(dy[i]) * Op::df(to_f32(x[i])));
}

struct Add {
    static __device__ __forceinline__ float f(float a, float b) { return a + b; }
};
struct Mul {
    static __device__ __forceinline__ float f(float a, float b) { return a * b; }
};

template <typename Op, typename T>
__device__ __forceinline__ void binary(const T* a, const T* b, T* out, i64 n, i64 nb) {
    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    if (nb <= 0) return;
    i64 done = 0;
    // Vectors when b repeats in whole units (nb a multiple of 8, or b as long as a).
    if (aligned16(a) && aligned16(b) && aligned16(out) && (nb == n || nb % UNIT == 0)) {
        const i64 units = n / UNIT;
        for (i64 u = tid; u < units; u += stride) {
            float va[UNIT], vb[UNIT];
            load8(a + u * UNIT, va);
            load8(b + (u * UNIT) % nb, vb);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) va[k] = Op::f(va[k], vb[k]);
            store8(out + u * UNIT, va);
        }
        done = units * UNIT;
    }
    for (i64 i = done + tid; i < n; i += stride)
        out[i] = from_f32<T>(Op::f(to_f32(a[i]), to_f32(b[nb == n ? i : i % nb])));
}

#define ELEMENTWISE(T, t)                                                                      \
    extern "C" __global__ void gelu_tanh_fwd_##t(const T* x, T* y, i64 n) {                    \
        unary_fwd<GeluTanh, T>(x, y, n);                                                       \
    }                                                                                          \
    extern "C" __global__ void gelu_erf_fwd_##t(const T* x, T* y, i64 n) {                     \
        unary_fwd<GeluErf, T>(x, y, n);                                                        \
    }                                                                                          \
    extern "C" __global__ void silu_fwd_##t(const T* x, T* y, i64 n) {                         \
        unary_fwd<Silu, T>(x, y, n);                                                           \
    }                                                                                          \
    extern "C" __global__ void gelu_tanh_bwd_##t(const T* x, const T* dy, T* dx, i64 n) {      \
        unary_bwd<GeluTanh, T>(x, dy, dx, n);                                                  \
    }                                                                                          \
    extern "C" __global__ void gelu_erf_bwd_##t(const T* x, const T* dy, T* dx, i64 n) {       \
        unary_bwd<GeluErf, T>(x, dy, dx, n);                                                   \
    }                                                                                          \
    extern "C" __global__ void silu_bwd_##t(const T* x, const T* dy, T* dx, i64 n) {           \
        unary_bwd<Silu, T>(x, dy, dx, n);                                                      \
    }                                                                                          \
    extern "C" __global__ void add_##t(const T* a, const T* b, T* out, i64 n, i64 nb) {        \
        binary<Add, T>(a, b, out, n, nb);                                                      \
    }                                                                                          \
    extern "C" __global__ void mul_##t(const T* a, const T* b, T* out, i64 n, i64 nb) {        \
        binary<Mul, T>(a, b, out, n, nb);                                                      \
    }

ELEMENTWISE(float, f32)
ELEMENTWISE(__half, f16)
ELEMENTWISE(__nv_bfloat16, bf16)
