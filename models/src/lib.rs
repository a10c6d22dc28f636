//! castor's Hugging Face front end: a checkpoint folder (config.json + safetensors, single or
//! sharded) or a bare config.json becomes a [`Model`], which lists its parameters, checks them
//! against the checkpoint, loads them as F32 master tensors and builds the forward graph in
//! castor's IR, for the GPT-2, BERT and LLaMA families.
//!
//! Layers, bottom up:
//! * [`safetensors`]: one memory-mapped file, header validated before any tensor is read;
//! * [`checkpoint`]: the folder, the shard index and cross-file checks;
//! * [`config`]: config.json into a validated family config;
//! * [`Model`] (`model.rs`): head and naming-prefix detection, the parameter contract, loading;
//! * `gpt2.rs`, `bert.rs`, `llama.rs`: each family's parameters and graph, on the shared
//!   pieces in `build.rs`;
//! * [`init`] (deterministic initial weights for config-only models), [`writer`] (atomic
//!   safetensors output) and [`finite`] (NaN and Inf in loaded weights, named by tensor).
//!
//! ```no_run
//! let model = castor_models::Model::load("checkpoints/gpt2")?;
//! let graph = model.build_graph(2, 16)?;
//! castor_ir::verify(&graph).expect("front-end graphs verify");
//! let weights = model.load_params()?;
//! # Ok::<(), castor_models::ModelError>(())
//! ```
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod bert;
mod build;
pub mod checkpoint;
pub mod classify;
pub mod config;
mod error;
pub mod finite;
mod gpt2;
pub mod init;
mod llama;
mod model;
mod objective;
pub mod safetensors;
pub mod writer;

pub use build::AttentionImpl;
pub use checkpoint::Checkpoint;
pub use classify::{Labels, ProblemType};
pub use config::{
    Activation, BertConfig, Config, DropoutRates, Family, Gpt2Config, LlamaConfig, ModelConfig,
    SlidingWindow,
};
pub use error::{DtypeProblem, MismatchReport, ModelError, ParamSpec, ShapeMismatch};
pub use finite::{find_non_finite, NonFinite};
pub use init::{init_adapter, init_param};
pub use model::{Head, LoadReport, Model};
pub use objective::{Objective, IGNORE_INDEX};
pub use safetensors::{SafetensorsFile, TensorInfo};
pub use writer::{write_atomically, write_safetensors};
