//! Host tensors: the values that bind a graph's inputs and parameters and that executors
//! return.

use crate::fp8::{Fp8Format, Overflow};
use crate::{DType, Shape, TensorType};
use half::{bf16, f16};

/// Element storage. Float tensors of every float dtype hold `f32` values that are exactly
/// representable in their dtype (an F16 tensor holds F16 values widened to F32, an FP8 tensor
/// its decoded bytes), so arithmetic is always F32 and rounding happens only where a value is
/// stored. I32 and I64 share `I64`.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
    U8(Vec<u8>),
}

/// A tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    ty: TensorType,
    data: TensorData,
}

/// Rounds an F32 value to the nearest value of `dtype` (round-to-nearest-even, as CUDA's
/// `__float2half_rn` and `__float2bfloat16_rn`); identity for F32.
///
/// The FP8 dtypes round *saturating* ([`Fp8Format::round_saturating`]): finite overflow and
/// infinities become ±max (448 for E4M3, 57344 for E5M2), NaN stays NaN. That is the
/// conversion of FP8 training (torchao clamps to ±max before casting; cuBLASLt and CUDA's
/// `__NV_SATFINITE` saturate), so one overflowing value never makes a tensor infinite.
#[inline]
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F8E4M3 => Fp8Format::E4M3.round_saturating(x),
        DType::F8E5M2 => Fp8Format::E5M2.round_saturating(x),
        _ => x,
    }
}

/// Rounds every value of `data` to `dtype` in place, exactly as [`round_to`] does one value:
/// BF16 by the round-to-nearest-even bit trick (a loop the compiler vectorizes), F16 through
/// `half`'s slice conversion (F16C instructions where the CPU has them), FP8 saturating.
pub fn round_slice(dtype: DType, data: &mut [f32]) {
    match dtype {
        DType::F8E4M3 | DType::F8E5M2 => {
            for x in data.iter_mut() {
                *x = round_to(dtype, *x);
            }
        }
        DType::BF16 => {
            for x in data.iter_mut() {
                let b = x.to_bits();
                let r = if x.is_nan() {
                    b | 0x0040_0000
                } else {
                    b.wrapping_add(0x7FFF + ((b >> 16) & 1))
                };
                *x = f32::from_bits(r & 0xFFFF_0000);
            }
        }
        DType::F16 => {
            use half::slice::HalfFloatSliceExt;
            let mut buf = [f16::ZERO; 1024];
            for chunk in data.chunks_mut(buf.len()) {
                let halves = &mut buf[..chunk.len()];
                halves.convert_from_f32_slice(chunk);
                halves.convert_to_f32_slice(chunk);
            }
        }
        _ => {}
    }
}

impl Tensor {
    /// A float tensor of `dtype`; values are rounded to it. Panics if the length is wrong or
    /// `dtype` is not a float type: callers build tensors of shapes they computed.
    pub fn from_f32(dtype: DType, shape: impl Into<Shape>, mut data: Vec<f32>) -> Tensor {
        let shape = shape.into();
        assert!(
            dtype.is_float(),
            "from_f32 needs a float dtype, got {dtype}"
        );
        assert_eq!(
            shape.numel(),
            Some(data.len()),
            "data length does not match {shape}"
        );
        round_slice(dtype, &mut data);
        Tensor {
            ty: TensorType::new(dtype, shape),
            data: TensorData::F32(data),
        }
    }

    /// An FP8 tensor from its stored bytes, decoded exactly (E5M2's infinities and NaNs are
    /// kept as they are: nothing is rounded). Panics if the length is wrong or `dtype` is not
    /// an FP8 type, as [`Tensor::from_f32`] does.
    pub fn from_fp8_bytes(dtype: DType, shape: impl Into<Shape>, bytes: &[u8]) -> Tensor {
        let shape = shape.into();
        let Some(format) = Fp8Format::of(dtype) else {
            panic!("from_fp8_bytes needs an FP8 dtype, got {dtype}");
        };
        assert_eq!(
            shape.numel(),
            Some(bytes.len()),
            "data length does not match {shape}"
        );
        Tensor {
            ty: TensorType::new(dtype, shape),
            data: TensorData::F32(bytes.iter().map(|&b| format.decode(b)).collect()),
        }
    }

    /// The bytes of an FP8 tensor, or `None` for any other dtype. Its values are values of its
    /// format, so each encodes exactly (E5M2's infinities to infinity bytes, which is why this
    /// does not saturate); NaN is written as `0x7F | sign`.
    pub fn fp8_bytes(&self) -> Option<Vec<u8>> {
        let format = Fp8Format::of(self.dtype())?;
        let values = self.as_f32()?;
        Some(
            values
                .iter()
                .map(|&x| format.encode(x, Overflow::NonFinite))
                .collect(),
        )
    }

    /// A tensor of `dtype` holding `data` as it is, not rounded: values already of `dtype`
    /// that are moved rather than computed (layout ops), so each stays exactly what it was (an
    /// E5M2 infinity is not saturated again, as [`round_to`] would). `None` if the storage
    /// does not hold `dtype` (F32 for floats, I64 for integers) or the length is wrong.
    pub fn from_stored(dtype: DType, shape: impl Into<Shape>, data: TensorData) -> Option<Tensor> {
        let shape = shape.into();
        let (len, fits) = match &data {
            TensorData::F32(v) => (v.len(), dtype.is_float()),
            TensorData::I64(v) => (v.len(), dtype.is_int()),
            TensorData::Bool(v) => (v.len(), dtype == DType::Bool),
            TensorData::U8(v) => (v.len(), dtype == DType::U8),
        };
        (fits && shape.numel() == Some(len)).then(|| Tensor {
            ty: TensorType::new(dtype, shape),
            data,
        })
    }

    /// An integer tensor (I32 or I64).
    pub fn from_i64(dtype: DType, shape: impl Into<Shape>, data: Vec<i64>) -> Tensor {
        let shape = shape.into();
        assert!(
            dtype.is_int(),
            "from_i64 needs an integer dtype, got {dtype}"
        );
        assert_eq!(
            shape.numel(),
            Some(data.len()),
            "data length does not match {shape}"
        );
        Tensor {
            ty: TensorType::new(dtype, shape),
            data: TensorData::I64(data),
        }
    }

    pub fn from_bool(shape: impl Into<Shape>, data: Vec<bool>) -> Tensor {
        let shape = shape.into();
        assert_eq!(
            shape.numel(),
            Some(data.len()),
            "data length does not match {shape}"
        );
        Tensor {
            ty: TensorType::new(DType::Bool, shape),
            data: TensorData::Bool(data),
        }
    }

    /// A byte tensor (U8: quantized codes).
    pub fn from_u8(shape: impl Into<Shape>, data: Vec<u8>) -> Tensor {
        let shape = shape.into();
        assert_eq!(
            shape.numel(),
            Some(data.len()),
            "data length does not match {shape}"
        );
        Tensor {
            ty: TensorType::new(DType::U8, shape),
            data: TensorData::U8(data),
        }
    }

    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }

    pub fn shape(&self) -> &Shape {
        &self.ty.shape
    }

    pub fn numel(&self) -> usize {
        match &self.data {
            TensorData::F32(v) => v.len(),
            TensorData::I64(v) => v.len(),
            TensorData::Bool(v) => v.len(),
            TensorData::U8(v) => v.len(),
        }
    }

    pub fn data(&self) -> &TensorData {
        &self.data
    }

    pub fn into_data(self) -> TensorData {
        self.data
    }

    /// The values of a float tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            TensorData::I64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<&[bool]> {
        match &self.data {
            TensorData::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_u8(&self) -> Option<&[u8]> {
        match &self.data {
            TensorData::U8(v) => Some(v),
            _ => None,
        }
    }

    /// The same data with another shape of equal element count.
    pub fn reshaped(mut self, shape: impl Into<Shape>) -> Tensor {
        let shape = shape.into();
        assert_eq!(
            shape.numel(),
            Some(self.numel()),
            "reshape changes element count"
        );
        self.ty.shape = shape;
        self
    }
}

/// Relative error ‖a − b‖ / ‖b‖ in F64, the measure every comparison with a reference uses.
/// Returns 0 when both are zero and infinity when only `b` is.
pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "relative_error needs equal lengths");
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = x as f64 - y as f64;
        num += d * d;
        den += (y as f64) * (y as f64);
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

#[cfg(test)]
mod round_tests {
    use super::*;

    /// The slice rounding is `round_to`, value by value, on the values that matter: ties,
    /// subnormals, overflow to infinity, signed zeros, infinities.
    #[test]
    fn round_slice_matches_round_to() {
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65519.0,
            65520.0,
            1e-8,
            -6e-8,
            3e-39,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            // BF16 ties: to even (down), to even (up), and past the largest finite value.
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x7F7F_8000),
        ];
        let mut state = 0x1234_5678_9abc_def0u64;
        for _ in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            values.push(f32::from_bits((state >> 32) as u32));
        }
        for dtype in [DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2] {
            let mut got = values.clone();
            round_slice(dtype, &mut got);
            for (&x, &g) in values.iter().zip(&got) {
                let want = round_to(dtype, x);
                assert!(
                    want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan()),
                    "{dtype} {x:e} ({:#x}): {want:e} vs {g:e}",
                    x.to_bits()
                );
            }
        }
    }

    /// FP8 tensors hold decoded bytes and give the same bytes back (NaNs as `0x7F | sign`);
    /// building one from F32 values rounds them saturating.
    #[test]
    fn fp8_tensors_round_trip_their_bytes() {
        use crate::fp8::Fp8Format;
        for format in Fp8Format::ALL {
            let bytes: Vec<u8> = (0..=255).collect();
            let t = Tensor::from_fp8_bytes(format.dtype(), [16, 16], &bytes);
            assert_eq!(t.dtype(), format.dtype());
            let back = t.fp8_bytes().unwrap();
            for (&b, &c) in bytes.iter().zip(&back) {
                if format.is_nan_byte(b) {
                    assert_eq!(c, (b & 0x80) | 0x7F, "{format} {b:#04x}");
                } else {
                    assert_eq!(c, b, "{format} {b:#04x}");
                }
            }
            let big = Tensor::from_f32(format.dtype(), [3], vec![1e6, f32::NEG_INFINITY, 0.3]);
            let max = format.max();
            let want = [max, -max, format.round_saturating(0.3)];
            assert_eq!(big.as_f32().unwrap(), want);
        }
        assert_eq!(
            Tensor::from_f32(DType::F32, [1], vec![1.0]).fp8_bytes(),
            None
        );
    }
}
