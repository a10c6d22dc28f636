//! `optimizer.cu`, `grad_norm.cu`, `loss_scale.cu`: multi-tensor AdamW and SGD updates,
//! the global gradient norm, the step counter and the dynamic loss scale.

use crate::cuda::emulate::contracts::{checked, one_block, row_block};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Ptr, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::{UpdateRule, Kernel};

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::GradNormPartials => grad_norm_partials(m, l),
        Kernel::GradNormFinalize => grad_norm_finalize(m, l),
        Kernel::CountStep => count_step(m, l),
        Kernel::LossScaleUpdate => loss_scale_update(m, l),
        Kernel::Update { rule, state, copy } => multi_tensor_update(m, l, rule, state, copy),
    }
}

/// The chunk table `{i32 tensor; i32 len; i64 start}` of a multi-tensor launch, checked to
/// cover every tensor exactly once (`numel` per tensor).
fn chunks(m: &Mem, p: Ptr, n_chunks: usize, numel: &[i64]) -> R<()> {
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
    Ok(())
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

/// `adamw_<c>`, `sgd_<c>` and `lion_<c>`, and their `bf16state_` twins (moments of
/// `state_dt`).
pub(crate) fn multi_tensor_update(
    m: &Mem,
    l: &Launch,
    rule: UpdateRule,
    state_dt: DType,
    copy_dt: DType,
) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let tensors = a.need(m, "tensors")?;
    let chunk_table = a.need(m, "chunks")?;
    let n_chunks = a.count32("n_chunks")?;
    let lr = a.need(m, "lr")?;
    let step = a.need(m, "step")?;
    let scale = a.need(m, "scale")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let hyperparameters: &[&str] = match rule {
        UpdateRule::AdamW => &["beta1", "beta2", "eps", "max_grad_norm"],
        UpdateRule::Sgd => &["momentum", "max_grad_norm"],
        UpdateRule::Lion => &["beta1", "beta2", "max_grad_norm"],
    };
    for h in hyperparameters {
        a.f64(h)?;
    }
    let amax_partials = a.ptr(m, "amax_partials")?;
    a.end()?;
    // Rows: AdamWTensor (master, grad, m, v, copy, numel, wd: 56 bytes) or MomentTensor
    // (master, grad, buf, copy, numel, wd: 48 bytes).
    let bufs = 2 + rule.moments();
    let row_bytes = (bufs + 3) * 8;
    let n_tensors = table_rows(m, tensors, row_bytes, chunk_table, n_chunks)?;
    let mut uses = vec![
        use_(
            "tensors",
            Some(tensors),
            (n_tensors * row_bytes) as u64,
            8,
            Io::R,
        ),
        use_("chunks", Some(chunk_table), n_chunks as u64 * 16, 8, Io::R),
        use_("amax_partials", amax_partials, n_chunks as u64 * 4, 4, Io::W),
    ];
    let names = match rule {
        UpdateRule::AdamW => ["master", "grad", "m", "v"].as_slice(),
        UpdateRule::Sgd | UpdateRule::Lion => ["master", "grad", "buf"].as_slice(),
    };
    let mut numel = Vec::with_capacity(n_tensors);
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
        let n = m.i64_at(tensors, base + bufs as i64 + 1)?;
        if n < 0 {
            return Err(format!("tensor {t}: numel {n}"));
        }
        for (k, (name, &p)) in names.iter().zip(&ptrs).enumerate() {
            let io = if k == 1 { Io::R } else { Io::Rw };
            // Master and gradient are F32; the moments are of the entry's state dtype.
            let size = if k < 2 { 4 } else { state_dt.size_bytes() };
            uses.push(use_(
                format!("tensor {t} {name}"),
                Some(p),
                n as u64 * size as u64,
                size,
                io,
            ));
        }
        let cs = copy_dt.size_bytes();
        uses.push(use_(
            format!("tensor {t} copy"),
            copy,
            n as u64 * cs as u64,
            cs,
            Io::W,
        ));
        numel.push(n);
    }
    for (what, p) in [
        ("lr", lr),
        ("step", step),
        ("scale", scale),
        ("grad_norm", grad_norm),
    ] {
        uses.push(use_(what, Some(p), 4, 4, Io::R));
    }
    chunks(m, chunk_table, n_chunks, &numel)?;
    checked(m, uses, &[])
}

pub(crate) fn grad_norm_partials(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let tensors = a.need(m, "tensors")?;
    let chunk_table = a.need(m, "chunks")?;
    let n_chunks = a.count32("n_chunks")?;
    let scale = a.need(m, "scale")?;
    let partials = a.need(m, "partials")?;
    a.end()?;
    // NormTensor { const void* data; i64 numel; i32 dtype; i32 pad } (24 bytes).
    let n_tensors = table_rows(m, tensors, 24, chunk_table, n_chunks)?;
    let mut uses = vec![
        use_("tensors", Some(tensors), n_tensors as u64 * 24, 8, Io::R),
        use_("chunks", Some(chunk_table), n_chunks as u64 * 16, 8, Io::R),
        use_("scale", Some(scale), 4, 4, Io::R),
        use_("partials", Some(partials), n_chunks as u64 * 8, 8, Io::W),
    ];
    let mut numel = Vec::with_capacity(n_tensors);
    for t in 0..n_tensors as i64 {
        let addr = m
            .u64_at(tensors, 3 * t)
            .map_err(|e| format!("`tensors` row {t}: {e}"))?;
        let p = m
            .decode(addr)?
            .ok_or_else(|| format!("tensor {t} is null"))?;
        let n = m.i64_at(tensors, 3 * t + 1)?;
        let dtype = match m.i32_at(tensors, 6 * t + 4)? {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::BF16,
            other => return Err(format!("tensor {t}: dtype code {other} (0, 1 or 2)")),
        };
        if n < 0 {
            return Err(format!("tensor {t}: numel {n}"));
        }
        let s = dtype.size_bytes();
        uses.push(use_(
            format!("tensor {t}"),
            Some(p),
            n as u64 * s as u64,
            s,
            Io::R,
        ));
        numel.push(n);
    }
    chunks(m, chunk_table, n_chunks, &numel)?;
    checked(m, uses, &[])
}

pub(crate) fn grad_norm_finalize(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let partials = a.need(m, "partials")?;
    let n_chunks = a.count32("n_chunks")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let found_inf = a.ptr(m, "found_inf")?;
    a.end()?;
    checked(
        m,
        vec![
            use_("partials", Some(partials), n_chunks as u64 * 8, 8, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::W),
            use_("found_inf", found_inf, 4, 4, Io::W),
        ],
        &[],
    )
}

pub(crate) fn count_step(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let step_in = a.need(m, "step_in")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let step_out = a.need(m, "step_out")?;
    a.end()?;
    checked(
        m,
        vec![
            use_("step_in", Some(step_in), 4, 4, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
            use_("step_out", Some(step_out), 4, 4, Io::W),
        ],
        &[("step_out", "step_in")],
    )
}

pub(crate) fn loss_scale_update(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let scale_in = a.need(m, "scale_in")?;
    let counters_in = a.need(m, "counters_in")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let scale_out = a.need(m, "scale_out")?;
    let counters_out = a.need(m, "counters_out")?;
    a.f64("growth_factor")?;
    a.f64("backoff_factor")?;
    let growth_interval = a.i64("growth_interval")?;
    let hysteresis = a.i64("hysteresis")?;
    a.f64("max_scale")?;
    a.end()?;
    if growth_interval < 1 || hysteresis < 1 {
        return Err(format!(
            "growth_interval {growth_interval}, hysteresis {hysteresis} (both at least 1)"
        ));
    }
    checked(
        m,
        vec![
            use_("scale_in", Some(scale_in), 4, 4, Io::R),
            use_("counters_in", Some(counters_in), 8, 4, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
            use_("scale_out", Some(scale_out), 4, 4, Io::W),
            use_("counters_out", Some(counters_out), 8, 4, Io::W),
        ],
        &[("scale_out", "scale_in"), ("counters_out", "counters_in")],
    )
}
