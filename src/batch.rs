//! Input batches: the safetensors files `castor eval` reads.
//!
//! A batch holds `input_ids` (I64 or I32, `[B, T]`) and optionally `attention_mask` and
//! `token_type_ids` of the same shape. Missing optional inputs take transformers' defaults:
//! an all-ones mask and all-zero token types.

use crate::CliError;
use castor_ir::{DType, Tensor};
use castor_models::{Model, Objective, ProblemType, SafetensorsFile, IGNORE_INDEX};
use std::collections::HashMap;

/// Graph inputs by name, all I64 `[B, T]`.
pub struct Batch {
    pub batch: usize,
    pub seq: usize,
    pub tensors: HashMap<String, Tensor>,
}

/// Reads and checks a batch for a model that takes `input_names` and has `vocab` tokens.
pub fn read_batch(
    file: &SafetensorsFile,
    input_names: &[&str],
    vocab: usize,
) -> anyhow::Result<Batch> {
    let path = file.path();
    let bad = |m: String| CliError::InvalidInput(format!("`{}`: {m}", path.display()));
    let ids_info = file
        .info("input_ids")
        .ok_or_else(|| bad("no tensor `input_ids` (expected I64 or I32 [batch, seq])".into()))?;
    let (batch, seq) = match ids_info.shape.as_slice() {
        [b, t] if *b > 0 && *t > 0 => (*b, *t),
        other => {
            return Err(bad(format!(
                "`input_ids` must be [batch, seq] with both > 0, found {other:?}"
            ))
            .into())
        }
    };
    let mut tensors = HashMap::new();
    for &name in input_names {
        let data = match file.info(name) {
            Some(info) => {
                if info.shape != [batch, seq] {
                    return Err(bad(format!(
                        "`{name}` is {:?}, expected [{batch}, {seq}] like `input_ids`",
                        info.shape
                    ))
                    .into());
                }
                match info.ir_dtype() {
                    Some(DType::I64 | DType::I32) => file.read_i64(name)?,
                    other => {
                        let found = other
                            .map(|d| d.to_string())
                            .unwrap_or_else(|| format!("{:?}", info.dtype));
                        return Err(
                            bad(format!("`{name}` must be I64 or I32, found {found}")).into()
                        );
                    }
                }
            }
            None if name == "attention_mask" => vec![1; batch * seq],
            None if name == "token_type_ids" => vec![0; batch * seq],
            None => return Err(bad(format!("no tensor `{name}`")).into()),
        };
        if name == "input_ids" {
            if let Some((i, id)) = data
                .iter()
                .enumerate()
                .find(|(_, &id)| id < 0 || id as u64 >= vocab as u64)
            {
                return Err(bad(format!(
                    "`input_ids`[{}, {}] = {id} is outside the vocabulary [0, {vocab})",
                    i / seq,
                    i % seq
                ))
                .into());
            }
        }
        tensors.insert(
            name.to_string(),
            Tensor::from_i64(DType::I64, [batch, seq], data),
        );
    }
    let unknown: Vec<&str> = file
        .names()
        .filter(|n| !input_names.contains(n) && *n != "labels")
        .collect();
    if !unknown.is_empty() {
        crate::errln!(
            "warning: `{}`: ignoring tensors this model does not take: {}",
            path.display(),
            unknown.join(", ")
        );
    }
    Ok(Batch {
        batch,
        seq,
        tensors,
    })
}

/// The `labels` a training objective reads: the file's `labels` (I64 or I32 `[B, T]`, -100 =
/// ignored) if it has them; for `lm` without them, the input ids with padded positions ignored
/// (what transformers' language-modelling collator produces). For `classify`, one label per
/// sequence: see [`read_class_labels`].
pub fn read_labels(
    file: &SafetensorsFile,
    batch: &Batch,
    objective: Objective,
    model: &Model,
) -> anyhow::Result<Tensor> {
    if objective == Objective::Classify {
        return read_class_labels(file, batch.batch, model);
    }
    let vocab = model.vocab_size();
    let path = file.path();
    let bad = |m: String| CliError::InvalidInput(format!("`{}`: {m}", path.display()));
    let (b, t) = (batch.batch, batch.seq);
    let labels = match file.info("labels") {
        Some(info) => {
            if info.shape != [b, t] {
                return Err(bad(format!(
                    "`labels` is {:?}, expected [{b}, {t}] like `input_ids`",
                    info.shape
                ))
                .into());
            }
            let labels = file.read_i64("labels")?;
            if let Some((i, l)) = labels
                .iter()
                .enumerate()
                .find(|(_, &l)| l != IGNORE_INDEX && (l < 0 || l as u64 >= vocab as u64))
            {
                return Err(bad(format!(
                    "`labels`[{}, {}] = {l} is neither {IGNORE_INDEX} nor in the vocabulary [0, {vocab})",
                    i / t,
                    i % t
                ))
                .into());
            }
            labels
        }
        None if objective == Objective::Lm => {
            let ids = batch.tensors.get("input_ids").and_then(|t| t.as_i64());
            let mask = batch.tensors.get("attention_mask").and_then(|t| t.as_i64());
            match (ids, mask) {
                (Some(ids), Some(mask)) => ids
                    .iter()
                    .zip(mask)
                    .map(|(&id, &m)| if m == 0 { IGNORE_INDEX } else { id })
                    .collect(),
                _ => return Err(bad("no `input_ids` to derive labels from".into()).into()),
            }
        }
        None => {
            return Err(bad(format!(
                "objective `{objective}` needs a `labels` tensor [{b}, {t}] (-100 = ignored)"
            ))
            .into())
        }
    };
    Ok(Tensor::from_i64(DType::I64, [b, t], labels))
}

/// A classifier's `labels`: class ids (I64 or I32 `[B]`, each in `0..num_labels` or -100 =
/// ignored) for single-label classification, float targets (`[B, num_labels]`, or `[B]` for
/// one label) for regression.
pub fn read_class_labels(
    file: &SafetensorsFile,
    b: usize,
    model: &Model,
) -> anyhow::Result<Tensor> {
    let path = file.path();
    let bad = |m: String| CliError::InvalidInput(format!("`{}`: {m}", path.display()));
    let n = model.labels().num_labels;
    let info = file.info("labels").ok_or_else(|| {
        bad(format!(
            "objective `classify` needs a `labels` tensor (one per sequence, {b} of them)"
        ))
    })?;
    match model.labels().problem() {
        ProblemType::Regression => {
            if info.shape != [b, n] && !(n == 1 && info.shape == [b]) {
                return Err(bad(format!(
                    "`labels` is {:?}, expected [{b}, {n}] regression targets",
                    info.shape
                ))
                .into());
            }
            let v = file.read_f32("labels")?;
            Ok(Tensor::from_f32(DType::F32, [b, n], v))
        }
        _ => {
            if info.shape != [b] {
                return Err(bad(format!(
                    "`labels` is {:?}, expected [{b}]: one class id per sequence",
                    info.shape
                ))
                .into());
            }
            let labels = file.read_i64("labels")?;
            if let Some((i, l)) = labels
                .iter()
                .enumerate()
                .find(|(_, &l)| l != IGNORE_INDEX && (l < 0 || l as u64 >= n as u64))
            {
                return Err(bad(format!(
                    "`labels`[{i}] = {l} is neither {IGNORE_INDEX} nor a class id in [0, {n})"
                ))
                .into());
            }
            Ok(Tensor::from_i64(DType::I64, [b], labels))
        }
    }
}
