//! FP8 scaling and casts ([`castor_ir::fp8`] holds the formats): the scale of a tensor, and
//! the scaled, saturating cast with its amax.

use castor_ir::fp8::Fp8Format;

/// The smallest amax a scale is taken of (torchao's `EPS`): an all-zero tensor gets a large
/// finite scale rather than an infinite one.
const AMAX_FLOOR: f64 = 1e-12;

/// The largest magnitude in `x`; NaN if `x` holds one (as `torch.max(torch.abs(x))`), 0 for
/// an empty tensor.
pub fn amax(x: &[f32]) -> f32 {
    let mut m = 0.0f32;
    for &v in x {
        if v.is_nan() {
            return f32::NAN;
        }
        m = m.max(v.abs());
    }
    m
}

/// `fmax / max(amax, 1e-12) / 2^margin`, in F64 rounded to F32: torchao's `amax_to_scale`
/// (with Transformer Engine's margin).
pub fn scale(format: Fp8Format, amax: f32, margin: usize) -> f32 {
    ratio(format, f64::from(amax).max(AMAX_FLOOR), margin)
}

/// `fmax / amax / 2^margin` in F64, rounded once to F32: the F32 division correctly rounded
/// (F64 holds the quotient exactly enough), as Transformer Engine's `__fdiv_rn`.
fn ratio(format: Fp8Format, amax: f64, margin: usize) -> f32 {
    let s = f64::from(format.max()) / amax;
    (s / 2f64.powi(margin.min(1024) as i32)) as f32
}

/// One step of delayed scaling (Transformer Engine's max algorithm): the history with `amax`
/// entered first and the oldest amax dropped, and the scale its largest amax gives (F32's
/// largest value where that overflows), or `scale` unchanged when that amax is 0 or not
/// finite (NaN included): Transformer Engine's `_default_sf_compute`.
pub fn amax_history(
    format: Fp8Format,
    margin: usize,
    history: &[f32],
    scale: f32,
    amax: f32,
) -> (Vec<f32>, f32) {
    let mut next = Vec::with_capacity(history.len());
    if !history.is_empty() {
        next.push(amax);
        next.extend_from_slice(&history[..history.len() - 1]);
    }
    // torch.max: NaN wins.
    let largest = next.iter().fold(0.0f32, |m, &v| {
        if m.is_nan() || v.is_nan() {
            f32::NAN
        } else {
            m.max(v)
        }
    });
    let scale = if largest.is_finite() && largest > 0.0 {
        // No floor here (Transformer Engine's delayed scaling has none): an amax so small
        // that the scale overflows F32 gives F32's largest value.
        ratio(format, f64::from(largest), margin).min(f32::MAX)
    } else {
        scale
    };
    (next, scale)
}

/// `x · scale` in F32, rounded to `format` (nearest even, saturating): the values the FP8
/// tensor holds, as F32.
pub fn quantize(format: Fp8Format, x: &[f32], scale: f32) -> Vec<f32> {
    x.iter()
        .map(|&v| format.round_saturating(v * scale))
        .collect()
}

/// The factor a product of operands with scales `a` and `b` is multiplied by: the
/// reciprocals rounded to F32, then their product rounded to F32.
pub fn dequantization(a: f32, b: f32) -> f32 {
    (1.0 / a) * (1.0 / b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_maps_the_amax_to_the_largest_value() {
        assert_eq!(scale(Fp8Format::E4M3, 448.0, 0), 1.0);
        assert_eq!(scale(Fp8Format::E4M3, 2.0, 0), 224.0);
        assert_eq!(scale(Fp8Format::E5M2, 57344.0, 1), 0.5);
        // A zero tensor: the floor keeps the scale finite.
        assert_eq!(scale(Fp8Format::E4M3, 0.0, 0), (448.0f64 / 1e-12) as f32);
        let q = quantize(
            Fp8Format::E4M3,
            &[2.0, -1.0, 3.0],
            scale(Fp8Format::E4M3, 2.0, 0),
        );
        // 3 * 224 = 672 saturates at 448.
        assert_eq!(q, vec![448.0, -224.0, 448.0]);
        assert!(amax(&[1.0, f32::NAN]).is_nan());
        // Delayed scaling: newest first, the oldest leaves; the largest amax gives the scale.
        let (h, s) = amax_history(Fp8Format::E4M3, 0, &[4.0, 8.0, 2.0], 1.0, 1.0);
        assert_eq!((h, s), (vec![1.0, 4.0, 8.0], 56.0));
        // A zero or non-finite history keeps the scale.
        assert_eq!(amax_history(Fp8Format::E5M2, 0, &[0.0], 3.0, 0.0).1, 3.0);
        let (h, s) = amax_history(Fp8Format::E4M3, 0, &[2.0, 1.0], 5.0, f32::NAN);
        assert!(h[0].is_nan());
        assert_eq!(s, 5.0);
        assert_eq!(
            amax_history(Fp8Format::E4M3, 0, &[f32::INFINITY, 0.0], 5.0, 1.0).1,
            5.0
        );
        assert_eq!(
            amax_history(Fp8Format::E4M3, 0, &[f32::INFINITY], 5.0, 1.0).1,
            448.0
        );
        let tiny = f32::from_bits(1);
        assert_eq!(
            amax_history(Fp8Format::E4M3, 0, &[0.0], 5.0, tiny).1,
            f32::MAX
        );
        assert_eq!(amax(&[-3.0, 2.0]), 3.0);
    }
}
