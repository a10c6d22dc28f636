// optimizer.cu: fused multi-tensor AdamW, SGD-momentum and Lion steps on F32 master weights.
//
// Fuses, in one pass over memory per element: unscale (1/loss scale), the found-inf skip,
// the global-norm clip, weight decay, the moment updates, the master update and the write of
// the low-precision working copy. Reads grad, master and moments; writes master, moments and
// the copy. No host synchronization: lr, step, scale and grad_norm are device scalars (so the
// whole step can be captured in a CUDA graph), and a step whose grad_norm is not finite
// (inf/NaN gradients: found_inf) changes nothing: it only writes each copy again from its
// unchanged master, since a data-parallel rank's copy may be a fresh buffer (its shard,
// gathered after the update) that nothing else writes; a persistent copy gets the same bits.
// Entry points (<c> = the working copy's dtype: f16, bf16, or f32; copy pointers may be null):
//   adamw_<c>(tensors, chunks, n_chunks, lr, step, scale, grad_norm, beta1, beta2, eps,
//             max_grad_norm, amax_partials)
//   sgd_<c>(tensors, chunks, n_chunks, lr, step, scale, grad_norm, momentum, max_grad_norm,
//           amax_partials)
//   lion_<c>(tensors, chunks, n_chunks, lr, step, scale, grad_norm, beta1, beta2,
//            max_grad_norm, amax_partials)
//   adamw_bf16state_<c>, sgd_bf16state_<c>, lion_bf16state_<c>: the same with the moments
//             stored in BF16 (read and widened, updated in F32, rounded to nearest even when
//             stored).
//   tensors: device table of AdamWTensor / MomentTensor (layouts below; SGD and Lion keep one
//   moment), chunks: TensorChunk
//   (castor_common.cuh). lr, step (optimizer steps taken before this one), scale, grad_norm:
//   device F32 scalars. Hyperparameters are F64 arguments, weight decay per tensor.
// Semantics: torch.optim.AdamW / SGD single-tensor implementations and lion-pytorch's Lion,
// operation by operation,
// exactly as the CPU twin runtime/src/cpu/optimizer.rs (F32 arithmetic on F32 buffers,
// scalars formed in F64 and used as F32; the module is compiled without FMA contraction):
//   g     = grad * (1/scale) * clip,  clip = min(1, F32(max_grad_norm) / (grad_norm + 1e-6))
//           when max_grad_norm > 0, else 1
//   AdamW, t = step + 1:
//     p *= F32(1 - lr * wd)                  (decoupled decay)
//     m  = lerp(m, g, 1 - b1)                (torch.lerp's two-branch formula)
//     v  = v * b2 + (1 - b2) * g * g
//     p += -F32(lr / (1 - b1^t)) * (m / (sqrt(v) / F32(sqrt(1 - b2^t)) + eps))
//   SGD (dampening 0, not Nesterov; the momentum buffer starts at zero, so the first step
//   stores g itself, as torch does):
//     g += wd * p (when wd != 0);  buf = momentum != 0 ? buf * momentum + g : g;  p += -lr * buf
//   Lion (Chen et al. 2023; the moment starts at zero):
//     p *= F32(1 - lr * wd);  p -= lr * sign(m * b1 + (1 - b1) * g);  m = m * b2 + (1 - b2) * g
//   copy = <c>(p), rounded to nearest even.
// The step counter is advanced separately (count_step in loss_scale.cu), after every
// optimizer launch of the step has read it.
// amax_partials (nullable, the last parameter of every entry point): n_chunks floats,
// amax_partials[c] = the largest |p| of chunk c's masters as the step leaves them (updated, or
// unchanged when the step is skipped), NaN if one is NaN: fp8.cu's amax partials, which
// fp8_scale_finalize turns into the scale of a weight's FP8 copy (the `fp8_scale` of an updated
// master fused into its update). A tensor's chunks are consecutive in the chunk table.
// Launch: any grid (up to one block per chunk) and blockDim.x; 4-float vectors when a chunk's
// pointers are 16-byte aligned (copy: 8-byte for 16-bit dtypes), scalar otherwise and for the
// chunk's tail.
#include "castor_common.cuh"

// Host layout: 5 pointers, i64 numel, f64 weight decay (56 bytes). The moments are float or
// __nv_bfloat16 as the entry point says.
struct AdamWTensor {
    float* master;
    const float* grad;
    void* m;
    void* v;
    void* copy;
    i64 numel;
    double weight_decay;
};

// Host layout: 4 pointers, i64 numel, f64 weight decay (48 bytes). SGD's momentum buffer or
// Lion's exp_avg.
struct MomentTensor {
    float* master;
    const float* grad;
    void* buf;
    void* copy;
    i64 numel;
    double weight_decay;
};

// The per-step factors every element uses; `skip` when the step is skipped.
struct GradFactor {
    float inv_scale, clip;
    bool skip;
};

__device__ __forceinline__ GradFactor grad_factor(const float* scale, const float* grad_norm,
                                                  double max_grad_norm) {
    const float gn = *grad_norm;
    GradFactor f;
    f.skip = !isfinite(gn);
    f.inv_scale = 1.0f / *scale;
    f.clip = 1.0f;
    if (max_grad_norm > 0.0) {
        const float coef = float(max_grad_norm) / (gn + 1e-6f);
        f.clip = coef < 1.0f ? coef : 1.0f;
    }
    return f;
}

// torch.lerp as ATen computes it.
__device__ __forceinline__ float lerp_torch(float a, float b, float w) {
    return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

template <typename C> __device__ __forceinline__ void store4(C* p, float4 v) {
    p[0] = from_f32<C>(v.x);
    p[1] = from_f32<C>(v.y);
    p[2] = from_f32<C>(v.z);
    p[3] = from_f32<C>(v.w);
}
template <> __device__ __forceinline__ void store4<float>(float* p, float4 v) {
    *reinterpret_cast<float4*>(p) = v;
}
template <typename H> __device__ __forceinline__ void store4_16(H* p, float4 v) {
    uint2 raw;
    H* e = reinterpret_cast<H*>(&raw);
    e[0] = from_f32<H>(v.x);
    e[1] = from_f32<H>(v.y);
    e[2] = from_f32<H>(v.z);
    e[3] = from_f32<H>(v.w);
    *reinterpret_cast<uint2*>(p) = raw;
}
template <> __device__ __forceinline__ void store4<__half>(__half* p, float4 v) { store4_16(p, v); }
template <> __device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* p, float4 v) {
    store4_16(p, v);
}

__device__ __forceinline__ bool aligned_to(const void* p, u64 bytes) {
    return (reinterpret_cast<u64>(p) & (bytes - 1)) == 0;
}

// Four consecutive moments, widened to F32 (16-byte loads for float, 8-byte for BF16).
template <typename S> __device__ __forceinline__ float4 load4(const S* p);
template <> __device__ __forceinline__ float4 load4<float>(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}
template <> __device__ __forceinline__ float4 load4<__nv_bfloat16>(const __nv_bfloat16* p) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
    return make_float4(to_f32(e[0]), to_f32(e[1]), to_f32(e[2]), to_f32(e[3]));
}

// The largest magnitude of one chunk's masters as the step leaves them (amax_partials).
struct ChunkAmax {
    float* partials;  // nullable: no amax wanted
    float m;
    bool nan;
    __device__ __forceinline__ void start() {
        m = 0.0f;
        nan = false;
    }
    __device__ __forceinline__ void fold(float p) {
        if (partials) fold_abs(p, m, nan);
    }
    __device__ __forceinline__ void fold4(float4 p) {
        fold(p.x);
        fold(p.y);
        fold(p.z);
        fold(p.w);
    }
    // Every thread of the block calls it, once a chunk (the chunk loop is uniform).
    __device__ __forceinline__ void store(int c, float* scratch) {
        if (!partials) return;
        const float r = block_max(nan ? F32_CANONICAL_NAN : m, scratch);
        if (threadIdx.x == 0) partials[c] = r;
    }
};

// A skipped step's copies: each written from its unchanged master (and its amax taken).
template <typename C, typename T>
__device__ __forceinline__ void refresh_copies(const T* __restrict__ tensors,
                                               const TensorChunk* __restrict__ chunks,
                                               int n_chunks, ChunkAmax amax, float* scratch) {
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const TensorChunk ch = chunks[c];
        const T tt = tensors[ch.tensor];
        const float* P = tt.master + ch.start;
        C* K = tt.copy ? static_cast<C*>(tt.copy) + ch.start : nullptr;
        const int len = int(min(i64(ch.len), tt.numel - ch.start));
        amax.start();
        for (int i = threadIdx.x; i < len; i += blockDim.x) {
            if (K) K[i] = from_f32<C>(P[i]);
            amax.fold(P[i]);
        }
        amax.store(c, scratch);
    }
}

struct AdamWScalars {
    float decay, w1, b2, w2, step_size, bias2_sqrt, eps;
};

__device__ __forceinline__ void adamw_elem(float& p, float g, float& m, float& v,
                                           const AdamWScalars& s) {
    p *= s.decay;
    m = lerp_torch(m, g, s.w1);
    v = v * s.b2 + s.w2 * g * g;
    const float denom = sqrtf(v) / s.bias2_sqrt + s.eps;
    p += -s.step_size * (m / denom);
}

template <typename C, typename S>
__device__ __forceinline__ void adamw(const AdamWTensor* __restrict__ tensors,
                                      const TensorChunk* __restrict__ chunks, int n_chunks,
                                      const float* lr, const float* step, const float* scale,
                                      const float* grad_norm, double beta1, double beta2,
                                      double eps, double max_grad_norm, float* amax_partials) {
    __shared__ float scratch[32];
    ChunkAmax amax{amax_partials};
    const GradFactor f = grad_factor(scale, grad_norm, max_grad_norm);
    if (f.skip) {
        refresh_copies<C>(tensors, chunks, n_chunks, amax, scratch);
        return;
    }
    const double t = double(*step) + 1.0;
    const double lr64 = double(*lr);
    AdamWScalars s;
    s.w1 = float(1.0 - beta1);
    s.b2 = float(beta2);
    s.w2 = float(1.0 - beta2);
    s.step_size = float(lr64 / (1.0 - pow(beta1, t)));
    s.bias2_sqrt = float(sqrt(1.0 - pow(beta2, t)));
    s.eps = float(eps);
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const TensorChunk ch = chunks[c];
        const AdamWTensor tt = tensors[ch.tensor];
        s.decay = float(1.0 - lr64 * tt.weight_decay);
        float* P = tt.master + ch.start;
        const float* G = tt.grad + ch.start;
        S* M = static_cast<S*>(tt.m) + ch.start;
        S* V = static_cast<S*>(tt.v) + ch.start;
        C* K = tt.copy ? static_cast<C*>(tt.copy) + ch.start : nullptr;
        const int len = int(min(i64(ch.len), tt.numel - ch.start));
        amax.start();
        const bool vec = aligned16(P) && aligned16(G) && aligned_to(M, 4 * sizeof(S)) &&
                         aligned_to(V, 4 * sizeof(S)) && (!K || aligned_to(K, 4 * sizeof(C)));
        const int units = vec ? len / 4 : 0;
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            float4 p = reinterpret_cast<float4*>(P)[u];
            const float4 g = reinterpret_cast<const float4*>(G)[u];
            float4 m = load4<S>(M + 4 * u);
            float4 v = load4<S>(V + 4 * u);
            adamw_elem(p.x, g.x * f.inv_scale * f.clip, m.x, v.x, s);
            adamw_elem(p.y, g.y * f.inv_scale * f.clip, m.y, v.y, s);
            adamw_elem(p.z, g.z * f.inv_scale * f.clip, m.z, v.z, s);
            adamw_elem(p.w, g.w * f.inv_scale * f.clip, m.w, v.w, s);
            reinterpret_cast<float4*>(P)[u] = p;
            amax.fold4(p);
            store4<S>(M + 4 * u, m);
            store4<S>(V + 4 * u, v);
            if (K) store4<C>(K + 4 * u, p);
        }
        for (int i = units * 4 + threadIdx.x; i < len; i += blockDim.x) {
            float p = P[i], m = to_f32(M[i]), v = to_f32(V[i]);
            adamw_elem(p, G[i] * f.inv_scale * f.clip, m, v, s);
            P[i] = p;
            amax.fold(p);
            M[i] = from_f32<S>(m);
            V[i] = from_f32<S>(v);
            if (K) K[i] = from_f32<C>(p);
        }
        amax.store(c, scratch);
    }
}

__device__ __forceinline__ void sgd_elem(float& p, float g, float& b, float wd, float mom,
                                         float lr) {
    if (wd != 0.0f) g += wd * p;
    b = mom != 0.0f ? b * mom + g : g;
    p += -lr * b;
}

template <typename C, typename S>
__device__ __forceinline__ void sgd(const MomentTensor* __restrict__ tensors,
                                    const TensorChunk* __restrict__ chunks, int n_chunks,
                                    const float* lr, const float* step, const float* scale,
                                    const float* grad_norm, double momentum, double max_grad_norm,
                                    float* amax_partials) {
    (void)step;  // SGD has no bias correction; kept for the common signature
    __shared__ float scratch[32];
    ChunkAmax amax{amax_partials};
    const GradFactor f = grad_factor(scale, grad_norm, max_grad_norm);
    if (f.skip) {
        refresh_copies<C>(tensors, chunks, n_chunks, amax, scratch);
        return;
    }
    const float lrf = *lr, mom = float(momentum);
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const TensorChunk ch = chunks[c];
        const MomentTensor tt = tensors[ch.tensor];
        const float wd = float(tt.weight_decay);
        float* P = tt.master + ch.start;
        const float* G = tt.grad + ch.start;
        S* B = static_cast<S*>(tt.buf) + ch.start;
        C* K = tt.copy ? static_cast<C*>(tt.copy) + ch.start : nullptr;
        const int len = int(min(i64(ch.len), tt.numel - ch.start));
        amax.start();
        const bool vec = aligned16(P) && aligned16(G) && aligned_to(B, 4 * sizeof(S)) &&
                         (!K || aligned_to(K, 4 * sizeof(C)));
        const int units = vec ? len / 4 : 0;
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            float4 p = reinterpret_cast<float4*>(P)[u];
            const float4 g = reinterpret_cast<const float4*>(G)[u];
            float4 b = load4<S>(B + 4 * u);
            sgd_elem(p.x, g.x * f.inv_scale * f.clip, b.x, wd, mom, lrf);
            sgd_elem(p.y, g.y * f.inv_scale * f.clip, b.y, wd, mom, lrf);
            sgd_elem(p.z, g.z * f.inv_scale * f.clip, b.z, wd, mom, lrf);
            sgd_elem(p.w, g.w * f.inv_scale * f.clip, b.w, wd, mom, lrf);
            reinterpret_cast<float4*>(P)[u] = p;
            amax.fold4(p);
            store4<S>(B + 4 * u, b);
            if (K) store4<C>(K + 4 * u, p);
        }
        for (int i = units * 4 + threadIdx.x; i < len; i += blockDim.x) {
            float p = P[i], b = to_f32(B[i]);
            sgd_elem(p, G[i] * f.inv_scale * f.clip, b, wd, mom, lrf);
            P[i] = p;
            amax.fold(p);
            B[i] = from_f32<S>(b);
            if (K) K[i] = from_f32<C>(p);
        }
        amax.store(c, scratch);
    }
}

// torch.sgn: -1, 0 or 1 (NaN stays NaN).
__device__ __forceinline__ float sign_torch(float x) {
    return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
}

struct LionScalars {
    float decay, lr, b1, c1, b2, c2;
};

__device__ __forceinline__ void lion_elem(float& p, float g, float& m, const LionScalars& s) {
    const float decayed = p * s.decay;
    const float blend = m * s.b1 + s.c1 * g;
    p = decayed - s.lr * sign_torch(blend);
    m = m * s.b2 + s.c2 * g;
}

template <typename C, typename S>
__device__ __forceinline__ void lion(const MomentTensor* __restrict__ tensors,
                                     const TensorChunk* __restrict__ chunks, int n_chunks,
                                     const float* lr, const float* step, const float* scale,
                                     const float* grad_norm, double beta1, double beta2,
                                     double max_grad_norm, float* amax_partials) {
    (void)step;  // Lion has no bias correction; kept for the common signature
    __shared__ float scratch[32];
    ChunkAmax amax{amax_partials};
    const GradFactor f = grad_factor(scale, grad_norm, max_grad_norm);
    if (f.skip) {
        refresh_copies<C>(tensors, chunks, n_chunks, amax, scratch);
        return;
    }
    LionScalars s;
    s.lr = *lr;
    s.b1 = float(beta1);
    s.c1 = float(1.0 - beta1);
    s.b2 = float(beta2);
    s.c2 = float(1.0 - beta2);
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const TensorChunk ch = chunks[c];
        const MomentTensor tt = tensors[ch.tensor];
        s.decay = float(1.0 - double(s.lr) * tt.weight_decay);
        float* P = tt.master + ch.start;
        const float* G = tt.grad + ch.start;
        S* M = static_cast<S*>(tt.buf) + ch.start;
        C* K = tt.copy ? static_cast<C*>(tt.copy) + ch.start : nullptr;
        const int len = int(min(i64(ch.len), tt.numel - ch.start));
        amax.start();
        const bool vec = aligned16(P) && aligned16(G) && aligned_to(M, 4 * sizeof(S)) &&
                         (!K || aligned_to(K, 4 * sizeof(C)));
        const int units = vec ? len / 4 : 0;
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            float4 p = reinterpret_cast<float4*>(P)[u];
            const float4 g = reinterpret_cast<const float4*>(G)[u];
            float4 m = load4<S>(M + 4 * u);
            lion_elem(p.x, g.x * f.inv_scale * f.clip, m.x, s);
            lion_elem(p.y, g.y * f.inv_scale * f.clip, m.y, s);
            lion_elem(p.z, g.z * f.inv_scale * f.clip, m.z, s);
            lion_elem(p.w, g.w * f.inv_scale * f.clip, m.w, s);
            reinterpret_cast<float4*>(P)[u] = p;
            amax.fold4(p);
            store4<S>(M + 4 * u, m);
            if (K) store4<C>(K + 4 * u, p);
        }
        for (int i = units * 4 + threadIdx.x; i < len; i += blockDim.x) {
            float p = P[i], m = to_f32(M[i]);
            lion_elem(p, G[i] * f.inv_scale * f.clip, m, s);
            P[i] = p;
            amax.fold(p);
            M[i] = from_f32<S>(m);
            if (K) K[i] = from_f32<C>(p);
        }
        amax.store(c, scratch);
    }
}

// `name` names the entry points of moments stored as S.
#define OPTIMIZER_STATE(C, c, S, name)                                                         \
    extern "C" __global__ void adamw_##name##c(                                                \
        const AdamWTensor* tensors, const TensorChunk* chunks, int n_chunks, const float* lr,  \
        const float* step, const float* scale, const float* grad_norm, double beta1,           \
        double beta2, double eps, double max_grad_norm, float* amax_partials) {                \
        adamw<C, S>(tensors, chunks, n_chunks, lr, step, scale, grad_norm, beta1, beta2, eps,  \
                    max_grad_norm, amax_partials);                                             \
    }                                                                                          \
    extern "C" __global__ void sgd_##name##c(const MomentTensor* tensors,                      \
                                             const TensorChunk* chunks, int n_chunks,          \
                                             const float* lr, const float* step,               \
                                             const float* scale, const float* grad_norm,       \
                                             double momentum, double max_grad_norm,            \
                                             float* amax_partials) {                           \
        sgd<C, S>(tensors, chunks, n_chunks, lr, step, scale, grad_norm, momentum,             \
                  max_grad_norm, amax_partials);                                               \
    }                                                                                          \
    extern "C" __global__ void lion_##name##c(                                                 \
        const MomentTensor* tensors, const TensorChunk* chunks, int n_chunks, const float* lr, \
        const float* step, const float* scale, const float* grad_norm, double beta1,           \
        double beta2, double max_grad_norm, float* amax_partials) {                            \
        lion<C, S>(tensors, chunks, n_chunks, lr, step, scale, grad_norm, beta1, beta2,        \
                   max_grad_norm, amax_partials);                                              \
    }

#define OPTIMIZER(C, c)                                                                        \
    OPTIMIZER_STATE(C, c, float, )                                                             \
    OPTIMIZER_STATE(C, c, __nv_bfloat16, bf16state_)

CASTOR_FOR_EACH_T(OPTIMIZER)
