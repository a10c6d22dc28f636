//! Properties of the built graphs, run on the CPU reference executor: causality, padding
//! masks, grouped-query attention equal to repeated k/v heads, tied equal to copied heads.

use crate::common;
use crate::exec;

use castor_ir::{DType, Tensor};
use castor_models::safetensors::Dtype;
use castor_models::Model;
use common::*;
use std::collections::HashMap;

fn feeds(m: &Model, ids: &[i64], mask: &[i64], b: usize, t: usize) -> HashMap<String, Tensor> {
    let mut f = m.load_params().unwrap();
    f.insert(
        "input_ids".into(),
        Tensor::from_i64(DType::I64, [b, t], ids.to_vec()),
    );
    f.insert(
        "attention_mask".into(),
        Tensor::from_i64(DType::I64, [b, t], mask.to_vec()),
    );
    f.insert(
        "token_type_ids".into(),
        Tensor::from_i64(DType::I64, [b, t], vec![0; b * t]),
    );
    f
}

fn run(m: &Model, ids: &[i64], mask: &[i64], b: usize, t: usize) -> HashMap<String, Vec<f32>> {
    let g = m.build_graph(b, t).unwrap();
    exec::run(&g, &feeds(m, ids, mask, b, t))
        .into_iter()
        .map(|(k, v)| (k, v.as_f32().unwrap().to_vec()))
        .collect()
}

fn close(a: &[f32], b: &[f32], tol: f64) {
    let e = castor_ir::relative_error(a, b);
    assert!(e <= tol, "relative error {e} > {tol}");
}

#[test]
fn causal_lms_do_not_see_the_future() {
    for cfg in [TINY_GPT2, TINY_LLAMA] {
        let dir = write_checkpoint(cfg, params_for(cfg, Dtype::F32));
        let m = Model::load(dir.path()).unwrap();
        let a = run(&m, &[1, 2, 3, 4], &[1; 4], 1, 4)["logits"].clone();
        let b = run(&m, &[1, 2, 3, 9], &[1; 4], 1, 4)["logits"].clone();
        let v = a.len() / 4;
        assert_eq!(a[..3 * v], b[..3 * v], "{cfg}");
        assert_ne!(a[3 * v..], b[3 * v..]);
        assert!(a.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn padding_is_masked_out() {
    for cfg in [TINY_GPT2, TINY_LLAMA, TINY_BERT_MLM] {
        let dir = write_checkpoint(cfg, params_for(cfg, Dtype::F32));
        let m = Model::load(dir.path()).unwrap();
        // Right padding: changing the padded token leaves the real positions alone.
        let a = run(&m, &[5, 6, 7, 1], &[1, 1, 1, 0], 1, 4)["logits"].clone();
        let b = run(&m, &[5, 6, 7, 2], &[1, 1, 1, 0], 1, 4)["logits"].clone();
        let v = a.len() / 4;
        assert_eq!(a[..3 * v], b[..3 * v], "{cfg}");
        // And a padded batch row equals the unpadded sequence alone.
        let short = run(&m, &[5, 6, 7], &[1, 1, 1], 1, 3)["logits"].clone();
        close(&a[..3 * v], &short, 1e-6);
    }
}

#[test]
fn gqa_equals_repeated_kv_heads() {
    // 4 query heads over 2 kv heads vs the same model with k/v repeated to 4 heads, as
    // transformers' repeat_kv does (kv head j serves query heads 2j and 2j+1).
    let gqa_dir = write_checkpoint(TINY_LLAMA, params_for(TINY_LLAMA, Dtype::F32));
    let gqa = Model::load(gqa_dir.path()).unwrap();
    let mha_cfg = TINY_LLAMA.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4");
    let d = 4;
    let tensors: Vec<(String, Owned)> = params_for(TINY_LLAMA, Dtype::F32)
        .into_iter()
        .map(|(n, t)| {
            if n.ends_with("k_proj.weight") || n.ends_with("v_proj.weight") {
                // [2*d, 16] -> [4*d, 16]: rows of kv head j repeated twice.
                let row = 16 * 4;
                let mut data = Vec::new();
                for j in 0..2 {
                    let head = &t.data[j * d * row..(j + 1) * d * row];
                    data.extend_from_slice(head);
                    data.extend_from_slice(head);
                }
                (
                    n,
                    Owned {
                        dtype: t.dtype,
                        shape: vec![4 * d, 16],
                        data,
                    },
                )
            } else {
                (n, t)
            }
        })
        .collect();
    let mha_dir = write_checkpoint(&mha_cfg, tensors);
    let mha = Model::load(mha_dir.path()).unwrap();
    let ids = [3, 1, 4, 1, 5, 9, 2, 6];
    let mask = [1, 1, 1, 1, 1, 1, 1, 0];
    let a = run(&gqa, &ids, &mask, 2, 4)["logits"].clone();
    let b = run(&mha, &ids, &mask, 2, 4)["logits"].clone();
    close(&a, &b, 1e-6);
}

#[test]
fn tied_head_equals_a_copied_head() {
    let tied_cfg = TINY_LLAMA.replace(
        "\"rope_theta\"",
        "\"tie_word_embeddings\": true, \"rope_theta\"",
    );
    let tied_dir = write_checkpoint(&tied_cfg, params_for(&tied_cfg, Dtype::F32));
    let tied = Model::load(tied_dir.path()).unwrap();
    let mut tensors = params_for(&tied_cfg, Dtype::F32);
    let emb = tensors
        .iter()
        .find(|(n, _)| n == "model.embed_tokens.weight")
        .unwrap()
        .1
        .clone();
    tensors.push(("lm_head.weight".into(), emb));
    let untied_dir = write_checkpoint(TINY_LLAMA, tensors);
    let untied = Model::load(untied_dir.path()).unwrap();
    assert_eq!(tied.parameter_count() + 40 * 16, untied.parameter_count());
    let a = run(&tied, &[1, 2, 3], &[1; 3], 1, 3)["logits"].clone();
    let b = run(&untied, &[1, 2, 3], &[1; 3], 1, 3)["logits"].clone();
    assert_eq!(a, b);
}

#[test]
fn bert_pooler_reads_the_first_token() {
    let cfg = TINY_BERT_MLM.replace("BertForMaskedLM", "BertModel");
    let dir = write_checkpoint(&cfg, params_for(&cfg, Dtype::F32));
    let m = Model::load(dir.path()).unwrap();
    let out = run(&m, &[2, 3, 4, 5, 6, 7], &[1; 6], 2, 3);
    assert_eq!(out["last_hidden_state"].len(), 2 * 3 * 8);
    assert_eq!(out["pooler_output"].len(), 2 * 8);
    assert!(out["pooler_output"].iter().all(|x| x.abs() <= 1.0));
}
