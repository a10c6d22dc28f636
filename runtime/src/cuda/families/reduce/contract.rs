//! `reduce.cu`: sum, mean and max over one axis.

use crate::cuda::emulate::contracts::checked;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::Kernel;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    reduce(m, l, k.input, k.output)
}

pub(crate) fn reduce(m: &Mem, l: &Launch, ti: DType, to: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let outer = a.count("outer")?;
    let len = a.count("len")?;
    let inner = a.count("inner")?;
    a.end()?;
    if outer * inner == 0 {
        return Err("launched for an empty result (the header: nothing to launch)".into());
    }
    let grid = (
        inner.div_ceil(32).min(65_535) as u32,
        outer.min(65_535) as u32,
        1,
    );
    if l.block != (32, 8, 1) || l.grid != grid {
        return Err(format!(
            "launched with grid {:?} block {:?}; the kernel must be launched with grid {grid:?} \
             block (32, 8, 1)",
            l.grid, l.block
        ));
    }
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    checked(
        m,
        vec![
            use_("x", Some(x), (outer * len * inner * si) as u64, si, Io::R),
            use_("y", Some(y), (outer * inner * so) as u64, so, Io::W),
        ],
        &[],
    )
}
