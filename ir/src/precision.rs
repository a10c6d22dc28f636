//! The precision policy families `--precision` chooses from. They live in the IR crate because
//! a training plan records the one it was built with (typed, not as a string).

use crate::DType;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The policy families `--precision` chooses from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in F32.
    Fp32,
    /// F32 storage; contractions on TF32 tensor cores (operands rounded to TF32).
    Tf32,
    /// BF16 for contractions and what follows them; F32 range, so no loss scaling.
    Bf16,
    /// F16 for contractions and what lies between them; needs loss scaling in training.
    Fp16,
    /// BF16 as [`Precision::Bf16`], and the products of the transformer layers on FP8
    /// operands (E4M3 in the forward, E5M2 gradients in the backward) with tensorwise
    /// current scaling, as torchao's float8 training recipe.
    Fp8,
}

impl Precision {
    pub const ALL: [Precision; 5] = [
        Precision::Fp32,
        Precision::Tf32,
        Precision::Bf16,
        Precision::Fp16,
        Precision::Fp8,
    ];

    /// The low-precision storage dtype, if the policy has one.
    pub fn low(self) -> Option<DType> {
        match self {
            Precision::Bf16 | Precision::Fp8 => Some(DType::BF16),
            Precision::Fp16 => Some(DType::F16),
            Precision::Fp32 | Precision::Tf32 => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp8 => "fp8",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Precision {
    /// True when the policy puts products on FP8 operands.
    pub fn is_fp8(self) -> bool {
        self == Precision::Fp8
    }

    /// The spellings users write for each precision (case is ignored): the short names,
    /// PyTorch's dtype names, `half`, and FP8's scaling named (`fp8:tensorwise`).
    pub const ALIASES: [(&'static str, Precision); 11] = [
        ("fp32", Precision::Fp32),
        ("float32", Precision::Fp32),
        ("tf32", Precision::Tf32),
        ("bf16", Precision::Bf16),
        ("bfloat16", Precision::Bf16),
        ("fp16", Precision::Fp16),
        ("float16", Precision::Fp16),
        ("half", Precision::Fp16),
        ("f16", Precision::Fp16),
        ("fp8", Precision::Fp8),
        ("fp8:tensorwise", Precision::Fp8),
    ];
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        if lower == "fp8:delayed" {
            return Err(
                "FP8 with delayed scaling (`fp8:delayed`, amax histories as plan state) \
                        is not available yet; `fp8` scales each tensor by its own amax \
                        (tensorwise current scaling)"
                    .to_string(),
            );
        }
        Precision::ALIASES
            .iter()
            .find(|(name, _)| *name == lower)
            .map(|&(_, p)| p)
            .ok_or_else(|| {
                format!(
                    "unknown precision `{s}` (expected fp32/float32, tf32, bf16/bfloat16, \
                     fp16/float16/half or fp8/fp8:tensorwise)"
                )
            })
    }
}

/// Plans store the policy by its name (`"bf16"`).
impl Serialize for Precision {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Precision {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Precision, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
