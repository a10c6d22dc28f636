//! From a node's op to its kernel: unpacks operands, calls the kernel, and builds the result
//! tensors with the types the graph records (float results are rounded to their dtype there,
//! by `Tensor::from_f32`).

use super::operand::{Args, Storage};
use super::{
    adafactor, adamw8bit, attention, cast, classifier, elementwise, embedding, epilogue, layout,
    loss, matmul, norm, optimizer, pool, reduce, rope, softmax,
};
use crate::RuntimeError;
use castor_ir::{Accum, BinaryOp, DType, Op, Tensor, TensorData, TensorType};

/// Calls a generic layout helper with the element type that stores `dtype`.
macro_rules! by_storage {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 | DType::F16 | DType::BF16 => $f::<f32>($($arg),*),
            DType::I32 | DType::I64 => $f::<i64>($($arg),*),
            DType::Bool => $f::<bool>($($arg),*),
            DType::U8 => $f::<u8>($($arg),*),
        }
    };
}

/// Runs `op` on `args` with the node's accumulation `acc`; `outs` are the node's result types.
pub fn execute(
    op: &Op,
    acc: Option<Accum>,
    args: &mut Args,
    outs: &[&TensorType],
) -> Result<Vec<Tensor>, RuntimeError> {
    let out = *outs
        .first()
        .ok_or_else(|| args.internal("the node has no results"))?;
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
        Op::GradNorm => {
            let last = args.len() - 1;
            let scale = scalar(args, last)?;
            let grads = (0..last)
                .map(|i| args.f32(i))
                .collect::<Result<Vec<_>, _>>()?;
            float(args, vec![optimizer::grad_norm(&grads, scale)])?
        }
        Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
            max_grad_norm,
            copy,
        } => {
            let h = optimizer::AdamW {
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *weight_decay,
                max_grad_norm: *max_grad_norm,
            };
            let c = control(args, 4)?;
            let (mut p, mut m, mut v) = (args.take_f32(0)?, args.take_f32(2)?, args.take_f32(3)?);
            optimizer::adamw(&h, c, &mut p, args.f32(1)?, &mut m, &mut v);
            return updated(args, outs, p, vec![m, v], *copy);
        }
        Op::AdamW8bit { .. } => {
            let Some((h, copy)) = adamw8bit::AdamW8bit::of(op) else {
                return Err(args.internal("not an adamw8bit op"));
            };
            let c = control(args, 7)?;
            let mut p = args.take_f32(0)?;
            let (mut mq, mut vq) = (take_u8(args, 2)?, take_u8(args, 4)?);
            let (mut ma, mut va) = (args.take_f32(3)?, args.take_f32(5)?);
            let m = adamw8bit::Quantized {
                codes: &mut mq,
                absmax: &mut ma,
            };
            let v = adamw8bit::Quantized {
                codes: &mut vq,
                absmax: &mut va,
            };
            adamw8bit::adamw8bit(&h, c, args.f32(6)?, &mut p, args.f32(1)?, m, v);
            let copy = copy.map(|_| TensorData::F32(p.clone()));
            return [
                TensorData::F32(p),
                TensorData::U8(mq),
                TensorData::F32(ma),
                TensorData::U8(vq),
                TensorData::F32(va),
            ]
            .into_iter()
            .chain(copy)
            .zip(outs)
            .map(|(data, ty)| make(args, ty, data))
            .collect();
        }
        Op::Sgd {
            momentum,
            weight_decay,
            max_grad_norm,
            copy,
        } => {
            let h = optimizer::Sgd {
                momentum: *momentum,
                weight_decay: *weight_decay,
                max_grad_norm: *max_grad_norm,
            };
            let c = control(args, 3)?;
            let (mut p, mut buf) = (args.take_f32(0)?, args.take_f32(2)?);
            optimizer::sgd(&h, c, &mut p, args.f32(1)?, &mut buf);
            return updated(args, outs, p, vec![buf], *copy);
        }
        Op::Adafactor { .. } => {
            let Some((h, copy)) = adafactor::Adafactor::of(op) else {
                return Err(args.internal("not an adafactor op"));
            };
            let dims = args.shape(0)?.to_vec();
            let n_moments = args.len() - 6;
            let c = control(args, 2 + n_moments)?;
            let mut p = args.take_f32(0)?;
            let mut moments = (2..2 + n_moments)
                .map(|i| args.take_f32(i))
                .collect::<Result<Vec<_>, _>>()?;
            let (first, second) = moments.split_at_mut(usize::from(h.beta1.is_some()));
            let second = match (second, dims.as_slice()) {
                ([row, col], [.., rows, cols]) => adafactor::SecondMoment::Factored {
                    rows: *rows,
                    cols: *cols,
                    row,
                    col,
                },
                ([v], _) => adafactor::SecondMoment::Full(v),
                _ => return Err(args.internal("adafactor's moments do not fit its parameter")),
            };
            adafactor::adafactor(
                &h,
                c,
                &mut p,
                args.f32(1)?,
                first.first_mut().map(|m| m.as_mut_slice()),
                second,
            );
            return updated(args, outs, p, moments, copy);
        }
        Op::CountStep => {
            let step = optimizer::count_step(scalar(args, 0)?, scalar(args, 1)?);
            float(args, vec![step])?
        }
        Op::LossScaleUpdate {
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            max_scale,
        } => {
            let h = optimizer::LossScaler {
                growth_factor: *growth_factor,
                backoff_factor: *backoff_factor,
                growth_interval: *growth_interval,
                hysteresis: *hysteresis,
                max_scale: *max_scale,
            };
            let counters = match args.f32(1)? {
                &[a, b] => [a, b],
                _ => return Err(args.internal("loss-scale counters must hold 2 values")),
            };
            let (scale, counters) =
                optimizer::loss_scale_update(&h, scalar(args, 0)?, counters, scalar(args, 2)?);
            return f32_results(args, outs, [vec![scale], counters.to_vec()]);
        }
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
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => float(args, product(args, acc, out, *transpose_a, *transpose_b)?)?,
        Op::MatMulScaled {
            transpose_a,
            transpose_b,
            alpha,
        } => {
            let mut scaled = product(args, acc, out, *transpose_a, *transpose_b)?;
            epilogue::scale(&mut scaled, *alpha);
            float(args, scaled)?
        }
        Op::Nf4MatMul {
            transpose_b,
            rows,
            cols,
        } => float(
            args,
            nf4_product(args, acc, out, *transpose_b, (*rows, *cols))?,
        )?,
        Op::MatMulBias {
            transpose_a,
            transpose_b,
        } => {
            let mut sum = product(args, acc, out, *transpose_a, *transpose_b)?;
            epilogue::add_bias(&mut sum, args.f32(2)?);
            float(args, sum)?
        }
        Op::MatMulBiasGelu {
            transpose_a,
            transpose_b,
        } => {
            let mut pre = product(args, acc, out, *transpose_a, *transpose_b)?;
            let act = epilogue::bias_gelu(&mut pre, args.f32(2)?);
            return f32_results(args, outs, [pre, act]);
        }
        Op::MatMulBiasGrad { lhs } => {
            let product = product(args, acc, out, true, false)?;
            let i = usize::from(!*lhs);
            let (k, n) = (args.shape(i)?[0], args.shape(i)?[1]);
            let dbias = epilogue::bias_grad(args.f32(i)?, k, n);
            return f32_results(args, outs, [product, dbias]);
        }
        Op::MatMulGeluGrad {
            transpose_a,
            transpose_b,
        } => {
            let mut grad = product(args, acc, out, *transpose_a, *transpose_b)?;
            epilogue::gelu_grad(&mut grad, args.f32(2)?);
            float(args, grad)?
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
                Some(softmax::Mask {
                    data: args.values::<bool>(1)?,
                    shape: args.shape(1)?,
                })
            } else {
                None
            };
            softmax::softmax(&mut x, out.shape.dims(), *causal, *window, mask);
            float(args, x)?
        }
        Op::Attention {
            causal,
            window,
            scale,
            ..
        } => {
            let ops = attention_operands(args, acc, &[0, 1, 2])?;
            let mask = args.len() > 3;
            let problem =
                attention_problem(args, acc, mask.then_some(3), (*causal, *window), *scale)?;
            let (o, lse) = attention::attention(&ops[0], &ops[1], &ops[2], &problem);
            return f32_results(args, outs, [o, lse]);
        }
        Op::AttentionGrad {
            causal,
            window,
            scale,
            ..
        } => {
            let ops = attention_operands(args, acc, &[0, 1, 2, 5])?;
            let mask = args.len() > 6;
            let problem =
                attention_problem(args, acc, mask.then_some(6), (*causal, *window), *scale)?;
            let (dq, dk, dv) = attention::attention_grad(
                &ops[0],
                &ops[1],
                &ops[2],
                args.f32(3)?,
                args.f32(4)?,
                &ops[3],
                &problem,
            );
            return f32_results(args, outs, [dq, dk, dv]);
        }
        Op::Rope { theta, scaling } => {
            let mut x = args.take_f32(0)?;
            let d = out.shape.dims();
            rope::rope(&mut x, d[d.len() - 2], d[d.len() - 1], *theta, *scaling);
            float(args, x)?
        }
        Op::Reshape { .. } => {
            let (_, data) = args.take(0)?;
            make(args, out, data)?
        }
        Op::Transpose { perm } => {
            let data = by_storage!(out.dtype, transpose(args, perm))?;
            make(args, out, data)?
        }
        Op::Slice { axis, start, end } => {
            let data = by_storage!(out.dtype, slice(args, *axis, *start, *end))?;
            make(args, out, data)?
        }
        Op::Concat { axis } => {
            let data = by_storage!(out.dtype, concat(args, *axis, out))?;
            make(args, out, data)?
        }
        Op::Split { axis, sizes } => {
            let pieces = by_storage!(out.dtype, split(args, *axis, sizes))?;
            return pieces
                .into_iter()
                .zip(outs)
                .map(|(data, ty)| make(args, ty, data))
                .collect();
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
        Op::LinearCrossEntropy {
            ignore_index,
            chunk_rows,
            logits,
        } => {
            let p = classifier_problem(args, acc, *ignore_index, *chunk_rows, *logits)?;
            let loss = classifier::loss(&p).map_err(|e| bad_label(args, &p, e))?;
            float(args, vec![loss])?
        }
        Op::LinearCrossEntropyGrad {
            ignore_index,
            chunk_rows,
            logits,
        } => {
            let p = classifier_problem(args, acc, *ignore_index, *chunk_rows, *logits)?;
            let dloss = scalar(args, 3)?;
            let (dh, dw) =
                classifier::grad(&p, dloss, outs[0].dtype).map_err(|e| bad_label(args, &p, e))?;
            return Ok(vec![
                make(args, outs[0], TensorData::F32(dh))?,
                make(args, outs[1], TensorData::F32(dw))?,
            ]);
        }
        // The loss and the gradients as the two ops compute them (the CPU recomputes each
        // chunk's logits; the device does not need to).
        Op::LinearCrossEntropyStep {
            ignore_index,
            chunk_rows,
            logits,
        } => {
            let p = classifier_problem(args, acc, *ignore_index, *chunk_rows, *logits)?;
            let loss = classifier::loss(&p).map_err(|e| bad_label(args, &p, e))?;
            let dloss = scalar(args, 3)?;
            let (dh, dw) =
                classifier::grad(&p, dloss, outs[1].dtype).map_err(|e| bad_label(args, &p, e))?;
            return f32_results(args, outs, [vec![loss], dh, dw]);
        }
        // A parameter's working copy holds its master rounded to the copy's dtype.
        Op::Cast { to } | Op::ParamCopy { to } => {
            let (_, data) = args.take(0)?;
            make(args, out, cast::cast(data, *to))?
        }
        Op::Full { value, .. } => {
            let n = out.shape.numel().unwrap_or(0);
            match out.dtype {
                DType::F32 | DType::F16 | DType::BF16 => float(args, vec![*value as f32; n])?,
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
            rope::rope_grad(&mut dy, d[d.len() - 2], d[d.len() - 1], *theta, *scaling);
            float(args, dy)?
        }
        Op::Pad {
            axis,
            before,
            after,
        } => {
            let data = by_storage!(out.dtype, pad(args, *axis, *before, *after))?;
            make(args, out, data)?
        }
        Op::BroadcastTo { shape } => {
            let data = by_storage!(out.dtype, broadcast_to(args, shape))?;
            make(args, out, data)?
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

/// The F32 scalar operand `i`.
fn scalar(args: &Args, i: usize) -> Result<f32, RuntimeError> {
    match args.f32(i)? {
        &[x] => Ok(x),
        _ => Err(args.internal(format!("operand {i} must be a scalar"))),
    }
}

/// The scalars `(lr, step, scale, grad_norm)` that follow an optimizer op's buffers.
/// The F32 product `op(a) · op(b)` of operands 0 and 1, unrounded (TF32 contractions see
/// their operands rounded to TF32, as tensor cores do).
fn product(
    args: &Args,
    acc: Option<Accum>,
    out: &TensorType,
    transpose_a: bool,
    transpose_b: bool,
) -> Result<Vec<f32>, RuntimeError> {
    let tf32 = acc == Some(Accum::Tf32);
    let (a_tf32, b_tf32) = if tf32 {
        (to_tf32(args.f32(0)?), to_tf32(args.f32(1)?))
    } else {
        (Vec::new(), Vec::new())
    };
    let a = matmul::Operand {
        data: if tf32 { &a_tf32 } else { args.f32(0)? },
        shape: args.shape(0)?,
        transpose: transpose_a,
    };
    let b = matmul::Operand {
        data: if tf32 { &b_tf32 } else { args.f32(1)? },
        shape: args.shape(1)?,
        transpose: transpose_b,
    };
    Ok(matmul::matmul(&a, &b, out.shape.dims()))
}

/// `x W^T` or `x W` of an NF4 weight `[rows, cols]` (codes operand 1, absmax operand 2):
/// the weight dequantized and rounded to `x`'s dtype, then the product as `matmul` computes
/// it (with TF32 operands under TF32 accumulation, as [`product`]), every row of `x` at once.
fn nf4_product(
    args: &Args,
    acc: Option<Accum>,
    out: &TensorType,
    transpose_b: bool,
    (rows, cols): (usize, usize),
) -> Result<Vec<f32>, RuntimeError> {
    let x = args.tensor(0)?;
    let q = castor_ir::nf4::Nf4 {
        packed: args.values::<u8>(1)?.to_vec(),
        absmax: args.f32(2)?.to_vec(),
        numel: rows * cols,
    };
    let dtype = x.dtype();
    let tf32 = acc == Some(Accum::Tf32);
    let mut weight: Vec<f32> = castor_ir::nf4::dequantize(&q, castor_ir::nf4::NF4_BLOCK)
        .into_iter()
        .map(|v| castor_ir::round_to(dtype, v))
        .collect();
    let x_tf32 = if tf32 {
        weight = to_tf32(&weight);
        to_tf32(args.f32(0)?)
    } else {
        Vec::new()
    };
    let k = *args.shape(0)?.last().unwrap_or(&0);
    let m = args.shape(0)?.iter().product::<usize>() / k.max(1);
    let n = *out.shape.dims().last().unwrap_or(&0);
    let a = matmul::Operand {
        data: if tf32 { &x_tf32 } else { args.f32(0)? },
        shape: &[m, k],
        transpose: false,
    };
    let b = matmul::Operand {
        data: &weight,
        shape: &[rows, cols],
        transpose: transpose_b,
    };
    Ok(matmul::matmul(&a, &b, &[m, n]))
}

/// A classifier op's operands: hidden `[N, C]`, weight `[V, C]`, labels `[N]`.
fn classifier_problem<'a>(
    args: &'a Args,
    acc: Option<Accum>,
    ignore_index: i64,
    chunk_rows: usize,
    logits: DType,
) -> Result<classifier::Classifier<'a>, RuntimeError> {
    let wd = args.shape(1)?;
    Ok(classifier::Classifier {
        hidden: args.f32(0)?,
        weight: args.f32(1)?,
        labels: args.values::<i64>(2)?,
        width: wd[1],
        vocab: wd[0],
        chunk_rows,
        ignore_index,
        logits,
        tf32: acc == Some(Accum::Tf32),
    })
}

fn bad_label(args: &Args, p: &classifier::Classifier, e: loss::BadLabel) -> RuntimeError {
    RuntimeError::IndexOutOfRange {
        node: args.node.to_string(),
        what: "label",
        index: e.label,
        position: e.position,
        limit: p.vocab,
    }
}

/// Operand `i`'s bytes (U8 codes), moved if owned, copied if borrowed.
fn take_u8(args: &mut Args, i: usize) -> Result<Vec<u8>, RuntimeError> {
    match args.take(i)? {
        (_, TensorData::U8(v)) => Ok(v),
        (ty, _) => Err(args.internal(format!("operand {i} ({ty}) has the wrong storage"))),
    }
}

fn control(args: &Args, first: usize) -> Result<optimizer::Control, RuntimeError> {
    Ok(optimizer::Control {
        lr: scalar(args, first)?,
        step: scalar(args, first + 1)?,
        scale: scalar(args, first + 2)?,
        grad_norm: scalar(args, first + 3)?,
    })
}

/// An optimizer op's results: the master, its moments, and the working copy (the master
/// rounded to the copy's dtype by `make`).
fn updated(
    args: &Args,
    outs: &[&TensorType],
    master: Vec<f32>,
    moments: Vec<Vec<f32>>,
    copy: Option<DType>,
) -> Result<Vec<Tensor>, RuntimeError> {
    let copy = copy.map(|_| master.clone());
    std::iter::once(master)
        .chain(moments)
        .chain(copy)
        .zip(outs)
        .map(|(v, ty)| make(args, ty, TensorData::F32(v)))
        .collect()
}

/// The float operands `which` of an attention op, rounded to TF32 for a TF32 contraction (as
/// tensor cores read them).
fn attention_operands(
    args: &Args,
    acc: Option<Accum>,
    which: &[usize],
) -> Result<Vec<Vec<f32>>, RuntimeError> {
    which
        .iter()
        .map(|&i| {
            let x = args.f32(i)?;
            Ok(if acc == Some(Accum::Tf32) {
                to_tf32(x)
            } else {
                x.to_vec()
            })
        })
        .collect()
}

/// An attention op's shapes, mask (operand `mask`) and rounding.
fn attention_problem<'a>(
    args: &'a Args,
    acc: Option<Accum>,
    mask: Option<usize>,
    (causal, window): (bool, Option<usize>),
    scale: f64,
) -> Result<attention::Problem<'a>, RuntimeError> {
    let mask = match mask {
        Some(i) => Some((args.values::<bool>(i)?, args.shape(i)?)),
        None => None,
    };
    let operand = if acc == Some(Accum::Tf32) {
        attention::Operand::Tf32
    } else {
        attention::Operand::Dtype(args.tensor(0)?.dtype())
    };
    Ok(attention::Problem {
        q: args.shape(0)?,
        k: args.shape(1)?,
        v: args.shape(2)?,
        mask,
        causal,
        window,
        scale,
        operand,
    })
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

fn transpose<T: Storage>(args: &Args, perm: &[usize]) -> Result<TensorData, RuntimeError> {
    let x = args.values::<T>(0)?;
    Ok(T::wrap(layout::transpose(x, args.shape(0)?, perm)))
}

fn slice<T: Storage>(
    args: &Args,
    axis: usize,
    start: usize,
    end: usize,
) -> Result<TensorData, RuntimeError> {
    let x = args.values::<T>(0)?;
    Ok(T::wrap(layout::slice(x, args.shape(0)?, axis, start, end)))
}

fn concat<T: Storage>(
    args: &Args,
    axis: usize,
    out: &TensorType,
) -> Result<TensorData, RuntimeError> {
    let parts = (0..args.len())
        .map(|i| Ok((args.values::<T>(i)?, args.shape(i)?)))
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    Ok(T::wrap(layout::concat(&parts, axis, out.shape.dims())))
}

fn split<T: Storage>(
    args: &Args,
    axis: usize,
    sizes: &[usize],
) -> Result<Vec<TensorData>, RuntimeError> {
    let x = args.values::<T>(0)?;
    let pieces = layout::split(x, args.shape(0)?, axis, sizes);
    Ok(pieces.into_iter().map(T::wrap).collect())
}

fn pad<T: Storage>(
    args: &Args,
    axis: usize,
    before: usize,
    after: usize,
) -> Result<TensorData, RuntimeError> {
    let x = args.values::<T>(0)?;
    Ok(T::wrap(layout::pad(x, args.shape(0)?, axis, before, after)))
}

fn broadcast_to<T: Storage>(args: &Args, shape: &[usize]) -> Result<TensorData, RuntimeError> {
    let x = args.values::<T>(0)?;
    Ok(T::wrap(layout::broadcast_to(x, args.shape(0)?, shape)))
}
