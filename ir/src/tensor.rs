//! Host tensors: the values that bind a graph's inputs and parameters and that executors
//! return.

use crate::{DType, Shape, TensorType};
use half::{bf16, f16};

/// Element storage. Float tensors of every float dtype hold `f32` values that are exactly
/// representable in their dtype (an F16 tensor holds F16 values widened to F32), so arithmetic
/// is always F32 and rounding happens only where a value is stored. I32 and I64 share `I64`.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

/// A tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    ty: TensorType,
    data: TensorData,
}

/// Rounds an F32 value to the nearest value of `dtype` (round-to-nearest-even, as CUDA's
/// `__float2half_rn` and `__float2bfloat16_rn`); identity for F32.
#[inline]
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
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
        if dtype != DType::F32 {
            for x in &mut data {
                *x = round_to(dtype, *x);
            }
        }
        Tensor {
            ty: TensorType::new(dtype, shape),
            data: TensorData::F32(data),
        }
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
