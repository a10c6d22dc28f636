//! Helpers shared by the integration tests: tiny configs and checkpoints written with the
//! `safetensors` crate's serializer into temporary folders.
#![allow(dead_code)]

use castor_models::safetensors::Dtype;
use castor_models::{Config, Model};
use half::{bf16, f16};
use safetensors::View;
use std::borrow::Cow;
use std::path::Path;

/// An owned tensor for the serializer.
#[derive(Clone, Debug)]
pub struct Owned {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl View for Owned {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Deterministic float values, encoded in `dtype`.
pub fn floats(dtype: Dtype, shape: &[usize], seed: u64) -> Owned {
    let n: usize = shape.iter().product();
    let vals = (0..n).map(|i| {
        let x = (i as u64)
            .wrapping_mul(2654435761)
            .wrapping_add(seed.wrapping_mul(97))
            % 1000;
        (x as f32 - 500.0) / 1000.0
    });
    let data = match dtype {
        Dtype::F32 => vals.flat_map(f32::to_le_bytes).collect(),
        Dtype::F16 => vals.flat_map(|v| f16::from_f32(v).to_le_bytes()).collect(),
        Dtype::BF16 => vals.flat_map(|v| bf16::from_f32(v).to_le_bytes()).collect(),
        other => panic!("floats: {other:?}"),
    };
    Owned {
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

pub fn write_file(path: &Path, tensors: Vec<(String, Owned)>) {
    safetensors::serialize_to_file(tensors, None, path).expect("serialize");
}

pub const TINY_GPT2: &str = r#"{
  "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
  "vocab_size": 50, "n_positions": 16, "n_embd": 8, "n_layer": 2, "n_head": 2
}"#;

pub const TINY_BERT_MLM: &str = r#"{
  "model_type": "bert", "architectures": ["BertForMaskedLM"],
  "vocab_size": 40, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
  "intermediate_size": 12, "max_position_embeddings": 16, "type_vocab_size": 2
}"#;

pub const TINY_LLAMA: &str = r#"{
  "model_type": "llama", "architectures": ["LlamaForCausalLM"],
  "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0
}"#;

/// The parameters a config expects, with deterministic values.
pub fn params_for(config_json: &str, dtype: Dtype) -> Vec<(String, Owned)> {
    let model = Model::from_config(Config::parse(config_json, "inline.json").expect("config"))
        .expect("model");
    model
        .expected_params()
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.clone(), floats(dtype, &p.shape, i as u64)))
        .collect()
}

/// A checkpoint folder with config.json and one model.safetensors.
pub fn write_checkpoint(config_json: &str, tensors: Vec<(String, Owned)>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("config.json"), config_json).expect("config");
    write_file(&dir.path().join("model.safetensors"), tensors);
    dir
}

/// The error's message, for assertions.
pub fn err_text<T: std::fmt::Debug>(r: Result<T, castor_models::ModelError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

pub fn assert_contains(text: &str, parts: &[&str]) {
    for p in parts {
        assert!(text.contains(p), "message lacks {p:?}:\n{text}");
    }
}
