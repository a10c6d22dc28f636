//! From a node's op to its kernel: unpacks operands, calls the kernel, and builds the result
//! tensors with the types the graph records (float results are rounded to their dtype there,
//! by `Tensor::from_f32`).

use super::mask::KeyMask;
use super::operand::Args;
use super::strides::{broadcast_strides, offset};
use super::{cast, dropout, elementwise, embedding, fp8, loss, norm, pool, reduce, rope, softmax};
use crate::RuntimeError;
use castor_ir::{Accum, BinaryOp, DType, Op, Tensor, TensorData, TensorType};

/// Calls a generic layout helper with the element type that stores `dtype`.
macro_rules! by_storage {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2 => {
                $f::<f32>($($arg),*)
            }
            DType::I32 | DType::I64 => $f::<i64>($($arg),*),
            DType::Bool => $f::<bool>($($arg),*),
            DType::U8 => $f::<u8>($($arg),*),
        }
    };
}

mod movement;
mod products;
mod step;

/// The node's first result type.
fn first_result<'a>(args: &Args, outs: &[&'a TensorType]) -> Result<&'a TensorType, RuntimeError> {
    outs.first()
        .copied()
        .ok_or_else(|| args.internal("the node has no results"))
}

/// Runs `op` on `args` with the node's accumulation `acc`; `outs` are the node's result types.
/// Each family of ops has its module (`step`, `products`, `movement`); the pointwise ops,
/// norms, softmax, rotary embeddings, reductions and losses run here.
pub fn execute(
    op: &Op,
    acc: Option<Accum>,
    args: &mut Args,
    outs: &[&TensorType],
) -> Result<Vec<Tensor>, RuntimeError> {
    let out = first_result(args, outs)?;
    let float = |args: &Args, data: Vec<f32>| make(args, out, TensorData::F32(data));
    let result = match op {
        Op::Input | Op::Param | Op::State => {
            return Err(args.internal("sources are bound, not executed"))
        }
        Op::AllReduce { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGather { .. }
        | Op::Shard { .. } => {
            return Err(args.internal("collectives run in the executor, with its rank group"))
        }
        Op::GradNorm
        | Op::AdamW { .. }
        | Op::AdamW8bit { .. }
        | Op::Sgd { .. }
        | Op::Lion { .. }
        | Op::Adafactor { .. }
        | Op::CountStep
        | Op::LossScaleUpdate { .. } => return step::execute(op, args, outs),
        Op::MatMul { .. }
        | Op::MatMulScaled { .. }
        | Op::MatMulAdd { .. }
        | Op::Nf4MatMul { .. }
        | Op::Fp8MatMul { .. }
        | Op::MatMulBias { .. }
        | Op::MatMulBiasGelu { .. }
        | Op::MatMulBiasGrad { .. }
        | Op::MatMulGeluGrad { .. }
        | Op::Attention { .. }
        | Op::AttentionGrad { .. }
        | Op::LinearCrossEntropy { .. }
        | Op::LinearCrossEntropyGrad { .. }
        | Op::LinearCrossEntropyStep { .. } => return products::execute(op, acc, args, outs),
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Split { .. }
        | Op::Pad { .. }
        | Op::BroadcastTo { .. } => return movement::execute(op, args, outs),
        Op::Embedding { .. } => {
            let (table, ids) = (args.f32(0)?, args.values::<i64>(1)?);
            let (v, h) = (args.shape(0)?[0], args.shape(0)?[1]);
            let rows = embedding::embedding(table, v, h, ids).map_err(|e| {
                RuntimeError::IndexOutOfRange {
                    node: args.node.to_string(),
                    what: "token id",
                    index: e.id,
                    position: e.position,
                    limit: v,
                }
            })?;
            float(args, rows)?
        }
        Op::Unary(u) => {
            let mut x = args.take_f32(0)?;
            elementwise::unary(*u, &mut x);
            float(args, x)?
        }
        Op::Binary(b) => {
            let values = binary(*b, args, out)?;
            float(args, values)?
        }
        Op::Scale { factor } => {
            let mut x = args.take_f32(0)?;
            elementwise::scale(&mut x, *factor);
            float(args, x)?
        }
        Op::Dropout { p, stream } => {
            let key: &[i64] = args.values(1)?;
            let key = [key[0], key[1]];
            let mut x = args.take_f32(0)?;
            dropout::dropout(&mut x, key, *stream as u32, *p);
            float(args, x)?
        }
        Op::LayerNorm { eps } => {
            let mut x = args.take_f32(0)?;
            norm::layer_norm(&mut x, args.f32(1)?, args.f32(2)?, *eps);
            float(args, x)?
        }
        Op::RmsNorm { eps } => {
            let mut x = args.take_f32(0)?;
            norm::rms_norm(&mut x, args.f32(1)?, *eps);
            float(args, x)?
        }
        Op::Softmax { causal, window } => {
            let mut x = args.take_f32(0)?;
            let mask = if args.len() > 1 {
                Some(key_mask(args, 1)?)
            } else {
                None
            };
            softmax::softmax(&mut x, out.shape.dims(), *causal, *window, mask);
            float(args, x)?
        }
        Op::Rope { theta, scaling } => {
            let mut x = args.take_f32(0)?;
            let d = out.shape.dims();
            let positions = rope_positions(args, d)?;
            rope::rope(&mut x, d, positions.as_deref(), *theta, *scaling);
            float(args, x)?
        }
        Op::Reduce { op, axes, .. } => {
            let x = args.f32(0)?;
            let reduced = reduce::reduce(*op, x, args.shape(0)?, axes).ok_or_else(|| {
                RuntimeError::EmptyReduction {
                    node: args.node.to_string(),
                    shape: args
                        .tensor(0)
                        .map(|t| t.shape().clone())
                        .unwrap_or_default(),
                }
            })?;
            float(args, reduced)?
        }
        Op::Fp8Scale { to, margin } => {
            let format = fp8_format(args, *to)?;
            let amax = fp8::amax(args.f32(0)?);
            float(args, vec![fp8::scale(format, amax, *margin)])?
        }
        Op::Quantize { to } => {
            let format = fp8_format(args, *to)?;
            let x = args.f32(0)?;
            let q = fp8::quantize(format, x, scalar(args, 1)?);
            let amax = fp8::amax(x);
            return f32_results(args, outs, [q, vec![amax]]);
        }
        Op::AmaxHistory { to, margin } => {
            let format = fp8_format(args, *to)?;
            let (history, scale) = fp8::amax_history(
                format,
                *margin,
                args.f32(0)?,
                scalar(args, 1)?,
                scalar(args, 2)?,
            );
            return f32_results(args, outs, [history, vec![scale]]);
        }
        Op::CrossEntropy { ignore_index } => {
            let (logits, labels) = (args.f32(0)?, args.values::<i64>(1)?);
            let v = args.shape(0)?[1];
            let loss = loss::cross_entropy(logits, v, labels, *ignore_index).map_err(|e| {
                RuntimeError::IndexOutOfRange {
                    node: args.node.to_string(),
                    what: "label",
                    index: e.label,
                    position: e.position,
                    limit: v,
                }
            })?;
            float(args, vec![loss])?
        }
        // A parameter's working copy holds its master rounded to the copy's dtype.
        Op::Cast { to } | Op::ParamCopy { to } => {
            let (_, data) = args.take(0)?;
            make(args, out, cast::cast(data, *to))?
        }
        Op::Full { value, .. } => {
            let n = out.shape.numel().unwrap_or(0);
            match out.dtype {
                DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2 => {
                    float(args, vec![*value as f32; n])?
                }
                DType::I32 | DType::I64 => {
                    make(args, out, TensorData::I64(vec![*value as i64; n]))?
                }
                DType::Bool => make(args, out, TensorData::Bool(vec![*value != 0.0; n]))?,
                DType::U8 => make(args, out, TensorData::U8(vec![*value as u8; n]))?,
            }
        }
        Op::UnaryGrad(u) => {
            let mut dy = args.take_f32(1)?;
            elementwise::unary_grad(*u, args.f32(0)?, &mut dy);
            float(args, dy)?
        }
        Op::LayerNormGrad { eps } => {
            let mut dy = args.take_f32(2)?;
            let (dw, db) = norm::layer_norm_grad(args.f32(0)?, args.f32(1)?, &mut dy, *eps);
            return f32_results(args, outs, [dy, dw, db]);
        }
        Op::RmsNormGrad { eps } => {
            let mut dy = args.take_f32(2)?;
            let dw = norm::rms_norm_grad(args.f32(0)?, args.f32(1)?, &mut dy, *eps);
            return f32_results(args, outs, [dy, dw]);
        }
        Op::SoftmaxGrad => {
            let mut dy = args.take_f32(1)?;
            let n = args.shape(0)?.last().copied().unwrap_or(1);
            softmax::softmax_grad(args.f32(0)?, &mut dy, n);
            float(args, dy)?
        }
        Op::RopeGrad { theta, scaling } => {
            let mut dy = args.take_f32(0)?;
            let d = out.shape.dims();
            let positions = rope_positions(args, d)?;
            rope::rope_grad(&mut dy, d, positions.as_deref(), *theta, *scaling);
            float(args, dy)?
        }
        Op::EmbeddingGrad { vocab, padding } => {
            let (ids, dy) = (args.values::<i64>(0)?, args.f32(1)?);
            let h = out.shape.last();
            let mut table = embedding::embedding_grad(ids, dy, *vocab, h).map_err(|e| {
                RuntimeError::IndexOutOfRange {
                    node: args.node.to_string(),
                    what: "token id",
                    index: e.id,
                    position: e.position,
                    limit: *vocab,
                }
            })?;
            // torch's padding_idx: that row gets no gradient.
            if let Some(row) = table.get_mut(padding.unwrap_or(usize::MAX).saturating_mul(h)..) {
                row.iter_mut().take(h).for_each(|x| *x = 0.0);
            }
            float(args, table)?
        }
        Op::CrossEntropyGrad { ignore_index } => {
            let v = args.shape(0)?[1];
            let dloss = *args
                .f32(2)?
                .first()
                .ok_or_else(|| args.internal("the loss gradient is empty"))?;
            let mut logits = args.take_f32(0)?;
            loss::cross_entropy_grad(&mut logits, v, args.values::<i64>(1)?, *ignore_index, dloss)
                .map_err(|e| RuntimeError::IndexOutOfRange {
                    node: args.node.to_string(),
                    what: "label",
                    index: e.label,
                    position: e.position,
                    limit: v,
                })?;
            float(args, logits)?
        }
    };
    Ok(vec![result])
}

/// Mask operand `i` of a softmax or an attention: kept keys (bool) or positions (i64).
pub(super) fn key_mask<'a>(args: &'a Args, i: usize) -> Result<KeyMask<'a>, RuntimeError> {
    let shape = args.shape(i)?;
    Ok(match args.tensor(i)?.dtype() {
        DType::Bool => KeyMask::Keep(args.values(i)?, shape),
        _ => KeyMask::Positions(args.values(i)?, shape),
    })
}

/// A rope's positions operand (if any), one per row of `x` (`dims`, `[.., T, D]`).
fn rope_positions(args: &Args, dims: &[usize]) -> Result<Option<Vec<i64>>, RuntimeError> {
    if args.len() < 2 {
        return Ok(None);
    }
    let (data, shape) = (args.values::<i64>(1)?, args.shape(1)?);
    let rows = &dims[..dims.len() - 1];
    let strides = broadcast_strides(shape, rows);
    let n: usize = rows.iter().product();
    Ok(Some(
        (0..n).map(|r| data[offset(r, rows, &strides)]).collect(),
    ))
}

/// The F32 scalar operand `i`.
fn scalar(args: &Args, i: usize) -> Result<f32, RuntimeError> {
    match args.f32(i)? {
        &[x] => Ok(x),
        _ => Err(args.internal(format!("operand {i} must be a scalar"))),
    }
}

/// The FP8 format of an FP8 dtype attribute (typing has checked it is one).
fn fp8_format(args: &Args, to: DType) -> Result<castor_ir::fp8::Fp8Format, RuntimeError> {
    castor_ir::fp8::Fp8Format::of(to)
        .ok_or_else(|| args.internal(format!("{to} is not an FP8 dtype")))
}

fn to_tf32(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| castor_ir::round_tf32(v)).collect()
}

/// A multi-output node's F32-computed results, each stored in its output's dtype.
fn f32_results<const N: usize>(
    args: &Args,
    outs: &[&TensorType],
    values: [Vec<f32>; N],
) -> Result<Vec<Tensor>, RuntimeError> {
    values
        .into_iter()
        .zip(outs)
        .map(|(v, ty)| make(args, ty, TensorData::F32(v)))
        .collect()
}

/// A tensor of type `ty` holding `data`; float data is rounded to `ty`'s dtype.
fn make(args: &Args, ty: &TensorType, data: TensorData) -> Result<Tensor, RuntimeError> {
    let shape = ty.shape.clone();
    let len = match &data {
        TensorData::F32(v) => v.len(),
        TensorData::I64(v) => v.len(),
        TensorData::Bool(v) => v.len(),
        TensorData::U8(v) => v.len(),
    };
    if ty.shape.numel() != Some(len) {
        return Err(args.internal(format!("a kernel made {len} elements for {ty}")));
    }
    match (data, ty.dtype) {
        (TensorData::F32(v), d) if d.is_float() => Ok(Tensor::from_f32(d, shape, v)),
        (TensorData::I64(v), d) if d.is_int() => Ok(Tensor::from_i64(d, shape, v)),
        (TensorData::Bool(v), DType::Bool) => Ok(Tensor::from_bool(shape, v)),
        (TensorData::U8(v), DType::U8) => Ok(Tensor::from_u8(shape, v)),
        _ => Err(args.internal(format!("a kernel made the wrong storage for {ty}"))),
    }
}

/// A tensor of type `ty` holding `data` as it is: the elements of an operand of the same dtype,
/// moved by a layout op, which are not rounded again (see [`Tensor::from_stored`]).
fn moved(args: &Args, ty: &TensorType, data: TensorData) -> Result<Tensor, RuntimeError> {
    Tensor::from_stored(ty.dtype, ty.shape.clone(), data)
        .ok_or_else(|| args.internal(format!("a layout op made the wrong storage for {ty}")))
}

/// `a op b`, writing into an operand's buffer when it is owned and has the output's shape
/// (the left one, or for `add`/`mul`, which commute exactly, the right one).
fn binary(op: BinaryOp, args: &mut Args, out: &TensorType) -> Result<Vec<f32>, RuntimeError> {
    let out_shape = out.shape.dims();
    let fits = |args: &Args, i: usize| -> Result<bool, RuntimeError> {
        Ok(args.is_owned(i) && args.shape(i)? == out_shape)
    };
    let (dst_from, other) = if fits(args, 0)? {
        (Some(0), 1)
    } else if matches!(op, BinaryOp::Add | BinaryOp::Mul) && fits(args, 1)? {
        (Some(1), 0)
    } else {
        (None, 1)
    };
    match dst_from {
        Some(i) => {
            let mut dst = args.take_f32(i)?;
            let (b, b_shape) = (args.f32(other)?, args.shape(other)?);
            elementwise::binary(
                op,
                elementwise::Lhs::InPlace,
                b,
                b_shape,
                &mut dst,
                out_shape,
            );
            Ok(dst)
        }
        None => {
            let mut dst = pool::buffer(out.shape.numel().unwrap_or(0));
            let a = elementwise::Lhs::Slice(args.f32(0)?, args.shape(0)?);
            elementwise::binary(op, a, args.f32(1)?, args.shape(1)?, &mut dst, out_shape);
            Ok(dst)
        }
    }
}
