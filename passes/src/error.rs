//! The passes' error type.

use castor_ir::IrError;

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// Two rules of a policy disagree about one node or op kind.
    #[error("conflicting precision rules for {subject}: {first} and {second}")]
    Conflict {
        subject: String,
        first: String,
        second: String,
    },
    /// A policy (file or command line) is malformed or names something unknown.
    #[error("precision policy {source_name}: {message}")]
    Policy {
        source_name: String,
        message: String,
    },
    /// A pass produced a graph the verifier rejects: a bug in that pass.
    #[error("pass `{pass}` produced an invalid graph: {source}")]
    Verify {
        pass: String,
        #[source]
        source: IrError,
    },
    /// A broken invariant inside a pass (a bug), reported instead of panicking.
    #[error("internal error in pass `{pass}`: {message}")]
    Internal { pass: &'static str, message: String },
    #[error("no pass named `{name}` (passes: {available})")]
    UnknownPass { name: String, available: String },
    /// Training options that cannot be applied to this model.
    #[error("training plan: {0}")]
    Training(String),
    /// A GPU description (`--gpu`) that cannot be read.
    #[error("GPU description {source_name}: {message}")]
    Gpu {
        source_name: String,
        message: String,
    },
    /// A `--remat` mode that is malformed or cannot be met.
    #[error("--remat: {0}")]
    Remat(String),
    #[error(transparent)]
    Ir(#[from] IrError),
}
