//! Contractions: the matrix products and their fused epilogues, NF4 products, fused attention and
//! the fused LM head with its loss.

use super::super::{attention, classifier, epilogue, fp8, layout, loss, matmul};
use super::{f32_results, make, scalar, to_tf32};
use crate::cpu::operand::Args;
use crate::RuntimeError;
use castor_ir::{Accum, DType, Op, Tensor, TensorData, TensorType};

/// Runs `op`, a contraction, on `args`; `outs` are the node's result types.
pub(super) fn execute(
    op: &Op,
    acc: Option<Accum>,
    args: &mut Args,
    outs: &[&TensorType],
) -> Result<Vec<Tensor>, RuntimeError> {
    let out = super::first_result(args, outs)?;
    let float = |args: &Args, data: Vec<f32>| make(args, out, TensorData::F32(data));
    let result = match op {
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
        Op::MatMulAdd {
            transpose_a,
            transpose_b,
            alpha,
        } => {
            let mut sum = product(args, acc, out, *transpose_a, *transpose_b)?;
            epilogue::scale(&mut sum, *alpha);
            epilogue::add_addend(&mut sum, args.f32(2)?);
            float(args, sum)?
        }
        Op::Nf4MatMul {
            transpose_b,
            rows,
            cols,
        } => float(
            args,
            nf4_product(args, acc, out, *transpose_b, (*rows, *cols))?,
        )?,
        Op::Fp8MatMul {
            transpose_a,
            transpose_b,
        } => {
            // FP8 values are exact in F32 and so are their products: the F32 sum is what the
            // tensor cores accumulate, then one multiplication dequantizes it.
            let mut sum = fp8_product(args, out, *transpose_a, *transpose_b)?;
            let factor = fp8::dequantization(scalar(args, 2)?, scalar(args, 3)?);
            sum.iter_mut().for_each(|v| *v *= factor);
            float(args, sum)?
        }
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
        Op::Attention {
            causal,
            window,
            scale,
            ..
        } => {
            let ops = attention_operands(args, acc, &[0, 1, 2])?;
            let problem = attention_problem(args, acc, op, (*causal, *window), *scale)?;
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
            let problem = attention_problem(args, acc, op, (*causal, *window), *scale)?;
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
        _ => return Err(args.internal(format!("`{}` is not a contraction", op.mnemonic()))),
    };
    Ok(vec![result])
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

/// The F32 sum of an FP8 product, on its operands brought to the form cuBLASLt's FP8 kernels
/// take (both contiguous along the inner dim: `a` as `[.., M, K]`, `b` as `[.., N, K]` read
/// transposed), transposing the ones the IR stores the other way. The CUDA lowering makes the
/// same transposed copies, so the emulator multiplies the same matrices laid out the same way
/// (`cuda/emulate/gemm.rs`); the sum is the same either way.
fn fp8_product(
    args: &Args,
    out: &TensorType,
    transpose_a: bool,
    transpose_b: bool,
) -> Result<Vec<f32>, RuntimeError> {
    let swapped = |i: usize| -> Result<(Vec<f32>, Vec<usize>), RuntimeError> {
        let shape = args.shape(i)?;
        let r = shape.len();
        if r < 2 {
            return Err(args.internal(format!("operand {i} of an FP8 product is not a matrix")));
        }
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        let dims: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        Ok((layout::transpose(args.f32(i)?, shape, &perm), dims))
    };
    let (a_copy, b_copy);
    let a = if transpose_a {
        a_copy = swapped(0)?;
        matmul::Operand {
            data: &a_copy.0,
            shape: &a_copy.1,
            transpose: false,
        }
    } else {
        matmul::Operand {
            data: args.f32(0)?,
            shape: args.shape(0)?,
            transpose: false,
        }
    };
    let b = if transpose_b {
        matmul::Operand {
            data: args.f32(1)?,
            shape: args.shape(1)?,
            transpose: true,
        }
    } else {
        b_copy = swapped(1)?;
        matmul::Operand {
            data: &b_copy.0,
            shape: &b_copy.1,
            transpose: true,
        }
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

/// An attention op's shapes, mask, dropout and rounding.
fn attention_problem<'a>(
    args: &'a Args,
    acc: Option<Accum>,
    op: &Op,
    (causal, window): (bool, Option<usize>),
    scale: f64,
) -> Result<attention::Problem<'a>, RuntimeError> {
    let at = op
        .attention_operands(args.len())
        .unwrap_or(castor_ir::AttentionOperands {
            mask: None,
            key: None,
        });
    let mask = match at.mask {
        Some(i) => Some(super::key_mask(args, i)?),
        None => None,
    };
    let dropout = match (op.attention_dropout(), at.key) {
        (Some(d), Some(i)) => {
            let key: &[i64] = args.values(i)?;
            let key = [key[0], key[1]];
            (!castor_ir::philox::is_evaluation(key)).then_some(attention::Dropout {
                key,
                stream: d.stream as u32,
                p: d.p,
            })
        }
        _ => None,
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
        dropout,
    })
}
