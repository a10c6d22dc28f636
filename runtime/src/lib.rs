//! castor's executors.
//!
//! [`cpu::CpuExecutor`] is the reference executor: it runs a verified [`castor_ir::Graph`] on
//! the host, computing every float op in F32 and rounding each result to the dtype the graph
//! records for it, so a mixed-precision graph gives the values a GPU storing F16/BF16 would.
//! Bad bindings and bad data are [`RuntimeError`]s, never panics.
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod cpu;
pub mod cuda;
pub mod cuda_probe;
mod error;
mod executor;
mod plan;
pub mod ranks;
pub mod rendezvous;

pub use error::RuntimeError;
pub use executor::{CpuStateFn, ExecutorKind, PlanExecutor};
pub use plan::{DeviceTime, LossScale, PlanRunner, StepReport};
