//! `rope.cu`: rotary embeddings forward and backward, and the (cos, sin) table.

use super::checked;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;

/// `rope_fwd_<t>(x, y, ..)` and `rope_bwd_<t>(dy, dx, ..)`.
pub(super) fn rope(m: &Mem, l: &Launch, dt: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    // The backward names its operand and result by direction.
    let (input, output) = if l.entry.starts_with("rope_bwd") {
        ("dy", "dx")
    } else {
        ("x", "y")
    };
    let x = a.need(m, input)?;
    let y = a.need(m, output)?;
    let cs = a.need(m, "cs")?;
    let rows = a.count("rows")?;
    let t = a.count32("t")?;
    let d = a.count32("d")?;
    a.end()?;
    if t == 0 || d % 2 != 0 {
        return Err(format!("t = {t}, d = {d} (d must be even)"));
    }
    let s = dt.size_bytes();
    checked(
        m,
        vec![
            use_(input, Some(x), (rows * d * s) as u64, s, Io::R),
            use_(output, Some(y), (rows * d * s) as u64, s, Io::W),
            use_("cs", Some(cs), (t * (d / 2) * 8) as u64, 8, Io::R),
        ],
        &[(output, input)],
    )
}

pub(super) fn rope_table(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let cs = a.need(m, "cs")?;
    let t = a.count32("t")?;
    let d = a.count32("d")?;
    a.f64("theta")?;
    a.end()?;
    checked(
        m,
        vec![use_("cs", Some(cs), (t * (d / 2) * 8) as u64, 8, Io::W)],
        &[],
    )
}
