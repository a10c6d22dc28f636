//! `castor train`: compile a training plan and run it on the CPU executor.

use crate::checkpoint::{self, TrainerState};
use crate::commands::eval::Device;
use crate::data::Data;
use crate::precision::PrecisionArgs;
use crate::training::TrainingArgs;
use crate::CliError;
use anyhow::Context;
use castor_ir::{Tensor, TrainingPlan};
use castor_models::Model;
use castor_passes::build_training_plan;
use castor_runtime::{PlanRunner, RuntimeError, StepReport};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Seed of the initialization of config-only models.
const INIT_SEED: u64 = 0x00ca_5709;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Schedule {
    /// The same learning rate every step (after warmup).
    Constant,
    /// Cosine decay from --lr to --min-lr over the run (after warmup).
    Cosine,
}

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder, or a bare config.json (weights initialized with a fixed seed).
    pub model: PathBuf,
    /// Training data: a safetensors batch (`input_ids` [B, T], optional `labels`; the same
    /// batch every step) or a text file read byte by byte.
    #[arg(long)]
    pub data: PathBuf,
    /// Optimizer steps to run.
    #[arg(long)]
    pub steps: u64,
    /// Sequences per micro-batch (text data; default 8).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence (text data; default 64).
    #[arg(long)]
    pub seq: Option<usize>,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    #[command(flatten)]
    pub training: TrainingArgs,
    /// Run a plan written by `castor compile --emit plan` instead of compiling one.
    #[arg(long, value_name = "PLAN.json")]
    pub plan: Option<PathBuf>,
    /// Learning-rate warmup steps (linear from 0).
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    #[arg(long, value_enum, default_value_t = Schedule::Constant)]
    pub schedule: Schedule,
    /// Length of the learning-rate schedule in steps (default: the step this run ends at;
    /// give the full length when a run will be resumed).
    #[arg(long)]
    pub total_steps: Option<u64>,
    /// The final learning rate of the cosine schedule.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Write a checkpoint here at the end (a Hugging Face folder plus optimizer state).
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Continue from a checkpoint written by --save: model, optimizer, scaler, data position.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Append one JSON line per step here.
    #[arg(long, value_name = "FILE.jsonl")]
    pub log: Option<PathBuf>,
    /// Print a line every N steps (default: about 20 lines per run).
    #[arg(long)]
    pub print_every: Option<u64>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::device::select(args.device)?;
    // Resuming reads the weights from the checkpoint, which is itself a model folder.
    let model_path = args.resume.as_deref().unwrap_or(&args.model);
    let model = Model::load(model_path)?;
    let config_json = std::fs::read_to_string(&model.config().file)
        .with_context(|| format!("cannot read `{}`", model.config().file.display()))?;
    let resume = args
        .resume
        .as_deref()
        .map(checkpoint::load_resume_state)
        .transpose()?;

    let plan = match &args.plan {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                CliError::InvalidInput(format!("cannot read plan `{}`: {e}", path.display()))
            })?;
            TrainingPlan::from_json(&text)
                .map_err(|e| CliError::InvalidInput(format!("`{}`: {e}", path.display())))?
        }
        None => compile_plan(&args, &model)?,
    };
    let objective: castor_models::Objective = plan.settings.objective.parse().map_err(|_| {
        CliError::InvalidInput(format!(
            "the plan's loss is `{}`, not a model objective (lm, mlm, sum): plans compiled \
             from IR files cannot be trained on a model's data",
            plan.settings.objective
        ))
    })?;
    let (batch, seq) = (plan.settings.batch, plan.settings.seq);
    let mut data = Data::open(&args.data, &model, objective, Some(batch), Some(seq))?;

    let params = if model.checkpoint().is_some() {
        model.load_params()?
    } else {
        eprintln!("weights: initialized from the config (seed {INIT_SEED:#x})");
        model.init_params(INIT_SEED)
    };
    let settings = plan.settings.clone();
    let mut runner = PlanRunner::new(plan, &|name| params.get(name).cloned())?;
    drop(params);
    let mut first_step = 0;
    if let Some((state, trainer)) = resume {
        if trainer.settings != settings {
            return Err(CliError::InvalidInput(
                "--resume: the checkpoint was trained with other settings (precision, \
                 optimizer, shapes or loss scaling); pass the same flags"
                    .into(),
            )
            .into());
        }
        runner.restore(state)?;
        data.seek(trainer.data_position);
        first_step = trainer.step;
    }

    let mut log = match &args.log {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| {
                    CliError::InvalidInput(format!("cannot open log `{}`: {e}", path.display()))
                })?,
        ),
        None => None,
    };
    let print_every = args
        .print_every
        .unwrap_or_else(|| (args.steps / 20).max(1))
        .max(1);
    let tokens_per_step = (batch * seq * settings.grad_accum) as f64;
    println!(
        "training    {} steps of {} x [{batch}, {seq}] tokens, {}, objective {}",
        args.steps, settings.grad_accum, settings.precision, settings.objective
    );
    let start = Instant::now();
    let mut skipped = 0u64;
    let mut last: Option<StepReport> = None;
    for step in first_step..first_step + args.steps {
        let total = args.total_steps.unwrap_or(first_step + args.steps);
        let lr = learning_rate(&args, step, total);
        let micro: Vec<HashMap<String, Tensor>> = (0..settings.grad_accum)
            .map(|_| data.next_batch(model.input_names()))
            .collect();
        let t0 = Instant::now();
        let report = runner.step(&micro, lr as f32)?;
        let tokens_per_s = tokens_per_step / t0.elapsed().as_secs_f64().max(1e-9);
        skipped += u64::from(report.skipped);
        if let Some(f) = log.as_mut() {
            let line = serde_json::json!({
                "step": step,
                "loss": report.loss,
                "loss_scale": report.loss_scale,
                "skipped": report.skipped,
                "grad_norm": if report.grad_norm.is_finite() { Some(report.grad_norm) } else { None },
                "lr": lr,
                "tokens_per_s": tokens_per_s,
            });
            writeln!(f, "{line}").context("cannot write the training log")?;
        }
        if (step - first_step + 1) % print_every == 0 || step + 1 == first_step + args.steps {
            println!(
                "step {:>6}  loss {:.4}  lr {lr:.3e}  scale {}  grad norm {:.3}{}  {:.0} tokens/s",
                step + 1,
                report.loss,
                report.loss_scale,
                report.grad_norm,
                if report.skipped { "  (skipped)" } else { "" },
                tokens_per_s
            );
        }
        check_loss_scale(&runner, &report, step)?;
        last = Some(report);
    }
    let elapsed = start.elapsed().as_secs_f64();
    if let Some(r) = last {
        println!(
            "done        {} steps in {elapsed:.2} s ({:.0} tokens/s); final loss {:.4}; {skipped} skipped; loss scale {}",
            args.steps,
            tokens_per_step * args.steps as f64 / elapsed.max(1e-9),
            r.loss,
            r.next_loss_scale
        );
    }
    if let Some(dir) = &args.save {
        let state = TrainerState {
            step: first_step + args.steps,
            data_position: data.position(),
            settings,
        };
        checkpoint::save(dir, &config_json, &runner, &state)?;
        println!("saved       {}", dir.display());
    }
    Ok(())
}

/// Compiles the training plan for the model with the command's flags.
fn compile_plan(args: &Args, model: &Model) -> anyhow::Result<TrainingPlan> {
    let objective = args.training.objective(Some(model))?;
    let probe = Data::open(&args.data, model, objective, args.batch, args.seq)?;
    let (batch, seq) = probe.shape();
    let loss_graph = model.build_loss_graph(batch, seq, objective)?;
    castor_ir::verify(&loss_graph).context("the front end built an invalid graph")?;
    let compiled = args.precision.compile(loss_graph, None, false)?;
    if let Some((_, report)) = compiled.reports.iter().find(|(p, _)| *p == "autocast") {
        println!(
            "precision   {} ({})",
            args.precision.precision, report.summary
        );
    }
    let settings = args
        .training
        .settings(args.precision.precision, objective, batch, seq)?;
    let (plan, report) = build_training_plan(&compiled.graph, settings)?;
    println!("plan        {}", report.summary);
    Ok(plan)
}

/// The learning rate of loop step `step` (0-based) of `total`: linear warmup, then constant or
/// cosine decay to `--min-lr`.
fn learning_rate(args: &Args, step: u64, total: u64) -> f64 {
    let peak = args.training.lr;
    if step < args.warmup {
        return peak * (step + 1) as f64 / args.warmup as f64;
    }
    match args.schedule {
        Schedule::Constant => peak,
        Schedule::Cosine => {
            let span = total.saturating_sub(args.warmup).max(1) as f64;
            let progress = ((step - args.warmup) as f64 / span).min(1.0);
            args.min_lr
                + 0.5 * (peak - args.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}

/// Stops the run when a dynamic loss scale fell below its minimum.
fn check_loss_scale(runner: &PlanRunner, report: &StepReport, step: u64) -> anyhow::Result<()> {
    match runner.min_loss_scale() {
        Some(min) if f64::from(report.next_loss_scale) < min => {
            Err(RuntimeError::LossScaleUnderflow {
                step: step + 1,
                scale: report.next_loss_scale,
                min,
            }
            .into())
        }
        _ => Ok(()),
    }
}
