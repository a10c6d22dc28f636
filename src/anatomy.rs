//! The memory anatomy of a training plan, as pictures and reports show it: the persistent
//! state by role, then the transient arena as the executor's memory model lays it out
//! (`crate::memory`), split into the activations the backward pass reads and the other
//! temporaries live at the peak, and for the CUDA executor its cuBLAS workspace and other
//! device buffers. The rows add up to the planned peak of one step.

use castor_ir::{StateRole, TrainingPlan};
use castor_passes::memory::Anatomy;
use castor_runtime::ExecutorKind;

/// One row of the anatomy.
#[derive(Clone, Debug)]
pub struct AnatomyRow {
    pub what: String,
    pub bytes: u64,
    /// True when the number is an estimate rather than exact.
    pub estimate: bool,
}

/// The rows of the anatomy, in the order the compile report prints them.
pub const STATE_ROLES: [StateRole; 7] = [
    StateRole::WorkingCopy,
    StateRole::Master,
    StateRole::Frozen,
    StateRole::Gradient,
    StateRole::OptimizerState,
    StateRole::Control,
    StateRole::Fp8Scaling,
];

/// The row of every buffer besides the state, the arena and the workspace.
pub const OTHER_BUFFERS: &str = "other device buffers";

/// The plan's persistent state by role, then the planned arena: saved activations (the plan
/// records where its forward part ends) and the other temporaries at the peak.
pub fn anatomy(plan: &TrainingPlan, executor: ExecutorKind) -> Vec<AnatomyRow> {
    rows(plan, &crate::memory::anatomy(executor, plan), executor)
}

/// [`anatomy`] of an anatomy already laid out by `executor`'s model.
pub fn rows(plan: &TrainingPlan, a: &Anatomy, executor: ExecutorKind) -> Vec<AnatomyRow> {
    let mut rows: Vec<AnatomyRow> = STATE_ROLES
        .iter()
        // Only a plan with a frozen base (LoRA) has that row, only fp8:delayed the scaling's.
        .filter(|&&role| {
            !matches!(role, StateRole::Frozen | StateRole::Fp8Scaling) || plan.state_bytes(role) > 0
        })
        .map(|&role| AnatomyRow {
            what: role.describe().to_string(),
            bytes: plan.state_bytes(role),
            estimate: false,
        })
        .collect();
    let saved = a.saved_activations.min(a.memory.arena_bytes);
    rows.push(AnatomyRow {
        what: "saved activations".into(),
        bytes: saved,
        estimate: false,
    });
    rows.push(AnatomyRow {
        what: "other temporaries at the peak".into(),
        bytes: a.memory.arena_bytes - saved,
        estimate: false,
    });
    // The CPU executor allocates nothing beside its values.
    if executor.runs_cuda_program() {
        rows.push(AnatomyRow {
            what: "cuBLAS workspace".into(),
            bytes: a.memory.workspace,
            estimate: false,
        });
        rows.push(AnatomyRow {
            what: OTHER_BUFFERS.into(),
            bytes: a.memory.other,
            estimate: false,
        });
    }
    rows
}
