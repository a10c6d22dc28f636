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
use castor_ir::DType;
use crate::cuda::kernel_id::FLOATS;

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

/// A kernel of the family: one 8-bit AdamW update, writing the working copy in `copy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub copy: DType,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        format!("adamw8bit_{}", self.copy.name())
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        FLOATS.map(|copy| Kernel { copy }).into()
    }
}
