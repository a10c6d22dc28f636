//! `rope.cu`: rotary embeddings forward and backward (at packed sequences' positions when
//! given), and the (cos, sin) table.
//!
//! The family: `rope.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::rope`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::DType;
use crate::cuda::kernel_id::{direction, FLOATS};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "rope.cu",
        source: include_str!("rope.cu"),
        entry_points: &[
            "rope_bwd_bf16",
            "rope_bwd_f16",
            "rope_bwd_f32",
            "rope_fwd_bf16",
            "rope_fwd_f16",
            "rope_fwd_f32",
            "rope_table",
        ],
    },
];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Table,
    Rope { backward: bool, dtype: DType },
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Table => "rope_table".into(),
            Kernel::Rope { backward, dtype } => {
                format!("rope_{}_{}", direction(backward), dtype.name())
            }
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids = vec![Kernel::Table];
        for dtype in FLOATS {
            ids.extend([false, true].map(|backward| Kernel::Rope { backward, dtype }));
        }
        ids
    }
}
