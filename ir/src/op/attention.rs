//! The fused attention's optional parts: dropout on its probabilities (an attribute pair) and
//! where its optional operands (the mask or positions, the dropout key) sit.

use super::attr::{Attr, AttrFields, AttrReader, AttrValue};
use super::Op;

/// Dropout on a fused attention's probabilities, as a [`Op::Dropout`] node with the same `p`
/// and `stream` would apply it to the `[.., T, S]` probabilities the eager attention stores
/// (the same Philox draws, [`crate::philox`], for the same row-major element index). In the
/// text format the attributes `dropout=P, stream=N`; absent: no dropout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDropout {
    /// The probability of dropping a probability, in `(0, 1)`.
    pub p: f64,
    /// The Philox stream, as a dropout node's.
    pub stream: usize,
}

impl AttrFields for Option<AttentionDropout> {
    fn push_attrs(&self, _key: &'static str, out: &mut Vec<(&'static str, Attr)>) {
        if let Some(d) = self {
            out.push(("dropout", Attr::Float(d.p)));
            out.push(("stream", d.stream.to_attr()));
        }
    }

    fn take_attrs(reader: &mut AttrReader<'_>, _key: &str) -> Result<Self, String> {
        let p: Option<f64> = AttrValue::take(reader, "dropout")?;
        match p {
            None => Ok(None),
            Some(p) => Ok(Some(AttentionDropout {
                p,
                stream: AttrValue::take(reader, "stream")?,
            })),
        }
    }
}

/// Where an attention's (or its gradient's) optional operands are, by index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionOperands {
    /// The bool mask or i64 positions.
    pub mask: Option<usize>,
    /// The dropout key (`i64[2]`, `[seed, offset]`).
    pub key: Option<usize>,
}

impl Op {
    /// The optional operands of an [`Op::Attention`] or [`Op::AttentionGrad`] with `inputs`
    /// operands: after the fixed ones (`q, k, v`, or `q, k, v, o, lse, do`) come the mask (if
    /// any), then the dropout key, which is there exactly when the op has dropout. `None` for
    /// any other op.
    pub fn attention_operands(&self, inputs: usize) -> Option<AttentionOperands> {
        let (fixed, dropout) = match self {
            Op::Attention { dropout, .. } => (3, dropout),
            Op::AttentionGrad { dropout, .. } => (6, dropout),
            _ => return None,
        };
        let key = dropout.map(|_| inputs.saturating_sub(1));
        let optional = inputs
            .saturating_sub(fixed)
            .saturating_sub(usize::from(key.is_some()));
        Some(AttentionOperands {
            mask: (optional > 0).then_some(fixed),
            key,
        })
    }

    /// The dropout of an [`Op::Attention`] or [`Op::AttentionGrad`].
    pub fn attention_dropout(&self) -> Option<AttentionDropout> {
        match self {
            Op::Attention { dropout, .. } | Op::AttentionGrad { dropout, .. } => *dropout,
            _ => None,
        }
    }
}
