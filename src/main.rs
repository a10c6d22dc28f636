//! The `castor` command line.
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use castor::commands::{compile, demo, eval, generate, inspect, merge, train};
use castor::given::Given;
use castor::{errln, error_message, exit_code};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "castor",
    version,
    about = "Mixed-precision training compiler for transformer checkpoints",
    long_about = "castor lowers a Hugging Face checkpoint (config.json + safetensors) to a tensor IR, \
                  decides the precision of every node, and runs the result on the CPU reference \
                  executor (or CUDA)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Summarize a checkpoint folder or a bare config.json: family, parameters, op classes.
    Inspect(inspect::Args),
    /// Run the precision passes and report what they decided (works from config.json alone).
    Compile(Box<compile::Args>),
    /// Run a forward pass on a batch (a safetensors file, or text) and report or write the
    /// outputs.
    Eval(eval::Args),
    /// Train a model: plan, loss scaling, optimizer, log, checkpoint, report.
    Train(Box<train::Args>),
    /// Continue a prompt with a causal model (GPT-2, LLaMA): KV-cache decoding, sampling.
    Generate(generate::Args),
    /// Compile and train the embedded tiny GPT-2 end to end: no files, no GPU.
    Demo(demo::Args),
    /// Fold a PEFT LoRA adapter into its base checkpoint: a full Hugging Face folder.
    Merge(merge::Args),
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let given = Given::new(
        matches
            .subcommand()
            .map(|(_, m)| m.clone())
            .unwrap_or_default(),
    );
    let result = match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Compile(a) => compile::run(*a, &given),
        Command::Eval(a) => eval::run(a),
        Command::Train(a) => train::run(*a, &given),
        Command::Generate(a) => generate::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Merge(a) => merge::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The run already said where it stopped and what it saved.
        Err(e) if e.is::<castor::Interrupted>() => ExitCode::from(castor::codes::INTERRUPTED),
        Err(e) => {
            errln!("error: {}", error_message(&e));
            ExitCode::from(exit_code(&e))
        }
    }
}
