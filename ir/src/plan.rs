//! Training plans: one training step as data.
//!
//! A [`TrainingPlan`] is two graphs and a table of persistent state. The *micro step*
//! (forward and backward of one micro-batch) runs `grad_accum` times per step; the *optimizer
//! step* (global gradient norm, one fused update per parameter buffer, step counter, loss-scale
//! update) runs once. Each graph's sources are bound by name: `input`s to the batch (and the
//! learning rate), `param`s and `state`s to the state table. After a graph runs, each of its
//! [`Write`]s stores an output into a state entry, which is how a step updates the masters,
//! moments, gradients and scaler.
//!
//! Plans serialize to JSON, with each graph in the IR text format (the one format that
//! prints and parses), so a plan written by `castor compile` runs anywhere.

use crate::{text, DType, Graph, IrError, TensorType};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// The format tag written into every plan file.
pub const PLAN_FORMAT: &str = "castor-training-plan/1";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingPlan {
    pub format: String,
    pub settings: TrainSettings,
    /// Forward and backward of one micro-batch.
    #[serde(with = "graph_text")]
    pub micro_step: Graph,
    /// Outputs of the micro step stored into state after every micro-batch.
    pub micro_step_writes: Vec<Write>,
    /// The update, once per step after `grad_accum` micro steps.
    #[serde(with = "graph_text")]
    pub optimizer_step: Graph,
    pub optimizer_step_writes: Vec<Write>,
    /// Every persistent buffer, in a fixed order.
    pub state: Vec<StateSpec>,
    /// Groups of pointwise nodes that run as one generated kernel each.
    #[serde(default)]
    pub fused_kernels: Vec<FusedKernel>,
}

/// A group of pointwise nodes of one graph that runs as one kernel: the members in order (by
/// their first result's name), which read the group's inputs and each other, and the CUDA C
/// source generated for them. Its results are the members' values that are read outside the
/// group. Each member's result is rounded to its dtype exactly where the unfused graph stores
/// it, so fused and unfused execution agree bit for bit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FusedKernel {
    /// The kernel's entry point.
    pub name: String,
    /// `micro_step` or `optimizer_step`.
    pub graph: String,
    pub members: Vec<String>,
    pub source: String,
}

/// Output `output` of a graph is stored into the state entry `state`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Write {
    pub output: String,
    pub state: String,
}

/// One persistent buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateSpec {
    pub name: String,
    #[serde(with = "type_text")]
    pub ty: TensorType,
    pub role: StateRole,
    pub init: StateInit,
}

/// What a persistent buffer is for (the rows of the memory anatomy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateRole {
    /// F32 master weights.
    Master,
    /// A low-precision working copy of a master.
    WorkingCopy,
    /// F32 gradients (accumulated over micro-batches).
    Gradient,
    /// Optimizer moments.
    OptimizerState,
    /// Step count and loss-scaler state.
    Control,
}

/// How a persistent buffer starts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateInit {
    /// The checkpoint tensor of this name.
    Checkpoint(String),
    /// The named master rounded to the buffer's dtype.
    CopyOf(String),
    Zeros,
    /// These values, one per element.
    Values(Vec<f64>),
}

/// The settings a plan was built with: recorded for logs and checkpoints; the graphs hold
/// everything the step computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSettings {
    pub precision: String,
    pub objective: String,
    pub batch: usize,
    pub seq: usize,
    pub grad_accum: usize,
    pub optimizer: OptimizerKind,
    /// Global-norm clipping threshold; 0 = none.
    pub max_grad_norm: f64,
    pub loss_scaling: LossScaling,
    /// Parameters that are not trained.
    pub frozen: Vec<String>,
    /// Parameters trained without weight decay.
    pub no_decay: Vec<String>,
    /// Weight gradients computed in the working copy's dtype (then widened to F32), as
    /// PyTorch autocast does, rather than written in F32 by their contractions.
    #[serde(default)]
    pub param_grads_in_compute_dtype: bool,
    /// What the micro step recomputes in its backward part instead of keeping.
    #[serde(default, skip_serializing_if = "Remat::is_none")]
    pub remat: Remat,
}

/// Rematerialization: which forward values the backward part recomputes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Remat {
    /// Keep every forward value the backward part reads.
    #[default]
    None,
    /// Keep each transformer block's input; recompute the rest of the block.
    Full,
    /// Recompute the attention scores and softmax and cheap pointwise and layout ops; keep
    /// contraction and normalization outputs.
    Selective,
    /// Keep what fits: the step's simulated peak stays within this many bytes.
    Budget(u64),
}

impl Remat {
    pub fn is_none(&self) -> bool {
        *self == Remat::None
    }
}

impl std::fmt::Display for Remat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Remat::None => f.write_str("none"),
            Remat::Full => f.write_str("full"),
            Remat::Selective => f.write_str("selective"),
            Remat::Budget(b) => write!(f, "budget:{b}"),
        }
    }
}

impl std::str::FromStr for Remat {
    type Err = String;

    /// `none`, `full`, `selective` or `budget:<bytes>`, the bytes a number with an optional
    /// unit (`B`, `KB`/`MB`/`GB`/`TB` = powers of 1000, `KiB`/`MiB`/`GiB`/`TiB` = of 1024).
    fn from_str(s: &str) -> Result<Remat, String> {
        match s.trim() {
            "none" => Ok(Remat::None),
            "full" => Ok(Remat::Full),
            "selective" => Ok(Remat::Selective),
            other => match other.strip_prefix("budget:") {
                Some(b) => parse_bytes(b).map(Remat::Budget).ok_or_else(|| {
                    format!(
                        "`{other}`: the budget must be a byte count such as 20GiB, 1.5GB or 123456"
                    )
                }),
                None => Err(format!(
                    "`{other}`: expected none, full, selective or budget:<bytes>"
                )),
            },
        }
    }
}

/// `123456`, `20GiB`, `1.5 GB`: bytes, rounded down.
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().ok()?;
    let mult: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024f64.powi(2),
        "GiB" => 1024f64.powi(3),
        "TiB" => 1024f64.powi(4),
        _ => return None,
    };
    let bytes = num * mult;
    (0.0..1.8e19).contains(&bytes).then_some(bytes as u64)
}

impl Serialize for Remat {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Remat {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Remat, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum OptimizerKind {
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    Sgd {
        momentum: f64,
        weight_decay: f64,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LossScaling {
    None,
    Static {
        scale: f64,
    },
    Dynamic {
        init_scale: f64,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: usize,
        hysteresis: usize,
        max_scale: f64,
        /// Training stops with an error when the scale falls below this.
        min_scale: f64,
    },
}

/// A plan file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("not a castor training plan: {0}")]
    Json(#[from] serde_json::Error),
    #[error("training plan format `{found}` is not supported (expected `{PLAN_FORMAT}`)")]
    Format { found: String },
    #[error("training plan: {graph} graph: {source}")]
    Graph {
        graph: &'static str,
        #[source]
        source: IrError,
    },
    #[error("training plan: {0}")]
    Inconsistent(String),
}

impl TrainingPlan {
    pub fn to_json(&self) -> String {
        // A plan holds only strings, numbers and lists: serialization cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Parses and checks a plan: both graphs verify, every source and write names a state
    /// entry (or, for sources, a graph input) of the right type.
    pub fn from_json(text: &str) -> Result<TrainingPlan, PlanError> {
        let plan: TrainingPlan = serde_json::from_str(text)?;
        if plan.format != PLAN_FORMAT {
            return Err(PlanError::Format {
                found: plan.format.clone(),
            });
        }
        plan.check()?;
        Ok(plan)
    }

    pub fn state_spec(&self, name: &str) -> Option<&StateSpec> {
        self.state.iter().find(|s| s.name == name)
    }

    /// The structural invariants `from_json` relies on.
    pub fn check(&self) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError::Inconsistent(m));
        let mut names = HashSet::new();
        for s in &self.state {
            if !names.insert(s.name.as_str()) {
                return bad(format!("state `{}` is listed twice", s.name));
            }
            if let StateInit::Values(v) = &s.init {
                if Some(v.len()) != s.ty.shape.numel() {
                    return bad(format!(
                        "state `{}` ({}) has {} initial values",
                        s.name,
                        s.ty,
                        v.len()
                    ));
                }
            }
        }
        for (label, g, writes) in [
            ("micro-step", &self.micro_step, &self.micro_step_writes),
            (
                "optimizer-step",
                &self.optimizer_step,
                &self.optimizer_step_writes,
            ),
        ] {
            crate::verify(g).map_err(|source| PlanError::Graph {
                graph: label,
                source,
            })?;
            for (_, node) in g.nodes() {
                if !matches!(node.op, crate::Op::Param | crate::Op::State) {
                    continue;
                }
                let v = node.outputs[0];
                match self.state_spec(g.name(v)) {
                    Some(s) if &s.ty == g.ty(v) => {}
                    Some(s) => {
                        return bad(format!(
                            "{label} graph reads `%{}` as {} but the state holds {}",
                            g.name(v),
                            g.ty(v),
                            s.ty
                        ))
                    }
                    None => {
                        return bad(format!(
                            "{label} graph reads `%{}`, which is not in the state table",
                            g.name(v)
                        ))
                    }
                }
            }
            for w in writes {
                let Some(v) = g.outputs().iter().find(|&&v| g.name(v) == w.output) else {
                    return bad(format!(
                        "{label} graph has no output `%{}` to write to `{}`",
                        w.output, w.state
                    ));
                };
                match self.state_spec(&w.state) {
                    Some(s) if &s.ty == g.ty(*v) => {}
                    _ => {
                        return bad(format!(
                            "{label} graph output `%{}` ({}) does not fit state `{}`",
                            w.output,
                            g.ty(*v),
                            w.state
                        ))
                    }
                }
            }
        }
        if self.settings.grad_accum == 0 {
            return bad("grad_accum must be at least 1".into());
        }
        Ok(())
    }

    /// Bytes of persistent state by role.
    pub fn state_bytes(&self, role: StateRole) -> u64 {
        self.state
            .iter()
            .filter(|s| s.role == role)
            .map(|s| s.ty.size_bytes().unwrap_or(0) as u64)
            .sum()
    }
}

impl StateRole {
    pub fn describe(self) -> &'static str {
        match self {
            StateRole::Master => "F32 master weights",
            StateRole::WorkingCopy => "low-precision weights",
            StateRole::Gradient => "gradients",
            StateRole::OptimizerState => "optimizer state",
            StateRole::Control => "step and loss-scale state",
        }
    }
}

/// Graphs as IR text inside the JSON.
mod graph_text {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(g: &Graph, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&text::print(g))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Graph, D::Error> {
        let src = String::deserialize(d)?;
        text::parse(&src).map_err(serde::de::Error::custom)
    }
}

/// Types as their IR text (`bf16[768, 768]`).
mod type_text {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &TensorType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&t.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TensorType, D::Error> {
        let src = String::deserialize(d)?;
        parse_type(&src).ok_or_else(|| serde::de::Error::custom(format!("bad tensor type `{src}`")))
    }

    fn parse_type(s: &str) -> Option<TensorType> {
        let (dtype, rest) = s.split_once('[')?;
        let dtype: DType = dtype.trim().parse().ok()?;
        let dims = rest.strip_suffix(']')?;
        let dims = if dims.trim().is_empty() {
            Vec::new()
        } else {
            dims.split(',')
                .map(|d| d.trim().parse::<usize>().ok())
                .collect::<Option<Vec<_>>>()?
        };
        Some(TensorType::new(dtype, dims))
    }
}
