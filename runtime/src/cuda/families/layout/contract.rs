//! `cast.cu` and `layout.cu`: dtype casts, strided copies, fills.

use crate::cuda::emulate::contracts::checked;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Ptr, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::{Launch, MAX_RANK};
use castor_ir::DType;
use std::collections::HashSet;
use super::Kernel;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::Cast { from, to } => cast(m, l, from, to),
        Kernel::StridedCopy { bytes } => strided_copy(m, l, bytes as usize),
        Kernel::Fill { bytes } => fill(m, l, bytes as usize),
    }
}

pub(crate) fn cast(m: &Mem, l: &Launch, from: DType, to: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let n = a.count("n")?;
    a.end()?;
    let (sf, st) = (from.size_bytes(), to.size_bytes());
    checked(
        m,
        vec![
            use_("x", Some(x), (n * sf) as u64, sf, Io::R),
            use_("y", Some(y), (n * st) as u64, st, Io::W),
        ],
        &[],
    )
}

pub(crate) fn strided_copy(m: &Mem, l: &Launch, w: usize) -> R<Vec<Use>> {
    if ![1, 2, 4, 8, 16].contains(&w) {
        return Err(format!("no strided copy of {w}-byte elements"));
    }
    let mut a = Args::new(l);
    let src = a.need(m, "src")?;
    let dst = a.need(m, "dst")?;
    // 16-byte units move as one vector load and store, which the device requires aligned.
    for (what, p) in [("src", src), ("dst", dst)] {
        if w == 16 && p.off % 16 != 0 {
            return Err(format!(
                "`{what}` at {} is not 16-byte aligned for 16-byte units",
                m.describe(p)
            ));
        }
    }
    let n = a.i64("n")?;
    let lay = a.layout("l")?;
    a.end()?;
    let rank = lay.rank.clamp(0, MAX_RANK as i32) as usize;
    let want: i64 = lay.shape[..rank].iter().product();
    if n != want {
        return Err(format!(
            "n = {n}, but the layout's shape {:?} holds {want} elements",
            &lay.shape[..rank]
        ));
    }
    if lay.shape[..rank].iter().any(|&d| d < 0) {
        return Err(format!("negative dims in {:?}", &lay.shape[..rank]));
    }
    // The header requires a distinct destination for every element; the spans of both sides
    // are the buffers the copy touches.
    let mut seen = HashSet::new();
    let (mut s_lo, mut s_hi, mut d_lo, mut d_hi) = (i64::MAX, i64::MIN, i64::MAX, i64::MIN);
    for i in 0..n {
        let (mut rest, mut s, mut d) = (i, lay.src_offset, lay.dst_offset);
        for k in (0..rank).rev() {
            let c = rest % lay.shape[k];
            rest /= lay.shape[k];
            s += c * lay.src_stride[k];
            d += c * lay.dst_stride[k];
        }
        if !seen.insert(d) {
            return Err(format!(
                "element {i} writes destination element {d} a second time (the kernel needs \
                 distinct destinations)"
            ));
        }
        (s_lo, s_hi, d_lo, d_hi) = (s_lo.min(s), s_hi.max(s), d_lo.min(d), d_hi.max(d));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    let wb = w as i64;
    // The element span [lo, hi] from `p`, as a use the kernel reaches through `p`.
    let span = |what: &str, p: Ptr, lo: i64, hi: i64, io: Io| -> R<Option<Use>> {
        let off = u64::try_from(i128::from(p.off) + i128::from(lo * wb))
            .map_err(|_| format!("`{what}` element {lo} is before {}", m.describe(p)))?;
        let first = Ptr { buf: p.buf, off };
        Ok(use_(what, Some(first), ((hi - lo + 1) * wb) as u64, w, io).map(|u| Use { at: p, ..u }))
    };
    checked(
        m,
        vec![
            span("src", src, s_lo, s_hi, Io::R)?,
            span("dst", dst, d_lo, d_hi, Io::W)?,
        ],
        &[],
    )
}

pub(crate) fn fill(m: &Mem, l: &Launch, w: usize) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let dst = a.need(m, "dst")?;
    let n = a.count("n")?;
    match w {
        1 | 4 => a.u32("value")?,
        2 => u32::from(a.u16("value")?),
        8 => a.u64("value")? as u32,
        _ => return Err(format!("no fill of {w}-byte elements")),
    };
    a.end()?;
    checked(
        m,
        vec![use_("dst", Some(dst), (n * w) as u64, w, Io::W)],
        &[],
    )
}
