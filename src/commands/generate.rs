//! `castor generate`: continue a prompt with a causal model (GPT-2, LLaMA), token by token
//! with a KV cache, tokenized and detokenized with the model's own tokenizer.
//!
//! The text goes to stdout as it is generated (the prompt first); what ran and how fast to
//! stderr.

use crate::generate::{Generator, Sampling};
use crate::precision::PrecisionArgs;
use crate::rng::Rng;
use crate::tokenizer::TextTokenizer;
use crate::CliError;
use castor_models::Model;
use std::path::PathBuf;
use std::time::Instant;

/// Where `generate` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GenerateDevice {
    /// The CPU executor (the only one decoding runs on for now: the CUDA executor runs
    /// training plans and single graphs, not a graph per decoding step).
    Cpu,
}

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder (config.json + safetensors; a folder `castor train --save` wrote
    /// works) of a causal model, with its tokenizer files.
    pub model: PathBuf,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Tokens to generate at most (generation also stops at the tokenizer's end-of-text token
    /// and at the model's last position).
    #[arg(long, default_value_t = 50, value_name = "N")]
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy (always the most likely token).
    #[arg(long, default_value_t = 1.0, help_heading = "Sampling")]
    pub temperature: f64,
    /// Sample among the K most likely tokens only (0 = all).
    #[arg(
        long,
        default_value_t = 50,
        value_name = "K",
        help_heading = "Sampling"
    )]
    pub top_k: usize,
    /// Sample among the most likely tokens whose probability reaches P (1 = all).
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "P",
        help_heading = "Sampling"
    )]
    pub top_p: f64,
    /// Seed of the sampler: the same seed, model and flags give the same text.
    #[arg(long, default_value_t = 0, help_heading = "Sampling")]
    pub seed: u64,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// A PEFT LoRA adapter folder to generate with (as `PeftModel.from_pretrained`).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Where to run: `cpu` only for now (decoding is not lowered for the CUDA executor).
    #[arg(long, value_enum, default_value_t = GenerateDevice::Cpu, help_heading = "Device")]
    pub device: GenerateDevice,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return Err(CliError::InvalidInput(format!(
            "--temperature must be 0 (greedy) or positive, found {}",
            args.temperature
        ))
        .into());
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        return Err(CliError::InvalidInput(format!(
            "--top-p must be in (0, 1], found {}",
            args.top_p
        ))
        .into());
    }
    let mut model = Model::load(&args.model)?;
    model.set_attention(args.precision.attention.into());
    crate::report::warn_unused(&model);
    if model.head() != castor_models::Head::CausalLm {
        return Err(CliError::InvalidInput(format!(
            "`{}` is a {}: generate continues text with a causal LM (GPT2LMHeadModel, \
             LlamaForCausalLM){}",
            args.model.display(),
            model.architecture(),
            if model.head() == castor_models::Head::MaskedLm {
                "; `castor eval --text` fills in its mask tokens"
            } else {
                ""
            }
        ))
        .into());
    }
    let tokenizer = TextTokenizer::for_model(&model)?;
    let prompt: Vec<i64> = tokenizer
        .encode(&args.prompt, true)?
        .into_iter()
        .map(i64::from)
        .collect();
    if prompt.is_empty() {
        return Err(CliError::InvalidInput("--prompt has no tokens".into()).into());
    }
    if prompt.len() >= model.max_positions() {
        return Err(CliError::InvalidInput(format!(
            "--prompt is {} tokens; the model has {} positions",
            prompt.len(),
            model.max_positions()
        ))
        .into());
    }
    let mut weights = model.load_params()?;
    let adapter = match &args.adapter {
        Some(dir) => Some(crate::adapter::load(dir)?),
        None => None,
    };
    if let Some(a) = &adapter {
        // Every adapter the pass adds must be in the folder: check against the prompt's graph.
        let graph = model.build_decode_graph(1, 0, prompt.len())?;
        let (graph, report) = crate::training::with_adapters(graph, Some(&a.lora))?;
        let wanted: Vec<(String, castor_ir::TensorType)> = graph
            .params()
            .map(|p| (graph.name(p).to_string(), graph.ty(p).clone()))
            .collect();
        weights.extend(crate::adapter::initial(
            &wanted,
            Some(&a.tensors),
            args.adapter.as_deref(),
            0,
        )?);
        if let Some(r) = report {
            errln!("lora        {}", r.summary);
        }
    }
    errln!(
        "generate    {} on the CPU executor, {}; tokenizer {}; prompt {} tokens",
        model.architecture(),
        args.precision.precision,
        tokenizer.describe(),
        prompt.len()
    );
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
    };
    let mut generator =
        Generator::new(&model, args.precision.clone()).with_adapters(adapter.map(|a| a.lora));
    let mut rng = Rng::new(args.seed);
    let end = tokenizer.end_of_text();
    // Decoded text is printed as it grows; a token that ends inside a UTF-8 character waits.
    out!("{}", args.prompt);
    let mut ids: Vec<u32> = Vec::new();
    let mut printed = String::new();
    let start = Instant::now();
    let new = generator.generate(
        &prompt,
        args.max_new_tokens,
        &sampling,
        &mut rng,
        &|name| weights.get(name),
        &|t| Some(t) == end,
        &mut |t| {
            ids.push(t);
            let text = tokenizer.decode(&ids);
            if let Some(more) = text.strip_prefix(printed.as_str()) {
                if !more.is_empty() && !more.ends_with('\u{fffd}') {
                    out!("{more}");
                    printed = text;
                }
            }
        },
    )?;
    let text = tokenizer.decode(&ids);
    match text.strip_prefix(printed.as_str()) {
        Some(more) => outln!("{more}"),
        // The decoder rewrote what was printed (rare: a cleanup across tokens).
        None => outln!("\n{}{text}", args.prompt),
    }
    let seconds = start.elapsed().as_secs_f64();
    let why = if new.len() == args.max_new_tokens {
        "--max-new-tokens reached".to_string()
    } else if generator.len() >= model.max_positions() {
        format!("the model's {} positions are full", model.max_positions())
    } else {
        "end of text".to_string()
    };
    errln!(
        "generated   {} tokens in {seconds:.2} s ({:.1} tokens/s); stopped: {why}",
        new.len(),
        new.len() as f64 / seconds.max(1e-9)
    );
    Ok(())
}
