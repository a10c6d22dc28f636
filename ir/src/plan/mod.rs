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
//! The control entries (step, loss scale, scaler counters) and the optimizer step's
//! learning-rate input and gradient-norm output are named once, in [`control`], and
//! [`TrainingPlan::check`] requires them: an executor never falls back to a default.
//!
//! Plans serialize to JSON, with each graph in the IR text format (the one format that
//! prints and parses), so a plan written by `castor compile` runs anywhere.

mod control;
mod differences;
mod settings;

pub use control::{ControlState, GRAD_NORM, LEARNING_RATE};
pub use differences::{show_value, Difference, Setting};
pub use settings::{
    Classifier, Dropout, Epilogues, LoraBase, LoraSettings, LossScaling, OptimizerKind, Parallel,
    Remat, TrainSettings,
};

use crate::{text, DType, Graph, IrError, KernelUnit, Shape, TensorType};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The format tag written into every plan file.
pub const PLAN_FORMAT: &str = "castor-training-plan/3";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingPlan {
    pub format: String,
    pub settings: TrainSettings,
    /// Forward and backward of one micro-batch.
    #[serde(with = "graph_text")]
    pub micro_step: Graph,
    /// The first `forward_nodes` nodes of the micro step are the forward pass (the loss);
    /// the rest is the backward pass, recomputation and gradient accumulation.
    pub forward_nodes: usize,
    /// Outputs of the micro step stored into state after every micro-batch.
    pub micro_step_writes: Vec<Write>,
    /// The update, once per step after `grad_accum` micro steps.
    #[serde(with = "graph_text")]
    pub optimizer_step: Graph,
    pub optimizer_step_writes: Vec<Write>,
    /// Every persistent buffer, in a fixed order.
    pub state: Vec<StateSpec>,
    /// What runs as one kernel in each graph (see [`crate::KernelUnit`]), in the order the
    /// units run; a node in no unit runs on its own.
    pub kernel_units: Vec<KernelUnit>,
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
    /// For an entry a data-parallel rank keeps a flat shard of (`castor_ir::Op::Shard`): the
    /// type of the whole value, which the ranks' shards together hold.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "opt_type_text"
    )]
    pub shard_of: Option<TensorType>,
}

/// What a persistent buffer is for (the rows of the memory anatomy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateRole {
    /// F32 master weights.
    Master,
    /// A low-precision working copy of a master.
    WorkingCopy,
    /// A parameter that is not trained (the base under LoRA adapters), stored once, in the
    /// dtype the step reads it in, from the checkpoint: no master, gradient or moments.
    Frozen,
    /// F32 gradients (accumulated over micro-batches).
    Gradient,
    /// Optimizer moments.
    OptimizerState,
    /// Step count and loss-scaler state.
    Control,
    /// FP8 delayed scaling: each cast's amax history and the scale it reads.
    Fp8Scaling,
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
    /// One part of the checkpoint tensor `tensor` quantized to NF4 ([`crate::nf4`], blocks of
    /// [`crate::nf4::NF4_BLOCK`]).
    Nf4 {
        tensor: String,
        part: Nf4Part,
    },
    /// One part of the named master's FP8 copy in `format`, made as the `fp8_scale` and
    /// `quantize` ops make it from the master: the scale of its amax, and the values times
    /// that scale, rounded (nearest even, saturating).
    Fp8CopyOf {
        master: String,
        format: crate::DType,
        part: Fp8Part,
    },
}

/// The two state entries of a weight's FP8 copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Part {
    /// The FP8 values, in the master's shape.
    Values,
    /// Their scale (F32 scalar): the values are the master times it.
    Scale,
}

impl Fp8Part {
    /// The entry's name for weight `weight`.
    pub fn name(self, weight: &str) -> String {
        match self {
            Fp8Part::Values => format!("{weight}.fp8"),
            Fp8Part::Scale => format!("{weight}.fp8_scale"),
        }
    }
}

/// The two state entries of a weight stored in NF4.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Nf4Part {
    /// The packed 4-bit codes, two per byte: u8 `[ceil(n / 2)]`.
    Codes,
    /// One F32 absolute maximum per block: f32 `[ceil(n / 64)]`.
    Absmax,
}

impl Nf4Part {
    /// The entry's name for weight `weight`.
    pub fn name(self, weight: &str) -> String {
        match self {
            Nf4Part::Codes => format!("{weight}.nf4_codes"),
            Nf4Part::Absmax => format!("{weight}.nf4_absmax"),
        }
    }

    /// The entry's type for a weight of `numel` values.
    pub fn ty(self, numel: usize) -> crate::TensorType {
        match self {
            Nf4Part::Codes => {
                crate::TensorType::new(crate::DType::U8, crate::Shape(vec![numel.div_ceil(2)]))
            }
            Nf4Part::Absmax => crate::TensorType::new(
                crate::DType::F32,
                crate::Shape(vec![numel.div_ceil(crate::nf4::NF4_BLOCK)]),
            ),
        }
    }

    /// This part of the quantized weight `q`.
    pub fn of(self, q: &crate::nf4::Nf4) -> crate::Tensor {
        match self {
            Nf4Part::Codes => {
                crate::Tensor::from_u8(crate::Shape(vec![q.packed.len()]), q.packed.clone())
            }
            Nf4Part::Absmax => crate::Tensor::from_f32(
                crate::DType::F32,
                crate::Shape(vec![q.absmax.len()]),
                q.absmax.clone(),
            ),
        }
    }
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

    /// The state entry of a control value; [`TrainingPlan::check`] guarantees it for every
    /// entry the plan's loss scaling requires.
    pub fn control(&self, c: ControlState) -> Result<&StateSpec, PlanError> {
        self.state_spec(c.name())
            .filter(|s| s.role == StateRole::Control)
            .ok_or_else(|| PlanError::Inconsistent(format!("the plan has no control entry `{c}`")))
    }

    /// The structural invariants `from_json` relies on, and the control contract: every
    /// control entry the loss scaling requires exists with its type, every entry of role
    /// control is one castor knows, and the optimizer step takes the learning rate and
    /// returns the gradient norm.
    pub fn check(&self) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError::Inconsistent(m));
        let mut by_name: HashMap<&str, &StateSpec> = HashMap::with_capacity(self.state.len());
        for s in &self.state {
            if by_name.insert(s.name.as_str(), s).is_some() {
                return bad(format!("state `{}` is listed twice", s.name));
            }
            if s.role == StateRole::Control && ControlState::from_name(&s.name).is_none() {
                let known: Vec<&str> = ControlState::ALL.iter().map(|c| c.name()).collect();
                return bad(format!(
                    "state `{}` has role control but is no control entry castor knows ({})",
                    s.name,
                    known.join(", ")
                ));
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
        for c in ControlState::ALL {
            match by_name.get(c.name()) {
                Some(s) if s.role == StateRole::Control && s.ty == c.ty() => {}
                Some(s) => {
                    return bad(format!(
                        "control entry `{c}` must be {} with role control, found {} ({:?})",
                        c.ty(),
                        s.ty,
                        s.role
                    ))
                }
                None if c.required(&self.settings.loss_scaling) => {
                    return bad(format!("the plan has no control entry `{c}`"))
                }
                None => {}
            }
        }
        if self.forward_nodes > self.micro_step.num_nodes() {
            return bad(format!(
                "the forward pass has {} nodes but the micro step only {}",
                self.forward_nodes,
                self.micro_step.num_nodes()
            ));
        }
        let scalar = TensorType::new(DType::F32, Shape::scalar());
        let lr = self.optimizer_step.lookup(LEARNING_RATE);
        if lr.is_none_or(|v| {
            self.optimizer_step
                .node(self.optimizer_step.value(v).producer)
                .op
                != crate::Op::Input
                || self.optimizer_step.ty(v) != &scalar
        }) {
            return bad(format!(
                "the optimizer step must take the learning rate as an f32[] input `%{LEARNING_RATE}`"
            ));
        }
        if !self.optimizer_step.outputs().iter().any(|&v| {
            self.optimizer_step.name(v) == GRAD_NORM && self.optimizer_step.ty(v) == &scalar
        }) {
            return bad(format!(
                "the optimizer step must return the gradient norm as an f32[] output `%{GRAD_NORM}`"
            ));
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
                match by_name.get(g.name(v)) {
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
            let outputs: HashMap<&str, crate::Value> =
                g.outputs().iter().map(|&v| (g.name(v), v)).collect();
            for w in writes {
                let Some(v) = outputs.get(w.output.as_str()) else {
                    return bad(format!(
                        "{label} graph has no output `%{}` to write to `{}`",
                        w.output, w.state
                    ));
                };
                match by_name.get(w.state.as_str()) {
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
        for unit in &self.kernel_units {
            let g = match unit.graph.as_str() {
                "micro_step" => &self.micro_step,
                "optimizer_step" => &self.optimizer_step,
                other => {
                    return bad(format!(
                        "kernel unit `{}` belongs to graph `{other}`, which the plan does not have",
                        unit.name
                    ))
                }
            };
            if let Some(m) = unit.members.iter().find(|m| g.lookup(m).is_none()) {
                return bad(format!(
                    "kernel unit `{}` has member `%{m}`, which the {} graph does not make",
                    unit.name, unit.graph
                ));
            }
            if let crate::UnitKind::Pointwise(body) = &unit.kind {
                body.check()
                    .or_else(|m| bad(format!("kernel unit `{}`: {m}", unit.name)))?;
            }
        }
        if self.settings.grad_accum == 0 {
            return bad("grad_accum must be at least 1".into());
        }
        Ok(())
    }

    /// The kernel units of graph `graph` (`micro_step`, `optimizer_step`).
    pub fn units_of(&self, graph: &str) -> Vec<KernelUnit> {
        self.kernel_units
            .iter()
            .filter(|u| u.graph == graph)
            .cloned()
            .collect()
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
            StateRole::Frozen => "frozen base weights",
            StateRole::Gradient => "gradients",
            StateRole::OptimizerState => "optimizer state",
            StateRole::Control => "step and loss-scale state",
            StateRole::Fp8Scaling => "FP8 scales and amax histories",
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
/// An optional tensor type in the IR text format, absent when none.
mod opt_type_text {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Option<TensorType>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&t.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<TensorType>, D::Error> {
        let src = String::deserialize(d)?;
        super::type_text::parse_type(&src)
            .map(Some)
            .ok_or_else(|| serde::de::Error::custom(format!("bad tensor type `{src}`")))
    }
}

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

    pub(super) fn parse_type(s: &str) -> Option<TensorType> {
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
