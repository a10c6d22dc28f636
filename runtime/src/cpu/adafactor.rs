//! One Adafactor step (`castor_ir::Op::Adafactor`), following transformers' `Adafactor.step`
//! operation by operation: F32 arithmetic on F32 values, hyperparameter scalars formed in F64
//! and applied as F32 (as torch applies a Python float to an F32 tensor). Reductions (means,
//! root mean squares) accumulate in F64 in the order `adafactor.cu` sums them (see
//! [`block_sum`]), so the CUDA kernels equal this twin bit for bit; torch accumulates in F32,
//! which is why the comparison with it holds to 1e-5 rather than to the last bit.

use super::optimizer::Control;
use castor_ir::AdafactorHparams;

/// The second-moment state of one parameter.
pub enum SecondMoment<'a> {
    /// Row and column statistics of a parameter of rank 2 or more, seen as `lead` matrices of
    /// `rows x cols`: `row` holds `lead * rows` values, `col` `lead * cols`.
    Factored {
        rows: usize,
        cols: usize,
        row: &'a mut [f32],
        col: &'a mut [f32],
    },
    /// The full `exp_avg_sq` of a vector.
    Full(&'a mut [f32]),
}

/// One step in place. Does nothing when the step is skipped.
pub fn adafactor(
    h: &AdafactorHparams,
    c: Control,
    p: &mut [f32],
    g: &[f32],
    exp_avg: Option<&mut [f32]>,
    second: SecondMoment<'_>,
) {
    if c.skip() {
        return;
    }
    let (inv_scale, clip) = c.grad_factor();
    let grad: Vec<f32> = g.iter().map(|&x| x * inv_scale * clip).collect();
    let t = f64::from(c.step) + 1.0;
    let lr = learning_rate(h, c.lr, t, rms(p));
    let beta2t = 1.0 - t.powf(h.decay_rate);
    let (keep, take) = (beta2t as f32, (1.0 - beta2t) as f32);
    let eps1 = h.eps1 as f32;
    let mut update: Vec<f32> = grad.iter().map(|&x| x * x + eps1).collect();
    match second {
        SecondMoment::Factored {
            rows,
            cols,
            row,
            col,
        } => {
            let per = rows * cols;
            for (b, u) in update.chunks_exact(per).enumerate() {
                let (row, col) = (
                    &mut row[b * rows..(b + 1) * rows],
                    &mut col[b * cols..(b + 1) * cols],
                );
                for (i, r) in row.iter_mut().enumerate() {
                    let u = &u[i * cols..(i + 1) * cols];
                    let mean = (block_sum(cols, |j| f64::from(u[j])) / cols as f64) as f32;
                    *r = *r * keep + take * mean;
                }
                // One column per device thread: its sum runs down the rows in order.
                for (j, cj) in col.iter_mut().enumerate() {
                    let sum: f64 = (0..rows).map(|i| f64::from(u[i * cols + j])).sum();
                    *cj = *cj * keep + take * (sum / rows as f64) as f32;
                }
            }
            // update = rsqrt(row / mean(row)) (x) rsqrt(col), times the gradient.
            for (b, u) in update.chunks_exact_mut(per).enumerate() {
                let row = &row[b * rows..(b + 1) * rows];
                let col = &col[b * cols..(b + 1) * cols];
                let row_mean = (block_sum(rows, |i| f64::from(row[i])) / rows as f64) as f32;
                let c_factor: Vec<f32> = col.iter().map(|&x| 1.0 / x.sqrt()).collect();
                let g = &grad[b * per..(b + 1) * per];
                for ((&r, u), g) in row
                    .iter()
                    .zip(u.chunks_exact_mut(cols))
                    .zip(g.chunks_exact(cols))
                {
                    let r_factor = 1.0 / (r / row_mean).sqrt();
                    for ((u, &c), &g) in u.iter_mut().zip(&c_factor).zip(g) {
                        *u = r_factor * c * g;
                    }
                }
            }
        }
        SecondMoment::Full(v) => {
            for ((u, v), &gr) in update.iter_mut().zip(v.iter_mut()).zip(&grad) {
                *v = *v * keep + take * *u;
                *u = (1.0 / v.sqrt()) * gr;
            }
        }
    }
    let denom = (rms(&update) / h.clip_threshold as f32).max(1.0);
    for u in &mut update {
        *u = *u / denom * lr;
    }
    let update = match (exp_avg, h.beta1) {
        (Some(m), Some(beta1)) => {
            let (b1, w1) = (beta1 as f32, (1.0 - beta1) as f32);
            for (m, u) in m.iter_mut().zip(update.iter_mut()) {
                *m = *m * b1 + w1 * *u;
                *u = *m;
            }
            update
        }
        _ => update,
    };
    if h.weight_decay != 0.0 {
        let alpha = -h.weight_decay as f32 * lr;
        for x in p.iter_mut() {
            *x += alpha * *x;
        }
    }
    for (x, u) in p.iter_mut().zip(&update) {
        *x += -u;
    }
}

/// transformers' `_get_lr`: the relative step `min(1e-2, 1/sqrt(t))` (`min(1e-6 t, ..)` with
/// warm-up) or the given rate, times `max(eps2, rms(p))` when scaling by the parameter.
fn learning_rate(h: &AdafactorHparams, lr: f32, t: f64, rms_p: f32) -> f32 {
    let step = if h.relative_step {
        let min_step = if h.warmup_init { 1e-6 * t } else { 1e-2 };
        min_step.min(1.0 / t.sqrt())
    } else {
        f64::from(lr)
    };
    if h.scale_parameter {
        // max(eps2, RMS) is a Python float when eps2 wins, an F32 tensor when the RMS does.
        if h.eps2 >= f64::from(rms_p) {
            (h.eps2 * step) as f32
        } else {
            rms_p * step as f32
        }
    } else {
        step as f32
    }
}

/// Threads of the kernels' reducing blocks.
const THREADS: usize = 256;
/// Elements per partial sum of the root mean squares.
const CHUNK: usize = 16_384;

/// `norm(x) / sqrt(numel)`: F64 partial sums of [`CHUNK`] elements ([`block_sum`]), added in
/// chunk order.
fn rms(x: &[f32]) -> f32 {
    let sum: f64 = x
        .chunks(CHUNK)
        .map(|c| block_sum(c.len(), |k| f64::from(c[k]) * f64::from(c[k])))
        .sum();
    (sum.sqrt() / (x.len() as f64).sqrt()) as f32
}

/// The sum of `term(0..len)` as one block of [`THREADS`] device threads forms it: thread `t`
/// adds the terms `t, t + THREADS, ..` in order, then `block_sum` in `kernels/common.cuh`
/// adds the threads' sums (a butterfly within each warp of 32, then one over the warps' sums).
fn block_sum(len: usize, term: impl Fn(usize) -> f64) -> f64 {
    let mut threads = [0.0f64; THREADS];
    for k in 0..len {
        threads[k % THREADS] += term(k);
    }
    let mut warps = [0.0f64; 32];
    for (w, lanes) in threads.chunks_exact(32).enumerate() {
        warps[w] = warp_sum(lanes);
    }
    warp_sum(&warps)
}

/// `warp_sum`: `v += shfl_xor(v, o)` for o = 16, 8, 4, 2, 1; every lane ends with the same sum.
fn warp_sum(lanes: &[f64]) -> f64 {
    let mut v = [0.0f64; 32];
    v.copy_from_slice(lanes);
    for o in [16, 8, 4, 2, 1] {
        let before = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = before[l] + before[l ^ o];
        }
    }
    v[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' defaults with a given learning rate.
    fn plain() -> AdafactorHparams {
        AdafactorHparams::defaults(false)
    }

    fn control(lr: f32) -> Control {
        Control {
            lr,
            step: 0.0,
            scale: 1.0,
            grad_norm: 1.0,
            max_grad_norm: 0.0,
        }
    }

    /// At t = 1, beta2t = 0: the second moment is the squared gradient itself, so the update
    /// is sign(g) (full) and its RMS is 1, under the clip threshold: p moves by lr.
    #[test]
    fn first_full_step_moves_by_lr_times_sign() {
        let (mut p, mut v) = (vec![1.0f32, 1.0], vec![0.0f32; 2]);
        adafactor(
            &plain(),
            control(0.1),
            &mut p,
            &[3.0, -0.5],
            None,
            SecondMoment::Full(&mut v),
        );
        assert_eq!(p, vec![0.9, 1.1]);
        assert_eq!(v, vec![9.0, 0.25]);
    }

    /// A rank-1 gradient matrix is reproduced exactly by its row and column statistics.
    #[test]
    fn factored_statistics_of_a_rank_one_square() {
        let g = [1.0f32, 2.0, 2.0, 4.0]; // [1, 2]^T [1, 2]
        let (mut p, mut row, mut col) = (vec![0.0f32; 4], vec![0.0f32; 2], vec![0.0f32; 2]);
        let h = AdafactorHparams {
            clip_threshold: 1e9,
            ..plain()
        };
        adafactor(
            &h,
            control(1.0),
            &mut p,
            &g,
            None,
            SecondMoment::Factored {
                rows: 2,
                cols: 2,
                row: &mut row,
                col: &mut col,
            },
        );
        assert_eq!(row, vec![2.5, 10.0]);
        assert_eq!(col, vec![2.5, 10.0]);
        for (x, gi) in p.iter().zip(g) {
            assert!((x + gi.signum()).abs() < 1e-6, "{p:?}");
        }
    }

    #[test]
    fn relative_step_ignores_the_given_rate() {
        let h = AdafactorHparams {
            relative_step: true,
            scale_parameter: true,
            ..plain()
        };
        // rms(p) = 2 > eps2: 2 * min(1e-2, 1/sqrt(1)).
        assert_eq!(learning_rate(&h, 5.0, 1.0, 2.0), 0.02);
        // t = 10^6: 1/sqrt(t) = 1e-3; rms under eps2: eps2 * 1e-3.
        assert_eq!(learning_rate(&h, 5.0, 1e6, 1e-4), 1e-6);
    }
}
