//! The CUDA executor's memory model: what the device allocates for a plan's step.
//!
//! The step is lowered as it would run (kernel units, their scratch, views that take no
//! memory) and its [`Program::allocation`] read back: the arena as the lowering places it,
//! the cuBLAS workspace, the batch inputs, graph outputs, error flags, device tables and
//! constants. The remat pass's budget, the memory anatomy and the fit verdict read this model,
//! so the planned peak is what the device allocates (tested for every family and remat mode).

use super::lower::{lower_step, MICRO_STEP, OPTIMIZER_STEP};
use super::program::Program;
use castor_ir::{Graph, TrainingPlan};
use castor_passes::fusion;
use castor_passes::memory::{MemoryModel, NodeLevel, StepMemory};

/// The CUDA executor's [`MemoryModel`].
pub struct CudaMemory;

impl MemoryModel for CudaMemory {
    fn step(&self, plan: &TrainingPlan, micro_step: &Graph) -> StepMemory {
        // A candidate micro step (or a plan before its fusion pass) has no units yet: the
        // fusion pass's are the ones the plan will record.
        let own = std::ptr::eq(micro_step, &plan.micro_step);
        let units = |g: &Graph, name: &str| match plan.units_of(name) {
            u if own && !u.is_empty() => u,
            _ => fusion::kernel_units(g, name),
        };
        let lowered = lower_step(
            plan,
            micro_step,
            units(micro_step, MICRO_STEP),
            units(&plan.optimizer_step, OPTIMIZER_STEP),
        );
        match lowered {
            Ok(program) => step_memory(plan, &program),
            Err(e) => StepMemory {
                model: format!("node level: the CUDA executor cannot run this plan ({e})"),
                ..NodeLevel.step(plan, micro_step)
            },
        }
    }
}

/// The step memory of `plan` lowered as `program`: its allocation beyond the state table's
/// bytes.
pub fn step_memory(plan: &TrainingPlan, program: &Program) -> StepMemory {
    let a = program.allocation();
    let state: u64 = castor_passes::memory::persistent_bytes(plan);
    StepMemory {
        model: "CUDA executor: kernel units".into(),
        arena_bytes: a.arena,
        lower_bound: program.arena_lower_bound,
        order: program
            .arena_order
            .unwrap_or(castor_passes::memory::PlacementOrder::BySize),
        workspace: a.workspace,
        other: a.total() - a.arena - a.workspace - state.min(a.state),
    }
}
