//! castor's tensor IR.
//!
//! A [`Graph`] holds nodes and values in arenas addressed by typed `u32` ids ([`Node`],
//! [`Value`]); both are stored in definition order, which is a topological order. Each node
//! applies one [`Op`]; each op has one [`OpClass`]. The text format ([`text::print`],
//! [`text::parse`]) round-trips exactly; [`verify`] checks every invariant; [`to_dot`] draws a
//! graph.
//!
//! This crate knows nothing of files, devices or passes.
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod builder;
mod bytes;
mod dot;
mod dtype;
mod entities;
mod error;
pub mod fp8;
mod graph;
pub mod nf4;
mod op;
pub mod optim;
pub mod philox;
mod plan;
mod precision;
pub mod quant;
mod rope;
mod shape;
mod structure;
mod tensor;
pub mod text;
mod units;
mod verify;

pub use builder::{is_name_char, sanitize_name, GraphBuilder};
pub use bytes::{human_bytes, parse_bytes, thousands};
pub use dot::{dtype_colour, to_dot};
pub use dtype::{round_tf32, Accum, DType, TensorType};
pub use entities::{Node, Value};
pub use error::{IrError, Site};
pub use graph::{Graph, Location, NodeData, Origin, ValueData};
pub use op::{
    adafactor_moments, AttentionDropout, AttentionLibrary, AttentionOperands, Attr, BinaryOp,
    CollectiveOp, Op, OpClass, ReduceOp, UnaryOp,
};
pub use optim::{AdafactorHparams, AdamWHparams, LionHparams, SgdHparams, WeightDecay};
pub use plan::{
    show_value, Classifier, ControlState, Difference, Dropout, Epilogues, Fp8Part, LoraBase,
    LoraSettings, LossScaling, Nf4Part, OptimizerKind, Parallel, PlanError, Remat, Setting,
    StateInit, StateRole, StateSpec, TrainSettings, TrainingPlan, Write, GRAD_NORM, LEARNING_RATE,
    PLAN_FORMAT,
};
pub use precision::Precision;
pub use rope::{rope_inv_freq, RopeScaling};
pub use shape::Shape;
pub use structure::ModelShape;
pub use tensor::{relative_error, round_slice, round_to, Tensor, TensorData};
pub use units::{
    AmaxScale, IndexMap, IndexTerm, KernelUnit, PointwiseBody, Step, UnitAmax, UnitInput, UnitKind,
    UnitOutput,
};
pub use verify::verify;
