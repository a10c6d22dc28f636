//! Training data: where `castor train` gets its micro-batches.
//!
//! - A safetensors batch file (`input_ids` [B, T], optional `attention_mask`, `labels`): the
//!   same batch every step, the way the reference fixtures train.
//! - A text file, tokenized byte by byte (the embedded model's vocabulary is the 256 bytes):
//!   a stream read in consecutive windows of T tokens per row, wrapping at the end. The
//!   position in the stream is part of a checkpoint, so a resumed run reads what the
//!   uninterrupted run would have read.

use crate::batch::{read_batch, read_labels};
use crate::CliError;
use castor_ir::{DType, Tensor};
use castor_models::{Model, Objective};
use std::collections::HashMap;
use std::path::Path;

pub enum Data {
    /// One fixed batch.
    Fixed {
        tensors: HashMap<String, Tensor>,
        batch: usize,
        seq: usize,
    },
    /// A token stream cut into windows.
    Stream {
        tokens: Vec<i64>,
        batch: usize,
        seq: usize,
        /// Index of the next window's first token.
        position: usize,
    },
}

impl Data {
    /// Opens `path` for `model`: `.safetensors` files are fixed batches, anything else is
    /// text. `batch`/`seq` size the windows of a text stream (default 8 x 64, at most the
    /// model's positions).
    pub fn open(
        path: &Path,
        model: &Model,
        objective: Objective,
        batch: Option<usize>,
        seq: Option<usize>,
    ) -> anyhow::Result<Data> {
        if path.extension().is_some_and(|e| e == "safetensors") {
            let b = read_batch(path, model.input_names(), model.vocab_size())?;
            if batch.is_some_and(|x| x != b.batch) || seq.is_some_and(|x| x != b.seq) {
                return Err(CliError::InvalidInput(format!(
                    "`{}` holds a [{}, {}] batch, but --batch/--seq ask for another shape",
                    path.display(),
                    b.batch,
                    b.seq
                ))
                .into());
            }
            let mut tensors = b.tensors.clone();
            if objective.needs_labels() {
                tensors.insert(
                    "labels".into(),
                    read_labels(path, &b, objective, model.vocab_size())?,
                );
            }
            return Ok(Data::Fixed {
                tensors,
                batch: b.batch,
                seq: b.seq,
            });
        }
        let bytes = std::fs::read(path).map_err(|e| {
            CliError::InvalidInput(format!("cannot read data `{}`: {e}", path.display()))
        })?;
        if model.vocab_size() < 256 {
            return Err(CliError::InvalidInput(format!(
                "`{}`: text is read byte by byte, which needs a vocabulary of at least 256 \
                 tokens; this model has {}",
                path.display(),
                model.vocab_size()
            ))
            .into());
        }
        if objective == Objective::Mlm {
            return Err(CliError::InvalidInput(
                "the mlm objective needs labels: give a safetensors batch with `labels`".into(),
            )
            .into());
        }
        let seq = seq.unwrap_or(64).min(model.max_positions());
        let batch = batch.unwrap_or(8);
        if bytes.len() < seq {
            return Err(CliError::InvalidInput(format!(
                "`{}` has {} bytes, fewer than one sequence of {seq}",
                path.display(),
                bytes.len()
            ))
            .into());
        }
        Ok(Data::Stream {
            tokens: bytes.into_iter().map(i64::from).collect(),
            batch,
            seq,
            position: 0,
        })
    }

    pub fn shape(&self) -> (usize, usize) {
        match self {
            Data::Fixed { batch, seq, .. } | Data::Stream { batch, seq, .. } => (*batch, *seq),
        }
    }

    /// Where the stream stands (0 for a fixed batch).
    pub fn position(&self) -> usize {
        match self {
            Data::Fixed { .. } => 0,
            Data::Stream { position, .. } => *position,
        }
    }

    pub fn seek(&mut self, to: usize) {
        if let Data::Stream {
            position, tokens, ..
        } = self
        {
            *position = to % tokens.len().max(1);
        }
    }

    /// The next micro-batch: graph inputs by name (`input_ids`, `attention_mask`, `labels`).
    pub fn next_batch(&mut self, input_names: &[&str]) -> HashMap<String, Tensor> {
        match self {
            Data::Fixed { tensors, .. } => tensors.clone(),
            Data::Stream {
                tokens,
                batch,
                seq,
                position,
            } => {
                let (b, t) = (*batch, *seq);
                let mut ids = Vec::with_capacity(b * t);
                for _ in 0..b {
                    if *position + t > tokens.len() {
                        *position = 0;
                    }
                    ids.extend_from_slice(&tokens[*position..*position + t]);
                    *position += t;
                }
                let mut out = HashMap::new();
                for &name in input_names {
                    let values = match name {
                        "input_ids" => ids.clone(),
                        "attention_mask" => vec![1; b * t],
                        _ => vec![0; b * t],
                    };
                    out.insert(
                        name.to_string(),
                        Tensor::from_i64(DType::I64, [b, t], values),
                    );
                }
                out.insert("labels".into(), Tensor::from_i64(DType::I64, [b, t], ids));
                out
            }
        }
    }
}
