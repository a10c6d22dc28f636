//! The CUDA executor.
//!
//! A graph or training plan is lowered ([`lower`]) to a [`program::Program`]: plain data
//! naming every kernel launch, cuBLAS product, copy and buffer of a run. The device layer
//! ([`device`]) compiles the program's modules with NVRTC (through the on-disk PTX cache),
//! makes one arena allocation for the transients at the planner's offsets plus one buffer per
//! persistent slot, captures each run in a CUDA graph and replays it. [`runner`] holds a
//! training plan's state on the device and runs steps, reading losses back only when asked.

pub mod device;
pub mod emulate;
pub mod families;
pub mod kernel_id;
pub mod lower;
pub mod memory;
pub mod nccl;
pub mod profile;
pub mod program;
pub mod roofline;
pub mod runner;
pub mod sdpa;
pub mod target;

pub use runner::{
    CudaGraphRunner, CudaPlanRunner, EmulatedGraphRunner, EmulatedPlanRunner, LoweredGraphRunner,
    LoweredPlanRunner,
};
pub use target::{Gpu, Target};

/// Device buffers and arena offsets are 256-byte aligned, as cudaMalloc's.
pub fn align(bytes: u64) -> u64 {
    bytes.div_ceil(256) * 256
}
