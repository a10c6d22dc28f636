//! `reduce.cu`: sum, mean and max over one axis.

use crate::cpu::math;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::{DType, ReduceOp};

pub(super) fn reduce(m: &mut Mem, l: &Launch, op: ReduceOp, ti: DType, to: DType) -> R<()> {
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
    check_uses(
        m,
        &[
            use_("x", Some(x), (outer * len * inner * si) as u64, si, Io::R),
            use_("y", Some(y), (outer * inner * so) as u64, so, Io::W),
        ],
        &[],
    )?;
    let xs = m.fv(x, 0, outer * len * inner, ti)?;
    let mut out = vec![0f32; outer * inner];
    for o in 0..outer {
        if inner == 1 {
            let row = &xs[o * len..(o + 1) * len];
            out[o] = match op {
                ReduceOp::Sum => math::sum(row) as f32,
                ReduceOp::Mean if len == 0 => f32::NAN,
                ReduceOp::Mean => (math::sum(row) / len as f64) as f32,
                ReduceOp::Max => math::max(row),
            };
            continue;
        }
        for c in 0..inner {
            let col = (0..len).map(|r| xs[(o * len + r) * inner + c]);
            out[o * inner + c] = match op {
                ReduceOp::Max => col.fold(f32::NEG_INFINITY, math::max2),
                ReduceOp::Sum => col.map(f64::from).sum::<f64>() as f32,
                ReduceOp::Mean if len == 0 => f32::NAN,
                ReduceOp::Mean => (col.map(f64::from).sum::<f64>() / len as f64) as f32,
            };
        }
    }
    m.set_fv(y, 0, to, &out)
}
