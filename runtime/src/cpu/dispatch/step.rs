//! The training step's ops: the global gradient norm, the optimizer updates of one parameter, the
//! step count and the loss-scale update.

use super::super::{adafactor, adamw8bit, optimizer};
use super::{f32_results, make, scalar};
use crate::cpu::operand::Args;
use crate::RuntimeError;
use castor_ir::{DType, Op, Tensor, TensorData, TensorType};

/// Runs `op`, a training-step op, on `args`; `outs` are the node's result types.
pub(super) fn execute(
    op: &Op,
    args: &mut Args,
    outs: &[&TensorType],
) -> Result<Vec<Tensor>, RuntimeError> {
    let out = super::first_result(args, outs)?;
    let float = |args: &Args, data: Vec<f32>| make(args, out, TensorData::F32(data));
    let result = match op {
        Op::GradNorm => {
            let last = args.len() - 1;
            let scale = scalar(args, last)?;
            let grads = (0..last)
                .map(|i| args.f32(i))
                .collect::<Result<Vec<_>, _>>()?;
            float(args, vec![optimizer::grad_norm(&grads, scale)])?
        }
        Op::AdamW {
            hp,
            max_grad_norm,
            copy,
        } => {
            let c = control(args, 4, *max_grad_norm)?;
            let (mut p, mut m, mut v) = (args.take_f32(0)?, args.take_f32(2)?, args.take_f32(3)?);
            optimizer::adamw(hp, c, &mut p, args.f32(1)?, &mut m, &mut v);
            return updated(args, outs, p, vec![m, v], *copy);
        }
        Op::AdamW8bit {
            hp,
            max_grad_norm,
            quant_block,
            copy,
        } => {
            let c = control(args, 7, *max_grad_norm)?;
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
            adamw8bit::adamw8bit(
                hp,
                *quant_block,
                c,
                args.f32(6)?,
                &mut p,
                args.f32(1)?,
                m,
                v,
            );
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
            hp,
            max_grad_norm,
            copy,
        } => {
            let c = control(args, 3, *max_grad_norm)?;
            let (mut p, mut buf) = (args.take_f32(0)?, args.take_f32(2)?);
            optimizer::sgd(hp, c, &mut p, args.f32(1)?, &mut buf);
            return updated(args, outs, p, vec![buf], *copy);
        }
        Op::Lion {
            hp,
            max_grad_norm,
            copy,
        } => {
            let c = control(args, 3, *max_grad_norm)?;
            let (mut p, mut m) = (args.take_f32(0)?, args.take_f32(2)?);
            optimizer::lion(hp, c, &mut p, args.f32(1)?, &mut m);
            return updated(args, outs, p, vec![m], *copy);
        }
        Op::Adafactor {
            hp: h,
            max_grad_norm,
            copy,
        } => {
            let dims = args.shape(0)?.to_vec();
            let n_moments = args.len() - 6;
            let c = control(args, 2 + n_moments, *max_grad_norm)?;
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
                h,
                c,
                &mut p,
                args.f32(1)?,
                first.first_mut().map(|m| m.as_mut_slice()),
                second,
            );
            return updated(args, outs, p, moments, *copy);
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
        _ => return Err(args.internal(format!("`{}` is not a training-step op", op.mnemonic()))),
    };
    Ok(vec![result])
}

/// Operand `i`'s bytes (U8 codes), moved if owned, copied if borrowed.
fn take_u8(args: &mut Args, i: usize) -> Result<Vec<u8>, RuntimeError> {
    match args.take(i)? {
        (_, TensorData::U8(v)) => Ok(v),
        (ty, _) => Err(args.internal(format!("operand {i} ({ty}) has the wrong storage"))),
    }
}

/// An optimizer op's control scalars (operands `first..first + 4`) and its clipping threshold.
fn control(
    args: &Args,
    first: usize,
    max_grad_norm: f64,
) -> Result<optimizer::Control, RuntimeError> {
    Ok(optimizer::Control {
        max_grad_norm,
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
