//! Packed rows (`--pack`) against the same examples one per row: on every decoder family, with
//! the eager and the fused attention, the packed batch's loss and every parameter's gradient
//! equal the unpacked batch's within 1e-5 in F32 (the CPU executor). Packing changes which
//! rows the tokens sit in, their positions (given as `position_ids`, restarting at each
//! example) and the attention (each query sees only its own example): the loss is the mean
//! over the same labelled tokens either way, so only summation order separates the two.

use crate::common;
use castor::training::data::packing::pack_bfd;
use castor_ir::{relative_error, DType, Tensor};
use castor_models::{AttentionImpl, Model, Objective, IGNORE_INDEX};
use castor_passes::{Autodiff, Pass};
use castor_runtime::cpu::CpuExecutor;
use std::collections::HashMap;

const SEQ: usize = 16;
/// Example lengths: a full row, sequences that cross the sliding window, and short ones.
const LENGTHS: [usize; 8] = [16, 9, 3, 12, 7, 2, 6, 5];

struct Example {
    ids: Vec<i64>,
    labels: Vec<i64>,
}

fn examples(vocab: usize) -> Vec<Example> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    LENGTHS
        .iter()
        .map(|&n| {
            let ids: Vec<i64> = (0..n).map(|_| (next() % vocab as u64) as i64).collect();
            // The first label is never predicted; about a third of the rest are prompt tokens.
            let labels = ids
                .iter()
                .enumerate()
                .map(|(i, &id)| {
                    if i == 0 || next() % 3 == 0 {
                        IGNORE_INDEX
                    } else {
                        id
                    }
                })
                .collect();
            Example { ids, labels }
        })
        .collect()
}

/// The rows `rows` (examples by index) as a batch: packed rows take `position_ids`, rows of
/// one example an attention mask.
fn batch(examples: &[Example], rows: &[Vec<usize>], packed: bool) -> HashMap<String, Tensor> {
    let (b, t) = (rows.len(), SEQ);
    let mut ids = vec![0i64; b * t];
    let mut labels = vec![IGNORE_INDEX; b * t];
    let mut mask = vec![0i64; b * t];
    let mut positions = vec![0i64; b * t];
    for (r, row) in rows.iter().enumerate() {
        let mut at = r * t;
        for &i in row {
            let e = &examples[i];
            let n = e.ids.len();
            ids[at..at + n].copy_from_slice(&e.ids);
            labels[at..at + n].copy_from_slice(&e.labels);
            mask[at..at + n].fill(1);
            for (p, v) in positions[at..at + n].iter_mut().zip(0..) {
                *p = v;
            }
            at += n;
        }
        // Padding: a sequence of its own.
        for (p, v) in positions[at..(r + 1) * t].iter_mut().zip(0..) {
            *p = v;
        }
    }
    let tensor = |v: Vec<i64>| Tensor::from_i64(DType::I64, [b, t], v);
    let mut out = HashMap::from([
        ("input_ids".to_string(), tensor(ids)),
        ("labels".to_string(), tensor(labels)),
    ]);
    if packed {
        out.insert("position_ids".into(), tensor(positions));
    } else {
        out.insert("attention_mask".into(), tensor(mask));
    }
    out
}

/// The loss and each parameter's gradient, by parameter name.
fn loss_and_grads(
    model: &Model,
    params: &HashMap<String, Tensor>,
    batch: &HashMap<String, Tensor>,
    rows: usize,
) -> (f32, HashMap<String, Vec<f32>>) {
    let g = model.build_loss_graph(rows, SEQ, Objective::Lm).unwrap();
    let (back, _) = Autodiff::default().run(&g).unwrap();
    let out = CpuExecutor::new()
        .run(&back, &|n| batch.get(n).or_else(|| params.get(n)))
        .unwrap();
    let loss = out[0].as_f32().unwrap()[0];
    let grads = back.outputs()[1..]
        .iter()
        .zip(&out[1..])
        .map(|(&v, t)| (back.name(v).to_string(), t.as_f32().unwrap().to_vec()))
        .collect();
    (loss, grads)
}

fn packed_equals_unpacked(variant: &str, attention: AttentionImpl) {
    let mut model = Model::load(common::fixture(variant)).unwrap();
    model.set_attention(attention);
    let params = model.load_params().unwrap();
    let examples = examples(model.vocab_size());
    let one_each: Vec<Vec<usize>> = (0..examples.len()).map(|i| vec![i]).collect();
    let packed_rows = pack_bfd(&LENGTHS, SEQ);
    assert!(packed_rows.len() < one_each.len(), "{packed_rows:?}");

    let (loss, grads) = loss_and_grads(
        &model,
        &params,
        &batch(&examples, &one_each, false),
        one_each.len(),
    );
    model.set_packed(true).unwrap();
    let (packed_loss, packed_grads) = loss_and_grads(
        &model,
        &params,
        &batch(&examples, &packed_rows, true),
        packed_rows.len(),
    );
    let err = relative_error(&[packed_loss], &[loss]);
    println!(
        "{variant} {attention:?}: {} rows -> {}, loss {loss} vs packed {packed_loss} ({err:.1e})",
        one_each.len(),
        packed_rows.len()
    );
    assert!(err <= 1e-5, "{variant}: loss {packed_loss} vs {loss}");
    assert_eq!(grads.len(), packed_grads.len());
    let mut worst = 0f64;
    for (name, g) in &grads {
        let err = relative_error(&packed_grads[name], g);
        worst = worst.max(err);
        assert!(err <= 1e-5, "{variant} {name}: gradient error {err:.2e}");
    }
    println!(
        "  worst gradient error {worst:.1e} over {} parameters",
        grads.len()
    );
}

#[test]
fn packed_rows_train_as_the_examples_one_per_row() {
    for variant in [
        "gpt2_lm",
        "llama_gqa",
        "llama31_rope",
        "mistral_window",
        "qwen2_bias",
        "gemma_tiny",
    ] {
        for attention in [AttentionImpl::Eager, AttentionImpl::Fused] {
            packed_equals_unpacked(variant, attention);
        }
    }
}

/// Encoders and classifiers have no packed form: the error says what packing is for.
#[test]
fn packing_is_refused_for_an_encoder() {
    let mut model = Model::load(common::fixture("bert_mlm")).unwrap();
    let err = model.set_packed(true).unwrap_err().to_string();
    assert!(err.contains("cannot take packed sequences"), "{err}");
}
