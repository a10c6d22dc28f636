//! `reduce.cu`: sum, mean and max over one axis, and two-stage column sums.

use super::Kernel;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::contracts::checked;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::Whole { input, output, .. } => reduce(m, l, input, output),
        Kernel::Grouped { input, output, .. } => grouped(m, l, input, output),
    }
}

/// The launch shape the header gives, or an error naming it.
fn shape(l: &Launch, grid: (u32, u32, u32)) -> R<()> {
    if l.block != (32, 8, 1) || l.grid != grid {
        return Err(format!(
            "launched with grid {:?} block {:?}; the kernel must be launched with grid {grid:?} \
             block (32, 8, 1)",
            l.grid, l.block
        ));
    }
    Ok(())
}

fn reduce(m: &Mem, l: &Launch, ti: DType, to: DType) -> R<Vec<Use>> {
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
    shape(
        l,
        (
            inner.div_ceil(32).min(65_535) as u32,
            outer.min(65_535) as u32,
            1,
        ),
    )?;
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

fn grouped(m: &Mem, l: &Launch, ti: DType, to: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let part = a.need(m, "part")?;
    let y = a.need(m, "y")?;
    let done = a.need(m, "done")?;
    let outer = a.count("outer")?;
    let len = a.count("len")?;
    let inner = a.count("inner")?;
    let per_group = a.count("rows_per_group")?;
    a.end()?;
    if outer * inner == 0 || per_group == 0 {
        return Err("launched for an empty result or with empty row groups".into());
    }
    let groups = len.div_ceil(per_group).max(1);
    let blocks = inner.div_ceil(256);
    if groups > 65_535 || outer > 65_535 || blocks > 65_535 {
        return Err(format!(
            "{groups} row groups of {outer} x {inner} columns exceed the grid's 65535 per dim"
        ));
    }
    shape(l, (blocks as u32, groups as u32, outer as u32))?;
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    checked(
        m,
        vec![
            use_("x", Some(x), (outer * len * inner * si) as u64, si, Io::R),
            // Written whole by the launch, then read back by each column block's last group.
            use_("part", Some(part), (outer * groups * inner * 8) as u64, 8, Io::W),
            use_("y", Some(y), (outer * inner * so) as u64, so, Io::W),
            use_("done", Some(done), (outer * blocks * 4) as u64, 4, Io::Rw),
        ],
        &[],
    )
}
