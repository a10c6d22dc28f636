//! `castor inspect MODEL`: the cheap validator and summary.
//!
//! Everything it checks comes from config.json, the safetensors headers and the file sizes
//! (absurd configs are refused before anything is built); `--strict` also reads the weights
//! to refuse NaN and Inf.

use crate::report::model_summary;
use anyhow::Context;
use castor_models::Model;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder (config.json + safetensors) or a bare config.json.
    pub model: PathBuf,
    /// Also print the forward graph's IR text.
    #[arg(long)]
    pub ir: bool,
    /// Batch size of the graph that is built.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Sequence length of the graph (default: the model's maximum).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Also read every weight and refuse NaN or Inf values. Without it, inspect reads only
    /// config.json and the safetensors headers, never tensor data.
    #[arg(long)]
    pub strict: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model = Model::load(&args.model)?;
    let seq = args.seq.unwrap_or_else(|| model.max_positions());
    let graph = model.build_graph(args.batch, seq)?;
    castor_ir::verify(&graph).context("the front end built an invalid graph")?;
    print!(
        "{}",
        model_summary(
            &args.model.display().to_string(),
            &model,
            &graph,
            args.batch,
            seq
        )
    );
    if let Some(path) = crate::data::model_tokenizer(&model) {
        let tok = crate::data::load_tokenizer(&path, model.vocab_size())?;
        println!(
            "tokenizer   tokenizer.json, {} tokens (vocabulary {})",
            tok.get_vocab_size(true),
            model.vocab_size()
        );
    }
    if args.strict {
        // `scan_weights(true)` fails on the first NaN or Inf found, naming every such tensor.
        model.scan_weights(true)?;
        println!(
            "weights     all {} parameter tensors are finite",
            model.expected_params().len()
        );
    }
    if args.ir {
        println!();
        print!("{}", castor_ir::text::print(&graph));
    }
    Ok(())
}
