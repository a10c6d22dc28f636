//! `dropout.cu`: inverted dropout with masks drawn from Philox4x32-10, forward and backward
//! (the same kernel: the mask is regenerated from the key).
//!
//! The family: `dropout.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::dropout`].

pub(crate) mod contract;
pub(crate) mod lower;
#[cfg(test)]
pub(crate) mod tests;

use crate::cuda::kernel_id::FLOATS;
use castor_ir::DType;
use castor_kernels::KernelFile;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[KernelFile {
    name: "dropout.cu",
    source: include_str!("dropout.cu"),
    entry_points: &["dropout_bf16", "dropout_f16", "dropout_f32"],
}];

/// A kernel of the family: dropout of one storage dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Dropout { dtype: DType },
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Dropout { dtype } => format!("dropout_{}", dtype.name()),
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        FLOATS.map(|dtype| Kernel::Dropout { dtype }).to_vec()
    }
}
