//! `softmax.cu`: softmax forward and backward.

use super::row_block;
use crate::cpu::math;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;

pub(super) fn softmax_fwd(m: &mut Mem, l: &Launch, ti: DType, to: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let rows = a.count("rows")?;
    let tk = a.count32("tk")?;
    let tq = a.count32("tq")?;
    let heads = a.count32("heads")?;
    let causal = a.i32("causal")? != 0;
    let mask = a.ptr(m, "mask")?;
    let (sb, sh, sq, sk) = (
        a.i64("mask_sb")?,
        a.i64("mask_sh")?,
        a.i64("mask_sq")?,
        a.i64("mask_sk")?,
    );
    a.end()?;
    if tq == 0 || heads == 0 {
        return Err(format!("tq = {tq}, heads = {heads}"));
    }
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    check_uses(
        m,
        &[
            use_("x", Some(x), (rows * tk * si) as u64, si, Io::R),
            use_("y", Some(y), (rows * tk * so) as u64, so, Io::W),
        ],
        &[("y", "x")],
    )?;
    for row in 0..rows {
        let q = (row % tq) as i64;
        let bh = row / tq;
        let (hh, bb) = ((bh % heads) as i64, (bh / heads) as i64);
        let at = (row * tk) as i64;
        let visible = if causal {
            (q + 1 + tk as i64 - tq as i64).clamp(0, tk as i64) as usize
        } else {
            tk
        };
        let mut keep = vec![true; visible];
        if let Some(mp) = mask {
            let base = bb * sb + hh * sh + q * sq;
            for (j, k) in keep.iter_mut().enumerate() {
                let [b] = m
                    .get::<1>(mp, base + j as i64 * sk)
                    .map_err(|e| format!("`mask` of row {row}: {e}"))?;
                *k = b != 0;
            }
        }
        // Only the entries the kernel reads: visible and kept.
        let mut xs = vec![0f32; visible];
        for j in (0..visible).filter(|&j| keep[j]) {
            xs[j] = m.f(x, at + j as i64, ti)?;
        }
        let max = (0..visible)
            .filter(|&j| keep[j])
            .map(|j| xs[j])
            .reduce(math::max2);
        let out = match max {
            None => vec![1.0 / tk as f32; tk],
            Some(max) => {
                let mut e = vec![0f32; tk];
                for j in 0..visible {
                    if keep[j] {
                        e[j] = math::exp(xs[j] - max);
                    }
                }
                let inv = (1.0 / math::sum(&e[..visible])) as f32;
                e[..visible].iter_mut().for_each(|v| *v *= inv);
                e
            }
        };
        m.set_fv(y, at, to, &out)?;
    }
    Ok(())
}

pub(super) fn softmax_bwd(m: &mut Mem, l: &Launch, ti: DType, to: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let y = a.need(m, "y")?;
    let dy = a.need(m, "dy")?;
    let dx = a.need(m, "dx")?;
    let rows = a.count("rows")?;
    let n = a.count32("n")?;
    a.end()?;
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    check_uses(
        m,
        &[
            use_("y", Some(y), (rows * n * so) as u64, so, Io::R),
            use_("dy", Some(dy), (rows * n * so) as u64, so, Io::R),
            use_("dx", Some(dx), (rows * n * si) as u64, si, Io::W),
        ],
        &[],
    )?;
    for r in 0..rows {
        let at = (r * n) as i64;
        let (ys, ds) = (m.fv(y, at, n, to)?, m.fv(dy, at, n, to)?);
        let mut dot = 0f64;
        for (&y, &d) in ys.iter().zip(&ds) {
            dot += f64::from(y) * f64::from(d);
        }
        let dot = dot as f32;
        let out: Vec<f32> = ys.iter().zip(&ds).map(|(&y, &d)| y * (d - dot)).collect();
        m.set_fv(dx, at, ti, &out)?;
    }
    Ok(())
}
