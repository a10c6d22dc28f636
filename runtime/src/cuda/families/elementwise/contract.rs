//! `elementwise.cu`: the activation functions forward and backward, add and mul.

use crate::cuda::emulate::contracts::checked;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::Kernel;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::Unary {
            backward, dtype, ..
        } => unary(m, l, dtype, backward),
        Kernel::Binary { dtype, .. } => binary(m, l, dtype),
    }
}

pub(crate) fn unary(m: &Mem, l: &Launch, t: DType, backward: bool) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let dy = if backward {
        Some(a.need(m, "dy")?)
    } else {
        None
    };
    let out = if backward { "dx" } else { "y" };
    let y = a.need(m, out)?;
    let n = a.count("n")?;
    a.end()?;
    let s = t.size_bytes();
    let b = (n * s) as u64;
    checked(
        m,
        vec![
            use_("x", Some(x), b, s, Io::R),
            use_("dy", dy, b, s, Io::R),
            use_(out, Some(y), b, s, Io::W),
        ],
        &[("y", "x"), ("dx", "dy")],
    )
}

pub(crate) fn binary(m: &Mem, l: &Launch, t: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let pa = a.need(m, "a")?;
    let pb = a.need(m, "b")?;
    let out = a.need(m, "out")?;
    let n = a.count("n")?;
    let nb = a.count("nb")?;
    a.end()?;
    if nb == 0 || (n % nb != 0) {
        return Err(format!("n = {n} is not a multiple of nb = {nb}"));
    }
    let s = t.size_bytes();
    checked(
        m,
        vec![
            use_("a", Some(pa), (n * s) as u64, s, Io::R),
            use_("b", Some(pb), (nb * s) as u64, s, Io::R),
            use_("out", Some(out), (n * s) as u64, s, Io::W),
        ],
        &[("out", "a")],
    )
}
