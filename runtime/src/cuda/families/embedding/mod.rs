//! `embedding.cu`: the lookup and the count, scan, fill, accumulate steps of its backward.
//!
//! The family: `embedding.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::embedding`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::DType;
use crate::cuda::kernel_id::{FLOATS, float_pairs};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "embedding.cu",
        source: include_str!("embedding.cu"),
        entry_points: &[
            "embedding_bwd_accumulate_bf16_bf16",
            "embedding_bwd_accumulate_bf16_f32",
            "embedding_bwd_accumulate_f16_f16",
            "embedding_bwd_accumulate_f16_f32",
            "embedding_bwd_accumulate_f32_f32",
            "embedding_bwd_count",
            "embedding_bwd_fill",
            "embedding_bwd_scan",
            "embedding_fwd_bf16",
            "embedding_fwd_f16",
            "embedding_fwd_f32",
        ],
    },
];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Forward { table: DType },
    Backward(BackwardStage),
    BackwardAccumulate { grad: DType, out: DType },
}

/// A stage of the deterministic backward's counting sort.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardStage {
    Count,
    Scan,
    Fill,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Forward { table } => format!("embedding_fwd_{}", table.name()),
            Kernel::Backward(stage) => match stage {
                BackwardStage::Count => "embedding_bwd_count",
                BackwardStage::Scan => "embedding_bwd_scan",
                BackwardStage::Fill => "embedding_bwd_fill",
            }
            .into(),
            Kernel::BackwardAccumulate { grad, out } => {
                format!("embedding_bwd_accumulate_{}_{}", grad.name(), out.name())
            }
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids: Vec<Kernel> = [BackwardStage::Count, BackwardStage::Scan, BackwardStage::Fill]
            .map(Kernel::Backward)
            .into();
        ids.extend(FLOATS.map(|table| Kernel::Forward { table }));
        ids.extend(float_pairs().map(|(grad, out)| Kernel::BackwardAccumulate { grad, out }));
        ids
    }
}
