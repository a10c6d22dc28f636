//! The runtime's error type.
//!
//! Every variant names where the problem is (a value or node name, as printed in the IR text)
//! and what was expected versus found, so a failed run can be traced back to the model.

use castor_ir::{IrError, Shape, TensorType};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RuntimeError {
    /// The graph failed verification; executors only run verified graphs.
    #[error("graph `{graph}` is not valid: {source}")]
    InvalidGraph {
        graph: String,
        #[source]
        source: IrError,
    },
    /// An `input` or `param` value has no tensor bound to its name.
    #[error("no tensor is bound to `%{name}` (expected {expected})")]
    MissingBinding { name: String, expected: TensorType },
    /// The tensor bound to a source has another dtype or shape than the graph declares.
    #[error("the tensor bound to `%{name}` should be {expected}, found {found}")]
    BindingMismatch {
        name: String,
        expected: TensorType,
        found: TensorType,
    },
    /// An index read from data (a token id, a label) is outside `[0, limit)`.
    #[error("node `%{node}`: {what} {index} at position {position} is out of range [0, {limit})")]
    IndexOutOfRange {
        node: String,
        what: &'static str,
        index: i64,
        position: usize,
        limit: usize,
    },
    /// A key-padding mask that cuDNN's fused attention cannot express by sequence lengths.
    #[error(
        "node `%{node}`: cuDNN's fused attention takes key-padding masks by sequence lengths, \
         so each row must keep its first keys and drop the rest (right padding), keeping at \
         least one; row {row} {problem}. castor's kernels take any mask: run with \
         --attention fused"
    )]
    MaskNotRightPadded {
        node: String,
        row: usize,
        problem: String,
    },
    /// A `max` reduction over an axis of length 0, which has no value (PyTorch raises too).
    #[error("node `%{node}`: max over an empty axis of {shape}")]
    EmptyReduction { node: String, shape: Shape },
    /// Dynamic loss scaling backed off below its minimum: gradients overflow at every scale.
    #[error(
        "step {step}: the loss scale fell to {scale}, below the minimum {min}; gradients \
         overflow F16 at every scale (train in bf16, lower the learning rate, or lower \
         --min-scale)"
    )]
    LossScaleUnderflow {
        step: u64,
        scale: crate::LossScale,
        min: crate::LossScale,
    },
    /// Every step of a run was skipped for non-finite gradients: nothing was trained.
    #[error("all {steps} step(s) were skipped, nothing was trained: {why}")]
    EveryStepSkipped { steps: u64, why: String },
    /// No CUDA device can be used (no driver, no device, no cuBLAS or NVRTC library).
    #[error("{0}")]
    DeviceUnavailable(String),
    /// The CUDA executor cannot run here or failed (no driver, a kernel that does not
    /// compile, a device error), with what and where.
    #[error("{0}")]
    Cuda(String),
    /// A lowered program failed on the host emulator (`--device emulate`): a lowering bug
    /// the emulator's checks caught (an access out of bounds, a read of bytes nothing wrote,
    /// an overlap a kernel does not allow), with the command and argument.
    #[error("the CUDA program failed on the emulator: {0}")]
    Emulated(String),
    /// The plan does not fit in the device's free memory (how much it needs and what to do).
    #[error("{0}")]
    OutOfMemory(String),
    /// The training plan breaks its contract (a missing or renamed control entry).
    #[error("{0}")]
    Plan(String),
    /// A broken invariant of the executor or of the IR's tensors (a bug in castor), reported
    /// rather than panicking.
    #[error("node `%{node}`: internal error: {message}")]
    Internal { node: String, message: String },
}

impl From<castor_ir::PlanError> for RuntimeError {
    fn from(e: castor_ir::PlanError) -> Self {
        RuntimeError::Plan(e.to_string())
    }
}
