//! castor's executors.
//!
//! [`cpu::CpuExecutor`] is the reference executor: it runs a verified [`castor_ir::Graph`] on
//! the host, computing every float op in F32 and rounding each result to the dtype the graph
//! records for it, so a mixed-precision graph gives the values a GPU storing F16/BF16 would.
//! Bad bindings and bad data are [`RuntimeError`]s, never panics.

pub mod cpu;
mod error;

pub use error::RuntimeError;
