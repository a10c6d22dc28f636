//! `adafactor.cu`: one Adafactor update in seven launches (see the file's header).
//!
//! The family: `adafactor.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::adafactor`].

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
        name: "adafactor.cu",
        source: include_str!("adafactor.cu"),
        entry_points: &[
            "adafactor_apply_bf16",
            "adafactor_apply_f16",
            "adafactor_apply_f32",
            "adafactor_cols",
            "adafactor_finalize",
            "adafactor_full",
            "adafactor_partials",
            "adafactor_row_mean",
            "adafactor_rows",
        ],
    },
];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Stage(Stage),
    /// The update, writing the parameter's working copy in `copy`.
    Apply { copy: DType },
}

/// The launches before the update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    Rows,
    Cols,
    Full,
    RowMean,
    Partials,
    Finalize,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Stage(stage) => match stage {
                Stage::Rows => "adafactor_rows",
                Stage::Cols => "adafactor_cols",
                Stage::Full => "adafactor_full",
                Stage::RowMean => "adafactor_row_mean",
                Stage::Partials => "adafactor_partials",
                Stage::Finalize => "adafactor_finalize",
            }
            .into(),
            Kernel::Apply { copy } => format!("adafactor_apply_{}", copy.name()),
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids: Vec<Kernel> = [
            Stage::Rows,
            Stage::Cols,
            Stage::Full,
            Stage::RowMean,
            Stage::Partials,
            Stage::Finalize,
        ]
        .map(Kernel::Stage)
        .into();
        ids.extend(FLOATS.map(|copy| Kernel::Apply { copy }));
        ids
    }
}
