//! The hand-written kernels: each `kernels/*.cu` entry point implemented from its header
//! comment, one submodule per kernel file (or family of files), and [`builtin`], which picks
//! the implementation by the launch's entry point name.

mod cross_entropy;
mod elementwise;
mod embedding;
mod layout;
mod norm;
mod optimizer;
mod reduce;
mod rope;
mod softmax;

use super::memory::Mem;
use super::R;
use crate::cuda::program::Launch;
use castor_ir::{BinaryOp, DType, ReduceOp, UnaryOp};
use cross_entropy::{cross_entropy_bwd, cross_entropy_finalize, cross_entropy_fwd};
use elementwise::{binary_kernel, unary_kernel};
use embedding::{
    embedding_bwd_accumulate, embedding_bwd_count, embedding_bwd_fill, embedding_bwd_scan,
    embedding_fwd,
};
use layout::{cast, fill, strided_copy};
use norm::{norm_bwd, norm_bwd_weight, norm_fwd, norm_weight_grad_reduce};
use optimizer::{
    count_step, grad_norm_finalize, grad_norm_partials, loss_scale_update, multi_tensor_update,
};
use reduce::reduce;
use rope::{rope_launch, rope_table};
use softmax::{softmax_bwd, softmax_fwd};

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

/// Kernels documented as one block.
fn one_block(l: &Launch) -> R<()> {
    if l.grid != (1, 1, 1) {
        return Err(format!("grid {:?}: the kernel runs as one block", l.grid));
    }
    Ok(())
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

/// A launch of a `kernels/*.cu` entry point, dispatched by the entry point's name.
pub(super) fn builtin(m: &mut Mem, l: &Launch) -> R<()> {
    let e = l.entry.as_str();
    if let Some(s) = e.strip_prefix("cast_") {
        let (a, b) = s
            .split_once('_')
            .and_then(|(a, b)| Some((dt(a)?, dt(b)?)))
            .ok_or_else(|| format!("`{e}`: no such cast"))?;
        return cast(m, l, a, b);
    }
    if let Some(w) = e.strip_prefix("strided_copy_b") {
        return strided_copy(m, l, w.parse().map_err(|_| format!("`{e}`"))?);
    }
    if let Some(w) = e.strip_prefix("fill_b") {
        return fill(m, l, w.parse().map_err(|_| format!("`{e}`"))?);
    }
    for (prefix, op) in [
        ("reduce_sum_", ReduceOp::Sum),
        ("reduce_mean_", ReduceOp::Mean),
        ("reduce_max_", ReduceOp::Max),
    ] {
        if let Some(s) = e.strip_prefix(prefix) {
            let (ti, to) = io(s)?;
            return reduce(m, l, op, ti, to);
        }
    }
    for (prefix, rms) in [("layer_norm_", false), ("rms_norm_", true)] {
        let Some(rest) = e.strip_prefix(prefix) else {
            continue;
        };
        if let Some(s) = rest.strip_prefix("fwd_") {
            let (ti, to) = io(s)?;
            return norm_fwd(m, l, rms, ti, to);
        }
        if let Some(s) = rest.strip_prefix("bwd_weight_") {
            let (ti, to) = io(s)?;
            return norm_bwd_weight(m, l, rms, ti, to);
        }
        if let Some(s) = rest.strip_prefix("bwd_") {
            let (ti, to) = io(s)?;
            return norm_bwd(m, l, rms, ti, to);
        }
    }
    if e == "norm_weight_grad_reduce" {
        return norm_weight_grad_reduce(m, l);
    }
    if let Some(s) = e.strip_prefix("softmax_fwd_") {
        let (ti, to) = io(s)?;
        return softmax_fwd(m, l, ti, to);
    }
    if let Some(s) = e.strip_prefix("softmax_bwd_") {
        let (ti, to) = io(s)?;
        return softmax_bwd(m, l, ti, to);
    }
    if e == "cross_entropy_finalize" {
        return cross_entropy_finalize(m, l);
    }
    if let Some(s) = e.strip_prefix("cross_entropy_fwd_") {
        return cross_entropy_fwd(m, l, float(s)?);
    }
    if let Some(s) = e.strip_prefix("cross_entropy_bwd_") {
        return cross_entropy_bwd(m, l, float(s)?);
    }
    match e {
        "embedding_bwd_count" => return embedding_bwd_count(m, l),
        "embedding_bwd_scan" => return embedding_bwd_scan(m, l),
        "embedding_bwd_fill" => return embedding_bwd_fill(m, l),
        "grad_norm_partials" => return grad_norm_partials(m, l),
        "grad_norm_finalize" => return grad_norm_finalize(m, l),
        "count_step" => return count_step(m, l),
        "loss_scale_update" => return loss_scale_update(m, l),
        "rope_table" => return rope_table(m, l),
        _ => {}
    }
    if let Some(s) = e.strip_prefix("embedding_fwd_") {
        return embedding_fwd(m, l, float(s)?);
    }
    if let Some(s) = e.strip_prefix("embedding_bwd_accumulate_") {
        let (t, o) = io(s)?;
        return embedding_bwd_accumulate(m, l, t, o);
    }
    if let Some(s) = e.strip_prefix("rope_fwd_") {
        return rope_launch(m, l, float(s)?, false);
    }
    if let Some(s) = e.strip_prefix("rope_bwd_") {
        return rope_launch(m, l, float(s)?, true);
    }
    if let Some(s) = e.strip_prefix("adamw_") {
        return multi_tensor_update(m, l, true, float(s)?);
    }
    if let Some(s) = e.strip_prefix("sgd_") {
        return multi_tensor_update(m, l, false, float(s)?);
    }
    for (prefix, op) in [
        ("gelu_tanh_", UnaryOp::GeluTanh),
        ("gelu_erf_", UnaryOp::GeluErf),
        ("silu_", UnaryOp::Silu),
    ] {
        if let Some(rest) = e.strip_prefix(prefix) {
            if let Some(s) = rest.strip_prefix("fwd_") {
                return unary_kernel(m, l, op, float(s)?, false);
            }
            if let Some(s) = rest.strip_prefix("bwd_") {
                return unary_kernel(m, l, op, float(s)?, true);
            }
        }
    }
    if let Some(s) = e.strip_prefix("add_") {
        return binary_kernel(m, l, BinaryOp::Add, float(s)?);
    }
    if let Some(s) = e.strip_prefix("mul_") {
        return binary_kernel(m, l, BinaryOp::Mul, float(s)?);
    }
    Err(format!("the emulator has no implementation of `{e}`"))
}
