//! Element types and tensor types.
//!
//! Floating-point values of every float dtype are *computed* in F32 by the executors; the
//! dtype of a value says where the result is rounded when it is stored.

use std::fmt;
use std::str::FromStr;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    I64,
    Bool,
    /// Unsigned bytes: the codes of block-wise quantized optimizer moments.
    U8,
    /// FP8 E4M3 (`e4m3fn`: bias 7, largest finite 448, no infinities); see [`crate::fp8`].
    F8E4M3,
    /// FP8 E5M2 (bias 15, largest finite 57344, with infinities); see [`crate::fp8`].
    F8E5M2,
}

impl DType {
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::Bool,
        DType::U8,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// The name used in the IR text (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// True for every float type, the FP8 types included: their values are floats computed
    /// in F32 like the others', rounded where they are stored.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// True for the 8-bit float types (E4M3, E5M2).
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// True for the float types narrower than F32 that mixed precision stores: the 16-bit
    /// types and the FP8 types.
    pub fn is_low_precision(self) -> bool {
        matches!(
            self,
            DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// Bytes one element occupies on a device.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::Bool | DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
                format!("unknown dtype `{s}` (expected one of {})", names.join(", "))
            })
    }
}

/// Plans store a dtype by its IR name (`bf16`).
impl serde::Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for DType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A tensor's static type: element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: crate::Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<crate::Shape>) -> Self {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }

    /// Bytes the tensor occupies, or `None` if the element count overflows.
    pub fn size_bytes(&self) -> Option<usize> {
        self.shape.numel()?.checked_mul(self.dtype.size_bytes())
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

/// The arithmetic inside a node's kernel, apart from the dtypes it reads and writes (the third
/// of a node's three dtypes: inputs, accumulation, output). castor's kernels always accumulate
/// in F32; `Tf32` additionally rounds a contraction's operands to TF32 (10-bit mantissa), as
/// tensor cores do in TF32 mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Accum {
    F32,
    Tf32,
}

impl Accum {
    pub fn name(self) -> &'static str {
        match self {
            Accum::F32 => "f32",
            Accum::Tf32 => "tf32",
        }
    }
}

impl fmt::Display for Accum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Accum {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Accum::F32),
            "tf32" => Ok(Accum::Tf32),
            _ => Err(format!("unknown accumulation `{s}` (expected f32 or tf32)")),
        }
    }
}

/// Rounds an F32 value to TF32 (10 explicit mantissa bits, round to nearest, ties away from
/// zero, as CUDA's `cvt.rna.tf32.f32`). Infinities and NaN pass through.
#[inline]
pub fn round_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    f32::from_bits((x.to_bits().wrapping_add(0x1000)) & 0xffff_e000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_parses_from_its_name() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.to_string(), d.name());
        }
        let e = "f8".parse::<DType>().unwrap_err();
        assert_eq!(
            e,
            "unknown dtype `f8` (expected one of f32, f16, bf16, i32, i64, bool, u8, f8e4m3, \
             f8e5m2)"
        );
    }

    #[test]
    fn fp8_dtypes_are_one_byte_low_precision_floats() {
        for d in [DType::F8E4M3, DType::F8E5M2] {
            assert!(d.is_float() && d.is_fp8() && d.is_low_precision() && !d.is_int());
            assert_eq!(d.size_bytes(), 1);
        }
        assert_eq!(
            DType::ALL.iter().filter(|d| d.is_fp8()).count(),
            2,
            "no other dtype is FP8"
        );
    }
}
