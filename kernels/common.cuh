// castor_common.cuh: helpers shared by every kernel file (supplied to NVRTC as an in-memory
// header; the .cu files include it by this name).
//
// Storage dtypes: float, __half, __nv_bfloat16. Loads widen to F32 exactly; stores round F32
// to the storage dtype to nearest, ties to even (__float2half_rn, __float2bfloat16_rn), the
// rounding the CPU executor applies through the `half` crate.
//
// Vector access: 16-byte loads and stores (4 floats or 8 halves) when the pointers involved are
// 16-byte aligned, with a scalar tail for the elements that do not fill a vector. Kernels test
// alignment at run time, so any pointer and any length is correct; only the speed changes.
//
// Reductions: per-thread partials combined by warp shuffles and then across warps through
// shared memory, in an order fixed by the launch shape, so a result depends only on the data
// and the block size, never on timing. No float atomics anywhere in castor's kernels.
//
// The module is compiled with --fmad=false: a * b + c is two roundings, as in the CPU twins
// (Rust does not contract), so elementwise results match the CPU executor bit for bit where
// the formulas agree. The kernels are memory bound; the lost FMAs cost nothing measurable.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned long long u64;

// No <math.h> under NVRTC: infinities by their bit patterns.
#define F32_INF __int_as_float(0x7f800000)
#define F32_NEG_INF __int_as_float(0xff800000)

// A block's dynamic shared memory: 16-byte aligned bytes, as many as the launch's
// shared_bytes. The host build (castor_host.h) defines its own.
#ifndef CASTOR_DYNAMIC_SHARED
#define CASTOR_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// ---- dtype conversion ----------------------------------------------------------------------

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// F32 rounded to T and back: the value a T store then load would see.
template <typename T> __device__ __forceinline__ float round_to(float x) {
    return to_f32(from_f32<T>(x));
}

// ---- vector access -------------------------------------------------------------------------

// Elements per 8-element unit: 8 floats are two 16-byte vectors, 8 halves one.
#define UNIT 8

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<u64>(p) & 15ull) == 0;
}

// Loads 8 consecutive elements at `p` (16-byte aligned) as F32.
__device__ __forceinline__ void load8(const float* p, float (&v)[UNIT]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <typename H> __device__ __forceinline__ void load8_16(const H* p, float (&v)[UNIT]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const H* e = reinterpret_cast<const H*>(&raw);
#pragma unroll
    for (int i = 0; i < UNIT; ++i) v[i] = to_f32(e[i]);
}
__device__ __forceinline__ void load8(const __half* p, float (&v)[UNIT]) { load8_16(p, v); }
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[UNIT]) {
    load8_16(p, v);
}

// Stores 8 F32 values rounded to the dtype of `p` (16-byte aligned).
__device__ __forceinline__ void store8(float* p, const float (&v)[UNIT]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <typename H> __device__ __forceinline__ void store8_16(H* p, const float (&v)[UNIT]) {
    uint4 raw;
    H* e = reinterpret_cast<H*>(&raw);
#pragma unroll
    for (int i = 0; i < UNIT; ++i) e[i] = from_f32<H>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void store8(__half* p, const float (&v)[UNIT]) { store8_16(p, v); }
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[UNIT]) {
    store8_16(p, v);
}

// ---- comparisons ---------------------------------------------------------------------------

// The larger of two values, NaN if either is NaN (PyTorch's max; the CPU executor's max2).
__device__ __forceinline__ float max_nan(float a, float b) {
    return (a > b || isnan(a)) ? a : b;
}

// ---- block reductions ----------------------------------------------------------------------
// Every thread of the block must call these (they synchronize); blockDim.x must be a multiple
// of 32 and at most 1024. The result is returned to every thread.

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block. `scratch` holds at least 32 values of A.
template <typename A> __device__ A block_sum(A v, A* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // `scratch` may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A r = lane < warps ? scratch[lane] : A(0);
    return warp_sum(r);
}

// NaN-propagating max over the block. `scratch` holds at least 32 floats.
__device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < warps ? scratch[lane] : F32_NEG_INF;
    return warp_max(r);
}

// ---- error reporting -----------------------------------------------------------------------

// Bad data (an out-of-range id or label) is reported through an int the host initializes to
// INT_MAX (0x7fffffff): the kernel lowers it to the first bad position (integer atomicMin, so
// the result is the same whatever the order). Null means "do not report".
__device__ __forceinline__ void report_bad(int* bad, i64 position) {
    if (bad != nullptr) atomicMin(bad, position > 0x7ffffffell ? 0x7fffffff : int(position));
}

// ---- instantiation helpers -----------------------------------------------------------------
// Entry points carry dtype suffixes: f32, f16, bf16.

// Input/output dtype pairs of kernels that read one dtype and write another (norms, softmax):
// M(input type, output type, suffix). Same dtype: the dtype's suffix; otherwise <in>_<out>.
#define CASTOR_FOR_EACH_IO(M)                                                                  \
    M(float, float, f32)                                                                       \
    M(__half, __half, f16)                                                                     \
    M(__nv_bfloat16, __nv_bfloat16, bf16)                                                      \
    M(float, __half, f32_f16)                                                                  \
    M(float, __nv_bfloat16, f32_bf16)                                                          \
    M(__half, float, f16_f32)                                                                  \
    M(__nv_bfloat16, float, bf16_f32)

// The storage dtypes: M(type, suffix).
#define CASTOR_FOR_EACH_T(M) M(float, f32) M(__half, f16) M(__nv_bfloat16, bf16)

// ---- multi-tensor launches -----------------------------------------------------------------
// A launch over many buffers walks a host-built table of chunks: chunk c covers elements
// [start, start + len) of tensor `tensor` in the launch's tensor table. Block b takes chunks
// b, b + gridDim.x, ...; results never depend on the grid size. Host layout (16 bytes):
// { i32 tensor; i32 len; i64 start; }.
struct TensorChunk {
    int tensor;
    int len;
    i64 start;
};

// ---- Pointwise functions: `f(x)` and its derivative `df(x)` (dx = dy * df(x)), in F32, with the
// formulas and evaluation order of the CPU executor (runtime/src/cpu/elementwise.rs). Used by
// elementwise.cu and by the fused kernels castor generates.
#define SQRT_2_OVER_PI 0.7978845608f
#define GELU_C 0.044715f
#define FRAC_1_SQRT_2 0.70710678118654752f
#define INV_SQRT_2PI 0.3989422804f

__device__ __forceinline__ float tanh_abs(float x) { return 1.0f - 2.0f / (expf(2.0f * x) + 1.0f); }

struct GeluTanh {
    static __device__ __forceinline__ float f(float v) {
        const float inner = SQRT_2_OVER_PI * (v + GELU_C * (v * v * v));
        return 0.5f * v * (1.0f + tanh_abs(inner));
    }
    static __device__ __forceinline__ float df(float x) {
        const float x_sq = x * x;
        const float t = tanh_abs(SQRT_2_OVER_PI * (x + GELU_C * (x_sq * x)));
        const float inner = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * x_sq);
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * inner;
    }
};

struct GeluErf {
    static __device__ __forceinline__ float f(float v) {
        return v * 0.5f * (1.0f + erff(v * FRAC_1_SQRT_2));
    }
    static __device__ __forceinline__ float df(float x) {
        const float cdf = 0.5f * (1.0f + erff(x * FRAC_1_SQRT_2));
        const float pdf = INV_SQRT_2PI * expf(-0.5f * x * x);
        return cdf + x * pdf;
    }
};

struct Silu {
    static __device__ __forceinline__ float f(float v) { return v / (1.0f + expf(-v)); }
    static __device__ __forceinline__ float df(float x) {
        const float s = 1.0f / (1.0f + expf(-x));
        return s * (1.0f + x * (1.0f - s));
    }
};

struct TanhFn {
    static __device__ __forceinline__ float f(float v) { return tanhf(v); }
    static __device__ __forceinline__ float df(float x) {
        const float t = tanhf(x);
        return 1.0f - t * t;
    }
};

struct ExpFn {
    static __device__ __forceinline__ float f(float v) { return expf(v); }
    static __device__ __forceinline__ float df(float x) { return expf(x); }
};

struct RsqrtFn {
    static __device__ __forceinline__ float f(float v) { return 1.0f / sqrtf(v); }
    static __device__ __forceinline__ float df(float x) {
        const float r = 1.0f / sqrtf(x);
        return -0.5f * (r * r * r);
    }
};

struct SqrtFn {
    static __device__ __forceinline__ float f(float v) { return sqrtf(v); }
    static __device__ __forceinline__ float df(float x) { return 0.5f / sqrtf(x); }
};

struct NegFn {
    static __device__ __forceinline__ float f(float v) { return -v; }
    static __device__ __forceinline__ float df(float) { return -1.0f; }
};

// ---- warp matrix products ------------------------------------------------------------------
// D += A B for one warp, in the shape of mma.sync.m16n8k16 (A 16 x 16, B 16 x 8, D 16 x 8 in
// F32), with every fragment held as F32 values (exactly representable in the operand dtype
// T). Lane l holds, with g = l / 4 and c = l % 4, the elements the PTX ISA assigns it:
//   A (row-major): a[0..1] = A[g][2c..2c+1],   a[2..3] = A[g+8][2c..2c+1],
//                  a[4..5] = A[g][2c+8..2c+9], a[6..7] = A[g+8][2c+8..2c+9]
//   B (col-major): b[0..1] = B[2c..2c+1][g],   b[2..3] = B[2c+8..2c+9][g]
//   D:             d[0..1] = D[g][2c..2c+1],   d[2..3] = D[g+8][2c..2c+1]
// so the accumulator of two adjacent n-tiles is, element for element, the A fragment of the
// next product (how FlashAttention feeds P into P V without leaving registers).
// On sm_80 and newer, BF16 and F16 operands run on tensor cores (exact products, F32
// accumulation in an order the hardware chooses). Otherwise (F32 operands, older devices, or
// CASTOR_WARP_MMA_SHUFFLE) each lane gathers its row and column by warp shuffles and sums the
// 16 products in k order in F32 before adding them to D, with the mul and add rounded
// separately (--fmad=false). The two differ only in the order of the F32 additions.
#define FULL_WARP 0xffffffffu

template <typename T>
__device__ __forceinline__ void warp_mma_shuffle(float (&d)[4], const float (&a)[8],
                                                 const float (&b)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        // A[row][k] is held by lane (row % 8) * 4 + (k % 8) / 2 in register
        // (k % 2) + 2 * (row >= 8) + 4 * (k >= 8); B[k][n] by lane n * 4 + (k % 8) / 2 in
        // register (k % 2) + 2 * (k >= 8).
        const int ra = (k & 1) + ((k >> 3) << 2);
        const int rb = (k & 1) + ((k >> 3) << 1);
        const int part = (k & 7) >> 1;
        const float a_lo = __shfl_sync(FULL_WARP, a[ra], g * 4 + part);
        const float a_hi = __shfl_sync(FULL_WARP, a[ra + 2], g * 4 + part);
        const float b0 = __shfl_sync(FULL_WARP, b[rb], (2 * c) * 4 + part);
        const float b1 = __shfl_sync(FULL_WARP, b[rb], (2 * c + 1) * 4 + part);
        acc[0] += a_lo * b0;
        acc[1] += a_lo * b1;
        acc[2] += a_hi * b0;
        acc[3] += a_hi * b1;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] += acc[i];
}

template <typename T>
__device__ __forceinline__ void warp_mma(float (&d)[4], const float (&a)[8], const float (&b)[4]);

template <> __device__ __forceinline__ void warp_mma<float>(float (&d)[4], const float (&a)[8],
                                                            const float (&b)[4]) {
    warp_mma_shuffle<float>(d, a, b);
}

#define CASTOR_WARP_MMA_16(T, PTX_TYPE)                                                        \
    template <> __device__ __forceinline__ void warp_mma<T>(float (&d)[4], const float (&a)[8], \
                                                            const float (&b)[4]) {             \
        CASTOR_WARP_MMA_BODY(T, PTX_TYPE)                                                      \
    }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(CASTOR_WARP_MMA_SHUFFLE)
// Two values rounded to the operand dtype and packed into the 32-bit register a fragment holds.
template <typename H> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

#define CASTOR_WARP_MMA_BODY(T, PTX_TYPE)                                                      \
    const unsigned ra[4] = {pack2<T>(a[0], a[1]), pack2<T>(a[2], a[3]), pack2<T>(a[4], a[5]),  \
                            pack2<T>(a[6], a[7])};                                             \
    const unsigned rb[2] = {pack2<T>(b[0], b[1]), pack2<T>(b[2], b[3])};                       \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 "       \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                              \
                 : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb[0]), "r"(rb[1]));
#else
#define CASTOR_WARP_MMA_BODY(T, PTX_TYPE) warp_mma_shuffle<T>(d, a, b);
#endif

CASTOR_WARP_MMA_16(__half, "f16")
CASTOR_WARP_MMA_16(__nv_bfloat16, "bf16")
