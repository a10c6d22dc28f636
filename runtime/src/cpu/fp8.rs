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
    let s = f64::from(format.max()) / f64::from(amax).max(AMAX_FLOOR);
    (s / 2f64.powi(margin.min(1024) as i32)) as f32
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
        assert_eq!(amax(&[-3.0, 2.0]), 3.0);
    }
}
