//! `rope.cu`: rotary embeddings forward and backward, and the (cos, sin) table.
//!
//! The family: `rope.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::rope`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "rope.cu",
        source: include_str!("rope.cu"),
        entry_points: &[
            "rope_bwd_bf16",
            "rope_bwd_f16",
            "rope_bwd_f32",
            "rope_fwd_bf16",
            "rope_fwd_f16",
            "rope_fwd_f32",
            "rope_table",
        ],
    },
];
