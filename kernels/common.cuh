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

// ---- FP8 -----------------------------------------------------------------------------------
// The saturating cast to E4M3 or E5M2 (castor_ir::fp8::Fp8Format::encode) and the running
// amax of a cast's input, shared by the fp8 family and the fused pointwise kernels.

#define F32_CANONICAL_NAN __int_as_float(0x7fc00000)

// |x| folded into the running maximum `m`, a NaN remembered in `nan`.
__device__ __forceinline__ void fold_abs(float x, float& m, bool& nan) {
    m = fmaxf(m, fabsf(x));
    nan = nan || isnan(x);
}

// The FP8 byte nearest to x, saturating (castor_ir::fp8::Fp8Format::encode): M mantissa bits,
// exponent bias BIAS, MAX_BYTE the largest finite value's byte.
template <int M, int BIAS, unsigned MAX_BYTE>
__device__ __forceinline__ unsigned char fp8_encode(float x) {
    const unsigned bits = __float_as_uint(x);
    const unsigned sign = (bits >> 24) & 0x80u;
    const unsigned biased = (bits >> 23) & 0xFFu;
    const unsigned fraction = bits & 0x007FFFFFu;
    if (biased == 0xFFu) {
        // NaN: 0x7F with its sign; an infinity saturates.
        return (unsigned char)(sign | (fraction != 0 ? 0x7Fu : MAX_BYTE));
    }
    // |x| = significand * 2^scale exactly; `exponent` is floor(log2 |x|) for normal values and
    // below every FP8 exponent for F32 subnormals (which all round to zero).
    unsigned significand;
    int scale, exponent;
    if (biased == 0) {
        significand = fraction;
        scale = -149;
        exponent = -127;
    } else {
        significand = fraction | 0x00800000u;
        scale = int(biased) - 150;
        exponent = int(biased) - 127;
    }
    const int emin = 1 - BIAS;
    // The exponent of one unit in the last place of the FP8 values around |x|; the shift from
    // F32's units to it is at least 20.
    const int ulp = (exponent > emin ? exponent : emin) - M;
    const int shift = ulp - scale;
    // |x| in those units, rounded to nearest, ties to even (a significand below 2^24 is below
    // half a unit once the shift passes 24).
    unsigned steps = 0;
    if (shift <= 24) {
        const unsigned kept = significand >> shift;
        const unsigned rest = significand & ((1u << shift) - 1u);
        const unsigned halfway = 1u << (shift - 1);
        steps = kept + ((rest > halfway || (rest == halfway && (kept & 1u))) ? 1u : 0u);
    }
    const unsigned code =
        exponent < emin ? steps : (unsigned(exponent - emin) << M) + steps;
    return (unsigned char)(sign | (code > MAX_BYTE ? MAX_BYTE : code));
}

struct E4M3 {
    static __device__ __forceinline__ unsigned char encode(float x) {
        return fp8_encode<3, 7, 0x7Eu>(x);
    }
};
struct E5M2 {
    static __device__ __forceinline__ unsigned char encode(float x) {
        return fp8_encode<2, 15, 0x7Bu>(x);
    }
};

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

// ---- Philox4x32-10 --------------------------------------------------------------------------
// The counter-based generator of castor_ir::philox (Salmon et al. 2011, as cuRAND's): four
// 32-bit draws from a 128-bit counter and a 64-bit key, no state between draws. Dropout masks
// are drawn from it (dropout.cu; the CPU twin is castor_ir::philox::dropout_draws).
__device__ __forceinline__ void philox4x32_10(unsigned (&c)[4], unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u64 p0 = (u64)0xD2511F53u * c[0];
        const u64 p1 = (u64)0xCD9E8D57u * c[2];
        const unsigned hi0 = (unsigned)(p0 >> 32), lo0 = (unsigned)p0;
        const unsigned hi1 = (unsigned)(p1 >> 32), lo1 = (unsigned)p1;
        c[0] = hi1 ^ c[1] ^ k0;
        c[1] = lo1;
        c[2] = hi0 ^ c[3] ^ k1;
        c[3] = lo0;
    }
}

// The draws of elements 4 block .. 4 block + 3 of a dropout keyed by (seed, offset) and
// stream: counter (block lo, block hi, stream, offset lo), key (seed lo, seed hi).
__device__ __forceinline__ void dropout_draws(unsigned (&r)[4], u64 seed, i64 offset,
                                              unsigned stream, u64 block) {
    r[0] = (unsigned)block;
    r[1] = (unsigned)(block >> 32);
    r[2] = stream;
    r[3] = (unsigned)offset;
    philox4x32_10(r, (unsigned)seed, (unsigned)(seed >> 32));
}

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
// separately (--fmad=false). The two differ only in the order of the F32 additions. The host
// build makes the same sums in one warp operation (castor_host_warp_mma: the same bits).
#define FULL_WARP 0xffffffffu

__device__ __forceinline__ void warp_mma_by_shuffles(float (&d)[4], const float (&a)[8],
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
__device__ __forceinline__ void warp_mma_shuffle(float (&d)[4], const float (&a)[8],
                                                 const float (&b)[4]) {
#if defined(__CUDA_ARCH__)
    warp_mma_by_shuffles(d, a, b);
#else
    castor_host_warp_mma(d, a, b);
#endif
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
// The tensor-core forms of this header's warp operations: mma.sync, ldmatrix and cp.async.
#define CASTOR_SM80 1
#endif

// ---- 16-bit operands packed in pairs -------------------------------------------------------
// A tensor-core fragment register holds two 16-bit values, the lower-indexed one in the low
// half. These convert between such registers and F32.

template <typename H> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <typename H> __device__ __forceinline__ float unpack_lo(unsigned r);
template <typename H> __device__ __forceinline__ float unpack_hi(unsigned r);
#if defined(__CUDA_ARCH__)
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ float unpack_lo<__half>(unsigned r) {
    return __half2float(__ushort_as_half((unsigned short)(r & 0xffffu)));
}
template <> __device__ __forceinline__ float unpack_hi<__half>(unsigned r) {
    return __half2float(__ushort_as_half((unsigned short)(r >> 16)));
}
template <> __device__ __forceinline__ float unpack_lo<__nv_bfloat16>(unsigned r) {
    return __uint_as_float(r << 16);
}
template <> __device__ __forceinline__ float unpack_hi<__nv_bfloat16>(unsigned r) {
    return __uint_as_float(r & 0xffff0000u);
}
#else
template <typename H> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return unsigned(from_f32<H>(lo).__x) | (unsigned(from_f32<H>(hi).__x) << 16);
}
template <typename H> __device__ __forceinline__ float unpack_lo(unsigned r) {
    H h;
    h.__x = (unsigned short)(r & 0xffffu);
    return to_f32(h);
}
template <typename H> __device__ __forceinline__ float unpack_hi(unsigned r) {
    H h;
    h.__x = (unsigned short)(r >> 16);
    return to_f32(h);
}
#endif

#if defined(CASTOR_SM80)
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

// D += A B (m16n8k16) with the operands already packed as the fragments hold them:
// a[i] = pack2(a-fragment values 2i, 2i + 1), b0 = pack2(b[0], b[1]), b1 = pack2(b[2], b[3])
// (the layouts above). What ldmatrix loads and what pack2 makes of an accumulator.
template <typename T>
__device__ __forceinline__ void mma_packed(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                           unsigned b1);
#if defined(CASTOR_SM80)
#define CASTOR_MMA_PACKED(T, PTX_TYPE)                                                         \
    template <> __device__ __forceinline__ void mma_packed<T>(                                 \
        float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {                     \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 "   \
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"      \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));         \
    }
#else
#define CASTOR_MMA_PACKED(T, PTX_TYPE)                                                         \
    template <> __device__ __forceinline__ void mma_packed<T>(                                 \
        float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {                     \
        const float af[8] = {unpack_lo<T>(a[0]), unpack_hi<T>(a[0]), unpack_lo<T>(a[1]),       \
                             unpack_hi<T>(a[1]), unpack_lo<T>(a[2]), unpack_hi<T>(a[2]),       \
                             unpack_lo<T>(a[3]), unpack_hi<T>(a[3])};                          \
        const float bf[4] = {unpack_lo<T>(b0), unpack_hi<T>(b0), unpack_lo<T>(b1),             \
                             unpack_hi<T>(b1)};                                                \
        warp_mma_shuffle<T>(d, af, bf);                                                        \
    }
#endif
CASTOR_MMA_PACKED(__half, "f16")
CASTOR_MMA_PACKED(__nv_bfloat16, "bf16")

// ---- ldmatrix: 8 x 8 tiles of 16-bit values from shared memory into fragments ------------
// ldsm_x4: lane l gives the address of row l % 8 of matrix l / 8 (16-byte aligned, 8
// consecutive 16-bit values); r[i] receives, from matrix i, row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 (the A fragment's and the B fragment's row-major pairs). ldsm_x4_t receives
// the transpose: rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4 (a B fragment from a
// row-major [k][n] tile). ldsm_x2 / ldsm_x2_t: matrices 0 and 1 only (lanes 0-15 give the
// addresses; the others' are ignored). Without tensor cores the same exchange is made by warp
// shuffles of the row addresses; on the host by one exchange of every lane's
// (castor_host_gather).
struct WarpRows {
#if defined(__CUDA_ARCH__)
    u64 mine;
    __device__ __forceinline__ explicit WarpRows(u64 row) : mine(row) {}
    __device__ __forceinline__ u64 of(int lane) const { return __shfl_sync(FULL_WARP, mine, lane); }
#else
    unsigned long long all[32];
    explicit WarpRows(u64 row) { castor_host_gather(all, row); }
    u64 of(int lane) const { return all[lane]; }
#endif
};

template <int N, bool TRANS>
__device__ __forceinline__ void ldsm_shuffle(unsigned (&r)[N], const void* row) {
    const int lane = threadIdx.x & 31;
    const WarpRows rows(reinterpret_cast<u64>(row));
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (TRANS) {
            const u64 p0 = rows.of(8 * i + 2 * (lane & 3));
            const u64 p1 = rows.of(8 * i + 2 * (lane & 3) + 1);
            const unsigned lo = *reinterpret_cast<const unsigned short*>(p0 + 2 * (lane >> 2));
            const unsigned hi = *reinterpret_cast<const unsigned short*>(p1 + 2 * (lane >> 2));
            r[i] = lo | (hi << 16);
        } else {
            const u64 p = rows.of(8 * i + (lane >> 2));
            r[i] = *reinterpret_cast<const unsigned*>(p + 4 * (lane & 3));
        }
    }
}

#if defined(CASTOR_SM80)
#define CASTOR_LDSM(NAME, N, TRANS, SUFFIX, OUTS, ...)                                         \
    __device__ __forceinline__ void NAME(unsigned (&r)[N], const void* row) {                  \
        const unsigned a = unsigned(__cvta_generic_to_shared(row));                            \
        asm volatile("ldmatrix.sync.aligned.m8n8." SUFFIX ".shared.b16 " OUTS ", [%" #N "];\n" \
                     : __VA_ARGS__                                                             \
                     : "r"(a));                                                                \
    }
CASTOR_LDSM(ldsm_x4, 4, false, "x4", "{%0, %1, %2, %3}", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]),
            "=r"(r[3]))
CASTOR_LDSM(ldsm_x4_t, 4, true, "x4.trans", "{%0, %1, %2, %3}", "=r"(r[0]), "=r"(r[1]),
            "=r"(r[2]), "=r"(r[3]))
CASTOR_LDSM(ldsm_x2, 2, false, "x2", "{%0, %1}", "=r"(r[0]), "=r"(r[1]))
CASTOR_LDSM(ldsm_x2_t, 2, true, "x2.trans", "{%0, %1}", "=r"(r[0]), "=r"(r[1]))
#else
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* row) {
    ldsm_shuffle<4, false>(r, row);
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* row) {
    ldsm_shuffle<4, true>(r, row);
}
__device__ __forceinline__ void ldsm_x2(unsigned (&r)[2], const void* row) {
    ldsm_shuffle<2, false>(r, row);
}
__device__ __forceinline__ void ldsm_x2_t(unsigned (&r)[2], const void* row) {
    ldsm_shuffle<2, true>(r, row);
}
#endif

// The same from a shared-memory address taken once (smem_addr: the 32-bit address in the
// shared window on the device, the pointer itself on the host) plus a byte offset: a
// fragment's constant offset then folds into the ldmatrix instruction, where a pointer per
// fragment costs an add and a shift of its own.
#if defined(CASTOR_SM80)
typedef unsigned SmemAddr;
__device__ __forceinline__ SmemAddr smem_addr(const void* p) {
    return unsigned(__cvta_generic_to_shared(p));
}
#define CASTOR_LDSM_AT(NAME, N, SUFFIX, OUTS, ...)                                              \
    __device__ __forceinline__ void NAME(unsigned (&r)[N], SmemAddr a) {                       \
        asm volatile("ldmatrix.sync.aligned.m8n8." SUFFIX ".shared.b16 " OUTS ", [%" #N "];\n" \
                     : __VA_ARGS__                                                             \
                     : "r"(a));                                                                \
    }
CASTOR_LDSM_AT(ldsm_x4_at, 4, "x4", "{%0, %1, %2, %3}", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]),
               "=r"(r[3]))
CASTOR_LDSM_AT(ldsm_x4_t_at, 4, "x4.trans", "{%0, %1, %2, %3}", "=r"(r[0]), "=r"(r[1]),
               "=r"(r[2]), "=r"(r[3]))
CASTOR_LDSM_AT(ldsm_x2_t_at, 2, "x2.trans", "{%0, %1}", "=r"(r[0]), "=r"(r[1]))
#else
typedef const char* SmemAddr;
__device__ __forceinline__ SmemAddr smem_addr(const void* p) {
    return static_cast<const char*>(p);
}
__device__ __forceinline__ void ldsm_x4_at(unsigned (&r)[4], SmemAddr a) {
    ldsm_shuffle<4, false>(r, a);
}
__device__ __forceinline__ void ldsm_x4_t_at(unsigned (&r)[4], SmemAddr a) {
    ldsm_shuffle<4, true>(r, a);
}
__device__ __forceinline__ void ldsm_x2_t_at(unsigned (&r)[2], SmemAddr a) {
    ldsm_shuffle<2, true>(r, a);
}
#endif

// ---- cp.async: 16-byte copies from global to shared memory that do not stall the thread ---
// cp_async16 copies 16 bytes (both addresses 16-byte aligned), or writes 16 zero bytes when
// `valid` is false (nothing is read then). Copies issued since the last commit form a group;
// cp_async_wait<N>() waits until at most N groups are still in flight. The results are read
// by other threads only after a __syncthreads that follows the wait. Without cp.async (and on
// the host) the copy is an ordinary load and store, and commit and wait do nothing.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#if defined(CASTOR_SM80)
    const unsigned a = unsigned(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem),
                 "r"(valid ? 16 : 0));
#else
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (valid) v = *reinterpret_cast<const uint4*>(gmem);
    *reinterpret_cast<uint4*>(smem) = v;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(CASTOR_SM80)
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(CASTOR_SM80)
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ---- fast exp2 -----------------------------------------------------------------------------
// 2^x by the special-function unit (ex2.approx.ftz: at most 2 ulp from 2^x, results below
// 2^-126 flushed to zero), for kernels whose header allows it (attention's softmax, where the
// largest value is 1 and a flushed term is below 2^-126 of it). The host build uses the C
// library's exp2f (correctly rounded in practice).
__device__ __forceinline__ float exp2_approx(float x) {
#if defined(__CUDA_ARCH__)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

// 1 / x and log2(x) by the special-function unit (rcp.approx.ftz, lg2.approx.ftz: within 1
// and 2 ulp for normal x), for kernels whose header allows it. The host build divides and
// calls log2f.
__device__ __forceinline__ float rcp_approx(float x) {
#if defined(__CUDA_ARCH__)
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return 1.0f / x;
#endif
}
__device__ __forceinline__ float log2_approx(float x) {
#if defined(__CUDA_ARCH__)
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return log2f(x);
#endif
}

// The calling thread's warp index, which the compiler then knows to be the same across the
// warp (as CUTLASS's canonical_warp_idx_sync): branches on it need no divergent fallback for
// the warp operations inside them.
__device__ __forceinline__ int warp_index() { return __shfl_sync(FULL_WARP, int(threadIdx.x >> 5), 0); }

// ---- ordering between blocks ---------------------------------------------------------------
// A kernel whose block waits for blocks launched before it (lower linear block index) relies
// on the device dispatching blocks in index order, as FlashAttention-3's deterministic
// backward does: an earlier block is then running or done, so the wait ends. The host build
// runs such a kernel's blocks in index order (castor_kernels' BLOCK_ORDERED list), so the
// value must already be there; a wait that would never end is an error naming the thread.
//
// The handoff is CUTLASS's semaphore (its GenericBarrier): one thread of each block waits and
// raises, a block barrier on the other side of each. The writer's threads store, the block
// passes __syncthreads(), then one thread calls raise_flag, whose release fence covers every
// store the barrier ordered before it. The reader's one thread calls wait_flag, whose acquire
// load the following __syncthreads() extends to every thread of the block, whose loads must
// bypass L1 (__ldcg). One fence per handoff, on one thread, where a fence on every thread
// would make each wait for its own stores.
// wait_flag: the calling thread waits until *flag >= value (acquire, device scope).
// raise_flag: adds 1 to *flag (release, device scope).
__device__ __forceinline__ void wait_flag(const int* flag, int value) {
#if defined(__CUDA_ARCH__)
    int seen;
    do {
        asm volatile("ld.global.acquire.gpu.b32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
    } while (seen < value);
#else
    castor_host_wait_flag(flag, value);
#endif
}
// arrive_count: adds 1 to *counter (acquire and release, device scope) and returns the count
// before it, so that the block that arrives last sees every other block's stores (each
// ordered before its arrival by a __syncthreads(), as for raise_flag; the last block's threads
// read them after a __syncthreads() too, through __ldcg): the "last block sums" handoff.
__device__ __forceinline__ int arrive_count(int* counter) {
#if defined(__CUDA_ARCH__)
    int before;
    asm volatile("fence.acq_rel.gpu;\n\tatom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
                 : "=r"(before)
                 : "l"(counter)
                 : "memory");
    return before;
#else
    __threadfence();
    const int before = atomicAdd(counter, 1);
    __threadfence();
    return before;
#endif
}
// last_to_arrive: whether this block, after its partial results are stored, is the last of
// `count` blocks to arrive at *counter; that block sets the counter back to zero, so the next
// launch finds it as the program's load left it. Every thread of the block calls it (it holds
// two block barriers) and gets the same answer.
__device__ __forceinline__ bool last_to_arrive(int* counter, int count) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        last = arrive_count(counter) == count - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    return last != 0;
}
// sum_column_groups: the second stage of a two-stage column sum, in a (32, 8) block that is a
// column block's last to arrive: for `width` columns from col0 (those below h), thread
// (lane, t) sums row groups t, t + 8, ... of part[g * h + col] in that order, through L2
// (__ldcg: other blocks stored them), and the 8 sums are added in the order t = 0..7; each
// column's F64 total goes to store(col, total). lanes: 8 x 32 doubles of shared scratch.
template <typename Store>
__device__ __forceinline__ void sum_column_groups(const double* part, i64 groups, i64 h, i64 col0,
                                                  int width, double (*lanes)[32], Store store) {
    const int lane = threadIdx.x, ty = threadIdx.y;
    for (int c = 0; c < width; c += 32) {
        const i64 col = col0 + c + lane;
        double t = 0.0;
        if (col < h) {
#pragma unroll 4
            for (i64 g = ty; g < groups; g += 8) t += __ldcg(part + g * h + col);
        }
        lanes[ty][lane] = t;
        __syncthreads();
        if (ty == 0 && col < h) {
            for (int u = 1; u < 8; ++u) t += lanes[u][lane];
            store(col, t);
        }
        __syncthreads();
    }
}
__device__ __forceinline__ void raise_flag(int* flag) {
#if defined(__CUDA_ARCH__)
    asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.s32 [%0], 1;"
                 :
                 : "l"(flag)
                 : "memory");
#else
    __threadfence();
    atomicAdd(flag, 1);
#endif
}
