//! What `castor eval --text` says about a text: for a causal LM the loss of predicting each
//! token from the ones before it and the most likely next tokens; for a masked LM the most
//! likely tokens at each mask token; for a sequence classifier each label's probability (or
//! the regression outputs). Probabilities are the softmax of the F32 logits, in F64.

use crate::tokenizer::TextTokenizer;
use castor_ir::Tensor;
use castor_models::{Head, Model, ProblemType};

/// How many predictions a row lists.
const TOP: usize = 5;

/// The log-softmax of one row of logits.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let sum: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    let log_sum = max + sum.ln();
    row.iter().map(|&x| f64::from(x) - log_sum).collect()
}

/// The `TOP` most likely tokens of a row: `"token" 12.3%` each.
fn top(tok: &TextTokenizer, row: &[f32]) -> String {
    let lp = log_softmax(row);
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    idx.iter()
        .take(TOP)
        .map(|&i| format!("{:?} {:.1}%", tok.token_text(i as u32), lp[i].exp() * 100.0))
        .collect::<Vec<_>>()
        .join("  ")
}

/// Prints the tokens of `ids`, each as the tokenizer decodes it, and what the logits
/// `[1, T, V]` say (a bare encoder has none: its tokens alone).
pub fn print(model: &Model, tok: &TextTokenizer, ids: &[u32], logits: Option<&Tensor>) {
    let values = logits.and_then(Tensor::as_f32);
    if model.head() == Head::SequenceClassification {
        if let Some(values) = values {
            print_labels(model, values);
        }
        return;
    }
    let t = ids.len();
    let shown: Vec<String> = ids
        .iter()
        .map(|&i| format!("{:?}", tok.token_text(i)))
        .collect();
    outln!("tokens      {t}: {}", shown.join(" "));
    let Some(values) = values else {
        return;
    };
    let vocab = values.len() / t.max(1);
    let row = |i: usize| &values[i * vocab..(i + 1) * vocab];
    match model.head() {
        Head::CausalLm => {
            if t > 1 {
                let nll: f64 = (0..t - 1)
                    .map(|i| -log_softmax(row(i))[ids[i + 1] as usize])
                    .sum::<f64>()
                    / (t - 1) as f64;
                outln!(
                    "loss        {nll:.4} nats per token over {} predicted tokens (perplexity {:.2})",
                    t - 1,
                    nll.exp()
                );
            }
            outln!("next        {}", top(tok, row(t - 1)));
        }
        Head::MaskedLm => {
            let masks: Vec<usize> = (0..t).filter(|&i| Some(ids[i]) == tok.mask()).collect();
            if masks.is_empty() {
                outln!(
                    "masks       none: put the mask token ({}) where the model should fill in",
                    tok.mask()
                        .map_or("[MASK]".to_string(), |m| tok.token_text(m))
                );
            }
            for i in masks {
                outln!("mask {i:<6} {}", top(tok, row(i)));
            }
        }
        Head::Base | Head::Pooler | Head::SequenceClassification => {}
    }
}

/// A classifier's logits `[1, labels]`: each label's probability, most likely first, or
/// the regression outputs.
fn print_labels(model: &Model, logits: &[f32]) {
    let names = &model.labels().id2label;
    let name = |i: usize| {
        names
            .get(i)
            .cloned()
            .unwrap_or_else(|| format!("LABEL_{i}"))
    };
    if model.labels().problem() == ProblemType::Regression {
        let shown: Vec<String> = logits
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{} {v:.4}", name(i)))
            .collect();
        outln!("regression  {}", shown.join("  "));
        return;
    }
    let lp = log_softmax(logits);
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    let shown: Vec<String> = idx
        .iter()
        .map(|&i| format!("{} {:.1}%", name(i), lp[i].exp() * 100.0))
        .collect();
    outln!("label       {}", shown.join("  "));
}
