//! castor: a mixed-precision training compiler for transformer checkpoints.
//!
//! The facade re-exports the workspace crates and holds what the CLI's commands share: the
//! exit-code convention and the batch files that `eval` reads.
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod anatomy;
pub mod batch;
pub mod checkpoint;
pub mod commands;
pub mod data;
pub mod device;
pub mod plot;
pub mod precision;
pub mod progress;
pub mod report;
pub mod trainer;
pub mod training;

pub use castor_ir as ir;
pub use castor_models as models;
pub use castor_passes as passes;
pub use castor_runtime as runtime;

/// Exit codes, documented in README.md.
pub mod codes {
    /// Something unexpected (a bug, or an I/O failure writing output).
    pub const FAILURE: u8 = 1;
    /// Bad command-line usage (clap's own code).
    pub const USAGE: u8 = 2;
    /// Invalid input: checkpoint, config, IR text or data file.
    pub const INVALID_INPUT: u8 = 3;
    /// Execution failed (bad bindings, out-of-range data found while running).
    pub const EXECUTION: u8 = 4;
    /// The requested device is not available.
    pub const DEVICE_UNAVAILABLE: u8 = 5;
}

/// Errors of the CLI layer itself.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    InvalidInput(String),
    #[error("{0}")]
    DeviceUnavailable(String),
}

/// Maps an error chain to its exit code by the first typed error found in it.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    for cause in e.chain() {
        if cause.is::<castor_models::ModelError>() || cause.is::<castor_ir::IrError>() {
            return codes::INVALID_INPUT;
        }
        if let Some(p) = cause.downcast_ref::<castor_passes::PassError>() {
            return match p {
                castor_passes::PassError::Verify { .. }
                | castor_passes::PassError::Internal { .. } => codes::FAILURE,
                _ => codes::INVALID_INPUT,
            };
        }
        if let Some(r) = cause.downcast_ref::<castor_runtime::RuntimeError>() {
            return match r {
                castor_runtime::RuntimeError::DeviceUnavailable(_) => codes::DEVICE_UNAVAILABLE,
                _ => codes::EXECUTION,
            };
        }
        if let Some(c) = cause.downcast_ref::<CliError>() {
            return match c {
                CliError::InvalidInput(_) => codes::INVALID_INPUT,
                CliError::DeviceUnavailable(_) => codes::DEVICE_UNAVAILABLE,
            };
        }
    }
    codes::FAILURE
}
