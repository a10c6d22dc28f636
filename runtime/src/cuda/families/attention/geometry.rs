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

/// Query rows per backward tile at tile width `p` (`AttShape<P>::QROWS`).
pub fn bwd_query_rows(p: u32) -> u32 {
    if p <= 64 {
        64
    } else {
        32
    }
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
/// backward's K/V tiles, double-buffered Q/dO tiles, the dS^T tile, the double-buffered F32
/// row statistics and the block's mask bytes.
pub fn shared_bytes(kernel: Kernel, p: u32, elem: u32) -> u32 {
    let row = (p + PAD) * elem;
    match kernel {
        Kernel::Forward => {
            let keys = fwd_keys(p);
            FWD_ROWS * row + 4 * keys * row + 2 * keys
        }
        Kernel::Backward => {
            let qt = bwd_query_rows(p);
            2 * BWD_KEYS * row + 4 * qt * row + BWD_KEYS * (qt + PAD) * elem + 4 * qt * 4 + BWD_KEYS
        }
        Kernel::Dq | Kernel::DkDv => 0,
    }
}

/// The grid of `kernel` over `bq` query batches of `t` rows (`bkv = bq / group` key batches of
/// `s` keys), tensor-core (`tensor_cores`) or F32. The tensor-core kernels split the batches
/// as (outer, head) by the grid: `heads` query heads (a multiple of `group`) to an outer batch.
pub fn grid(
    kernel: Kernel,
    tensor_cores: bool,
    bq: u32,
    (heads, group): (u32, u32),
    t: u32,
    s: u32,
) -> (u32, u32, u32) {
    let bkv = bq / group.max(1);
    let (heads, group) = (heads.max(1), group.max(1));
    match kernel {
        Kernel::Forward if tensor_cores => (t.div_ceil(FWD_ROWS).max(1), heads, bq / heads),
        Kernel::Backward => (s.div_ceil(BWD_KEYS).max(1), heads / group, bq / heads),
        Kernel::Forward | Kernel::Dq => (t.div_ceil(F32_ROWS).max(1), bq, 1),
        Kernel::DkDv => (s.div_ceil(F32_ROWS).max(1), bkv, 1),
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

/// Elements of the tensor-core backward's F32 `dq_acc` (`bq` query batches of `t` rows, rows
/// of `p` floats).
pub fn dq_acc_elems(bq: u64, t: u64, p: u32) -> u64 {
    bq * t * u64::from(p)
}

/// Ints of the tensor-core backward's `dq_ready` counters (one per query batch and tile), which
/// must be zero when it starts.
pub fn dq_ready_count(bq: u64, t: u64, p: u32) -> u64 {
    bq * t.div_ceil(u64::from(bwd_query_rows(p)))
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
