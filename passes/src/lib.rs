//! castor's compiler passes.
//!
//! A [`Pass`] takes a graph and returns a new graph and a [`PassReport`]; a [`Pipeline`] runs
//! passes in order, optionally verifying after each and keeping the IR text after a named
//! pass. The precision passes are here: [`Classify`], [`Autocast`] (driven by a declarative
//! [`Policy`] table, kept apart from the engine that applies it) and [`FoldCasts`].
//!
//! Passes transform [`castor_ir::Graph`]s and never touch a device or a file (policy files
//! are read by the caller and handed over as text).
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod autocast;
mod autodiff;
mod classify;
pub mod cost;
mod error;
mod fold_casts;
mod fp8;
pub mod fusion;
pub mod gpus;
pub mod lora;
pub mod memory;
pub mod names;
mod pass;
mod pipeline;
mod policy;
pub mod remat;
mod summary;
mod training;

pub use autocast::Autocast;
pub use autodiff::{grad_name, Autodiff, Seed};
pub use classify::Classify;
pub use error::PassError;
pub use fold_casts::FoldCasts;
pub use pass::{Pass, PassReport};
pub use pipeline::{Pipeline, PipelineOutput};
// The policy families are defined beside the plan that records them.
pub use castor_ir::Precision;
pub use fp8::Fp8Products;
pub use policy::{
    Fp8Options, NameRule, Policy, PolicyFileFormat, Rule, Target, DEFAULT_AMAX_HISTORY,
};
pub use summary::{decisions, explain, precision_summary, Decision, PrecisionSummary};
pub use training::{build_training_plan, PlanBuild, PlanPass, TrainingOutput, TrainingPipeline};

/// The passes `castor compile` runs, in order, for a policy (`fp8` only under
/// `--precision fp8`).
pub fn precision_pipeline(policy: Policy) -> Pipeline {
    let mut passes: Vec<Box<dyn Pass>> = vec![
        Box::new(Classify),
        Box::new(Autocast::new(policy.clone())),
        Box::new(FoldCasts),
    ];
    if policy.precision.is_fp8() {
        passes.push(Box::new(Fp8Products::new(
            policy.fp8().clone(),
            policy.precision.is_delayed(),
        )));
    }
    Pipeline::new(passes)
}
