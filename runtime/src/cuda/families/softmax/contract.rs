//! `softmax.cu`: softmax forward with the causal and padding masks or packed sequences'
//! positions, and backward.

use crate::cuda::emulate::contracts::{checked, row_block};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::Kernel;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k.backward {
        false => softmax_fwd(m, l, k.input, k.output),
        true => softmax_bwd(m, l, k.input, k.output),
    }
}

pub(crate) fn softmax_fwd(m: &Mem, l: &Launch, ti: DType, to: DType) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let rows = a.count("rows")?;
    let tk = a.count32("tk")?;
    let tq = a.count32("tq")?;
    let heads = a.count32("heads")?;
    a.i32("causal")?;
    if a.i32("window")? < 0 {
        return Err("a negative sliding window".into());
    }
    let mask = a.ptr(m, "mask")?;
    let positions = a.ptr(m, "positions")?;
    let strides = [a.i64("msb")?, a.i64("msh")?, a.i64("msq")?, a.i64("msk")?];
    a.end()?;
    if tq == 0 || heads == 0 || rows % (tq * heads) != 0 {
        return Err(format!(
            "rows = {rows} is not a whole number of [heads = {heads}, tq = {tq}] blocks"
        ));
    }
    if strides.iter().any(|&s| s < 0) {
        return Err(format!("negative mask strides {strides:?}"));
    }
    if mask.is_some() && positions.is_some() {
        return Err("a bool mask and positions together (the kernel takes one or the other)".into());
    }
    // The mask elements the row walk reaches: the last (b, h, q, j) at every stride.
    let dims = [rows / (tq * heads), heads, tq, tk];
    let mask_elems = if dims.contains(&0) {
        0
    } else {
        1 + dims
            .iter()
            .zip(strides)
            .map(|(&d, s)| (d as u64 - 1) * s as u64)
            .sum::<u64>()
    };
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    checked(
        m,
        vec![
            use_("x", Some(x), (rows * tk * si) as u64, si, Io::R),
            use_("y", Some(y), (rows * tk * so) as u64, so, Io::W),
            use_("mask", mask, mask_elems, 1, Io::R),
            use_("positions", positions, 8 * mask_elems, 8, Io::R),
        ],
        &[("y", "x")],
    )
}

pub(crate) fn softmax_bwd(m: &Mem, l: &Launch, ti: DType, to: DType) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let y = a.need(m, "y")?;
    let dy = a.need(m, "dy")?;
    let dx = a.need(m, "dx")?;
    let rows = a.count("rows")?;
    let n = a.count32("n")?;
    a.end()?;
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    checked(
        m,
        vec![
            use_("y", Some(y), (rows * n * so) as u64, so, Io::R),
            use_("dy", Some(dy), (rows * n * so) as u64, so, Io::R),
            use_("dx", Some(dx), (rows * n * si) as u64, si, Io::W),
        ],
        &[],
    )
}
