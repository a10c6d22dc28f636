// attention.cu: scaled dot-product attention without a T x S buffer, forward and backward,
// in the FlashAttention-2 manner.
//
// Layout: q [bq, t, d], k and v [bq / group, s, d], o [bq, t, d], lse F32 [bq, t]. `bq`
// flattens q's batch dims; query batch b reads key/value batch b / group (grouped-query
// attention: `group` consecutive query heads share a kv head). mask (nullable): bytes,
// nonzero = keep, one row of s per mask batch; query batch b reads row b / mask_group.
// causal != 0: query i sees keys j <= i + s - t; window > 0 (with causal: a sliding window)
// narrows that to the last `window` of them, j > i + s - t - window, whose key tiles are then
// skipped too. A row that sees no kept key attends uniformly to all s keys (its scores are all
// the mask's finite minimum in PyTorch), with the gradient of that uniform softmax, as the CPU
// twin (runtime/src/cpu/attention.rs) and the unfused softmax do; with a window and a mask,
// whether a row sees a kept key is found by one warp scanning the row's window of the mask.
//
// Forward, one block of 4 warps per (64 query rows, query batch):
//   attention_fwd_<t>_d<P>(q, k, v, mask, o, lse, bq, t, s, d, group, mask_group, causal,
//                          window, scale)
//     Q, K and V tiles of 64 rows in shared memory; each warp owns 16 query rows and keeps
//     their scores (16 x 64), running max, running sum and output (16 x d) in registers:
//     S = scale * Q K^T (warp_mma), online softmax, O += P V with P rounded to <t> as it
//     enters the product; o = O / l, lse = max + log(l). Key tiles past the last key a
//     causal block sees are skipped.
// Backward (the probabilities recomputed from lse, never stored):
//   attention_bwd_delta_<t>(o, do, delta, rows, d): delta = sum(do * o) per row, F64 sum.
//   attention_bwd_dq_<t>_d<P>(q, k, v, mask, do, lse, delta, dq, bq, t, s, d, group,
//                             mask_group, causal, window, scale)
//     per (64 query rows, query batch): P = exp(S - lse), dP = dO V^T, dS = P (dP - delta),
//     dQ = scale * sum over key tiles of dS K.
//   attention_bwd_dkdv_<t>_d<P>(q, k, v, mask, do, lse, delta, dk, dv, bkv, t, s, d, group,
//                               mask_group, causal, window, scale)
//     per (64 keys, kv batch): every query batch of the group and every 32-row query tile in
//     order: S^T = K Q^T, P^T, dP^T = V dO^T, dS^T; dV += P^T dO, dK += scale * dS^T Q.
//     Deterministic: each block owns its keys' gradients; no atomics.
// <t> is the dtype of q, k, v, o, do and the gradients (f16 or bf16: tensor cores; f32: the
// warp-per-row kernels below, without `_d<P>`, for any d <= 256); <P> (16, 32, 64 or 128) is d
// rounded up, the width of the shared-memory rows (zero-padded past d).
// Rounding points, as the CPU twin: P and dS are rounded to <t> where they enter a product,
// the running sum l adds the unrounded P, o = O / l is rounded once to <t>, lse in F32. The
// differences from the twin are summation orders (tensor-core or k-order F32 accumulation per
// 16-wide chunk, tile by tile, where the twin sums in F64 in key order), CUDA's expf and logf
// (within 2 ulp), and the online max (exp(s - m) rescaled as the max grows): together a few
// F32 ulps before the final rounding to <t>.
// Launch: block (128); tensor-core kernels: grid (ceil(t / 64), bq) for fwd and dq,
// (ceil(s / 64), bq / group) for dkdv, dynamic shared memory (3 x 64 rows for fwd, 4 x 64 for
// dq, 2 x 64 + 2 x 32 for dkdv, of P + 8 elements each, plus 64 mask bytes, and for dkdv
// 2 x 32 floats): 52 KiB for bf16 at P = 128, over 48 KiB, so the host opts in. F32 kernels:
// grid (ceil(t / 4), bq) for fwd and dq, (ceil(s / 4), bq / group) for dkdv, no dynamic
// shared memory. delta: ceil(rows / 4) blocks.
#include "castor_common.cuh"

#define ATT_ROWS 64      // query rows per forward / dq block, keys per dkdv block
#define ATT_KEYS 64      // keys per tile in the forward / dq loops
#define ATT_QROWS 32     // query rows per tile in the dkdv loop
#define ATT_PAD 8        // elements of padding per shared-memory row (bank spread)
#define ATT_THREADS 128

// The first key the mask keeps (s when it keeps none; 0 without a mask), for mask row `m`,
// computed by warp 0 and returned to every thread of the block.
__device__ __forceinline__ int first_kept(const unsigned char* m, int s, int* shared_slot) {
    if (threadIdx.x < 32) {
        int first = s;
        if (m != nullptr) {
            for (int j = threadIdx.x; j < s; j += 32) {
                if (m[j] != 0) {
                    first = min(first, j);
                    break;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(FULL_WARP, first, o));
        } else {
            first = 0;
        }
        if (threadIdx.x == 0) *shared_slot = first;
    }
    __syncthreads();
    return *shared_slot;
}

// Keys query row r sees under the causal mask (all s without it).
__device__ __forceinline__ int visible_keys(int r, int t, int s, int causal) {
    return causal ? min(s, r + 1 + s - t) : s;
}

// The first key query row r sees: past the sliding window's start (0 without a window).
__device__ __forceinline__ int first_visible_key(int r, int t, int s, int causal, int window) {
    return window > 0 ? max(0, visible_keys(r, t, s, causal) - window) : 0;
}

// Whether mask row `m` keeps no key in [lo, end): the calling warp scans it, 32 bytes at a
// time, and stops at the first kept one (so a row that keeps most keys costs one step).
__device__ __forceinline__ bool warp_keeps_none(const unsigned char* m, int lo, int end) {
    const int lane = threadIdx.x & 31;
    for (int j0 = lo; j0 < end; j0 += 32) {
        const int j = j0 + lane;
        if (__any_sync(FULL_WARP, j < end && m[j] != 0)) return false;
    }
    return true;
}

// Copies rows [r0, r0 + rows) of a [n, d] matrix into shared memory as [rows][P + PAD],
// zero past n and past d.
template <typename T, int P>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int r0, int rows, int n, int d) {
    constexpr int LD = P + ATT_PAD;
    for (int idx = threadIdx.x; idx < rows * P; idx += ATT_THREADS) {
        const int r = idx / P, c = idx % P;
        const int row = r0 + r;
        dst[r * LD + c] = (row < n && c < d) ? src[i64(row) * d + c] : from_f32<T>(0.0f);
    }
}

// The A fragment of rows [row0, row0 + 16), columns [col0, col0 + 16) of a shared tile.
template <typename T, int LD>
__device__ __forceinline__ void frag_a(float (&a)[8], const T* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const T* lo = tile + (row0 + g) * LD + col0 + 2 * c;
    const T* hi = lo + 8 * LD;
    a[0] = to_f32(lo[0]); a[1] = to_f32(lo[1]);
    a[2] = to_f32(hi[0]); a[3] = to_f32(hi[1]);
    a[4] = to_f32(lo[8]); a[5] = to_f32(lo[9]);
    a[6] = to_f32(hi[8]); a[7] = to_f32(hi[9]);
}

// The B fragment of B = X^T for X the tile's rows [n0, n0 + 8) (B's columns) and columns
// [k0, k0 + 16) (B's rows): B[k][n] = X[n0 + n][k0 + k].
template <typename T, int LD>
__device__ __forceinline__ void frag_b_t(float (&b)[4], const T* tile, int n0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const T* p = tile + (n0 + g) * LD + k0 + 2 * c;
    b[0] = to_f32(p[0]); b[1] = to_f32(p[1]);
    b[2] = to_f32(p[8]); b[3] = to_f32(p[9]);
}

// The B fragment of B = X for rows [k0, k0 + 16) and columns [n0, n0 + 8) of the tile.
template <typename T, int LD>
__device__ __forceinline__ void frag_b(float (&b)[4], const T* tile, int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const T* p = tile + (k0 + 2 * c) * LD + n0 + g;
    b[0] = to_f32(p[0]); b[1] = to_f32(p[LD]);
    b[2] = to_f32(p[8 * LD]); b[3] = to_f32(p[9 * LD]);
}

// The A fragment for key chunk `kc` (16 columns) from accumulators of 8-column tiles 2kc and
// 2kc + 1, each value rounded to T as it enters the product.
template <typename T, int N>
__device__ __forceinline__ void frag_a_from_acc(float (&a)[8], const float (&acc)[N][4], int kc) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        a[e] = round_to<T>(acc[2 * kc][e]);
        a[4 + e] = round_to<T>(acc[2 * kc + 1][e]);
    }
}

// The row max across the four lanes that share a row.
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_WARP, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_WARP, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_WARP, v, 1);
    return v + __shfl_xor_sync(FULL_WARP, v, 2);
}

// Whether query row r (of t) keeps key j (of s), and whether it sees no key at all.
struct Visibility {
    int t, s, causal, window, first;  // first: the first key the row's mask keeps
    const unsigned char* keep;  // the mask bytes of the current key tile (shared), or null
    int key0;                   // the tile's first key
    // With a window and a mask: per-row flags of rows [row0, ..) that see no kept key in their
    // window (window_rows fills them); null otherwise.
    const unsigned char* empty_rows = nullptr;
    int row0 = 0;
    __device__ __forceinline__ int lo(int r) const {
        return first_visible_key(r, t, s, causal, window);
    }
    __device__ __forceinline__ bool none(int r) const {
        return r >= t || first >= visible_keys(r, t, s, causal) ||
               (empty_rows != nullptr && empty_rows[r - row0] != 0);
    }
    __device__ __forceinline__ bool kept(int r, int j) const {
        if (j >= s) return false;
        if (none(r)) return true;  // uniform over every key
        return j >= lo(r) && j < visible_keys(r, t, s, causal) &&
               (keep == nullptr || keep[j - key0] != 0);
    }
    // none(r) for the calling warp's own row, scanning the window's mask bytes when needed
    // (the F32 kernels, one warp per row).
    __device__ __forceinline__ bool warp_none(int r, const unsigned char* mrow) const {
        if (none(r)) return true;
        return window > 0 && mrow != nullptr &&
               warp_keeps_none(mrow, lo(r), visible_keys(r, t, s, causal));
    }
};

// Fills `flags[i]` for rows row0 + i (i < n): 1 when the row's window holds no kept key of mask
// row `mrow`, one warp per row; then points `vis` at them. Only with a window and a mask.
__device__ __forceinline__ void window_rows(Visibility& vis, unsigned char* flags,
                                            const unsigned char* mrow, int row0, int n) {
    if (vis.window <= 0 || mrow == nullptr) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // the previous tile's flags are no longer read
    for (int i = warp; i < n; i += ATT_THREADS / 32) {
        const int r = row0 + i;
        const bool empty = r < vis.t && warp_keeps_none(mrow, vis.lo(r),
                                                       visible_keys(r, vis.t, vis.s, vis.causal));
        if (lane == 0) flags[i] = empty;
    }
    __syncthreads();
    vis.empty_rows = flags;
    vis.row0 = row0;
}

// ---- forward -----------------------------------------------------------------------------

template <typename T, int P>
__device__ void att_fwd(const T* q, const T* k, const T* v, const unsigned char* mask, T* o,
                        float* lse, int t, int s, int d, int group, int mask_group, int causal,
                        int window, float scale) {
    constexpr int LD = P + ATT_PAD, NT = ATT_KEYS / 8, DT = P / 16, OT = P / 8;
    CASTOR_DYNAMIC_SHARED(att_smem);
    T* qs = reinterpret_cast<T*>(att_smem);
    T* ks = qs + ATT_ROWS * LD;
    T* vs = ks + ATT_KEYS * LD;
    unsigned char* keep = reinterpret_cast<unsigned char*>(vs + ATT_KEYS * LD);
    __shared__ int first_slot;
    __shared__ unsigned char empty_rows[ATT_ROWS];

    const i64 b = blockIdx.y;
    const int r0 = blockIdx.x * ATT_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const T* qb = q + b * i64(t) * d;
    const T* kb = k + (b / group) * i64(s) * d;
    const T* vb = v + (b / group) * i64(s) * d;
    const unsigned char* mrow = mask ? mask + (b / mask_group) * i64(s) : nullptr;
    Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), mrow ? keep : nullptr,
                   0};
    window_rows(vis, empty_rows, mrow, r0, ATT_ROWS);

    load_tile<T, P>(qs, qb, r0, ATT_ROWS, t, d);
    // Keys the block needs: from the first key its first row sees to the last key its last
    // row sees, or all when a row sees none.
    const int last_row = min(r0 + ATT_ROWS, t) - 1;
    bool uniform = false;
    for (int r = r0; r <= last_row; ++r) uniform |= vis.none(r);
    const int kend = uniform ? s : visible_keys(last_row, t, s, causal);
    const int kstart = uniform ? 0 : vis.lo(r0) / ATT_KEYS * ATT_KEYS;

    const int rows[2] = {r0 + warp * 16 + g, r0 + warp * 16 + g + 8};
    float m[2] = {F32_NEG_INF, F32_NEG_INF}, l[2] = {0.0f, 0.0f};
    float acc[OT][4];
#pragma unroll
    for (int i = 0; i < OT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    for (int key0 = kstart; key0 < kend; key0 += ATT_KEYS) {
        __syncthreads();  // the previous tile is no longer read
        load_tile<T, P>(ks, kb, key0, ATT_KEYS, s, d);
        load_tile<T, P>(vs, vb, key0, ATT_KEYS, s, d);
        if (mrow) {
            for (int j = threadIdx.x; j < ATT_KEYS; j += ATT_THREADS)
                keep[j] = key0 + j < s ? mrow[key0 + j] : 0;
        }
        __syncthreads();
        vis.key0 = key0;

        float sc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DT; ++kk) {
            float a[8];
            frag_a<T, LD>(a, qs, warp * 16, kk * 16);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                float bf[4];
                frag_b_t<T, LD>(bf, ks, n * 8, kk * 16);
                warp_mma<T>(sc[n], a, bf);
            }
        }
        float tile_max[2] = {F32_NEG_INF, F32_NEG_INF};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = rows[e >> 1], j = key0 + n * 8 + 2 * c + (e & 1);
                float x = F32_NEG_INF;
                if (vis.kept(r, j)) x = vis.none(r) ? 0.0f : sc[n][e] * scale;
                sc[n][e] = x;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
            }
        }
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float mn = fmaxf(m[h], quad_max(tile_max[h]));
            // A row with nothing kept yet keeps m = -inf: exp against 0 gives 0, not NaN.
            const float base = mn == F32_NEG_INF ? 0.0f : mn;
            corr[h] = expf(m[h] - base);
            m[h] = mn;
            float part = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    sc[n][e] = expf(sc[n][e] - base);
                    part += sc[n][e];
                }
            }
            l[h] = l[h] * corr[h] + quad_sum(part);
        }
#pragma unroll
        for (int i = 0; i < OT; ++i) {
            acc[i][0] *= corr[0]; acc[i][1] *= corr[0];
            acc[i][2] *= corr[1]; acc[i][3] *= corr[1];
        }
#pragma unroll
        for (int kc = 0; kc < ATT_KEYS / 16; ++kc) {
            float a[8];
            frag_a_from_acc<T>(a, sc, kc);
#pragma unroll
            for (int i = 0; i < OT; ++i) {
                float bf[4];
                frag_b<T, LD>(bf, vs, kc * 16, i * 8);
                warp_mma<T>(acc[i], a, bf);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = rows[h];
        if (r < t) {
#pragma unroll
            for (int i = 0; i < OT; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = i * 8 + 2 * c + e;
                    if (col < d) o[(b * t + r) * i64(d) + col] = from_f32<T>(acc[i][2 * h + e] / l[h]);
                }
            }
            if (c == 0) lse[b * t + r] = m[h] + logf(l[h]);
        }
    }
}

// ---- backward: delta ---------------------------------------------------------------------

template <typename T>
__device__ void att_delta(const T* o, const T* d_o, float* delta, i64 rows, int d) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 row = i64(blockIdx.x) * (ATT_THREADS / 32) + warp;
    if (row >= rows) return;
    double acc = 0.0;
    for (int j = lane; j < d; j += 32)
        acc += double(to_f32(d_o[row * d + j])) * double(to_f32(o[row * d + j]));
    acc = warp_sum(acc);
    if (lane == 0) delta[row] = float(acc);
}

// ---- backward: dq ------------------------------------------------------------------------

template <typename T, int P>
__device__ void att_dq(const T* q, const T* k, const T* v, const unsigned char* mask,
                       const T* d_o, const float* lse, const float* delta, T* dq, int t, int s,
                       int d, int group, int mask_group, int causal, int window, float scale) {
    constexpr int LD = P + ATT_PAD, NT = ATT_KEYS / 8, DT = P / 16, OT = P / 8;
    CASTOR_DYNAMIC_SHARED(att_smem);
    T* qs = reinterpret_cast<T*>(att_smem);
    T* dos = qs + ATT_ROWS * LD;
    T* ks = dos + ATT_ROWS * LD;
    T* vs = ks + ATT_KEYS * LD;
    unsigned char* keep = reinterpret_cast<unsigned char*>(vs + ATT_KEYS * LD);
    __shared__ int first_slot;
    __shared__ unsigned char empty_rows[ATT_ROWS];

    const i64 b = blockIdx.y;
    const int r0 = blockIdx.x * ATT_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const T* kb = k + (b / group) * i64(s) * d;
    const T* vb = v + (b / group) * i64(s) * d;
    const unsigned char* mrow = mask ? mask + (b / mask_group) * i64(s) : nullptr;
    Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), mrow ? keep : nullptr,
                   0};
    window_rows(vis, empty_rows, mrow, r0, ATT_ROWS);

    load_tile<T, P>(qs, q + b * i64(t) * d, r0, ATT_ROWS, t, d);
    load_tile<T, P>(dos, d_o + b * i64(t) * d, r0, ATT_ROWS, t, d);
    const int last_row = min(r0 + ATT_ROWS, t) - 1;
    bool uniform = false;
    for (int r = r0; r <= last_row; ++r) uniform |= vis.none(r);
    const int kend = uniform ? s : visible_keys(last_row, t, s, causal);
    const int kstart = uniform ? 0 : vis.lo(r0) / ATT_KEYS * ATT_KEYS;

    const int rows[2] = {r0 + warp * 16 + g, r0 + warp * 16 + g + 8};
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool ok = rows[h] < t;
        row_lse[h] = ok ? lse[b * t + rows[h]] : 0.0f;
        row_delta[h] = ok ? delta[b * t + rows[h]] : 0.0f;
    }
    float acc[OT][4];
#pragma unroll
    for (int i = 0; i < OT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    for (int key0 = kstart; key0 < kend; key0 += ATT_KEYS) {
        __syncthreads();
        load_tile<T, P>(ks, kb, key0, ATT_KEYS, s, d);
        load_tile<T, P>(vs, vb, key0, ATT_KEYS, s, d);
        if (mrow) {
            for (int j = threadIdx.x; j < ATT_KEYS; j += ATT_THREADS)
                keep[j] = key0 + j < s ? mrow[key0 + j] : 0;
        }
        __syncthreads();
        vis.key0 = key0;

        float p[NT][4], dp[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DT; ++kk) {
            float a[8], ad[8];
            frag_a<T, LD>(a, qs, warp * 16, kk * 16);
            frag_a<T, LD>(ad, dos, warp * 16, kk * 16);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                float bk[4], bv[4];
                frag_b_t<T, LD>(bk, ks, n * 8, kk * 16);
                frag_b_t<T, LD>(bv, vs, n * 8, kk * 16);
                warp_mma<T>(p[n], a, bk);
                warp_mma<T>(dp[n], ad, bv);
            }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1, r = rows[h], j = key0 + n * 8 + 2 * c + (e & 1);
                float pr = 0.0f;
                if (r < t && vis.kept(r, j)) {
                    const float x = vis.none(r) ? 0.0f : p[n][e] * scale;
                    pr = expf(x - row_lse[h]);
                }
                p[n][e] = pr * (dp[n][e] - row_delta[h]);  // dS
            }
        }
#pragma unroll
        for (int kc = 0; kc < ATT_KEYS / 16; ++kc) {
            float a[8];
            frag_a_from_acc<T>(a, p, kc);
#pragma unroll
            for (int i = 0; i < OT; ++i) {
                float bf[4];
                frag_b<T, LD>(bf, ks, kc * 16, i * 8);
                warp_mma<T>(acc[i], a, bf);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = rows[h];
        if (r < t) {
#pragma unroll
            for (int i = 0; i < OT; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = i * 8 + 2 * c + e;
                    if (col < d) dq[(b * t + r) * i64(d) + col] = from_f32<T>(acc[i][2 * h + e] * scale);
                }
            }
        }
    }
}

// ---- backward: dk and dv -----------------------------------------------------------------

template <typename T, int P>
__device__ void att_dkdv(const T* q, const T* k, const T* v, const unsigned char* mask,
                         const T* d_o, const float* lse, const float* delta, T* dk, T* dv, int t,
                         int s, int d, int group, int mask_group, int causal, int window,
                         float scale) {
    constexpr int LD = P + ATT_PAD, NQ = ATT_QROWS / 8, DT = P / 16, OT = P / 8;
    CASTOR_DYNAMIC_SHARED(att_smem);
    T* ks = reinterpret_cast<T*>(att_smem);
    T* vs = ks + ATT_ROWS * LD;
    T* qs = vs + ATT_ROWS * LD;
    T* dos = qs + ATT_QROWS * LD;
    float* lse_s = reinterpret_cast<float*>(dos + ATT_QROWS * LD);
    float* delta_s = lse_s + ATT_QROWS;
    unsigned char* keep = reinterpret_cast<unsigned char*>(delta_s + ATT_QROWS);
    __shared__ int first_slot;
    __shared__ unsigned char empty_rows[ATT_QROWS];

    const i64 bk = blockIdx.y;
    const int key0 = blockIdx.x * ATT_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    load_tile<T, P>(ks, k + bk * i64(s) * d, key0, ATT_ROWS, s, d);
    load_tile<T, P>(vs, v + bk * i64(s) * d, key0, ATT_ROWS, s, d);
    const int keys[2] = {key0 + warp * 16 + g, key0 + warp * 16 + g + 8};

    float acc_k[OT][4], acc_v[OT][4];
#pragma unroll
    for (int i = 0; i < OT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[i][e] = acc_v[i][e] = 0.0f;

    for (i64 b = bk * group; b < (bk + 1) * group; ++b) {
        const unsigned char* mrow = mask ? mask + (b / mask_group) * i64(s) : nullptr;
        __syncthreads();
        if (mrow) {
            for (int j = threadIdx.x; j < ATT_ROWS; j += ATT_THREADS)
                keep[j] = key0 + j < s ? mrow[key0 + j] : 0;
        }
        Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot),
                       mrow ? keep : nullptr, key0};
        for (int q0 = 0; q0 < t; q0 += ATT_QROWS) {
            // A query tile whose rows see none of these keys (and none is uniform) is skipped:
            // its last row's causal limit is before them, or its first row's window starts
            // after them.
            window_rows(vis, empty_rows, mrow, q0, ATT_QROWS);
            const int last_row = min(q0 + ATT_QROWS, t) - 1;
            bool needed =
                visible_keys(last_row, t, s, causal) > key0 && vis.lo(q0) < key0 + ATT_ROWS;
            for (int r = q0; r <= last_row && !needed; ++r) needed = vis.none(r);
            if (!needed) continue;
            __syncthreads();
            load_tile<T, P>(qs, q + b * i64(t) * d, q0, ATT_QROWS, t, d);
            load_tile<T, P>(dos, d_o + b * i64(t) * d, q0, ATT_QROWS, t, d);
            for (int i = threadIdx.x; i < ATT_QROWS; i += ATT_THREADS) {
                const bool ok = q0 + i < t;
                lse_s[i] = ok ? lse[b * t + q0 + i] : 0.0f;
                delta_s[i] = ok ? delta[b * t + q0 + i] : 0.0f;
            }
            __syncthreads();

            float p[NQ][4], dp[NQ][4];
#pragma unroll
            for (int n = 0; n < NQ; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < DT; ++kk) {
                float a[8], av[8];
                frag_a<T, LD>(a, ks, warp * 16, kk * 16);
                frag_a<T, LD>(av, vs, warp * 16, kk * 16);
#pragma unroll
                for (int n = 0; n < NQ; ++n) {
                    float bq[4], bo[4];
                    frag_b_t<T, LD>(bq, qs, n * 8, kk * 16);
                    frag_b_t<T, LD>(bo, dos, n * 8, kk * 16);
                    warp_mma<T>(p[n], a, bq);   // S^T
                    warp_mma<T>(dp[n], av, bo);  // dP^T
                }
            }
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = keys[e >> 1], i = n * 8 + 2 * c + (e & 1), r = q0 + i;
                    float pr = 0.0f;
                    if (r < t && vis.kept(r, j)) {
                        const float x = vis.none(r) ? 0.0f : p[n][e] * scale;
                        pr = expf(x - lse_s[i]);
                    }
                    p[n][e] = pr;                               // P^T
                    dp[n][e] = pr * (dp[n][e] - delta_s[i]);    // dS^T
                }
            }
#pragma unroll
            for (int kc = 0; kc < ATT_QROWS / 16; ++kc) {
                float ap[8], as[8];
                frag_a_from_acc<T>(ap, p, kc);
                frag_a_from_acc<T>(as, dp, kc);
#pragma unroll
                for (int i = 0; i < OT; ++i) {
                    float bo[4], bq[4];
                    frag_b<T, LD>(bo, dos, kc * 16, i * 8);
                    frag_b<T, LD>(bq, qs, kc * 16, i * 8);
                    warp_mma<T>(acc_v[i], ap, bo);
                    warp_mma<T>(acc_k[i], as, bq);
                }
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int j = keys[h];
        if (j < s) {
#pragma unroll
            for (int i = 0; i < OT; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = i * 8 + 2 * c + e;
                    if (col < d) {
                        const i64 at = (bk * s + j) * i64(d) + col;
                        dk[at] = from_f32<T>(acc_k[i][2 * h + e] * scale);
                        dv[at] = from_f32<T>(acc_v[i][2 * h + e]);
                    }
                }
            }
        }
    }
}

// ---- F32: one warp per row, no tensor cores -----------------------------------------------
// F32 operands have no exact tensor-core product, so the F32 kernels take one query row (or,
// for dk/dv, one key row) per warp, the lanes splitting the head dim (d <= 256), and walk the
// keys (queries) one at a time. Dot products and gradient sums are F64, in the CPU twin's
// order (keys ascending; query batches of the group, then rows, ascending), so these kernels
// differ from the twin only in expf/logf and the running rescaling of the online softmax.

#define ATT_LANE_DIMS 8  // head-dim elements per lane: d <= 256

__device__ __forceinline__ double warp_dot(const float (&x)[ATT_LANE_DIMS], const float* y, int d) {
    const int lane = threadIdx.x & 31;
    double acc = 0.0;
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) {
        const int col = lane + 32 * u;
        if (col < d) acc += double(x[u]) * double(y[col]);
    }
    return warp_sum(acc);
}

__device__ __forceinline__ void lane_row(float (&x)[ATT_LANE_DIMS], const float* row, int d) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) {
        const int col = lane + 32 * u;
        x[u] = col < d ? row[col] : 0.0f;
    }
}

__device__ void att_fwd_f32(const float* q, const float* k, const float* v,
                            const unsigned char* mask, float* o, float* lse, int t, int s, int d,
                            int group, int mask_group, int causal, int window, double scale) {
    __shared__ int first_slot;
    const i64 b = blockIdx.y;
    const int r = blockIdx.x * (ATT_THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const unsigned char* mrow = mask ? mask + (b / mask_group) * i64(s) : nullptr;
    const Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), nullptr, 0};
    if (r >= t) return;
    const float* kb = k + (b / group) * i64(s) * d;
    const float* vb = v + (b / group) * i64(s) * d;
    float qi[ATT_LANE_DIMS], acc[ATT_LANE_DIMS];
    lane_row(qi, q + (b * t + r) * i64(d), d);
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) acc[u] = 0.0f;
    const bool none = vis.warp_none(r, mrow);
    const int end = none ? s : visible_keys(r, t, s, causal);
    float m = F32_NEG_INF, l = 0.0f;
    for (int j = none ? 0 : vis.lo(r); j < end; ++j) {
        if (!none && mrow != nullptr && mrow[j] == 0) continue;
        const float x = none ? 0.0f : float(warp_dot(qi, kb + i64(j) * d, d) * double(scale));
        const float mn = fmaxf(m, x);
        const float corr = expf(m - mn), p = expf(x - mn);
        m = mn;
        l = l * corr + p;
        const float* vj = vb + i64(j) * d;
#pragma unroll
        for (int u = 0; u < ATT_LANE_DIMS; ++u) {
            const int col = lane + 32 * u;
            acc[u] = acc[u] * corr + (col < d ? p * vj[col] : 0.0f);
        }
    }
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) {
        const int col = lane + 32 * u;
        if (col < d) o[(b * t + r) * i64(d) + col] = acc[u] / l;
    }
    if (lane == 0) lse[b * t + r] = m + logf(l);
}

__device__ void att_dq_f32(const float* q, const float* k, const float* v,
                           const unsigned char* mask, const float* d_o, const float* lse,
                           const float* delta, float* dq, int t, int s, int d, int group,
                           int mask_group, int causal, int window, double scale) {
    __shared__ int first_slot;
    const i64 b = blockIdx.y;
    const int r = blockIdx.x * (ATT_THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const unsigned char* mrow = mask ? mask + (b / mask_group) * i64(s) : nullptr;
    const Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), nullptr, 0};
    if (r >= t) return;
    const float* kb = k + (b / group) * i64(s) * d;
    const float* vb = v + (b / group) * i64(s) * d;
    const i64 row = b * t + r;
    float qi[ATT_LANE_DIMS], doi[ATT_LANE_DIMS];
    lane_row(qi, q + row * d, d);
    lane_row(doi, d_o + row * d, d);
    double acc[ATT_LANE_DIMS];
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) acc[u] = 0.0;
    const bool none = vis.warp_none(r, mrow);
    const int end = none ? s : visible_keys(r, t, s, causal);
    for (int j = none ? 0 : vis.lo(r); j < end; ++j) {
        if (!none && mrow != nullptr && mrow[j] == 0) continue;
        const float x = none ? 0.0f : float(warp_dot(qi, kb + i64(j) * d, d) * double(scale));
        const float p = expf(x - lse[row]);
        const float dp = float(warp_dot(doi, vb + i64(j) * d, d));
        const double ds = double(p * (dp - delta[row]));
        const float* kj = kb + i64(j) * d;
#pragma unroll
        for (int u = 0; u < ATT_LANE_DIMS; ++u) {
            const int col = lane + 32 * u;
            if (col < d) acc[u] += ds * double(kj[col]);
        }
    }
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) {
        const int col = lane + 32 * u;
        if (col < d) dq[row * d + col] = float(acc[u] * double(scale));
    }
}

__device__ void att_dkdv_f32(const float* q, const float* k, const float* v,
                             const unsigned char* mask, const float* d_o, const float* lse,
                             const float* delta, float* dk, float* dv, int t, int s, int d,
                             int group, int mask_group, int causal, int window, double scale) {
    __shared__ int first_slot;
    const i64 bk = blockIdx.y;
    const int j = blockIdx.x * (ATT_THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    float kj[ATT_LANE_DIMS], vj[ATT_LANE_DIMS];
    if (j < s) {
        lane_row(kj, k + (bk * s + j) * i64(d), d);
        lane_row(vj, v + (bk * s + j) * i64(d), d);
    }
    double acc_k[ATT_LANE_DIMS], acc_v[ATT_LANE_DIMS];
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) acc_k[u] = acc_v[u] = 0.0;
    for (i64 b = bk * group; b < (bk + 1) * group; ++b) {
        const unsigned char* mrow = mask ? mask + (b / mask_group) * i64(s) : nullptr;
        __syncthreads();  // first_slot is about to be rewritten
        const Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), nullptr, 0};
        if (j >= s) continue;
        const bool key_kept = mrow == nullptr || mrow[j] != 0;
        for (int r = 0; r < t; ++r) {
            const bool none = vis.warp_none(r, mrow);
            if (!none && (!key_kept || j >= visible_keys(r, t, s, causal) || j < vis.lo(r)))
                continue;
            const i64 row = b * t + r;
            const float* qr = q + row * d;
            const float* dor = d_o + row * d;
            const float x = none ? 0.0f : float(warp_dot(kj, qr, d) * double(scale));
            const float p = expf(x - lse[row]);
            const float dp = float(warp_dot(vj, dor, d));
            const double ds = double(p * (dp - delta[row]));
#pragma unroll
            for (int u = 0; u < ATT_LANE_DIMS; ++u) {
                const int col = lane + 32 * u;
                if (col < d) {
                    acc_k[u] += ds * double(qr[col]);
                    acc_v[u] += double(p) * double(dor[col]);
                }
            }
        }
    }
    if (j >= s) return;
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) {
        const int col = lane + 32 * u;
        if (col < d) {
            dk[(bk * s + j) * i64(d) + col] = float(acc_k[u] * double(scale));
            dv[(bk * s + j) * i64(d) + col] = float(acc_v[u]);
        }
    }
}

// ---- entry points --------------------------------------------------------------------------

#define CASTOR_ATTENTION(T, sfx, P)                                                                \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) attention_fwd_##sfx##_d##P(       \
        const T* q, const T* k, const T* v, const unsigned char* mask, T* o, float* lse,           \
        i64 bq, int t, int s, int d, int group, int mask_group, int causal, int window,            \
        double scale) {                                                                            \
        att_fwd<T, P>(q, k, v, mask, o, lse, t, s, d, group, mask_group, causal, window,           \
                      float(scale));                                                               \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) attention_bwd_dq_##sfx##_d##P(    \
        const T* q, const T* k, const T* v, const unsigned char* mask, const T* d_o,               \
        const float* lse, const float* delta, T* dq, i64 bq, int t, int s, int d, int group,       \
        int mask_group, int causal, int window, double scale) {                                    \
        att_dq<T, P>(q, k, v, mask, d_o, lse, delta, dq, t, s, d, group, mask_group, causal,       \
                     window, float(scale));                                                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) attention_bwd_dkdv_##sfx##_d##P(  \
        const T* q, const T* k, const T* v, const unsigned char* mask, const T* d_o,               \
        const float* lse, const float* delta, T* dk, T* dv, i64 bkv, int t, int s, int d,          \
        int group, int mask_group, int causal, int window, double scale) {                         \
        att_dkdv<T, P>(q, k, v, mask, d_o, lse, delta, dk, dv, t, s, d, group, mask_group,         \
                       causal, window, float(scale));                                              \
    }

// Each (dtype, P) of the tensor-core kernels is its own instantiation, and the file builds
// them all: about 27 s with NVRTC the first time a machine compiles it, then from the PTX
// cache.
#define CASTOR_ATTENTION_DELTA(T, sfx)                                                             \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_bwd_delta_##sfx(           \
        const T* o, const T* d_o, float* delta, i64 rows, int d) {                                 \
        att_delta<T>(o, d_o, delta, rows, d);                                                      \
    }

#define CASTOR_ATTENTION_F32                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_fwd_f32(                   \
        const float* q, const float* k, const float* v, const unsigned char* mask, float* o,       \
        float* lse, i64 bq, int t, int s, int d, int group, int mask_group, int causal,            \
        int window, double scale) {                                                                \
        att_fwd_f32(q, k, v, mask, o, lse, t, s, d, group, mask_group, causal, window, scale);     \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_bwd_dq_f32(                \
        const float* q, const float* k, const float* v, const unsigned char* mask,                 \
        const float* d_o, const float* lse, const float* delta, float* dq, i64 bq, int t,          \
        int s, int d, int group, int mask_group, int causal, int window, double scale) {           \
        att_dq_f32(q, k, v, mask, d_o, lse, delta, dq, t, s, d, group, mask_group, causal,         \
                   window, scale);                                                                 \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_bwd_dkdv_f32(              \
        const float* q, const float* k, const float* v, const unsigned char* mask,                 \
        const float* d_o, const float* lse, const float* delta, float* dk, float* dv, i64 bkv,     \
        int t, int s, int d, int group, int mask_group, int causal, int window, double scale) {    \
        att_dkdv_f32(q, k, v, mask, d_o, lse, delta, dk, dv, t, s, d, group, mask_group,           \
                     causal, window, scale);                                                       \
    }                                                                                              \
    CASTOR_ATTENTION_DELTA(float, f32)

CASTOR_ATTENTION_F32
CASTOR_ATTENTION_DELTA(__half, f16)
CASTOR_ATTENTION_DELTA(__nv_bfloat16, bf16)
CASTOR_ATTENTION(__half, f16, 16)
CASTOR_ATTENTION(__half, f16, 32)
CASTOR_ATTENTION(__half, f16, 64)
CASTOR_ATTENTION(__half, f16, 128)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 16)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 32)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 64)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 128)
