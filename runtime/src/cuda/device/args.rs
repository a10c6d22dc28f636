//! Kernel arguments as the bytes the driver copies: one aligned buffer per parameter.

use crate::cuda::program::{Arg, CopyLayout, Place};

/// The bytes of one kernel argument, exactly as many as the kernel's parameter has:
/// pointers, tables and 64-bit values take 8, `I32`/`U32` 4, `U16` 2, a [`CopyLayout`] its
/// C struct's 216. Little-endian, as CUDA hosts are.
pub fn arg_bytes(
    arg: &Arg,
    address: &dyn Fn(Place) -> u64,
    table_address: &dyn Fn(usize) -> u64,
) -> Vec<u8> {
    match arg {
        Arg::Ptr(p) => address(*p).to_le_bytes().to_vec(),
        Arg::Null => 0u64.to_le_bytes().to_vec(),
        Arg::I32(x) => x.to_le_bytes().to_vec(),
        Arg::I64(x) => x.to_le_bytes().to_vec(),
        Arg::U16(x) => x.to_le_bytes().to_vec(),
        Arg::U32(x) => x.to_le_bytes().to_vec(),
        Arg::U64(x) => x.to_le_bytes().to_vec(),
        Arg::F64(x) => x.to_le_bytes().to_vec(),
        Arg::Table(i) => table_address(*i).to_le_bytes().to_vec(),
        Arg::Layout(l) => layout_bytes(l),
    }
}

/// The bytes of a [`CopyLayout`] as its `repr(C)` struct (no padding: 24 i64s then 2 i32s).
fn layout_bytes(l: &CopyLayout) -> Vec<u8> {
    let mut out = Vec::with_capacity(std::mem::size_of::<CopyLayout>());
    for dims in [&l.shape, &l.src_stride, &l.dst_stride] {
        for x in dims.iter() {
            out.extend(x.to_le_bytes());
        }
    }
    out.extend(l.src_offset.to_le_bytes());
    out.extend(l.dst_offset.to_le_bytes());
    out.extend(l.rank.to_le_bytes());
    out.extend(l.pad.to_le_bytes());
    out
}

/// Bytes copied into 8-byte words, so the driver reads each parameter from aligned storage;
/// the words' memory holds exactly `bytes` (then zero padding).
pub(super) fn to_words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_ne_bytes(w)
        })
        .collect()
}
