//! `cross_entropy.cu`: the fused log-softmax + NLL forward, its finalize, and its backward.
//!
//! The family: `cross_entropy.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program), `classifier.rs`; `contract.rs` (what the emulator lets each launch read and write);
//! `tests.rs` (the kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::loss`] (the fused classifier: [`crate::cpu::classifier`]).

pub(crate) mod lower;
pub(crate) mod classifier;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "cross_entropy.cu",
        source: include_str!("cross_entropy.cu"),
        entry_points: &[
            "cross_entropy_bwd_bf16",
            "cross_entropy_bwd_f16",
            "cross_entropy_bwd_f32",
            "cross_entropy_finalize",
            "cross_entropy_fwd_bf16",
            "cross_entropy_fwd_f16",
            "cross_entropy_fwd_f32",
        ],
    },
];
