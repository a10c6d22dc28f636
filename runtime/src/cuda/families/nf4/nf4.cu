// nf4.cu: the dequantization of a frozen weight stored in NF4 (QLoRA's base; the format of
// castor_ir::nf4, which is bitsandbytes' quantize_4bit(quant_type="nf4")), into a scratch
// buffer that the product's cuBLAS call then reads.
//
// Why a scratch buffer rather than dequantizing inside the product's operand tiles: the
// products stay cuBLAS's (tensor cores, every shape and layout it already handles), and the
// scratch lives only for the product: one weight at a time, the largest of LLaMA-2-7B 90 MB in
// BF16, next to 3.6 GB of NF4 codes for the whole base. The cost is one write and one read of
// the dequantized weight per product, small against the product itself at training shapes.
//
// Entry points: nf4_dequantize_<t>(const unsigned char* codes, const float* absmax, i64 n,
//   i64 block, T* out), t in f32, f16, bf16: for every i < n,
//     out[i] = T(NF4[code(i)] * absmax[i / block]),
//   code(i) the high nibble of codes[i / 2] for even i, the low nibble for odd i.
// Rounding points: the F32 product of the code's value and the block's absmax
// (castor_ir::nf4::dequantize), rounded once to T, nearest even, as the CPU executor rounds the
// weight to the product's dtype.
// Launch: any 1-D grid and block (grid-stride over bytes: a thread writes both values of one
// byte); the results do not depend on the launch shape.
#include "castor_common.cuh"

// The 16 NF4 values, as castor_ir::nf4::NF4_CODE holds them.
__device__ __forceinline__ float nf4_value(unsigned int code) {
    const float values[16] = {-1.0f,          -0.6961928f,  -0.52507305f, -0.3949175f,
                              -0.28444138f,   -0.18477343f, -0.091050036f, 0.0f,
                              0.0795803f,     0.1609302f,   0.2461123f,    0.33791524f,
                              0.44070983f,    0.562617f,    0.72295684f,   1.0f};
    return values[code & 15u];
}

template <typename T>
__device__ __forceinline__ void nf4_dequantize(const unsigned char* __restrict__ codes,
                                               const float* __restrict__ absmax, i64 n,
                                               i64 block, T* __restrict__ out) {
    const i64 bytes = (n + 1) / 2;
    const i64 stride = i64(gridDim.x) * blockDim.x;
    for (i64 b = i64(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
        const unsigned int byte = codes[b];
        const i64 i = 2 * b;
        out[i] = from_f32<T>(nf4_value(byte >> 4) * absmax[i / block]);
        if (i + 1 < n) out[i + 1] = from_f32<T>(nf4_value(byte) * absmax[(i + 1) / block]);
    }
}

#define NF4_DEQUANTIZE(T, t)                                                                   \
    extern "C" __global__ void nf4_dequantize_##t(const unsigned char* codes,                  \
                                                  const float* absmax, i64 n, i64 block,       \
                                                  T* out) {                                    \
        nf4_dequantize<T>(codes, absmax, n, block, out);                                       \
    }

CASTOR_FOR_EACH_T(NF4_DEQUANTIZE)
