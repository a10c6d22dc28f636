//! `norm.cu`: layer and RMS norm, forward (alone, or with its output's FP8 cast and amax fused
//! behind) and backward, and the weight-gradient reduction.
//!
//! The family: `norm.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::norm`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::DType;
use crate::cuda::kernel_id::{io, float_pairs};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "norm.cu",
        source: include_str!("norm.cu"),
        entry_points: &[
            "layer_norm_bwd_bf16",
            "layer_norm_bwd_bf16_f32",
            "layer_norm_bwd_f16",
            "layer_norm_bwd_f16_f32",
            "layer_norm_bwd_f32",
            "layer_norm_bwd_f32_bf16",
            "layer_norm_bwd_f32_f16",
            "layer_norm_bwd_weight_bf16",
            "layer_norm_bwd_weight_bf16_f32",
            "layer_norm_bwd_weight_f16",
            "layer_norm_bwd_weight_f16_f32",
            "layer_norm_bwd_weight_f32",
            "layer_norm_bwd_weight_f32_bf16",
            "layer_norm_bwd_weight_f32_f16",
            "layer_norm_fwd_bf16",
            "layer_norm_fwd_bf16_f32",
            "layer_norm_fwd_f16",
            "layer_norm_fwd_f16_f32",
            "layer_norm_fwd_f32",
            "layer_norm_fwd_f32_bf16",
            "layer_norm_fwd_f32_f16",
            "layer_norm_fwd_fp8_bf16",
            "layer_norm_fwd_fp8_bf16_f32",
            "layer_norm_fwd_fp8_f16",
            "layer_norm_fwd_fp8_f16_f32",
            "layer_norm_fwd_fp8_f32",
            "layer_norm_fwd_fp8_f32_bf16",
            "layer_norm_fwd_fp8_f32_f16",
            "rms_norm_bwd_bf16",
            "rms_norm_bwd_bf16_f32",
            "rms_norm_bwd_f16",
            "rms_norm_bwd_f16_f32",
            "rms_norm_bwd_f32",
            "rms_norm_bwd_f32_bf16",
            "rms_norm_bwd_f32_f16",
            "rms_norm_bwd_weight_bf16",
            "rms_norm_bwd_weight_bf16_f32",
            "rms_norm_bwd_weight_f16",
            "rms_norm_bwd_weight_f16_f32",
            "rms_norm_bwd_weight_f32",
            "rms_norm_bwd_weight_f32_bf16",
            "rms_norm_bwd_weight_f32_f16",
            "rms_norm_fwd_bf16",
            "rms_norm_fwd_bf16_f32",
            "rms_norm_fwd_f16",
            "rms_norm_fwd_f16_f32",
            "rms_norm_fwd_f32",
            "rms_norm_fwd_f32_bf16",
            "rms_norm_fwd_f32_f16",
            "rms_norm_fwd_fp8_bf16",
            "rms_norm_fwd_fp8_bf16_f32",
            "rms_norm_fwd_fp8_f16",
            "rms_norm_fwd_fp8_f16_f32",
            "rms_norm_fwd_fp8_f32",
            "rms_norm_fwd_fp8_f32_bf16",
            "rms_norm_fwd_fp8_f32_f16",
        ],
    },
];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Layer norm or RMSNorm (`rms`), one pass of it.
    Norm {
        rms: bool,
        pass: Pass,
        input: DType,
        output: DType,
    },
}

/// A pass of a norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    /// The forward with its output's amax, and its E4M3 cast, fused behind.
    ForwardFp8,
    /// The input's gradient.
    Backward,
    /// The weight's (and bias's) gradient: partials per row group, summed by each column
    /// block's last group.
    BackwardWeight,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Norm {
                rms,
                pass,
                input,
                output,
            } => {
                let kind = if rms { "rms_norm" } else { "layer_norm" };
                let pass = match pass {
                    Pass::Forward => "fwd",
                    Pass::ForwardFp8 => "fwd_fp8",
                    Pass::Backward => "bwd",
                    Pass::BackwardWeight => "bwd_weight",
                };
                format!("{kind}_{pass}_{}", io(input, output))
            }
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids = Vec::new();
        for (input, output) in float_pairs() {
            for rms in [false, true] {
                for pass in [
                    Pass::Forward,
                    Pass::ForwardFp8,
                    Pass::Backward,
                    Pass::BackwardWeight,
                ] {
                    ids.push(Kernel::Norm {
                        rms,
                        pass,
                        input,
                        output,
                    });
                }
            }
        }
        ids
    }
}
