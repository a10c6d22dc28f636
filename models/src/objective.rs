//! Training objectives: the scalar loss appended to a model's forward graph.
//!
//! - `lm`: causal language modelling as transformers computes it with `labels=`: logits at
//!   position t predict the label at t+1, labels equal to -100 are ignored, and the loss is the
//!   mean over the counted tokens.
//! - `mlm`: masked language modelling: every position with a label other than -100 counts.
//! - `sum`: the sum of the base model's last hidden state (a head-free benchmark objective).

use crate::{Head, Model, ModelError};
use castor_ir::{DType, Graph, GraphBuilder, IrError, Op, ReduceOp, TensorType, Value};
use std::fmt;
use std::str::FromStr;

/// transformers' ignore index for labels.
pub const IGNORE_INDEX: i64 = -100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objective {
    Lm,
    Mlm,
    Sum,
}

impl Objective {
    pub fn name(self) -> &'static str {
        match self {
            Objective::Lm => "lm",
            Objective::Mlm => "mlm",
            Objective::Sum => "sum",
        }
    }

    /// `lm` or `mlm` when the model has that head, else `sum`.
    pub fn auto(model: &Model) -> Objective {
        match model.head() {
            Head::CausalLm => Objective::Lm,
            Head::MaskedLm => Objective::Mlm,
            Head::Base | Head::Pooler => Objective::Sum,
        }
    }

    /// True if the objective reads a `labels` input.
    pub fn needs_labels(self) -> bool {
        !matches!(self, Objective::Sum)
    }
}

impl fmt::Display for Objective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Objective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lm" => Ok(Objective::Lm),
            "mlm" => Ok(Objective::Mlm),
            "sum" => Ok(Objective::Sum),
            other => Err(format!(
                "unknown objective `{other}` (expected lm, mlm or sum)"
            )),
        }
    }
}

impl Model {
    /// The name of the value holding the base model's last hidden state in the forward graph.
    fn hidden_state_name(&self) -> String {
        match (self.family(), self.head()) {
            (_, Head::Base | Head::Pooler) => "last_hidden_state".into(),
            (crate::Family::Gpt2, _) => "ln_f".into(),
            (
                crate::Family::Llama
                | crate::Family::Qwen2
                | crate::Family::Mistral
                | crate::Family::Gemma,
                _,
            ) => "norm".into(),
            (crate::Family::Bert, _) => match &self.config().model {
                crate::ModelConfig::Bert(c) => {
                    format!(
                        "encoder.layer.{}.output.LayerNorm",
                        c.num_hidden_layers.saturating_sub(1)
                    )
                }
                _ => "last_hidden_state".into(),
            },
        }
    }

    /// The forward graph with a scalar loss as its only output. `lm` and `mlm` add an input
    /// `labels` (i64 `[B, T]`).
    pub fn build_loss_graph(
        &self,
        batch: usize,
        seq: usize,
        objective: Objective,
    ) -> Result<Graph, ModelError> {
        let forward = self.build_graph(batch, seq)?;
        let wrong = |message: String| ModelError::Objective {
            objective: objective.name().to_string(),
            architecture: self.architecture().to_string(),
            message,
        };
        let graph_err = |source: IrError| ModelError::Graph {
            architecture: self.architecture().to_string(),
            source,
        };
        let hidden = self.hidden_state_name();
        let mut b = GraphBuilder::from_graph(forward);
        let loss = match objective {
            Objective::Sum => {
                let h = b.graph().lookup(&hidden).ok_or_else(|| {
                    wrong(format!("no last hidden state `%{hidden}` in the graph"))
                })?;
                let axes = (0..b.ty(h).shape.rank()).collect();
                b.op(
                    "loss",
                    Op::Reduce {
                        op: ReduceOp::Sum,
                        axes,
                        keepdim: false,
                    },
                    &[h],
                )
                .map_err(graph_err)?
            }
            Objective::Lm | Objective::Mlm => {
                let expected = if objective == Objective::Lm {
                    Head::CausalLm
                } else {
                    Head::MaskedLm
                };
                if self.head() != expected {
                    return Err(wrong(format!(
                        "needs a {expected} head; this model's head is {}",
                        self.head()
                    )));
                }
                let logits = b
                    .graph()
                    .lookup("logits")
                    .ok_or_else(|| wrong("no `logits` in the graph".into()))?;
                let labels = b
                    .input("labels", TensorType::new(DType::I64, [batch, seq]))
                    .map_err(graph_err)?;
                let (logits, labels, rows) = if objective == Objective::Lm {
                    if seq < 2 {
                        return Err(wrong("needs a sequence of at least 2 tokens".into()));
                    }
                    let l = slice(&mut b, "loss.logits.shifted", logits, 0, seq - 1)
                        .map_err(graph_err)?;
                    let t =
                        slice(&mut b, "loss.labels.shifted", labels, 1, seq).map_err(graph_err)?;
                    (l, t, batch * (seq - 1))
                } else {
                    (logits, labels, batch * seq)
                };
                let vocab = b.ty(logits).shape.last();
                let l2 = b
                    .op(
                        "loss.logits.rows",
                        Op::Reshape {
                            shape: vec![rows, vocab],
                        },
                        &[logits],
                    )
                    .map_err(graph_err)?;
                let t2 = b
                    .op(
                        "loss.labels.rows",
                        Op::Reshape { shape: vec![rows] },
                        &[labels],
                    )
                    .map_err(graph_err)?;
                b.op(
                    "loss",
                    Op::CrossEntropy {
                        ignore_index: IGNORE_INDEX,
                    },
                    &[l2, t2],
                )
                .map_err(graph_err)?
            }
        };
        b.set_outputs(vec![loss]);
        Ok(b.finish())
    }
}

fn slice(
    b: &mut GraphBuilder,
    name: &str,
    v: Value,
    start: usize,
    end: usize,
) -> Result<Value, IrError> {
    b.op(
        name,
        Op::Slice {
            axis: 1,
            start,
            end,
        },
        &[v],
    )
}
