//! Scalar maths shared by the kernels.
//!
//! [`exp`] is written without branches or library calls so that loops over slices
//! auto-vectorize (the standard library's `expf` is a call per element, and softmax, GELU and
//! SiLU are dominated by it). The sums accumulate in F64 over eight independent lanes: more
//! accurate than one running F32 sum, and the lanes let the compiler vectorize. Everything
//! here is `#[inline(always)]` so that it is compiled into both copies of a
//! [`super::simd::multiversion!`] function rather than called at the baseline target.

/// `e^x` in F32 (Cephes `expf`): the argument is reduced to `r = x - n ln 2` with
/// `|r| <= ln 2 / 2`, `e^r` is a degree-7 polynomial, and `2^n` is applied in two halves so
/// results that are subnormal stay correct. Relative error is within 2 ulp; overflow gives
/// `inf`, large negative arguments give 0, NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer (to nearest, even) and leaves it in the low bits.
    const ROUNDER: f32 = 12_582_912.0;
    // Past 89, e^x overflows; below -110 it rounds to 0. Clamping keeps `n` in range.
    let xc = x.clamp(-110.0, 89.0);
    let t = xc * LOG2E + ROUNDER;
    let n = (t.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let nf = t - ROUNDER;
    let r = xc - nf * LN2_HI - nf * LN2_LO;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // Wrapping arithmetic: for NaN `n` is garbage, and the result is NaN through `y` anyway.
    let n1 = n >> 1;
    let n2 = n.wrapping_sub(n1);
    let s1 = f32::from_bits((n1.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((n2.wrapping_add(127) as u32) << 23);
    y * s1 * s2
}

/// `tanh(x)` as `1 - 2 / (e^{2x} + 1)`: vectorizes like [`exp`], with an absolute error of a
/// few 1e-8, which is what GELU needs (it adds the result to 1). Not for a standalone `tanh`,
/// whose small results need relative accuracy.
#[inline(always)]
pub fn tanh_abs(x: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * x) + 1.0)
}

const LANES: usize = 8;

/// `Σ f(x)` over `xs`, accumulated in F64 with independent lanes.
#[inline(always)]
pub fn sum_by(xs: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut acc = [0f64; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x);
        }
    }
    let mut tail = 0f64;
    for &x in chunks.remainder() {
        tail += f(x);
    }
    acc.iter().sum::<f64>() + tail
}

/// `Σ x`.
#[inline(always)]
pub fn sum(xs: &[f32]) -> f64 {
    sum_by(xs, f64::from)
}

/// `Σ x²`.
#[inline(always)]
pub fn sum_sq(xs: &[f32]) -> f64 {
    sum_by(xs, |x| f64::from(x) * f64::from(x))
}

/// `Σ (x - mean)²`.
#[inline(always)]
pub fn sum_sq_dev(xs: &[f32], mean: f64) -> f64 {
    sum_by(xs, |x| (f64::from(x) - mean) * (f64::from(x) - mean))
}

/// The largest element; NaN if any element is NaN (as PyTorch's `max`); `-inf` if empty.
#[inline(always)]
pub fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = max2(*a, x);
        }
    }
    let m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| max2(m, x));
    acc.iter().fold(m, |m, &x| max2(m, x))
}

/// The larger of two values, NaN if either is NaN.
#[inline(always)]
pub fn max2(a: f32, b: f32) -> f32 {
    if a > b || a.is_nan() {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        let mut worst = 0;
        let mut x = -104.0f32;
        while x < 88.7 {
            let want = (x as f64).exp() as f32;
            if want >= f32::MIN_POSITIVE {
                worst = worst.max(ulps(exp(x), want));
            }
            x += 0.000_731;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
    }

    #[test]
    fn exp_edge_cases() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        // Subnormal results keep their value.
        let want = (-95.0f64).exp() as f32;
        assert!(ulps(exp(-95.0), want) <= 2);
    }

    #[test]
    fn tanh_abs_error_is_small() {
        let mut x = -12.0f32;
        while x < 12.0 {
            assert!(
                (tanh_abs(x) as f64 - (x as f64).tanh()).abs() < 2e-7,
                "x={x}"
            );
            x += 0.001_3;
        }
    }

    #[test]
    fn sums_and_max() {
        let xs: Vec<f32> = (0..21).map(|i| i as f32 - 3.0).collect();
        assert_eq!(sum(&xs), (0..21).map(|i| i as f64 - 3.0).sum::<f64>());
        assert_eq!(sum_sq(&[1.0, 2.0, 3.0]), 14.0);
        assert_eq!(sum_sq_dev(&[1.0, 2.0, 3.0], 2.0), 2.0);
        assert_eq!(max(&xs), 17.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        let mut with_nan = xs.clone();
        with_nan[13] = f32::NAN;
        assert!(max(&with_nan).is_nan());
    }
}
