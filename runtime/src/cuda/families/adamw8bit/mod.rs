//! `adamw8bit.cu`: one 8-bit AdamW update in one launch (see the file's header).
//!
//! The family: `adamw8bit.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::adamw8bit`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "adamw8bit.cu",
        source: include_str!("adamw8bit.cu"),
        entry_points: &[
            "adamw8bit_bf16",
            "adamw8bit_f16",
            "adamw8bit_f32",
        ],
    },
];
