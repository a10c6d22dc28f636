//! Layer norm and RMS norm over the last axis, in place, one row at a time.
//!
//! Row statistics accumulate in F64 (two passes for the variance), so they are at least as
//! accurate as PyTorch's F32 moments; the normalized values are then computed in F32.

use super::math;
use super::par::for_each_block;
use super::simd::multiversion;

/// `(x - mean) / sqrt(var + eps) * weight + bias` over rows of `weight.len()`, with the biased
/// variance, as `torch.nn.functional.layer_norm`.
pub fn layer_norm(x: &mut [f32], weight: &[f32], bias: &[f32], eps: f64) {
    let h = weight.len();
    for_each_block(x, h, h, |_, row| layer_norm_row(row, weight, bias, eps));
}

multiversion! {
    fn layer_norm_row(row: &mut [f32], weight: &[f32], bias: &[f32], eps: f64) {
        let h = row.len() as f64;
        let mean = math::sum(row) / h;
        let var = math::sum_sq_dev(row, mean) / h;
        let rstd = (1.0 / (var + eps).sqrt()) as f32;
        let mean = mean as f32;
        for ((v, &w), &b) in row.iter_mut().zip(weight).zip(bias) {
            *v = (*v - mean) * rstd * w + b;
        }
    }
}

/// `x / sqrt(mean(x²) + eps) * weight` over rows of `weight.len()` (LLaMA's RMSNorm, with one
/// rounding at the end where HF rounds to the input dtype before the weight).
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f64) {
    let h = weight.len();
    for_each_block(x, h, h, |_, row| rms_norm_row(row, weight, eps));
}

multiversion! {
    fn rms_norm_row(row: &mut [f32], weight: &[f32], eps: f64) {
        let ms = math::sum_sq(row) / row.len() as f64;
        let r = (1.0 / (ms + eps).sqrt()) as f32;
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * r * w;
        }
    }
}
