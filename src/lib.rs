//! castor: a mixed-precision training compiler for transformer checkpoints.
//!
//! The facade re-exports the workspace crates and holds what the CLI's commands share: the
//! exit-code convention and the batch files that `eval` reads.
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

#[macro_use]
pub mod out;

pub mod adapter;
pub mod anatomy;
pub mod batch;
pub mod chat;
pub mod classifier;
pub mod commands;
pub mod device;
pub mod generate;
pub mod given;
pub mod html;
pub mod memory;
pub mod outputs;
pub mod plot;
pub mod precision;
pub mod report;
pub mod rng;
pub mod text_eval;
pub mod tokenizer;
pub mod training;

pub use castor_ir as ir;
pub use castor_models as models;
pub use castor_passes as passes;
pub use castor_runtime as runtime;

/// Exit codes, documented in README.md.
pub mod codes {
    /// Something unexpected (a bug), or an output that cannot be written.
    pub const FAILURE: u8 = 1;
    /// Bad command-line usage (clap's own code).
    pub const USAGE: u8 = 2;
    /// Invalid input: checkpoint, config, IR text or data file.
    pub const INVALID_INPUT: u8 = 3;
    /// Execution failed (bad bindings, out-of-range data found while running).
    pub const EXECUTION: u8 = 4;
    /// The requested device is not available.
    pub const DEVICE_UNAVAILABLE: u8 = 5;
    /// Stopped by Ctrl-C (after saving), as shells report SIGINT: 128 + 2.
    pub const INTERRUPTED: u8 = 130;
}

/// A run Ctrl-C stopped after it saved: not a failure to report, but not a finished run
/// either, so a script can tell the two apart by the exit code ([`codes::INTERRUPTED`]).
#[derive(Debug, thiserror::Error)]
#[error("interrupted")]
pub struct Interrupted;

/// Errors of the CLI layer itself.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    InvalidInput(String),
    #[error("{0}")]
    DeviceUnavailable(String),
    /// An output path that cannot be written (exit code 1, as the README says of write
    /// errors).
    #[error("{0}")]
    Output(String),
}

/// What kind of failure an error chain is, by the first typed error found in it: the exit
/// code of the CLI and the exception class of the Python API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A checkpoint that cannot be read or does not match its config.
    Checkpoint,
    /// A config.json castor refuses, or a model it cannot build.
    Config,
    /// IR text, a plan file or a graph that does not verify.
    Ir,
    /// A precision policy or a training setting the passes refuse.
    Policy,
    /// Other invalid input: data, batches, flags that contradict each other.
    Input,
    /// The requested device is not available.
    Device,
    /// Execution failed (bad bindings, out-of-range data found while running, out of
    /// memory).
    Execution,
    /// An output that cannot be written.
    Output,
    /// Something unexpected: a bug.
    Internal,
}

impl ErrorKind {
    pub fn of(e: &anyhow::Error) -> ErrorKind {
        use castor_models::ModelError as M;
        for cause in e.chain() {
            if let Some(m) = cause.downcast_ref::<M>() {
                return match m {
                    M::Write { .. } => ErrorKind::Output,
                    M::Config { .. }
                    | M::UnsupportedModelType { .. }
                    | M::UnsupportedArchitecture { .. }
                    | M::UnsupportedActivation { .. }
                    | M::UnsupportedFeature { .. }
                    | M::Objective { .. }
                    | M::GraphSize { .. }
                    | M::NotCausal { .. }
                    | M::NoPadToken { .. } => ErrorKind::Config,
                    M::Graph { .. } => ErrorKind::Ir,
                    _ => ErrorKind::Checkpoint,
                };
            }
            if cause.is::<castor_ir::IrError>() || cause.is::<castor_ir::PlanError>() {
                return ErrorKind::Ir;
            }
            if let Some(p) = cause.downcast_ref::<castor_passes::PassError>() {
                return match p {
                    castor_passes::PassError::Verify { .. }
                    | castor_passes::PassError::Internal { .. } => ErrorKind::Internal,
                    castor_passes::PassError::Ir(_) => ErrorKind::Ir,
                    _ => ErrorKind::Policy,
                };
            }
            if let Some(r) = cause.downcast_ref::<castor_runtime::RuntimeError>() {
                return match r {
                    castor_runtime::RuntimeError::DeviceUnavailable(_) => ErrorKind::Device,
                    _ => ErrorKind::Execution,
                };
            }
            // A launched group whose ranks cannot meet: the peers are what is unavailable.
            if cause.is::<castor_runtime::rendezvous::RendezvousError>() {
                return ErrorKind::Device;
            }
            if let Some(c) = cause.downcast_ref::<CliError>() {
                return match c {
                    CliError::InvalidInput(_) => ErrorKind::Input,
                    CliError::DeviceUnavailable(_) => ErrorKind::Device,
                    CliError::Output(_) => ErrorKind::Output,
                };
            }
        }
        ErrorKind::Internal
    }

    /// The CLI's exit code (README.md).
    pub fn exit_code(self) -> u8 {
        match self {
            ErrorKind::Checkpoint
            | ErrorKind::Config
            | ErrorKind::Ir
            | ErrorKind::Policy
            | ErrorKind::Input => codes::INVALID_INPUT,
            ErrorKind::Device => codes::DEVICE_UNAVAILABLE,
            ErrorKind::Execution => codes::EXECUTION,
            ErrorKind::Output | ErrorKind::Internal => codes::FAILURE,
        }
    }
}

/// Maps an error chain to its exit code by the first typed error found in it.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    ErrorKind::of(e).exit_code()
}

/// An error chain as one line: each cause once. Errors that quote their source in their own
/// message (`cannot read `x`: No such file`) would otherwise print the OS error twice.
pub fn error_message(e: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if message.contains(&text) {
            continue;
        }
        if !message.is_empty() {
            message.push_str(": ");
        }
        message.push_str(&text);
    }
    message
}
