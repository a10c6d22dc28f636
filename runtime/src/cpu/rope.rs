//! Rotary position embedding, rotate-half layout, in place.
//!
//! The angles are computed exactly as HF's `LlamaRotaryEmbedding` does in F32:
//! `inv_freq[i] = 1 / theta^(2i / D)` (the power in F32, `theta` rounded to F32 first),
//! rescaled as the op's `rope_scaling` says ([`castor_ir::rope_inv_freq`]),
//! `angle = pos * inv_freq[i]` with the position as F32, and `cos`/`sin` of that in F32. HF then
//! casts `cos`/`sin` to the activation dtype and rounds after each multiply and add; here the
//! rotation is computed in F32 from F32 `cos`/`sin` and rounded once, where the graph stores
//! the result.

use super::par::for_each_block;
use castor_ir::RopeScaling;

/// Rotates `x` of shape `[.., t, d]` (`d` even) at positions `0..t` along the `t` axis:
/// `out[i] = x[i] cos - x[i + d/2] sin`, `out[i + d/2] = x[i + d/2] cos + x[i] sin`.
pub fn rope(x: &mut [f32], t: usize, d: usize, theta: f64, scaling: RopeScaling) {
    let half = d / 2;
    let table = rope_table(t, d, theta, scaling);
    for_each_block(x, d, d, |r, row| {
        let pos = r % t;
        let cs = &table[pos * half..(pos + 1) * half];
        let (lo, hi) = row.split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
            let (x1, x2) = (*a, *b);
            *a = x1 * c - x2 * s;
            *b = x2 * c + x1 * s;
        }
    });
}

/// The transpose of [`rope`], in place: rotation of `dy` by the negated angles (the same F32
/// `cos`/`sin`), `dx[i] = dy[i] cos + dy[i + d/2] sin`, `dx[i + d/2] = dy[i + d/2] cos - dy[i] sin`.
pub fn rope_grad(dy: &mut [f32], t: usize, d: usize, theta: f64, scaling: RopeScaling) {
    let half = d / 2;
    let table = rope_table(t, d, theta, scaling);
    for_each_block(dy, d, d, |r, row| {
        let pos = r % t;
        let cs = &table[pos * half..(pos + 1) * half];
        let (lo, hi) = row.split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
            let (g1, g2) = (*a, *b);
            *a = g1 * c + g2 * s;
            *b = g2 * c - g1 * s;
        }
    });
}

/// `(cos, sin)` per position and frequency, `[t, d/2]`, as HF computes them in F32.
pub(crate) fn rope_table(t: usize, d: usize, theta: f64, scaling: RopeScaling) -> Vec<(f32, f32)> {
    let inv_freq = castor_ir::rope_inv_freq(d, theta, scaling);
    (0..t)
        .flat_map(|pos| {
            inv_freq.iter().map(move |&f| {
                let angle = pos as f32 * f;
                (angle.cos(), angle.sin())
            })
        })
        .collect()
}
