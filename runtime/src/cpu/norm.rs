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

/// Rows per block of the weight-gradient reduction: each block sums its rows in order into
/// one F64 partial, and the partials are added in block order. The blocking depends only on
/// `h`, so `dweight`/`dbias` are the same bits for any number of threads.
fn rows_per_block(h: usize) -> usize {
    ((1 << 14) / h.max(1)).max(1)
}

/// Adds the blocks' partials `[blocks, k * h]` in block order: `k` vectors of `h`, F32.
fn sum_partials(partials: &[f64], h: usize, k: usize) -> Vec<Vec<f32>> {
    let mut total = vec![0f64; k * h];
    for block in partials.chunks(k * h) {
        for (t, &p) in total.iter_mut().zip(block) {
            *t += p;
        }
    }
    total
        .chunks(h.max(1))
        .take(k)
        .map(|c| c.iter().map(|&v| v as f32).collect())
        .collect()
}

/// Gradients of [`layer_norm`] over rows of `h = weight.len()`, as PyTorch's
/// `native_layer_norm_backward`: with `x̂ = (x - mean) * rstd` (the forward's F32 values) and
/// `g = dy * weight`, `dx = rstd * (g - mean(g) - x̂ * mean(g x̂))`, `dweight = Σ dy x̂` and
/// `dbias = Σ dy` over rows. `dy` is overwritten with `dx`; returns `(dweight, dbias)`.
pub fn layer_norm_grad(
    x: &[f32],
    weight: &[f32],
    dy: &mut [f32],
    eps: f64,
) -> (Vec<f32>, Vec<f32>) {
    let h = weight.len();
    if h == 0 {
        return (Vec::new(), Vec::new());
    }
    // Per row: the forward's F32 mean and rstd.
    let mut stats = vec![(0f32, 0f32); x.len() / h];
    for_each_block(&mut stats, 1, 2 * h, |r, s| {
        let row = &x[r * h..(r + 1) * h];
        let mean = math::sum(row) / h as f64;
        let var = math::sum_sq_dev(row, mean) / h as f64;
        s[0] = (mean as f32, (1.0 / (var + eps).sqrt()) as f32);
    });
    let per = rows_per_block(h);
    let blocks = stats.len().div_ceil(per);
    let mut partials = vec![0f64; blocks * 2 * h];
    let dy_in: &[f32] = dy;
    for_each_block(&mut partials, 2 * h, per * h, |b, part| {
        let (dw, db) = part.split_at_mut(h);
        for r in b * per..((b + 1) * per).min(stats.len()) {
            let (mean, rstd) = stats[r];
            let (xr, dyr) = (&x[r * h..(r + 1) * h], &dy_in[r * h..(r + 1) * h]);
            layer_norm_weight_grad_row(xr, dyr, mean, rstd, dw, db);
        }
    });
    for_each_block(dy, h, 2 * h, |r, row| {
        let (mean, rstd) = stats[r];
        layer_norm_grad_row(&x[r * h..(r + 1) * h], weight, row, mean, rstd);
    });
    let mut sums = sum_partials(&partials, h, 2).into_iter();
    let dw = sums.next().unwrap_or_default();
    let db = sums.next().unwrap_or_default();
    (dw, db)
}

multiversion! {
    fn layer_norm_weight_grad_row(
        x: &[f32],
        dy: &[f32],
        mean: f32,
        rstd: f32,
        dw: &mut [f64],
        db: &mut [f64],
    ) {
        for (((&x, &d), w), b) in x.iter().zip(dy).zip(dw.iter_mut()).zip(db.iter_mut()) {
            let xhat = (x - mean) * rstd;
            *w += f64::from(d) * f64::from(xhat);
            *b += f64::from(d);
        }
    }
}

multiversion! {
    /// One row of `dx`, written over the row of `dy`.
    fn layer_norm_grad_row(x: &[f32], weight: &[f32], dy: &mut [f32], mean: f32, rstd: f32) {
        let h = x.len() as f64;
        let (mut sum_g, mut sum_gx) = (0f64, 0f64);
        for ((&x, &w), &d) in x.iter().zip(weight).zip(dy.iter()) {
            let g = f64::from(d * w);
            sum_g += g;
            sum_gx += g * f64::from((x - mean) * rstd);
        }
        let (mean_g, mean_gx) = ((sum_g / h) as f32, (sum_gx / h) as f32);
        for ((&x, &w), d) in x.iter().zip(weight).zip(dy.iter_mut()) {
            let xhat = (x - mean) * rstd;
            *d = rstd * (*d * w - mean_g - xhat * mean_gx);
        }
    }
}

/// Gradients of [`rms_norm`] over rows of `h = weight.len()`: with `r = 1/sqrt(mean(x²) + eps)`
/// (the forward's F32 value) and `g = dy * weight`, `dx = r * (g - x r² mean(g x))` and
/// `dweight = Σ dy x r` over rows. `dy` is overwritten with `dx`; returns `dweight`.
pub fn rms_norm_grad(x: &[f32], weight: &[f32], dy: &mut [f32], eps: f64) -> Vec<f32> {
    let h = weight.len();
    if h == 0 {
        return Vec::new();
    }
    let mut rs = vec![0f32; x.len() / h];
    for_each_block(&mut rs, 1, h, |r, s| {
        let ms = math::sum_sq(&x[r * h..(r + 1) * h]) / h as f64;
        s[0] = (1.0 / (ms + eps).sqrt()) as f32;
    });
    let per = rows_per_block(h);
    let blocks = rs.len().div_ceil(per);
    let mut partials = vec![0f64; blocks * h];
    let dy_in: &[f32] = dy;
    for_each_block(&mut partials, h, per * h, |b, dw| {
        for (r, &rstd) in rs.iter().enumerate().take((b + 1) * per).skip(b * per) {
            let (xr, dyr) = (&x[r * h..(r + 1) * h], &dy_in[r * h..(r + 1) * h]);
            rms_norm_weight_grad_row(xr, dyr, rstd, dw);
        }
    });
    for_each_block(dy, h, 2 * h, |r, row| {
        rms_norm_grad_row(&x[r * h..(r + 1) * h], weight, row, rs[r]);
    });
    sum_partials(&partials, h, 1).pop().unwrap_or_default()
}

multiversion! {
    fn rms_norm_weight_grad_row(x: &[f32], dy: &[f32], r: f32, dw: &mut [f64]) {
        for ((&x, &d), w) in x.iter().zip(dy).zip(dw.iter_mut()) {
            *w += f64::from(d) * f64::from(x * r);
        }
    }
}

multiversion! {
    /// One row of `dx`, written over the row of `dy`.
    fn rms_norm_grad_row(x: &[f32], weight: &[f32], dy: &mut [f32], r: f32) {
        let mut sum_gx = 0f64;
        for ((&x, &w), &d) in x.iter().zip(weight).zip(dy.iter()) {
            sum_gx += f64::from(d * w) * f64::from(x);
        }
        let c = r * r * (sum_gx / x.len() as f64) as f32;
        for ((&x, &w), d) in x.iter().zip(weight).zip(dy.iter_mut()) {
            *d = r * (*d * w - x * c);
        }
    }
}
