// reduce.cu: sum, mean and max over the middle axis of x viewed as [outer, len, inner].
//
// Fuses: the reduction, the mean's division and the output's rounding; one read of x.
// Entry points: reduce_<op>_<io>(const TI* x, TO* y, i64 outer, i64 len, i64 inner), op in
// sum, mean, max; x contiguous [outer, len, inner], y contiguous [outer, inner]:
//   y[o, c] = op over r < len of x[o, r, c].
// Dtypes: <io> every pair of input dtype TI and output dtype TO in f32, f16, bf16: the dtype's
// suffix when they are the same (reduce_sum_bf16), <ti>_<to> otherwise (reduce_sum_bf16_f32,
// reduce_max_f16_bf16): 27 kernels.
// Rounding points, as the CPU twin (runtime/src/cpu/reduce.rs, reduce_rows for inner == 1 and
// reduce_columns otherwise): inputs widen to F32 exactly; sum and mean accumulate in F64, sum
// = F32(total), mean = F32(total / len) with the division in F64; max is F32; the result is
// rounded once more to TO (nearest, ties to even), as the CPU stores its F32 result. len == 0:
// sum gives 0, mean NaN (max over an empty axis has no value; if launched it gives -inf).
//   Max reproduces the CPU's fold exactly, ties included (NaN if any element is NaN, and the
//   same NaN; among equal maxima such as -0.0 and +0.0, the same one): each element carries
//   its position in the CPU's fold order (the row index for reduce_columns; for reduce_rows,
//   math::max's order: the tail after the last whole 8-element chunk first, then lane 0's
//   elements 0, 8, 16, ..., lane 1's, ...), and partials combine as the fold would: the NaN
//   earliest in that order, else the largest value, the latest in that order among equals.
//   That combination is order-free, so the result is the CPU's bit for bit.
//   The F64 sums add in another order than the CPU (eight strided partials here, one running
//   sum per column there; a 256-thread tree here, eight lanes there for rows): the totals agree
//   to ~1e-16 relative, and the F32 results differ only when a total falls within that of an
//   F32 rounding boundary.
// Launch (the host must follow it exactly; the kernels are written for this block shape):
//   block (32, 8, 1), grid (min(ceil(inner / 32), 65535), min(outer, 65535), 1), no dynamic
//   shared memory. Nothing to launch when outer * inner == 0.
//   inner > 1, columns: block (bx, by) takes column groups c0 = 32 bx, 32 (bx + gridDim.x), ...
//     of outer rows o = by, by + gridDim.y, ...; lane threadIdx.x owns column c0 + threadIdx.x
//     and its 8 threads threadIdx.y = t take rows t, t + 8, t + 16, ... in order; the 8
//     partials are combined in shared memory in the order t = 0..7. Loads are coalesced across
//     the 32 lanes (one row segment of 32 columns per warp step).
//   inner == 1, rows: all 256 threads of a block (t = 32 threadIdx.y + threadIdx.x) share one
//     row, thread t taking elements t, t + 256, ... (when the row is 16-byte aligned: 8-element
//     units t, t + 256, ... with 16-byte loads, then the tail after the last whole unit), then
//     a warp shuffle tree and the 8 warps' partials in order; block (bx, by) takes rows by + gridDim.y bx, then steps of
//     gridDim.x * gridDim.y.
//   Either way each output's arithmetic is fixed by the block shape alone: results are
//   deterministic and independent of the grid size.
//
// Column sums and means in two stages, for a column reduction whose one-stage grid is too
// small to keep a GPU's memory busy (a bias gradient: 8192 rows of 768 columns are 24 blocks
// above): the rows split into groups, each summed per column into an F64 partial, then the
// groups' partials summed per column, in one launch. No float atomics: the grouping comes
// from the shape alone (the lowering's `rows_per_group`), so the result is the same on every
// device and run.
//   reduce_grouped_<op>_<io>(const TI* x, double* part, TO* y, int* done, i64 outer, i64 len,
//                            i64 inner, i64 rows_per_group), op in sum, mean:
//     stage one: part[(o * groups + g) * inner + c] = sum over rows r of group g
//     (rows_per_group rows from g * rows_per_group) of x[o, r, c], groups = max(1,
//     ceil(len / rows_per_group)). Block (32, 8, 1), grid exactly (ceil(inner / 256), groups,
//     outer), each at most 65535: block (bx, g, o); lane threadIdx.x owns 8 consecutive
//     columns (one 16-byte load a row where inner is a multiple of 8 and x is 16-byte aligned,
//     else 8 scalar loads: the same sums either way), its 8 threads threadIdx.y = t take the
//     group's rows t, t + 8, ... in order, and the 8 partials are combined in shared memory in
//     the order t = 0..7.
//     stage two, by the last of the groups of (o, bx) to store its partials (done[o *
//     gridDim.x + bx] counts them: zero before the launch, and that block sets it back to
//     zero): y[o, c] = finish(sum over g of part[(o * groups + g) * inner + c]) for the block's
//     256 columns, 32 at a time, thread t of a column summing groups t, t + 8, ... in order,
//     the 8 sums added in the order t = 0..7 (the mean divides the F64 total by len).
//   Rounding: as the one-stage sums (inputs widen exactly, F64 totals rounded once to F32
//   and once more to TO), in another grouping of the same F64 additions.
#include "castor_common.cuh"

#define RW 32               // lanes: columns per block
#define RH 8                // threads per column
#define RT (RW * RH)        // threads per block

// The F64 sum of a partition.
struct SumAcc {
    double s;
    __device__ __forceinline__ void init() { s = 0.0; }
    __device__ __forceinline__ void add(float v, i64) { s += double(v); }
    __device__ __forceinline__ void merge(const SumAcc& o) { s += o.s; }
    __device__ __forceinline__ SumAcc shfl_xor(int lane_mask) const {
        return SumAcc{__shfl_xor_sync(0xffffffffu, s, lane_mask)};
    }
};

// The max of a partition and the CPU fold position `ord` of the element it is (-1: none yet).
struct MaxAcc {
    float v;
    i64 ord;
    __device__ __forceinline__ void init() {
        v = F32_NEG_INF;
        ord = -1;
    }
    // The CPU's max2 fold, made order-free: the earliest NaN; else the largest value, the
    // latest among equals (max2(a, b) keeps b unless a > b or a is NaN).
    __device__ __forceinline__ void merge(const MaxAcc& o) {
        const bool a_nan = isnan(v), b_nan = isnan(o.v);
        const bool take = a_nan ? (b_nan && o.ord < ord)
                                : (b_nan || o.v > v || (o.v == v && o.ord > ord));
        if (take) {
            v = o.v;
            ord = o.ord;
        }
    }
    __device__ __forceinline__ void add(float x, i64 pos) { merge(MaxAcc{x, pos}); }
    __device__ __forceinline__ MaxAcc shfl_xor(int lane_mask) const {
        return MaxAcc{__shfl_xor_sync(0xffffffffu, v, lane_mask),
                      __shfl_xor_sync(0xffffffffu, ord, lane_mask)};
    }
};

enum { OP_SUM = 0, OP_MEAN = 1, OP_MAX = 2 };

template <int OP> __device__ __forceinline__ float finish(const SumAcc& a, i64 len) {
    if (OP == OP_SUM) return float(a.s);
    return len == 0 ? __int_as_float(0x7fc00000) : float(a.s / double(len));
}
template <int OP> __device__ __forceinline__ float finish(const MaxAcc& a, i64) { return a.v; }

// Position of element i of a row of len = 8 q + rem in math::max's fold: the tail
// [8 q, len) first, then lane k's elements k, k + 8, ... for k = 0..7.
__device__ __forceinline__ i64 row_ord(i64 i, i64 q, i64 rem) {
    return i >= 8 * q ? i - 8 * q : rem + (i & 7) * q + (i >> 3);
}

// inner == 1: one block per row.
template <typename TI, typename TO, int OP, typename Acc>
__device__ __forceinline__ void reduce_rows(const TI* __restrict__ x, TO* __restrict__ y,
                                            i64 outer, i64 len) {
    __shared__ Acc warp_part[RH];
    const int t = threadIdx.y * RW + threadIdx.x;
    const i64 q = len >> 3, rem = len - 8 * q;
    const i64 step = i64(gridDim.x) * gridDim.y;
    for (i64 o = i64(blockIdx.x) * gridDim.y + blockIdx.y; o < outer; o += step) {
        const TI* row = x + o * len;
        Acc a;
        a.init();
        i64 done = 0;
        if (aligned16(row)) {
            // Unit u holds elements 8u..8u+7 < 8q: lane k's element u.
            for (i64 u = t; u < q; u += RT) {
                float v[UNIT];
                load8(row + u * UNIT, v);
#pragma unroll
                for (int k = 0; k < UNIT; ++k) a.add(v[k], rem + k * q + u);
            }
            done = 8 * q;
        }
        for (i64 i = done + t; i < len; i += RT) a.add(to_f32(row[i]), row_ord(i, q, rem));
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) a.merge(a.shfl_xor(m));
        __syncthreads();  // the previous row's partials may still be being read
        if (threadIdx.x == 0) warp_part[threadIdx.y] = a;
        __syncthreads();
        if (t == 0) {
            Acc r = warp_part[0];
#pragma unroll
            for (int w = 1; w < RH; ++w) r.merge(warp_part[w]);
            y[o] = from_f32<TO>(finish<OP>(r, len));
        }
    }
}

// inner > 1: 32 columns per block, 8 threads per column.
template <typename TI, typename TO, int OP, typename Acc>
__device__ __forceinline__ void reduce_columns(const TI* __restrict__ x, TO* __restrict__ y,
                                               i64 outer, i64 len, i64 inner) {
    __shared__ Acc part[RH][RW];
    const int lane = threadIdx.x, ty = threadIdx.y;
    for (i64 o = blockIdx.y; o < outer; o += gridDim.y) {
        for (i64 c0 = i64(blockIdx.x) * RW; c0 < inner; c0 += i64(gridDim.x) * RW) {
            const i64 c = c0 + lane;
            Acc a;
            a.init();
            if (c < inner) {
                const TI* col = x + o * len * inner + c;
#pragma unroll 4
                for (i64 r = ty; r < len; r += RH) a.add(to_f32(col[r * inner]), r);
            }
            __syncthreads();  // the previous group's partials may still be being read
            part[ty][lane] = a;
            __syncthreads();
            if (ty == 0 && c < inner) {
                Acc s = part[0][lane];
#pragma unroll
                for (int k = 1; k < RH; ++k) s.merge(part[k][lane]);
                y[o * inner + c] = from_f32<TO>(finish<OP>(s, len));
            }
        }
    }
}

template <typename TI, typename TO, int OP, typename Acc>
__device__ __forceinline__ void reduce(const TI* x, TO* y, i64 outer, i64 len, i64 inner) {
    if (inner == 1) {
        reduce_rows<TI, TO, OP, Acc>(x, y, outer, len);
    } else {
        reduce_columns<TI, TO, OP, Acc>(x, y, outer, len, inner);
    }
}

// Every (input, output) pair of the float storage dtypes: M(TI, TO, suffix).
#define REDUCE_FOR_EACH_IO(M)                                                                  \
    CASTOR_FOR_EACH_IO(M)                                                                      \
    M(__half, __nv_bfloat16, f16_bf16)                                                         \
    M(__nv_bfloat16, __half, bf16_f16)

#define REDUCE(TI, TO, io)                                                                     \
    extern "C" __global__ void reduce_sum_##io(const TI* x, TO* y, i64 outer, i64 len,         \
                                               i64 inner) {                                    \
        reduce<TI, TO, OP_SUM, SumAcc>(x, y, outer, len, inner);                               \
    }                                                                                          \
    extern "C" __global__ void reduce_mean_##io(const TI* x, TO* y, i64 outer, i64 len,        \
                                                i64 inner) {                                   \
        reduce<TI, TO, OP_MEAN, SumAcc>(x, y, outer, len, inner);                              \
    }                                                                                          \
    extern "C" __global__ void reduce_max_##io(const TI* x, TO* y, i64 outer, i64 len,         \
                                               i64 inner) {                                    \
        reduce<TI, TO, OP_MAX, MaxAcc>(x, y, outer, len, inner);                               \
    }

REDUCE_FOR_EACH_IO(REDUCE)

// A two-stage column sum or mean of x[o = blockIdx.z] (see the file's head).
template <typename TI, typename TO, int OP>
__device__ __forceinline__ void reduce_grouped(const TI* __restrict__ x, double* __restrict__ part,
                                               TO* __restrict__ y, int* done, i64 outer, i64 len,
                                               i64 inner, i64 rows_per_group) {
    __shared__ double lanes[RH][RW * UNIT];
    const int lane = threadIdx.x, ty = threadIdx.y;
    const i64 groups = gridDim.y;
    const i64 col0 = (i64(blockIdx.x) * RW + lane) * UNIT;
    const i64 group = blockIdx.y;
    const i64 o = blockIdx.z;
    const i64 r0 = group * rows_per_group;
    const i64 r1 = min(len, r0 + rows_per_group);
    const bool vec = inner % UNIT == 0 && aligned16(x);
    if (o >= outer) return;
    const TI* xo = x + o * len * inner;
    double* po = part + o * groups * inner;
    double s[UNIT];
#pragma unroll
    for (int k = 0; k < UNIT; ++k) s[k] = 0.0;
    if (col0 < inner) {
#pragma unroll 2
        for (i64 r = r0 + ty; r < r1; r += RH) {
            float v[UNIT];
            if (vec) {
                load8(xo + r * inner + col0, v);
            } else {
#pragma unroll
                for (int k = 0; k < UNIT; ++k) {
                    v[k] = col0 + k < inner ? to_f32(xo[r * inner + col0 + k]) : 0.0f;
                }
            }
#pragma unroll
            for (int k = 0; k < UNIT; ++k) s[k] += double(v[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < UNIT; ++k) lanes[ty][lane * UNIT + k] = s[k];
    __syncthreads();
    // The block's RW * UNIT columns, a thread each: its RH partials in the order t = 0..7.
    const int j = ty * RW + lane;
    const i64 first = i64(blockIdx.x) * RW * UNIT;
    if (first + j < inner) {
        double t = lanes[0][j];
        for (int k = 1; k < RH; ++k) t += lanes[k][j];
        po[group * inner + first + j] = t;
    }
    // Stage two, in the last group of (o, blockIdx.x) to store its partials.
    if (!last_to_arrive(&done[o * gridDim.x + blockIdx.x], gridDim.y)) return;
    double(*scratch)[RW] = reinterpret_cast<double(*)[RW]>(&lanes[0][0]);
    sum_column_groups(po, groups, inner, first, RW * UNIT, scratch, [&](i64 c, double t) {
        y[o * inner + c] = from_f32<TO>(finish<OP>(SumAcc{t}, len));
    });
}

#define REDUCE_GROUPED(TI, TO, io)                                                             \
    extern "C" __global__ void reduce_grouped_sum_##io(const TI* x, double* part, TO* y,       \
                                                       int* done, i64 outer, i64 len,          \
                                                       i64 inner, i64 rows_per_group) {        \
        reduce_grouped<TI, TO, OP_SUM>(x, part, y, done, outer, len, inner, rows_per_group);   \
    }                                                                                          \
    extern "C" __global__ void reduce_grouped_mean_##io(const TI* x, double* part, TO* y,      \
                                                        int* done, i64 outer, i64 len,         \
                                                        i64 inner, i64 rows_per_group) {       \
        reduce_grouped<TI, TO, OP_MEAN>(x, part, y, done, outer, len, inner, rows_per_group);  \
    }

REDUCE_FOR_EACH_IO(REDUCE_GROUPED)
