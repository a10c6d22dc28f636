//! The one interface every executor of a training plan offers ([`PlanExecutor`]), and the one
//! name for which executor runs ([`ExecutorKind`]).
//!
//! The CPU executor's [`PlanRunner`], the lowered CUDA program on a GPU or on the host
//! emulator ([`crate::cuda::LoweredPlanRunner`]) and a data-parallel group of either in this
//! process ([`crate::ranks::Ranks`]) all train a plan the same way, so the trainer holds one
//! `Box<dyn PlanExecutor>` and never asks which it is.

use crate::cuda::memory::CudaMemory;
use crate::cuda::profile::KernelProfile;
use crate::{PlanRunner, RuntimeError, StepReport};
use castor_ir::{Tensor, TrainingPlan};
use castor_passes::memory::{MemoryModel, NodeLevel};
use std::collections::HashMap;
use std::sync::Arc;

/// Which executor runs a plan, as `--device` names it once resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExecutorKind {
    /// The CPU reference executor.
    Cpu,
    /// The lowered CUDA program on a GPU.
    Cuda,
    /// The lowered CUDA program, run on the host by the program emulator.
    Emulate,
}

impl ExecutorKind {
    /// The name `--device` takes and the device line prints.
    pub fn name(self) -> &'static str {
        match self {
            ExecutorKind::Cpu => "cpu",
            ExecutorKind::Cuda => "cuda",
            ExecutorKind::Emulate => "emulate",
        }
    }

    /// Whether it runs the lowered CUDA program (on a GPU or on the emulator).
    pub fn runs_cuda_program(self) -> bool {
        !matches!(self, ExecutorKind::Cpu)
    }

    /// The memory model a plan for it is laid out against: the CUDA program's (what the
    /// device allocates) for a GPU and the emulator, the CPU executor's (every value from its
    /// node to its last reader) for the CPU.
    pub fn memory_model(self) -> Arc<dyn MemoryModel> {
        if self.runs_cuda_program() {
            Arc::new(CudaMemory)
        } else {
            Arc::new(NodeLevel)
        }
    }
}

impl std::fmt::Display for ExecutorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A CPU computation over a runner's state (see [`PlanExecutor::on_cpu_state`]).
pub type CpuStateFn<'a> = dyn Fn(&PlanRunner) -> Result<Vec<f64>, RuntimeError> + Sync + 'a;

/// What a trainer asks of an executor holding a training plan and its state.
pub trait PlanExecutor {
    fn plan(&self) -> &TrainingPlan;

    fn kind(&self) -> ExecutorKind;

    /// The device line's name for it: `cpu`, `cpu (4 ranks)`, `cuda (<the GPU>)`,
    /// `emulate (<the emulator>)`.
    fn device(&self) -> String;

    /// One optimizer step over `micro_batches`; its report when `report` asks for it. An
    /// executor with a device queues the step and reads nothing back otherwise, so steps
    /// between reports never wait for the host; the CPU reports every step.
    fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
        report: bool,
    ) -> Result<Option<StepReport>, RuntimeError>;

    /// The mean micro-step loss on held-out `batches` with the current weights, where the
    /// state lives (nothing is copied back for it); the state is unchanged.
    fn validation_loss(&mut self, batches: &[HashMap<String, Tensor>])
        -> Result<f64, RuntimeError>;

    /// The whole state in the single-rank layout (a sharded entry gathered from its ranks).
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError>;

    /// Replaces state entries given in the single-rank layout (resuming).
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError>;

    /// The CPU runner holding the state itself, where the executor is one (no copy needed).
    fn cpu_runner(&self) -> Option<&PlanRunner> {
        None
    }

    /// `f` on the CPU runners that hold the state, every rank at once where a group holds it
    /// (their micro step's collectives need every rank); rank 0's result. `None` where no CPU
    /// runner holds the state: copy it to the host instead.
    fn on_cpu_state(&mut self, _f: &CpuStateFn) -> Option<Result<Vec<f64>, RuntimeError>> {
        None
    }

    /// Each flag set on any rank of a group spread over processes (one exchange between
    /// them); elsewhere the flags as given.
    fn agree(&mut self, flags: [bool; 2]) -> Result<[bool; 2], RuntimeError> {
        Ok(flags)
    }

    /// Device memory the plan holds, where one device program holds it.
    fn allocated_bytes(&self) -> Option<u64> {
        None
    }

    /// What runs the plan's fused attention where a library may (cuDNN, or castor's kernels
    /// and why), for the `attention` line of `castor train`.
    fn attention(&self) -> Option<String> {
        None
    }

    /// Times each step's runs on the device, where there is a device clock.
    fn set_timing(&mut self, _on: bool) {}

    /// Profiles the next step command by command, where there is a device clock.
    fn profile_next_step(&mut self) {}

    /// The last profiled step's commands and device times.
    fn take_kernel_profile(&mut self) -> Option<KernelProfile> {
        None
    }
}

impl PlanExecutor for PlanRunner {
    fn plan(&self) -> &TrainingPlan {
        PlanRunner::plan(self)
    }
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Cpu
    }
    fn device(&self) -> String {
        "cpu".into()
    }
    fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
        _report: bool,
    ) -> Result<Option<StepReport>, RuntimeError> {
        PlanRunner::step(self, micro_batches, lr).map(Some)
    }
    fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        self.micro_step_loss(batches)
    }
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        Ok(PlanRunner::state_entries(self)
            .into_iter()
            .map(|(name, t)| (name.to_string(), t.clone()))
            .collect())
    }
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        PlanRunner::restore(self, entries)
    }
    fn cpu_runner(&self) -> Option<&PlanRunner> {
        Some(self)
    }
    fn on_cpu_state(&mut self, f: &CpuStateFn) -> Option<Result<Vec<f64>, RuntimeError>> {
        Some(f(self))
    }
}
