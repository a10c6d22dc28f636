//! `optimizer.cu`, `grad_norm.cu`, `loss_scale.cu`: multi-tensor AdamW and SGD updates,
//! the global gradient norm, the step counter and the dynamic loss scale.

use super::{one_block, row_block};
use crate::cpu::optimizer;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem, Ptr};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;

/// The chunk table `{i32 tensor; i32 len; i64 start}` of a multi-tensor launch, checked to
/// cover every tensor exactly once (`numel` per tensor).
fn chunks(m: &Mem, p: Ptr, n_chunks: usize, numel: &[i64]) -> R<Vec<(usize, i64, i64)>> {
    let mut out = Vec::with_capacity(n_chunks);
    let mut covered: Vec<Vec<(i64, i64)>> = vec![Vec::new(); numel.len()];
    for c in 0..n_chunks as i64 {
        let b = m
            .bytes(p, c * 16, 16)
            .map_err(|e| format!("`chunks` row {c}: {e}"))?;
        let tensor = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let len = i32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let start = i64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
        let t = usize::try_from(tensor)
            .ok()
            .filter(|&t| t < numel.len())
            .ok_or_else(|| format!("chunk {c} names tensor {tensor} ({} tensors)", numel.len()))?;
        if len < 0 || start < 0 {
            return Err(format!("chunk {c}: start {start}, len {len}"));
        }
        let len = i64::from(len).min(numel[t] - start).max(0);
        covered[t].push((start, start + len));
        out.push((t, start, len));
    }
    for (t, spans) in covered.iter_mut().enumerate() {
        spans.sort_unstable();
        let mut at = 0;
        for &(s, e) in spans.iter() {
            if s != at {
                return Err(format!(
                    "the chunks of tensor {t} cover [{s}, {e}) after [.., {at}): elements are \
                     missed or covered twice"
                ));
            }
            at = e;
        }
        if at != numel[t] {
            return Err(format!(
                "the chunks of tensor {t} cover {at} of its {} elements",
                numel[t]
            ));
        }
    }
    Ok(out)
}

/// The rows of a multi-tensor launch's tensor table: every row of the table when the
/// pointer is a table of the program (at its start), else as many as the chunks name.
fn table_rows(
    m: &Mem,
    tensors: Ptr,
    row_bytes: usize,
    chunk_table: Ptr,
    n_chunks: usize,
) -> R<usize> {
    let table = 1 + m.slots..1 + m.slots + m.tables;
    if table.contains(&tensors.buf) && tensors.off == 0 {
        let len = m.bufs[tensors.buf].len();
        if !len.is_multiple_of(row_bytes) {
            return Err(format!(
                "the tensor table holds {len} bytes, not whole {row_bytes}-byte rows"
            ));
        }
        return Ok(len / row_bytes);
    }
    let mut n = 0usize;
    for c in 0..n_chunks as i64 {
        let t = m
            .i32_at(chunk_table, c * 4)
            .map_err(|e| format!("`chunks` row {c}: {e}"))?;
        n = n.max(usize::try_from(t).unwrap_or(0) + 1);
    }
    Ok(n)
}

/// A device F32 scalar.
fn scalar(m: &Mem, p: Ptr, what: &str) -> R<f32> {
    m.f32_at(p, 0).map_err(|e| format!("`{what}`: {e}"))
}

/// `adamw_<c>` and `sgd_<c>`.
pub(super) fn multi_tensor_update(m: &mut Mem, l: &Launch, adamw: bool, copy_dt: DType) -> R<()> {
    let mut a = Args::new(l);
    let tensors = a.need(m, "tensors")?;
    let chunk_table = a.need(m, "chunks")?;
    let n_chunks = a.count32("n_chunks")?;
    let lr = a.need(m, "lr")?;
    let step = a.need(m, "step")?;
    let scale = a.need(m, "scale")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let hyper: Vec<f64> = if adamw {
        vec![
            a.f64("beta1")?,
            a.f64("beta2")?,
            a.f64("eps")?,
            a.f64("max_grad_norm")?,
        ]
    } else {
        vec![a.f64("momentum")?, a.f64("max_grad_norm")?]
    };
    a.end()?;
    let control = optimizer::Control {
        lr: scalar(m, lr, "lr")?,
        step: scalar(m, step, "step")?,
        scale: scalar(m, scale, "scale")?,
        grad_norm: scalar(m, grad_norm, "grad_norm")?,
    };
    // Rows: AdamWTensor (master, grad, m, v, copy, numel, wd: 56 bytes) or SgdTensor
    // (master, grad, buf, copy, numel, wd: 48 bytes).
    let bufs = if adamw { 4 } else { 3 };
    let row_bytes = (bufs + 3) * 8;
    let n_tensors = table_rows(m, tensors, row_bytes, chunk_table, n_chunks)?;
    struct Row {
        ptrs: Vec<Ptr>,
        copy: Option<Ptr>,
        numel: i64,
        wd: f64,
    }
    let mut rows = Vec::with_capacity(n_tensors);
    let mut uses = Vec::new();
    let names = if adamw {
        ["master", "grad", "m", "v"].as_slice()
    } else {
        ["master", "grad", "buf"].as_slice()
    };
    for t in 0..n_tensors as i64 {
        let base = t * row_bytes as i64 / 8;
        let mut ptrs = Vec::with_capacity(bufs);
        for (k, name) in names.iter().enumerate() {
            let addr = m
                .u64_at(tensors, base + k as i64)
                .map_err(|e| format!("`tensors` row {t}: {e}"))?;
            let p = m
                .decode(addr)
                .map_err(|e| format!("tensor {t} `{name}`: {e}"))?
                .ok_or_else(|| format!("tensor {t} `{name}` is null"))?;
            ptrs.push(p);
        }
        let copy = m.decode(m.u64_at(tensors, base + bufs as i64)?)?;
        let numel = m.i64_at(tensors, base + bufs as i64 + 1)?;
        let wd = m.f64_at(tensors, base + bufs as i64 + 2)?;
        if numel < 0 {
            return Err(format!("tensor {t}: numel {numel}"));
        }
        for (k, (name, &p)) in names.iter().zip(&ptrs).enumerate() {
            let io = if k == 1 { Io::R } else { Io::Rw };
            uses.push(use_(
                format!("tensor {t} {name}"),
                Some(p),
                numel as u64 * 4,
                4,
                io,
            ));
        }
        let cs = copy_dt.size_bytes();
        uses.push(use_(
            format!("tensor {t} copy"),
            copy,
            numel as u64 * cs as u64,
            cs,
            Io::W,
        ));
        rows.push(Row {
            ptrs,
            copy,
            numel,
            wd,
        });
    }
    for (what, p) in [
        ("lr", lr),
        ("step", step),
        ("scale", scale),
        ("grad_norm", grad_norm),
    ] {
        uses.push(use_(what, Some(p), 4, 4, Io::R));
    }
    check_uses(m, &uses, &[])?;
    let numel: Vec<i64> = rows.iter().map(|r| r.numel).collect();
    let chunk_list = chunks(m, chunk_table, n_chunks, &numel)?;
    if control.skip() {
        return Ok(()); // a skipped step writes nothing
    }
    for (t, start, len) in chunk_list {
        let row = &rows[t];
        let n = len as usize;
        let mut p = m.fv(row.ptrs[0], start, n, DType::F32)?;
        let g = m.fv(row.ptrs[1], start, n, DType::F32)?;
        let mut s1 = m.fv(row.ptrs[2], start, n, DType::F32)?;
        if adamw {
            let mut s2 = m.fv(row.ptrs[3], start, n, DType::F32)?;
            let h = optimizer::AdamW {
                beta1: hyper[0],
                beta2: hyper[1],
                eps: hyper[2],
                weight_decay: row.wd,
                max_grad_norm: hyper[3],
            };
            optimizer::adamw(&h, control, &mut p, &g, &mut s1, &mut s2);
            m.set_fv(row.ptrs[3], start, DType::F32, &s2)?;
        } else {
            let h = optimizer::Sgd {
                momentum: hyper[0],
                weight_decay: row.wd,
                max_grad_norm: hyper[1],
            };
            optimizer::sgd(&h, control, &mut p, &g, &mut s1);
        }
        m.set_fv(row.ptrs[0], start, DType::F32, &p)?;
        m.set_fv(row.ptrs[2], start, DType::F32, &s1)?;
        if let Some(c) = row.copy {
            m.set_fv(c, start, copy_dt, &p)?;
        }
    }
    Ok(())
}

pub(super) fn grad_norm_partials(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let tensors = a.need(m, "tensors")?;
    let chunk_table = a.need(m, "chunks")?;
    let n_chunks = a.count32("n_chunks")?;
    let scale = a.need(m, "scale")?;
    let partials = a.need(m, "partials")?;
    a.end()?;
    let n_tensors = table_rows(m, tensors, 24, chunk_table, n_chunks)?;
    // NormTensor { const void* data; i64 numel; i32 dtype; i32 pad } (24 bytes).
    let mut rows = Vec::with_capacity(n_tensors);
    let mut uses = vec![
        use_("scale", Some(scale), 4, 4, Io::R),
        use_("partials", Some(partials), n_chunks as u64 * 8, 8, Io::W),
    ];
    for t in 0..n_tensors as i64 {
        let addr = m
            .u64_at(tensors, 3 * t)
            .map_err(|e| format!("`tensors` row {t}: {e}"))?;
        let p = m
            .decode(addr)?
            .ok_or_else(|| format!("tensor {t} is null"))?;
        let numel = m.i64_at(tensors, 3 * t + 1)?;
        let dtype = match m.i32_at(tensors, 6 * t + 4)? {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::BF16,
            other => return Err(format!("tensor {t}: dtype code {other} (0, 1 or 2)")),
        };
        if numel < 0 {
            return Err(format!("tensor {t}: numel {numel}"));
        }
        let s = dtype.size_bytes();
        uses.push(use_(
            format!("tensor {t}"),
            Some(p),
            numel as u64 * s as u64,
            s,
            Io::R,
        ));
        rows.push((p, numel, dtype));
    }
    check_uses(m, &uses, &[])?;
    let numel: Vec<i64> = rows.iter().map(|r| r.1).collect();
    let chunk_list = chunks(m, chunk_table, n_chunks, &numel)?;
    let inv = f64::from(1.0f32 / scalar(m, scale, "scale")?);
    for (c, (t, start, len)) in chunk_list.into_iter().enumerate() {
        let (p, _, dtype) = rows[t];
        let acc: f64 = m
            .fv(p, start, len as usize, dtype)?
            .into_iter()
            .map(|x| {
                let u = f64::from(x) * inv;
                u * u
            })
            .sum();
        m.set_f64(partials, c as i64, acc)?;
    }
    Ok(())
}

pub(super) fn grad_norm_finalize(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let partials = a.need(m, "partials")?;
    let n_chunks = a.count32("n_chunks")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let found_inf = a.ptr(m, "found_inf")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("partials", Some(partials), n_chunks as u64 * 8, 8, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::W),
            use_("found_inf", found_inf, 4, 4, Io::W),
        ],
        &[],
    )?;
    let mut acc = 0f64;
    for c in 0..n_chunks as i64 {
        acc += m.f64_at(partials, c)?;
    }
    let norm = acc.sqrt() as f32;
    m.set_f32(grad_norm, 0, norm)?;
    if let Some(p) = found_inf {
        m.set_i32(p, 0, i32::from(!norm.is_finite()))?;
    }
    Ok(())
}

pub(super) fn count_step(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let step_in = a.need(m, "step_in")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let step_out = a.need(m, "step_out")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("step_in", Some(step_in), 4, 4, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
            use_("step_out", Some(step_out), 4, 4, Io::W),
        ],
        &[("step_out", "step_in")],
    )?;
    let s = optimizer::count_step(
        scalar(m, step_in, "step_in")?,
        scalar(m, grad_norm, "grad_norm")?,
    );
    m.set_f32(step_out, 0, s)
}

pub(super) fn loss_scale_update(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let scale_in = a.need(m, "scale_in")?;
    let counters_in = a.need(m, "counters_in")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let scale_out = a.need(m, "scale_out")?;
    let counters_out = a.need(m, "counters_out")?;
    let growth_factor = a.f64("growth_factor")?;
    let backoff_factor = a.f64("backoff_factor")?;
    let growth_interval = a.i64("growth_interval")?;
    let hysteresis = a.i64("hysteresis")?;
    let max_scale = a.f64("max_scale")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("scale_in", Some(scale_in), 4, 4, Io::R),
            use_("counters_in", Some(counters_in), 8, 4, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
            use_("scale_out", Some(scale_out), 4, 4, Io::W),
            use_("counters_out", Some(counters_out), 8, 4, Io::W),
        ],
        &[("scale_out", "scale_in"), ("counters_out", "counters_in")],
    )?;
    let h = optimizer::LossScaler {
        growth_factor,
        backoff_factor,
        growth_interval: usize::try_from(growth_interval)
            .map_err(|_| format!("growth_interval {growth_interval}"))?,
        hysteresis: usize::try_from(hysteresis).map_err(|_| format!("hysteresis {hysteresis}"))?,
        max_scale,
    };
    let counters = [m.f32_at(counters_in, 0)?, m.f32_at(counters_in, 1)?];
    let (s, c) = optimizer::loss_scale_update(
        &h,
        scalar(m, scale_in, "scale_in")?,
        counters,
        scalar(m, grad_norm, "grad_norm")?,
    );
    m.set_f32(scale_out, 0, s)?;
    m.set_f32(counters_out, 0, c[0])?;
    m.set_f32(counters_out, 1, c[1])
}
