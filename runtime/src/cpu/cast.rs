//! Conversions between dtypes.
//!
//! Float to float keeps the F32 value (the executor rounds it to the target dtype where it is
//! stored, by [`castor_ir::round_to`]); int to bool and float to bool test for nonzero; bool to
//! a number is 0 or 1; float to int truncates toward zero (saturating, NaN to 0, as Rust's
//! `as`); int to I32 wraps to 32 bits, as PyTorch's `.to(torch.int32)`, and to U8 to 8 bits, as
//! `.to(torch.uint8)`.
//!
//! A cast to an FP8 dtype (`f8e4m3`, `f8e5m2`) rounds to nearest even **saturating**: finite
//! values beyond the format's largest (448, 57344) and infinities become ±max, NaN stays NaN
//! ([`castor_ir::fp8::Overflow::Saturate`]). That is the conversion FP8 training uses (torchao
//! clamps to ±max before casting; cuBLASLt and CUDA's `__NV_SATFINITE` saturate), not
//! PyTorch's plain `.to(torch.float8_e5m2)`, which gives infinity.

use castor_ir::{DType, TensorData};

/// The float dtypes, as a pattern: every one holds F32 values on the host.
macro_rules! float_dtypes {
    () => {
        DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
    };
}

/// `data` converted to `to`. Float targets get F32 values not yet rounded to `to` (the
/// executor's store rounds them, to FP8 dtypes saturating: see the module docs); a conversion
/// that changes nothing returns the buffer as is.
pub fn cast(data: TensorData, to: DType) -> TensorData {
    match (data, to) {
        (v @ TensorData::F32(_), float_dtypes!()) => v,
        (TensorData::F32(v), DType::I64) => {
            TensorData::I64(v.into_iter().map(|x| x as i64).collect())
        }
        (TensorData::F32(v), DType::I32) => {
            TensorData::I64(v.into_iter().map(|x| i64::from(x as i32)).collect())
        }
        (TensorData::F32(v), DType::Bool) => {
            TensorData::Bool(v.into_iter().map(|x| x != 0.0).collect())
        }
        (TensorData::I64(v), float_dtypes!()) => {
            TensorData::F32(v.into_iter().map(|x| x as f32).collect())
        }
        (v @ TensorData::I64(_), DType::I64) => v,
        (TensorData::I64(v), DType::I32) => {
            TensorData::I64(v.into_iter().map(|x| i64::from(x as i32)).collect())
        }
        (TensorData::I64(v), DType::Bool) => {
            TensorData::Bool(v.into_iter().map(|x| x != 0).collect())
        }
        (TensorData::Bool(v), float_dtypes!()) => {
            TensorData::F32(v.into_iter().map(|b| f32::from(u8::from(b))).collect())
        }
        (TensorData::Bool(v), DType::I32 | DType::I64) => {
            TensorData::I64(v.into_iter().map(i64::from).collect())
        }
        (v @ TensorData::Bool(_), DType::Bool) => v,
        (TensorData::F32(v), DType::U8) => TensorData::U8(v.into_iter().map(|x| x as u8).collect()),
        (TensorData::I64(v), DType::U8) => TensorData::U8(v.into_iter().map(|x| x as u8).collect()),
        (TensorData::Bool(v), DType::U8) => TensorData::U8(v.into_iter().map(u8::from).collect()),
        (TensorData::U8(v), float_dtypes!()) => {
            TensorData::F32(v.into_iter().map(f32::from).collect())
        }
        (TensorData::U8(v), DType::I32 | DType::I64) => {
            TensorData::I64(v.into_iter().map(i64::from).collect())
        }
        (TensorData::U8(v), DType::Bool) => {
            TensorData::Bool(v.into_iter().map(|x| x != 0).collect())
        }
        (v @ TensorData::U8(_), DType::U8) => v,
    }
}
