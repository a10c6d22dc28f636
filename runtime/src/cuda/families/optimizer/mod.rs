//! `optimizer.cu`, `grad_norm.cu`, `loss_scale.cu`: multi-tensor AdamW, SGD and Lion updates,
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
use castor_ir::DType;
use crate::cuda::kernel_id::FLOATS;

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
            "lion_bf16",
            "lion_bf16state_bf16",
            "lion_bf16state_f16",
            "lion_bf16state_f32",
            "lion_f16",
            "lion_f32",
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

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    GradNormPartials,
    GradNormFinalize,
    CountStep,
    LossScaleUpdate,
    /// The multi-tensor AdamW, SGD or Lion update, moments in `state`, copies in `copy`.
    Update {
        rule: UpdateRule,
        state: DType,
        copy: DType,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UpdateRule {
    AdamW,
    Sgd,
    Lion,
}

impl UpdateRule {
    /// The moments the rule keeps: AdamW two, SGD and Lion one.
    pub fn moments(self) -> usize {
        match self {
            UpdateRule::AdamW => 2,
            UpdateRule::Sgd | UpdateRule::Lion => 1,
        }
    }
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::GradNormPartials => "grad_norm_partials".into(),
            Kernel::GradNormFinalize => "grad_norm_finalize".into(),
            Kernel::CountStep => "count_step".into(),
            Kernel::LossScaleUpdate => "loss_scale_update".into(),
            Kernel::Update { rule, state, copy } => {
                let rule = match rule {
                    UpdateRule::AdamW => "adamw",
                    UpdateRule::Sgd => "sgd",
                    UpdateRule::Lion => "lion",
                };
                let state = if state == DType::BF16 {
                    "bf16state_"
                } else {
                    ""
                };
                format!("{rule}_{state}{}", copy.name())
            }
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids = vec![
            Kernel::GradNormPartials,
            Kernel::GradNormFinalize,
            Kernel::CountStep,
            Kernel::LossScaleUpdate,
        ];
        for state in [DType::F32, DType::BF16] {
            for copy in FLOATS {
                for rule in [UpdateRule::AdamW, UpdateRule::Sgd, UpdateRule::Lion] {
                    ids.push(Kernel::Update { rule, state, copy });
                }
            }
        }
        ids
    }
}
