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

/// Rotates `x` of shape `dims` (`[.., t, d]`, `d` even), row `r` at position `positions[r]`
/// (one per row, flat over `[.., t]`; packed sequences' positions lie in `0..t`, and one
/// outside is clamped into it, as the CUDA kernels' table of `t` positions does), or `r % t`
/// (positions `0..t` along the `t` axis):
/// `out[i] = x[i] cos - x[i + d/2] sin`, `out[i + d/2] = x[i + d/2] cos + x[i] sin`.
pub fn rope(
    x: &mut [f32],
    dims: &[usize],
    positions: Option<&[i64]>,
    theta: f64,
    scaling: RopeScaling,
) {
    rotate(x, dims, positions, theta, scaling, 1.0);
}

/// The transpose of [`rope`], in place: rotation of `dy` by the negated angles (the same F32
/// `cos`/`sin`), `dx[i] = dy[i] cos + dy[i + d/2] sin`, `dx[i + d/2] = dy[i + d/2] cos - dy[i] sin`.
pub fn rope_grad(
    dy: &mut [f32],
    dims: &[usize],
    positions: Option<&[i64]>,
    theta: f64,
    scaling: RopeScaling,
) {
    rotate(dy, dims, positions, theta, scaling, -1.0);
}

/// Rotation by the angles (`sign` 1) or their negation (`sign` -1: `sin` negated).
fn rotate(
    x: &mut [f32],
    dims: &[usize],
    positions: Option<&[i64]>,
    theta: f64,
    scaling: RopeScaling,
    sign: f32,
) {
    let (t, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let half = d / 2;
    // Positions `0..t`: a position is data, so one outside (negative, or past the row) is
    // clamped into the table rather than sizing it.
    let table = rope_table(t, d, theta, scaling);
    let last = t.saturating_sub(1) as i64;
    for_each_block(x, d, d, |r, row| {
        let pos = positions.map_or(r % t, |p| p[r].clamp(0, last) as usize);
        let cs = &table[pos * half..][..half];
        let (a, b) = row.split_at_mut(half);
        for ((a, b), &(c, s)) in a.iter_mut().zip(b.iter_mut()).zip(cs) {
            let (x1, x2, s) = (*a, *b, sign * s);
            *a = x1 * c - x2 * s;
            *b = x2 * c + x1 * s;
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
