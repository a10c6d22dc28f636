//! Training objectives: the scalar loss appended to a model's forward graph.
//!
//! - `lm`: causal language modelling as transformers computes it with `labels=`: logits at
//!   position t predict the label at t+1, labels equal to -100 are ignored, and the loss is the
//!   mean over the counted tokens.
//! - `mlm`: masked language modelling: every position with a label other than -100 counts.
//! - `sum`: the sum of the base model's last hidden state (a head-free benchmark objective).
//! - `classify`: a sequence classification head's loss, as its `forward` computes it with
//!   `labels=`: cross-entropy over the labels (labels i64 `[B]`, -100 ignored) for
//!   `single_label_classification`, the mean squared error (labels f32 `[B, num_labels]`)
//!   for `regression`; `multi_label_classification` is refused.

use crate::{Head, Model, ModelError, ProblemType};
use castor_ir::{BinaryOp, DType, Graph, GraphBuilder, IrError, Op, ReduceOp, TensorType, Value};
use std::fmt;
use std::str::FromStr;

/// transformers' ignore index for labels.
pub const IGNORE_INDEX: i64 = -100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objective {
    Lm,
    Mlm,
    Sum,
    Classify,
}

impl Objective {
    pub fn name(self) -> &'static str {
        match self {
            Objective::Lm => "lm",
            Objective::Mlm => "mlm",
            Objective::Sum => "sum",
            Objective::Classify => "classify",
        }
    }

    /// `lm`, `mlm` or `classify` when the model has that head, else `sum`.
    pub fn auto(model: &Model) -> Objective {
        match model.head() {
            Head::CausalLm => Objective::Lm,
            Head::MaskedLm => Objective::Mlm,
            Head::SequenceClassification => Objective::Classify,
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
            "classify" => Ok(Objective::Classify),
            other => Err(format!(
                "unknown objective `{other}` (expected lm, mlm, classify or sum)"
            )),
        }
    }
}

impl Model {
    /// The name of the value holding the base model's last hidden state in the forward graph.
    fn hidden_state_name(&self) -> String {
        match (self.family(), self.head()) {
            (_, Head::Base | Head::Pooler | Head::SequenceClassification) => {
                "last_hidden_state".into()
            }
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
    /// `labels` (i64 `[B, T]`); `classify` an input `labels` of one class id per sequence
    /// (i64 `[B]`) or, for regression, `num_labels` targets per sequence (f32 `[B, labels]`).
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
            Objective::Classify => {
                if self.head() != Head::SequenceClassification {
                    return Err(wrong(format!(
                        "needs a {} head; this model's head is {}",
                        Head::SequenceClassification,
                        self.head()
                    )));
                }
                let logits = b
                    .graph()
                    .lookup("logits")
                    .ok_or_else(|| wrong("no `logits` in the graph".into()))?;
                classification_loss(&mut b, logits, self.labels(), batch).map_err(|e| match e {
                    LossError::Ir(source) => graph_err(source),
                    LossError::MultiLabel => wrong(
                        "config field `problem_type` is `multi_label_classification`, whose \
                         loss (binary cross-entropy per label) castor does not implement; \
                         `single_label_classification` and `regression` train"
                            .into(),
                    ),
                })?
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

enum LossError {
    Ir(IrError),
    MultiLabel,
}

impl From<IrError> for LossError {
    fn from(e: IrError) -> Self {
        LossError::Ir(e)
    }
}

/// The loss of `*ForSequenceClassification.forward` on `logits` `[B, labels]`.
fn classification_loss(
    b: &mut GraphBuilder,
    logits: Value,
    labels: &crate::Labels,
    batch: usize,
) -> Result<Value, LossError> {
    let n = labels.num_labels;
    match labels.problem() {
        ProblemType::SingleLabel => {
            let t = b.input("labels", TensorType::new(DType::I64, [batch]))?;
            let ce = Op::CrossEntropy {
                ignore_index: IGNORE_INDEX,
            };
            Ok(b.op("loss", ce, &[logits, t])?)
        }
        // MSELoss: the mean over every element (transformers squeezes a single label away,
        // which leaves the same mean).
        ProblemType::Regression => {
            let t = b.input("labels", TensorType::new(DType::F32, [batch, n]))?;
            let d = b.op("loss.diff", Op::Binary(BinaryOp::Sub), &[logits, t])?;
            let sq = b.op("loss.squared", Op::Binary(BinaryOp::Mul), &[d, d])?;
            let mean = Op::Reduce {
                op: ReduceOp::Mean,
                axes: vec![0, 1],
                keepdim: false,
            };
            Ok(b.op("loss", mean, &[sq])?)
        }
        ProblemType::MultiLabel => Err(LossError::MultiLabel),
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
