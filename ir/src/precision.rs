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
    /// [`Precision::Fp8`] with delayed scaling for the activations and gradients, as
    /// Transformer Engine's `DelayedScaling`: each cast reads a scale kept in the plan's state,
    /// computed from a history of the tensor's past amaxes (the weights, cast once per
    /// optimizer step, keep their current scale).
    Fp8Delayed,
}

impl Precision {
    pub const ALL: [Precision; 6] = [
        Precision::Fp32,
        Precision::Tf32,
        Precision::Bf16,
        Precision::Fp16,
        Precision::Fp8,
        Precision::Fp8Delayed,
    ];

    /// The low-precision storage dtype, if the policy has one.
    pub fn low(self) -> Option<DType> {
        match self {
            Precision::Bf16 | Precision::Fp8 | Precision::Fp8Delayed => Some(DType::BF16),
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
            Precision::Fp8Delayed => "fp8:delayed",
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
        matches!(self, Precision::Fp8 | Precision::Fp8Delayed)
    }

    /// True when the FP8 casts of activations and gradients read scales from amax histories
    /// kept in the plan's state.
    pub fn is_delayed(self) -> bool {
        self == Precision::Fp8Delayed
    }

    /// The spellings users write for each precision (case is ignored): the short names,
    /// PyTorch's dtype names, `half`, and FP8's scalings named (`fp8:tensorwise`,
    /// `fp8:delayed`).
    pub const ALIASES: [(&'static str, Precision); 12] = [
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
        ("fp8:delayed", Precision::Fp8Delayed),
    ];
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        Precision::ALIASES
            .iter()
            .find(|(name, _)| *name == lower)
            .map(|&(_, p)| p)
            .ok_or_else(|| {
                format!(
                    "unknown precision `{s}` (expected fp32/float32, tf32, bf16/bfloat16, \
                     fp16/float16/half, fp8/fp8:tensorwise or fp8:delayed)"
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
