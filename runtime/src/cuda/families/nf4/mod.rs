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
