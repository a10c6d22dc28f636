//! `castor demo`: castor's main job on an embedded model, with no files and no GPU.

use crate::report::model_summary;
use anyhow::Context;
use castor_ir::{DType, Tensor};
use castor_models::{Config, Model};
use castor_runtime::cpu::CpuExecutor;
use std::path::Path;
use std::time::Instant;

/// The embedded model: a tiny byte-level GPT-2 (256-token vocabulary, so any text is input).
pub const TINY_GPT2_CONFIG: &str = include_str!("../../assets/tiny-gpt2.json");

/// Text the demo feeds the model, as bytes.
const DEMO_TEXT: &str =
    "castor makes every precision decision a visible, testable compiler decision.";

/// Seed of the deterministic initialization.
pub const DEMO_SEED: u64 = 0x00ca_5709;

#[derive(clap::Args)]
pub struct Args {}

/// The embedded tiny GPT-2 and its deterministic initial weights.
pub fn tiny_gpt2() -> anyhow::Result<(Model, std::collections::HashMap<String, Tensor>)> {
    let config = Config::parse(TINY_GPT2_CONFIG, Path::new("<embedded tiny-gpt2>"))?;
    let model = Model::from_config(config)?;
    let params = model.init_params(DEMO_SEED);
    Ok((model, params))
}

pub fn run(_args: Args) -> anyhow::Result<()> {
    let (model, params) = tiny_gpt2()?;
    let tokens: Vec<i64> = DEMO_TEXT.bytes().map(i64::from).collect();
    let seq = tokens.len();
    let graph = model.build_graph(1, seq)?;
    castor_ir::verify(&graph).context("the front end built an invalid graph")?;
    print!(
        "{}",
        model_summary(
            "embedded tiny-gpt2 (deterministic init)",
            &model,
            &graph,
            1,
            seq
        )
    );

    let inputs = [
        (
            "input_ids",
            Tensor::from_i64(DType::I64, [1, seq], tokens.clone()),
        ),
        (
            "attention_mask",
            Tensor::from_i64(DType::I64, [1, seq], vec![1; seq]),
        ),
    ];
    let bind = |name: &str| {
        inputs
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| t)
            .or_else(|| params.get(name))
    };
    let start = Instant::now();
    let outputs = CpuExecutor::new().run(&graph, &bind)?;
    let elapsed = start.elapsed();
    let logits = outputs
        .first()
        .and_then(|t| t.as_f32())
        .context("the demo graph has no float output")?;
    let vocab = logits.len() / seq;
    let loss = next_token_loss(logits, &tokens, vocab);
    println!();
    println!(
        "forward     {seq} tokens of text -> logits f32[1,{seq},{vocab}] in {:.2} ms on the CPU executor",
        elapsed.as_secs_f64() * 1e3
    );
    println!(
        "loss        next-byte cross-entropy {loss:.4} (untrained; uniform would be ln {vocab} = {:.4})",
        (vocab as f64).ln()
    );
    Ok(())
}

/// Mean cross-entropy of predicting token t+1 from position t.
fn next_token_loss(logits: &[f32], tokens: &[i64], vocab: usize) -> f64 {
    let mut total = 0.0;
    for t in 0..tokens.len() - 1 {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        total += lse - row[tokens[t + 1] as usize] as f64;
    }
    total / (tokens.len() - 1) as f64
}
