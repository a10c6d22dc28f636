// layout.cu: data movement (strided copies and fills) and the casts that involve bool or i64.
//
// Fuses: nothing; one read (none for a fill) and one write per element. The CUDA executor's
// transpose, slice, split, concat (one copy per input, into its place in the output), pad (a
// fill, then a copy into the interior) and broadcast_to are each a strided_copy, and fill, with
// a host-built CopyLayout: the CPU twin of those is runtime/src/cpu/layout.rs. Copies and
// fills move raw bits by element width, so every dtype (f32, f16, bf16, i64, bool) is covered
// and nothing is rounded.
//
// Entry points:
//   strided_copy_b<w>(const U* src, U* dst, i64 n, CopyLayout l), w = 1, 2, 4, 8, 16 bytes,
//     U = unsigned char, unsigned short, unsigned int, unsigned long long, uint4 (the lowering
//     copies 16-byte units when the innermost dim is contiguous on both sides and every
//     address is 16-byte aligned: the attention heads' splits and merges, whose rows of 64
//     BF16 values the first GPU profile measured at 280 GB/s element by element; src and dst
//     must then be 16-byte aligned): for every flat index
//     i < n, idx = i decomposed row-major over l.shape[0..rank) (last dim fastest), and
//       dst[l.dst_offset + sum_d idx[d] * l.dst_stride[d]]
//         = src[l.src_offset + sum_d idx[d] * l.src_stride[d]].
//     n must be the product of shape[0..rank) (rank 0: n = 1, the element at the offsets).
//     Strides are in elements and may be 0 (broadcast) or negative. Every i must write a
//     distinct destination element, and src and dst must not overlap (no in-place copies).
//   fill_b<w>(U* dst, i64 n, value): dst[0..n) = value, the element's bit pattern, passed by
//     the host (fill_b1 takes an unsigned int and stores its low byte; fill_b2 an unsigned
//     short, fill_b4 an unsigned int, fill_b8 an unsigned long long). 16-byte stores when dst
//     is 16-byte aligned, scalar otherwise and for the tail.
//   cast_<from>_<to>(const From* x, To* y, i64 n): the conversions of runtime/src/cpu/cast.rs
//     that involve bool or i64 (float <-> float is cast.cu). bool is one byte holding 0 or 1;
//     a nonzero byte reads as true, and bools are written as 0 or 1.
//       cast_i64_bool, cast_f32_bool:  x != 0 (NaN is true, -0.0 false)
//       cast_bool_f32, cast_bool_f16, cast_bool_bf16, cast_bool_i32, cast_bool_i64:  0 or 1
//       cast_i64_f32, cast_i64_f16, cast_i64_bf16:  x to F32 rounded to nearest even (Rust's
//         `as`), then rounded to the target to nearest even: the CPU keeps the F32 value and
//         rounds it where it is stored, so i64 -> f16/bf16 is the same double rounding there
//       cast_f32_i64:  truncation toward zero, saturating at the i64 range, NaN -> 0 (Rust's
//         `as`)
//
// CopyLayout, the host's #[repr(C)] struct, 216 bytes, no padding, by value:
//   i64 shape[8]       offset   0  the copied block's shape, outermost first; unused dims 1
//   i64 src_stride[8]  offset  64  source element strides per dim (0 = broadcast)
//   i64 dst_stride[8]  offset 128  destination element strides per dim
//   i64 src_offset     offset 192  element offset of the source block
//   i64 dst_offset     offset 200
//   i32 rank           offset 208  dims used, 0..=8; dims >= rank are ignored
//   i32 pad            offset 212
//
// Launch: every kernel here takes any 1-D grid and block (grid-stride loops); the results do
// not depend on the launch shape. strided_copy decomposes indices in 32-bit arithmetic when
// n < 2^32 and in 64-bit otherwise; offsets are always 64-bit.
#include "castor_common.cuh"

struct CopyLayout {
    i64 shape[8];
    i64 src_stride[8];
    i64 dst_stride[8];
    i64 src_offset;
    i64 dst_offset;
    int rank;
    int pad;
};
// Members in declaration order with no padding (every i64 at a multiple of 8): the size and
// alignment pin the layout. (NVRTC has no offsetof.)
static_assert(sizeof(CopyLayout) == 216, "CopyLayout must match the host's #[repr(C)] struct");
static_assert(alignof(CopyLayout) == 8, "CopyLayout must match the host's #[repr(C)] struct");

#define MAX_RANK 8

// ---- strided copy ----------------------------------------------------------------------------

// Copies the elements i = start, start + stride, ... < n; I is the index type the flat index
// is decomposed in (unsigned int when n < 2^32, u64 otherwise). The dimension loop is unrolled
// so the layout stays in the parameter space (no local copy).
template <typename U, typename I>
__device__ __forceinline__ void copy_elements(const U* __restrict__ src, U* __restrict__ dst,
                                              i64 n, const CopyLayout& l, int rank, i64 start,
                                              i64 stride) {
    for (i64 i = start; i < n; i += stride) {
        I rest = I(i);
        i64 s = l.src_offset, d = l.dst_offset;
#pragma unroll
        for (int k = MAX_RANK - 1; k > 0; --k) {
            if (k < rank) {
                const I dim = I(l.shape[k]);
                const I q = rest / dim;
                const i64 c = i64(rest - q * dim);
                s += c * l.src_stride[k];
                d += c * l.dst_stride[k];
                rest = q;
            }
        }
        // Dimension 0 takes what is left: i < n, so rest < shape[0].
        if (rank > 0) {
            s += i64(rest) * l.src_stride[0];
            d += i64(rest) * l.dst_stride[0];
        }
        dst[d] = src[s];
    }
}

template <typename U>
__device__ __forceinline__ void strided_copy(const U* src, U* dst, i64 n, const CopyLayout& l) {
    const i64 start = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    const int rank = l.rank < 0 ? 0 : (l.rank > MAX_RANK ? MAX_RANK : l.rank);
    if (n <= 0xffffffffll) {
        copy_elements<U, unsigned int>(src, dst, n, l, rank, start, stride);
    } else {
        copy_elements<U, u64>(src, dst, n, l, rank, start, stride);
    }
}

#define STRIDED_COPY(U, w)                                                                     \
    extern "C" __global__ void strided_copy_##w(const U* src, U* dst, i64 n, CopyLayout l) {   \
        strided_copy<U>(src, dst, n, l);                                                       \
    }

STRIDED_COPY(unsigned char, b1)
STRIDED_COPY(unsigned short, b2)
STRIDED_COPY(unsigned int, b4)
STRIDED_COPY(u64, b8)
STRIDED_COPY(uint4, b16)

// ---- fill ------------------------------------------------------------------------------------

// 16 bytes holding `v` repeated.
__device__ __forceinline__ uint4 splat16(unsigned char v) {
    const unsigned int w = 0x01010101u * v;
    return make_uint4(w, w, w, w);
}
__device__ __forceinline__ uint4 splat16(unsigned short v) {
    const unsigned int w = 0x00010001u * v;
    return make_uint4(w, w, w, w);
}
__device__ __forceinline__ uint4 splat16(unsigned int v) { return make_uint4(v, v, v, v); }
__device__ __forceinline__ uint4 splat16(u64 v) {
    const unsigned int lo = (unsigned int)v, hi = (unsigned int)(v >> 32);
    return make_uint4(lo, hi, lo, hi);  // little-endian: the low word first
}

template <typename U> __device__ __forceinline__ void fill(U* dst, i64 n, U value) {
    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    i64 done = 0;
    if (aligned16(dst)) {
        const int per = 16 / int(sizeof(U));
        const i64 units = n / per;
        const uint4 v = splat16(value);
        for (i64 u = tid; u < units; u += stride) reinterpret_cast<uint4*>(dst)[u] = v;
        done = units * per;
    }
    for (i64 i = done + tid; i < n; i += stride) dst[i] = value;
}

extern "C" __global__ void fill_b1(unsigned char* dst, i64 n, unsigned int value) {
    fill<unsigned char>(dst, n, (unsigned char)value);
}
extern "C" __global__ void fill_b2(unsigned short* dst, i64 n, unsigned short value) {
    fill<unsigned short>(dst, n, value);
}
extern "C" __global__ void fill_b4(unsigned int* dst, i64 n, unsigned int value) {
    fill<unsigned int>(dst, n, value);
}
extern "C" __global__ void fill_b8(u64* dst, i64 n, u64 value) { fill<u64>(dst, n, value); }

// ---- casts with bool or i64 ------------------------------------------------------------------

typedef unsigned char bool8;  // castor's bool: one byte, 0 or 1

// Rust's `f32 as i64`: truncation toward zero, saturating, NaN -> 0.
__device__ __forceinline__ i64 f32_to_i64(float v) {
    if (isnan(v)) return 0;
    if (v >= 9223372036854775808.0f) return 0x7fffffffffffffffll;  // 2^63
    if (v <= -9223372036854775808.0f) return -0x7fffffffffffffffll - 1;
    return __float2ll_rz(v);
}

// Rust's `i64 as f32` (round to nearest, ties to even), then the store's rounding to T.
template <typename T> __device__ __forceinline__ T i64_to(i64 v) {
    return from_f32<T>(__ll2float_rn(v));
}

template <typename T> __device__ __forceinline__ T bool_to(bool8 v) {
    return from_f32<T>(v != 0 ? 1.0f : 0.0f);
}

#define CONVERT(NAME, FROM, TO, EXPR)                                                          \
    extern "C" __global__ void NAME(const FROM* __restrict__ x, TO* __restrict__ y, i64 n) {   \
        const i64 stride = i64(gridDim.x) * blockDim.x;                                        \
        for (i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {         \
            const FROM v = x[i];                                                               \
            y[i] = (EXPR);                                                                     \
        }                                                                                      \
    }

CONVERT(cast_i64_bool, i64, bool8, bool8(v != 0))
CONVERT(cast_f32_bool, float, bool8, bool8(v != 0.0f))
CONVERT(cast_bool_f32, bool8, float, bool_to<float>(v))
CONVERT(cast_bool_f16, bool8, __half, bool_to<__half>(v))
CONVERT(cast_bool_bf16, bool8, __nv_bfloat16, bool_to<__nv_bfloat16>(v))
CONVERT(cast_bool_i32, bool8, int, int(v != 0))
CONVERT(cast_bool_i64, bool8, i64, i64(v != 0))
CONVERT(cast_i64_f32, i64, float, i64_to<float>(v))
CONVERT(cast_i64_f16, i64, __half, i64_to<__half>(v))
CONVERT(cast_i64_bf16, i64, __nv_bfloat16, i64_to<__nv_bfloat16>(v))
CONVERT(cast_f32_i64, float, i64, f32_to_i64(v))
