//! `cast.cu` and `layout.cu`: dtype casts, strided copies, fills.

use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem, Ptr, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::{Launch, MAX_RANK};
use castor_ir::DType;
use std::collections::HashSet;

pub(super) fn cast(m: &mut Mem, l: &Launch, from: DType, to: DType) -> R<()> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let n = a.count("n")?;
    a.end()?;
    let (sf, st) = (from.size_bytes(), to.size_bytes());
    check_uses(
        m,
        &[
            use_("x", Some(x), (n * sf) as u64, sf, Io::R),
            use_("y", Some(y), (n * st) as u64, st, Io::W),
        ],
        &[],
    )?;
    for i in 0..n as i64 {
        match (from, to) {
            (f, t) if f.is_float() && t.is_float() => {
                let v = m.f(x, i, f)?;
                m.set_f(y, i, t, v)?;
            }
            (DType::I64, DType::Bool) => {
                let v = m.i64_at(x, i)?;
                m.put(y, i, [u8::from(v != 0)])?;
            }
            (DType::F32, DType::Bool) => {
                let v = m.f32_at(x, i)?;
                m.put(y, i, [u8::from(v != 0.0)])?;
            }
            (DType::Bool, DType::I64) => {
                let [v] = m.get::<1>(x, i)?;
                m.set_i64(y, i, i64::from(v != 0))?;
            }
            (DType::Bool, t) if t.is_float() => {
                let [v] = m.get::<1>(x, i)?;
                m.set_f(y, i, t, if v != 0 { 1.0 } else { 0.0 })?;
            }
            (DType::I64, t) if t.is_float() => {
                let v = m.i64_at(x, i)?;
                m.set_f(y, i, t, v as f32)?;
            }
            (DType::F32, DType::I64) => {
                let v = m.f32_at(x, i)?;
                m.set_i64(y, i, v as i64)?;
            }
            (f, t) => return Err(format!("no cast from {} to {}", f.name(), t.name())),
        }
    }
    Ok(())
}

pub(super) fn strided_copy(m: &mut Mem, l: &Launch, w: usize) -> R<()> {
    if ![1, 2, 4, 8].contains(&w) {
        return Err(format!("no strided copy of {w}-byte elements"));
    }
    let mut a = Args::new(l);
    let src = a.need(m, "src")?;
    let dst = a.need(m, "dst")?;
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
    let mut moves = Vec::with_capacity(n.max(0) as usize);
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
        moves.push((s, d));
    }
    if n > 0 {
        let wb = w as i64;
        // The element span [lo, hi] from `p`, as a use.
        let span = |what: &str, p: Ptr, lo: i64, hi: i64, io: Io| -> R<Option<Use>> {
            let off = u64::try_from(i128::from(p.off) + i128::from(lo * wb))
                .map_err(|_| format!("`{what}` element {lo} is before {}", m.describe(p)))?;
            let p = Ptr { buf: p.buf, off };
            Ok(use_(what, Some(p), ((hi - lo + 1) * wb) as u64, w, io))
        };
        check_uses(
            m,
            &[
                span("src", src, s_lo, s_hi, Io::R)?,
                span("dst", dst, d_lo, d_hi, Io::W)?,
            ],
            &[],
        )?;
    }
    for (s, d) in moves {
        let v = m.bytes(src, s * w as i64, w as u64)?.to_vec();
        m.bytes_mut(dst, d * w as i64, w as u64)?
            .copy_from_slice(&v);
    }
    Ok(())
}

pub(super) fn fill(m: &mut Mem, l: &Launch, w: usize) -> R<()> {
    let mut a = Args::new(l);
    let dst = a.need(m, "dst")?;
    let n = a.count("n")?;
    let bits: Vec<u8> = match w {
        1 => vec![a.u32("value")? as u8],
        2 => a.u16("value")?.to_le_bytes().to_vec(),
        4 => a.u32("value")?.to_le_bytes().to_vec(),
        8 => a.u64("value")?.to_le_bytes().to_vec(),
        _ => return Err(format!("no fill of {w}-byte elements")),
    };
    a.end()?;
    let b = m
        .bytes_mut(dst, 0, (n * w) as u64)
        .map_err(|e| format!("`dst`: {e}"))?;
    for c in b.chunks_exact_mut(w) {
        c.copy_from_slice(&bits);
    }
    Ok(())
}
