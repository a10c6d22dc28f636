// norm.cu: LayerNorm and RMSNorm over the last axis, forward and backward, with an optional
// residual add fused in front.
//
// Forward, one block per row (grid-stride over rows), rows of h elements:
//   layer_norm_fwd_<io>(x, x_low, res, sum_out, w, b, y, mean_out, rstd_out, rows, h, eps)
//   rms_norm_fwd_<io>  (x, x_low, res, sum_out, w,    y,           rstd_out, rows, h, eps)
//     a = x, or x_low widened to F32 where x_low is set (TO, nullable; x is then null: the
//         projection's result a norm unit's cast widens on its way into the residual sum)
//     s = res ? TI(a + res) : a          (the residual sum, rounded to TI and written to
//                                          sum_out when sum_out is not null)
//     LN:  y = TO((s - mean) * rstd * w + b), mean and rstd over the row (biased variance)
//     RMS: y = TO(s * rstd * w),               rstd = 1 / sqrt(mean(s^2) + eps)
//     mean_out / rstd_out: F32 per row (nullable), saved for the backward.
//     y (nullable): when null, only the statistics are computed (a backward recomputing
//     them): the normalize pass is skipped and w and b are not read (b may be null then).
// Forward with the FP8 cast of its output fused behind (a norm unit ending with `quantize` or
// `fp8_scale`, under `--precision fp8`):
//   layer_norm_fwd_fp8_<io>(x, x_low, res, sum_out, w, b, y, mean_out, rstd_out, scale, q,
//                           partials, rows, h, eps)
//   rms_norm_fwd_fp8_<io>  (x, x_low, res, sum_out, w, y, rstd_out, scale, q, partials, rows,
//                           h, eps)
//     as the forward, always normalizing; y is stored only when not null. Of each output value
//     as stored, o = TO(y):
//     q (nullable, with scale): q[i] = the E4M3 byte nearest to the F32 product o * *scale
//       (ties to even, saturating), as fp8.cu's fp8_quantize;
//     partials: partials[blockIdx.x] = the NaN-propagating largest |o| over the block's rows,
//       as fp8.cu's fp8_amax partials (fp8_amax_finalize or fp8_scale_finalize reduce them).
// Backward, dx, one block per row:
//   layer_norm_bwd_<io>(s, dy, w, mean, rstd, dadd, dx, dx_low, rows, h)
//     g = dy * w, xhat = (s - mean) * rstd,
//     dx = rstd * (g - mean(g) - xhat * mean(g * xhat))             (native_layer_norm_backward)
//   rms_norm_bwd_<io>(s, dy, w, rstd, dadd, dx, dx_low, rows, h)
//     dx = rstd * (g - s * rstd^2 * mean(g * s))
//   dadd (nullable, TI): another gradient of s, added after dx is rounded to TI (the graph's
//   add of the residual branch's gradient), dx = TI(TI(dx) + dadd).
//   dx_low (nullable, TO): dx as stored, rounded again to TO (the graph's cast of the residual
//   stream's gradient to the products' dtype), dx_low = TO(dx).
// Backward, weight gradients, deterministic in two stages in one launch (no float atomics):
//   layer_norm_bwd_weight_<io>(s, dy, mean, rstd, dw_part, db_part, dw, db, done, rows, h,
//                              rows_per_group)
//   rms_norm_bwd_weight_<io>  (s, dy, rstd, dw_part, dw, done, rows, h, rows_per_group)
//     row group y = blockIdx.y (rows_per_group rows) summed per column into an F64 partial:
//     dw_part[group * h + col] = sum dy * xhat (RMS: dy * s * rstd), db_part = sum dy. Then
//     the last of a column block's gridDim.y groups to finish (done[blockIdx.x] counts them;
//     zero before the launch, and the last block sets it back to zero) sums that block's
//     columns of the partials over the groups: dw[col] = F32(sum of dw_part over the groups),
//     db likewise (each nullable: a gradient nobody reads is not summed).
// Dtypes: <io> is the input/residual/dx dtype TI and the output/dy dtype TO (suffix `bf16`
// when both are bf16, `f32_bf16` for F32 in and BF16 out, ...); w, b, mean, rstd and the
// weight gradients are F32.
// Rounding points, as the CPU twin (runtime/src/cpu/norm.rs): row statistics accumulate in
// F64 (two passes for the variance: sum, then sum of squared deviations from the F64 mean);
// mean and rstd are rounded to F32 (rstd computed as 1 / sqrt(var + eps) in F64 first); the
// normalized values are F32 arithmetic rounded once to TO. The backward's row sums and the
// weight-gradient sums are F64 and rounded to F32 at the end. The only difference from the CPU
// twin is the order of the F64 additions (block tree here, eight lanes there), far below F32
// resolution. The backward takes the forward's saved mean/rstd, which are the values the CPU
// twin recomputes.
// Launch: forward and dx kernels, blockDim.x a multiple of 32, at most 1024. A row whose
// pointers are 16-byte aligned, with h a multiple of 8 and at most one 8-element unit a
// thread (the lowering's block: h / 8 threads in whole warps, 3 warps for GPT-2's 768, up to
// h = 8192), is read from memory once into registers: one read and one write of each element,
// nothing between the two but the row's sums (warp shuffles, and shared memory across the
// block's warps). Every operand of the row is loaded before its sums (the dx kernel's dadd
// too), so a row costs one trip to memory. One unit a thread keeps the registers few
// (many rows in flight on each SM) and each thread's share of the row short: the row's
// latency is its loads and its sums' tree. Any other row (any h, any alignment) takes the
// general loop, which reads the row again for each pass (16-byte vectors where aligned,
// scalar otherwise and for the tail). Both compute the same values: the units a thread sums
// and their order are the same either way, so the block size alone fixes the result.
// Weight gradients: block (32, 8). The kernel takes 32 x 8 columns per block, lane
// threadIdx.x owning 8 consecutive ones (one 16-byte load of each operand a row where
// aligned), its 8 threads threadIdx.y = t taking the group's rows t, t + 8, ... in order, their
// 8 F64 partials combined in shared memory in the order t = 0..7 (as reduce.cu's columns);
// grid (ceil(h / 256), groups). The last block of a column block sums its columns 32 at a time,
// thread t of a column summing groups t, t + 8, ... in order, the 8 sums added in the order
// t = 0..7: which block is last changes nothing but who sums. The lowering picks
// rows_per_group from the shape alone (enough groups to fill a large GPU), so results do not
// depend on the device.
// In place is allowed for y == s (same dtype) and sum_out == x, dx == dy or dx == s.
#include "castor_common.cuh"

// The forward and dx kernels' largest block: a block of any size the lowering picks launches
// (ptxas keeps their registers within 64 a thread).
#define NORM_ROW_THREADS 1024
#define NW_COLS 32    // weight gradients: lanes per block (each UNIT columns of the weight kernel)
#define NW_LANES 8    // weight gradients: threads per column

// Whether a row takes the one-read path: aligned 16-byte vectors, whole units, and at most
// one unit a thread.
__device__ __forceinline__ bool row_in_registers(bool vec, int h) {
    return vec && h % UNIT == 0 && h / UNIT <= int(blockDim.x);
}

// The block's sum of v: the warp's shuffles alone when the block is one warp (the same value
// block_sum gives: its second stage adds zeros).
template <typename A> __device__ __forceinline__ A row_sum(A v, A* scratch) {
    return blockDim.x == 32 ? warp_sum(v) : block_sum(v, scratch);
}

// The block's sums of a pair (the backward's two row sums, under one pair of barriers): each
// component is the value row_sum gives for it.
__device__ __forceinline__ double2 row_sum2(double2 v, double2* scratch) {
    v = make_double2(warp_sum(v.x), warp_sum(v.y));
    if (blockDim.x == 32) return v;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // `scratch` may still be read by the previous row's sums
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const double2 r = lane < warps ? scratch[lane] : make_double2(0.0, 0.0);
    return make_double2(warp_sum(r.x), warp_sum(r.y));
}

// The FP8 tail of a forward (the *_fwd_fp8 kernels): the running largest magnitude of the
// output as stored, and its E4M3 cast by the scale where `q` is set.
template <typename TO> struct Fp8Tail {
    float s;  // *scale, read once (0 when there is no cast)
    float m = 0.0f;
    bool nan = false;
    // 8 outputs at q (8-byte aligned, nullable).
    __device__ __forceinline__ void unit(unsigned char* q, const float (&v)[UNIT]) {
        u64 packed = 0;
#pragma unroll
        for (int k = 0; k < UNIT; ++k) {
            const float o = round_to<TO>(v[k]);
            fold_abs(o, m, nan);
            packed |= u64(E4M3::encode(o * s)) << (8 * k);
        }
        if (q) *reinterpret_cast<u64*>(q) = packed;
    }
    // One output at q (nullable).
    __device__ __forceinline__ void one(unsigned char* q, float v) {
        const float o = round_to<TO>(v);
        fold_abs(o, m, nan);
        if (q) *q = E4M3::encode(o * s);
    }
};

// One row's input, possibly with the residual added: element j, or 8 elements at j. The
// add's first operand is x, or xl (in the output dtype) widened as it is loaded.
template <typename TI, typename TO> struct RowIn {
    const TI* x;   // null where xl is set
    const TO* xl;  // nullable
    const TI* r;   // nullable
    __device__ __forceinline__ float first(int j) const {
        return xl ? to_f32(xl[j]) : to_f32(x[j]);
    }
    __device__ __forceinline__ float at(int j) const {
        return r ? round_to<TI>(first(j) + to_f32(r[j])) : first(j);
    }
    __device__ __forceinline__ void unit(int j, float (&v)[UNIT]) const {
        if (xl)
            load8(xl + j, v);
        else
            load8(x + j, v);
        if (r) {
            float w[UNIT];
            load8(r + j, w);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) v[k] = round_to<TI>(v[k] + w[k]);
        }
    }
    __device__ __forceinline__ bool aligned() const {
        return (xl ? aligned16(xl) : aligned16(x)) && (!r || aligned16(r));
    }
};

// One row of the forward through registers (row_in_registers): thread tid holds unit tid,
// the general loop's share of a thread when the row has no more units than the block threads.
template <typename TI, typename TO, bool RMS, bool FP8>
__device__ __forceinline__ void norm_fwd_regs(RowIn<TI, TO> in, TI* s_out,
                                              const float* __restrict__ w,
                                              const float* __restrict__ b, TO* yr,
                                              float* mean_out, float* rstd_out, i64 row, int h,
                                              double eps, double* scratch, Fp8Tail<TO>& tail,
                                              unsigned char* qr) {
    const int tid = threadIdx.x, j = tid * UNIT;
    const bool mine = tid < h / UNIT;
    float v[UNIT];
    double acc = 0.0;
    if (mine) {
        in.unit(j, v);
        if (s_out) store8(s_out + j, v);
#pragma unroll
        for (int e = 0; e < UNIT; ++e) acc += RMS ? double(v[e]) * double(v[e]) : double(v[e]);
    }
    const double total = row_sum(acc, scratch);
    float meanf = 0.0f, rstd;
    if (RMS) {
        rstd = float(1.0 / sqrt(total / double(h) + eps));
    } else {
        const double mean = total / double(h);
        double dev = 0.0;
        if (mine) {
#pragma unroll
            for (int e = 0; e < UNIT; ++e) dev += (double(v[e]) - mean) * (double(v[e]) - mean);
        }
        const double var = row_sum(dev, scratch) / double(h);
        rstd = float(1.0 / sqrt(var + eps));
        meanf = float(mean);
    }
    if (tid == 0) {
        if (mean_out) mean_out[row] = meanf;
        if (rstd_out) rstd_out[row] = rstd;
    }
    if ((!FP8 && !yr) || !mine) return;
    float wv[UNIT], bv[UNIT];
    load8(w + j, wv);
    if (!RMS) load8(b + j, bv);
#pragma unroll
    for (int e = 0; e < UNIT; ++e)
        v[e] = RMS ? v[e] * rstd * wv[e] : (v[e] - meanf) * rstd * wv[e] + bv[e];
    if (FP8) tail.unit(qr ? qr + j : nullptr, v);
    if (!FP8 || yr) store8(yr + j, v);
}

// FP8: the *_fwd_fp8 kernels (always normalizing, y nullable), with the output's amax per
// block into partials and its E4M3 cast into q where q is set.
template <typename TI, typename TO, bool RMS, bool FP8>
__device__ __forceinline__ void norm_fwd(const TI* x, const TO* x_low, const TI* res,
                                         TI* sum_out, const float* __restrict__ w,
                                         const float* __restrict__ b, TO* y, float* mean_out,
                                         float* rstd_out, const float* scale, unsigned char* q,
                                         float* partials, i64 rows, int h, double eps) {
    __shared__ double scratch[32];
    __shared__ float amax_scratch[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    Fp8Tail<TO> tail{FP8 && q ? *scale : 0.0f};
    const bool normalizes = FP8 || y;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 off = row * h;
        RowIn<TI, TO> in{x_low ? nullptr : x + off, x_low ? x_low + off : nullptr,
                         res ? res + off : nullptr};
        TI* s_out = sum_out ? sum_out + off : nullptr;
        TO* yr = y ? y + off : nullptr;
        unsigned char* qr = q ? q + off : nullptr;
        const bool vec = in.aligned() && (!s_out || aligned16(s_out)) &&
                         (!normalizes || (aligned16(w) && (RMS || aligned16(b)))) &&
                         (!yr || aligned16(yr)) && (!qr || (reinterpret_cast<u64>(qr) & 7ull) == 0);
        if (row_in_registers(vec, h)) {
            norm_fwd_regs<TI, TO, RMS, FP8>(in, s_out, w, b, yr, mean_out, rstd_out, row, h, eps,
                                            scratch, tail, qr);
            continue;
        }
        const int units = vec ? h / UNIT : 0;
        const int rest = units * UNIT;

        // Pass 1: the sum (LN) or sum of squares (RMS), writing the residual sum.
        double acc = 0.0;
        for (int u = tid; u < units; u += nt) {
            float v[UNIT];
            in.unit(u * UNIT, v);
            if (s_out) store8(s_out + u * UNIT, v);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) acc += RMS ? double(v[k]) * double(v[k]) : double(v[k]);
        }
        for (int j = rest + tid; j < h; j += nt) {
            const float v = in.at(j);
            if (s_out) s_out[j] = from_f32<TI>(v);
            acc += RMS ? double(v) * double(v) : double(v);
        }
        // Later passes read the rounded sum back where it was stored (each thread its own
        // elements, so no barrier is needed for that).
        if (s_out) in = RowIn<TI, TO>{s_out, nullptr, nullptr};
        const double total = row_sum(acc, scratch);

        float meanf = 0.0f, rstd;
        if (RMS) {
            rstd = float(1.0 / sqrt(total / double(h) + eps));
        } else {
            const double mean = total / double(h);
            double dev = 0.0;
            for (int u = tid; u < units; u += nt) {
                float v[UNIT];
                in.unit(u * UNIT, v);
#pragma unroll
                for (int k = 0; k < UNIT; ++k) dev += (double(v[k]) - mean) * (double(v[k]) - mean);
            }
            for (int j = rest + tid; j < h; j += nt) {
                const double d = double(in.at(j)) - mean;
                dev += d * d;
            }
            const double var = row_sum(dev, scratch) / double(h);
            rstd = float(1.0 / sqrt(var + eps));
            meanf = float(mean);
        }
        if (tid == 0) {
            if (mean_out) mean_out[row] = meanf;
            if (rstd_out) rstd_out[row] = rstd;
        }
        if (!normalizes) continue;
        // Pass 3: normalize.
        for (int u = tid; u < units; u += nt) {
            const int j = u * UNIT;
            float v[UNIT], wv[UNIT], bv[UNIT];
            in.unit(j, v);
            load8(w + j, wv);
            if (!RMS) load8(b + j, bv);
#pragma unroll
            for (int k = 0; k < UNIT; ++k)
                v[k] = RMS ? v[k] * rstd * wv[k] : (v[k] - meanf) * rstd * wv[k] + bv[k];
            if (FP8) tail.unit(qr ? qr + j : nullptr, v);
            if (!FP8 || yr) store8(yr + j, v);
        }
        for (int j = rest + tid; j < h; j += nt) {
            const float v = in.at(j);
            const float o = RMS ? v * rstd * w[j] : (v - meanf) * rstd * w[j] + b[j];
            if (FP8) tail.one(qr ? qr + j : nullptr, o);
            if (!FP8 || yr) yr[j] = from_f32<TO>(o);
        }
    }
    if (FP8) {
        const float m = block_max(tail.nan ? F32_CANONICAL_NAN : tail.m, amax_scratch);
        if (tid == 0) partials[blockIdx.x] = m;
    }
}

// One unit's terms of a dx row's sums, in element order: sum g and sum g * xhat (LN), or sum
// g * s (RMS), g = dy * w. Both paths add through it, so they sum alike.
template <bool RMS>
__device__ __forceinline__ void dx_sums(const float (&xv)[UNIT], const float (&dv)[UNIT],
                                        const float (&wv)[UNIT], float m, float r, double& sg,
                                        double& sgx) {
#pragma unroll
    for (int e = 0; e < UNIT; ++e) {
        const double g = double(dv[e] * wv[e]);
        if (RMS) {
            sgx += g * double(xv[e]);
        } else {
            sg += g;
            sgx += g * double((xv[e] - m) * r);
        }
    }
}

// One row of dx through registers (row_in_registers): thread tid holds unit tid of s, dy and
// dadd, all loaded before the row's sums so that a row costs one trip to memory; w is read
// again after them (every row reads it: the cache has it), which keeps the registers within
// NORM_ROW_THREADS' bound.
template <typename TI, typename TO, bool RMS>
__device__ __forceinline__ void norm_bwd_regs(const TI* sr, const TO* dyr,
                                              const float* __restrict__ w, float m, float r,
                                              const TI* ar, TI* dxr, TO* lr, int h,
                                              double2* scratch) {
    const int tid = threadIdx.x, j = tid * UNIT;
    const bool mine = tid < h / UNIT;
    float xv[UNIT], dv[UNIT], wv[UNIT], av[UNIT];
    double sg = 0.0, sgx = 0.0;
    if (mine) {
        load8(sr + j, xv);
        load8(dyr + j, dv);
        load8(w + j, wv);
        if (ar) load8(ar + j, av);
        dx_sums<RMS>(xv, dv, wv, m, r, sg, sgx);
    }
    const double2 t = row_sum2(make_double2(sg, sgx), scratch);
    if (!mine) return;
    const float mean_g = float(t.x / double(h));
    const float mean_gx = float(t.y / double(h));
    const float c = r * r * mean_gx;
    load8(w + j, wv);
#pragma unroll
    for (int e = 0; e < UNIT; ++e) {
        const float xhat = (xv[e] - m) * r;
        dv[e] = RMS ? r * (dv[e] * wv[e] - xv[e] * c)
                    : r * (dv[e] * wv[e] - mean_g - xhat * mean_gx);
        if (ar) dv[e] = round_to<TI>(dv[e]) + av[e];
    }
    store8(dxr + j, dv);
    if (lr) {
#pragma unroll
        for (int e = 0; e < UNIT; ++e) dv[e] = round_to<TI>(dv[e]);
        store8(lr + j, dv);
    }
}

template <typename TI, typename TO, bool RMS>
__device__ __forceinline__ void norm_bwd(const TI* s, const TO* dy,
                                         const float* __restrict__ w, const float* __restrict__ mean,
                                         const float* __restrict__ rstd, const TI* dadd, TI* dx,
                                         TO* dx_low, i64 rows, int h) {
    __shared__ double2 scratch[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 off = row * h;
        const TI* sr = s + off;
        const TO* dyr = dy + off;
        const TI* ar = dadd ? dadd + off : nullptr;
        TI* dxr = dx + off;
        TO* lr = dx_low ? dx_low + off : nullptr;
        const float m = RMS ? 0.0f : mean[row];
        const float r = rstd[row];
        const bool vec = aligned16(sr) && aligned16(dyr) && aligned16(dxr) && aligned16(w) &&
                         (!ar || aligned16(ar)) && (!lr || aligned16(lr));
        if (row_in_registers(vec, h)) {
            norm_bwd_regs<TI, TO, RMS>(sr, dyr, w, m, r, ar, dxr, lr, h, scratch);
            continue;
        }
        const int units = vec ? h / UNIT : 0;
        const int tail = units * UNIT;

        // Pass 1: sum g and sum g * xhat (LN), or sum g * s (RMS), in F64.
        double sg = 0.0, sgx = 0.0;
        for (int u = tid; u < units; u += nt) {
            const int j = u * UNIT;
            float xv[UNIT], dv[UNIT], wv[UNIT];
            load8(sr + j, xv);
            load8(dyr + j, dv);
            load8(w + j, wv);
            dx_sums<RMS>(xv, dv, wv, m, r, sg, sgx);
        }
        for (int j = tail + tid; j < h; j += nt) {
            const double g = double(to_f32(dyr[j]) * w[j]);
            const float xv = to_f32(sr[j]);
            if (RMS) {
                sgx += g * double(xv);
            } else {
                sg += g;
                sgx += g * double((xv - m) * r);
            }
        }
        const double2 tot = row_sum2(make_double2(sg, sgx), scratch);
        const float mean_g = float(tot.x / double(h));
        const float mean_gx = float(tot.y / double(h));
        const float c = r * r * mean_gx;  // RMS: rstd^2 * mean(g s)

        // Pass 2: dx.
        for (int u = tid; u < units; u += nt) {
            const int j = u * UNIT;
            float xv[UNIT], dv[UNIT], wv[UNIT];
            load8(sr + j, xv);
            load8(dyr + j, dv);
            load8(w + j, wv);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) {
                const float xhat = (xv[k] - m) * r;
                dv[k] = RMS ? r * (dv[k] * wv[k] - xv[k] * c)
                            : r * (dv[k] * wv[k] - mean_g - xhat * mean_gx);
            }
            if (ar) {
                float av[UNIT];
                load8(ar + j, av);
#pragma unroll
                for (int k = 0; k < UNIT; ++k) dv[k] = round_to<TI>(dv[k]) + av[k];
            }
            store8(dxr + j, dv);
            if (lr) {
#pragma unroll
                for (int k = 0; k < UNIT; ++k) dv[k] = round_to<TI>(dv[k]);
                store8(lr + j, dv);
            }
        }
        for (int j = tail + tid; j < h; j += nt) {
            const float xv = to_f32(sr[j]);
            const float d = to_f32(dyr[j]);
            const float xhat = (xv - m) * r;
            float v = RMS ? r * (d * w[j] - xv * c) : r * (d * w[j] - mean_g - xhat * mean_gx);
            if (ar) v = round_to<TI>(v) + to_f32(ar[j]);
            dxr[j] = from_f32<TI>(v);
            if (lr) lr[j] = from_f32<TO>(round_to<TI>(v));
        }
    }
}

// Stage one of the weight gradients: one F64 partial per (row group, column); block
// (NW_COLS, NW_LANES), lane threadIdx.x owning UNIT consecutive columns, the lanes of a column
// taking the group's rows in turn. A row's UNIT elements are one 16-byte load of each operand
// where h is a multiple of UNIT and s and dy are 16-byte aligned (a row is then too), else
// UNIT scalar loads: the same sums in the same order either way.
template <typename TI, typename TO, bool RMS>
__device__ __forceinline__ void norm_bwd_weight(const TI* __restrict__ s, const TO* __restrict__ dy,
                                                const float* __restrict__ mean,
                                                const float* __restrict__ rstd, double* dw_part,
                                                double* db_part, float* dw_out, float* db_out,
                                                int* done, i64 rows, int h, int rows_per_group) {
    __shared__ double dw_lanes[NW_LANES][NW_COLS * UNIT], db_lanes[NW_LANES][NW_COLS * UNIT];
    const int lane = threadIdx.x, ty = threadIdx.y;
    const int col0 = (blockIdx.x * NW_COLS + lane) * UNIT;
    const i64 group = blockIdx.y;
    const i64 r0 = group * rows_per_group;
    const i64 r1 = min(rows, r0 + rows_per_group);
    const bool vec = h % UNIT == 0 && aligned16(s) && aligned16(dy);
    double dw[UNIT], db[UNIT];
#pragma unroll
    for (int k = 0; k < UNIT; ++k) dw[k] = db[k] = 0.0;
    if (col0 < h) {
#pragma unroll 2
        for (i64 row = r0 + ty; row < r1; row += NW_LANES) {
            float d[UNIT], xv[UNIT];
            if (vec) {
                load8(dy + row * h + col0, d);
                load8(s + row * h + col0, xv);
            } else {
#pragma unroll
                for (int k = 0; k < UNIT; ++k) {
                    const bool in = col0 + k < h;
                    d[k] = in ? to_f32(dy[row * h + col0 + k]) : 0.0f;
                    xv[k] = in ? to_f32(s[row * h + col0 + k]) : 0.0f;
                }
            }
            const float r = rstd[row];
            const float m = RMS ? 0.0f : mean[row];
#pragma unroll
            for (int k = 0; k < UNIT; ++k) {
                const float xhat = RMS ? xv[k] * r : (xv[k] - m) * r;
                dw[k] += double(d[k]) * double(xhat);
                db[k] += double(d[k]);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < UNIT; ++k) {
        dw_lanes[ty][lane * UNIT + k] = dw[k];
        db_lanes[ty][lane * UNIT + k] = db[k];
    }
    __syncthreads();
    // The block's NW_COLS * UNIT columns, a thread each: its NW_LANES partials in the order
    // t = 0..7.
    const int j = ty * NW_COLS + lane, col = blockIdx.x * NW_COLS * UNIT + j;
    if (col < h) {
        double w_sum = dw_lanes[0][j], b_sum = db_lanes[0][j];
        for (int t = 1; t < NW_LANES; ++t) {
            w_sum += dw_lanes[t][j];
            b_sum += db_lanes[t][j];
        }
        dw_part[group * h + col] = w_sum;
        if (!RMS) db_part[group * h + col] = b_sum;
    }
    // Stage two, in the column block's last group to finish.
    if (!last_to_arrive(&done[blockIdx.x], gridDim.y)) return;
    double(*lanes)[NW_COLS] = reinterpret_cast<double(*)[NW_COLS]>(&dw_lanes[0][0]);
    const i64 first = i64(blockIdx.x) * NW_COLS * UNIT;
    if (dw_out != nullptr) {
        sum_column_groups(dw_part, gridDim.y, h, first, NW_COLS * UNIT, lanes,
                          [&](i64 c, double t) { dw_out[c] = float(t); });
    }
    if (!RMS && db_out != nullptr) {
        sum_column_groups(db_part, gridDim.y, h, first, NW_COLS * UNIT, lanes,
                          [&](i64 c, double t) { db_out[c] = float(t); });
    }
}

#define NORM(TI, TO, io)                                                                       \
    extern "C" __global__ void __launch_bounds__(NORM_ROW_THREADS) layer_norm_fwd_##io(        \
        const TI* x, const TO* x_low, const TI* res, TI* sum_out, const float* w,              \
        const float* b, TO* y, float* mean_out, float* rstd_out, i64 rows, int h, double eps) { \
        norm_fwd<TI, TO, false, false>(x, x_low, res, sum_out, w, b, y, mean_out, rstd_out,    \
                                       nullptr, nullptr, nullptr, rows, h, eps);               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_ROW_THREADS) rms_norm_fwd_##io(          \
        const TI* x, const TO* x_low, const TI* res, TI* sum_out, const float* w, TO* y,       \
        float* rstd_out, i64 rows, int h, double eps) {                                        \
        norm_fwd<TI, TO, true, false>(x, x_low, res, sum_out, w, nullptr, y, nullptr,          \
                                      rstd_out, nullptr, nullptr, nullptr, rows, h, eps);      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_ROW_THREADS) layer_norm_bwd_##io(        \
        const TI* s, const TO* dy, const float* w, const float* mean, const float* rstd,       \
        const TI* dadd, TI* dx, TO* dx_low, i64 rows, int h) {                                 \
        norm_bwd<TI, TO, false>(s, dy, w, mean, rstd, dadd, dx, dx_low, rows, h);              \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_ROW_THREADS) rms_norm_bwd_##io(          \
        const TI* s, const TO* dy, const float* w, const float* rstd, const TI* dadd, TI* dx,  \
        TO* dx_low, i64 rows, int h) {                                                         \
        norm_bwd<TI, TO, true>(s, dy, w, nullptr, rstd, dadd, dx, dx_low, rows, h);            \
    }                                                                                          \
    extern "C" __global__ void layer_norm_bwd_weight_##io(                                     \
        const TI* s, const TO* dy, const float* mean, const float* rstd, double* dw_part,      \
        double* db_part, float* dw, float* db, int* done, i64 rows, int h,                     \
        int rows_per_group) {                                                                  \
        norm_bwd_weight<TI, TO, false>(s, dy, mean, rstd, dw_part, db_part, dw, db, done,      \
                                       rows, h, rows_per_group);                               \
    }                                                                                          \
    extern "C" __global__ void rms_norm_bwd_weight_##io(                                       \
        const TI* s, const TO* dy, const float* rstd, double* dw_part, float* dw, int* done,   \
        i64 rows, int h, int rows_per_group) {                                                 \
        norm_bwd_weight<TI, TO, true>(s, dy, nullptr, rstd, dw_part, nullptr, dw, nullptr,     \
                                      done, rows, h, rows_per_group);                          \
    }

CASTOR_FOR_EACH_IO(NORM)

#define NORM_FP8(TI, TO, io)                                                                   \
    extern "C" __global__ void __launch_bounds__(NORM_ROW_THREADS) layer_norm_fwd_fp8_##io(    \
        const TI* x, const TO* x_low, const TI* res, TI* sum_out, const float* w,              \
        const float* b, TO* y, float* mean_out, float* rstd_out, const float* scale,           \
        unsigned char* q, float* partials, i64 rows, int h, double eps) {                      \
        norm_fwd<TI, TO, false, true>(x, x_low, res, sum_out, w, b, y, mean_out, rstd_out,     \
                                      scale, q, partials, rows, h, eps);                       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_ROW_THREADS) rms_norm_fwd_fp8_##io(      \
        const TI* x, const TO* x_low, const TI* res, TI* sum_out, const float* w, TO* y,       \
        float* rstd_out, const float* scale, unsigned char* q, float* partials, i64 rows,      \
        int h, double eps) {                                                                   \
        norm_fwd<TI, TO, true, true>(x, x_low, res, sum_out, w, nullptr, y, nullptr, rstd_out, \
                                     scale, q, partials, rows, h, eps);                        \
    }

CASTOR_FOR_EACH_IO(NORM_FP8)
