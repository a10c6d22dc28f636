//! The memory model each command plans against: the one of the executor that runs the step
//! ([`ExecutorKind::memory_model`]). The CUDA executor's
//! ([`castor_runtime::cuda::memory::CudaMemory`]: the step lowered as it runs, what the device
//! allocates) for `compile`, for training on a GPU or the emulator and for verdicts against a
//! GPU's memory; the CPU executor's ([`castor_passes::memory::NodeLevel`]: every value from
//! its node to its last reader) for training on the CPU. The remat budget, the memory anatomy,
//! the fit verdict and the report read the same model, so each shows the same number.

use castor_ir::TrainingPlan;
use castor_passes::memory::Anatomy;
use castor_passes::TrainingPipeline;
use castor_runtime::ExecutorKind;

/// The training build, its remat budget checked against `executor`'s memory model.
pub fn pipeline(executor: ExecutorKind) -> TrainingPipeline {
    TrainingPipeline::default().memory_model(executor.memory_model())
}

/// The plan's memory anatomy under `executor`'s memory model.
pub fn anatomy(executor: ExecutorKind, plan: &TrainingPlan) -> Anatomy {
    Anatomy::of_plan(plan, executor.memory_model().as_ref())
}
