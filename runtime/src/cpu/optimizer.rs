//! The training-step ops: global gradient norm, fused AdamW, SGD and Lion updates, the step
//! counter and the dynamic loss-scale update.
//!
//! The updates follow torch.optim's single-tensor implementations (and `lion-pytorch`'s)
//! operation by operation (F32 arithmetic on F32 buffers, hyperparameter scalars formed in
//! F64 and used as F32), so three steps agree with PyTorch to rounding. The CUDA kernels are
//! their twins.

use castor_ir::{AdamWHparams, LionHparams, SgdHparams};
use rayon::prelude::*;

/// Elements per partial sum of the gradient norm: fixed, so the sum does not depend on the
/// number of threads.
const NORM_BLOCK: usize = 1 << 14;

/// `sqrt(sum((g * inv_scale)^2))` over every gradient, accumulated in F64 in a fixed order.
/// Inf or NaN when any gradient is.
pub fn grad_norm(grads: &[&[f32]], scale: f32) -> f32 {
    let inv = f64::from(1.0 / scale);
    let mut total = 0.0f64;
    for g in grads {
        let partials: Vec<f64> = g
            .par_chunks(NORM_BLOCK)
            .map(|block| {
                block
                    .iter()
                    .map(|&x| {
                        let u = f64::from(x) * inv;
                        u * u
                    })
                    .sum::<f64>()
            })
            .collect();
        total += partials.iter().sum::<f64>();
    }
    total.sqrt() as f32
}

/// The per-step scalars every optimizer op reads.
#[derive(Clone, Copy, Debug)]
pub struct Control {
    pub lr: f32,
    /// Optimizer steps taken before this one.
    pub step: f32,
    pub scale: f32,
    pub grad_norm: f32,
    /// The op's gradient-clipping threshold (`clip_grad_norm_`'s max norm; 0 clips nothing).
    pub max_grad_norm: f64,
}

impl Control {
    /// True when the step is skipped: some gradient was inf or NaN.
    pub fn skip(&self) -> bool {
        !self.grad_norm.is_finite()
    }

    /// What each raw gradient is multiplied by: the loss-scale inverse (in F32, as
    /// GradScaler's unscale does) and the clipping coefficient of `clip_grad_norm_`.
    pub(crate) fn grad_factor(&self) -> (f32, f32) {
        let inv_scale = 1.0f32 / self.scale;
        let clip = if self.max_grad_norm > 0.0 {
            let coef = self.max_grad_norm as f32 / (self.grad_norm + 1e-6);
            coef.min(1.0)
        } else {
            1.0
        };
        (inv_scale, clip)
    }
}

/// One AdamW step in place (torch.optim.AdamW, `_single_tensor_adamw`). Does nothing when the
/// step is skipped.
pub fn adamw(h: &AdamWHparams, c: Control, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    if c.skip() {
        return;
    }
    let (inv_scale, clip) = c.grad_factor();
    let t = f64::from(c.step) + 1.0;
    let lr = f64::from(c.lr);
    let decay = (1.0 - lr * h.weight_decay) as f32;
    let w1 = (1.0 - h.beta1) as f32;
    let (b2, w2) = (h.beta2 as f32, (1.0 - h.beta2) as f32);
    let bias1 = 1.0 - h.beta1.powf(t);
    let step_size = (lr / bias1) as f32;
    let bias2_sqrt = ((1.0 - h.beta2.powf(t)).sqrt()) as f32;
    let eps = h.eps as f32;
    p.par_chunks_mut(NORM_BLOCK)
        .zip(g.par_chunks(NORM_BLOCK))
        .zip(
            m.par_chunks_mut(NORM_BLOCK)
                .zip(v.par_chunks_mut(NORM_BLOCK)),
        )
        .for_each(|((p, g), (m, v))| {
            for i in 0..p.len() {
                let grad = g[i] * inv_scale * clip;
                p[i] *= decay;
                m[i] = lerp(m[i], grad, w1);
                v[i] = v[i] * b2 + w2 * grad * grad;
                let denom = v[i].sqrt() / bias2_sqrt + eps;
                p[i] += -step_size * (m[i] / denom);
            }
        });
}

/// `torch.lerp(a, b, w)` as ATen computes it on the CPU.
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

/// One SGD-with-momentum step in place (torch.optim.SGD, dampening 0, not Nesterov). The
/// momentum buffer starts at zero, so the first step stores the gradient itself, as torch
/// does. Does nothing when the step is skipped.
pub fn sgd(h: &SgdHparams, c: Control, p: &mut [f32], g: &[f32], buf: &mut [f32]) {
    if c.skip() {
        return;
    }
    let (inv_scale, clip) = c.grad_factor();
    let (lr, wd, mom) = (c.lr, h.weight_decay as f32, h.momentum as f32);
    p.par_chunks_mut(NORM_BLOCK)
        .zip(g.par_chunks(NORM_BLOCK))
        .zip(buf.par_chunks_mut(NORM_BLOCK))
        .for_each(|((p, g), buf)| {
            for i in 0..p.len() {
                let mut grad = g[i] * inv_scale * clip;
                if wd != 0.0 {
                    grad += wd * p[i];
                }
                buf[i] = if mom != 0.0 {
                    buf[i] * mom + grad
                } else {
                    grad
                };
                p[i] += -lr * buf[i];
            }
        });
}

/// One Lion step in place, as `lion-pytorch` computes it: the decoupled decay `p *= 1 - lr
/// wd`, then `p -= lr sign(beta1 m + (1 - beta1) g)` and `m = beta2 m + (1 - beta2) g`, each
/// product rounded before its sum (no fused multiply-add, as the CUDA twin). The moment starts
/// at zero, so the first update is the gradient's sign. Does nothing when the step is
/// skipped.
pub fn lion(h: &LionHparams, c: Control, p: &mut [f32], g: &[f32], m: &mut [f32]) {
    if c.skip() {
        return;
    }
    let (inv_scale, clip) = c.grad_factor();
    let lr = c.lr;
    // Formed in F64 as Python forms `1. - lr * wd`, used as F32.
    let decay = (1.0 - f64::from(lr) * h.weight_decay) as f32;
    let (b1, b2) = (h.beta1 as f32, h.beta2 as f32);
    let (c1, c2) = ((1.0 - h.beta1) as f32, (1.0 - h.beta2) as f32);
    p.par_chunks_mut(NORM_BLOCK)
        .zip(g.par_chunks(NORM_BLOCK))
        .zip(m.par_chunks_mut(NORM_BLOCK))
        .for_each(|((p, g), m)| {
            for i in 0..p.len() {
                let grad = g[i] * inv_scale * clip;
                let p_decayed = p[i] * decay;
                let blend = m[i] * b1 + c1 * grad;
                p[i] = p_decayed - lr * sign(blend);
                m[i] = m[i] * b2 + c2 * grad;
            }
        });
}

/// `torch.sgn` of a float: -1, 0 or 1 (NaN stays NaN).
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

/// The step count after this step: unchanged when it was skipped.
pub fn count_step(step: f32, grad_norm: f32) -> f32 {
    if grad_norm.is_finite() {
        step + 1.0
    } else {
        step
    }
}

/// Dynamic loss-scaling rules (see `castor_ir::Op::LossScaleUpdate`).
#[derive(Clone, Copy, Debug)]
pub struct LossScaler {
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
    pub hysteresis: usize,
    pub max_scale: f64,
}

/// The scale and counters `(clean steps, overflows still tolerated)` after a step whose
/// gradient norm was `grad_norm`.
pub fn loss_scale_update(
    h: &LossScaler,
    scale: f32,
    counters: [f32; 2],
    grad_norm: f32,
) -> (f32, [f32; 2]) {
    let [clean, tolerated] = counters;
    if !grad_norm.is_finite() {
        // GradScaler backs off on every overflow; with hysteresis H the first H - 1
        // overflows since the last growth only use up the tolerance (DeepSpeed).
        if tolerated <= 1.0 {
            (
                (f64::from(scale) * h.backoff_factor) as f32,
                [0.0, tolerated],
            )
        } else {
            (scale, [0.0, tolerated - 1.0])
        }
    } else if clean + 1.0 >= h.growth_interval as f32 {
        let grown = f64::from(scale) * h.growth_factor;
        // Growth stops at the maximum; a scale that starts above it only backs off.
        let capped = grown.min(h.max_scale.max(f64::from(scale)));
        (capped as f32, [0.0, h.hysteresis as f32])
    } else {
        (scale, [clean + 1.0, tolerated])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(interval: usize, hysteresis: usize) -> LossScaler {
        LossScaler {
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: interval,
            hysteresis,
            max_scale: 16777216.0,
        }
    }

    #[test]
    fn grad_scaler_rules() {
        let h = scaler(3, 1);
        let (s, c) = loss_scale_update(&h, 1024.0, [0.0, 1.0], f32::INFINITY);
        assert_eq!((s, c), (512.0, [0.0, 1.0]));
        let (s, c) = loss_scale_update(&h, s, c, 1.0);
        let (s, c) = loss_scale_update(&h, s, c, 1.0);
        assert_eq!((s, c), (512.0, [2.0, 1.0]));
        let (s, c) = loss_scale_update(&h, s, c, 1.0);
        assert_eq!((s, c), (1024.0, [0.0, 1.0]));
        let (s, _) = loss_scale_update(&h, 16777216.0, [2.0, 1.0], 1.0);
        assert_eq!(s, 16777216.0, "growth stops at the maximum");
    }

    #[test]
    fn hysteresis_tolerates_overflows_until_growth() {
        let h = scaler(2, 2);
        let (s, c) = loss_scale_update(&h, 1024.0, [0.0, 2.0], f32::NAN);
        assert_eq!((s, c), (1024.0, [0.0, 1.0]));
        let (s, c) = loss_scale_update(&h, s, c, f32::NAN);
        assert_eq!((s, c), (512.0, [0.0, 1.0]));
        let (s, c) = loss_scale_update(&h, s, c, f32::NAN);
        assert_eq!(s, 256.0);
        let (s, c) = loss_scale_update(&h, s, c, 1.0);
        let (s, c) = loss_scale_update(&h, s, c, 1.0);
        assert_eq!((s, c), (512.0, [0.0, 2.0]));
    }

    #[test]
    fn skipped_steps_change_nothing() {
        let c = Control {
            lr: 0.1,
            step: 0.0,
            scale: 1.0,
            grad_norm: f32::INFINITY,
            max_grad_norm: 0.0,
        };
        let h = AdamWHparams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let (mut p, mut m, mut v) = (vec![1.0f32; 3], vec![0.0f32; 3], vec![0.0f32; 3]);
        adamw(&h, c, &mut p, &[f32::INFINITY; 3], &mut m, &mut v);
        assert_eq!(p, vec![1.0; 3]);
        assert_eq!(count_step(4.0, f32::NAN), 4.0);
        assert!(grad_norm(&[&[1.0, f32::NAN]], 1.0).is_nan());
    }

    #[test]
    fn first_adamw_step_moves_by_lr() {
        // With bias correction the first step is lr * g / (|g| + eps') = lr * sign(g).
        let c = Control {
            lr: 0.1,
            step: 0.0,
            scale: 4.0,
            grad_norm: 1.0,
            max_grad_norm: 0.0,
        };
        let h = AdamWHparams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let (mut p, mut m, mut v) = (vec![1.0f32, 1.0], vec![0.0f32; 2], vec![0.0f32; 2]);
        adamw(&h, c, &mut p, &[8.0, -8.0], &mut m, &mut v);
        assert!(
            (p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6,
            "{p:?}"
        );
        assert_eq!(m, vec![0.2, -0.2], "the gradient was unscaled by 1/4 first");
        assert_eq!(grad_norm(&[&[3.0], &[4.0]], 5.0), 1.0);
    }
}
