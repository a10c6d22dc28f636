// cast.cu: dtype conversion between the float storage dtypes.
//
// Fuses: nothing; one read and one write per element.
// Entry points: cast_<from>_<to> for every ordered pair of f32, f16, bf16 (six kernels).
//   (const From* x, To* y, i64 n): y[i] = To(x[i]).
// Rounding: widening (f16/bf16 -> f32) is exact; narrowing rounds to nearest, ties to even
// (__float2half_rn / __float2bfloat16_rn), overflow to inf, NaN stays NaN. f16 <-> bf16 goes
// through F32, which is exact on the way up, so there is one rounding, as the CPU executor
// (F32 value rounded where stored) does.
// Launch: any 1-D grid and block (grid-stride); 8 elements per thread per step with 16-byte
// vectors when both pointers are 16-byte aligned, scalar otherwise and for the tail.
#include "castor_common.cuh"

template <typename From, typename To>
__device__ __forceinline__ void cast_impl(const From* __restrict__ x, To* __restrict__ y, i64 n) {
    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    i64 done = 0;
    if (aligned16(x) && aligned16(y)) {
        const i64 units = n / UNIT;
        for (i64 u = tid; u < units; u += stride) {
            float v[UNIT];
            load8(x + u * UNIT, v);
            store8(y + u * UNIT, v);
        }
        done = units * UNIT;
    }
    for (i64 i = done + tid; i < n; i += stride) y[i] = from_f32<To>(to_f32(x[i]));
}

#define CAST(FROM, TO, from, to)                                                               \
    extern "C" __global__ void cast_##from##_##to(const FROM* x, TO* y, i64 n) {               \
        cast_impl<FROM, TO>(x, y, n);                                                          \
    }

CAST(float, __half, f32, f16)
CAST(float, __nv_bfloat16, f32, bf16)
CAST(__half, float, f16, f32)
CAST(__nv_bfloat16, float, bf16, f32)
CAST(__half, __nv_bfloat16, f16, bf16)
CAST(__nv_bfloat16, __half, bf16, f16)
