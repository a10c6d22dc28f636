//! `reduce.cu`: sum, mean and max over one axis; sums and means of columns also in two stages
//! (row groups' F64 partials, then their sum), where one stage has too few blocks.
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
use crate::cuda::kernel_id::{float_pairs, io, FLOATS};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "reduce.cu",
        source: include_str!("reduce.cu"),
        entry_points: &[
            "reduce_groups_mean_bf16",
            "reduce_groups_mean_f16",
            "reduce_groups_mean_f32",
            "reduce_groups_sum_bf16",
            "reduce_groups_sum_f16",
            "reduce_groups_sum_f32",
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
            "reduce_partials_bf16",
            "reduce_partials_f16",
            "reduce_partials_f32",
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
    /// A two-stage column sum's first stage: the row groups' F64 partials
    /// (`reduce_partials_<ti>`).
    Partials { input: DType },
    /// Its second stage: the partials summed, or averaged, per column
    /// (`reduce_groups_<op>_<to>`, `op` sum or mean).
    Groups { op: ReduceOp, output: DType },
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Whole { op, input, output } => {
                format!("reduce_{}_{}", op.name(), io(input, output))
            }
            Kernel::Partials { input } => format!("reduce_partials_{}", input.name()),
            Kernel::Groups { op, output } => {
                format!("reduce_groups_{}_{}", op.name(), output.name())
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
        all.extend(FLOATS.map(|input| Kernel::Partials { input }));
        for output in FLOATS {
            all.extend(
                [ReduceOp::Sum, ReduceOp::Mean].map(|op| Kernel::Groups { op, output }),
            );
        }
        all
    }
}
