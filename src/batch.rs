//! Input batches: the safetensors files `castor eval` reads.
//!
//! A batch holds `input_ids` (I64 or I32, `[B, T]`) and optionally `attention_mask` and
//! `token_type_ids` of the same shape. Missing optional inputs take transformers' defaults:
//! an all-ones mask and all-zero token types.

use crate::CliError;
use castor_ir::{DType, Tensor};
use castor_models::SafetensorsFile;
use std::collections::HashMap;
use std::path::Path;

/// Graph inputs by name, all I64 `[B, T]`.
pub struct Batch {
    pub batch: usize,
    pub seq: usize,
    pub tensors: HashMap<String, Tensor>,
}

/// Reads and checks a batch for a model that takes `input_names` and has `vocab` tokens.
pub fn read_batch(path: &Path, input_names: &[&str], vocab: usize) -> anyhow::Result<Batch> {
    let file = SafetensorsFile::open(path)?;
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
    let unknown: Vec<&str> = file.names().filter(|n| !input_names.contains(n)).collect();
    if !unknown.is_empty() {
        eprintln!(
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
