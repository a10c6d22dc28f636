//! `rope.cu`: rotary embeddings forward and backward (at packed sequences' positions when
//! given), and the (cos, sin) table.

use crate::cuda::emulate::contracts::{checked, Strides};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::Kernel;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::Table => rope_table(m, l),
        Kernel::Rope { backward, dtype } => rope(m, l, backward, dtype),
    }
}

/// `rope_fwd_<t>(x, y, ..)` and `rope_bwd_<t>(dy, dx, ..)`.
pub(crate) fn rope(m: &Mem, l: &Launch, backward: bool, dt: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    // The backward names its operand and result by direction.
    let (input, output) = if backward { ("dy", "dx") } else { ("x", "y") };
    let x = a.need(m, input)?;
    let y = a.need(m, output)?;
    let cs = a.need(m, "cs")?;
    let positions = a.ptr(m, "positions")?;
    let batches = a.count32("batches")?;
    let t = a.count32("t")?;
    let d = a.count32("d")?;
    let heads = a.count32("heads")?;
    let (sx, sy, sp) = (
        Strides::read(&mut a, input)?,
        Strides::read(&mut a, output)?,
        Strides::read(&mut a, "positions")?,
    );
    a.end()?;
    if d % 2 != 0 {
        return Err(format!("d = {d}: the rotation pairs halves of an even d"));
    }
    let s = dt.size_bytes();
    let dims = (batches, heads, t, d);
    let mut uses = vec![
        sx.use_of(input, x, dims, s, Io::R)?,
        sy.use_of(output, y, dims, s, Io::W)?,
        use_("cs", Some(cs), (t * (d / 2) * 8) as u64, 8, Io::R),
    ];
    // One i64 position per row, through its own strides (0 where it broadcasts).
    if let Some(p) = positions {
        uses.push(sp.use_of("positions", p, (batches, heads, t, 1), 8, Io::R)?);
    }
    checked(m, uses, &[(output, input)])
}

pub(crate) fn rope_table(m: &Mem, l: &Launch) -> R<Vec<Use>> {
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
