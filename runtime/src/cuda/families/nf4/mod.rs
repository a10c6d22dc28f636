//! `nf4.cu`: an NF4 weight's codes and block maxima in, the dequantized weight out.
//!
//! The family: `nf4.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA program);
//! `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the kernels
//! against the CPU twin, in the host build).
//! CPU twin: [`castor_ir::nf4::dequantize`].

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
        name: "nf4.cu",
        source: include_str!("nf4.cu"),
        entry_points: &[
            "nf4_dequantize_bf16",
            "nf4_dequantize_f16",
            "nf4_dequantize_f32",
        ],
    },
];

/// A kernel of the family: dequantizing an NF4 weight to `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub dtype: DType,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        format!("nf4_dequantize_{}", self.dtype.name())
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        FLOATS.map(|dtype| Kernel { dtype }).into()
    }
}
