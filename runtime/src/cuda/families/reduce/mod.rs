//! `reduce.cu`: sum, mean and max over one axis; sums and means of columns also in two stages
//! in one launch (row groups' F64 partials, then their sum by each column block's last
//! group), where one stage has too few blocks.
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
use crate::cuda::kernel_id::{float_pairs, io};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "reduce.cu",
        source: include_str!("reduce.cu"),
        entry_points: &[
            "reduce_grouped_mean_bf16",
            "reduce_grouped_mean_bf16_f16",
            "reduce_grouped_mean_bf16_f32",
            "reduce_grouped_mean_f16",
            "reduce_grouped_mean_f16_bf16",
            "reduce_grouped_mean_f16_f32",
            "reduce_grouped_mean_f32",
            "reduce_grouped_mean_f32_bf16",
            "reduce_grouped_mean_f32_f16",
            "reduce_grouped_sum_bf16",
            "reduce_grouped_sum_bf16_f16",
            "reduce_grouped_sum_bf16_f32",
            "reduce_grouped_sum_f16",
            "reduce_grouped_sum_f16_bf16",
            "reduce_grouped_sum_f16_f32",
            "reduce_grouped_sum_f32",
            "reduce_grouped_sum_f32_bf16",
            "reduce_grouped_sum_f32_f16",
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

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// One reduction over the middle axis, in one launch (`reduce_<op>_<io>`).
    Whole {
        op: ReduceOp,
        input: DType,
        output: DType,
    },
    /// A two-stage column sum or mean in one launch: the row groups' F64 partials, then
    /// their sum per column by each column block's last group (`reduce_grouped_<op>_<io>`,
    /// `op` sum or mean).
    Grouped {
        op: ReduceOp,
        input: DType,
        output: DType,
    },
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Whole { op, input, output } => {
                format!("reduce_{}_{}", op.name(), io(input, output))
            }
            Kernel::Grouped { op, input, output } => {
                format!("reduce_grouped_{}_{}", op.name(), io(input, output))
            }
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut all: Vec<Kernel> = float_pairs()
            .flat_map(|(input, output)| {
                ReduceOp::ALL.map(|op| Kernel::Whole { op, input, output })
            })
            .collect();
        for (input, output) in float_pairs() {
            all.extend(
                [ReduceOp::Sum, ReduceOp::Mean].map(|op| Kernel::Grouped { op, input, output }),
            );
        }
        all
    }
}
