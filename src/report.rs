//! Human-readable summaries shared by `inspect` and `demo`.

use castor_ir::Graph;
use castor_models::{Model, ModelConfig};
use std::fmt::Write;

/// `1234567` -> `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The model's key dimensions in one line.
pub fn config_line(config: &ModelConfig) -> String {
    match config {
        ModelConfig::Gpt2(c) => format!(
            "layers {}, hidden {}, heads {}, mlp {}, vocab {}, positions {}, {}",
            c.n_layer, c.n_embd, c.n_head, c.n_inner, c.vocab_size, c.n_positions, c.activation
        ),
        ModelConfig::Bert(c) => format!(
            "layers {}, hidden {}, heads {}, mlp {}, vocab {}, positions {}, token types {}, {}",
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.intermediate_size,
            c.vocab_size,
            c.max_position_embeddings,
            c.type_vocab_size,
            c.hidden_act
        ),
        ModelConfig::Llama(c) => format!(
            "layers {}, hidden {}, heads {} (kv {}), head dim {}, mlp {}, vocab {}, rope theta {}, {}",
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
            c.rope_theta,
            c.hidden_act
        ),
    }
}

/// The `inspect` summary of a model and its forward graph.
pub fn model_summary(
    source: &str,
    model: &Model,
    graph: &Graph,
    batch: usize,
    seq: usize,
) -> String {
    let mut s = String::new();
    let prefix = if model.prefix().is_empty() {
        "no prefix".to_string()
    } else {
        format!("prefix `{}`", model.prefix())
    };
    let _ = writeln!(s, "model       {source}");
    let _ = writeln!(
        s,
        "family      {} ({}, head: {}, {prefix})",
        model.family().model_type(),
        model.architecture(),
        model.head()
    );
    let _ = writeln!(s, "config      {}", config_line(&model.config().model));
    match model.checkpoint() {
        Some(ck) => {
            let dtype = model
                .checkpoint_dtype()
                .map(|d| d.to_string())
                .unwrap_or_else(|| "mixed".into());
            let _ = writeln!(
                s,
                "checkpoint  {} file{}, {} tensors, stored {dtype}; headers validated against files and config",
                ck.files().len(),
                if ck.files().len() == 1 { "" } else { "s" },
                ck.len()
            );
        }
        None => {
            let _ = writeln!(s, "checkpoint  none (config only: shapes, no weights)");
        }
    }
    let _ = writeln!(
        s,
        "parameters  {} (tied weights counted once)",
        thousands(model.parameter_count())
    );
    let counts = graph.class_counts();
    let total: usize = counts.iter().map(|(_, n)| n).sum();
    let by_class: Vec<String> = counts.iter().map(|(c, n)| format!("{c} {n}")).collect();
    let _ = writeln!(
        s,
        "graph       batch {batch} x seq {seq}: {total} ops ({}), {} inputs, {} parameters",
        by_class.join(", "),
        graph.inputs().count(),
        graph.params().count()
    );
    let report = model.report();
    if !report.ignored_buffers.is_empty() {
        let _ = writeln!(
            s,
            "ignored     buffers: {}",
            report.ignored_buffers.join(", ")
        );
    }
    if !report.tied_copies.is_empty() {
        let _ = writeln!(
            s,
            "tied        stored copies of tied weights: {}",
            report.tied_copies.join(", ")
        );
    }
    if !report.unused.is_empty() {
        let _ = writeln!(
            s,
            "warning     {} checkpoint tensor(s) not used by {}: {}",
            report.unused.len(),
            model.architecture(),
            report.unused.join(", ")
        );
    }
    s
}
