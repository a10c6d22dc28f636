//! Training data: where `castor train` gets its micro-batches.
//!
//! - A safetensors batch file (`input_ids` [B, T], optional `attention_mask`, `labels`): the
//!   same batch every step, the way the reference fixtures train.
//! - A token stream read in consecutive windows of T tokens per row, wrapping at the end. The
//!   position in the stream is part of a checkpoint, so a resumed run reads what the
//!   uninterrupted run would have read. A stream comes from
//!   - a text file, tokenized with the model's `tokenizer.json` when it has one, else byte by
//!     byte (the embedded model's vocabulary is the 256 bytes);
//!   - a pre-tokenized `.bin` file: llm.c's format (a header of 256 little-endian int32, magic
//!     20240520, version 1 = u16 tokens, version 2 = u32 tokens, then the token count) or, when
//!     the magic is absent, nanoGPT's raw little-endian u16 tokens.
//!
//! With a validation fraction the stream's last tokens are held out: training never reads
//! them, and [`Data::validation_batches`] cuts them into fixed windows.

use crate::batch::{read_batch, read_labels};
use crate::CliError;
use castor_ir::{DType, Tensor};
use castor_models::{Model, Objective};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// llm.c's token file header: 256 int32, the first three magic, version, token count.
pub const LLMC_MAGIC: i32 = 20240520;
pub const LLMC_HEADER_INTS: usize = 256;

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
        /// Held-out tokens (the stream's tail), empty without a validation split.
        validation: Vec<i64>,
        batch: usize,
        seq: usize,
        /// Index of the next window's first token.
        position: usize,
        /// Where the tokens came from, for people.
        source: String,
    },
}

/// How a data file is opened.
#[derive(Clone, Debug, Default)]
pub struct DataOptions {
    /// Sequences per micro-batch (streams; default 8).
    pub batch: Option<usize>,
    /// Tokens per sequence (streams; default 64, at most the model's positions).
    pub seq: Option<usize>,
    /// The fraction of the stream held out for validation (0 = none).
    pub val_fraction: f64,
}

/// The tokenizer of a model: `tokenizer.json` beside its config.json, if there is one.
pub fn model_tokenizer(model: &Model) -> Option<PathBuf> {
    let dir = model.config().file.parent()?;
    let path = dir.join("tokenizer.json");
    path.is_file().then_some(path)
}

impl Data {
    /// Opens `path` for `model`: `.safetensors` files are fixed batches, `.bin` files token
    /// files, anything else text.
    pub fn open(
        path: &Path,
        model: &Model,
        objective: Objective,
        options: &DataOptions,
    ) -> anyhow::Result<Data> {
        let (batch, seq) = (options.batch, options.seq);
        if path.extension().is_some_and(|e| e == "safetensors") {
            if options.val_fraction > 0.0 {
                return Err(CliError::InvalidInput(
                    "--val-fraction needs a token stream (text or .bin), not a fixed batch".into(),
                )
                .into());
            }
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
        if objective == Objective::Mlm {
            return Err(CliError::InvalidInput(
                "the mlm objective needs labels: give a safetensors batch with `labels`".into(),
            )
            .into());
        }
        let bytes = std::fs::read(path).map_err(|e| {
            CliError::InvalidInput(format!("cannot read data `{}`: {e}", path.display()))
        })?;
        let (tokens, source) = if path.extension().is_some_and(|e| e == "bin") {
            read_token_file(path, &bytes)?
        } else if let Some(tok) = model_tokenizer(model) {
            (
                tokenize(path, &bytes, &tok, model.vocab_size())?,
                "tokenizer.json".to_string(),
            )
        } else {
            if model.vocab_size() < 256 {
                return Err(CliError::InvalidInput(format!(
                    "`{}`: text is read byte by byte (the model has no tokenizer.json), which \
                     needs a vocabulary of at least 256 tokens; this model has {}",
                    path.display(),
                    model.vocab_size()
                ))
                .into());
            }
            (
                bytes.into_iter().map(i64::from).collect(),
                "bytes".to_string(),
            )
        };
        check_range(path, &tokens, model.vocab_size())?;
        let seq = seq.unwrap_or(64).min(model.max_positions());
        let batch = batch.unwrap_or(8);
        Data::from_tokens(
            tokens,
            batch,
            seq,
            options.val_fraction,
            format!("`{}` ({source})", path.display()),
        )
    }

    /// A stream over `tokens` with the last `val_fraction` of them held out.
    pub fn from_tokens(
        mut tokens: Vec<i64>,
        batch: usize,
        seq: usize,
        val_fraction: f64,
        source: String,
    ) -> anyhow::Result<Data> {
        if batch == 0 || seq == 0 {
            return Err(
                CliError::InvalidInput("--batch and --seq must be at least 1".into()).into(),
            );
        }
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(CliError::InvalidInput(format!(
                "--val-fraction must be in [0, 1), found {val_fraction}"
            ))
            .into());
        }
        let held = (tokens.len() as f64 * val_fraction).ceil() as usize;
        let validation = tokens.split_off(tokens.len() - held);
        if tokens.len() < seq {
            return Err(CliError::InvalidInput(format!(
                "{source} has {} training tokens, fewer than one sequence of {seq}",
                tokens.len()
            ))
            .into());
        }
        if held > 0 && validation.len() < seq {
            return Err(CliError::InvalidInput(format!(
                "{source}: --val-fraction {val_fraction} holds out {} tokens, fewer than one \
                 sequence of {seq}",
                validation.len()
            ))
            .into());
        }
        Ok(Data::Stream {
            tokens,
            validation,
            batch,
            seq,
            position: 0,
            source,
        })
    }

    pub fn shape(&self) -> (usize, usize) {
        match self {
            Data::Fixed { batch, seq, .. } | Data::Stream { batch, seq, .. } => (*batch, *seq),
        }
    }

    /// One line for people: where the tokens come from and how many there are.
    pub fn describe(&self) -> String {
        match self {
            Data::Fixed { batch, seq, .. } => format!("a fixed [{batch}, {seq}] batch"),
            Data::Stream {
                tokens,
                validation,
                source,
                ..
            } => {
                let mut s = format!(
                    "{source}: {} training tokens",
                    crate::report::thousands(tokens.len() as u64)
                );
                if !validation.is_empty() {
                    s.push_str(&format!(
                        ", {} held out for validation",
                        crate::report::thousands(validation.len() as u64)
                    ));
                }
                s
            }
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
                ..
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
                window_batch(ids, b, t, input_names)
            }
        }
    }

    /// Whether there is held-out data to evaluate on.
    pub fn has_validation(&self) -> bool {
        matches!(self, Data::Stream { validation, .. } if !validation.is_empty())
    }

    /// Up to `max_batches` micro-batches of consecutive held-out windows (at least one; rows
    /// wrap around a short validation split). Always the same batches.
    pub fn validation_batches(
        &self,
        input_names: &[&str],
        max_batches: usize,
    ) -> Vec<HashMap<String, Tensor>> {
        let Data::Stream {
            validation,
            batch,
            seq,
            ..
        } = self
        else {
            return Vec::new();
        };
        let (b, t) = (*batch, *seq);
        if validation.len() < t {
            return Vec::new();
        }
        let windows = validation.len() / t;
        let count = (windows / b).clamp(1, max_batches.max(1));
        (0..count)
            .map(|i| {
                let mut ids = Vec::with_capacity(b * t);
                for row in 0..b {
                    let w = (i * b + row) % windows;
                    ids.extend_from_slice(&validation[w * t..(w + 1) * t]);
                }
                window_batch(ids, b, t, input_names)
            })
            .collect()
    }
}

/// A [b, t] batch of token windows: the ids, a full attention mask, zero token types, and the
/// ids as labels (the loss shifts them).
fn window_batch(
    ids: Vec<i64>,
    b: usize,
    t: usize,
    input_names: &[&str],
) -> HashMap<String, Tensor> {
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

fn invalid(path: &Path, what: String) -> anyhow::Error {
    CliError::InvalidInput(format!("`{}`: {what}", path.display())).into()
}

/// Reads a `.bin` token file: llm.c's (by its magic) or nanoGPT's raw u16 tokens.
pub fn read_token_file(path: &Path, bytes: &[u8]) -> anyhow::Result<(Vec<i64>, String)> {
    let header_bytes = LLMC_HEADER_INTS * 4;
    let int = |i: usize| -> Option<i32> {
        let b = bytes.get(i * 4..i * 4 + 4)?;
        Some(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if bytes.len() >= header_bytes && int(0) == Some(LLMC_MAGIC) {
        let version = int(1).unwrap_or(0);
        let width = match version {
            1 => 2,
            2 => 4,
            v => {
                return Err(invalid(
                    path,
                    format!("llm.c token file version {v}; known: 1 (u16 tokens), 2 (u32 tokens)"),
                ))
            }
        };
        let count = usize::try_from(int(2).unwrap_or(-1))
            .map_err(|_| invalid(path, "llm.c header has a negative token count".to_string()))?;
        let body = &bytes[header_bytes..];
        if body.len() != count * width {
            return Err(invalid(
                path,
                format!(
                    "llm.c header says {count} tokens of {width} bytes, but {} bytes follow it",
                    body.len()
                ),
            ));
        }
        let tokens = if width == 2 {
            body.chunks_exact(2)
                .map(|c| i64::from(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        } else {
            body.chunks_exact(4)
                .map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect()
        };
        return Ok((tokens, format!("llm.c tokens, version {version}")));
    }
    if !bytes.len().is_multiple_of(2) {
        return Err(invalid(
            path,
            format!(
                "no llm.c header (magic {LLMC_MAGIC}), and {} bytes is not a whole number of \
                 raw u16 tokens",
                bytes.len()
            ),
        ));
    }
    let tokens = bytes
        .chunks_exact(2)
        .map(|c| i64::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    Ok((tokens, "raw u16 tokens".to_string()))
}

/// Tokenizes a text file with a Hugging Face `tokenizer.json`.
fn tokenize(path: &Path, bytes: &[u8], tokenizer: &Path, vocab: usize) -> anyhow::Result<Vec<i64>> {
    let tok = load_tokenizer(tokenizer, vocab)?;
    let text = std::str::from_utf8(bytes).map_err(|e| {
        invalid(
            path,
            format!("a tokenizer.json tokenizes text, but this file is not UTF-8 ({e})"),
        )
    })?;
    let encoding = tok
        .encode(text, false)
        .map_err(|e| invalid(path, format!("tokenizing failed: {e}")))?;
    Ok(encoding.get_ids().iter().map(|&i| i64::from(i)).collect())
}

/// Loads a tokenizer.json and checks that every id it can produce is a row of the model's
/// embedding (a tokenizer may have fewer tokens than the embedding has rows: GPT-2's
/// checkpoints pad theirs, but never more).
pub fn load_tokenizer(path: &Path, vocab: usize) -> anyhow::Result<tokenizers::Tokenizer> {
    let tok = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| invalid(path, format!("cannot load the tokenizer: {e}")))?;
    let size = tok.get_vocab_size(true);
    if size > vocab {
        return Err(invalid(
            path,
            format!(
                "the tokenizer has {size} tokens (added tokens included), but the model's \
                 vocabulary (vocab_size in config.json) has {vocab}: they belong to different \
                 models"
            ),
        ));
    }
    Ok(tok)
}

/// Every token must be a row of the embedding.
fn check_range(path: &Path, tokens: &[i64], vocab: usize) -> anyhow::Result<()> {
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t as u64 >= vocab as u64)
    {
        return Err(invalid(
            path,
            format!(
                "token {i} is id {t}, outside the model's vocabulary of {vocab} tokens (ids \
                 0..{}); was the data tokenized for another model?",
                vocab.saturating_sub(1)
            ),
        ));
    }
    Ok(())
}
