//! `castor compile`: run the precision passes and show what they decided.

use crate::precision::PrecisionArgs;
use crate::report::thousands;
use anyhow::Context;
use castor_ir::{text, verify, Graph};
use castor_models::Model;
use castor_passes::{explain, precision_summary};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// The precision report (always printed to stdout).
    Summary,
    /// The compiled graph's IR text.
    Ir,
    /// A Graphviz picture of the compiled graph, coloured by dtype, casts as diamonds.
    Dot,
}

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder, a bare config.json (no weights needed), or an IR text file (.ir).
    pub model: PathBuf,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// What to write: the summary, the IR text or a DOT graph.
    #[arg(long, value_enum, default_value_t = Emit::Summary)]
    pub emit: Emit,
    /// Write the emitted IR or DOT here instead of stdout.
    #[arg(short = 'o', long = "out", value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Explain the dtype decisions of the nodes whose names match GLOB (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub explain: Vec<String>,
    /// Print the IR after the named pass (`input`, `classify`, `autocast`, `fold_casts`).
    #[arg(long, value_name = "PASS")]
    pub dump_after: Option<String>,
    /// Run the IR verifier after every pass (always on in debug builds).
    #[arg(long)]
    pub verify: bool,
    /// Batch size of the graph built from a model.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Sequence length of the graph (default: the model's maximum).
    #[arg(long)]
    pub seq: Option<usize>,
}

/// The forward graph of a model path or an IR file, and a one-line description.
fn load_graph(path: &Path, batch: usize, seq: Option<usize>) -> anyhow::Result<(Graph, String)> {
    if path.extension().is_some_and(|e| e == "ir") {
        let src = std::fs::read_to_string(path).map_err(|e| {
            crate::CliError::InvalidInput(format!("cannot read `{}`: {e}", path.display()))
        })?;
        let g = text::parse(&src).with_context(|| format!("`{}`", path.display()))?;
        verify(&g).with_context(|| format!("`{}`", path.display()))?;
        let what = format!("IR file, {} nodes", g.num_nodes());
        return Ok((g, what));
    }
    let model = Model::load(path)?;
    let seq = seq.unwrap_or_else(|| model.max_positions());
    let g = model.build_graph(batch, seq)?;
    let what = format!(
        "{} ({}), {} parameters, batch {batch} x seq {seq}",
        model.architecture(),
        model.family().model_type(),
        thousands(model.parameter_count())
    );
    Ok((g, what))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (graph, what) = load_graph(&args.model, args.batch, args.seq)?;
    let out = args
        .precision
        .compile(graph, args.dump_after.as_deref(), args.verify)?;
    let policy = args.precision.policy()?;

    println!("model       {} ({what})", args.model.display());
    println!("precision   {}", args.precision.precision);
    for r in policy.name_rules() {
        println!("rule        {}", r.describe(policy.precision.low()));
    }
    for (pass, report) in &out.reports {
        println!("pass        {pass:<11} {}", report.summary);
    }
    let summary = precision_summary(&out.graph, args.precision.precision.low());
    println!();
    println!("{}", summary.headline());
    for line in summary.table_lines() {
        println!("  {line}");
    }
    for glob in &args.explain {
        let lines = explain(&out.graph, glob);
        if lines.is_empty() {
            println!("\nexplain '{glob}': no node matches");
        }
        for l in lines {
            println!("\n{l}");
        }
    }
    if let Some(dump) = &out.dump {
        println!("\n# IR after {}", args.dump_after.as_deref().unwrap_or(""));
        print!("{dump}");
    }
    let emitted = match args.emit {
        Emit::Summary => None,
        Emit::Ir => Some(text::print(&out.graph)),
        Emit::Dot => Some(castor_ir::to_dot(&out.graph)),
    };
    match (emitted, &args.out) {
        (Some(text), Some(path)) => {
            castor_models::write_atomically(path, text.as_bytes())?;
            println!("\nwrote {}", path.display());
        }
        (Some(text), None) => {
            println!();
            print!("{text}");
        }
        (None, Some(_)) => {
            return Err(
                crate::CliError::InvalidInput("-o needs --emit ir or --emit dot".into()).into(),
            );
        }
        (None, None) => {}
    }
    Ok(())
}
