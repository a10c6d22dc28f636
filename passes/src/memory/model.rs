//! Memory models: how an executor lays out one training step beyond its state table.
//!
//! The remat pass's budget, the memory anatomy and the fit verdict all read one model, so the
//! number `--remat budget:` promises is the number the executor allocates. The CUDA executor's
//! model (the lowered program's arena at kernel-unit granularity, its cuBLAS workspace and
//! its other buffers) lives in `castor_runtime::cuda::memory`, which knows the device;
//! [`NodeLevel`] is the device-free model: every value live from its node to its last reader,
//! placed in one arena, as the CPU executor frees values.

use super::{plan_graphs, PlacementOrder, ScheduledGraph};
use castor_ir::{Graph, TrainingPlan};
use std::collections::HashSet;

/// How an executor lays out a training step's memory beyond the plan's state table.
pub trait MemoryModel: Send + Sync {
    /// The step's memory besides the state table, with `micro_step` as its micro step (the
    /// plan's own, or a candidate the remat pass weighs) and the rest from `plan`.
    fn step(&self, plan: &TrainingPlan, micro_step: &Graph) -> StepMemory;
}

/// One step's memory besides the state table, as a model lays it out.
#[derive(Clone, Debug, PartialEq)]
pub struct StepMemory {
    /// What laid it out, for reports (`CUDA executor, kernel units`).
    pub model: String,
    /// The arena of transient values and scratch.
    pub arena_bytes: u64,
    /// The largest total of live arena bytes at any point: no placement does better.
    pub lower_bound: u64,
    /// The placement order that won.
    pub order: PlacementOrder,
    /// Library workspace (cuBLAS).
    pub workspace: u64,
    /// Every other buffer the executor allocates: batch inputs, graph outputs, error flags,
    /// device tables and constants, and the allocation rounding of the state's buffers.
    pub other: u64,
}

impl StepMemory {
    /// Arena over its lower bound (1.0 = optimal).
    pub fn ratio(&self) -> f64 {
        if self.lower_bound == 0 {
            1.0
        } else {
            self.arena_bytes as f64 / self.lower_bound as f64
        }
    }

    /// Bytes besides the state table.
    pub fn total(&self) -> u64 {
        self.arena_bytes + self.workspace + self.other
    }
}

/// The device-free model: node-level live ranges in one best-fit arena, nothing else.
pub struct NodeLevel;

impl MemoryModel for NodeLevel {
    fn step(&self, plan: &TrainingPlan, micro_step: &Graph) -> StepMemory {
        fn stored(w: &[castor_ir::Write]) -> HashSet<&str> {
            w.iter().map(|w| w.output.as_str()).collect()
        }
        let m = plan_graphs(&[
            ScheduledGraph {
                graph: micro_step,
                stored_outputs: stored(&plan.micro_step_writes),
            },
            ScheduledGraph {
                graph: &plan.optimizer_step,
                stored_outputs: stored(&plan.optimizer_step_writes),
            },
        ]);
        StepMemory {
            model: "node level".into(),
            arena_bytes: m.arena_bytes,
            lower_bound: m.lower_bound,
            order: m.order,
            workspace: 0,
            other: 0,
        }
    }
}
