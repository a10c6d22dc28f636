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
