//! `softmax.cu`: softmax forward with the causal and padding masks or packed sequences'
//! positions, and backward.
//!
//! The family: `softmax.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::softmax`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::DType;
use crate::cuda::kernel_id::{io, direction, float_pairs};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "softmax.cu",
        source: include_str!("softmax.cu"),
        entry_points: &[
            "softmax_bwd_bf16",
            "softmax_bwd_bf16_f32",
            "softmax_bwd_f16",
            "softmax_bwd_f16_f32",
            "softmax_bwd_f32",
            "softmax_bwd_f32_bf16",
            "softmax_bwd_f32_f16",
            "softmax_fwd_bf16",
            "softmax_fwd_bf16_f32",
            "softmax_fwd_f16",
            "softmax_fwd_f16_f32",
            "softmax_fwd_f32",
            "softmax_fwd_f32_bf16",
            "softmax_fwd_f32_f16",
        ],
    },
];

/// A kernel of the family: the row softmax or its gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub backward: bool,
    pub input: DType,
    pub output: DType,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        format!(
            "softmax_{}_{}",
            direction(self.backward),
            io(self.input, self.output)
        )
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        float_pairs()
            .flat_map(|(input, output)| {
                [false, true].map(|backward| Kernel {
                    backward,
                    input,
                    output,
                })
            })
            .collect()
    }
}
