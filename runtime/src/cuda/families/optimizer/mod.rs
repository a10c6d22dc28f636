//! `optimizer.cu`, `grad_norm.cu`, `loss_scale.cu`: multi-tensor AdamW and SGD updates,
//! the global gradient norm, the step counter and the dynamic loss scale.
//!
//! The family: `optimizer.cu`, `grad_norm.cu`, `loss_scale.cu` (sources, entry points below);
//! `lower.rs` (its launches in a CUDA program), `loss_scale.rs`; `contract.rs` (what the emulator
//! lets each launch read and write); `tests.rs` (the kernels against the CPU twin, in the host
//! build).
//! CPU twin: [`crate::cpu::optimizer`].

pub(crate) mod lower;
pub(crate) mod loss_scale;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "optimizer.cu",
        source: include_str!("optimizer.cu"),
        entry_points: &[
            "adamw_bf16",
            "adamw_bf16state_bf16",
            "adamw_bf16state_f16",
            "adamw_bf16state_f32",
            "adamw_f16",
            "adamw_f32",
            "sgd_bf16",
            "sgd_bf16state_bf16",
            "sgd_bf16state_f16",
            "sgd_bf16state_f32",
            "sgd_f16",
            "sgd_f32",
        ],
    },
    KernelFile {
        name: "grad_norm.cu",
        source: include_str!("grad_norm.cu"),
        entry_points: &[
            "grad_norm_finalize",
            "grad_norm_partials",
        ],
    },
    KernelFile {
        name: "loss_scale.cu",
        source: include_str!("loss_scale.cu"),
        entry_points: &[
            "count_step",
            "loss_scale_update",
        ],
    },
];
