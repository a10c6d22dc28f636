//! 8-bit AdamW (bitsandbytes' `AdamW8bit`): moments stored as block-wise quantized codes
//! ([`castor_ir::quant`]), dequantized, updated in F32 and quantized again, block by block.
//!
//! The update follows bitsandbytes' CPU implementation operation by operation (F32
//! arithmetic, hyperparameter scalars formed in F64 and used as F32, the moments' `add` and
//! `addcmul` as the fused multiply-adds ATen's vectorized kernels compute), so from the same
//! state a step forms the same moments and block maxima as bitsandbytes. Codes are the
//! nearest ones (bitsandbytes' table-driven search misses the nearest for about one value in
//! a hundred), and masters agree to the last bit but where torch's vectorized square root
//! is not correctly rounded. The CUDA kernel (`adamw8bit.cu`) is its twin.

use super::optimizer::Control;
use castor_ir::quant::{dequantize_block, quantize_block, CODES};
use castor_ir::AdamWHparams;
use rayon::prelude::*;

/// Blocks one worker updates at a time.
const BLOCKS_PER_TASK: usize = 64;

/// One quantized moment: its codes and the absolute maximum of each block.
pub struct Quantized<'a> {
    pub codes: &'a mut [u8],
    pub absmax: &'a mut [f32],
}

/// One 8-bit AdamW step in place, over quantization blocks of `block` values. `maps` holds
/// the signed then the unsigned code map. Does nothing when the step is skipped.
#[allow(clippy::too_many_arguments)]
pub fn adamw8bit(
    h: &AdamWHparams,
    block: usize,
    c: Control,
    maps: &[f32],
    p: &mut [f32],
    g: &[f32],
    m: Quantized,
    v: Quantized,
) {
    if c.skip() {
        return;
    }
    let (inv_scale, clip) = c.grad_factor();
    let t = f64::from(c.step) + 1.0;
    let lr = f64::from(c.lr);
    let s = Scalars {
        inv_scale,
        clip,
        b1: h.beta1 as f32,
        w1: (1.0 - h.beta1) as f32,
        b2: h.beta2 as f32,
        w2: (1.0 - h.beta2) as f32,
        bias2_sqrt: (1.0 - h.beta2.powf(t)).sqrt() as f32,
        eps: h.eps as f32,
        decay: (h.weight_decay > 0.0).then_some((1.0 - lr * h.weight_decay) as f32),
        neg_step: (-lr / (1.0 - h.beta1.powf(t))) as f32,
    };
    let (signed, unsigned) = maps.split_at(CODES);
    let span = block * BLOCKS_PER_TASK;
    p.par_chunks_mut(span)
        .zip(g.par_chunks(span))
        .zip(
            m.codes
                .par_chunks_mut(span)
                .zip(v.codes.par_chunks_mut(span)),
        )
        .zip(
            m.absmax
                .par_chunks_mut(BLOCKS_PER_TASK)
                .zip(v.absmax.par_chunks_mut(BLOCKS_PER_TASK)),
        )
        .for_each(|(((p, g), (mq, vq)), (ma, va))| {
            let mut mf = vec![0f32; block];
            let mut vf = vec![0f32; block];
            for (k, (ma, va)) in ma.iter_mut().zip(va.iter_mut()).enumerate() {
                let at = k * block..((k + 1) * block).min(p.len());
                let n = at.len();
                let (mf, vf) = (&mut mf[..n], &mut vf[..n]);
                dequantize_block(signed, &mq[at.clone()], *ma, mf);
                dequantize_block(unsigned, &vq[at.clone()], *va, vf);
                let (p, g) = (&mut p[at.clone()], &g[at.clone()]);
                for i in 0..n {
                    s.update(&mut p[i], g[i], &mut mf[i], &mut vf[i]);
                }
                *ma = quantize_block(signed, mf, &mut mq[at.clone()]);
                *va = quantize_block(unsigned, vf, &mut vq[at]);
            }
        });
}

/// The per-step F32 scalars of one update.
struct Scalars {
    inv_scale: f32,
    clip: f32,
    b1: f32,
    w1: f32,
    b2: f32,
    w2: f32,
    bias2_sqrt: f32,
    eps: f32,
    decay: Option<f32>,
    neg_step: f32,
}

impl Scalars {
    /// One element, in bitsandbytes' order:
    /// `m = fma(g, 1-b1, m*b1)`, `v = fma((1-b2)*g, g, v*b2)`, `denom = sqrt(v)/sqrt(1-b2^t) + eps`,
    /// `p *= 1 - lr*wd` (when wd > 0), `p += (-lr/(1-b1^t)) * m / denom`.
    #[inline]
    fn update(&self, p: &mut f32, g: f32, m: &mut f32, v: &mut f32) {
        let grad = g * self.inv_scale * self.clip;
        *m = grad.mul_add(self.w1, *m * self.b1);
        *v = (self.w2 * grad).mul_add(grad, *v * self.b2);
        let denom = v.sqrt() / self.bias2_sqrt + self.eps;
        if let Some(d) = self.decay {
            *p *= d;
        }
        *p += self.neg_step * *m / denom;
    }
}
