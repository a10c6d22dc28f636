//! `cross_entropy.cu`: the loss forward, its finalize step, and its backward.

use super::{one_block, row_block};
use crate::cpu::math;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;

/// The row's max and `Σ exp(x - max)` in F64, as the CPU twin computes them.
fn row_stats(row: &[f32]) -> (f32, f64) {
    let max = math::max(row);
    (max, math::sum_by(row, |x| f64::from(math::exp(x - max))))
}

pub(super) fn cross_entropy_fwd(m: &mut Mem, l: &Launch, t: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let logits = a.need(m, "logits")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let v = a.count32("v")?;
    let ignore = a.i64("ignore_index")?;
    let row_loss = a.need(m, "row_loss")?;
    let row_max = a.ptr(m, "row_max")?;
    let row_inv = a.ptr(m, "row_inv")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    let st = t.size_bytes();
    check_uses(
        m,
        &[
            use_("logits", Some(logits), (rows * v * st) as u64, st, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("row_loss", Some(row_loss), rows as u64 * 8, 8, Io::W),
            use_("row_max", row_max, rows as u64 * 4, 4, Io::W),
            use_("row_inv", row_inv, rows as u64 * 4, 4, Io::W),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )?;
    for r in 0..rows {
        let ri = r as i64;
        let label = m.i64_at(labels, ri)?;
        let ok = label >= 0 && label < v as i64;
        let (loss, mx, inv) = if label == ignore || !ok {
            if label != ignore {
                m.report_bad(bad, ri)?;
            }
            (if label == ignore { 0.0 } else { f64::NAN }, 0.0, 0.0)
        } else {
            let xs = m.fv(logits, ri * v as i64, v, t)?;
            let (mx, s) = row_stats(&xs);
            (
                s.ln() + f64::from(mx) - f64::from(xs[label as usize]),
                mx,
                (1.0 / s) as f32,
            )
        };
        m.set_f64(row_loss, ri, loss)?;
        if let Some(p) = row_max {
            m.set_f32(p, ri, mx)?;
        }
        if let Some(p) = row_inv {
            m.set_f32(p, ri, inv)?;
        }
    }
    Ok(())
}

pub(super) fn cross_entropy_finalize(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let row_loss = a.need(m, "row_loss")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let ignore = a.i64("ignore_index")?;
    let loss = a.need(m, "loss")?;
    let count = a.need(m, "count")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("row_loss", Some(row_loss), rows as u64 * 8, 8, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("loss", Some(loss), 4, 4, Io::W),
            use_("count", Some(count), 4, 4, Io::W),
        ],
        &[],
    )?;
    let (mut s, mut c) = (0f64, 0i64);
    for r in 0..rows as i64 {
        if m.i64_at(labels, r)? != ignore {
            s += m.f64_at(row_loss, r)?;
            c += 1;
        }
    }
    m.set_f32(loss, 0, (s / c as f64) as f32)?;
    m.set_i32(count, 0, c as i32)
}

pub(super) fn cross_entropy_bwd(m: &mut Mem, l: &Launch, t: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let logits = a.need(m, "logits")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let v = a.count32("v")?;
    let ignore = a.i64("ignore_index")?;
    let row_max = a.ptr(m, "row_max")?;
    let row_inv = a.ptr(m, "row_inv")?;
    let dloss = a.need(m, "dloss")?;
    let count = a.need(m, "count")?;
    let dlogits = a.need(m, "dlogits")?;
    a.end()?;
    let st = t.size_bytes();
    let big = (rows * v * st) as u64;
    check_uses(
        m,
        &[
            use_("logits", Some(logits), big, st, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("row_max", row_max, rows as u64 * 4, 4, Io::R),
            use_("row_inv", row_inv, rows as u64 * 4, 4, Io::R),
            use_("dloss", Some(dloss), 4, 4, Io::R),
            use_("count", Some(count), 4, 4, Io::R),
            use_("dlogits", Some(dlogits), big, st, Io::W),
        ],
        &[("dlogits", "logits")],
    )?;
    let scale = m.f32_at(dloss, 0)? / m.i32_at(count, 0)? as f32;
    for r in 0..rows {
        let ri = r as i64;
        let at = ri * v as i64;
        let label = m.i64_at(labels, ri)?;
        if label == ignore || label < 0 || label >= v as i64 {
            let fill = if label == ignore { 0.0 } else { f32::NAN };
            m.set_fv(dlogits, at, t, &vec![fill; v])?;
            continue;
        }
        let xs = m.fv(logits, at, v, t)?;
        let (mx, inv) = match (row_max, row_inv) {
            (Some(pm), Some(pi)) => (m.f32_at(pm, ri)?, m.f32_at(pi, ri)?),
            _ => {
                let (mx, s) = row_stats(&xs);
                (mx, (1.0 / s) as f32)
            }
        };
        let mut out: Vec<f32> = xs
            .iter()
            .map(|&x| math::exp(x - mx) * inv * scale)
            .collect();
        out[label as usize] -= scale;
        m.set_fv(dlogits, at, t, &out)?;
    }
    Ok(())
}
