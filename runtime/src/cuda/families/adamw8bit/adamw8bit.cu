// adamw8bit.cu: one 8-bit AdamW step (bitsandbytes' AdamW8bit) of one F32 parameter in one
// launch, equal to the CPU twin (runtime/src/cpu/adamw8bit.rs) bit for bit.
//
// The moments m and v are U8 codes, cut into quantization blocks of ADAMW8BIT_BLOCK values,
// each block with its F32 absolute maximum (m_absmax, v_absmax); m's codes index the signed
// dynamic map code_maps[0..256], v's the unsigned one code_maps[256..512]
// (castor_ir::quant). Each thread block takes one quantization block at a time, one value per
// thread: it dequantizes (code * absmax), updates in F32, reduces the new block maxima and
// writes the nearest codes.
// Entry points (<c> = the working copy's dtype: f16, bf16, or f32; copy may be null):
//   adamw8bit_<c>(master, grad, m, m_absmax, v, v_absmax, code_maps, copy, n, lr, step, scale,
//                 grad_norm, beta1, beta2, eps, weight_decay, max_grad_norm)
// Per value, with g = grad * (1/scale) * clip (clip as optimizer.cu) and t = step + 1:
//   m = fmaf(g, F32(1 - b1), m * F32(b1));  v = fmaf(F32(1 - b2) * g, g, v * F32(b2))
//   denom = sqrtf(v) / F32(sqrt(1 - b2^t)) + F32(eps)
//   p *= F32(1 - lr * wd) (when wd > 0);  p += F32(-lr / (1 - b1^t)) * m / denom
//   copy = <c>(p); absmax = max |m| (v) over the block; code = nearest map entry to
//   x / absmax (0 when absmax is 0), the lower one on a tie, found by binary search.
// A step whose grad_norm is not finite changes nothing.
// Launch: blockDim = (ADAMW8BIT_BLOCK, 1, 1), any 1-D grid (blocks stride over the
// quantization blocks).
#include "castor_common.cuh"

#define ADAMW8BIT_BLOCK 256
#define ADAMW8BIT_CODES 256

// The index of the entry of the sorted `code` nearest to x, as castor_ir::quant::nearest_code.
__device__ __forceinline__ unsigned char adamw8bit_nearest(const float* code, float x) {
    int lo = 0, hi = ADAMW8BIT_CODES;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (code[mid] <= x) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    if (lo + 1 < ADAMW8BIT_CODES && fabsf(x - code[lo + 1]) < fabsf(x - code[lo])) lo += 1;
    return (unsigned char)lo;
}

template <typename C>
__device__ __forceinline__ void adamw8bit(
    float* __restrict__ master, const float* __restrict__ grad, unsigned char* __restrict__ m,
    float* __restrict__ m_absmax, unsigned char* __restrict__ v, float* __restrict__ v_absmax,
    const float* __restrict__ code_maps, C* copy, i64 n, const float* lr, const float* step,
    const float* scale, const float* grad_norm, double beta1, double beta2, double eps,
    double weight_decay, double max_grad_norm) {
    __shared__ float signed_map[ADAMW8BIT_CODES];
    __shared__ float unsigned_map[ADAMW8BIT_CODES];
    __shared__ float scratch[32];
    const float gn = *grad_norm;
    if (!isfinite(gn)) return;
    const int t = threadIdx.x;
    signed_map[t] = code_maps[t];
    unsigned_map[t] = code_maps[ADAMW8BIT_CODES + t];
    __syncthreads();

    const float inv_scale = 1.0f / *scale;
    float clip = 1.0f;
    if (max_grad_norm > 0.0) {
        const float coef = float(max_grad_norm) / (gn + 1e-6f);
        clip = coef < 1.0f ? coef : 1.0f;
    }
    const double steps = double(*step) + 1.0;
    const double lr64 = double(*lr);
    const float b1 = float(beta1), w1 = float(1.0 - beta1);
    const float b2 = float(beta2), w2 = float(1.0 - beta2);
    const float bias2_sqrt = float(sqrt(1.0 - pow(beta2, steps)));
    const float e = float(eps);
    const bool decays = weight_decay > 0.0;
    const float decay = float(1.0 - lr64 * weight_decay);
    const float neg_step = float(-lr64 / (1.0 - pow(beta1, steps)));

    const i64 blocks = (n + ADAMW8BIT_BLOCK - 1) / ADAMW8BIT_BLOCK;
    for (i64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        const i64 k = b * ADAMW8BIT_BLOCK + t;
        const bool live = k < n;
        float mf = 0.0f, vf = 0.0f;
        if (live) {
            mf = signed_map[m[k]] * m_absmax[b];
            vf = unsigned_map[v[k]] * v_absmax[b];
            const float g = grad[k] * inv_scale * clip;
            mf = fmaf(g, w1, mf * b1);
            vf = fmaf(w2 * g, g, vf * b2);
            const float denom = sqrtf(vf) / bias2_sqrt + e;
            float p = master[k];
            if (decays) p *= decay;
            p += neg_step * mf / denom;
            master[k] = p;
            if (copy) copy[k] = from_f32<C>(p);
        }
        // Every thread has read this block's maxima before the reductions synchronize.
        const float m_max = block_max(fabsf(mf), scratch);
        const float v_max = block_max(vf, scratch);
        if (live) {
            m[k] = adamw8bit_nearest(signed_map, m_max > 0.0f ? mf / m_max : 0.0f);
            v[k] = adamw8bit_nearest(unsigned_map, v_max > 0.0f ? vf / v_max : 0.0f);
        }
        if (t == 0) {
            m_absmax[b] = m_max;
            v_absmax[b] = v_max;
        }
    }
}

#define ADAMW8BIT(C, c)                                                                        \
    extern "C" __global__ void adamw8bit_##c(                                                  \
        float* __restrict__ master, const float* __restrict__ grad,                           \
        unsigned char* __restrict__ m, float* __restrict__ m_absmax,                          \
        unsigned char* __restrict__ v, float* __restrict__ v_absmax,                          \
        const float* __restrict__ code_maps, C* copy, i64 n, const float* lr,                 \
        const float* step, const float* scale, const float* grad_norm, double beta1,          \
        double beta2, double eps, double weight_decay, double max_grad_norm) {                \
        adamw8bit<C>(master, grad, m, m_absmax, v, v_absmax, code_maps, copy, n, lr, step,    \
                     scale, grad_norm, beta1, beta2, eps, weight_decay, max_grad_norm);       \
    }
ADAMW8BIT(float, f32)
ADAMW8BIT(__half, f16)
ADAMW8BIT(__nv_bfloat16, bf16)
