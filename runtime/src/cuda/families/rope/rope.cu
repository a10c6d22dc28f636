// rope.cu: rotary position embedding (rotate-half layout, LLaMA/HF), forward and backward.
//
// Entry points:
//   rope_table(cs [t, d/2] float2, t, d, theta): (cos, sin) of angle = pos * inv_freq[i],
//     inv_freq[i] = 1 / theta_f32^(2i / d), all in F32 as HF's LlamaRotaryEmbedding computes
//     them. Built once per plan (constant); the executor may instead upload the CPU twin's
//     table (runtime/src/cpu/rope.rs) for bit-identical angles: CUDA's powf/sincosf are within
//     a few ulp of the host libm's, not always equal.
//   rope_fwd_<t>(x, y, cs, positions, batches, t, d, heads, x_batch, x_head, x_row, y_batch,
//                y_head, y_row, positions_batch, positions_head, positions_row): x, y
//     [batches, t, d] (batches = the leading dims); row p of batch b starts at
//     (b / heads) X_batch + (b % heads) X_head + p X_row, so that a head read from a
//     [B, T, H, d] product or written into one is used in place (dense: (heads t d, t d, d));
//       y[i]       = x[i] cos - x[i + d/2] sin
//       y[i + d/2] = x[i + d/2] cos + x[i] sin            (i < d/2)
//     at the angles of position p, or, with positions (nullable, i64: packed sequences, each
//     restarting at 0), of position positions[(b / heads) positions_batch + (b % heads)
//     positions_head + p positions_row] (0 strides broadcast, e.g. one row of positions per
//     sequence shared by its heads).
//   rope_bwd_<t>(dy, dx, cs, positions, batches, t, d, heads, <dy, dx, positions strides>): the
//     transpose (rotation by the negated angle),
//       dx[i] = dy[i] cos + dy[i + d/2] sin, dx[i + d/2] = dy[i + d/2] cos - dy[i] sin.
// The table holds positions 0..t, so packed positions are looked up, not computed: the angles
// stay the CPU twin's bit for bit (CUDA's sincosf is not the host's). A packed sequence fits
// in its row of t, so its positions lie in 0..t; a position outside (data no packing makes) is
// clamped into 0..t - 1, as the CPU twin clamps it.
// Fuses: the rotation of both halves with one read and one write of each element.
// Dtypes: <t> storage dtype of x/y (dy/dx); the table is F32. Rounding: the rotation in F32
// from F32 cos/sin, rounded once to <t>, as the CPU twin (HF rounds cos/sin to the activation
// dtype and after each multiply and add; castor rounds once).
// In place is allowed (y == x, same strides): each thread reads both elements of its pair
// before writing.
// Launch: any grid and block (every loop is grid-stride). Best as the lowering launches it:
// block (lanes, 256 / lanes), threadIdx.x over a row's pairs, or over its 16-byte vectors
// where every row of both operands is 16-byte aligned and d/2 a multiple of 8 (consecutive
// threads take consecutive elements, so both halves are read coalesced), threadIdx.y over
// positions; grid x over blocks of positions, y over the rows / t batches. A row's start is
// computed once per (batch, position) in 32-bit arithmetic: no 64-bit division runs per
// element (the H100 profile of 2026-11-28 had the per-element form at 3.2x its memory
// roofline; one pair per thread was 4.0x on the 2026-11-30 H200 profile).
#include "castor_common.cuh"

extern "C" __global__ void rope_table(float2* __restrict__ cs, int t, int d, double theta) {
    const int half = d / 2;
    const float base = float(theta);
    const i64 total = i64(t) * half;
    for (i64 idx = i64(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += i64(gridDim.x) * blockDim.x) {
        const int pos = int(idx / half), i = int(idx % half);
        const float inv_freq = 1.0f / powf(base, float(2 * i) / float(d));
        const float angle = float(pos) * inv_freq;
        float s, c;
        sincosf(angle, &s, &c);
        cs[idx] = make_float2(c, s);
    }
}

// Where row `pos` of batch `outer * heads + head` of an operand starts: (batch, head, row)
// strides.
struct RopeStrides {
    int batch, head, row;
    __device__ __forceinline__ i64 at(int outer, int h, int pos) const {
        return i64(outer) * batch + i64(h) * head + i64(pos) * row;
    }
    // Whether every row of an operand at `p` with these strides starts 16-byte aligned.
    template <typename T> __device__ __forceinline__ bool aligned(const T* p) const {
        const i64 bytes = i64(sizeof(T));
        return aligned16(p) && (batch * bytes) % 16 == 0 && (head * bytes) % 16 == 0 &&
               (row * bytes) % 16 == 0;
    }
};

// The rotation of one pair (x1 = x[i], x2 = x[i + d/2]) by (c, s), or by its negation.
template <bool BWD>
__device__ __forceinline__ void rotate(float x1, float x2, float c, float s, float& y1,
                                       float& y2) {
    if (BWD) {
        y1 = x1 * c + x2 * s;
        y2 = x2 * c - x1 * s;
    } else {
        y1 = x1 * c - x2 * s;
        y2 = x2 * c + x1 * s;
    }
}

template <typename T, bool BWD>
__device__ __forceinline__ void rope(const T* x, T* y, const float2* __restrict__ cs,
                                     const i64* __restrict__ positions, int batches, int t,
                                     int d, int heads, RopeStrides sx, RopeStrides sy,
                                     RopeStrides sp) {
    const int half = d / 2;
    // Whole rows in 16-byte vectors (UNIT elements of each half per thread), where both halves
    // of every row of x and y are aligned (uniform across the grid): twice to eight times the
    // bytes in flight of one pair per thread. Else one pair per thread.
    const bool vec = half % UNIT == 0 && sx.aligned(x) && sy.aligned(y);
    for (int b = blockIdx.y; b < batches; b += gridDim.y) {
        const int outer = b / heads, h = b % heads;
        for (int pos = blockIdx.x * blockDim.y + threadIdx.y; pos < t;
             pos += gridDim.x * blockDim.y) {
            int at = pos;
            if (positions != nullptr)
                at = int(min(max(positions[sp.at(outer, h, pos)], i64(0)), i64(t - 1)));
            const float2* table = cs + i64(at) * half;
            const T* xr = x + sx.at(outer, h, pos);
            T* yr = y + sy.at(outer, h, pos);
            if (vec) {
                for (int i = threadIdx.x * UNIT; i < half; i += blockDim.x * UNIT) {
                    float x1[UNIT], x2[UNIT], y1[UNIT], y2[UNIT];
                    load8(xr + i, x1);
                    load8(xr + i + half, x2);
#pragma unroll
                    for (int k = 0; k < UNIT; ++k) {
                        const float2 a = table[i + k];
                        rotate<BWD>(x1[k], x2[k], a.x, a.y, y1[k], y2[k]);
                    }
                    store8(yr + i, y1);
                    store8(yr + i + half, y2);
                }
                continue;
            }
            for (int i = threadIdx.x; i < half; i += blockDim.x) {
                const float2 a = table[i];
                float y1, y2;
                rotate<BWD>(to_f32(xr[i]), to_f32(xr[i + half]), a.x, a.y, y1, y2);
                yr[i] = from_f32<T>(y1);
                yr[i + half] = from_f32<T>(y2);
            }
        }
    }
}

#define ROPE(T, t)                                                                             \
    extern "C" __global__ void rope_fwd_##t(                                                   \
        const T* x, T* y, const float2* cs, const i64* positions, int batches, int t, int d,   \
        int heads, int x_batch, int x_head, int x_row, int y_batch, int y_head, int y_row,     \
        int positions_batch, int positions_head, int positions_row) {                          \
        rope<T, false>(x, y, cs, positions, batches, t, d, heads,                              \
                       RopeStrides{x_batch, x_head, x_row}, RopeStrides{y_batch, y_head, y_row}, \
                       RopeStrides{positions_batch, positions_head, positions_row});           \
    }                                                                                          \
    extern "C" __global__ void rope_bwd_##t(                                                   \
        const T* dy, T* dx, const float2* cs, const i64* positions, int batches, int t, int d, \
        int heads, int dy_batch, int dy_head, int dy_row, int dx_batch, int dx_head,           \
        int dx_row, int positions_batch, int positions_head, int positions_row) {              \
        rope<T, true>(dy, dx, cs, positions, batches, t, d, heads,                             \
                      RopeStrides{dy_batch, dy_head, dy_row},                                  \
                      RopeStrides{dx_batch, dx_head, dx_row},                                  \
                      RopeStrides{positions_batch, positions_head, positions_row});            \
    }

CASTOR_FOR_EACH_T(ROPE)
