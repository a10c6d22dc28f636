//! Kernels of the gradient ops the autodiff pass emits (vector-Jacobian products).
//!
//! Written for clarity, as the reference the CUDA kernels will be checked against: F32
//! arithmetic with F64 accumulation of every sum, rows processed in order, so results are
//! deterministic. Each function documents the formula it implements.

use super::rope::rope_table;
use castor_ir::UnaryOp;
use std::f64::consts::PI;

/// `dx = f'(x) * dy` for the unary op `f`.
pub fn unary_grad(op: UnaryOp, x: &[f32], dy: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(dy)
        .map(|(&x, &dy)| (derivative(op, x as f64) * dy as f64) as f32)
        .collect()
}

fn derivative(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::GeluTanh => {
            let k = (2.0 / PI).sqrt();
            let u = k * (x + 0.044715 * x * x * x);
            let t = u.tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
        }
        UnaryOp::GeluErf => {
            let cdf = 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * x * x).exp() / (2.0 * PI).sqrt();
            cdf + x * pdf
        }
        UnaryOp::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 + x * (1.0 - s))
        }
        UnaryOp::Tanh => 1.0 - x.tanh().powi(2),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Rsqrt => -0.5 * x.powf(-1.5),
        UnaryOp::Neg => -1.0,
    }
}

/// Layer norm over rows of `h`: `g = dy * w`, `dx = rstd * (g - mean(g) - x̂ * mean(g x̂))`,
/// `dw = Σ dy x̂`, `db = Σ dy` over rows.
pub fn layer_norm_grad(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    h: usize,
    eps: f64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dx = vec![0f32; x.len()];
    let (mut dw, mut db) = (vec![0f64; h], vec![0f64; h]);
    for ((xr, dyr), dxr) in x.chunks(h).zip(dy.chunks(h)).zip(dx.chunks_mut(h)) {
        let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
        let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        let xhat: Vec<f64> = xr.iter().map(|&v| (v as f64 - mean) * rstd).collect();
        let g: Vec<f64> = dyr
            .iter()
            .zip(w)
            .map(|(&d, &w)| d as f64 * w as f64)
            .collect();
        let mg = g.iter().sum::<f64>() / h as f64;
        let mgx = g.iter().zip(&xhat).map(|(g, x)| g * x).sum::<f64>() / h as f64;
        for i in 0..h {
            dxr[i] = (rstd * (g[i] - mg - xhat[i] * mgx)) as f32;
            dw[i] += dyr[i] as f64 * xhat[i];
            db[i] += dyr[i] as f64;
        }
    }
    (dx, to_f32(dw), to_f32(db))
}

/// RMS norm: `r = 1/sqrt(mean(x²) + eps)`, `g = dy * w`, `dx = r * (g - x r² mean(g x))`,
/// `dw = Σ dy x r` over rows.
pub fn rms_norm_grad(x: &[f32], w: &[f32], dy: &[f32], h: usize, eps: f64) -> (Vec<f32>, Vec<f32>) {
    let mut dx = vec![0f32; x.len()];
    let mut dw = vec![0f64; h];
    for ((xr, dyr), dxr) in x.chunks(h).zip(dy.chunks(h)).zip(dx.chunks_mut(h)) {
        let ms = xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / h as f64;
        let r = 1.0 / (ms + eps).sqrt();
        let g: Vec<f64> = dyr
            .iter()
            .zip(w)
            .map(|(&d, &w)| d as f64 * w as f64)
            .collect();
        let mgx = g.iter().zip(xr).map(|(g, &x)| g * x as f64).sum::<f64>() / h as f64;
        for i in 0..h {
            let xi = xr[i] as f64;
            dxr[i] = (r * (g[i] - xi * r * r * mgx)) as f32;
            dw[i] += dyr[i] as f64 * xi * r;
        }
    }
    (dx, to_f32(dw))
}

/// Softmax over rows of `n`: `dx = y * (dy - Σ dy y)`.
pub fn softmax_grad(y: &[f32], dy: &[f32], n: usize) -> Vec<f32> {
    let mut dx = vec![0f32; y.len()];
    for ((yr, dyr), dxr) in y.chunks(n).zip(dy.chunks(n)).zip(dx.chunks_mut(n)) {
        let dot: f64 = yr.iter().zip(dyr).map(|(&y, &d)| y as f64 * d as f64).sum();
        for i in 0..n {
            dxr[i] = (yr[i] as f64 * (dyr[i] as f64 - dot)) as f32;
        }
    }
    dx
}

/// The transpose of rope: rotation of `dy` `[.., t, d]` by the negated angles.
pub fn rope_grad(dy: &[f32], t: usize, d: usize, theta: f64) -> Vec<f32> {
    let half = d / 2;
    let table = rope_table(t, d, theta);
    let mut dx = dy.to_vec();
    for (r, row) in dx.chunks_mut(d).enumerate() {
        let cs = &table[(r % t) * half..(r % t + 1) * half];
        let (lo, hi) = row.split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
            let (g1, g2) = (*a, *b);
            *a = g1 * c + g2 * s;
            *b = g2 * c - g1 * s;
        }
    }
    dx
}

/// Zeros `before` and `after` along `axis` of `x` with dims `dims`.
pub fn pad(x: &[f32], dims: &[usize], axis: usize, before: usize, after: usize) -> Vec<f32> {
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    let len = dims[axis];
    let out_len = len + before + after;
    let mut out = vec![0f32; outer * out_len * inner];
    for o in 0..outer {
        let src = &x[o * len * inner..(o + 1) * len * inner];
        let dst = &mut out[(o * out_len + before) * inner..(o * out_len + before + len) * inner];
        dst.copy_from_slice(src);
    }
    out
}

/// NumPy broadcast of `x` with dims `from` to dims `to`.
pub fn broadcast_to(x: &[f32], from: &[usize], to: &[usize]) -> Vec<f32> {
    let extra = to.len() - from.len();
    // Strides of `x` seen from `to`'s index space: 0 along broadcast dims.
    let mut strides = vec![0usize; to.len()];
    let mut s = 1;
    for i in (0..from.len()).rev() {
        strides[i + extra] = if from[i] == 1 { 0 } else { s };
        s *= from[i];
    }
    let n: usize = to.iter().product();
    let mut out = Vec::with_capacity(n);
    let mut index = vec![0usize; to.len()];
    for _ in 0..n {
        let src: usize = index.iter().zip(&strides).map(|(i, s)| i * s).sum();
        out.push(x[src]);
        for k in (0..to.len()).rev() {
            index[k] += 1;
            if index[k] < to[k] {
                break;
            }
            index[k] = 0;
        }
    }
    out
}

/// Rows of `dy` (`[ids.len(), h]`) added into a `[vocab, h]` table at their ids, in order.
/// Returns the position of the first id outside `[0, vocab)`, if any.
pub fn embedding_grad(
    ids: &[i64],
    dy: &[f32],
    vocab: usize,
    h: usize,
) -> Result<Vec<f32>, (usize, i64)> {
    let mut acc = vec![0f64; vocab * h];
    for (p, (&id, row)) in ids.iter().zip(dy.chunks(h)).enumerate() {
        if id < 0 || id as u64 >= vocab as u64 {
            return Err((p, id));
        }
        let dst = &mut acc[id as usize * h..(id as usize + 1) * h];
        for (a, &d) in dst.iter_mut().zip(row) {
            *a += d as f64;
        }
    }
    Ok(to_f32(acc))
}

/// `(softmax(logits) - onehot(label)) * dloss / count` on counted rows, zero on ignored rows;
/// `count` is the number of counted rows (NaN everywhere when there are none, as PyTorch's
/// mean over nothing). Returns the first bad label's position, if any.
pub fn cross_entropy_grad(
    logits: &[f32],
    v: usize,
    labels: &[i64],
    ignore: i64,
    dloss: f32,
) -> Result<Vec<f32>, (usize, i64)> {
    let count = labels.iter().filter(|&&l| l != ignore).count();
    let scale = dloss as f64 / count as f64;
    let mut out = vec![0f32; logits.len()];
    for (p, ((row, &label), o)) in logits
        .chunks(v)
        .zip(labels)
        .zip(out.chunks_mut(v))
        .enumerate()
    {
        if label == ignore {
            continue;
        }
        if label < 0 || label as u64 >= v as u64 {
            return Err((p, label));
        }
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
        let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        for (i, (o, &x)) in o.iter_mut().zip(row).enumerate() {
            let p = (x as f64 - max).exp() / sum;
            let onehot = if i as i64 == label { 1.0 } else { 0.0 };
            *o = ((p - onehot) * scale) as f32;
        }
    }
    Ok(out)
}

fn to_f32(v: Vec<f64>) -> Vec<f32> {
    v.into_iter().map(|x| x as f32).collect()
}
