//! The two 8-bit float formats of FP8 training (OCP "8-bit Floating Point" 1.0, as NVIDIA's
//! Hopper and Blackwell tensor cores and PyTorch's `float8_e4m3fn` / `float8_e5m2` store
//! them): decoding a byte and encoding a value, exactly. This module is the formats' one
//! definition: the FP8 dtypes' rounding ([`crate::round_to`]), host tensors and checkpoints
//! use it.
//!
//! | format | bits (sign.exponent.mantissa) | bias | largest finite | smallest subnormal | infinities | NaN |
//! |---|---|---|---|---|---|---|
//! | [`Fp8Format::E4M3`] (`e4m3fn`) | 1.4.3 | 7 | 448 (`0x7E`) | 2^-9 | none | `S.1111.111` only |
//! | [`Fp8Format::E5M2`] | 1.5.2 | 15 | 57344 (`0x7B`) | 2^-16 | `S.11111.00` | `S.11111.{01,10,11}` |
//!
//! Training recipes (Transformer Engine, torchao's float8) keep forward operands in E4M3 (more
//! precision) and gradients in E5M2 (more range).
//!
//! Encoding rounds to nearest, ties to even, with exact subnormals; `-0` stays `-0`, and values
//! below half the smallest subnormal go to zero of their sign. What happens past the largest
//! finite value is the [`Overflow`] mode:
//!
//! - [`Overflow::Saturate`] gives ±max for finite overflow and for ±infinity, in both formats.
//!   It is the FP8 training recipes' conversion (torchao clamps `x * scale` to ±max before
//!   casting; Transformer Engine and cuBLASLt's FP8 outputs convert as CUDA's
//!   `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)` does), and it is what castor's executors
//!   store in an FP8 dtype: one overflowing value must not turn a tensor's amax, and with it
//!   the next step's scale, into NaN or infinity. It equals PyTorch's
//!   `x.float().clamp(-max, max).to(fp8)` byte for byte, and PyTorch 2.15's plain
//!   `.to(torch.float8_e4m3fn)`, which saturates since pytorch/pytorch#178817 (earlier
//!   releases gave NaN).
//! - [`Overflow::NonFinite`] is the OCP non-saturating conversion (CUDA's `__NV_NOSAT`): E4M3
//!   overflow and ±infinity give NaN, E5M2 overflow and ±infinity give ±infinity. It equals
//!   PyTorch's `.to(torch.float8_e5m2)` and ml_dtypes' `astype(float8_e4m3fn)` byte for byte.
//!
//! "Overflow" is decided after rounding: E4M3 values up to 464 (the midpoint between 448 and
//! the next step, 480, a tie that rounds to 448's even mantissa) give 448; E5M2 values below
//! 61440 give 57344, and 61440 itself (a tie towards the odd mantissa of 57344) overflows.
//!
//! NaN encodes as `0x7F | sign` in both formats and both modes, as PyTorch writes it (ml_dtypes
//! and CUDA write E5M2's NaN as `0x7E | sign`; every `S.11111.{01,10,11}` byte is a NaN).
//! Decoding gives PyTorch's `.float()` bits: E4M3's NaN is `sign | 0x7FF0_0000`, E5M2's NaNs
//! are F16 NaNs widened to F32 and quieted (`sign | 0x7FC0_0000 | mantissa << 21`).
//!
//! `tests/fp8.rs` holds these conversions to PyTorch's and ml_dtypes' bytes for every BF16 bit
//! pattern, ten thousand F32 values and all 256 bytes (`tests/fixtures/generate_fp8.py`).

use crate::DType;
use half::{bf16, f16};
use std::fmt;

/// One of the two FP8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, bias 7, finite only (OCP E4M3, `e4m3fn`).
    E4M3,
    /// 5 exponent bits, 2 mantissa bits, bias 15, with infinities (OCP E5M2).
    E5M2,
}

/// What an encoding does with a value beyond the largest finite one (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// ±max for finite overflow and ±infinity (`__NV_SATFINITE`; the training recipes).
    Saturate,
    /// NaN (E4M3) or ±infinity (E5M2) for finite overflow and ±infinity (`__NV_NOSAT`).
    NonFinite,
}

/// The byte of NaN (with the sign bit clear) that encoding writes, in both formats.
pub const NAN_BYTE: u8 = 0x7F;

/// `2^k` for `k` in F32's normal exponent range.
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

impl Fp8Format {
    pub const ALL: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// The format an FP8 dtype stores, or `None` for every other dtype.
    pub fn of(dtype: DType) -> Option<Fp8Format> {
        match dtype {
            DType::F8E4M3 => Some(Fp8Format::E4M3),
            DType::F8E5M2 => Some(Fp8Format::E5M2),
            _ => None,
        }
    }

    /// The IR dtype of values stored in this format.
    pub fn dtype(self) -> DType {
        match self {
            Fp8Format::E4M3 => DType::F8E4M3,
            Fp8Format::E5M2 => DType::F8E5M2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }

    /// Explicit mantissa bits: 3 or 2.
    pub fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// The exponent bias: 7 or 15.
    pub fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// The exponent of the smallest normal value, `1 - bias`: -6 or -14.
    fn min_exponent(self) -> i32 {
        1 - self.bias()
    }

    /// The byte of the largest finite value, positive: `0x7E` (448) or `0x7B` (57344).
    pub fn max_byte(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }

    /// The largest finite value: 448 or 57344.
    pub fn max(self) -> f32 {
        self.decode(self.max_byte())
    }

    /// The smallest normal value: 2^-6 or 2^-14.
    pub fn min_normal(self) -> f32 {
        pow2(self.min_exponent())
    }

    /// The smallest subnormal value: 2^-9 or 2^-16.
    pub fn min_subnormal(self) -> f32 {
        pow2(self.min_exponent() - self.mantissa_bits() as i32)
    }

    /// Whether `byte` is a NaN of this format (`S.1111.111` for E4M3; `S.11111.xx` with a
    /// nonzero mantissa for E5M2).
    pub fn is_nan_byte(self, byte: u8) -> bool {
        match self {
            Fp8Format::E4M3 => byte & 0x7F == 0x7F,
            Fp8Format::E5M2 => byte & 0x7F > 0x7C,
        }
    }

    /// The value of `byte`, exactly (every FP8 value is an F32 value). NaN bytes decode to
    /// PyTorch's NaN bits (see the module docs).
    pub fn decode(self, byte: u8) -> f32 {
        let sign = u32::from(byte >> 7) << 31;
        let m = self.mantissa_bits();
        let exponent = u32::from(byte & 0x7F) >> m;
        let mantissa = u32::from(byte) & ((1 << m) - 1);
        match self {
            Fp8Format::E4M3 if byte & 0x7F == 0x7F => return f32::from_bits(sign | 0x7FF0_0000),
            Fp8Format::E5M2 if exponent == 0x1F => {
                let special = if mantissa == 0 {
                    0x7F80_0000
                } else {
                    0x7FC0_0000 | mantissa << 21
                };
                return f32::from_bits(sign | special);
            }
            _ => {}
        }
        let magnitude = if exponent == 0 {
            mantissa as f32 * self.min_subnormal()
        } else {
            (mantissa | 1 << m) as f32 * pow2(exponent as i32 - self.bias() - m as i32)
        };
        f32::from_bits(sign | magnitude.to_bits())
    }

    /// The byte nearest to `x` (ties to even), with overflow handled as `overflow` says.
    pub fn encode(self, x: f32, overflow: Overflow) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        if x.is_nan() {
            return sign | NAN_BYTE;
        }
        let overflowed = match (overflow, self) {
            (Overflow::Saturate, _) => self.max_byte(),
            (Overflow::NonFinite, Fp8Format::E4M3) => NAN_BYTE,
            (Overflow::NonFinite, Fp8Format::E5M2) => 0x7C,
        };
        if x.is_infinite() {
            return sign | overflowed;
        }
        // |x| = significand * 2^scale exactly; `exponent` is floor(log2 |x|) for normal F32
        // values, and below every FP8 exponent for F32 subnormals (which all round to zero).
        let biased = ((bits >> 23) & 0xFF) as i32;
        let fraction = bits & 0x007F_FFFF;
        let (significand, scale, exponent) = if biased == 0 {
            (fraction, -149, -127)
        } else {
            (fraction | 0x0080_0000, biased - 150, biased - 127)
        };
        let m = self.mantissa_bits();
        let emin = self.min_exponent();
        // The exponent of one unit in the last place of the FP8 values around |x|; F32 has
        // more mantissa bits, so `ulp - scale` is positive.
        let ulp = exponent.max(emin) - m as i32;
        // |x| in those units, rounded: for a normal value 2^m ..= 2^(m+1), the implicit bit
        // included (2^(m+1) is a carry onto the next binade's first value, which the code
        // below lands on).
        let steps = round_shift(significand, (ulp - scale) as u32);
        let code = if exponent < emin {
            steps
        } else {
            (((exponent - emin) as u64) << m) + steps
        };
        if code > u64::from(self.max_byte()) {
            sign | overflowed
        } else {
            sign | code as u8
        }
    }

    /// [`encode`](Self::encode) of a BF16 value (through its exact F32 value).
    pub fn encode_bf16(self, x: bf16, overflow: Overflow) -> u8 {
        self.encode(x.to_f32(), overflow)
    }

    /// [`encode`](Self::encode) of an F16 value (through its exact F32 value).
    pub fn encode_f16(self, x: f16, overflow: Overflow) -> u8 {
        self.encode(x.to_f32(), overflow)
    }

    /// `x` rounded to this format, saturating: the value of
    /// `encode(x, Overflow::Saturate)`. What castor stores in an FP8 dtype.
    pub fn round_saturating(self, x: f32) -> f32 {
        self.decode(self.encode(x, Overflow::Saturate))
    }
}

impl fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `value / 2^shift` rounded to the nearest integer, ties to even (`shift` > 0).
fn round_shift(value: u32, shift: u32) -> u64 {
    if shift >= 40 {
        // value < 2^32 is below half of 2^shift.
        return 0;
    }
    let value = u64::from(value);
    let kept = value >> shift;
    let rest = value & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    kept + u64::from(rest > half || (rest == half && kept & 1 == 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use Fp8Format::{E4M3, E5M2};
    use Overflow::{NonFinite, Saturate};

    /// Every value of a format, from the definition: (-1)^s 2^(e - bias) (1 + m / 2^M), or
    /// 2^(1 - bias) (m / 2^M) for e = 0, computed in F64.
    fn by_definition(f: Fp8Format, byte: u8) -> Option<f64> {
        let m_bits = f.mantissa_bits();
        let e = i32::from(byte & 0x7F) >> m_bits;
        let m = f64::from(byte & ((1 << m_bits) - 1));
        let frac = m / f64::from(1u32 << m_bits);
        let max_exp = (1 << (7 - m_bits)) - 1;
        if f.is_nan_byte(byte) || (f == E5M2 && e == max_exp) {
            return None;
        }
        let v = if e == 0 {
            2f64.powi(1 - f.bias()) * frac
        } else {
            2f64.powi(e - f.bias()) * (1.0 + frac)
        };
        Some(if byte & 0x80 != 0 { -v } else { v })
    }

    #[test]
    fn constants_are_the_formats() {
        assert_eq!(E4M3.max(), 448.0);
        assert_eq!(E5M2.max(), 57344.0);
        assert_eq!(E4M3.min_normal(), 2f32.powi(-6));
        assert_eq!(E5M2.min_normal(), 2f32.powi(-14));
        assert_eq!(E4M3.min_subnormal(), 2f32.powi(-9));
        assert_eq!(E5M2.min_subnormal(), 2f32.powi(-16));
        assert_eq!(Fp8Format::of(DType::F8E4M3), Some(E4M3));
        assert_eq!(Fp8Format::of(DType::BF16), None);
        for f in Fp8Format::ALL {
            assert_eq!(Fp8Format::of(f.dtype()), Some(f));
        }
        let nans = |f: Fp8Format| (0..=255u8).filter(|&b| f.is_nan_byte(b)).count();
        assert_eq!((nans(E4M3), nans(E5M2)), (2, 6));
    }

    #[test]
    fn decode_is_the_definition_and_encode_inverts_it() {
        for f in Fp8Format::ALL {
            for byte in 0..=255u8 {
                let x = f.decode(byte);
                match by_definition(f, byte) {
                    Some(v) => {
                        assert_eq!(f64::from(x), v, "{f} {byte:#04x}");
                        // Every value encodes back to its byte, in both modes.
                        assert_eq!(f.encode(x, Saturate), byte, "{f} {byte:#04x}");
                        assert_eq!(f.encode(x, NonFinite), byte, "{f} {byte:#04x}");
                    }
                    None if f.is_nan_byte(byte) => assert!(x.is_nan(), "{f} {byte:#04x}"),
                    None => assert_eq!(x.abs(), f32::INFINITY, "{f} {byte:#04x}"),
                }
                assert_eq!(x.is_sign_negative(), byte & 0x80 != 0, "{f} {byte:#04x}");
            }
        }
    }

    #[test]
    fn edges_round_as_the_formats_say() {
        let cases: &[(Fp8Format, f32, u8, u8)] = &[
            // (format, x, saturating byte, non-saturating byte)
            (E4M3, 0.0, 0x00, 0x00),
            (E4M3, -0.0, 0x80, 0x80),
            (E4M3, 464.0, 0x7E, 0x7E), // the tie above max rounds to even (448)
            (E4M3, 464.03125, 0x7E, 0x7F), // just past it overflows
            (E4M3, 1e9, 0x7E, 0x7F),
            (E4M3, -f32::INFINITY, 0xFE, 0xFF), // no infinities: -max or NaN
            (E4M3, 2f32.powi(-10), 0x00, 0x00), // half the smallest subnormal: ties to 0
            (E4M3, 3.0 * 2f32.powi(-10), 0x02, 0x02), // 1.5 subnormal steps: ties to even 2
            (E4M3, -1e-30, 0x80, 0x80),
            (E4M3, 0.0175, 0x09, 0x09), // 1.12 * 2^-6, between 1.0 and 1.125
            (E5M2, 61439.996, 0x7B, 0x7B), // just below the tie above max
            (E5M2, 61440.0, 0x7B, 0x7C), // the tie rounds to odd 57344's neighbour: overflow
            (E5M2, f32::INFINITY, 0x7B, 0x7C),
            (E5M2, -f32::INFINITY, 0xFB, 0xFC),
            (E5M2, 2f32.powi(-17), 0x00, 0x00),
            (E5M2, 2f32.powi(-17) * 1.0001, 0x01, 0x01),
            (E5M2, f32::from_bits(1), 0x00, 0x00), // F32 subnormals
            (E5M2, 1.125, 0x3C, 0x3C),             // tie between 1.0 and 1.25: even (1.0)
            (E5M2, 1.375, 0x3E, 0x3E),             // tie between 1.25 and 1.5: even (1.5)
        ];
        for &(f, x, sat, nosat) in cases {
            assert_eq!(f.encode(x, Saturate), sat, "{f} {x:e} saturating");
            assert_eq!(f.encode(x, NonFinite), nosat, "{f} {x:e} non-saturating");
        }
        for f in Fp8Format::ALL {
            for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001)] {
                let sign = if nan.is_sign_negative() { 0x80 } else { 0 };
                assert_eq!(f.encode(nan, Saturate), sign | NAN_BYTE);
                assert_eq!(f.encode(nan, NonFinite), sign | NAN_BYTE);
            }
            assert!(f.round_saturating(f32::NAN).is_nan());
            assert_eq!(f.round_saturating(f32::INFINITY), f.max());
            assert_eq!(f.round_saturating(-1e30), -f.max());
        }
    }

    /// Encoding is round to nearest, ties to even, against the sorted list of values: on every
    /// F32 value between consecutive FP8 values, at the midpoints and next to them.
    #[test]
    fn encode_is_nearest_even_everywhere() {
        for f in Fp8Format::ALL {
            let mut values: Vec<(f32, u8)> = (0..=f.max_byte()).map(|b| (f.decode(b), b)).collect();
            values.sort_by(|a, b| a.0.total_cmp(&b.0));
            for w in values.windows(2) {
                let ((lo, lb), (hi, hb)) = (w[0], w[1]);
                let mid = (lo + hi) / 2.0; // exact: FP8 values have few bits
                let even = if lb & 1 == 0 { lb } else { hb };
                assert_eq!(f.encode(mid, Saturate), even, "{f} tie {mid:e}");
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(f.encode(below, Saturate), lb, "{f} {below:e}");
                assert_eq!(f.encode(above, Saturate), hb, "{f} {above:e}");
                assert_eq!(f.encode(-above, NonFinite), 0x80 | hb, "{f} {above:e}");
                // A sweep of the F32 values strictly between lo and mid, every 997th.
                let mut b = lo.to_bits() + 1;
                while b < mid.to_bits() {
                    assert_eq!(f.encode(f32::from_bits(b), Saturate), lb);
                    b += 997;
                }
            }
        }
    }

    #[test]
    fn bf16_and_f16_encode_through_their_f32_values() {
        for f in Fp8Format::ALL {
            for bits in 0..=u16::MAX {
                for mode in [Saturate, NonFinite] {
                    let b = bf16::from_bits(bits);
                    assert_eq!(f.encode_bf16(b, mode), f.encode(b.to_f32(), mode));
                    let h = f16::from_bits(bits);
                    assert_eq!(f.encode_f16(h, mode), f.encode(h.to_f32(), mode));
                }
            }
        }
    }
}
