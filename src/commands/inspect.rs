//! `castor inspect MODEL`: the cheap validator and summary.

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
    if args.ir {
        println!();
        print!("{}", castor_ir::text::print(&graph));
    }
    Ok(())
}
