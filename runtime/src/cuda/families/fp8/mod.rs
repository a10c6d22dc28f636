//! `fp8.cu`: FP8 tensorwise scaling: a tensor's amax and scale (`fp8_scale`), the scaled,
//! saturating cast to E4M3 or E5M2 with its input's amax (`quantize`), and the dequantization
//! factors a cuBLASLt FP8 product reads through its scale pointers (`fp8_matmul`, whose
//! product itself is a cuBLASLt call: `crate::cuda::lower::gemm::fp8_matmul`).
//!
//! The family: `fp8.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::fp8`] and [`castor_ir::fp8`].

pub(crate) mod contract;
pub(crate) mod lower;
#[cfg(test)]
pub(crate) mod tests;

use crate::cuda::kernel_id::FLOATS;
use castor_ir::fp8::Fp8Format;
use castor_ir::DType;
use castor_kernels::KernelFile;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[KernelFile {
    name: "fp8.cu",
    source: include_str!("fp8.cu"),
    entry_points: &[
        "fp8_amax_bf16",
        "fp8_amax_f16",
        "fp8_amax_f32",
        "fp8_amax_finalize",
        "fp8_amax_history",
        "fp8_dequantization",
        "fp8_quantize_bf16_e4m3",
        "fp8_quantize_bf16_e5m2",
        "fp8_quantize_f16_e4m3",
        "fp8_quantize_f16_e5m2",
        "fp8_quantize_f32_e4m3",
        "fp8_quantize_f32_e5m2",
        "fp8_scale_finalize",
    ],
}];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Per-block maxima of `|x|` (`fp8_amax_<t>`).
    Amax { dtype: DType },
    /// The scale from the per-block maxima (`fp8_scale_finalize`).
    ScaleFinalize,
    /// The scaled cast of a `dtype` tensor to `to`, with per-block maxima
    /// (`fp8_quantize_<t>_<f>`).
    Quantize { dtype: DType, to: Fp8Format },
    /// The amax from the per-block maxima (`fp8_amax_finalize`).
    AmaxFinalize,
    /// The two reciprocals of an FP8 product's scales (`fp8_dequantization`).
    Dequantization,
    /// One step of delayed scaling: the next amax history and scale (`fp8_amax_history`).
    AmaxHistory,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Amax { dtype } => format!("fp8_amax_{}", dtype.name()),
            Kernel::ScaleFinalize => "fp8_scale_finalize".into(),
            Kernel::Quantize { dtype, to } => format!("fp8_quantize_{}_{}", dtype.name(), to),
            Kernel::AmaxFinalize => "fp8_amax_finalize".into(),
            Kernel::Dequantization => "fp8_dequantization".into(),
            Kernel::AmaxHistory => "fp8_amax_history".into(),
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut all = vec![
            Kernel::ScaleFinalize,
            Kernel::AmaxFinalize,
            Kernel::Dequantization,
            Kernel::AmaxHistory,
        ];
        for dtype in FLOATS {
            all.push(Kernel::Amax { dtype });
            for to in Fp8Format::ALL {
                all.push(Kernel::Quantize { dtype, to });
            }
        }
        all
    }
}
