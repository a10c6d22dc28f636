//! `castor inspect MODEL`: the cheap validator and summary.
//!
//! Everything it checks comes from config.json, the safetensors headers and the file sizes
//! (absurd configs are refused before anything is built); `--strict` also reads the weights
//! to refuse NaN and Inf.

use crate::out::Stream;
use crate::report::model_summary;
use crate::tokenizer::TextTokenizer;
use anyhow::Context;
use castor_models::Model;
use std::fmt::Write;
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
    /// Also describe a PEFT LoRA adapter folder for this model: its settings, the products it
    /// adapts and the parameters it trains against the frozen base (--ir then prints the
    /// graph with the adapters).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let inspected = inspect(&args)?;
    // With --ir the IR is the result: it goes to stdout alone, the summary to stderr.
    let say = if args.ir {
        Stream::Stderr
    } else {
        Stream::Stdout
    };
    say.write(format_args!("{}", inspected.report));
    if args.ir {
        crate::out!("{}", castor_ir::text::print(&inspected.graph));
    }
    Ok(())
}

/// What `inspect` found: the model, its report and its graph (with the adapters of
/// `--adapter`).
pub struct Inspected {
    pub model: Model,
    /// The summary, as the CLI prints it.
    pub report: String,
    pub graph: castor_ir::Graph,
}

/// Runs every check `inspect` makes and writes its report; printing is the caller's.
pub fn inspect(args: &Args) -> anyhow::Result<Inspected> {
    let mut r = String::new();
    let model = Model::load(&args.model)?;
    crate::report::warn_unused(&model);
    let seq = args.seq.unwrap_or_else(|| model.max_positions());
    let graph = model.build_graph(args.batch, seq)?;
    castor_ir::verify(&graph).context("the front end built an invalid graph")?;
    write!(
        r,
        "{}",
        model_summary(
            &args.model.display().to_string(),
            &model,
            &graph,
            args.batch,
            seq
        )
    )?;
    match TextTokenizer::for_model(&model) {
        Ok(tok) => writeln!(
            r,
            "tokenizer   {}, {} tokens (vocabulary {})",
            tok.describe(),
            tok.len(),
            model.vocab_size()
        )?,
        // A tokenizer that belongs to another model is invalid input; a missing one only
        // means text cannot be read.
        Err(e) if has_tokenizer_files(&model) => return Err(e),
        Err(_) => writeln!(r, "tokenizer   none (token files and batches only)")?,
    }
    let dir = model
        .config()
        .file
        .parent()
        .unwrap_or(std::path::Path::new("."));
    match crate::chat::ChatTemplate::find(dir) {
        Ok(Some(t)) => writeln!(
            r,
            "chat        template `{}`; {}",
            t.origin().display(),
            if t.marks_generation() {
                "marks the assistant's turns ({% generation %}): SFT on conversations takes \
                 the loss on them"
            } else {
                "no {% generation %} blocks: SFT on conversations needs --loss-on all"
            }
        )?,
        Ok(None) => {}
        // Said, not fatal: inspect is where a broken template should show.
        Err(e) => writeln!(r, "chat        {}", crate::error_message(&e))?,
    }
    let graph = match &args.adapter {
        Some(dir) => {
            let a = crate::adapter::load(dir)?;
            let (graph, report) = crate::training::with_adapters(graph, Some(&a.lora))?;
            let wanted = crate::adapter::adapters_of(&graph);
            // Every adapter the model gets must be in the folder, shaped as the graph says.
            let tensors = crate::adapter::initial(&wanted, Some(&a.tensors), Some(dir), 0)?;
            for (name, ty) in &wanted {
                if let Some(t) = tensors.get(name) {
                    if t.shape() != &ty.shape {
                        return Err(crate::CliError::InvalidInput(format!(
                            "--adapter `{}`: `{name}` is {}, the model needs {}",
                            dir.display(),
                            t.shape(),
                            ty.shape
                        ))
                        .into());
                    }
                }
            }
            writeln!(
                r,
                "adapter     {}: PEFT LoRA, r={}, lora_alpha={} (scale {}), target_modules {}, \
                 {} tensors",
                dir.display(),
                a.lora.rank,
                a.lora.alpha,
                a.lora.scaling(),
                a.lora.targets.join(","),
                a.tensors.len()
            )?;
            if let Some(lora) = report {
                writeln!(r, "lora        {}", lora.summary)?;
            }
            graph
        }
        None => graph,
    };
    if args.strict {
        // `scan_weights(true)` fails on the first NaN or Inf found, naming every such tensor.
        model.scan_weights(true)?;
        writeln!(
            r,
            "weights     all {} parameter tensors are finite",
            model.expected_params().len()
        )?;
    }
    Ok(Inspected {
        model,
        report: r,
        graph,
    })
}

/// Whether the model's folder holds any tokenizer file.
fn has_tokenizer_files(model: &Model) -> bool {
    model.config().file.parent().is_some_and(|dir| {
        ["tokenizer.json", "vocab.json", "merges.txt", "vocab.txt"]
            .iter()
            .any(|f| dir.join(f).is_file())
    })
}
