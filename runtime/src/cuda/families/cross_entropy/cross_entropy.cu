// cross_entropy.cu: fused log-softmax + negative log-likelihood over large vocabularies, and
// its backward, without materializing probabilities.
//
// Forward, one block per row of logits [rows, v], row r at logits + r * ld (ld >= v: the fused
// classifier pads its chunk's rows to a multiple of 64 elements so that every row, and every
// operand of the cuBLAS products around it, is 16-byte aligned; the eager loss passes v). The
// forward reads only the first v of each row:
//   cross_entropy_fwd_<t>(logits, labels, rows, v, ld, ignore_index, row_loss, row_max, row_inv,
//                         bad)
//     Two passes over the row: M = the row's max (NaN-propagating), then
//     S = sum of F32 expf(x - M) in F64. row_loss[r] = log(S) + M - x[label] in F64 (0 on
//     ignored rows, NaN on a bad label); row_max[r] = M and row_inv[r] = F32(1 / S) are kept
//     for the backward (nullable).
//     labels are i64; ignore_index is -100 for PyTorch's default. A label outside [0, v) that
//     is not ignore_index lowers *bad (initialized by the host to INT_MAX) to its row.
//   cross_entropy_finalize(row_loss, labels, rows, ignore_index, loss, count), one block:
//     count = number of rows whose label is not ignore_index; loss = F32(sum(row_loss) / count)
//     with the sum in F64 in a fixed order; 0 / 0 = NaN when no row counts (PyTorch's mean).
// Backward, one block per row:
//   cross_entropy_bwd_<t>(logits, labels, rows, v, ld, ignore_index, row_max, row_inv, dloss,
//                         count, dlogits)
//     scale = *dloss / F32(*count) (device scalars, so the step needs no host sync);
//     dlogits = T((exp(x - M) * inv) * scale - scale * onehot(label)) on counted rows, 0 on
//     ignored rows (so with every row ignored the gradient is all zeros), NaN on bad labels.
//     row_max/row_inv null: the block recomputes them with the forward's two passes. dlogits
//     has the logits' row stride ld and may be logits (in place); the padding past v in each
//     row is written 0 (the fused classifier's input-gradient product reads all ld columns).
// Dtypes: <t> is the logits' and dlogits' storage dtype; arithmetic F32, sums F64.
// Rounding points: those of runtime/src/cpu/loss.rs (log_sum_exp, cross_entropy_grad), so with
// the same expf (the host build's, castor_host.h; CUDA's is within 2 ulp of it) the results are
// the CPU twin's; only the F64 sum of S adds in another order (a block tree here,
// eight lanes there: ~1e-16 relative, below F32 resolution). Why two passes rather than one
// online (max, sum) pass that rescales: the rescaling changes which F32 exponentials are
// summed, so S would differ from the CPU twin's by ~1e-7 relative, and through AdamW's
// normalization such differences in near-zero gradients become differences of the order of
// the learning rate in the weights. The second pass reads a row one block just read (mostly
// from L2: a 50k-vocabulary BF16 row is 100 KB).
// Launch: blockDim.x a multiple of 32, at most 1024 (512 or 1024 for v ~ 50k-150k).
#include "castor_common.cuh"

// The row's max M (NaN-propagating) and S = sum of F32 expf(x - M), in F64, over the block;
// every thread gets both.
template <typename T>
__device__ __forceinline__ void row_stats(const T* row, int v, float& M, double& S,
                                          float* fscratch, double* dscratch) {
    const int tid = threadIdx.x, nt = blockDim.x;
    const int units = aligned16(row) ? v / UNIT : 0;
    float m = F32_NEG_INF;
    for (int u = tid; u < units; u += nt) {
        float x[UNIT];
        load8(row + u * UNIT, x);
#pragma unroll
        for (int k = 0; k < UNIT; ++k) m = max_nan(m, x[k]);
    }
    for (int j = units * UNIT + tid; j < v; j += nt) m = max_nan(m, to_f32(row[j]));
    M = block_max(m, fscratch);
    double s = 0.0;
    for (int u = tid; u < units; u += nt) {
        float x[UNIT];
        load8(row + u * UNIT, x);
#pragma unroll
        for (int k = 0; k < UNIT; ++k) s += double(expf(x[k] - M));
    }
    for (int j = units * UNIT + tid; j < v; j += nt) s += double(expf(to_f32(row[j]) - M));
    S = block_sum(s, dscratch);
}

__device__ __forceinline__ bool label_ok(i64 label, int v) { return label >= 0 && label < v; }

template <typename T>
__device__ __forceinline__ void ce_fwd(const T* __restrict__ logits, const i64* __restrict__ labels,
                                       i64 rows, int v, i64 ld, i64 ignore_index,
                                       double* row_loss, float* row_max, float* row_inv,
                                       int* bad) {
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 label = labels[row];
        if (label == ignore_index || !label_ok(label, v)) {
            if (threadIdx.x == 0) {
                if (label != ignore_index) report_bad(bad, row);
                row_loss[row] = label == ignore_index ? 0.0 : __longlong_as_double(0x7ff8000000000000ll);
                if (row_max) row_max[row] = 0.0f;
                if (row_inv) row_inv[row] = 0.0f;
            }
            continue;
        }
        const T* xr = logits + row * ld;
        float M;
        double S;
        row_stats(xr, v, M, S, fscratch, dscratch);
        if (threadIdx.x == 0) {
            row_loss[row] = log(S) + double(M) - double(to_f32(xr[label]));
            if (row_max) row_max[row] = M;
            if (row_inv) row_inv[row] = float(1.0 / S);
        }
    }
}

extern "C" __global__ void cross_entropy_finalize(const double* __restrict__ row_loss,
                                                  const i64* __restrict__ labels, i64 rows,
                                                  i64 ignore_index, float* loss, int* count) {
    __shared__ double dscratch[32];
    __shared__ i64 iscratch[32];
    double s = 0.0;
    i64 c = 0;
    for (i64 r = threadIdx.x; r < rows; r += blockDim.x) {
        if (labels[r] != ignore_index) {
            s += row_loss[r];
            c += 1;
        }
    }
    s = block_sum(s, dscratch);
    c = block_sum(c, iscratch);
    if (threadIdx.x == 0) {
        *loss = float(s / double(c));
        *count = int(c);
    }
}

template <typename T>
__device__ __forceinline__ void ce_bwd(const T* logits, const i64* __restrict__ labels, i64 rows,
                                       int v, i64 ld, i64 ignore_index, const float* row_max,
                                       const float* row_inv, const float* dloss, const int* count,
                                       T* dlogits) {
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    const float scale = *dloss / float(*count);
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 label = labels[row];
        const T* xr = logits + row * ld;
        T* dr = dlogits + row * ld;
        for (i64 j = v + tid; j < ld; j += nt) dr[j] = from_f32<T>(0.0f);
        const bool vec = aligned16(xr) && aligned16(dr);
        const int units = vec ? v / UNIT : 0;
        if (label == ignore_index || !label_ok(label, v)) {
            const float fill = label == ignore_index ? 0.0f : __int_as_float(0x7fc00000);
            float z[UNIT];
#pragma unroll
            for (int k = 0; k < UNIT; ++k) z[k] = fill;
            for (int u = tid; u < units; u += nt) store8(dr + u * UNIT, z);
            for (int j = units * UNIT + tid; j < v; j += nt) dr[j] = from_f32<T>(fill);
            continue;
        }
        float M, inv;
        if (row_max && row_inv) {
            M = row_max[row];
            inv = row_inv[row];
        } else {
            double S;
            row_stats(xr, v, M, S, fscratch, dscratch);
            inv = float(1.0 / S);
        }
        for (int u = tid; u < units; u += nt) {
            const int j0 = u * UNIT;
            float x[UNIT];
            load8(xr + j0, x);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) {
                x[k] = expf(x[k] - M) * inv * scale;
                if (j0 + k == label) x[k] -= scale;
            }
            store8(dr + j0, x);
        }
        for (int j = units * UNIT + tid; j < v; j += nt) {
            float p = expf(to_f32(xr[j]) - M) * inv * scale;
            if (j == label) p -= scale;
            dr[j] = from_f32<T>(p);
        }
    }
}

#define CROSS_ENTROPY(T, t)                                                                    \
    extern "C" __global__ void cross_entropy_fwd_##t(const T* logits, const i64* labels,       \
                                                     i64 rows, int v, i64 ld,                  \
                                                     i64 ignore_index, double* row_loss,       \
                                                     float* row_max, float* row_inv,           \
                                                     int* bad) {                               \
        ce_fwd<T>(logits, labels, rows, v, ld, ignore_index, row_loss, row_max, row_inv, bad); \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_bwd_##t(                                          \
        const T* logits, const i64* labels, i64 rows, int v, i64 ld, i64 ignore_index,         \
        const float* row_max, const float* row_inv, const float* dloss, const int* count,      \
        T* dlogits) {                                                                          \
        ce_bwd<T>(logits, labels, rows, v, ld, ignore_index, row_max, row_inv, dloss, count,   \
                  dlogits);                                                                    \
    }

CASTOR_FOR_EACH_T(CROSS_ENTROPY)
