//! `norm.cu`: layer and RMS norm, forward and backward, and the weight-gradient reduction.
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
            "norm_weight_grad_reduce",
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
        ],
    },
];
