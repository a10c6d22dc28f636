//! Sequence classification heads (`BertForSequenceClassification`,
//! `LlamaForSequenceClassification`) and the label fields of config.json they read.
//!
//! The families build their base model as for the bare model (BERT with its pooler); this
//! module adds the head on top, so the family files only name the architecture:
//! * BERT: `logits = classifier(pooler_output)` (`classifier.weight` `[labels, hidden]`,
//!   `classifier.bias`); dropout is the identity in eval mode.
//! * decoders: `score` (no bias) on the final-norm hidden state of each row's last
//!   non-padding token. transformers scores every position and then picks one row per
//!   sequence; picking the row first is the same product on fewer rows. Which token is
//!   "last" is transformers' rule ([`last_token_rows`]), computed on the host from the token
//!   ids and fed to the graph as the input `last_token_rows`, the flat row `b * T + t` of
//!   the picked token, which an `embedding` lookup reads out of the `[B * T, hidden]` states
//!   (its gradient is a scatter into those rows).
//!
//! The labels follow transformers' `PretrainedConfig`: `id2label` decides `num_labels` when
//! present (its length), else `num_labels` (default 2); `problem_type` is one of
//! `regression`, `single_label_classification`, `multi_label_classification` or unset, and
//! when unset the loss is decided as `*ForSequenceClassification.forward` decides it: one
//! label is regression, more are single-label classification for integer labels (castor's
//! class labels always are).

use crate::build::Ctx;
use crate::config::Family;
use crate::error::{ModelError, ParamSpec};
use castor_ir::{DType, Op, TensorType, Value};
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// The graph input of a decoder classifier: each sequence's picked row in `[B * T, hidden]`.
pub const LAST_TOKEN_ROWS: &str = "last_token_rows";

/// Labels above this are refused as absurd (the head is `[labels, hidden]`).
pub(crate) const MAX_LABELS: usize = 1 << 20;

/// `problem_type`: which loss a classification head trains with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProblemType {
    /// Cross-entropy over the labels; one integer class per sequence.
    SingleLabel,
    /// Mean squared error; `num_labels` float targets per sequence.
    Regression,
    /// Binary cross-entropy with logits per label (not implemented: refused when training).
    MultiLabel,
}

impl ProblemType {
    const NAMES: [(&'static str, ProblemType); 3] = [
        ("single_label_classification", ProblemType::SingleLabel),
        ("regression", ProblemType::Regression),
        ("multi_label_classification", ProblemType::MultiLabel),
    ];

    /// The config.json spelling.
    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, p)| *p == self)
            .map_or("", |(n, _)| n)
    }
}

impl fmt::Display for ProblemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The classification fields of config.json, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Labels {
    pub num_labels: usize,
    /// As written; `None` when the config leaves it to the head (see [`Labels::problem`]).
    pub problem_type: Option<ProblemType>,
    /// The padding token a decoder classifier skips when it picks each row's last token.
    pub pad_token_id: Option<i64>,
    /// Label names by id (`LABEL_i` when config.json has none, as transformers names them).
    pub id2label: Vec<String>,
    /// `label2id` as written (empty when absent): how string labels in data map to ids.
    pub label2id: BTreeMap<String, i64>,
}

impl Labels {
    /// Reads the fields from config.json's object; `file` is for messages.
    pub(crate) fn read(obj: &Map<String, Json>, file: &Path) -> Result<Labels, ModelError> {
        let err = |field: &str, message: String| ModelError::Config {
            file: file.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
        let stated = match get("num_labels") {
            None => None,
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && n <= MAX_LABELS as u64 => Some(n as usize),
                _ => {
                    return Err(err(
                        "num_labels",
                        format!("expected 1 to {MAX_LABELS} labels, found {v}"),
                    ))
                }
            },
        };
        let id2label = match get("id2label") {
            None => None,
            Some(Json::Object(m)) => {
                let mut by_id = BTreeMap::new();
                for (k, v) in m {
                    let id: usize = k.parse().map_err(|_| {
                        err("id2label", format!("keys must be label ids, found `{k}`"))
                    })?;
                    let name = v.as_str().ok_or_else(|| {
                        err(
                            "id2label",
                            format!("`{k}`: expected a label name, found {v}"),
                        )
                    })?;
                    by_id.insert(id, name.to_string());
                }
                // transformers indexes the head by these ids: they must be 0..n.
                if by_id.keys().copied().ne(0..by_id.len()) || by_id.is_empty() {
                    return Err(err(
                        "id2label",
                        format!(
                            "expected the ids 0..{} once each, found {:?}",
                            by_id.len(),
                            by_id.keys().collect::<Vec<_>>()
                        ),
                    ));
                }
                Some(by_id.into_values().collect::<Vec<_>>())
            }
            Some(v) => return Err(err("id2label", format!("expected an object, found {v}"))),
        };
        // As PretrainedConfig: the map, when there is one, decides the number of labels.
        let num_labels = id2label.as_ref().map_or(stated.unwrap_or(2), Vec::len);
        if num_labels > MAX_LABELS {
            return Err(err("id2label", format!("more than {MAX_LABELS} labels")));
        }
        let id2label =
            id2label.unwrap_or_else(|| (0..num_labels).map(|i| format!("LABEL_{i}")).collect());
        let mut label2id = BTreeMap::new();
        match get("label2id") {
            None => {}
            Some(Json::Object(m)) => {
                for (k, v) in m {
                    let id = v.as_i64().filter(|&i| i >= 0 && (i as usize) < num_labels);
                    let id = id.ok_or_else(|| {
                        err(
                            "label2id",
                            format!("`{k}`: expected a label id in 0..{num_labels}, found {v}"),
                        )
                    })?;
                    label2id.insert(k.clone(), id);
                }
            }
            Some(v) => return Err(err("label2id", format!("expected an object, found {v}"))),
        }
        let problem_type = match get("problem_type") {
            None => None,
            Some(v) => {
                let s = v.as_str().unwrap_or_default();
                let p = ProblemType::NAMES
                    .iter()
                    .find(|(n, _)| *n == s)
                    .map(|&(_, p)| p)
                    .ok_or_else(|| {
                        err(
                            "problem_type",
                            format!(
                                "expected one of {}, found {v}",
                                ProblemType::NAMES.map(|(n, _)| n).join(", ")
                            ),
                        )
                    })?;
                Some(p)
            }
        };
        if problem_type == Some(ProblemType::SingleLabel) && num_labels == 1 {
            return Err(err(
                "problem_type",
                "`single_label_classification` needs num_labels > 1 (for one output use \
                 `regression`)"
                    .into(),
            ));
        }
        let pad_token_id =
            match get("pad_token_id") {
                None => None,
                Some(v) => Some(v.as_i64().ok_or_else(|| {
                    err("pad_token_id", format!("expected a token id, found {v}"))
                })?),
            };
        Ok(Labels {
            num_labels,
            problem_type,
            pad_token_id,
            id2label,
            label2id,
        })
    }

    /// The loss a head trains with, as transformers decides it in `forward` when
    /// `problem_type` is unset: regression for one label, single-label classification for
    /// more (castor's class labels are integers; float labels would make transformers choose
    /// multi-label, which castor does not train).
    pub fn problem(&self) -> ProblemType {
        self.problem_type.unwrap_or(if self.num_labels == 1 {
            ProblemType::Regression
        } else {
            ProblemType::SingleLabel
        })
    }
}

/// The head's parameters (canonical names: the head sits outside the base model's prefix).
pub(crate) fn params(family: Family, labels: &Labels, hidden: usize) -> Vec<ParamSpec> {
    let n = labels.num_labels;
    match family {
        Family::Bert => vec![
            ParamSpec::new("classifier.weight", [n, hidden]),
            ParamSpec::new("classifier.bias", [n]),
        ],
        Family::Gpt2 | Family::Llama | Family::Qwen2 | Family::Mistral | Family::Gemma => {
            vec![ParamSpec::new("score.weight", [n, hidden])]
        }
    }
}

/// Appends the head to the base model's `outputs` (BERT: `[last_hidden_state,
/// pooler_output]`; decoders: `[last_hidden_state]`); returns `[logits]` (`[B, labels]`).
pub(crate) fn build(
    family: Family,
    ctx: &mut Ctx,
    outputs: Vec<Value>,
) -> Result<Vec<Value>, ModelError> {
    let linear = Op::MatMul {
        transpose_a: false,
        transpose_b: true,
    };
    match family {
        Family::Bert => {
            let pooled = outputs[outputs.len() - 1];
            // BertForSequenceClassification drops the pooled output in training.
            let rate = ctx.dropout.classifier;
            let pooled = ctx.dropout("classifier.dropout", pooled, rate)?;
            let y = ctx.linear("classifier.matmul", pooled, "classifier.weight", None, true)?;
            let bias = ctx.param("classifier.bias")?;
            let logits = ctx.op_exact(
                "logits",
                castor_ir::Op::Binary(castor_ir::BinaryOp::Add),
                &[y, bias],
            )?;
            Ok(vec![logits])
        }
        Family::Gpt2 | Family::Llama | Family::Qwen2 | Family::Mistral | Family::Gemma => {
            let h = outputs[0];
            let (b, t) = (ctx.batch, ctx.seq);
            let width = ctx.ty(h).shape.last();
            let rows = ctx.op_exact(
                "score.rows",
                Op::Reshape {
                    shape: vec![b * t, width],
                },
                &[h],
            )?;
            let picked = ctx.input(LAST_TOKEN_ROWS, TensorType::new(DType::I64, [b]))?;
            let last = ctx.op_exact(
                "score.last_token",
                Op::Embedding { padding: None },
                &[rows, picked],
            )?;
            let w = ctx.param("score.weight")?;
            Ok(vec![ctx.op_exact("logits", linear, &[last, w])?])
        }
    }
}

/// Each sequence's picked row for a decoder classifier, as transformers picks it: the
/// rightmost token that is not `pad_token_id` (`(arange(T) * (ids != pad)).argmax(-1)`, so
/// position 0 when every token is padding), or the last position when there is no padding
/// token, which transformers allows only for a batch of one. Returned as flat rows
/// `b * seq + t` of the `[batch * seq, hidden]` states.
pub fn last_token_rows(
    input_ids: &[i64],
    batch: usize,
    seq: usize,
    pad_token_id: Option<i64>,
) -> Result<Vec<i64>, ModelError> {
    let Some(pad) = pad_token_id else {
        if batch != 1 {
            return Err(ModelError::NoPadToken { batch });
        }
        return Ok(vec![seq as i64 - 1]);
    };
    Ok(input_ids
        .chunks(seq)
        .take(batch)
        .enumerate()
        .map(|(b, row)| {
            let t = row.iter().rposition(|&id| id != pad).unwrap_or(0);
            (b * seq + t) as i64
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(json: &str) -> Result<Labels, ModelError> {
        let v: Json = serde_json::from_str(json).unwrap();
        Labels::read(v.as_object().unwrap(), Path::new("config.json"))
    }

    #[test]
    fn labels_follow_pretrained_config() {
        let l = labels("{}").unwrap();
        assert_eq!((l.num_labels, l.problem()), (2, ProblemType::SingleLabel));
        assert_eq!(l.id2label, ["LABEL_0", "LABEL_1"]);
        let l = labels(r#"{"num_labels": 1}"#).unwrap();
        assert_eq!(l.problem(), ProblemType::Regression);
        // id2label decides the count, as transformers (which only warns on a disagreement).
        let l = labels(r#"{"num_labels": 5, "id2label": {"1": "b", "0": "a", "2": "c"}}"#).unwrap();
        assert_eq!(
            (l.num_labels, l.id2label.clone()),
            (3, vec!["a".into(), "b".into(), "c".into()])
        );
        let l = labels(r#"{"num_labels": 3, "problem_type": "regression"}"#).unwrap();
        assert_eq!(l.problem(), ProblemType::Regression);
        for (json, words) in [
            (r#"{"problem_type": "ranking"}"#, "\"ranking\""),
            (
                r#"{"num_labels": 1, "problem_type": "single_label_classification"}"#,
                "num_labels > 1",
            ),
            (r#"{"id2label": {"0": "a", "2": "c"}}"#, "0..2"),
            (r#"{"label2id": {"a": 7}}"#, "0..2"),
            (r#"{"num_labels": 0}"#, "found 0"),
        ] {
            let e = labels(json).unwrap_err().to_string();
            assert!(e.contains(words), "{json}: {e}");
        }
    }

    #[test]
    fn the_last_token_is_the_rightmost_that_is_not_padding() {
        // Right padding, left padding, no padding, all padding (transformers' argmax: 0).
        let ids = [5, 6, 0, 0, 0, 0, 7, 8, 5, 6, 7, 8, 0, 0, 0, 0];
        assert_eq!(
            last_token_rows(&ids, 4, 4, Some(0)).unwrap(),
            [1, 4 + 3, 8 + 3, 12]
        );
        assert_eq!(last_token_rows(&ids[..4], 1, 4, None).unwrap(), [3]);
        assert!(last_token_rows(&ids, 4, 4, None).is_err());
    }
}
