//! `attention.cu`: the fused attention forward, its `delta` row sums, and its backward (one
//! tensor-core kernel, or the F32 dq and dk/dv kernels). Launch shapes, dynamic shared memory
//! and scratch are `crate::cuda::families::attention::geometry`'s.
//!
//! The family: `attention.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::attention`].

pub(crate) mod lower;
pub mod geometry;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;

/// Entry points whose blocks wait for blocks with a lower index (the backward's ordered dQ
/// sums; see [`super::waits_for_earlier_blocks`]).
pub const BLOCK_ORDERED: &[&str] = &[
    "attention_bwd_bf16_d128",
    "attention_bwd_bf16_d16",
    "attention_bwd_bf16_d32",
    "attention_bwd_bf16_d64",
    "attention_bwd_f16_d128",
    "attention_bwd_f16_d16",
    "attention_bwd_f16_d32",
    "attention_bwd_f16_d64",
];

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "attention.cu",
        source: include_str!("attention.cu"),
        entry_points: &[
            "attention_bwd_bf16_d128",
            "attention_bwd_bf16_d16",
            "attention_bwd_bf16_d32",
            "attention_bwd_bf16_d64",
            "attention_bwd_delta_bf16",
            "attention_bwd_delta_f16",
            "attention_bwd_delta_f32",
            "attention_bwd_dkdv_f32",
            "attention_bwd_dq_f32",
            "attention_bwd_f16_d128",
            "attention_bwd_f16_d16",
            "attention_bwd_f16_d32",
            "attention_bwd_f16_d64",
            "attention_fwd_bf16_d128",
            "attention_fwd_bf16_d16",
            "attention_fwd_bf16_d32",
            "attention_fwd_bf16_d64",
            "attention_fwd_f16_d128",
            "attention_fwd_f16_d16",
            "attention_fwd_f16_d32",
            "attention_fwd_f16_d64",
            "attention_fwd_f32",
        ],
    },
];
