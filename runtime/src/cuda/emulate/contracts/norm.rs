//! `norm.cu`: layer and RMS norm, forward and backward, and the weight-gradient reduction.

use super::row_block;
use crate::cpu::math;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem, Ptr};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::{round_to, DType};

pub(super) fn norm_fwd(m: &mut Mem, l: &Launch, rms: bool, ti: DType, to: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let res = a.ptr(m, "res")?;
    let sum_out = a.ptr(m, "sum_out")?;
    let w = a.need(m, "w")?;
    let b = if rms { None } else { a.ptr(m, "b")? };
    let y = a.ptr(m, "y")?;
    let mean_out = if rms { None } else { a.ptr(m, "mean_out")? };
    let rstd_out = a.ptr(m, "rstd_out")?;
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    let eps = a.f64("eps")?;
    a.end()?;
    // A null `y` computes the statistics only and reads neither `w` nor `b`; a LayerNorm that
    // normalizes reads its bias, which must then exist.
    if y.is_some() && !rms && b.is_none() {
        return Err(
            "argument `b` is null, but the kernel normalizes (`y` is set) and reads it".into(),
        );
    }
    let normalizes = |p: Option<Ptr>| if y.is_some() { p } else { None };
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    let big = |s: usize| (rows * h * s) as u64;
    check_uses(
        m,
        &[
            use_("x", Some(x), big(si), si, Io::R),
            use_("res", res, big(si), si, Io::R),
            use_("sum_out", sum_out, big(si), si, Io::W),
            use_("w", normalizes(Some(w)), h as u64 * 4, 4, Io::R),
            use_("b", normalizes(b), h as u64 * 4, 4, Io::R),
            use_("y", y, big(so), so, Io::W),
            use_("mean_out", mean_out, rows as u64 * 4, 4, Io::W),
            use_("rstd_out", rstd_out, rows as u64 * 4, 4, Io::W),
        ],
        &[("y", "x"), ("y", "sum_out"), ("sum_out", "x")],
    )?;
    let (wv, bv) = match y {
        Some(_) => (
            m.fv(w, 0, h, DType::F32)?,
            match b {
                Some(b) => m.fv(b, 0, h, DType::F32)?,
                None => vec![0.0; h],
            },
        ),
        None => (Vec::new(), Vec::new()),
    };
    for r in 0..rows {
        let at = (r * h) as i64;
        let mut s = m.fv(x, at, h, ti)?;
        if let Some(res) = res {
            for (v, rv) in s.iter_mut().zip(m.fv(res, at, h, ti)?) {
                *v = round_to(ti, *v + rv);
            }
        }
        if let Some(so) = sum_out {
            m.set_fv(so, at, ti, &s)?;
        }
        let hf = h as f64;
        let (mean, rstd) = if rms {
            (0.0, (1.0 / (math::sum_sq(&s) / hf + eps).sqrt()) as f32)
        } else {
            let mean = math::sum(&s) / hf;
            let var = math::sum_sq_dev(&s, mean) / hf;
            (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
        };
        if let Some(p) = mean_out {
            m.set_f32(p, r as i64, mean)?;
        }
        if let Some(p) = rstd_out {
            m.set_f32(p, r as i64, rstd)?;
        }
        let Some(y) = y else { continue };
        let out: Vec<f32> = s
            .iter()
            .zip(&wv)
            .zip(&bv)
            .map(|((&v, &w), &b)| {
                if rms {
                    v * rstd * w
                } else {
                    (v - mean) * rstd * w + b
                }
            })
            .collect();
        m.set_fv(y, at, to, &out)?;
    }
    Ok(())
}

pub(super) fn norm_bwd(m: &mut Mem, l: &Launch, rms: bool, ti: DType, to: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let s = a.need(m, "s")?;
    let dy = a.need(m, "dy")?;
    let w = a.need(m, "w")?;
    let mean = if rms { None } else { Some(a.need(m, "mean")?) };
    let rstd = a.need(m, "rstd")?;
    let dadd = a.ptr(m, "dadd")?;
    let dx = a.need(m, "dx")?;
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    a.end()?;
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    let big = |s: usize| (rows * h * s) as u64;
    check_uses(
        m,
        &[
            use_("s", Some(s), big(si), si, Io::R),
            use_("dy", Some(dy), big(so), so, Io::R),
            use_("w", Some(w), h as u64 * 4, 4, Io::R),
            use_("mean", mean, rows as u64 * 4, 4, Io::R),
            use_("rstd", Some(rstd), rows as u64 * 4, 4, Io::R),
            use_("dadd", dadd, big(si), si, Io::R),
            use_("dx", Some(dx), big(si), si, Io::W),
        ],
        &[("dx", "dy"), ("dx", "s")],
    )?;
    let wv = m.fv(w, 0, h, DType::F32)?;
    let hf = h as f64;
    for r in 0..rows {
        let at = (r * h) as i64;
        let xs = m.fv(s, at, h, ti)?;
        let ds = m.fv(dy, at, h, to)?;
        let mu = match mean {
            Some(p) => m.f32_at(p, r as i64)?,
            None => 0.0,
        };
        let rs = m.f32_at(rstd, r as i64)?;
        let (mut sg, mut sgx) = (0f64, 0f64);
        for ((&x, &d), &w) in xs.iter().zip(&ds).zip(&wv) {
            let g = f64::from(d * w);
            if rms {
                sgx += g * f64::from(x);
            } else {
                sg += g;
                sgx += g * f64::from((x - mu) * rs);
            }
        }
        let (mean_g, mean_gx) = ((sg / hf) as f32, (sgx / hf) as f32);
        let c = rs * rs * mean_gx;
        let mut out: Vec<f32> = xs
            .iter()
            .zip(&ds)
            .zip(&wv)
            .map(|((&x, &d), &w)| {
                if rms {
                    rs * (d * w - x * c)
                } else {
                    let xhat = (x - mu) * rs;
                    rs * (d * w - mean_g - xhat * mean_gx)
                }
            })
            .collect();
        if let Some(p) = dadd {
            for (v, add) in out.iter_mut().zip(m.fv(p, at, h, ti)?) {
                *v = round_to(ti, *v) + add;
            }
        }
        m.set_fv(dx, at, ti, &out)?;
    }
    Ok(())
}

pub(super) fn norm_bwd_weight(m: &mut Mem, l: &Launch, rms: bool, ti: DType, to: DType) -> R<()> {
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
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    let per = a.count32("rows_per_group")?;
    a.end()?;
    if l.block.1 != 1 || l.block.2 != 1 {
        return Err(format!("block {:?}: the kernel takes a 1-D block", l.block));
    }
    // Not a grid-stride kernel: block (x, y) owns columns x * blockDim.x.. and row group y.
    let groups = l.grid.1 as usize;
    let cols = (l.grid.0 as usize * l.block.0 as usize).min(h);
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
    check_uses(
        m,
        &[
            use_("s", Some(s), big(si), si, Io::R),
            use_("dy", Some(dy), big(so), so, Io::R),
            use_("mean", mean, rows as u64 * 4, 4, Io::R),
            use_("rstd", Some(rstd), rows as u64 * 4, 4, Io::R),
            use_("dw_part", Some(dw_part), part, 8, Io::W),
            use_("db_part", db_part, part, 8, Io::W),
        ],
        &[],
    )?;
    for g in 0..groups {
        let (r0, r1) = ((g * per).min(rows), ((g + 1) * per).min(rows));
        let mut dw = vec![0f64; h];
        let mut db = vec![0f64; h];
        for r in r0..r1 {
            let at = (r * h) as i64;
            let xs = m.fv(s, at, h, ti)?;
            let ds = m.fv(dy, at, h, to)?;
            let mu = match mean {
                Some(p) => m.f32_at(p, r as i64)?,
                None => 0.0,
            };
            let rs = m.f32_at(rstd, r as i64)?;
            for j in 0..h {
                let xhat = if rms { xs[j] * rs } else { (xs[j] - mu) * rs };
                dw[j] += f64::from(ds[j]) * f64::from(xhat);
                db[j] += f64::from(ds[j]);
            }
        }
        for j in 0..h {
            m.set_f64(dw_part, (g * h + j) as i64, dw[j])?;
            if let Some(p) = db_part {
                m.set_f64(p, (g * h + j) as i64, db[j])?;
            }
        }
    }
    Ok(())
}

pub(super) fn norm_weight_grad_reduce(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let part = a.need(m, "part")?;
    let groups = a.count32("groups")?;
    let h = a.count32("h")?;
    let out = a.need(m, "out")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("part", Some(part), (groups * h * 8) as u64, 8, Io::R),
            use_("out", Some(out), h as u64 * 4, 4, Io::W),
        ],
        &[],
    )?;
    for j in 0..h {
        let mut t = 0f64;
        for g in 0..groups {
            t += m.f64_at(part, (g * h + j) as i64)?;
        }
        m.set_f32(out, j as i64, t as f32)?;
    }
    Ok(())
}
