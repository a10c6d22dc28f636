//! The memory anatomy of a training plan: what the bytes of one training step hold.
//!
//! Persistent state comes from the plan's state table by role. Activations are estimated
//! from the forward graph until the memory planner reports the real arena: this module is
//! the one place to switch to its numbers.

use castor_ir::{Graph, Op, StateRole, TrainingPlan};

/// One row of the anatomy.
#[derive(Clone, Debug)]
pub struct AnatomyRow {
    pub what: String,
    pub bytes: u64,
    /// True when the number is an estimate rather than exact.
    pub estimate: bool,
}

/// The rows of the anatomy, in the order the compile report prints them.
pub const STATE_ROLES: [StateRole; 5] = [
    StateRole::WorkingCopy,
    StateRole::Master,
    StateRole::Gradient,
    StateRole::OptimizerState,
    StateRole::Control,
];

/// The plan's persistent state by role, plus (given the compiled forward graph) the
/// activation estimate.
pub fn anatomy(plan: &TrainingPlan, forward: Option<&Graph>) -> Vec<AnatomyRow> {
    let mut rows: Vec<AnatomyRow> = STATE_ROLES
        .iter()
        .map(|&role| AnatomyRow {
            what: role.describe().to_string(),
            bytes: plan.state_bytes(role),
            estimate: false,
        })
        .collect();
    if let Some(g) = forward {
        rows.push(AnatomyRow {
            what: "activations (estimate)".into(),
            bytes: activation_estimate(g),
            estimate: true,
        });
    }
    rows
}

/// Bytes of every value the forward graph computes (not its inputs, parameters or parameter
/// copies): what the backward pass keeps when nothing is recomputed and nothing is freed
/// early. An upper bound on saved activations with rematerialization `none`.
pub fn activation_estimate(g: &Graph) -> u64 {
    g.nodes()
        .filter(|(_, n)| {
            !matches!(
                n.op,
                Op::Input | Op::Param | Op::State | Op::ParamCopy { .. }
            )
        })
        .flat_map(|(_, n)| n.outputs.iter())
        .map(|&v| g.ty(v).size_bytes().unwrap_or(0) as u64)
        .sum()
}
