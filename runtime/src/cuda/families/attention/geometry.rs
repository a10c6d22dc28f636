//! The launch geometry of `attention.cu`, as its header states it: which variant a head dim
//! takes, and each kernel's grid, block, dynamic shared memory and scratch. The CUDA lowering
//! launches by these and the emulator's contract checks launches against them, so the two
//! cannot drift apart; the numbers are the file's `ATT_*` constants and `AttShape`.

/// Threads per block of the F32 kernels and of `delta`.
pub const THREADS: u32 = 128;
/// Threads per block of the tensor-core kernels (8 warps).
pub const TC_THREADS: u32 = 256;
/// Query rows per tensor-core forward block.
pub const FWD_ROWS: u32 = 128;
/// Keys per tensor-core backward block.
pub const BWD_KEYS: u32 = 128;
/// Query rows per segment of a key block's work in a banded backward.
pub const BWD_SEGMENT_ROWS: u32 = 512;
/// Elements of padding per shared-memory row.
const PAD: u32 = 8;
/// Rows one F32 block takes (a warp per row).
pub const F32_ROWS: u32 = THREADS / 32;
/// The widest head dim of the F32 kernels (8 elements per lane).
pub const F32_MAX_HEAD_DIM: usize = 256;
/// The head-dim tiles the tensor-core kernels are built for.
pub const TILES: [u32; 4] = [16, 32, 64, 128];

/// The tensor-core variant's tile for head dim `d`: `d` rounded up to 16, 32, 64 or 128, or
/// `None` past 128.
pub fn tile(d: usize) -> Option<u32> {
    TILES.into_iter().find(|&p| d <= p as usize)
}

/// Keys per forward tile at tile width `p` (`AttShape<P>::KEYS`).
pub fn fwd_keys(p: u32) -> u32 {
    if p <= 64 {
        128
    } else {
        64
    }
}

/// Query rows per backward tile at tile width `p` (`AttShape<P>::QROWS`); the kernel computes
/// a tile's scores in two halves of these rows.
pub fn bwd_query_rows(p: u32) -> u32 {
    if p <= 64 {
        128
    } else {
        64
    }
}

/// Whether a mask is banded, causal or windowed (`window` keys, 0 for none): its key blocks'
/// work differs, and the backward splits it into segments.
pub fn banded(causal: bool, window: usize) -> bool {
    causal || window > 0
}

/// The segments a backward key block's query tiles split into at tile width `p` over `t`
/// query rows (`att_bwd_segments`): `BWD_SEGMENT_ROWS` rows each when the mask is banded
/// (causal or windowed), so that the first key blocks' long runs of tiles share out over
/// several blocks; else one.
pub fn bwd_segments(p: u32, t: u32, banded: bool) -> u32 {
    if !banded {
        return 1;
    }
    let rows = bwd_query_rows(p);
    t.div_ceil(rows).div_ceil(BWD_SEGMENT_ROWS / rows).max(1)
}

/// The kernels of one attention op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Forward,
    /// The tensor-core backward: dq, dk and dv in one pass over key blocks.
    Backward,
    /// The F32 query gradient.
    Dq,
    /// The F32 key and value gradients.
    DkDv,
}

/// Threads per block of `kernel` (`tensor_cores`: the f16/bf16 kernels).
pub fn threads(kernel: Kernel, tensor_cores: bool) -> u32 {
    match kernel {
        Kernel::Forward | Kernel::Backward if tensor_cores => TC_THREADS,
        _ => THREADS,
    }
}

/// Bytes of dynamic shared memory a tensor-core kernel takes at tile `p` with operands of
/// `elem` bytes: the forward's Q tile and double-buffered K/V tiles with their mask bytes; the
/// backward's K/V tiles, double-buffered Q/dO tiles, the dS^T tile, the F32 dQ sum of the
/// blocks above (a query tile of padded rows), the double-buffered F32 row statistics and the
/// block's mask bytes, or, if more, the F32 dK and dV accumulators of
/// its 256 threads (`p` KiB), which pass through it when a key block has several links.
pub fn shared_bytes(kernel: Kernel, p: u32, elem: u32) -> u32 {
    let row = (p + PAD) * elem;
    match kernel {
        Kernel::Forward => {
            let keys = fwd_keys(p);
            FWD_ROWS * row + 4 * keys * row + 2 * keys
        }
        Kernel::Backward => {
            let qt = bwd_query_rows(p);
            let tiles = 2 * BWD_KEYS * row
                + 4 * qt * row
                + BWD_KEYS * (qt + PAD) * elem
                + qt * (p + PAD) * 4
                + 4 * qt * 4
                + BWD_KEYS;
            tiles.max(TC_THREADS * 2 * p / 8 * 16)
        }
        Kernel::Dq | Kernel::DkDv => 0,
    }
}

/// The grid of `kernel` over `bq` query batches of `t` rows (`bkv = bq / group` key batches of
/// `s` keys), tensor-core (`tile`: the variant's head-dim tile) or F32; `banded`: causal or
/// windowed. The tensor-core kernels split the batches as (outer, head) by the grid: `heads`
/// query heads (a multiple of `group`) to an outer batch. The backward takes a block per key
/// block, query head and segment (`bwd_segments`): its z dim counts (outer batch, segment),
/// segments fastest.
pub fn grid(
    kernel: Kernel,
    tile: Option<u32>,
    bq: u32,
    (heads, group): (u32, u32),
    (t, s): (u32, u32),
    banded: bool,
) -> (u32, u32, u32) {
    let bkv = bq / group.max(1);
    let heads = heads.max(1);
    match (kernel, tile) {
        (Kernel::Forward, Some(_)) => (t.div_ceil(FWD_ROWS).max(1), heads, bq / heads),
        (Kernel::Backward, Some(p)) => (
            s.div_ceil(BWD_KEYS).max(1),
            heads,
            bq / heads * bwd_segments(p, t, banded),
        ),
        (Kernel::Forward | Kernel::Dq, _) => (t.div_ceil(F32_ROWS).max(1), bq, 1),
        (Kernel::DkDv | Kernel::Backward, _) => (s.div_ceil(F32_ROWS).max(1), bkv, 1),
    }
}

/// Lanes of the `delta` kernel that sum one row of `d` elements: one per 16-byte unit (8
/// elements), rounded up to a power of two, at most a warp (`att_delta_lanes`).
pub fn delta_lanes(d: u32) -> u32 {
    d.div_ceil(8).max(1).next_power_of_two().min(32)
}

/// The grid of the `delta` kernel over `rows` query rows of `d` elements: each warp sums
/// `32 / delta_lanes(d)` rows.
pub fn delta_grid(rows: u64, d: u32) -> (u32, u32, u32) {
    let rows_per_block = u64::from(F32_ROWS * (32 / delta_lanes(d)));
    (rows.div_ceil(rows_per_block).max(1) as u32, 1, 1)
}

/// The tensor-core backward's scratch at tile `p`: `bq` query batches of `t` rows in groups of
/// `group` (the key batches), `s` keys, `banded` as for `grid`. `acc_elems` F32 values of
/// `dq_acc`: dQ's sums, `[bq, t, p]`, then, where more than one block (link) adds to a key
/// block's dK and dV (grouped query heads or several segments), their sums, `2 p` floats per
/// key of every key block. `ready_count` ints of `dq_ready`, zero when it starts: one per
/// query batch and tile, then, with links, one per key batch and key block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardScratch {
    pub acc_elems: u64,
    pub ready_count: u64,
}

pub fn backward_scratch(
    p: u32,
    (bq, group): (u64, u64),
    (t, s): (u64, u64),
    banded: bool,
) -> BackwardScratch {
    let dq_tiles = bq * t.div_ceil(u64::from(bwd_query_rows(p)));
    let mut scratch = BackwardScratch {
        acc_elems: bq * t * u64::from(p),
        ready_count: dq_tiles,
    };
    let links = group * u64::from(bwd_segments(p, t as u32, banded));
    if links > 1 {
        let (bkv, key_blocks) = (bq / group, s.div_ceil(u64::from(BWD_KEYS)).max(1));
        scratch.acc_elems += bkv * key_blocks * u64::from(BWD_KEYS) * 2 * u64::from(p);
        scratch.ready_count += bkv * key_blocks;
    }
    scratch
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row takes a lane per 16-byte unit, a power of two, at most a warp; a warp then sums
    /// 32 / lanes rows (GPT-2's d = 64: 8 lanes, 4 rows, where one row per warp left 24 of
    /// its 32 lanes idle).
    #[test]
    fn delta_lanes_cover_a_row_in_16_byte_units() {
        let lanes: Vec<u32> = [1, 8, 13, 33, 64, 100, 128, 256, 1000]
            .map(delta_lanes)
            .into();
        assert_eq!(lanes, [1, 1, 2, 8, 8, 16, 16, 32, 32]);
        assert_eq!(delta_grid(96 * 1024, 64), (6144, 1, 1));
        assert_eq!(delta_grid(17, 256), (5, 1, 1));
    }

    /// A banded backward splits each key block's tiles into segments of 512 query rows (GPT-2
    /// at T = 1024: 2, LLaMA at 2048: 4), an unbanded one keeps one; the scratch of the dK/dV
    /// sums exists only where a key block has more than one link (grouped heads or segments).
    #[test]
    fn backward_segments_grid_and_scratch() {
        let segments = [(64, 1024), (128, 2048), (64, 512), (64, 513), (128, 513), (64, 0)]
            .map(|(p, t)| bwd_segments(p, t, true));
        assert_eq!(segments, [2, 4, 1, 2, 2, 1]);
        assert_eq!([bwd_query_rows(16), bwd_query_rows(64), bwd_query_rows(128)], [128, 128, 64]);
        assert_eq!(bwd_segments(64, 1024, false), 1);
        // GPT-2 124M at B=8 (96 query batches of 12 heads), LLaMA-3.2-1B at B=4 (32 query
        // heads in groups of 4).
        let gpt2 = grid(Kernel::Backward, Some(64), 96, (12, 1), (1024, 1024), true);
        assert_eq!(gpt2, (8, 12, 16));
        let llama = grid(Kernel::Backward, Some(64), 128, (32, 4), (2048, 2048), true);
        assert_eq!(llama, (16, 32, 16));
        assert_eq!(
            backward_scratch(64, (96, 1), (1024, 1024), true),
            BackwardScratch {
                acc_elems: 96 * 1024 * 64 + 96 * 1024 * 2 * 64,
                ready_count: 96 * 8 + 96 * 8,
            }
        );
        // BERT's unbanded mask, no grouping: one link, dQ's scratch only.
        assert_eq!(
            backward_scratch(64, (96, 1), (512, 512), false),
            BackwardScratch {
                acc_elems: 96 * 512 * 64,
                ready_count: 96 * 4,
            }
        );
        // Grouped heads link even when unbanded; the key blocks' scratch is whole blocks.
        assert_eq!(
            backward_scratch(128, (8, 4), (40, 200), false),
            BackwardScratch {
                acc_elems: 8 * 40 * 128 + 2 * 256 * 2 * 128,
                ready_count: 8 + 2 * 2,
            }
        );
    }

    /// The shared memory of every variant fits the device's opt-in limit (227 KiB on H100).
    #[test]
    fn every_variant_fits_in_shared_memory() {
        for p in TILES {
            for k in [Kernel::Forward, Kernel::Backward] {
                let bytes = shared_bytes(k, p, 2);
                assert!(bytes <= 232_448, "{k:?} at P = {p}: {bytes} bytes");
            }
        }
    }
}
