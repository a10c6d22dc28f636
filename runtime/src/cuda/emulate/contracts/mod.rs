//! What each kernel may touch: for every entry point, its arguments read by name and type, the
//! launch shape its header requires, and the buffers it reads and writes (how many bytes from
//! each pointer, and which in-place uses its header allows), checked against the program's
//! memory before the real kernel runs. One submodule per kernel file (or family of files), and
//! `generated` for the kernels the fusion pass writes.
//!
//! These are the header comments' contracts, not the kernels' arithmetic: the kernels
//! themselves run from their sources (`super::launch`).

mod adafactor;
mod adamw8bit;
mod attention;
mod cross_entropy;
mod elementwise;
mod embedding;
mod generated;
mod layout;
mod nf4;
mod norm;
mod optimizer;
mod reduce;
mod rope;
mod softmax;

pub(super) use generated::generated;

use super::args::Args;
use super::memory::{check_uses, ranges_use, Io, Mem, Ptr, Use};
use super::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use castor_kernels::attention::Kernel as attention_kernel;

/// Kernels whose block reductions need `blockDim = (32 k, 1, 1)`, `k <= 32`.
fn row_block(l: &Launch) -> R<()> {
    let (bx, by, bz) = l.block;
    if bx % 32 != 0 || by != 1 || bz != 1 {
        return Err(format!(
            "block {:?}: the kernel needs blockDim.x a multiple of 32 (at most 1024) and a 1-D \
             block",
            l.block
        ));
    }
    Ok(())
}

/// Kernels that declare no dynamic shared memory.
pub(super) fn no_dynamic_shared(l: &Launch) -> R<()> {
    if l.shared_bytes != 0 {
        return Err(format!(
            "{} bytes of dynamic shared memory: the kernel declares none",
            l.shared_bytes
        ));
    }
    Ok(())
}

/// Kernels documented as one block.
fn one_block(l: &Launch) -> R<()> {
    if l.grid != (1, 1, 1) {
        return Err(format!("grid {:?}: the kernel runs as one block", l.grid));
    }
    Ok(())
}

/// The uses that exist, checked to lie in their buffers and not to overlap except as
/// `in_place` allows.
fn checked(m: &Mem, uses: Vec<Option<Use>>, in_place: &[(&str, &str)]) -> R<Vec<Use>> {
    check_uses(m, &uses, in_place)?;
    Ok(uses.into_iter().flatten().collect())
}

fn dt(s: &str) -> Option<DType> {
    match s {
        "f32" => Some(DType::F32),
        "f16" => Some(DType::F16),
        "bf16" => Some(DType::BF16),
        "i64" => Some(DType::I64),
        "bool" => Some(DType::Bool),
        _ => None,
    }
}

fn float(s: &str) -> R<DType> {
    match dt(s) {
        Some(d) if d.is_float() => Ok(d),
        _ => Err(format!("`{s}` is not a float dtype suffix")),
    }
}

/// `bf16` -> (BF16, BF16); `f32_bf16` -> (F32, BF16).
fn io(s: &str) -> R<(DType, DType)> {
    if let Ok(d) = float(s) {
        return Ok((d, d));
    }
    let (a, b) = s
        .split_once('_')
        .ok_or_else(|| format!("`{s}` is not a dtype suffix"))?;
    Ok((float(a)?, float(b)?))
}

/// The buffers a launch of a `kernels/*.cu` entry point uses, by the entry point's name.
pub(super) fn builtin(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let e = l.entry.as_str();
    if let Some((kernel, v)) = attention::parse(e)? {
        return match kernel {
            Some(attention_kernel::Forward) => attention::forward(m, l, v),
            Some(attention_kernel::Backward) => attention::backward(m, l, v),
            Some(attention_kernel::Dq) => attention::dq(m, l, v),
            Some(attention_kernel::DkDv) => attention::dkdv(m, l, v),
            None => attention::delta(m, l, v.dtype),
        };
    }
    // Only the attention kernels declare dynamic shared memory.
    no_dynamic_shared(l)?;
    if let Some(s) = e.strip_prefix("cast_") {
        let (a, b) = s
            .split_once('_')
            .and_then(|(a, b)| Some((dt(a)?, dt(b)?)))
            .ok_or_else(|| format!("`{e}`: no such cast"))?;
        return layout::cast(m, l, a, b);
    }
    if let Some(w) = e.strip_prefix("strided_copy_b") {
        return layout::strided_copy(m, l, w.parse().map_err(|_| format!("`{e}`"))?);
    }
    if let Some(w) = e.strip_prefix("fill_b") {
        return layout::fill(m, l, w.parse().map_err(|_| format!("`{e}`"))?);
    }
    for prefix in ["reduce_sum_", "reduce_mean_", "reduce_max_"] {
        if let Some(s) = e.strip_prefix(prefix) {
            let (ti, to) = io(s)?;
            return reduce::reduce(m, l, ti, to);
        }
    }
    for (prefix, rms) in [("layer_norm_", false), ("rms_norm_", true)] {
        let Some(rest) = e.strip_prefix(prefix) else {
            continue;
        };
        if let Some(s) = rest.strip_prefix("fwd_") {
            let (ti, to) = io(s)?;
            return norm::norm_fwd(m, l, rms, ti, to);
        }
        if let Some(s) = rest.strip_prefix("bwd_weight_") {
            let (ti, to) = io(s)?;
            return norm::norm_bwd_weight(m, l, rms, ti, to);
        }
        if let Some(s) = rest.strip_prefix("bwd_") {
            let (ti, to) = io(s)?;
            return norm::norm_bwd(m, l, rms, ti, to);
        }
    }
    if e == "norm_weight_grad_reduce" {
        return norm::norm_weight_grad_reduce(m, l);
    }
    if let Some(s) = e.strip_prefix("softmax_fwd_") {
        let (ti, to) = io(s)?;
        return softmax::softmax_fwd(m, l, ti, to);
    }
    if let Some(s) = e.strip_prefix("softmax_bwd_") {
        let (ti, to) = io(s)?;
        return softmax::softmax_bwd(m, l, ti, to);
    }
    if e == "cross_entropy_finalize" {
        return cross_entropy::cross_entropy_finalize(m, l);
    }
    if let Some(s) = e.strip_prefix("cross_entropy_fwd_") {
        return cross_entropy::cross_entropy_fwd(m, l, float(s)?);
    }
    if let Some(s) = e.strip_prefix("cross_entropy_bwd_") {
        return cross_entropy::cross_entropy_bwd(m, l, float(s)?);
    }
    match e {
        "embedding_bwd_count" => return embedding::embedding_bwd_count(m, l),
        "embedding_bwd_scan" => return embedding::embedding_bwd_scan(m, l),
        "embedding_bwd_fill" => return embedding::embedding_bwd_fill(m, l),
        "grad_norm_partials" => return optimizer::grad_norm_partials(m, l),
        "grad_norm_finalize" => return optimizer::grad_norm_finalize(m, l),
        "count_step" => return optimizer::count_step(m, l),
        "loss_scale_update" => return optimizer::loss_scale_update(m, l),
        "rope_table" => return rope::rope_table(m, l),
        _ => {}
    }
    if let Some(s) = e.strip_prefix("embedding_fwd_") {
        return embedding::embedding_fwd(m, l, float(s)?);
    }
    if let Some(s) = e.strip_prefix("embedding_bwd_accumulate_") {
        let (t, o) = io(s)?;
        return embedding::embedding_bwd_accumulate(m, l, t, o);
    }
    if let Some(s) = e.strip_prefix("rope_fwd_") {
        return rope::rope(m, l, float(s)?);
    }
    if let Some(s) = e.strip_prefix("rope_bwd_") {
        return rope::rope(m, l, float(s)?);
    }
    if let Some(rest) = e.strip_prefix("adafactor_") {
        return match rest {
            "rows" => adafactor::rows(m, l),
            "cols" => adafactor::cols(m, l),
            "full" => adafactor::full(m, l),
            "row_mean" => adafactor::row_mean(m, l),
            "partials" => adafactor::partials(m, l),
            "finalize" => adafactor::finalize(m, l),
            other => match other.strip_prefix("apply_") {
                Some(s) => adafactor::apply(m, l, float(s)?),
                None => Err(format!("no contract for `{e}`")),
            },
        };
    }
    if let Some(s) = e.strip_prefix("adamw8bit_") {
        return adamw8bit::update(m, l, float(s)?);
    }
    if let Some(s) = e.strip_prefix("nf4_dequantize_") {
        return nf4::dequantize(m, l, float(s)?);
    }
    for (prefix, adamw, state) in [
        ("adamw_bf16state_", true, DType::BF16),
        ("adamw_", true, DType::F32),
        ("sgd_bf16state_", false, DType::BF16),
        ("sgd_", false, DType::F32),
    ] {
        if let Some(s) = e.strip_prefix(prefix) {
            return optimizer::multi_tensor_update(m, l, adamw, state, float(s)?);
        }
    }
    for prefix in ["gelu_tanh_", "gelu_erf_", "silu_"] {
        if let Some(rest) = e.strip_prefix(prefix) {
            if let Some(s) = rest.strip_prefix("fwd_") {
                return elementwise::unary(m, l, float(s)?, false);
            }
            if let Some(s) = rest.strip_prefix("bwd_") {
                return elementwise::unary(m, l, float(s)?, true);
            }
        }
    }
    if let Some(s) = e.strip_prefix("add_").or_else(|| e.strip_prefix("mul_")) {
        return elementwise::binary(m, l, float(s)?);
    }
    Err(format!("no contract for `{e}`"))
}

/// Where a kernel's operand read or written in place is (`attention.cu`'s AttStrides,
/// `rope.cu`'s RopeStrides): batch `b` at `(b / heads) batch + (b % heads) head`, its rows
/// `row` elements apart, each of `d` contiguous elements (all in elements).
#[derive(Clone, Copy, Debug)]
pub(super) struct Strides {
    batch: i64,
    head: i64,
    row: i64,
}

impl Strides {
    /// `X_batch`, `X_head`, `X_row` of operand `x`.
    pub(super) fn read(a: &mut Args, x: &str) -> R<Strides> {
        let st = Strides {
            batch: a.i32(&format!("{x}_batch"))?.into(),
            head: a.i32(&format!("{x}_head"))?.into(),
            row: a.i32(&format!("{x}_row"))?.into(),
        };
        if st.batch < 0 || st.head < 0 || st.row < 0 {
            return Err(format!("`{x}`: negative strides {st:?}"));
        }
        Ok(st)
    }

    /// The use of `batches` batches (split by `heads`) of `rows` rows of `d` elements: the
    /// rows it touches, one range each.
    pub(super) fn use_of(
        &self,
        what: &str,
        p: Ptr,
        (batches, heads, rows, d): (usize, usize, usize, usize),
        elem: usize,
        io: Io,
    ) -> R<Option<Use>> {
        if heads == 0 {
            return Err(format!("`{what}`: heads 0"));
        }
        let e = elem as u64;
        let mut ranges = Vec::with_capacity(batches * rows);
        for b in 0..batches {
            let base = (b / heads) as i64 * self.batch + (b % heads) as i64 * self.head;
            for r in 0..rows {
                let at = (base + r as i64 * self.row) as u64;
                ranges.push((at * e, d as u64 * e));
            }
        }
        Ok(ranges_use(what, p, ranges, elem, io))
    }
}
