// fp8.cu: FP8 tensorwise scaling: the largest magnitude of a tensor and its scale
// (`fp8_scale`), the scaled saturating cast to E4M3 or E5M2 with the amax of its input
// (`quantize`), and the dequantization factors a cuBLASLt FP8 product reads through its scale
// pointers (`fp8_matmul`).
//
// Entry points (t = storage dtype of x: f32, f16, bf16; f = e4m3, e5m2):
//   fp8_amax_<t>(const T* x, i64 n, float* partials)
//     partials[blockIdx.x] = the largest |x[i]| over the elements the block takes (grid-stride),
//     NaN if one of them is NaN, 0 if none. One float per block of the grid.
//   fp8_scale_finalize(const float* partials, int count, double largest, double divisor,
//                      float* scale), one block:
//     amax = the NaN-propagating max of partials[0 .. count);
//     *scale = F32((largest / max(F64(amax), 1e-12)) / divisor), in F64: `largest` is the
//     format's largest finite value (448 or 57344), `divisor` 2^margin (the host's
//     2f64.powi(min(margin, 1024))). max() is IEEE maxNum, as Rust's f64::max: a NaN amax
//     gives the floor's scale, as the CPU twin computes it.
//   fp8_quantize_<t>_<f>(const T* x, i64 n, const float* scale, unsigned char* q,
//                        float* partials)
//     q[i] = the FP8 byte nearest to the F32 product x[i] * *scale (ties to even, saturating at
//     the largest finite value, NaN as 0x7F | sign); partials (nullable) as fp8_amax_<t>.
//   fp8_amax_finalize(const float* partials, int count, float* amax), one block:
//     *amax = the NaN-propagating max of the partials, a NaN written as 0x7FC00000 (Rust's
//     f32::NAN, which the CPU twin returns whatever the NaN it met).
//   fp8_amax_history(const Fp8History* histories, int count), thread i of the grid taking row
//   i < count of the table (delayed scaling, `amax_history`; one launch for a batch of them):
//     struct Fp8History { const float* history; const float* scale; const float* amax;
//                         float* history_next; float* scale_next; double largest;
//                         double divisor; int length; int pad; }
//     history_next = [*amax, history[0 .. length - 1)] (newest first);
//     a = the NaN-propagating max of history_next; *scale_next = F32((largest / a) / divisor)
//     in F64 (F32's largest where that is infinite) when a is finite and positive, else
//     *scale (Transformer Engine's `_default_sf_compute`). Reads every input of its row before
//     it writes, so history_next may be history and scale_next scale (a write back in place).
//   fp8_dequantization(const Fp8Factors* products, int count), thread i of the grid taking
//   row i < count of the table (struct Fp8Factors { const float* a_scale;
//   const float* b_scale; float* factors; }):
//     factors[0] = 1 / *a_scale, factors[1] = 1 / *b_scale, each rounded to F32: what a
//     cuBLASLt FP8 product's A_SCALE_POINTER and B_SCALE_POINTER point at. One launch serves
//     every product whose scales are made by then (under delayed scaling, all of a run's).
// Bit for bit the CPU twin (runtime/src/cpu/fp8.rs, castor_ir::fp8::Fp8Format::encode with
// Overflow::Saturate): the product in F32 is rounded once, to FP8. The maximum of magnitudes is
// exact and independent of the order it is taken in, so the result depends on no grid or block
// size; the NaN flag is kept beside it, so a NaN anywhere gives NaN. Where the device differs:
// its F32 product of a NaN is the canonical (positive) NaN, so a negative NaN input gives 0x7F
// there and 0xFF here and on the CPU (both NaN).
//
// The conversion is written out on the bits rather than taken from cuda_fp8.h's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...): CUDA writes E5M2's NaN as 0x7E where castor
// (as PyTorch) writes 0x7F | sign, and the same source must run in the host build, where
// cuda_fp8.h's device conversion (a `cvt.rn.satfinite` instruction) does not exist. The kernel
// tests hold it to castor_ir::fp8 for every BF16 and F16 bit pattern and many F32 values.
// Launch: amax and quantize: any 1-D grid, blockDim.x a multiple of 32 (at most 1024), with a
// partials buffer of gridDim.x floats; the finalizers: one block, blockDim.x a multiple of 32;
// the amax histories and the dequantization factors: a 1-D grid of at least `count` threads.
#include "castor_common.cuh"

// F32_CANONICAL_NAN, fold_abs, fp8_encode, E4M3 and E5M2 are in castor_common.cuh (the
// fused pointwise kernels that end with a cast to FP8 use them too).

// The block's maximum of |x| over the grid-stride elements of x (16-byte loads when aligned).
template <typename T>
__device__ __forceinline__ float block_amax(const T* x, i64 n, float* scratch) {
    float m = 0.0f;
    bool nan = false;
    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    const i64 units = aligned16(x) ? n / UNIT : 0;
    for (i64 u = tid; u < units; u += stride) {
        float v[UNIT];
        load8(x + u * UNIT, v);
#pragma unroll
        for (int k = 0; k < UNIT; ++k) fold_abs(v[k], m, nan);
    }
    for (i64 i = units * UNIT + tid; i < n; i += stride) fold_abs(to_f32(x[i]), m, nan);
    return block_max(nan ? F32_CANONICAL_NAN : m, scratch);
}

template <typename T>
__device__ __forceinline__ void amax_partials(const T* x, i64 n, float* partials) {
    __shared__ float scratch[32];
    const float m = block_amax(x, n, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

#define FP8_AMAX(T, t)                                                                         \
    extern "C" __global__ void fp8_amax_##t(const T* __restrict__ x, i64 n,                   \
                                            float* __restrict__ partials) {                   \
        amax_partials<T>(x, n, partials);                                                      \
    }
CASTOR_FOR_EACH_T(FP8_AMAX)

// The NaN-propagating max of `count` partial maxima, in one block.
__device__ __forceinline__ float finalize_amax(const float* partials, int count, float* scratch) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) m = max_nan(m, partials[i]);
    return block_max(m, scratch);
}

extern "C" __global__ void fp8_scale_finalize(const float* __restrict__ partials, int count,
                                              double largest, double divisor, float* scale) {
    __shared__ float scratch[32];
    const float amax = finalize_amax(partials, count, scratch);
    if (threadIdx.x == 0) {
        const double s = largest / fmax(double(amax), 1e-12);
        *scale = float(s / divisor);
    }
}

extern "C" __global__ void fp8_amax_finalize(const float* __restrict__ partials, int count,
                                             float* amax) {
    __shared__ float scratch[32];
    const float m = finalize_amax(partials, count, scratch);
    if (threadIdx.x == 0) *amax = isnan(m) ? F32_CANONICAL_NAN : m;
}

template <typename T, typename F>
__device__ __forceinline__ void quantize(const T* x, i64 n, const float* scale_p,
                                         unsigned char* q, float* partials) {
    __shared__ float scratch[32];
    const float s = *scale_p;
    float m = 0.0f;
    bool nan = false;
    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    // Units of 8 elements: 16-byte loads, one 8-byte store of the 8 codes.
    const bool vector = aligned16(x) && (reinterpret_cast<u64>(q) & 7ull) == 0;
    const i64 units = vector ? n / UNIT : 0;
    for (i64 u = tid; u < units; u += stride) {
        float v[UNIT];
        load8(x + u * UNIT, v);
        u64 packed = 0;
#pragma unroll
        for (int k = 0; k < UNIT; ++k) {
            fold_abs(v[k], m, nan);
            packed |= u64(F::encode(v[k] * s)) << (8 * k);
        }
        *reinterpret_cast<u64*>(q + u * UNIT) = packed;
    }
    for (i64 i = units * UNIT + tid; i < n; i += stride) {
        const float v = to_f32(x[i]);
        fold_abs(v, m, nan);
        q[i] = F::encode(v * s);
    }
    if (partials != nullptr) {
        const float r = block_max(nan ? F32_CANONICAL_NAN : m, scratch);
        if (threadIdx.x == 0) partials[blockIdx.x] = r;
    }
}

#define FP8_QUANTIZE(T, t, F, f)                                                               \
    extern "C" __global__ void fp8_quantize_##t##_##f(const T* __restrict__ x, i64 n,         \
                                                      const float* scale,                     \
                                                      unsigned char* __restrict__ q,          \
                                                      float* __restrict__ partials) {         \
        quantize<T, F>(x, n, scale, q, partials);                                              \
    }
FP8_QUANTIZE(float, f32, E4M3, e4m3)
FP8_QUANTIZE(float, f32, E5M2, e5m2)
FP8_QUANTIZE(__half, f16, E4M3, e4m3)
FP8_QUANTIZE(__half, f16, E5M2, e5m2)
FP8_QUANTIZE(__nv_bfloat16, bf16, E4M3, e4m3)
FP8_QUANTIZE(__nv_bfloat16, bf16, E5M2, e5m2)

struct Fp8Factors {
    const float* a_scale;
    const float* b_scale;
    float* factors;
};

extern "C" __global__ void fp8_dequantization(const Fp8Factors* products, int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const Fp8Factors p = products[i];
    p.factors[0] = 1.0f / *p.a_scale;
    p.factors[1] = 1.0f / *p.b_scale;
}

struct Fp8History {
    const float* history;
    const float* scale;
    const float* amax;
    float* history_next;
    float* scale_next;
    double largest;
    double divisor;
    int length;
    int pad;
};

extern "C" __global__ void fp8_amax_history(const Fp8History* histories, int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const Fp8History h = histories[i];
    if (h.length <= 0) return;
    const float old_scale = *h.scale;
    const float newest = *h.amax;
    // Shift from the end, so that history_next may be history itself.
    float a = 0.0f;
    for (int k = h.length - 1; k >= 1; --k) {
        const float v = h.history[k - 1];
        h.history_next[k] = v;
        a = max_nan(a, v);
    }
    h.history_next[0] = newest;
    a = max_nan(a, newest);
    float s = old_scale;
    if (isfinite(a) && a > 0.0f) {
        s = float((h.largest / double(a)) / h.divisor);
        if (isinf(s)) s = __int_as_float(0x7f7fffff);  // F32's largest
    }
    *h.scale_next = s;
}
