//! Cross-entropy over rows of logits.
//!
//! Each row's loss is `logsumexp(row) - row[label]` with the row maximum subtracted before
//! exponentiating. Per-row losses are computed in parallel and summed serially in F64, so the
//! result does not depend on the thread count. The gradient is computed row by row in place.

use super::math;
use super::par::for_each_block;
use super::simd::multiversion;

/// A label that is neither in `[0, V)` nor the ignore index: its row and value.
pub struct BadLabel {
    pub position: usize,
    pub label: i64,
}

/// The mean of `-log_softmax(logits[i])[labels[i]]` over the rows whose label is not
/// `ignore_index`; logits are `[labels.len(), v]`. With no counted row the mean is `0 / 0`,
/// NaN, as PyTorch's `cross_entropy` with `reduction="mean"` gives.
pub fn cross_entropy(
    logits: &[f32],
    v: usize,
    labels: &[i64],
    ignore_index: i64,
) -> Result<f32, BadLabel> {
    check(v, labels, ignore_index)?;
    let mut losses = vec![0f64; labels.len()];
    row_losses(logits, v, labels, ignore_index, &mut losses);
    Ok(mean(&losses, labels, ignore_index))
}

/// Each row's `logsumexp(row) - row[label]` into `out` (0 on ignored rows), in parallel.
/// Labels are checked.
pub(crate) fn row_losses(
    logits: &[f32],
    v: usize,
    labels: &[i64],
    ignore_index: i64,
    out: &mut [f64],
) {
    for_each_block(out, 1, v, |i, dst| {
        let label = labels[i];
        if label == ignore_index {
            return;
        }
        let row = &logits[i * v..(i + 1) * v];
        dst[0] = log_sum_exp(row) - f64::from(row[label as usize]);
    });
}

/// The mean of the row losses over the counted rows: summed serially in F64, in row order.
pub(crate) fn mean(row_losses: &[f64], labels: &[i64], ignore_index: i64) -> f32 {
    let counted = labels.iter().filter(|&&l| l != ignore_index).count();
    (row_losses.iter().sum::<f64>() / counted as f64) as f32
}

/// The first label that is neither in `[0, v)` nor `ignore_index`, if any.
pub(crate) fn check(v: usize, labels: &[i64], ignore_index: i64) -> Result<(), BadLabel> {
    let valid = |l: i64| usize::try_from(l).is_ok_and(|l| l < v);
    match labels
        .iter()
        .enumerate()
        .find(|&(_, &l)| l != ignore_index && !valid(l))
    {
        Some((position, &label)) => Err(BadLabel { position, label }),
        None => Ok(()),
    }
}

/// The gradient of [`cross_entropy`] with respect to `logits` (`[labels.len(), v]`, replaced
/// by the result): `(softmax(row) - onehot(label)) * dloss / count` on rows whose label is not
/// `ignore_index`, where `count` is the number of such rows, and 0 on ignored rows, as
/// PyTorch's `nll_loss` and `log_softmax` backward compute it. With no counted row every row
/// is ignored and the gradient is all zeros (PyTorch's too, though the loss itself is NaN).
pub fn cross_entropy_grad(
    logits: &mut [f32],
    v: usize,
    labels: &[i64],
    ignore_index: i64,
    dloss: f32,
) -> Result<(), BadLabel> {
    check(v, labels, ignore_index)?;
    let scale = grad_scale(labels, ignore_index, dloss);
    row_grads(logits, v, labels, ignore_index, scale);
    Ok(())
}

/// What each counted row's gradient is scaled by: PyTorch divides the (F32) incoming gradient
/// by the (F32) count of counted rows.
pub(crate) fn grad_scale(labels: &[i64], ignore_index: i64, dloss: f32) -> f32 {
    let counted = labels.iter().filter(|&&l| l != ignore_index).count();
    dloss / counted as f32
}

/// Each row's gradient in place, `scale` from [`grad_scale`]. Labels are checked.
pub(crate) fn row_grads(
    logits: &mut [f32],
    v: usize,
    labels: &[i64],
    ignore_index: i64,
    scale: f32,
) {
    for_each_block(logits, v, 2 * v, |i, row| {
        let label = labels[i];
        if label == ignore_index {
            row.fill(0.0);
        } else {
            cross_entropy_grad_row(row, label as usize, scale);
        }
    });
}

multiversion! {
    /// `(softmax(row) - onehot(label)) * scale`, in place.
    fn cross_entropy_grad_row(row: &mut [f32], label: usize, scale: f32) {
        let max = math::max(row);
        row.iter_mut().for_each(|x| *x = math::exp(*x - max));
        let inv = (1.0 / math::sum(row)) as f32;
        row.iter_mut().for_each(|p| *p = *p * inv * scale);
        row[label] -= scale;
    }
}

multiversion! {
    /// `log Σ e^x`, with the maximum subtracted before exponentiating.
    fn log_sum_exp(row: &[f32]) -> f64 {
        let max = math::max(row);
        let sum = math::sum_by(row, |x| f64::from(math::exp(x - max)));
        sum.ln() + f64::from(max)
    }
}
