//! The launch geometry of `attention.cu`, as its header states it: which variant a head dim
//! takes, and each kernel's grid and dynamic shared memory. The CUDA lowering launches by
//! these and the emulator's contract checks launches against them, so the two cannot drift
//! apart; the numbers are the file's `ATT_*` constants.

/// Threads per block of every attention kernel.
pub const THREADS: u32 = 128;
/// Query rows per forward / dq block, keys per dk/dv block, keys per loaded tile.
pub const ROWS: u32 = 64;
/// Query rows per tile of the dk/dv loop.
const QROWS: u32 = 32;
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

/// The kernels of one attention op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Forward,
    /// The query gradient.
    Dq,
    /// The key and value gradients.
    DkDv,
}

/// Bytes of dynamic shared memory a tensor-core kernel takes at tile `p` with operands of
/// `elem` bytes: its Q/K/V/dO tiles (`p + 8` elements per row), the F32 row statistics of the
/// dk/dv loop, and 64 mask bytes.
pub fn shared_bytes(kernel: Kernel, p: u32, elem: u32) -> u32 {
    let row = (p + PAD) * elem;
    match kernel {
        Kernel::Forward => 3 * ROWS * row + ROWS,
        Kernel::Dq => 4 * ROWS * row + ROWS,
        Kernel::DkDv => (2 * ROWS + 2 * QROWS) * row + 2 * QROWS * 4 + ROWS,
    }
}

/// The grid of `kernel` over `bq` query batches of `t` rows (`bkv = bq / group` key batches of
/// `s` keys), tensor-core (`tensor_cores`) or F32.
pub fn grid(
    kernel: Kernel,
    tensor_cores: bool,
    bq: u32,
    group: u32,
    t: u32,
    s: u32,
) -> (u32, u32, u32) {
    let per = if tensor_cores { ROWS } else { F32_ROWS };
    match kernel {
        Kernel::Forward | Kernel::Dq => (t.div_ceil(per).max(1), bq, 1),
        Kernel::DkDv => (s.div_ceil(per).max(1), bq / group.max(1), 1),
    }
}

/// The grid of the `delta` kernel over `rows` query rows.
pub fn delta_grid(rows: u64) -> (u32, u32, u32) {
    (rows.div_ceil(u64::from(F32_ROWS)).max(1) as u32, 1, 1)
}
