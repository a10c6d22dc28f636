//! The memory model each command plans against: the one of the executor that runs the step.
//! The CUDA executor's ([`castor_runtime::cuda::memory::CudaMemory`]: the step lowered as it
//! runs, what the device allocates) for `compile`, for training on a GPU or the emulator and
//! for verdicts against a GPU's memory; the CPU executor's ([`NodeLevel`]: every value from
//! its node to its last reader) for training on the CPU. The remat budget, the memory anatomy,
//! the fit verdict and the report read the same model, so each shows the same number.

use crate::device::Selected;
use castor_ir::TrainingPlan;
use castor_passes::memory::{Anatomy, MemoryModel, NodeLevel};
use castor_passes::TrainingPipeline;
use castor_runtime::cuda::memory::CudaMemory;
use std::sync::Arc;

/// The executor whose memory a plan is laid out for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executor {
    Cpu,
    /// The CUDA program, on a GPU or on the host emulator.
    Cuda,
}

impl Executor {
    /// The executor `--device` selected.
    pub fn of(device: &Selected) -> Executor {
        match device {
            Selected::Cpu => Executor::Cpu,
            Selected::Cuda(_) | Selected::Emulated => Executor::Cuda,
        }
    }

    /// Its memory model.
    pub fn model(self) -> Arc<dyn MemoryModel> {
        match self {
            Executor::Cpu => Arc::new(NodeLevel),
            Executor::Cuda => Arc::new(CudaMemory),
        }
    }

    /// The training build, its remat budget checked against this executor's model.
    pub fn pipeline(self) -> TrainingPipeline {
        TrainingPipeline::default().memory_model(self.model())
    }

    /// The plan's memory anatomy under this executor's model.
    pub fn anatomy(self, plan: &TrainingPlan) -> Anatomy {
        Anatomy::of_plan(plan, self.model().as_ref())
    }
}
