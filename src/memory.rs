//! The memory model castor's commands plan against: the CUDA executor's
//! ([`castor_runtime::cuda::memory::CudaMemory`]). The remat budget, the memory anatomy, the
//! fit verdict and the report all read it, so each shows what the device allocates.

use castor_ir::TrainingPlan;
use castor_passes::memory::{Anatomy, MemoryModel};
use castor_passes::TrainingPipeline;
use castor_runtime::cuda::memory::CudaMemory;
use std::sync::Arc;

/// The model every command plans against.
pub fn model() -> Arc<dyn MemoryModel> {
    Arc::new(CudaMemory)
}

/// The training build, its remat budget checked against [`model`].
pub fn pipeline() -> TrainingPipeline {
    TrainingPipeline::default().memory_model(model())
}

/// The plan's memory anatomy under [`model`].
pub fn anatomy(plan: &TrainingPlan) -> Anatomy {
    Anatomy::of_plan(plan, &CudaMemory)
}
