// attention.cu: scaled dot-product attention without a T x S buffer, forward and backward,
// in the FlashAttention-2 manner.
//
// Layout: q [bq, t, d], k and v [bq / group, s, d], o [bq, t, d], lse F32 [bq, t]. `bq`
// flattens q's batch dims; query batch b reads key/value batch b / group (grouped-query
// attention: `group` consecutive query heads share a kv head). The tensor-core kernels read
// and write q, k, v, o, do, dq, dk and dv through strides (AttStrides below: query batch b
// split as (b / heads, b % heads), key batches as (bk / (heads / group), ..), rows any
// distance apart), so that a head of a fused QKV product or a context in [B, T, H, d] is used
// in place, without a copy; the F32 kernels take dense operands. mask (nullable): bytes,
// nonzero = keep, one row of s per mask batch; query batch b reads row b / mask_group.
// causal != 0: query i sees keys j <= i + s - t; window > 0 (with causal: a sliding window)
// narrows that to the last `window` of them, j > i + s - t - window, whose key tiles are then
// skipped too. A row that sees no kept key attends uniformly to all s keys (its scores are all
// the mask's finite minimum in PyTorch), with the gradient of that uniform softmax, as the CPU
// twin (runtime/src/cpu/attention.rs) and the unfused softmax do; with a window and a mask,
// whether a row sees a kept key is found by one warp scanning the row's window of the mask.
// positions (nullable; only with causal, and never with a mask: the lowering passes one or the
// other; of the tensor-core kernels, only the `_packed` entry points read it, and the others,
// which must be passed null, compile that code out):
// i64, each key's position in its own packed sequence, one row of s per mask batch
// (query batch b reads row b / mask_group, as the mask). Query i, whose own key is
// a = i + s - t, sees only keys j >= a - clamp(pos[a], 0, a), the start of its sequence (a
// malformed position never reaches before the row), as the CPU twin's PositionRows and
// softmax.cu; with a window, the later of the two starts. Such a row always sees its own key.
// That first key need not grow with the row (a malformed position may start a later row's
// sequence earlier), so the kernels take a warp's, block's or tile's bounds as the least and
// greatest first key over its rows (for the causal and window bounds, its first and last
// row's).
//
// Tensor-core kernels (f16, bf16; <P> = 16, 32, 64 or 128, the head dim d rounded up):
//   attention_fwd_<t>_d<P>(q, k, v, mask, positions, o, lse, bq, t, s, d, group, mask_group,
//                          causal, window, scale, <q, k, v, o strides>)
//     One block of 8 warps per (128 query rows, query batch); the block of the last rows
//     starts first (a causal block of later rows has the most keys). Q is copied to shared
//     memory and from there, by ldmatrix, into registers, once; K and V tiles (128 keys for
//     P <= 64, else 64) are double-buffered: the next tile's 16-byte cp.async copies run
//     while the current one is multiplied. Each warp owns 16 query rows: S = Q K^T
//     (mma.sync, K fragments by ldmatrix), online softmax in the log2 domain, O += P V (P
//     straight from the score registers, rounded to <t>; V fragments by ldmatrix.trans);
//     o = O / l, lse = max + log(l). Masks are tested only on a tile a warp's rows see in
//     part (the causal diagonal, a window's edge, a sequence's start, the last keys, a mask
//     byte that drops a key, a row that sees none); the warp skips a tile its rows see none
//     of, and the block starts at the key tile of its rows' least first key.
//   attention_bwd_delta_<t>(o, do, delta, rows, t, d, heads, <o, do strides>): delta =
//     sum(do * o) per row, F64 sum; a row takes att_delta_lanes(d) lanes (one per 16-byte
//     unit of the row, a power of two, at most 32), so a warp sums 32 / lanes rows at once.
//   attention_bwd_<t>_d<P>(q, k, v, mask, positions, do, lse, delta, dq, dk, dv, dq_acc,
//                          dq_ready, bkv, t, s, d, group, mask_group, causal, window, scale,
//                          <q, k, v, do, dq, dk, dv strides>)
//     One pass over key blocks: one block of 8 warps per (128 keys, query batch, segment);
//     each warp owns 16 keys. For every tile of 64 query rows of its segment that sees the
//     block's keys, in order, with the next tile's Q, dO, lse and delta copied while this one
//     computes: S^T = K Q^T and dP^T = V dO^T, P^T = exp(S^T - lse),
//     dS^T = P^T (dP^T - delta); dV += P^T dO and dK += dS^T Q in registers (for P = 128 these
//     take the tile's rows 32 at a time); dS^T (as <t>) through shared memory into the
//     block's share of dQ = dS K. Five products, nothing recomputed.
//     A segment is ATT_BWD_SEGMENT_ROWS (512) query rows where the mask is banded (causal or
//     windowed), else all t: under a causal mask the first key block reads every tile and the
//     last only the last ones, so a block per whole run would leave the device waiting on the
//     first blocks at the end of the launch. The blocks of one key block (the group's query
//     heads, each one's segments: its links) sum dK and dV in that order, in F32 scratch past
//     dq_acc, each waiting (dkv counters past dq_ready's) until the links before it have
//     added theirs; the last link writes dk = scale * sum and dv as <t>. With one link
//     (no grouping, one segment) the block writes them from its registers.
//     dQ is summed across key blocks without float atomics, in a fixed order: the key blocks
//     that read a query tile add their shares into the F32 rows of dq_acc ([bq, t, P]) from
//     the highest block to the lowest, each waiting until dq_ready (one int per (query batch,
//     tile), zero before the launch) counts the blocks above it; the lowest writes dq =
//     scale * sum as <t>. Blocks are numbered so that higher key blocks have lower linear
//     indices (x), and earlier links of a key block lower ones too (z: segments, each over
//     y: query heads): a block waits only for blocks the device dispatched before it (it
//     dispatches in index order, as FlashAttention-3's deterministic backward relies on), so
//     the wait ends, and with causal masks it rarely waits at all (a higher block reaches a
//     tile two tiles before the next lower one; a link waits only once it is done, on links
//     that started before it). The result does not depend on timing. Per tile one
//     thread waits (an acquire load) and one raises (a release), between block barriers, as
//     castor_common.cuh's wait_flag and raise_flag describe: one fence per tile, not one per
//     thread. After the wait each warp copies its part of the sum so far into shared memory
//     by cp.async (.cg: from L2, never a stale L1 line) while its share's product runs, and
//     adds it after: no registers are held for it across the product.
//     A query batch with a row that may see no kept key (a mask's first kept key past the
//     first row's last visible key, or any mask under a window) sends every tile to every
//     key block. With positions, a key block takes the tiles from its diagonal's to that of
//     the last row whose sequence starts before the block's end (its threads scan the rows'
//     positions once per query batch), passes over a tile between them none of whose rows
//     starts that early (all blocks agree on a tile's blocks from its rows' least first key,
//     which the block finds as it copies the tile), and on a tile that a sequence's start
//     straddles tests each score against its row's start (each warp's 16 keys against the
//     tile's rows by one ballot per key).
// F32 kernels (one warp per row, no tensor cores; any d <= 256):
//   attention_fwd_f32, attention_bwd_dq_f32, attention_bwd_dkdv_f32, attention_bwd_delta_f32
//   (below).
//
// Rounding points, as the CPU twin: P and dS are rounded to <t> where they enter a product,
// the running sum l adds the unrounded P, o, dq, dk and dv are rounded once to <t>, lse in F32.
// What differs from the twin in the tensor-core kernels: summation orders (tensor-core F32
// accumulation per 16-wide chunk, tile by tile, where the twin sums in F64 in key order); the
// online max (P rescaled as the max grows); and the softmax's exponential, which this file
// computes as exp2(fma(s, scale log2(e), -m)) with the special-function unit's ex2 (within 2
// ulp; the host build's exp2f is correctly rounded): scale and log2(e) folded into one fused
// multiply-add (the one place this file contracts a multiply and an add; every other product
// and sum is rounded separately, --fmad=false), which rounds s scale log2(e) - m once where
// the twin rounds s scale, then exp's argument. Together a few F32 ulps before the final
// rounding to <t>: the kernel test's bounds (relative error against the twin, measured worst
// with a margin) are 2e-4 in F16 and 1.2e-3 in BF16.
// Launch (geometry.rs holds these numbers): tensor-core kernels block (256),
// grid (ceil(t / 128), heads, bq / heads) for fwd and (ceil(s / 128), heads,
// bq / heads * segments) for bwd (heads: the query heads of one outer batch, a multiple of
// group; the grid gives each block its (outer, head) split), dynamic shared memory as
// attention::shared_bytes computes (over 48 KiB, so the host opts in); bwd needs
// dq_acc of bq t P floats (16-byte aligned: cp.async and float4 stripes read it) and
// dq_ready of bq ceil(t / QT) ints zeroed before it; with more
// than one link per key block, dq_acc also holds 2 P floats per key of every key block
// (bq / group ceil(s / 128) 128 keys) past those, and dq_ready one int per key block past
// its own, zeroed too (geometry::backward_scratch). F32 kernels and delta: block (128), grid
// (ceil(t / 4), bq) for fwd and dq, (ceil(s / 4), bq / group) for dkdv, no dynamic shared
// memory; delta: ceil(rows / (4 * 32 / att_delta_lanes(d))) blocks.
#include "castor_common.cuh"

#define ATT_PAD 8            // elements of padding per shared-memory row (bank spread)
#define ATT_THREADS 128      // threads of an F32 or delta block
#define ATT_TC_THREADS 256   // threads of a tensor-core block: 8 warps
#define ATT_FWD_ROWS 128     // query rows per tensor-core forward block: 8 warps x 16
#define ATT_BWD_KEYS 128     // keys per tensor-core backward block: 8 warps x 16
#define ATT_BWD_SEGMENT_ROWS 512  // query rows per segment of a banded backward's key block
#define ATT_LOG2E 1.4426950408889634
#define ATT_LN2 0.69314718055994531f

// Keys per forward tile by tile width P (fewer where the accumulators of P columns leave
// registers for no more), and query rows per backward tile (64 at every width: at d128 the
// backward computes a tile's scores in two halves of 32 rows, so that they fit in registers
// beside the dK and dV accumulators, while the tile's staging and dQ handoff happen once).
template <int P> struct AttShape {
    static constexpr int KEYS = P <= 64 ? 128 : 64;
    static constexpr int QROWS = P <= 64 ? 128 : 64;
};

// Where the rows of a tensor-core kernel's operand are: query (or key) batch b, split as
// (b / heads, b % heads) = (outer, h), starts at outer batch + h head, and its rows are `row`
// elements apart, each of d contiguous elements. A head of a fused QKV product
// ([B, T, 3, H, d] read as [B, H, T, d]) or a context in [B, T, H, d] is read and written in
// place this way; a dense [bq, rows, d] operand is (heads rows d, rows d, d) for any heads.
struct AttStrides {
    int batch, head, row;  // 32-bit strides, 64-bit offsets: one wide multiply-add each
    // Where head `h` of outer batch `outer` starts (the tensor-core kernels take both from
    // their grid, so no division runs).
    __device__ __forceinline__ i64 at(int outer, int h) const {
        return i64(outer) * batch + i64(h) * head;
    }
    // Every row starts 16 bytes after a 16-byte aligned base when the element offsets do.
    __device__ __forceinline__ bool rows16() const { return ((batch | head | row) & 7) == 0; }
};

// The first key the mask keeps (s when it keeps none; 0 without a mask), for mask row `m`,
// computed by warp 0 (32 bytes at a time, stopping at the first kept one) and returned to
// every thread of the block.
__device__ __forceinline__ int first_kept(const unsigned char* m, int s, int* shared_slot) {
    if (warp_index() == 0) {
        int first = m != nullptr ? s : 0;
        if (m != nullptr) {
            const int lane = threadIdx.x & 31;
            for (int j0 = 0; j0 < s; j0 += 32) {
                const unsigned kept = __ballot_sync(FULL_WARP, j0 + lane < s && m[j0 + lane] != 0);
                if (kept != 0) {
                    first = j0 + __ffs(int(kept)) - 1;
                    break;
                }
            }
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

// The first key of the packed sequence of key a >= 0, from its position: a - clamp(pos[a], 0,
// a), the CPU twin's sequence_start.
__device__ __forceinline__ int sequence_start(const i64* pos, int a) {
    const i64 p = pos[a];
    return p <= 0 ? a : p >= a ? 0 : a - int(p);
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

// Whether query row r (of t) keeps key j (of s), and whether it sees no key at all.
struct Visibility {
    int t, s, causal, window, first;  // first: the first key the row's mask keeps
    const unsigned char* keep;  // the mask bytes of the current key tile (shared), or null
    int key0;                   // the tile's first key
    // With a window and a mask: per-row flags of rows [row0, ..) that see no kept key in their
    // window (window_rows fills them); null otherwise.
    const unsigned char* empty_rows = nullptr;
    int row0 = 0;
    // Packed sequences' positions of the batch's keys (one row of s), or null.
    const i64* pos = nullptr;
    // The first key row r sees by the causal mask and the window (it grows with the row).
    __device__ __forceinline__ int lo(int r) const {
        return first_visible_key(r, t, s, causal, window);
    }
    // Where the packed sequence of row r's own key starts (0 without positions, for a row
    // past t and for one before the keys).
    __device__ __forceinline__ int start(int r) const {
        const int a = r + s - t;
        return pos != nullptr && r < t && a >= 0 ? sequence_start(pos, a) : 0;
    }
    // The first key row r < t sees: lo(r), or its sequence's start if later (which need not
    // grow with the row).
    __device__ __forceinline__ int first_key(int r) const { return max(lo(r), start(r)); }
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
// row `mrow`, one warp per row; then points `vis` at them and returns whether any row is
// empty. Only with a window and a mask (otherwise false, and nothing is filled).
__device__ __forceinline__ bool window_rows(Visibility& vis, unsigned char* flags, int* any,
                                            const unsigned char* mrow, int row0, int n) {
    if (vis.window <= 0 || mrow == nullptr) return false;
    const int warp = warp_index(), lane = threadIdx.x & 31;
    __syncthreads();  // the previous tile's flags are no longer read
    if (threadIdx.x == 0) *any = 0;
    __syncthreads();
    for (int i = warp; i < n; i += int(blockDim.x >> 5)) {
        const int r = row0 + i;
        const bool empty = r < vis.t && warp_keeps_none(mrow, vis.lo(r),
                                                       visible_keys(r, vis.t, vis.s, vis.causal));
        if (lane == 0) {
            flags[i] = empty;
            if (empty) atomicOr(any, 1);  // several warps may find one
        }
    }
    __syncthreads();
    vis.empty_rows = flags;
    vis.row0 = row0;
    return *any != 0;
}

// Dropout on the probabilities (the `_dropout` entry points): element (row, key) of the
// [bq t, s] probabilities, row-major index idx = row s + key, is kept when Philox draw idx % 4
// of block idx / 4, keyed by (seed, offset) and the stream, is below threshold, exactly as a
// dropout node over the probabilities keeps it (dropout.cu, castor_ir::philox); kept ones are
// scaled by `scale`, the F32 1 / (1 - p). A negative offset is evaluation mode: `on` is false
// and the kernels compute what the entry points without dropout do, bit for bit.
struct AttDropout {
    u64 seed = 0, threshold = 0;
    i64 offset = -1;
    unsigned stream = 0;
    float scale = 1.0f;
    bool on = false;
    // Whether elements idx and idx + 1 are kept: one Philox call when they share a block.
    __device__ __forceinline__ void kept2(i64 idx, bool& k0, bool& k1) const {
        unsigned r[4];
        dropout_draws(r, seed, offset, stream, u64(idx) >> 2);
        const int lane = int(idx & 3);
        const unsigned x0 = lane == 0 ? r[0] : lane == 1 ? r[1] : lane == 2 ? r[2] : r[3];
        k0 = u64(x0) < threshold;
        if (lane < 3) {
            const unsigned x1 = lane == 0 ? r[1] : lane == 1 ? r[2] : r[3];
            k1 = u64(x1) < threshold;
        } else {
            dropout_draws(r, seed, offset, stream, (u64(idx) >> 2) + 1);
            k1 = u64(r[0]) < threshold;
        }
    }
    __device__ __forceinline__ bool kept(i64 idx) const {
        unsigned r[4];
        dropout_draws(r, seed, offset, stream, u64(idx) >> 2);
        const int lane = int(idx & 3);
        const unsigned x = lane == 0 ? r[0] : lane == 1 ? r[1] : lane == 2 ? r[2] : r[3];
        return u64(x) < threshold;
    }
};

// The dropout of the `_dropout` entry points' arguments (the key in device memory).
__device__ __forceinline__ AttDropout att_dropout(const i64* key, unsigned stream, u64 threshold,
                                                  double scale) {
    AttDropout dr;
    dr.seed = u64(key[0]);
    dr.offset = key[1];
    dr.stream = stream;
    dr.threshold = threshold;
    dr.scale = float(scale);
    dr.on = dr.offset >= 0;
    return dr;
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


// Copies rows [r0, r0 + ROWS) of N [n, d] matrices src[m] (rows ld[m] elements apart) into
// shared memory as [ROWS][P + ATT_PAD] tiles dst[m], zero past n and past d: with `vec` (d and
// every ld a multiple of 8, the matrices 16-byte aligned) by 16-byte cp.async copies the
// caller commits and waits for, else element by element.
template <typename T, int P, int ROWS, int N>
__device__ __forceinline__ void load_tiles(T* const (&dst)[N], const T* const (&src)[N],
                                           const int (&ld)[N], int r0, int n, int d, bool vec) {
    constexpr int LD = P + ATT_PAD, CHUNKS = P / 8, STEP = ATT_TC_THREADS / CHUNKS;
    if (vec) {
        // Each thread copies one 16-byte column chunk of every STEP-th row.
        const int r = threadIdx.x / CHUNKS, col = (threadIdx.x % CHUNKS) * 8;
        const bool col_ok = col < d;
#pragma unroll
        for (int m = 0; m < N; ++m) {
            const T* from = src[m] + i64(r0 + r) * ld[m] + col;
            T* to = dst[m] + r * LD + col;
#pragma unroll
            for (int it = 0; it < (ROWS + STEP - 1) / STEP; ++it) {
                if (ROWS % STEP == 0 || r + it * STEP < ROWS) {
                    const bool ok = col_ok && r0 + r + it * STEP < n;
                    cp_async16(to + it * STEP * LD, ok ? from : src[m], ok);
                }
                from += i64(STEP) * ld[m];
            }
        }
    } else {
        static_assert(N <= 2, "one loop takes at most two matrices");
#pragma unroll 1
        for (int idx = threadIdx.x; idx < N * ROWS * P; idx += ATT_TC_THREADS) {
            const int r = idx / P % ROWS, col = idx % P, row = r0 + r;
            const bool second = idx >= ROWS * P;
            const T* from = second ? src[N - 1] : src[0];
            const int stride = second ? ld[N - 1] : ld[0];
            T* to = second ? dst[N - 1] : dst[0];
            to[r * LD + col] =
                (row < n && col < d) ? from[i64(row) * stride + col] : from_f32<T>(0.0f);
        }
    }
}
template <typename T, int P, int ROWS>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int ld, int r0, int n, int d,
                                          bool vec) {
    T* const to[1] = {dst};
    const T* const from[1] = {src};
    const int lds[1] = {ld};
    load_tiles<T, P, ROWS, 1>(to, from, lds, r0, n, d, vec);
}

// Stores the pair (x0, x1) at columns col, col + 1 of a row of d elements, as T, dropping
// columns past d; one 4-byte store when `pairs` (d even and the row 4-byte aligned).
template <typename T>
__device__ __forceinline__ void store_pair(T* row, int col, int d, float x0, float x1,
                                           bool pairs) {
    if (pairs && col < d) {
        *reinterpret_cast<unsigned*>(row + col) = pack2<T>(x0, x1);
    } else {
        if (col < d) row[col] = from_f32<T>(x0);
        if (col + 1 < d) row[col + 1] = from_f32<T>(x1);
    }
}

// Copies `rows` rows of d elements from `n` shared tiles (LD = P + ATT_PAD per row) to global
// rows ld[m] elements apart (tile m to dst[m]), the calling warp alone: by 16-byte vectors with
// `vec` (d and every ld a multiple of 8, every dst 16-byte aligned), else element by element.
// Once per block, so not unrolled.
template <typename T, int P, int N>
__device__ __forceinline__ void store_rows(T* const (&dst)[N], const T* const (&tile)[N],
                                           const int (&ld)[N], int rows, int d, bool vec) {
    constexpr int LD = P + ATT_PAD, CHUNKS = P / 8;
    const int lane = threadIdx.x & 31;
    if (vec) {
#pragma unroll
        for (int m = 0; m < N; ++m) {
#pragma unroll 1
            for (int idx = lane; idx < rows * CHUNKS; idx += 32) {
                const int r = idx / CHUNKS, col = (idx % CHUNKS) * 8;
                if (col < d)
                    *reinterpret_cast<uint4*>(dst[m] + i64(r) * ld[m] + col) =
                        *reinterpret_cast<const uint4*>(tile[m] + r * LD + col);
            }
        }
    } else {
#pragma unroll
        for (int m = 0; m < N; ++m) {
#pragma unroll 1
            for (int r = 0; r < rows; ++r) {
#pragma unroll 1
                for (int col = lane; col < d; col += 32)
                    dst[m][i64(r) * ld[m] + col] = tile[m][r * LD + col];
            }
        }
    }
}

// The bits of a 64-bit word below bit n (none for n <= 0, all for n >= 64).
__device__ __forceinline__ u64 below64(int n) {
    return n <= 0 ? 0ull : n >= 64 ? ~0ull : (1ull << n) - 1ull;
}

// The A fragment of P (rows of 16, keys kc*16..+16) from score accumulators 2kc and 2kc + 1,
// each value rounded to T as it enters the product.
template <typename T, int N>
__device__ __forceinline__ void frag_from_acc(unsigned (&a)[4], const float (&acc)[N][4], int kc) {
    a[0] = pack2<T>(acc[2 * kc][0], acc[2 * kc][1]);
    a[1] = pack2<T>(acc[2 * kc][2], acc[2 * kc][3]);
    a[2] = pack2<T>(acc[2 * kc + 1][0], acc[2 * kc + 1][1]);
    a[3] = pack2<T>(acc[2 * kc + 1][2], acc[2 * kc + 1][3]);
}

// Shared-memory row addresses each lane gives ldmatrix (LD elements per row):
// a_rows: the A fragment of rows [row0, row0 + 16), columns [col0, col0 + 16);
// bt_rows: the B fragments of X^T for two 8-row tiles of X, rows [row0, row0 + 16), columns
//          [col0, col0 + 16) (ldsm_x4: r[0], r[1] tile 0, r[2], r[3] tile 1);
// b_rows: the B fragments of X for rows [row0, row0 + 16), two 8-column tiles from col0
//         (ldsm_x4_t: r[0], r[1] tile 0, r[2], r[3] tile 1; ldsm_x2_t: tile 0).
template <int LD, typename T>
__device__ __forceinline__ const T* a_rows(const T* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31;
    return tile + (row0 + (lane & 15)) * LD + col0 + (lane >> 4) * 8;
}
template <int LD, typename T>
__device__ __forceinline__ const T* bt_rows(const T* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31;
    return tile + (row0 + (lane & 7) + ((lane >> 4) << 3)) * LD + col0 + ((lane >> 3) & 1) * 8;
}
template <int LD, typename T>
__device__ __forceinline__ const T* b_rows(const T* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31;
    return tile + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + col0 + (lane >> 4) * 8;
}

// ---- forward -----------------------------------------------------------------------------

// Copies key tile [key0, key0 + KEYS) of K and V, and its mask bytes, into buffer `buf`.
template <typename T, int P>
__device__ __forceinline__ void stage_keys(T* ks, T* vs, unsigned char* keep, const T* kb,
                                           const T* vb, const int (&ld)[2],
                                           const unsigned char* mrow, int key0, int s, int d,
                                           bool vec, int buf) {
    constexpr int LD = P + ATT_PAD, KEYS = AttShape<P>::KEYS;
    T* const to[2] = {ks + buf * KEYS * LD, vs + buf * KEYS * LD};
    const T* const from[2] = {kb, vb};
    load_tiles<T, P, KEYS, 2>(to, from, ld, key0, s, d, vec);
    if (mrow != nullptr) {
        for (int j = threadIdx.x; j < KEYS; j += ATT_TC_THREADS)
            keep[buf * KEYS + j] = key0 + j < s ? mrow[key0 + j] : 0;
    }
}

template <typename T, int P, bool DROP, bool POS>
__device__ void att_fwd(const T* q, const T* k, const T* v, const unsigned char* mask,
                        const i64* positions, T* o, float* lse, int t, int s, int d, int group,
                        int mask_group, int causal,
                        int window, float scale_log2, AttStrides sq, AttStrides sk,
                        AttStrides sv, AttStrides so, AttDropout dr) {
    if constexpr (!POS) positions = nullptr;  // the plain entry points compile it out
    constexpr int LD = P + ATT_PAD, KEYS = AttShape<P>::KEYS, ROWS = ATT_FWD_ROWS;
    constexpr int NT = KEYS / 8, DT = P / 16, OT = P / 8, WORDS = KEYS / 64;
    CASTOR_DYNAMIC_SHARED(att_smem);
    T* qs = reinterpret_cast<T*>(att_smem);                                   // [ROWS][LD]
    T* ks = qs + ROWS * LD;                                                   // [2][KEYS][LD]
    T* vs = ks + 2 * KEYS * LD;                                               // [2][KEYS][LD]
    unsigned char* keep = reinterpret_cast<unsigned char*>(vs + 2 * KEYS * LD);  // [2][KEYS]
    __shared__ int first_slot, any_empty;
    __shared__ unsigned char empty_rows[ROWS];
    __shared__ int warp_lo[ROWS / 16];  // each warp's least first key

    // Query head h of outer batch `outer`, query batch b; 32-bit (grid dimensions), and no
    // 64-bit divisions below.
    const int h = blockIdx.y, outer = blockIdx.z, b = outer * int(gridDim.y) + h;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * ROWS;
    const int warp = warp_index(), lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const T* qb = q + sq.at(outer, h);
    const T* kb = k + sk.at(outer, h / group);
    const T* vb = v + sv.at(outer, h / group);
    const int kv_ld[2] = {sk.row, sv.row};
    const unsigned char* mrow = mask ? mask + i64(b / mask_group) * s : nullptr;
    Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), nullptr, 0};
    vis.pos = positions ? positions + i64(b / mask_group) * s : nullptr;
    const bool some_empty = window_rows(vis, empty_rows, &any_empty, mrow, r0, ROWS);
    const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) &&
                     sq.rows16() && sk.rows16() && sv.rows16();
    load_tile<T, P, ROWS>(qs, qb, sq.row, r0, t, d, vec);

    // This lane's two rows, and what the warp's 16 rows see: keys [see_lo, see_hi) hold every
    // key any of them sees; [full_lo, full_hi) the keys all of them see (causal, window,
    // positions).
    const int wr0 = r0 + warp * 16, wlast = min(wr0 + 15, t - 1);
    const bool active = wr0 < t;
    const int rows[2] = {wr0 + g, wr0 + g + 8};
    bool none_r[2];
    int lo_r[2], hi_r[2];
    const int start_r[2] = {vis.start(rows[0]), vis.start(rows[1])};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        none_r[h] = vis.none(rows[h]);  // rows past t count as none: never stored
        lo_r[h] = none_r[h] ? 0 : max(vis.lo(rows[h]), start_r[h]);
        hi_r[h] = none_r[h] ? s : visible_keys(rows[h], t, s, causal);
    }
    const bool wnone = __any_sync(FULL_WARP, (rows[0] < t && none_r[0]) || (rows[1] < t && none_r[1]));
    const int see_hi = active ? visible_keys(wlast, t, s, causal) : 0;
    const int full_hi = active ? visible_keys(wr0, t, s, causal) : 0;
    // The least and greatest first key of the warp's rows (its first and last row's, but for
    // positions, which need not grow with the row; which rows see none does not matter here).
    const int see_lo = __reduce_min_sync(FULL_WARP, min(rows[0] < t ? lo_r[0] : s,
                                                        rows[1] < t ? lo_r[1] : s));
    const int full_lo = __reduce_max_sync(FULL_WARP, max(lo_r[0], lo_r[1]));

    // Keys the block needs: from the least first key of its rows to the last key its last row
    // sees, or all when a row sees none (visible_keys grows with the row: the first row is
    // the one that might see none before the mask's first kept key).
    const int last_row = min(r0 + ROWS, t) - 1;
    const bool uniform = some_empty || vis.first >= visible_keys(r0, t, s, causal);
    const int kend = uniform ? s : visible_keys(last_row, t, s, causal);
    if (lane == 0) warp_lo[warp] = see_lo;
    __syncthreads();
    int block_lo = warp_lo[0];
#pragma unroll
    for (int w = 1; w < ROWS / 16; ++w) block_lo = min(block_lo, warp_lo[w]);
    const int kstart = uniform ? 0 : block_lo / KEYS * KEYS;

    float m2[2] = {F32_NEG_INF, F32_NEG_INF};  // running max of s scale log2(e)
    float l[2] = {0.0f, 0.0f};                 // this lane's part of the running sum
    float acc[OT][4];
#pragma unroll
    for (int i = 0; i < OT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    unsigned qf[DT][4];
    // Each lane's ldmatrix rows in the K and V tiles, taken once: a fragment adds a constant
    // and a staged tile its buffer's offset.
    constexpr int ES = int(sizeof(T));
    const SmemAddr ks_bt = smem_addr(bt_rows<LD>(ks, 0, 0));
    const SmemAddr vs_b = smem_addr(b_rows<LD>(vs, 0, 0));

    // Tile key0 - KEYS only stages the first tile; every later iteration stages the next one
    // while it computes on its own.
    for (int key0 = kstart - KEYS, buf = 1; key0 < kend; key0 += KEYS, buf ^= 1) {
        const bool more = key0 + KEYS < kend;
        if (more)
            stage_keys<T, P>(ks, vs, keep, kb, vb, kv_ld, mrow, key0 + KEYS, s, d, vec, buf ^ 1);
        cp_async_commit();
        if (key0 < kstart) continue;
        if (more) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (key0 == kstart) {
            // A row that sees no key gets Q = 0, so all its scores are 0 (uniform attention).
#pragma unroll
            for (int kk = 0; kk < DT; ++kk) {
                ldsm_x4(qf[kk], a_rows<LD>(qs, warp * 16, kk * 16));
                if (none_r[0]) qf[kk][0] = qf[kk][2] = 0u;
                if (none_r[1]) qf[kk][1] = qf[kk][3] = 0u;
            }
        }
        const int staged = buf * KEYS * LD * ES;  // the tile's buffer, in bytes
        const unsigned char* kp = keep + buf * KEYS;
        // The tile's mask bytes as bits: bit j of word w keeps key key0 + 64 w + j.
        u64 kbits[WORDS];
#pragma unroll
        for (int w = 0; w < WORDS; ++w) {
            kbits[w] = ~0ull;
            if (mrow != nullptr) {
                const u64 lo = __ballot_sync(FULL_WARP, kp[64 * w + lane] != 0);
                const u64 hi = __ballot_sync(FULL_WARP, kp[64 * w + 32 + lane] != 0);
                kbits[w] = lo | (hi << 32);
            }
        }
        bool tile_kept = key0 + KEYS <= s;
#pragma unroll
        for (int w = 0; w < WORDS; ++w) tile_kept = tile_kept && kbits[w] == ~0ull;
        const bool skip = !active || (!wnone && (key0 >= see_hi || key0 + KEYS <= see_lo));
        if (!skip) {
            float sc[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < DT; ++kk) {
#pragma unroll
                for (int n2 = 0; n2 < NT / 2; ++n2) {
                    unsigned bk[4];
                    ldsm_x4_at(bk, ks_bt + staged + (n2 * 16 * LD + kk * 16) * ES);
                    mma_packed<T>(sc[2 * n2], qf[kk], bk[0], bk[1]);
                    mma_packed<T>(sc[2 * n2 + 1], qf[kk], bk[2], bk[3]);
                }
            }
            const bool plain =
                !wnone && tile_kept && key0 + KEYS <= full_hi && key0 >= full_lo;
            if (!plain) {
                // Which keys of the tile each of this lane's rows keeps, as bits shifted so
                // that an element's bit is the same for every lane; a row that sees none
                // keeps every key before s (its scores are 0: its Q row is).
                u64 rbits[2][WORDS];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#pragma unroll
                    for (int w = 0; w < WORDS; ++w) {
                        const int a = lo_r[h] - key0 - 64 * w, z = hi_r[h] - key0 - 64 * w;
                        const u64 kept = none_r[h] ? ~0ull : kbits[w];
                        rbits[h][w] = (below64(z) & ~below64(a) & kept) >> (2 * c);
                    }
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int h = e >> 1, bit = (n * 8) % 64 + (e & 1);
                        if (!((rbits[h][n * 8 / 64] >> bit) & 1ull)) sc[n][e] = F32_NEG_INF;
                    }
                }
            }
            float corr[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = F32_NEG_INF;
#pragma unroll
                for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * h], sc[n][2 * h + 1]));
                const float mn = fmaxf(m2[h], quad_max(mx) * scale_log2);
                // A row with nothing kept yet keeps m = -inf: exp against 0 gives 0, not NaN.
                const float base = mn == F32_NEG_INF ? 0.0f : mn;
                corr[h] = exp2_approx(m2[h] - base);
                m2[h] = mn;
                float part = 0.0f;
#pragma unroll
                for (int n = 0; n < NT; ++n) {
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        sc[n][e] = exp2_approx(fmaf(sc[n][e], scale_log2, -base));
                        part += sc[n][e];
                    }
                }
                l[h] = l[h] * corr[h] + part;
            }
            if constexpr (DROP) {
                // The dropped probabilities leave the product (l keeps them: lse is the
                // undropped scores'); the kept ones are scaled with o below.
                if (dr.on) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if (rows[h] >= t) continue;
                        const i64 base = (i64(b) * t + rows[h]) * s + key0 + 2 * c;
#pragma unroll
                        for (int n = 0; n < NT; ++n) {
                            bool k0, k1;
                            dr.kept2(base + n * 8, k0, k1);
                            if (!k0) sc[n][2 * h] = 0.0f;
                            if (!k1) sc[n][2 * h + 1] = 0.0f;
                        }
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < OT; ++i) {
                acc[i][0] *= corr[0];
                acc[i][1] *= corr[0];
                acc[i][2] *= corr[1];
                acc[i][3] *= corr[1];
            }
#pragma unroll
            for (int kc = 0; kc < KEYS / 16; ++kc) {
                unsigned a[4];
                frag_from_acc<T>(a, sc, kc);
#pragma unroll
                for (int i2 = 0; i2 < OT / 2; ++i2) {
                    unsigned bv[4];
                    ldsm_x4_t_at(bv, vs_b + staged + (kc * 16 * LD + i2 * 16) * ES);
                    mma_packed<T>(acc[2 * i2], a, bv[0], bv[1]);
                    mma_packed<T>(acc[2 * i2 + 1], a, bv[2], bv[3]);
                }
            }
        }
        __syncthreads();  // the buffer is refilled next
    }
    cp_async_wait<0>();
    if (!active) return;
    // o = O / l through the warp's own rows of the Q tile (no longer read), then out by rows.
    T* ow = qs + warp * 16 * LD;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(l[h]);
        float inv = rcp_approx(sum);
        if constexpr (DROP) {
            if (dr.on) inv = inv * dr.scale;
        }
#pragma unroll
        for (int i = 0; i < OT; ++i)
            *reinterpret_cast<unsigned*>(ow + (g + 8 * h) * LD + i * 8 + 2 * c) =
                pack2<T>(acc[i][2 * h] * inv, acc[i][2 * h + 1] * inv);
        if (c == 0 && rows[h] < t)
            lse[i64(b) * t + rows[h]] = (m2[h] + log2_approx(sum)) * ATT_LN2;
    }
    __syncwarp();
    T* const to[1] = {o + so.at(outer, h) + i64(wr0) * so.row};
    const T* const from[1] = {ow};
    const int o_ld[1] = {so.row};
    store_rows<T, P, 1>(to, from, o_ld, min(16, t - wr0), d,
                        d % 8 == 0 && aligned16(o) && so.rows16());
}

// ---- backward: delta ---------------------------------------------------------------------

// Lanes that sum one row of d elements: one per 16-byte unit, rounded up to a power of two,
// at most a warp (geometry.rs's delta_lanes).
__host__ __device__ __forceinline__ int att_delta_lanes(int d) {
    const int units = (d + UNIT - 1) / UNIT;
    int lanes = 1;
    while (lanes < units && lanes < 32) lanes <<= 1;
    return lanes;
}

template <typename T>
__device__ void att_delta(const T* o, const T* d_o, float* delta, i64 rows, int t, int d,
                          int heads, AttStrides so, AttStrides sdo) {
    const int lanes = att_delta_lanes(d);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int l = lane & (lanes - 1);
    const i64 row = (i64(blockIdx.x) * (ATT_THREADS / 32) + warp) * (32 / lanes) + lane / lanes;
    // Every lane takes part in the shuffles below; a lane past the last row sums nothing.
    double acc = 0.0;
    if (row < rows) {
        const int b = int(row / t), r = int(row % t), outer = b / heads, h = b % heads;
        const T* orow = o + so.at(outer, h) + i64(r) * so.row;
        const T* dorow = d_o + sdo.at(outer, h) + i64(r) * sdo.row;
        if (d % UNIT == 0 && aligned16(o) && aligned16(d_o) && so.rows16() && sdo.rows16()) {
            for (int j = l * UNIT; j < d; j += lanes * UNIT) {
                float a[UNIT], x[UNIT];
                load8(dorow + j, a);
                load8(orow + j, x);
#pragma unroll
                for (int u = 0; u < UNIT; ++u) acc += double(a[u]) * double(x[u]);
            }
        } else {
            for (int j = l; j < d; j += lanes)
                acc += double(to_f32(dorow[j])) * double(to_f32(orow[j]));
        }
    }
    // The row's lanes are adjacent: a butterfly over offsets below `lanes` stays inside them.
    for (int off = lanes >> 1; off > 0; off >>= 1) acc += __shfl_xor_sync(FULL_WARP, acc, off);
    if (row < rows && l == 0) delta[row] = float(acc);
}

// ---- backward: one pass over key blocks ---------------------------------------------------

// Whether some row of a query batch may see no kept key, and so attend to every key: a row
// before the mask's first kept key (with no mask: causal with t > s), or, with a window over
// a mask, a row whose window the mask may empty (assumed rather than scanned for).
__device__ __forceinline__ bool may_see_none(const Visibility& vis, bool masked) {
    return vis.first >= visible_keys(0, vis.t, vis.s, vis.causal) || (vis.window > 0 && masked);
}

// The key blocks [lo, hi] of KB keys that query tile qt (rows qt QROWS ..) reads, given the
// least first key of its rows `tile_lo`; every block computes the same for a tile, which is
// how they agree on who adds to dQ in which order.
template <int KB, int QROWS>
__device__ __forceinline__ void tile_key_blocks(const Visibility& vis, bool maybe_none, int qt,
                                                int tile_lo, int nkb, int& lo, int& hi) {
    if (maybe_none) {
        lo = 0;
        hi = nkb - 1;
        return;
    }
    const int rl = min(qt * QROWS + QROWS, vis.t) - 1;
    lo = int(unsigned(tile_lo) / KB);  // tile_lo >= 0: a shift
    hi = (visible_keys(rl, vis.t, vis.s, vis.causal) - 1) / KB;
}

// The segments a backward key block's query tiles split into: ATT_BWD_SEGMENT_ROWS rows each
// where the mask is banded (causal or windowed: the key blocks' work differs, the first one's
// most), else one. geometry.rs computes the same.
__device__ __forceinline__ int att_bwd_segments(int t, int qrows, int causal, int window) {
    const int nqt = (t + qrows - 1) / qrows, per = ATT_BWD_SEGMENT_ROWS / qrows;
    return causal || window > 0 ? max(1, (nqt + per - 1) / per) : 1;
}

// Bits [lo, hi] (inclusive, clamped to [0, 64)) of a 64-bit word.
__device__ __forceinline__ u64 bit_range(int lo, int hi) {
    lo = max(lo, 0);
    hi = min(hi, 63);
    if (hi < lo) return 0ull;
    return ((~0ull) >> (63 - hi)) & ~((1ull << lo) - 1ull);
}

template <typename T, int P, bool DROP, bool POS>
__device__ void att_bwd(const T* q, const T* k, const T* v, const unsigned char* mask,
                        const i64* positions, const T* d_o, const float* lse,
                        const float* delta, T* dq, T* dk, T* dv, float* dq_acc, int* dq_ready,
                        int t, int s, int d, int group,
                        int mask_group, int causal, int window, float scale, float scale_log2,
                        AttStrides sq, AttStrides sk, AttStrides sv, AttStrides sdo,
                        AttStrides sdq, AttStrides sdk, AttStrides sdv, AttDropout dr) {
    if constexpr (!POS) positions = nullptr;  // the plain entry points compile it out
    constexpr int KB = ATT_BWD_KEYS, QT = AttShape<P>::QROWS, LD = P + ATT_PAD;
    constexpr int LDS = QT + ATT_PAD, LDA = P + ATT_PAD, DT = P / 16, OT = P / 8;
    // S^T and dP^T take the tile's rows in two halves of QH (NH 8-row tiles each): a whole
    // tile's would not fit in registers beside dK and dV.
    constexpr int QH = QT / 2, NH = QH / 8;
    // The dQ product's warps: MT tiles of 16 query rows, CW warps on each, NW 8-column tiles
    // per warp.
    constexpr int MT = QT / 16, CW = 8 / MT, NW = P / 8 / CW;
    CASTOR_DYNAMIC_SHARED(att_smem);
    T* ks = reinterpret_cast<T*>(att_smem);  // [KB][LD]
    T* vs = ks + KB * LD;                    // [KB][LD]
    T* qs = vs + KB * LD;                    // [2][QT][LD]
    T* dos = qs + 2 * QT * LD;               // [2][QT][LD]
    T* dst = dos + 2 * QT * LD;              // [KB][LDS]: the tile's dS^T, as T
    // [QT][LDA]: the tile's dQ sum of the blocks above this one, copied while the share's
    // product runs.
    float* above_s = reinterpret_cast<float*>(dst + KB * LDS);
    float* lse_s = above_s + QT * LDA;                          // [2][QT]: lse log2(e)
    float* delta_s = lse_s + 2 * QT;                            // [2][QT]
    unsigned char* keep = reinterpret_cast<unsigned char*>(delta_s + 2 * QT);  // [KB]
    __shared__ int first_slot, any_empty;
    __shared__ unsigned char empty_rows[QT];
    // Per staged tile: each row's sequence start, and the least and greatest first key of its
    // rows per warp of 32; with positions, the last row that reads this block's keys.
    __shared__ int starts[2][QT];
    __shared__ int first_keys[2][QT / 32][2];
    __shared__ int reading;

    const int nkb = gridDim.x, kb = nkb - 1 - blockIdx.x, key0 = kb * KB;
    // Query head qh of outer batch `outer` (query batch b), segment seg of its query tiles;
    // key head hk = qh / group. The block is one link of the chain that sums its key block's
    // dK and dV (below, after the loop).
    const int nqt = (t + QT - 1) / QT, per_seg = ATT_BWD_SEGMENT_ROWS / QT;
    const int segs = att_bwd_segments(t, QT, causal, window);
    const int outer = int(blockIdx.z) / segs, seg = int(blockIdx.z) - outer * segs;
    const int heads = gridDim.y, qh = blockIdx.y, hk = qh / group, b = outer * heads + qh;
    const int warp = warp_index(), lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int j0 = key0 + warp * 16;
    const int keys[2] = {j0 + g, j0 + g + 8};
    const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) &&
                     aligned16(d_o) && sq.rows16() && sk.rows16() && sv.rows16() &&
                     sdo.rows16();
    {
        T* const to[2] = {ks, vs};
        const T* const from[2] = {k + sk.at(outer, hk), v + sv.at(outer, hk)};
        const int ld[2] = {sk.row, sv.row};
        load_tiles<T, P, KB, 2>(to, from, ld, key0, s, d, vec);
    }
    cp_async_commit();

    float acc_k[OT][4], acc_v[OT][4];
#pragma unroll
    for (int i = 0; i < OT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc_k[i][e] = acc_v[i][e] = 0.0f;
#if defined(__CUDA_ARCH__)
            // Opaque to the optimizer (no instruction): a block that reads no tile would
            // otherwise get a copy of the end of the kernel of its own, with constant zeros.
            asm volatile("" : "+f"(acc_k[i][e]), "+f"(acc_v[i][e]));
#endif
        }
    // Whether this block's segment has a tile that reads its keys (else its link of the dK and
    // dV chain adds nothing).
    bool reads_tiles = false;

    {
        const int mrow_index = b / mask_group;
        const unsigned char* mrow = mask ? mask + i64(mrow_index) * s : nullptr;
        const i64* prow = positions ? positions + i64(mrow_index) * s : nullptr;
        if (mrow != nullptr && threadIdx.x < KB)
            keep[threadIdx.x] = key0 + int(threadIdx.x) < s ? mrow[key0 + threadIdx.x] : 0;
        if (threadIdx.x == 0) reading = -1;
        Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot),
                       mrow ? keep : nullptr, key0};
        vis.pos = prow;
        const bool maybe_none = may_see_none(vis, mrow != nullptr);
        // The tiles of this batch that read this block's keys: a run [qa, qz].
        int qa = nqt, qz = -1;
        if (prow == nullptr || maybe_none) {
#pragma unroll 1
            for (int qt = 0; qt < nqt; ++qt) {
                int lo, hi;
                tile_key_blocks<KB, QT>(vis, maybe_none, qt, vis.lo(qt * QT), nkb, lo, hi);
                if (lo <= kb && kb <= hi) {
                    qa = min(qa, qt);
                    qz = qt;
                }
            }
        } else {
            // With positions (causal, t <= s): from the tile whose last row sees key0, up to
            // the last row whose sequence starts before the block's end (and whose window
            // does), which the block's threads find, a row each. A tile inside the run whose
            // rows all start past the block is passed over below.
            const int end = key0 + KB;
            const int rows = window > 0 ? min(t, end - 1 + window + t - s) : t;
            qa = int(unsigned(max(0, key0 + t - s)) / QT);
            int last = -1;
#pragma unroll 1
            for (int r = qa * QT + int(threadIdx.x); r < rows; r += ATT_TC_THREADS)
                if (sequence_start(prow, r + s - t) < end) last = r;
            atomicMax(&reading, last);
            __syncthreads();
            qz = reading >= 0 ? int(unsigned(reading) / QT) : -1;
        }
        // This segment's share of the run.
        qa = max(qa, seg * per_seg);
        qz = min(qz, seg * per_seg + per_seg - 1);
        reads_tiles = qa <= qz;
        if (reads_tiles) {
            // This lane's keys: whether each is before s, and kept by the mask.
            bool jin[2], jok[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                jin[h] = keys[h] < s;
                jok[h] = jin[h] && (mrow == nullptr || keep[keys[h] - key0] != 0);
            }
            const bool keys_kept = __all_sync(FULL_WARP, jok[0] && jok[1]);
            const T* qb = q + sq.at(outer, qh);
            const T* dob = d_o + sdo.at(outer, qh);
            const int q_ld[2] = {sq.row, sdo.row};

            // Each lane's ldmatrix rows in the tiles, taken once: a fragment adds a constant
            // (and a staged tile its buffer's offset).
            constexpr int ES = int(sizeof(T));
            const int mt = warp % MT, col0 = (warp / MT) * NW * 8;
            const SmemAddr ks_a = smem_addr(a_rows<LD>(ks, warp * 16, 0));
            const SmemAddr vs_a = smem_addr(a_rows<LD>(vs, warp * 16, 0));
            const SmemAddr qs_bt = smem_addr(bt_rows<LD>(qs, 0, 0));
            const SmemAddr dos_bt = smem_addr(bt_rows<LD>(dos, 0, 0));
            const SmemAddr qs_b = smem_addr(b_rows<LD>(qs, 0, 0));
            const SmemAddr dos_b = smem_addr(b_rows<LD>(dos, 0, 0));
            const SmemAddr ks_b = smem_addr(b_rows<LD>(ks, 0, col0));
            const SmemAddr dst_t = smem_addr(dst + (((lane >> 4) << 3) + (lane & 7)) * LDS +
                                             mt * 16 + ((lane >> 3) & 1) * 8);

            // Tile qa - 1 only stages tile qa; every later one stages the next while it computes.
            for (int qt = qa - 1, buf = 1; qt <= qz; ++qt, buf ^= 1) {
                const bool more = qt < qz;
                if (more) {
                    const int n0 = (qt + 1) * QT;
                    T* const to[2] = {qs + (buf ^ 1) * QT * LD, dos + (buf ^ 1) * QT * LD};
                    const T* const from[2] = {qb, dob};
                    load_tiles<T, P, QT, 2>(to, from, q_ld, n0, t, d, vec);
                    // Each row's sequence start (0 without positions), which the scores are tested
                    // against, and the least and greatest first key of the tile's rows (causal,
                    // window and positions), per warp of 32 rows.
                    int key_lo = s, key_hi = 0;
                    if (threadIdx.x < QT) {
                        const int r = n0 + threadIdx.x;
                        const i64 at = i64(b) * t + r;
                        lse_s[(buf ^ 1) * QT + threadIdx.x] =
                            r < t ? lse[at] * float(ATT_LOG2E) : F32_INF;
                        delta_s[(buf ^ 1) * QT + threadIdx.x] = r < t ? delta[at] : 0.0f;
                        if constexpr (POS) {
                            const int start = vis.start(r);
                            starts[buf ^ 1][threadIdx.x] = start;
                            if (r < t) key_lo = key_hi = max(vis.lo(r), start);
                        }
                    }
                    if constexpr (POS) {
                        const int least = __reduce_min_sync(FULL_WARP, key_lo);
                        const int most = __reduce_max_sync(FULL_WARP, key_hi);
                        if (lane == 0 && warp < QT / 32) {
                            first_keys[buf ^ 1][warp][0] = least;
                            first_keys[buf ^ 1][warp][1] = most;
                        }
                    }
                }
                cp_async_commit();
                if (qt < qa) continue;
                if (more) {
                    cp_async_wait<1>();
                } else {
                    cp_async_wait<0>();
                }
                const int q0 = qt * QT, qlast = min(q0 + QT, t) - 1;
                window_rows(vis, empty_rows, &any_empty, mrow, q0, QT);
                __syncthreads();
                // The least and greatest first key of the tile's rows: its first and last row's
                // (the first key grows with the row), but for positions.
                int tile_lo = vis.lo(q0), tile_hi = vis.lo(qlast);
                if constexpr (POS) {
                    tile_lo = first_keys[buf][0][0];
                    tile_hi = first_keys[buf][0][1];
#pragma unroll
                    for (int w = 1; w < QT / 32; ++w) {
                        tile_lo = min(tile_lo, first_keys[buf][w][0]);
                        tile_hi = max(tile_hi, first_keys[buf][w][1]);
                    }
                }
                if (!maybe_none && tile_lo >= key0 + KB) {
                    // No row of the tile sees the block (positions may leave such a tile inside
                    // the run): it takes no part in the tile's dQ.
                    __syncthreads();  // first_keys[buf] is rewritten next
                    continue;
                }
                const int staged = buf * QT * LD * ES;  // the tile's buffer, in bytes
                const float* l2 = lse_s + buf * QT;
                const float* dl = delta_s + buf * QT;
                T* my_dst = dst + warp * 16 * LDS;
                // The tile's rows in two halves (QH rows each): S^T, dP^T, dS^T and their
                // products into dK and dV one half at a time; the tile's other work once.
#pragma unroll 1
                for (int hq = 0; hq < QT; hq += QH) {
                    const int r0 = q0 + hq;  // the half's first row: bit 0 of the masks below
                    const bool skip =
                        !maybe_none && (j0 >= visible_keys(min(r0 + QH, t) - 1, t, s, causal) ||
                                        j0 + 16 <= tile_lo);
                    if (skip) {
                        // The warp's keys are not seen by the half: its dS^T rows are zero.
#pragma unroll
                        for (int i = lane; i < 16 * QH / 8; i += 32)
                            *reinterpret_cast<uint4*>(my_dst + (i / (QH / 8)) * LDS + hq +
                                                      (i % (QH / 8)) * 8) =
                                make_uint4(0u, 0u, 0u, 0u);
                    } else {
                        float st[NH][4], dpt[NH][4];
#pragma unroll
                        for (int n = 0; n < NH; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
#pragma unroll
                        for (int kk = 0; kk < DT; ++kk) {
                            unsigned ak[4], av[4];
                            ldsm_x4_at(ak, ks_a + kk * 16 * ES);
                            ldsm_x4_at(av, vs_a + kk * 16 * ES);
#pragma unroll
                            for (int n2 = 0; n2 < NH / 2; ++n2) {
                                unsigned bq[4], bo[4];
                                const int at = staged + ((hq + n2 * 16) * LD + kk * 16) * ES;
                                ldsm_x4_at(bq, qs_bt + at);
                                ldsm_x4_at(bo, dos_bt + at);
                                mma_packed<T>(st[2 * n2], ak, bq[0], bq[1]);       // S^T
                                mma_packed<T>(st[2 * n2 + 1], ak, bq[2], bq[3]);
                                mma_packed<T>(dpt[2 * n2], av, bo[0], bo[1]);      // dP^T
                                mma_packed<T>(dpt[2 * n2 + 1], av, bo[2], bo[3]);
                            }
                        }
                        const bool plain = !maybe_none && keys_kept &&
                                           j0 + 16 <= visible_keys(r0, t, s, causal) &&
                                           j0 >= tile_hi;
                        if (!plain) {
                            // Per key of this lane, the half's queries whose score it keeps
                            // (`kept`) and those that see no kept key (`zero`: score 0, kept for
                            // keys before s), as bits of the query index from r0 shifted by 2c,
                            // so that an element's bit is the same for every lane. The rows that
                            // see a key j form a range: causal: j < r + 1 + s - t; window:
                            // r + 1 + s - t - window <= j (or s - window <= j when every row sees
                            // all s keys).
                            u64 zero = 0;
#pragma unroll
                            for (int w = 0; w < QH / 32; ++w)
                                zero |= u64(__ballot_sync(FULL_WARP, vis.none(r0 + 32 * w + lane)))
                                        << (32 * w);
                            zero >>= 2 * c;
                            // With positions, the rows that start at or before each of this lane's
                            // keys (which need not be a range): one ballot over the half's rows per
                            // key of the warp, kept by the lanes that hold the key.
                            u64 started[2] = {~0ull, ~0ull};
                            if (prow != nullptr) {
                                int from[QH / 32];
#pragma unroll
                                for (int w = 0; w < QH / 32; ++w)
                                    from[w] = starts[buf][hq + 32 * w + lane];
#pragma unroll 1
                                for (int k = 0; k < 8; ++k) {
                                    u64 m[2] = {0ull, 0ull};
#pragma unroll
                                    for (int w = 0; w < QH / 32; ++w) {
                                        m[0] |= u64(__ballot_sync(FULL_WARP, from[w] <= j0 + k))
                                                << (32 * w);
                                        m[1] |= u64(__ballot_sync(FULL_WARP, from[w] <= j0 + k + 8))
                                                << (32 * w);
                                    }
                                    if (k == g) {
                                        started[0] = m[0] >> (2 * c);
                                        started[1] = m[1] >> (2 * c);
                                    }
                                }
                            }
                            u64 kept[2];
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const int j = keys[h];
                                int lo = causal ? j - s + t : 0, hi = t - 1;
                                if (window > 0) {
                                    if (causal && j + window < s) hi = j + window - 1 - s + t;
                                    if (!causal && j < s - window) hi = -1;
                                }
                                const u64 seen =
                                    jok[h] ? bit_range(lo - r0 - 2 * c, hi - r0 - 2 * c) : 0ull;
                                kept[h] = (seen & started[h] & ~zero) | (jin[h] ? zero : 0ull);
                            }
#pragma unroll
                            for (int n = 0; n < NH; ++n) {
#pragma unroll
                                for (int e = 0; e < 4; ++e) {
                                    const int io = n * 8 + (e & 1);
                                    if ((zero >> io) & 1ull) st[n][e] = 0.0f;
                                    if (!((kept[e >> 1] >> io) & 1ull)) st[n][e] = F32_NEG_INF;
                                }
                            }
                        }
#pragma unroll
                        for (int n = 0; n < NH; ++n) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int i = hq + n * 8 + 2 * c + (e & 1);
                                const float p = exp2_approx(fmaf(st[n][e], scale_log2, -l2[i]));
                                if constexpr (DROP) {
                                    if (dr.on) {
                                        // The forward's mask, regenerated: dP of a dropped key is
                                        // 0, of a kept one scaled, and dV reads the dropped,
                                        // scaled P.
                                        const int qi = q0 + i, j = keys[e >> 1];
                                        const bool kept = qi < t && j < s &&
                                                          dr.kept((i64(b) * t + qi) * s + j);
                                        st[n][e] = kept ? p * dr.scale : 0.0f;
                                        dpt[n][e] =
                                            p * ((kept ? dpt[n][e] * dr.scale : 0.0f) - dl[i]);
                                        continue;
                                    }
                                }
                                st[n][e] = p;                          // P^T
                                dpt[n][e] = p * (dpt[n][e] - dl[i]);  // dS^T
                            }
                        }
#pragma unroll
                        for (int n = 0; n < NH; ++n) {
                            T* row = my_dst + hq + n * 8 + 2 * c;
                            *reinterpret_cast<unsigned*>(row + g * LDS) =
                                pack2<T>(dpt[n][0], dpt[n][1]);
                            *reinterpret_cast<unsigned*>(row + (g + 8) * LDS) =
                                pack2<T>(dpt[n][2], dpt[n][3]);
                        }
#pragma unroll
                        for (int kc = 0; kc < QH / 16; ++kc) {
                            unsigned ap[4], as[4];
                            frag_from_acc<T>(ap, st, kc);
                            frag_from_acc<T>(as, dpt, kc);
#pragma unroll
                            for (int i2 = 0; i2 < OT / 2; ++i2) {
                                unsigned bo[4], bq[4];
                                const int at = staged + ((hq + kc * 16) * LD + i2 * 16) * ES;
                                ldsm_x4_t_at(bo, dos_b + at);
                                ldsm_x4_t_at(bq, qs_b + at);
                                mma_packed<T>(acc_v[2 * i2], ap, bo[0], bo[1]);  // dV += P^T dO
                                mma_packed<T>(acc_v[2 * i2 + 1], ap, bo[2], bo[3]);
                                mma_packed<T>(acc_k[2 * i2], as, bq[0], bq[1]);  // dK += dS^T Q
                                mma_packed<T>(acc_k[2 * i2 + 1], as, bq[2], bq[3]);
                            }
                        }
                    }
                }
                __syncthreads();  // dS^T is whole

                // This block's share of dQ for the tile, dS (from dS^T) times the block's K, is
                // added to the shares of the blocks above this one (dq_acc). The wait for them
                // comes first, so that their sum loads while the product runs.
                int lo_kb, hi_kb;
                tile_key_blocks<KB, QT>(vis, maybe_none, qt, tile_lo, nkb, lo_kb, hi_kb);
                const bool first = kb == hi_kb, last = kb == lo_kb;
                int* ready = dq_ready + i64(b) * nqt + qt;
                if (!first) {
                    if (threadIdx.x == 0) wait_flag(ready, hi_kb - kb);
                    __syncthreads();  // the blocks above this one have added their shares
                    // Their sum, this warp's 16 rows and NW 8-column tiles of it, into shared
                    // memory by cp.async (16 bytes a copy, NW copies a lane; zeros past t),
                    // while the share's product runs: no registers held for it.
                    // A row is 2 NW copies, so lane takes row lane / (2 NW) and, copy j, the
                    // row 16 / NW j below it, at the same column.
                    const int r0 = mt * 16 + lane / (2 * NW), cc = lane % (2 * NW) * 4;
                    const float* from = dq_acc + (i64(b) * t + q0 + r0) * P + col0 + cc;
                    float* to = above_s + r0 * LDA + col0 + cc;
#pragma unroll
                    for (int j = 0; j < NW; ++j)
                        cp_async16(to + j * (16 / NW) * LDA, from + j * (16 / NW) * P,
                                   q0 + r0 + j * (16 / NW) < t);
                    cp_async_commit();
                }
                float aq[NW][4];
#pragma unroll
                for (int n = 0; n < NW; ++n) aq[n][0] = aq[n][1] = aq[n][2] = aq[n][3] = 0.0f;
#pragma unroll
                for (int kc = 0; kc < KB / 16; ++kc) {
                    unsigned a[4];
                    ldsm_x4_t_at(a, dst_t + kc * 16 * LDS * ES);
                    if constexpr (NW >= 2) {
#pragma unroll
                        for (int n2 = 0; n2 < NW / 2; ++n2) {
                            unsigned bk4[4];
                            ldsm_x4_t_at(bk4, ks_b + (kc * 16 * LD + n2 * 16) * ES);
                            mma_packed<T>(aq[2 * n2], a, bk4[0], bk4[1]);
                            mma_packed<T>(aq[2 * n2 + 1], a, bk4[2], bk4[3]);
                        }
                    } else {
                        unsigned bk2[2];
                        ldsm_x2_t_at(bk2, ks_b + kc * 16 * LD * ES);
                        mma_packed<T>(aq[0], a, bk2[0], bk2[1]);
                    }
                }
                // The sum so far: the shares above, then this one (the first block's share is
                // the sum).
                if (!first) {
                    cp_async_wait<0>();
                    __syncwarp();  // the warp's copies are in shared memory
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float* arow = above_s + (mt * 16 + g + 8 * h) * LDA + col0 + 2 * c;
#pragma unroll
                        for (int n = 0; n < NW; ++n) {
                            const float2 x = *reinterpret_cast<const float2*>(arow + n * 8);
                            aq[n][2 * h] = x.x + aq[n][2 * h];
                            aq[n][2 * h + 1] = x.y + aq[n][2 * h + 1];
                        }
                    }
                }
                if (!last) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int i = mt * 16 + g + 8 * h;
                        float* arow = dq_acc + (i64(b) * t + q0 + i) * P + col0 + 2 * c;
#pragma unroll
                        for (int n = 0; n < NW; ++n)
                            if (q0 + i < t)
                                __stcg(reinterpret_cast<float2*>(arow + n * 8),
                                       make_float2(aq[n][2 * h], aq[n][2 * h + 1]));
                    }
                }
                // Every warp has read dS^T, and this block's share is stored (raise_flag's
                // fence covers it).
                __syncthreads();
                if (!last) {
                    if (threadIdx.x == 0) raise_flag(ready);
                } else {
                    // The last block writes dq = scale * sum through the dS^T buffer (the next
                    // tile writes it after its own first barrier).
                    T* out = dst;  // [QT][LD] now
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int i = mt * 16 + g + 8 * h;
#pragma unroll
                        for (int n = 0; n < NW; ++n)
                            *reinterpret_cast<unsigned*>(out + i * LD + col0 + n * 8 + 2 * c) =
                                pack2<T>(aq[n][2 * h] * scale, aq[n][2 * h + 1] * scale);
                    }
                    __syncthreads();  // the tile's dq is whole
                    const bool dvec = d % 8 == 0 && aligned16(dq) && sdq.rows16();
                    T* dqb = dq + sdq.at(outer, qh) + i64(q0) * sdq.row;
                    if (warp < QT / 16) {
                        T* const to[1] = {dqb + i64(warp) * 16 * sdq.row};
                        const T* const from[1] = {out + warp * 16 * LD};
                        const int ld[1] = {sdq.row};
                        store_rows<T, P, 1>(to, from, ld, min(16, qlast + 1 - q0 - warp * 16), d,
                                            dvec);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // K and V are read no more: shared memory takes dK and dV
    const int links = group * segs;
    if (links > 1) {
        // The key block's dK and dV are summed over its links in order (segments, then the
        // group's query heads), in F32 scratch past dq_acc, a float4 stripe per thread as the
        // accumulators lie: each link waits until the ones before it have added theirs, adds
        // its own after theirs and passes the sum on, or, as the last, writes dk and dv from
        // it below. The stripes go through shared memory (P KiB at the front, which
        // geometry::shared_bytes provides; each thread reads only its own), so that one loop,
        // not one copy per register, adds them, a batch of stripes per L2 round trip. A link
        // whose segment reads no tile counts too, but moves no more than it must: as the
        // first it stores zeros, as a middle one it passes the sum on as it is (adding its
        // zeros would change nothing but a -0 sum into +0), and as the last it adds its zeros
        // and writes dk and dv.
        const int link = (int(blockIdx.z) - outer * segs) * group + qh - hk * group;
        const i64 bq = i64(gridDim.z / segs) * gridDim.y;
        const int bk = outer * (int(gridDim.y) / group) + hk;
        float4* sum = reinterpret_cast<float4*>(dq_acc + bq * t * P) +
                      (i64(bk) * nkb + kb) * (2 * OT * ATT_TC_THREADS) + threadIdx.x;
        int* ready = dq_ready + bq * nqt + i64(bk) * nkb + kb;
        if (link > 0 && threadIdx.x == 0) wait_flag(ready, link);
        __syncthreads();  // the links before this one have added theirs
        float4* stripe = reinterpret_cast<float4*>(att_smem) + threadIdx.x;
        const bool pass_on = link < links - 1;
        if (reads_tiles || !pass_on || link == 0) {
#pragma unroll
            for (int i = 0; i < OT; ++i) {
                stripe[i * ATT_TC_THREADS] =
                    make_float4(acc_k[i][0], acc_k[i][1], acc_k[i][2], acc_k[i][3]);
                stripe[(OT + i) * ATT_TC_THREADS] =
                    make_float4(acc_v[i][0], acc_v[i][1], acc_v[i][2], acc_v[i][3]);
            }
            // The sum so far, a batch of stripes' loads issued together (one L2 round trip a
            // batch), added into the stripes; the sum passed on is stored from them.
            constexpr int STRIPES = 2 * OT, BATCH = STRIPES < 4 ? STRIPES : 4;
            if (link > 0) {
                const float4* from = sum;
                float4* into = stripe;
#pragma unroll 1
                for (int i0 = 0; i0 < STRIPES; i0 += BATCH) {
                    float4 y[BATCH];
#pragma unroll
                    for (int u = 0; u < BATCH; ++u) y[u] = __ldcg(from + u * ATT_TC_THREADS);
#pragma unroll
                    for (int u = 0; u < BATCH; ++u) {
                        float4& x = into[u * ATT_TC_THREADS];
                        x = make_float4(y[u].x + x.x, y[u].y + x.y, y[u].z + x.z, y[u].w + x.w);
                    }
                    from += BATCH * ATT_TC_THREADS;
                    into += BATCH * ATT_TC_THREADS;
                }
            }
            if (pass_on) {
                float4* to = sum;
#pragma unroll 1
                for (int i = 0; i < STRIPES; ++i, to += ATT_TC_THREADS)
                    __stcg(to, stripe[i * ATT_TC_THREADS]);
            }
        }
        if (!pass_on) {
#pragma unroll
            for (int i = 0; i < OT; ++i) {
                const float4 xk = stripe[i * ATT_TC_THREADS];
                const float4 xv = stripe[(OT + i) * ATT_TC_THREADS];
                acc_k[i][0] = xk.x;
                acc_k[i][1] = xk.y;
                acc_k[i][2] = xk.z;
                acc_k[i][3] = xk.w;
                acc_v[i][0] = xv.x;
                acc_v[i][1] = xv.y;
                acc_v[i][2] = xv.z;
                acc_v[i][3] = xv.w;
            }
        }
        __syncthreads();  // the stripes are read; the block's sum is stored (raise_flag's fence)
        if (pass_on) {
            if (threadIdx.x == 0) raise_flag(ready);
            return;
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < OT; ++i) {
            const int at = (warp * 16 + g + 8 * h) * LD + i * 8 + 2 * c;
            *reinterpret_cast<unsigned*>(ks + at) =
                pack2<T>(acc_k[i][2 * h] * scale, acc_k[i][2 * h + 1] * scale);
            *reinterpret_cast<unsigned*>(vs + at) = pack2<T>(acc_v[i][2 * h], acc_v[i][2 * h + 1]);
        }
    }
    __syncwarp();
    const int rows = min(16, s - j0);
    if (rows > 0) {
        const bool kvec =
            d % 8 == 0 && aligned16(dk) && aligned16(dv) && sdk.rows16() && sdv.rows16();
        T* const to[2] = {dk + sdk.at(outer, hk) + i64(j0) * sdk.row,
                          dv + sdv.at(outer, hk) + i64(j0) * sdv.row};
        const T* const from[2] = {ks + warp * 16 * LD, vs + warp * 16 * LD};
        const int ld[2] = {sdk.row, sdv.row};
        store_rows<T, P, 2>(to, from, ld, rows, d, kvec);
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
                            const unsigned char* mask, const i64* positions, float* o,
                            float* lse, int t, int s, int d, int group, int mask_group,
                            int causal, int window, double scale, AttDropout dr) {
    __shared__ int first_slot;
    const i64 b = blockIdx.y;
    const int r = blockIdx.x * (ATT_THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const unsigned char* mrow = mask ? mask + (b / mask_group) * i64(s) : nullptr;
    Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), nullptr, 0};
    vis.pos = positions ? positions + (b / mask_group) * i64(s) : nullptr;
    if (r >= t) return;
    const float* kb = k + (b / group) * i64(s) * d;
    const float* vb = v + (b / group) * i64(s) * d;
    const i64 drow = (b * t + r) * i64(s);  // the row's first element of the probabilities
    float qi[ATT_LANE_DIMS], acc[ATT_LANE_DIMS];
    lane_row(qi, q + (b * t + r) * i64(d), d);
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) acc[u] = 0.0f;
    const bool none = vis.warp_none(r, mrow);
    const int end = none ? s : visible_keys(r, t, s, causal);
    float m = F32_NEG_INF, l = 0.0f;
    for (int j = none ? 0 : vis.first_key(r); j < end; ++j) {
        if (!none && mrow != nullptr && mrow[j] == 0) continue;
        const float x = none ? 0.0f : float(warp_dot(qi, kb + i64(j) * d, d) * double(scale));
        const float mn = fmaxf(m, x);
        const float corr = expf(m - mn), p = expf(x - mn);
        m = mn;
        l = l * corr + p;
        // A dropped probability leaves the product, not the sum.
        const float pv = dr.on && !dr.kept(drow + j) ? 0.0f : p;
        const float* vj = vb + i64(j) * d;
#pragma unroll
        for (int u = 0; u < ATT_LANE_DIMS; ++u) {
            const int col = lane + 32 * u;
            acc[u] = acc[u] * corr + (col < d ? pv * vj[col] : 0.0f);
        }
    }
#pragma unroll
    for (int u = 0; u < ATT_LANE_DIMS; ++u) {
        const int col = lane + 32 * u;
        if (col < d) o[(b * t + r) * i64(d) + col] = dr.on ? acc[u] / l * dr.scale : acc[u] / l;
    }
    if (lane == 0) lse[b * t + r] = m + logf(l);
}

__device__ void att_dq_f32(const float* q, const float* k, const float* v,
                           const unsigned char* mask, const i64* positions, const float* d_o,
                           const float* lse, const float* delta, float* dq, int t, int s,
                           int d, int group, int mask_group, int causal, int window,
                           double scale, AttDropout dr) {
    __shared__ int first_slot;
    const i64 b = blockIdx.y;
    const int r = blockIdx.x * (ATT_THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const unsigned char* mrow = mask ? mask + (b / mask_group) * i64(s) : nullptr;
    Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), nullptr, 0};
    vis.pos = positions ? positions + (b / mask_group) * i64(s) : nullptr;
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
    for (int j = none ? 0 : vis.first_key(r); j < end; ++j) {
        if (!none && mrow != nullptr && mrow[j] == 0) continue;
        const float x = none ? 0.0f : float(warp_dot(qi, kb + i64(j) * d, d) * double(scale));
        const float p = expf(x - lse[row]);
        float dp = float(warp_dot(doi, vb + i64(j) * d, d));
        if (dr.on) dp = dr.kept(row * s + j) ? dp * dr.scale : 0.0f;
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
                             const unsigned char* mask, const i64* positions,
                             const float* d_o, const float* lse, const float* delta, float* dk,
                             float* dv, int t, int s, int d, int group, int mask_group,
                             int causal, int window, double scale, AttDropout dr) {
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
        Visibility vis{t, s, causal, window, first_kept(mrow, s, &first_slot), nullptr, 0};
        vis.pos = positions ? positions + (b / mask_group) * i64(s) : nullptr;
        if (j >= s) continue;
        const bool key_kept = mrow == nullptr || mrow[j] != 0;
        for (int r = 0; r < t; ++r) {
            const bool none = vis.warp_none(r, mrow);
            if (!none && (!key_kept || j >= visible_keys(r, t, s, causal) ||
                          j < vis.first_key(r)))
                continue;
            const i64 row = b * t + r;
            const float* qr = q + row * d;
            const float* dor = d_o + row * d;
            const float x = none ? 0.0f : float(warp_dot(kj, qr, d) * double(scale));
            const float p = expf(x - lse[row]);
            float dp = float(warp_dot(vj, dor, d)), z = p;
            if (dr.on) {
                const bool kept = dr.kept(row * s + j);
                dp = kept ? dp * dr.scale : 0.0f;
                z = kept ? p * dr.scale : 0.0f;
            }
            const double ds = double(p * (dp - delta[row]));
#pragma unroll
            for (int u = 0; u < ATT_LANE_DIMS; ++u) {
                const int col = lane + 32 * u;
                if (col < d) {
                    acc_k[u] += ds * double(qr[col]);
                    acc_v[u] += double(z) * double(dor[col]);
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

// Each (dtype, P) of the tensor-core kernels is its own instantiation, and the file builds
// them all: NVRTC takes a while the first time a machine compiles it, then the PTX cache
// answers.
// The strides of operand X (AttStrides) come after the shape as X_batch, X_head, X_row.
// The `_packed` entry points are the same templates with packed sequences' positions compiled
// in (POS = true); the others take a null `positions` and carry none of that code.
// The `_dropout` entry points take the dropout last: the key ([seed, offset], device memory),
// the stream, the keep threshold round((1 - p) 2^32) and the F32 1 / (1 - p) as a double
// (dropout.cu's arguments). The tensor-core entry points without it are the same templates
// with the dropout compiled out (DROP = false), so they run exactly the code they ran before.
#define CASTOR_ATTENTION(T, sfx, P, pk, POS)                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_TC_THREADS, 1) attention_fwd_##sfx##_d##P##pk(    \
        const T* q, const T* k, const T* v, const unsigned char* mask, const i64* positions, T* o, \
        float* lse, i64 bq, int t, int s, int d, int group, int mask_group, int causal,            \
        int window, double scale, int q_batch, int q_head, int q_row, int k_batch, int k_head,     \
        int k_row, int v_batch, int v_head, int v_row, int o_batch, int o_head, int o_row) {       \
        att_fwd<T, P, false, POS>(q, k, v, mask, positions, o, lse, t, s, d, group, mask_group, causal, \
                            window, float(scale * ATT_LOG2E), AttStrides{q_batch, q_head, q_row},  \
                            AttStrides{k_batch, k_head, k_row},                                    \
                            AttStrides{v_batch, v_head, v_row},                                    \
                            AttStrides{o_batch, o_head, o_row}, AttDropout{});                     \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_TC_THREADS, 1) attention_bwd_##sfx##_d##P##pk(    \
        const T* q, const T* k, const T* v, const unsigned char* mask, const i64* positions,       \
        const T* d_o, const float* lse, const float* delta, T* dq, T* dk, T* dv, float* dq_acc,    \
        int* dq_ready, i64 bkv, int t, int s, int d, int group, int mask_group, int causal,        \
        int window, double scale, int q_batch, int q_head, int q_row, int k_batch, int k_head,     \
        int k_row, int v_batch, int v_head, int v_row, int d_o_batch, int d_o_head, int d_o_row,   \
        int dq_batch, int dq_head, int dq_row, int dk_batch, int dk_head, int dk_row,              \
        int dv_batch, int dv_head, int dv_row) {                                                   \
        att_bwd<T, P, false, POS>(q, k, v, mask, positions, d_o, lse, delta, dq, dk, dv, dq_acc,        \
                            dq_ready, t, s, d, group, mask_group, causal, window, float(scale),    \
                            float(scale * ATT_LOG2E), AttStrides{q_batch, q_head, q_row},          \
                            AttStrides{k_batch, k_head, k_row},                                    \
                            AttStrides{v_batch, v_head, v_row},                                    \
                            AttStrides{d_o_batch, d_o_head, d_o_row},                              \
                            AttStrides{dq_batch, dq_head, dq_row},                                 \
                            AttStrides{dk_batch, dk_head, dk_row},                                 \
                            AttStrides{dv_batch, dv_head, dv_row}, AttDropout{});                  \
    }
#define CASTOR_ATTENTION_DROPOUT(T, sfx, P, pk, POS)                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_TC_THREADS, 1) attention_fwd_##sfx##_d##P##pk##_dropout( \
        const T* q, const T* k, const T* v, const unsigned char* mask, const i64* positions, T* o, \
        float* lse, i64 bq, int t, int s, int d, int group, int mask_group, int causal,            \
        int window, double scale, int q_batch, int q_head, int q_row, int k_batch, int k_head,     \
        int k_row, int v_batch, int v_head, int v_row, int o_batch, int o_head, int o_row,         \
        const i64* dropout_key, unsigned stream, u64 threshold, double keep_scale) {               \
        att_fwd<T, P, true, POS>(q, k, v, mask, positions, o, lse, t, s, d, group, mask_group, causal,  \
                            window, float(scale * ATT_LOG2E), AttStrides{q_batch, q_head, q_row},  \
                            AttStrides{k_batch, k_head, k_row},                                    \
                            AttStrides{v_batch, v_head, v_row},                                    \
                            AttStrides{o_batch, o_head, o_row},                                    \
                            att_dropout(dropout_key, stream, threshold, keep_scale)); \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_TC_THREADS, 1) attention_bwd_##sfx##_d##P##pk##_dropout( \
        const T* q, const T* k, const T* v, const unsigned char* mask, const i64* positions,       \
        const T* d_o, const float* lse, const float* delta, T* dq, T* dk, T* dv, float* dq_acc,    \
        int* dq_ready, i64 bkv, int t, int s, int d, int group, int mask_group, int causal,        \
        int window, double scale, int q_batch, int q_head, int q_row, int k_batch, int k_head,     \
        int k_row, int v_batch, int v_head, int v_row, int d_o_batch, int d_o_head, int d_o_row,   \
        int dq_batch, int dq_head, int dq_row, int dk_batch, int dk_head, int dk_row,              \
        int dv_batch, int dv_head, int dv_row,                                                     \
        const i64* dropout_key, unsigned stream, u64 threshold, double keep_scale) {               \
        att_bwd<T, P, true, POS>(q, k, v, mask, positions, d_o, lse, delta, dq, dk, dv, dq_acc,         \
                            dq_ready, t, s, d, group, mask_group, causal, window, float(scale),    \
                            float(scale * ATT_LOG2E), AttStrides{q_batch, q_head, q_row},          \
                            AttStrides{k_batch, k_head, k_row},                                    \
                            AttStrides{v_batch, v_head, v_row},                                    \
                            AttStrides{d_o_batch, d_o_head, d_o_row},                              \
                            AttStrides{dq_batch, dq_head, dq_row},                                 \
                            AttStrides{dk_batch, dk_head, dk_row},                                 \
                            AttStrides{dv_batch, dv_head, dv_row},                                 \
                            att_dropout(dropout_key, stream, threshold, keep_scale)); \
    }

#define CASTOR_ATTENTION_DELTA(T, sfx)                                                             \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_bwd_delta_##sfx(           \
        const T* o, const T* d_o, float* delta, i64 rows, int t, int d, int heads, int o_batch,    \
        int o_head, int o_row, int d_o_batch, int d_o_head, int d_o_row) {                         \
        att_delta<T>(o, d_o, delta, rows, t, d, heads, AttStrides{o_batch, o_head, o_row},         \
                     AttStrides{d_o_batch, d_o_head, d_o_row});                                    \
    }

#define CASTOR_ATTENTION_F32                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_fwd_f32(                   \
        const float* q, const float* k, const float* v, const unsigned char* mask,                 \
        const i64* positions, float* o, float* lse, i64 bq, int t, int s, int d, int group,        \
        int mask_group, int causal, int window, double scale) {                                    \
        att_fwd_f32(q, k, v, mask, positions, o, lse, t, s, d, group, mask_group, causal, window,  \
                    scale, AttDropout{});                                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_bwd_dq_f32(                \
        const float* q, const float* k, const float* v, const unsigned char* mask,                 \
        const i64* positions, const float* d_o, const float* lse, const float* delta, float* dq,   \
        i64 bq, int t, int s, int d, int group, int mask_group, int causal, int window,            \
        double scale) {                                                                            \
        att_dq_f32(q, k, v, mask, positions, d_o, lse, delta, dq, t, s, d, group, mask_group,      \
                   causal, window, scale, AttDropout{});                                           \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_bwd_dkdv_f32(              \
        const float* q, const float* k, const float* v, const unsigned char* mask,                 \
        const i64* positions, const float* d_o, const float* lse, const float* delta, float* dk,   \
        float* dv, i64 bkv, int t, int s, int d, int group, int mask_group, int causal,            \
        int window, double scale) {                                                                \
        att_dkdv_f32(q, k, v, mask, positions, d_o, lse, delta, dk, dv, t, s, d, group,            \
                     mask_group, causal, window, scale, AttDropout{});                             \
    }
#define CASTOR_ATTENTION_F32_DROPOUT                                                               \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_fwd_f32_dropout(           \
        const float* q, const float* k, const float* v, const unsigned char* mask,                 \
        const i64* positions, float* o, float* lse, i64 bq, int t, int s, int d, int group,        \
        int mask_group, int causal, int window, double scale,                                      \
        const i64* dropout_key, unsigned stream, u64 threshold, double keep_scale) {               \
        att_fwd_f32(q, k, v, mask, positions, o, lse, t, s, d, group, mask_group, causal, window,  \
                    scale, att_dropout(dropout_key, stream, threshold, keep_scale));               \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_bwd_dq_f32_dropout(        \
        const float* q, const float* k, const float* v, const unsigned char* mask,                 \
        const i64* positions, const float* d_o, const float* lse, const float* delta, float* dq,   \
        i64 bq, int t, int s, int d, int group, int mask_group, int causal, int window,            \
        double scale,                                                                              \
        const i64* dropout_key, unsigned stream, u64 threshold, double keep_scale) {               \
        att_dq_f32(q, k, v, mask, positions, d_o, lse, delta, dq, t, s, d, group, mask_group,      \
                   causal, window, scale, att_dropout(dropout_key, stream, threshold, keep_scale)); \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_bwd_dkdv_f32_dropout(      \
        const float* q, const float* k, const float* v, const unsigned char* mask,                 \
        const i64* positions, const float* d_o, const float* lse, const float* delta, float* dk,   \
        float* dv, i64 bkv, int t, int s, int d, int group, int mask_group, int causal,            \
        int window, double scale,                                                                  \
        const i64* dropout_key, unsigned stream, u64 threshold, double keep_scale) {               \
        att_dkdv_f32(q, k, v, mask, positions, d_o, lse, delta, dk, dv, t, s, d, group,            \
                     mask_group, causal, window, scale, att_dropout(dropout_key, stream, threshold, keep_scale)); \
    }

CASTOR_ATTENTION_F32
CASTOR_ATTENTION_F32_DROPOUT
CASTOR_ATTENTION_DELTA(float, f32)
CASTOR_ATTENTION_DELTA(__half, f16)
CASTOR_ATTENTION_DELTA(__nv_bfloat16, bf16)
CASTOR_ATTENTION(__half, f16, 16, , false)
CASTOR_ATTENTION(__half, f16, 32, , false)
CASTOR_ATTENTION(__half, f16, 64, , false)
CASTOR_ATTENTION(__half, f16, 128, , false)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 16, , false)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 32, , false)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 64, , false)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 128, , false)
CASTOR_ATTENTION(__half, f16, 16, _packed, true)
CASTOR_ATTENTION(__half, f16, 32, _packed, true)
CASTOR_ATTENTION(__half, f16, 64, _packed, true)
CASTOR_ATTENTION(__half, f16, 128, _packed, true)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 16, _packed, true)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 32, _packed, true)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 64, _packed, true)
CASTOR_ATTENTION(__nv_bfloat16, bf16, 128, _packed, true)
CASTOR_ATTENTION_DROPOUT(__half, f16, 16, , false)
CASTOR_ATTENTION_DROPOUT(__half, f16, 32, , false)
CASTOR_ATTENTION_DROPOUT(__half, f16, 64, , false)
CASTOR_ATTENTION_DROPOUT(__half, f16, 128, , false)
CASTOR_ATTENTION_DROPOUT(__nv_bfloat16, bf16, 16, , false)
CASTOR_ATTENTION_DROPOUT(__nv_bfloat16, bf16, 32, , false)
CASTOR_ATTENTION_DROPOUT(__nv_bfloat16, bf16, 64, , false)
CASTOR_ATTENTION_DROPOUT(__nv_bfloat16, bf16, 128, , false)
CASTOR_ATTENTION_DROPOUT(__half, f16, 16, _packed, true)
CASTOR_ATTENTION_DROPOUT(__half, f16, 32, _packed, true)
CASTOR_ATTENTION_DROPOUT(__half, f16, 64, _packed, true)
CASTOR_ATTENTION_DROPOUT(__half, f16, 128, _packed, true)
CASTOR_ATTENTION_DROPOUT(__nv_bfloat16, bf16, 16, _packed, true)
CASTOR_ATTENTION_DROPOUT(__nv_bfloat16, bf16, 32, _packed, true)
CASTOR_ATTENTION_DROPOUT(__nv_bfloat16, bf16, 64, _packed, true)
CASTOR_ATTENTION_DROPOUT(__nv_bfloat16, bf16, 128, _packed, true)
