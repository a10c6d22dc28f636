//! What the front end knows about a model's structure, recorded in the IR so that passes never
//! guess it from value names: the model's shape (on the graph) and each node's block (on the
//! node, [`crate::NodeData::block`]).

use crate::op::{AttrReader, AttrValue};
use crate::Attr;

/// The shape of the model a graph was built from, and the batch and sequence it was built
/// for. A graph written by hand or loaded from an
/// IR file without a `model` line has none, and reports that need it say so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Transformer blocks; node blocks are `0..layers`.
    pub layers: usize,
    /// Width of the residual stream (the hidden size).
    pub width: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads (fewer than `heads` under grouped-query attention).
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// Sequences per batch of the graph.
    pub batch: usize,
    /// Tokens per sequence of the graph.
    pub seq: usize,
}

/// Declares the fields once for printing and parsing, in text order.
macro_rules! shape_fields {
    ($m:ident) => {
        $m!(layers, width, heads, kv_heads, head_dim, vocab, batch, seq)
    };
}

impl ModelShape {
    /// The fields as text attributes: `layers=12, width=768, ...`.
    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        macro_rules! attrs {
            ($($f:ident),*) => {
                vec![$( (stringify!($f), self.$f.to_attr()) ),*]
            };
        }
        shape_fields!(attrs)
    }

    /// The inverse of [`ModelShape::attrs`]: every field exactly once.
    pub fn from_attrs(attrs: Vec<(String, Attr)>) -> Result<ModelShape, String> {
        let mut reader = AttrReader::new("model", attrs);
        macro_rules! read {
            ($($f:ident),*) => {
                ModelShape { $( $f: AttrValue::take(&mut reader, stringify!($f))? ),* }
            };
        }
        let shape = shape_fields!(read);
        reader.finish()?;
        Ok(shape)
    }
}
