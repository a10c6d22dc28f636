// softmax.cu: softmax over the last axis with the causal mask and a boolean padding mask or
// packed sequences' positions, and its backward.
//
// Forward, one block per row (grid-stride over rows):
//   softmax_fwd_<io>(x, y, rows, tk, tq, heads, causal, window, mask, positions, msb, msh, msq,
//                    msk)
//     x, y: [B, heads, tq, tk] (any leading shape folded into B and heads; rows = B*heads*tq).
//     causal != 0: query q (row % tq) sees keys j <= q + tk - tq; window > 0 (with causal, a
//     sliding window) narrows that to the last `window` of them, j > q + tk - tq - window.
//     mask (nullable): bytes, nonzero = keep, broadcast over x through element strides
//     (msb, msh, msq, msk), 0 along broadcast axes: the keep bit of (b, h, q, j) is
//     mask[b*msb + h*msh + q*msq + j*msk].
//     positions (nullable; with causal, the lowering passes it or mask, not both): i64, each
//     key's position in its own packed sequence, through the same strides (msq is 0: one row
//     of tk per (b, h)). Query q, whose own key is a = q + tk - tq, sees only keys
//     j >= a - clamp(pos[a], 0, a), the start of its sequence (a malformed position never
//     reaches before the row); with a window, the later of the two starts. Such a row always
//     sees its own key.
//     Masked and causally hidden entries get exactly 0. A row with every key masked (or hidden)
//     becomes uniform, 1/tk over the whole row, as the CPU executor and HF's finite mask give.
// Backward, one block per row:
//   softmax_bwd_<io>(y, dy, dx, rows, n): dx = y * (dy - sum(dy * y)), the sum in F64 (as the
//   CPU twin; PyTorch's _softmax_backward_data in F32). Masked entries have y = 0, so dx = 0.
// Dtypes: <io> = input dtype TI (x, dx) and output dtype TO (y, dy); suffix as in norm.cu.
// Rounding points, as runtime/src/cpu/softmax.rs: the max over kept entries (NaN-propagating),
// e = exp(x - max) in F32, the sum of e in F64, inv = F32(1 / sum) and y = TO(e * inv). The
// exponential is CUDA's expf (within 2 ulp) where the CPU uses a Cephes expf (within 2 ulp):
// y may differ by an ulp of F32 before its rounding to TO.
// Memory: when a row fits the block's registers (tk a multiple of 8, at most 8 per thread, x
// and y 16-byte aligned: attention rows up to 8 x blockDim.x keys), the forward reads x once
// with 16-byte loads, thread t holding elements 8t..8t+7, and writes y from the registers;
// the first GPU profile measured the element-by-element path below at 427 us for GPT-2's
// [8, 12, 1024, 1024] BF16 scores, over three times what one read and one write take. Other
// rows read x three times (max, sum, write), the second and third from L1/L2, with coalesced
// scalar loads (masks and causal limits make rows ragged). The two paths add the F64 sum in
// different orders (its rounding points are the same). The backward uses 16-byte vectors
// when the rows are aligned.
// Launch: blockDim.x a multiple of 32, at most 1024 (128 suits tk <= 2048).
#include "castor_common.cuh"

// One row of tk <= 8 * blockDim.x elements (tk a multiple of 8, x and y 16-byte aligned):
// thread t loads elements 8t..8t+7 once and keeps them; the rounding points of the path below.
// Every thread reads only the elements it writes, so y may be x.
template <typename TI, typename TO, typename Keep>
__device__ __forceinline__ void softmax_row_in_registers(const TI* xr, TO* yr, int tk, Keep keep,
                                                         float* fscratch, double* dscratch,
                                                         int* iscratch) {
    const int j0 = threadIdx.x * UNIT;
    const bool mine = j0 < tk;
    float v[UNIT];
    bool k[UNIT];
    float m = F32_NEG_INF;
    int kept = 0;
    if (mine) load8(xr + j0, v);
#pragma unroll
    for (int i = 0; i < UNIT; ++i) {
        k[i] = mine && keep(j0 + i);
        if (k[i]) {
            m = max_nan(m, v[i]);
            kept = 1;
        }
    }
    m = block_max(m, fscratch);
    kept = block_sum(kept, iscratch);
    if (kept == 0) {
        const float uniform = 1.0f / float(tk);
#pragma unroll
        for (int i = 0; i < UNIT; ++i) v[i] = uniform;
        if (mine) store8(yr + j0, v);
        return;
    }
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < UNIT; ++i) {
        v[i] = k[i] ? expf(v[i] - m) : 0.0f;
        if (k[i]) s += double(v[i]);
    }
    const float inv = float(1.0 / block_sum(s, dscratch));
#pragma unroll
    for (int i = 0; i < UNIT; ++i) v[i] = k[i] ? v[i] * inv : 0.0f;
    if (mine) store8(yr + j0, v);
}

template <typename TI, typename TO>
__device__ __forceinline__ void softmax_fwd(const TI* x, TO* y, i64 rows, int tk, int tq, int heads,
                                            int causal, int window,
                                            const unsigned char* __restrict__ mask,
                                            const i64* __restrict__ positions, i64 msb, i64 msh,
                                            i64 msq, i64 msk) {
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    __shared__ int iscratch[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const int q = int(row % tq);
        const i64 bh = row / tq;
        const i64 hh = bh % heads, bb = bh / heads;
        const TI* xr = x + row * tk;
        TO* yr = y + row * tk;
        const i64 at = bb * msb + hh * msh + i64(q) * msq;
        const unsigned char* mr = mask ? mask + at : nullptr;
        int visible = tk;
        if (causal) visible = max(0, min(tk, q + 1 + tk - tq));
        int first = window > 0 ? max(0, visible - window) : 0;
        // The start of the packed sequence of the row's own key a (none before the keys).
        const int a = q + tk - tq;
        if (positions != nullptr && a >= 0)
            first = max(first, a - int(min(max(positions[at + i64(a) * msk], i64(0)), i64(a))));
        auto keep = [&](int j) {
            return j >= first && j < visible && (mr == nullptr || mr[i64(j) * msk] != 0);
        };
        if (tk % UNIT == 0 && tk <= nt * UNIT && aligned16(xr) && aligned16(yr)) {
            softmax_row_in_registers(xr, yr, tk, keep, fscratch, dscratch, iscratch);
            continue;
        }

        float m = F32_NEG_INF;
        int kept = 0;
        for (int j = first + tid; j < visible; j += nt) {
            if (keep(j)) {
                m = max_nan(m, to_f32(xr[j]));
                kept = 1;
            }
        }
        m = block_max(m, fscratch);
        kept = block_sum(kept, iscratch);
        if (kept == 0) {
            const float uniform = 1.0f / float(tk);
            for (int j = tid; j < tk; j += nt) yr[j] = from_f32<TO>(uniform);
            continue;
        }
        double s = 0.0;
        for (int j = first + tid; j < visible; j += nt)
            if (keep(j)) s += double(expf(to_f32(xr[j]) - m));
        const float inv = float(1.0 / block_sum(s, dscratch));
        // Reads of this row by other threads finished before the reductions' barriers, so
        // y may be x (in place, same dtype).
        for (int j = tid; j < tk; j += nt)
            yr[j] = from_f32<TO>(keep(j) ? expf(to_f32(xr[j]) - m) * inv : 0.0f);
    }
}

template <typename TI, typename TO>
__device__ __forceinline__ void softmax_bwd(const TO* __restrict__ y, const TO* dy, TI* dx,
                                            i64 rows, int n) {
    __shared__ double scratch[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const TO* yr = y + row * n;
        const TO* dyr = dy + row * n;
        TI* dxr = dx + row * n;
        const bool vec = aligned16(yr) && aligned16(dyr) && aligned16(dxr);
        const int units = vec ? n / UNIT : 0;
        const int tail = units * UNIT;
        double acc = 0.0;
        for (int u = tid; u < units; u += nt) {
            float a[UNIT], b[UNIT];
            load8(yr + u * UNIT, a);
            load8(dyr + u * UNIT, b);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) acc += double(a[k]) * double(b[k]);
        }
        for (int j = tail + tid; j < n; j += nt) acc += double(to_f32(yr[j])) * double(to_f32(dyr[j]));
        const float dot = float(block_sum(acc, scratch));
        for (int u = tid; u < units; u += nt) {
            float a[UNIT], b[UNIT];
            load8(yr + u * UNIT, a);
            load8(dyr + u * UNIT, b);
#pragma unroll
            for (int k = 0; k < UNIT; ++k) b[k] = a[k] * (b[k] - dot);
            store8(dxr + u * UNIT, b);
        }
        for (int j = tail + tid; j < n; j += nt)
            dxr[j] = from_f32<TI>(to_f32(yr[j]) * (to_f32(dyr[j]) - dot));
    }
}

#define SOFTMAX(TI, TO, io)                                                                    \
    extern "C" __global__ void softmax_fwd_##io(const TI* x, TO* y, i64 rows, int tk, int tq,  \
                                                int heads, int causal, int window,             \
                                                const unsigned char* mask,                     \
                                                const i64* positions, i64 msb, i64 msh,        \
                                                i64 msq, i64 msk) {                            \
        softmax_fwd<TI, TO>(x, y, rows, tk, tq, heads, causal, window, mask, positions, msb,   \
                            msh, msq, msk);                                                    \
    }                                                                                          \
    extern "C" __global__ void softmax_bwd_##io(const TO* y, const TO* dy, TI* dx, i64 rows,   \
                                                int n) {                                       \
        softmax_bwd<TI, TO>(y, dy, dx, rows, n);                                               \
    }

CASTOR_FOR_EACH_IO(SOFTMAX)
