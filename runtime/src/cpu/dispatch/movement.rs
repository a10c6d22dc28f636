//! Data movement: reshapes, transposes, slices, concatenation, splits, padding and broadcasts, for
//! every storage type. Results hold their operands' elements as they are, not rounded again.

use super::super::layout;
use super::moved;
use crate::cpu::operand::{Args, Storage};
use crate::RuntimeError;
use castor_ir::{DType, Op, Tensor, TensorData, TensorType};

/// Runs `op`, a data-movement op, on `args`; `outs` are the node's result types.
pub(super) fn execute(
    op: &Op,
    args: &mut Args,
    outs: &[&TensorType],
) -> Result<Vec<Tensor>, RuntimeError> {
    let out = super::first_result(args, outs)?;
    let result = match op {
        Op::Reshape { .. } => {
            let (_, data) = args.take(0)?;
            moved(args, out, data)?
        }
        Op::Transpose { perm } => {
            let data = by_storage!(out.dtype, transpose(args, perm))?;
            moved(args, out, data)?
        }
        Op::Slice { axis, start, end } => {
            let data = by_storage!(out.dtype, slice(args, *axis, *start, *end))?;
            moved(args, out, data)?
        }
        Op::Concat { axis } => {
            let data = by_storage!(out.dtype, concat(args, *axis, out))?;
            moved(args, out, data)?
        }
        Op::Split { axis, sizes } => {
            let pieces = by_storage!(out.dtype, split(args, *axis, sizes))?;
            return pieces
                .into_iter()
                .zip(outs)
                .map(|(data, ty)| moved(args, ty, data))
                .collect();
        }
        Op::Pad {
            axis,
            before,
            after,
        } => {
            let data = by_storage!(out.dtype, pad(args, *axis, *before, *after))?;
            moved(args, out, data)?
        }
        Op::BroadcastTo { shape } => {
            let data = by_storage!(out.dtype, broadcast_to(args, shape))?;
            moved(args, out, data)?
        }
        _ => return Err(args.internal(format!("`{}` is not a data-movement op", op.mnemonic()))),
    };
    Ok(vec![result])
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
