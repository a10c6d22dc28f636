//! `norm.cu`: layer and RMS norm, forward and backward, and the weight gradients.

use crate::cuda::emulate::contracts::{checked, row_block};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Ptr, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::{Pass, Kernel};

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::Norm {
            rms,
            pass,
            input,
            output,
        } => match pass {
            Pass::Forward => norm_fwd(m, l, rms, input, output, false),
            Pass::ForwardFp8 => norm_fwd(m, l, rms, input, output, true),
            Pass::Backward => norm_bwd(m, l, rms, input, output),
            Pass::BackwardWeight => norm_bwd_weight(m, l, rms, input, output),
        },
    }
}

/// A forward launch; `fp8`: the `*_fwd_fp8` kernels, which always normalize (`y` may be null)
/// and write the output's amax partials (one float per block) and, with a scale, its E4M3 cast.
pub(crate) fn norm_fwd(
    m: &Mem,
    l: &Launch,
    rms: bool,
    ti: DType,
    to: DType,
    fp8: bool,
) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let x = a.ptr(m, "x")?;
    let x_low = a.ptr(m, "x_low")?;
    let res = a.ptr(m, "res")?;
    let sum_out = a.ptr(m, "sum_out")?;
    let w = a.need(m, "w")?;
    let b = if rms { None } else { a.ptr(m, "b")? };
    let y = a.ptr(m, "y")?;
    let mean_out = if rms { None } else { a.ptr(m, "mean_out")? };
    let rstd_out = a.ptr(m, "rstd_out")?;
    let (scale, q, partials) = if fp8 {
        (a.ptr(m, "scale")?, a.ptr(m, "q")?, Some(a.need(m, "partials")?))
    } else {
        (None, None, None)
    };
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    a.f64("eps")?;
    a.end()?;
    // A null `y` computes the statistics only (except under FP8, which always normalizes) and
    // reads neither `w` nor `b`; a LayerNorm that normalizes reads its bias, which must then
    // exist.
    let normalizes = fp8 || y.is_some();
    if normalizes && !rms && b.is_none() {
        return Err("argument `b` is null, but the kernel normalizes and reads it".into());
    }
    if x.is_some() == x_low.is_some() {
        return Err("arguments `x` and `x_low`: the kernel reads exactly one of them".into());
    }
    if q.is_some() != scale.is_some() {
        return Err("arguments `q` and `scale`: the cast needs both or neither".into());
    }
    let normalized = |p: Option<Ptr>| if normalizes { p } else { None };
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    let big = |s: usize| (rows * h * s) as u64;
    let blocks = u64::from(l.grid.0);
    if fp8 && (l.grid.1, l.grid.2) != (1, 1) {
        return Err(format!("grid {:?}: the kernel takes a 1-D grid", l.grid));
    }
    checked(
        m,
        vec![
            use_("x", x, big(si), si, Io::R),
            use_("x_low", x_low, big(so), so, Io::R),
            use_("res", res, big(si), si, Io::R),
            use_("sum_out", sum_out, big(si), si, Io::W),
            use_("w", normalized(Some(w)), h as u64 * 4, 4, Io::R),
            use_("b", normalized(b), h as u64 * 4, 4, Io::R),
            use_("y", y, big(so), so, Io::W),
            use_("mean_out", mean_out, rows as u64 * 4, 4, Io::W),
            use_("rstd_out", rstd_out, rows as u64 * 4, 4, Io::W),
            use_("scale", scale, 4, 4, Io::R),
            use_("q", q, big(1), 1, Io::W),
            use_("partials", partials, blocks * 4, 4, Io::W),
        ],
        &[("y", "x"), ("y", "sum_out"), ("sum_out", "x")],
    )
}

pub(crate) fn norm_bwd(m: &Mem, l: &Launch, rms: bool, ti: DType, to: DType) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let s = a.need(m, "s")?;
    let dy = a.need(m, "dy")?;
    let w = a.need(m, "w")?;
    let mean = if rms { None } else { Some(a.need(m, "mean")?) };
    let rstd = a.need(m, "rstd")?;
    let dadd = a.ptr(m, "dadd")?;
    let dx = a.need(m, "dx")?;
    let dx_low = a.ptr(m, "dx_low")?;
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    a.end()?;
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    let big = |s: usize| (rows * h * s) as u64;
    checked(
        m,
        vec![
            use_("s", Some(s), big(si), si, Io::R),
            use_("dy", Some(dy), big(so), so, Io::R),
            use_("w", Some(w), h as u64 * 4, 4, Io::R),
            use_("mean", mean, rows as u64 * 4, 4, Io::R),
            use_("rstd", Some(rstd), rows as u64 * 4, 4, Io::R),
            use_("dadd", dadd, big(si), si, Io::R),
            use_("dx", Some(dx), big(si), si, Io::W),
            use_("dx_low", dx_low, big(so), so, Io::W),
        ],
        &[("dx", "dy"), ("dx", "s")],
    )
}

pub(crate) fn norm_bwd_weight(m: &Mem, l: &Launch, rms: bool, ti: DType, to: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let s = a.need(m, "s")?;
    let dy = a.need(m, "dy")?;
    let mean = if rms { None } else { Some(a.need(m, "mean")?) };
    let rstd = a.need(m, "rstd")?;
    let dw_part = a.need(m, "dw_part")?;
    let db_part = if rms {
        None
    } else {
        Some(a.need(m, "db_part")?)
    };
    let dw = a.ptr(m, "dw")?;
    let db = if rms { None } else { a.ptr(m, "db")? };
    let done = a.need(m, "done")?;
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    let per = a.count32("rows_per_group")?;
    a.end()?;
    weight_block(l)?;
    // Not a grid-stride kernel: block (x, y) owns columns 256 x.. (8 a lane) and row group y.
    let groups = l.grid.1 as usize;
    let cols = (l.grid.0 as usize * l.block.0 as usize * 8).min(h);
    let needed = rows.div_ceil(per.max(1));
    if per == 0 || groups < needed || cols < h {
        return Err(format!(
            "grid {:?} block {:?} covers {cols} of {h} columns and {groups} of {needed} row \
             groups of {per}",
            l.grid, l.block
        ));
    }
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    let big = |s: usize| (rows * h * s) as u64;
    let part = (groups * h * 8) as u64;
    checked(
        m,
        vec![
            use_("s", Some(s), big(si), si, Io::R),
            use_("dy", Some(dy), big(so), so, Io::R),
            use_("mean", mean, rows as u64 * 4, 4, Io::R),
            use_("rstd", Some(rstd), rows as u64 * 4, 4, Io::R),
            // Written whole by the launch, then read back by its last groups.
            use_("dw_part", Some(dw_part), part, 8, Io::W),
            use_("db_part", db_part, part, 8, Io::W),
            use_("dw", dw, h as u64 * 4, 4, Io::W),
            use_("db", db, h as u64 * 4, 4, Io::W),
            use_("done", Some(done), l.grid.0 as u64 * 4, 4, Io::Rw),
        ],
        &[],
    )
}

/// The weight-gradient kernels' block: 32 lanes, 8 threads each (`NW_COLS`, `NW_LANES`).
fn weight_block(l: &Launch) -> R<()> {
    if l.block != (32, 8, 1) {
        return Err(format!(
            "block {:?}: the weight-gradient kernels are written for block (32, 8, 1)",
            l.block
        ));
    }
    Ok(())
}
