//! `elementwise.cu`: the activation functions forward and backward, add and mul.
//!
//! The family: `elementwise.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::elementwise`].

pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "elementwise.cu",
        source: include_str!("elementwise.cu"),
        entry_points: &[
            "add_bf16",
            "add_f16",
            "add_f32",
            "gelu_erf_bwd_bf16",
            "gelu_erf_bwd_f16",
            "gelu_erf_bwd_f32",
            "gelu_erf_fwd_bf16",
            "gelu_erf_fwd_f16",
            "gelu_erf_fwd_f32",
            "gelu_tanh_bwd_bf16",
            "gelu_tanh_bwd_f16",
            "gelu_tanh_bwd_f32",
            "gelu_tanh_fwd_bf16",
            "gelu_tanh_fwd_f16",
            "gelu_tanh_fwd_f32",
            "mul_bf16",
            "mul_f16",
            "mul_f32",
            "silu_bwd_bf16",
            "silu_bwd_f16",
            "silu_bwd_f32",
            "silu_fwd_bf16",
            "silu_fwd_f16",
            "silu_fwd_f32",
        ],
    },
];
