//! `embedding.cu`: the lookup and the count, scan, fill, accumulate steps of its backward.
//!
//! The family: `embedding.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::embedding`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "embedding.cu",
        source: include_str!("embedding.cu"),
        entry_points: &[
            "embedding_bwd_accumulate_bf16_bf16",
            "embedding_bwd_accumulate_bf16_f32",
            "embedding_bwd_accumulate_f16_f16",
            "embedding_bwd_accumulate_f16_f32",
            "embedding_bwd_accumulate_f32_f32",
            "embedding_bwd_count",
            "embedding_bwd_fill",
            "embedding_bwd_scan",
            "embedding_fwd_bf16",
            "embedding_fwd_f16",
            "embedding_fwd_f32",
        ],
    },
];
