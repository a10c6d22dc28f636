//! The `castor` command line.
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use castor::commands::{compile, demo, eval, inspect, train};
use castor::exit_code;
use clap::{Parser, Subcommand};
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
    Compile(compile::Args),
    /// Run a forward pass on a batch from a safetensors file and write the outputs.
    Eval(eval::Args),
    /// Train a model on the CPU executor: plan, loss scaling, optimizer, log, checkpoint.
    Train(train::Args),
    /// Compile and train the embedded tiny GPT-2 end to end: no files, no GPU.
    Demo(demo::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Compile(a) => compile::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Train(a) => train::run(a),
        Command::Demo(a) => demo::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(exit_code(&e))
        }
    }
}
