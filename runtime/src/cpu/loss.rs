//! Cross-entropy over rows of logits.
//!
//! Each row's loss is `logsumexp(row) - row[label]` with the row maximum subtracted before
//! exponentiating. Per-row losses are computed in parallel and summed serially in F64, so the
//! result does not depend on the thread count.

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
    let valid = |l: i64| usize::try_from(l).is_ok_and(|l| l < v);
    if let Some((position, &label)) = labels
        .iter()
        .enumerate()
        .find(|&(_, &l)| l != ignore_index && !valid(l))
    {
        return Err(BadLabel { position, label });
    }
    let mut losses = vec![0f64; labels.len()];
    for_each_block(&mut losses, 1, v, |i, dst| {
        let label = labels[i];
        if label == ignore_index {
            return;
        }
        let row = &logits[i * v..(i + 1) * v];
        dst[0] = log_sum_exp(row) - f64::from(row[label as usize]);
    });
    let counted = labels.iter().filter(|&&l| l != ignore_index).count();
    Ok((losses.iter().sum::<f64>() / counted as f64) as f32)
}

multiversion! {
    /// `log Σ e^x`, with the maximum subtracted before exponentiating.
    fn log_sum_exp(row: &[f32]) -> f64 {
        let max = math::max(row);
        let sum = math::sum_by(row, |x| f64::from(math::exp(x - max)));
        sum.ln() + f64::from(max)
    }
}
