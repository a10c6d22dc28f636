// adafactor.cu: one Adafactor step (transformers' Adafactor.step) of one F32 parameter, in
// launches that each pass over the gradient once, with every sum in a fixed order so the
// result equals the CPU twin (runtime/src/cpu/adafactor.rs) bit for bit.
//
// A parameter of rank >= 2 is `lead` matrices of rows x cols with factored second moments
// (row [lead*rows], col [lead*cols]); a vector has the full exp_avg_sq v [n].
//   g'     = grad * F32(1/scale) * clip (clip as optimizer.cu), sq = g'*g' + F32(eps1)
//   t      = step + 1, beta2t = 1 - t^decay_rate (F64), keep = F32(beta2t), take = F32(1 - beta2t)
// Entry points, in launch order:
//   adafactor_rows(grad, row, n_rows, cols, scale, grad_norm, max_grad_norm, eps1, step,
//                  decay_rate): one block per row (lead*rows blocks):
//     row[i] = row[i]*keep + take*F32(sum_j sq[i,j] / cols)
//   adafactor_cols(grad, col, lead, rows, cols, ...same): one thread per column:
//     col[j] = col[j]*keep + take*F32(sum_i sq[i,j] / rows), the sum over i in order
//   adafactor_full(grad, v, n, ...same): v = v*keep + take*sq, elementwise
//   adafactor_row_mean(row, lead, rows, grad_norm, row_mean): one block per matrix:
//     row_mean[b] = F32(sum_i row[b,i] / rows)
//   adafactor_partials(master, grad, row, col, row_mean, v, n, rows, cols, scale, grad_norm,
//                      max_grad_norm, partials): one block per CHUNK elements:
//     partials[c] = sum over chunk c of u^2, partials[n_chunks + c] = of master^2, where
//     u = F32(1/sqrt(row[i]/row_mean[b])) * F32(1/sqrt(col[j])) * g' (factored; row null
//     when v is not) or F32(1/sqrt(v)) * g' (full)
//   adafactor_finalize(partials, n_chunks, n, lr, step, grad_norm, eps2, clip_threshold,
//                      relative_step, scale_parameter, warmup_init, factors), one thread:
//     rms_u = F32(sqrt(sum u^2) / sqrt(n)), rms_p the same of master; factors[0] = the rate
//     (transformers' _get_lr), factors[1] = max(rms_u / F32(clip_threshold), 1)
//   adafactor_apply_<c>(master, grad, exp_avg, row, col, row_mean, v, copy, n, rows, cols,
//                       scale, grad_norm, max_grad_norm, factors, beta1, weight_decay):
//     u = u / factors[1] * factors[0]; exp_avg (nullable) = exp_avg*F32(beta1) +
//     F32(1-beta1)*u, u = exp_avg; master += (-F32(wd) * rate) * master when wd != 0;
//     master += -u; copy (nullable, dtype <c>) = <c>(master)
// Every launch reads grad_norm and changes nothing when it is not finite (a skipped step).
// Sums: F64, each thread over the elements k = threadIdx.x + m * ADAFACTOR_THREADS in order,
// then block_sum's tree (warp butterflies, then the warps' sums); the finalize sums the chunk
// partials in chunk order. The twin sums in exactly this order.
// Launch: rows, row_mean and partials with blockDim.x = ADAFACTOR_THREADS; cols, full and apply
// with any 1-D grid and block; finalize with one thread.
#include "castor_common.cuh"

#define ADAFACTOR_THREADS 256
#define ADAFACTOR_CHUNK 16384

__device__ __forceinline__ bool adafactor_skip(const float* grad_norm) {
    return !isfinite(*grad_norm);
}

// F32(1/scale) * clip, as optimizer.cu's grad_factor.
__device__ __forceinline__ float adafactor_gscale(const float* scale, const float* grad_norm,
                                                  double max_grad_norm, float* clip) {
    const float gn = *grad_norm;
    *clip = 1.0f;
    if (max_grad_norm > 0.0) {
        const float coef = float(max_grad_norm) / (gn + 1e-6f);
        *clip = coef < 1.0f ? coef : 1.0f;
    }
    return 1.0f / *scale;
}

struct Decay {
    float keep, take;
};

__device__ __forceinline__ Decay adafactor_decay(const float* step, double decay_rate) {
    const double t = double(*step) + 1.0;
    const double beta2t = 1.0 - pow(t, decay_rate);
    Decay d;
    d.keep = float(beta2t);
    d.take = float(1.0 - beta2t);
    return d;
}

extern "C" __global__ void adafactor_rows(const float* __restrict__ grad, float* __restrict__ row,
                                          int n_rows, int cols, const float* scale,
                                          const float* grad_norm, double max_grad_norm,
                                          double eps1, const float* step, double decay_rate) {
    __shared__ double scratch[32];
    if (adafactor_skip(grad_norm)) return;
    float clip;
    const float inv = adafactor_gscale(scale, grad_norm, max_grad_norm, &clip);
    const float e1 = float(eps1);
    const Decay d = adafactor_decay(step, decay_rate);
    for (int r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const float* g = grad + i64(r) * cols;
        double acc = 0.0;
        for (int j = threadIdx.x; j < cols; j += ADAFACTOR_THREADS) {
            const float x = g[j] * inv * clip;
            acc += double(x * x + e1);
        }
        acc = block_sum(acc, scratch);
        if (threadIdx.x == 0) row[r] = row[r] * d.keep + d.take * float(acc / double(cols));
    }
}

extern "C" __global__ void adafactor_cols(const float* __restrict__ grad, float* __restrict__ col,
                                          int lead, int rows, int cols, const float* scale,
                                          const float* grad_norm, double max_grad_norm,
                                          double eps1, const float* step, double decay_rate) {
    if (adafactor_skip(grad_norm)) return;
    float clip;
    const float inv = adafactor_gscale(scale, grad_norm, max_grad_norm, &clip);
    const float e1 = float(eps1);
    const Decay d = adafactor_decay(step, decay_rate);
    const i64 n = i64(lead) * cols;
    for (i64 k = blockIdx.x * i64(blockDim.x) + threadIdx.x; k < n;
         k += i64(gridDim.x) * blockDim.x) {
        const i64 b = k / cols, j = k % cols;
        const float* g = grad + b * rows * cols + j;
        double acc = 0.0;
        for (int i = 0; i < rows; ++i) {
            const float x = g[i64(i) * cols] * inv * clip;
            acc += double(x * x + e1);
        }
        col[k] = col[k] * d.keep + d.take * float(acc / double(rows));
    }
}

extern "C" __global__ void adafactor_full(const float* __restrict__ grad, float* __restrict__ v,
                                          i64 n, const float* scale, const float* grad_norm,
                                          double max_grad_norm, double eps1, const float* step,
                                          double decay_rate) {
    if (adafactor_skip(grad_norm)) return;
    float clip;
    const float inv = adafactor_gscale(scale, grad_norm, max_grad_norm, &clip);
    const float e1 = float(eps1);
    const Decay d = adafactor_decay(step, decay_rate);
    for (i64 k = blockIdx.x * i64(blockDim.x) + threadIdx.x; k < n;
         k += i64(gridDim.x) * blockDim.x) {
        const float x = grad[k] * inv * clip;
        v[k] = v[k] * d.keep + d.take * (x * x + e1);
    }
}

extern "C" __global__ void adafactor_row_mean(const float* __restrict__ row, int lead, int rows,
                                              const float* grad_norm,
                                              float* __restrict__ row_mean) {
    __shared__ double scratch[32];
    if (adafactor_skip(grad_norm)) return;
    for (int b = blockIdx.x; b < lead; b += gridDim.x) {
        double acc = 0.0;
        for (int i = threadIdx.x; i < rows; i += ADAFACTOR_THREADS) acc += double(row[i64(b) * rows + i]);
        acc = block_sum(acc, scratch);
        if (threadIdx.x == 0) row_mean[b] = float(acc / double(rows));
    }
}

// The unclipped, unscaled update of element k.
__device__ __forceinline__ float adafactor_u(const float* row, const float* col,
                                             const float* row_mean, const float* v, i64 k,
                                             int rows, int cols, float g) {
    if (v) return (1.0f / sqrtf(v[k])) * g;
    const i64 per = i64(rows) * cols;
    const i64 b = k / per, i = (k % per) / cols, j = k % cols;
    const float r = 1.0f / sqrtf(row[b * rows + i] / row_mean[b]);
    const float c = 1.0f / sqrtf(col[b * cols + j]);
    return r * c * g;
}

extern "C" __global__ void adafactor_partials(
    const float* __restrict__ master, const float* __restrict__ grad, const float* row,
    const float* col, const float* row_mean, const float* v, i64 n, int rows, int cols,
    const float* scale, const float* grad_norm, double max_grad_norm,
    double* __restrict__ partials) {
    __shared__ double scratch[32];
    if (adafactor_skip(grad_norm)) return;
    float clip;
    const float inv = adafactor_gscale(scale, grad_norm, max_grad_norm, &clip);
    const i64 n_chunks = (n + ADAFACTOR_CHUNK - 1) / ADAFACTOR_CHUNK;
    for (i64 c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const i64 start = c * ADAFACTOR_CHUNK;
        const i64 end = min(n, start + ADAFACTOR_CHUNK);
        double su = 0.0, sp = 0.0;
        for (i64 k = start + threadIdx.x; k < end; k += ADAFACTOR_THREADS) {
            const float u = adafactor_u(row, col, row_mean, v, k, rows, cols, grad[k] * inv * clip);
            su += double(u) * double(u);
            sp += double(master[k]) * double(master[k]);
        }
        su = block_sum(su, scratch);
        sp = block_sum(sp, scratch);
        if (threadIdx.x == 0) {
            partials[c] = su;
            partials[n_chunks + c] = sp;
        }
    }
}

extern "C" __global__ void adafactor_finalize(const double* __restrict__ partials, int n_chunks,
                                              i64 n, const float* lr, const float* step,
                                              const float* grad_norm, double eps2,
                                              double clip_threshold, int relative_step,
                                              int scale_parameter, int warmup_init,
                                              float* __restrict__ factors) {
    if (adafactor_skip(grad_norm) || threadIdx.x != 0 || blockIdx.x != 0) return;
    double su = 0.0, sp = 0.0;
    for (int c = 0; c < n_chunks; ++c) {
        su += partials[c];
        sp += partials[n_chunks + c];
    }
    const double root_n = sqrt(double(n));
    const float rms_u = float(sqrt(su) / root_n);
    const float rms_p = float(sqrt(sp) / root_n);
    const double t = double(*step) + 1.0;
    double rel = double(*lr);
    if (relative_step) {
        const double min_step = warmup_init ? 1e-6 * t : 1e-2;
        rel = fmin(min_step, 1.0 / sqrt(t));
    }
    float rate;
    if (!scale_parameter) {
        rate = float(rel);
    } else if (eps2 >= double(rms_p)) {
        rate = float(eps2 * rel);
    } else {
        rate = rms_p * float(rel);
    }
    factors[0] = rate;
    factors[1] = fmaxf(rms_u / float(clip_threshold), 1.0f);
}

template <typename C>
__device__ __forceinline__ void adafactor_apply(
    float* __restrict__ master, const float* __restrict__ grad, float* __restrict__ exp_avg,
    const float* row, const float* col, const float* row_mean, const float* v, C* copy, i64 n,
    int rows, int cols, const float* scale, const float* grad_norm, double max_grad_norm,
    const float* factors, double beta1, double weight_decay) {
    if (adafactor_skip(grad_norm)) return;
    float clip;
    const float inv = adafactor_gscale(scale, grad_norm, max_grad_norm, &clip);
    const float rate = factors[0], denom = factors[1];
    const float b1 = float(beta1), w1 = float(1.0 - beta1);
    const float alpha = -float(weight_decay) * rate;
    for (i64 k = blockIdx.x * i64(blockDim.x) + threadIdx.x; k < n;
         k += i64(gridDim.x) * blockDim.x) {
        float u = adafactor_u(row, col, row_mean, v, k, rows, cols, grad[k] * inv * clip);
        u = u / denom * rate;
        if (exp_avg) {
            const float m = exp_avg[k] * b1 + w1 * u;
            exp_avg[k] = m;
            u = m;
        }
        float p = master[k];
        if (weight_decay != 0.0) p += alpha * p;
        p += -u;
        master[k] = p;
        if (copy) copy[k] = from_f32<C>(p);
    }
}

#define ADAFACTOR_APPLY(C, c)                                                                  \
    extern "C" __global__ void adafactor_apply_##c(                                            \
        float* master, const float* grad, float* exp_avg, const float* row, const float* col,  \
        const float* row_mean, const float* v, C* copy, i64 n, int rows, int cols,             \
        const float* scale, const float* grad_norm, double max_grad_norm,                      \
        const float* factors, double beta1, double weight_decay) {                             \
        adafactor_apply<C>(master, grad, exp_avg, row, col, row_mean, v, copy, n, rows, cols,  \
                           scale, grad_norm, max_grad_norm, factors, beta1, weight_decay);     \
    }

CASTOR_FOR_EACH_T(ADAFACTOR_APPLY)
