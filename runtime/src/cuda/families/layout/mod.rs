//! `cast.cu` and `layout.cu`: dtype casts, strided copies, fills.
//!
//! The family: `layout.cu`, `cast.cu` (sources, entry points below); `lower.rs` (its launches in a
//! CUDA program); `contract.rs` (what the emulator lets each launch read and write);
//! `tests.rs` (the kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::layout`] and [`crate::cpu::cast`].

pub(crate) mod lower;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::DType;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "layout.cu",
        source: include_str!("layout.cu"),
        entry_points: &[
            "cast_bool_bf16",
            "cast_bool_f16",
            "cast_bool_f32",
            "cast_bool_i32",
            "cast_bool_i64",
            "cast_f32_bool",
            "cast_f32_i64",
            "cast_i64_bf16",
            "cast_i64_bool",
            "cast_i64_f16",
            "cast_i64_f32",
            "fill_b1",
            "fill_b2",
            "fill_b4",
            "fill_b8",
            "strided_copy_b1",
            "strided_copy_b2",
            "strided_copy_b4",
            "strided_copy_b8",
            "strided_copy_b16",
        ],
    },
    KernelFile {
        name: "cast.cu",
        source: include_str!("cast.cu"),
        entry_points: &[
            "cast_bf16_f16",
            "cast_bf16_f32",
            "cast_f16_bf16",
            "cast_f16_f32",
            "cast_f32_bf16",
            "cast_f32_f16",
        ],
    },
];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Cast { from: DType, to: DType },
    /// A strided copy of `bytes`-byte elements.
    StridedCopy { bytes: u32 },
    Fill { bytes: u32 },
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Cast { from, to } => format!("cast_{}_{}", from.name(), to.name()),
            Kernel::StridedCopy { bytes } => format!("strided_copy_b{bytes}"),
            Kernel::Fill { bytes } => format!("fill_b{bytes}"),
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids: Vec<Kernel> = DType::ALL
            .into_iter()
            .flat_map(|from| DType::ALL.map(|to| Kernel::Cast { from, to }))
            .collect();
        for bytes in [1, 2, 4, 8, 16] {
            ids.extend([Kernel::StridedCopy { bytes }, Kernel::Fill { bytes }]);
        }
        ids
    }
}
