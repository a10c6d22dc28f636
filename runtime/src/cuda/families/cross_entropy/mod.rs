//! `cross_entropy.cu`: the fused log-softmax + NLL forward, its finalize, and its backward.
//!
//! The family: `cross_entropy.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program), `classifier.rs`; `contract.rs` (what the emulator lets each launch read and write);
//! `tests.rs` (the kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::loss`] (the fused classifier: [`crate::cpu::classifier`]).

pub(crate) mod lower;
pub(crate) mod classifier;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::DType;
use crate::cuda::kernel_id::{direction, FLOATS};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "cross_entropy.cu",
        source: include_str!("cross_entropy.cu"),
        entry_points: &[
            "cross_entropy_bwd_bf16",
            "cross_entropy_bwd_f16",
            "cross_entropy_bwd_f32",
            "cross_entropy_finalize",
            "cross_entropy_fwd_bf16",
            "cross_entropy_fwd_f16",
            "cross_entropy_fwd_f32",
        ],
    },
];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    CrossEntropy { backward: bool, logits: DType },
    Finalize,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::CrossEntropy { backward, logits } => {
                format!("cross_entropy_{}_{}", direction(backward), logits.name())
            }
            Kernel::Finalize => "cross_entropy_finalize".into(),
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids = vec![Kernel::Finalize];
        for logits in FLOATS {
            for backward in [false, true] {
                ids.push(Kernel::CrossEntropy { backward, logits });
            }
        }
        ids
    }
}
