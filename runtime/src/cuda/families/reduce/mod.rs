//! `reduce.cu`: sum, mean and max over one axis.
//!
//! The family: `reduce.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::reduce`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::{DType, ReduceOp};
use crate::cuda::kernel_id::{io, float_pairs};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "reduce.cu",
        source: include_str!("reduce.cu"),
        entry_points: &[
            "reduce_max_bf16",
            "reduce_max_bf16_f16",
            "reduce_max_bf16_f32",
            "reduce_max_f16",
            "reduce_max_f16_bf16",
            "reduce_max_f16_f32",
            "reduce_max_f32",
            "reduce_max_f32_bf16",
            "reduce_max_f32_f16",
            "reduce_mean_bf16",
            "reduce_mean_bf16_f16",
            "reduce_mean_bf16_f32",
            "reduce_mean_f16",
            "reduce_mean_f16_bf16",
            "reduce_mean_f16_f32",
            "reduce_mean_f32",
            "reduce_mean_f32_bf16",
            "reduce_mean_f32_f16",
            "reduce_sum_bf16",
            "reduce_sum_bf16_f16",
            "reduce_sum_bf16_f32",
            "reduce_sum_f16",
            "reduce_sum_f16_bf16",
            "reduce_sum_f16_f32",
            "reduce_sum_f32",
            "reduce_sum_f32_bf16",
            "reduce_sum_f32_f16",
        ],
    },
];

/// A kernel of the family: one reduction over the middle axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub op: ReduceOp,
    pub input: DType,
    pub output: DType,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        format!("reduce_{}_{}", self.op.name(), io(self.input, self.output))
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        float_pairs()
            .flat_map(|(input, output)| {
                ReduceOp::ALL.map(|op| Kernel { op, input, output })
            })
            .collect()
    }
}
