//! `castor train`: compile a training plan and run it on the CPU executor.
//!
//! The loop ([`train_loop`]) is shared with `castor demo`: learning-rate schedule, progress,
//! JSON-lines log, validation, loss-curve picture, periodic checkpoints and Ctrl-C.

use crate::checkpoint::{self, CheckpointFiles, TrainerState};
use crate::commands::eval::Device;
use crate::data::{Data, DataOptions};
use crate::plot::{self, LossHistory};
use crate::precision::PrecisionArgs;
use crate::progress::{Progress, StepLine};
use crate::trainer::Trainer;
use crate::training::TrainingArgs;
use crate::CliError;
use anyhow::Context;
use castor_ir::{Tensor, TrainingPlan};
use castor_models::Model;
use castor_passes::build_training_plan;
use castor_runtime::cpu::CpuExecutor;
use castor_runtime::{PlanRunner, RuntimeError, StepReport};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// batch every step), a token file (.bin: llm.c's format, or nanoGPT's raw u16 tokens),
    /// or a text file (tokenized with the model's tokenizer.json, else byte by byte).
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
    /// Hold out this fraction of the token stream (its end) for validation.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub val_fraction: f64,
    /// Evaluate the validation loss every N steps (and at the end; needs --val-fraction).
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Micro-batches of held-out windows per evaluation (at most).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub eval_batches: usize,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Time each logged step's runs on the GPU (CUDA events around the micro steps and the
    /// optimizer step), written to the JSON log as `micro_steps_ms` and `optimizer_step_ms`.
    #[arg(long)]
    pub profile: bool,
    /// Write a checkpoint here at the end (a Hugging Face folder plus optimizer state).
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Also write a checkpoint every N steps, as the folder DIR/step-NNNNNN/ (needs --save).
    #[arg(long, value_name = "N")]
    pub save_every: Option<u64>,
    /// Keep only the newest K step folders (0 keeps all).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub keep: usize,
    /// Continue from a checkpoint written by --save (its newest step folder, when that is
    /// further along): model, optimizer, scaler, data position.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Append one JSON line per step here.
    #[arg(long, value_name = "FILE.jsonl")]
    pub log: Option<PathBuf>,
    /// Draw the loss curve here (SVG), redrawn at every evaluation and printed line.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Print a line every N steps (default: about 20 lines per run).
    #[arg(long)]
    pub print_every: Option<u64>,
}

/// Set by Ctrl-C: the loop finishes its step, saves and stops.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Installs the Ctrl-C handler (once per process).
pub fn catch_interrupts() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Without a handler Ctrl-C simply kills the process, as before.
        let _ = ctrlc::set_handler(|| {
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                // A second Ctrl-C: stop now.
                std::process::exit(130);
            }
        });
    });
}

/// The learning-rate schedule: linear warmup, then constant or cosine decay.
#[derive(Clone, Debug)]
pub struct LrSchedule {
    pub peak: f64,
    pub warmup: u64,
    pub schedule: Schedule,
    pub min_lr: f64,
    /// The schedule's length in steps.
    pub total: u64,
}

impl LrSchedule {
    /// The learning rate of loop step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        match self.schedule {
            Schedule::Constant => self.peak,
            Schedule::Cosine => {
                let span = self.total.saturating_sub(self.warmup).max(1) as f64;
                let progress = ((step - self.warmup) as f64 / span).min(1.0);
                self.min_lr
                    + 0.5
                        * (self.peak - self.min_lr)
                        * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// Periodic checkpoints.
pub struct Saves {
    pub root: PathBuf,
    pub every: u64,
    pub keep: usize,
}

/// What the training loop does besides stepping.
pub struct LoopOptions {
    /// Loop steps already done (resumed runs).
    pub first_step: u64,
    pub steps: u64,
    pub lr: LrSchedule,
    pub print_every: u64,
    /// Evaluate every N steps (0 = only at the end); only with validation data.
    pub eval_every: u64,
    pub eval_batches: usize,
    pub log: Option<std::fs::File>,
    /// The loss-curve picture and its title.
    pub plot: Option<(PathBuf, String)>,
    pub saves: Option<Saves>,
    pub files: CheckpointFiles,
    pub input_names: &'static [&'static str],
    /// The progress bar's prefix.
    pub label: String,
}

/// What a run of the loop did.
pub struct LoopOutcome {
    pub steps_done: u64,
    pub history: LossHistory,
    pub last: Option<StepReport>,
    pub skipped: u64,
    pub seconds: f64,
    pub tokens: f64,
    pub interrupted: bool,
    /// Steps whose validation loss was computed (1-based step numbers).
    pub evaluated_at: Option<u64>,
}

/// The validation loss: the plan's micro step (forward and backward of one micro-batch) run
/// on each held-out batch with the runner's state, writing nothing back; the mean loss.
pub fn validation_loss(
    runner: &PlanRunner,
    batches: &[HashMap<String, Tensor>],
) -> anyhow::Result<Option<f64>> {
    if batches.is_empty() {
        return Ok(None);
    }
    let graph = &runner.plan().micro_step;
    let executor = CpuExecutor::new();
    let mut sum = 0.0;
    for batch in batches {
        let bind = |name: &str| batch.get(name).or_else(|| runner.state(name));
        let outputs = executor.run(graph, &bind)?;
        let loss = outputs
            .first()
            .and_then(|t| t.as_f32())
            .and_then(|v| v.first().copied())
            .context("the micro step has no loss output")?;
        sum += f64::from(loss);
    }
    Ok(Some(sum / batches.len() as f64))
}

/// Runs `opts.steps` steps of `runner` on `data`, continuing `history`.
pub fn train_loop(
    runner: &mut Trainer,
    data: &mut Data,
    opts: &mut LoopOptions,
    mut history: LossHistory,
) -> anyhow::Result<LoopOutcome> {
    let settings = runner.plan().settings.clone();
    let (batch, seq) = (settings.batch, settings.seq);
    let tokens_per_step = (batch * seq * settings.grad_accum) as f64;
    let val_batches = data.validation_batches(opts.input_names, opts.eval_batches);
    let progress = Progress::new(opts.first_step, opts.steps, &opts.label);
    let start = Instant::now();
    let mut out = LoopOutcome {
        steps_done: 0,
        history: LossHistory::default(),
        last: None,
        skipped: 0,
        seconds: 0.0,
        tokens: 0.0,
        interrupted: false,
        evaluated_at: None,
    };
    let end = opts.first_step + opts.steps;
    let (mut queued, mut last_report) = (0u64, Instant::now());
    for step in opts.first_step..end {
        let lr = opts.lr.at(step);
        let micro: Vec<HashMap<String, Tensor>> = (0..settings.grad_accum)
            .map(|_| data.next_batch(opts.input_names))
            .collect();
        let done = step + 1;
        let last_step = done == end;
        let eval_now = !val_batches.is_empty()
            && ((opts.eval_every > 0 && done.is_multiple_of(opts.eval_every)) || last_step);
        let print = (done - opts.first_step).is_multiple_of(opts.print_every) || last_step;
        let stop = INTERRUPTED.load(Ordering::SeqCst);
        let save_now = opts
            .saves
            .as_ref()
            .is_some_and(|s| s.every > 0 && (done.is_multiple_of(s.every) || last_step || stop));
        // A device step's report is read back only when something shows or keeps it.
        let wanted = print || eval_now || save_now || stop || opts.log.is_some();
        let stepped = runner.step(&micro, lr as f32, wanted)?;
        out.steps_done += 1;
        let Some(report) = stepped else {
            progress.tick();
            queued += 1;
            continue;
        };
        // Throughput over the steps since the last report (queued device steps included).
        let tokens_per_s =
            tokens_per_step * (queued + 1) as f64 / last_report.elapsed().as_secs_f64().max(1e-9);
        queued = 0;
        last_report = Instant::now();
        out.skipped += u64::from(report.skipped);
        history.train.push((done, f64::from(report.loss)));

        let val_loss = if eval_now {
            let v = runner.validation_loss(&val_batches)?;
            if let Some(v) = v {
                history.validation.push((done, v));
                out.evaluated_at = Some(done);
                progress.println(&format!("eval   {done:>6}  validation loss {v:.4}"));
            }
            v
        } else {
            None
        };
        if let Some(f) = opts.log.as_mut() {
            let mut line = serde_json::json!({
                "step": step,
                "loss": report.loss,
                "loss_scale": report.loss_scale,
                "skipped": report.skipped,
                "grad_norm": if report.grad_norm.is_finite() { Some(report.grad_norm) } else { None },
                "lr": lr,
                "tokens_per_s": tokens_per_s,
            });
            if let Some(v) = val_loss {
                line["val_loss"] = serde_json::json!(v);
            }
            if let Some(t) = report.device_time {
                line["micro_steps_ms"] = serde_json::json!(t.micro_steps_ms);
                line["optimizer_step_ms"] = serde_json::json!(t.optimizer_step_ms);
            }
            writeln!(f, "{line}").context("cannot write the training log")?;
        }
        progress.step(
            &StepLine {
                step: done,
                loss: report.loss,
                lr,
                loss_scale: report.loss_scale,
                grad_norm: report.grad_norm,
                skipped: report.skipped,
                tokens_per_s,
            },
            print,
        );
        if let Some((path, title)) = &opts.plot {
            if print || eval_now {
                plot::write_loss_curve(path, title, &history)?;
            }
        }
        check_loss_scale(runner.min_loss_scale(), &report, step)?;
        out.last = Some(report);
        if let (Some(saves), true) = (&opts.saves, save_now) {
            let state = TrainerState {
                step: done,
                data_position: data.position(),
                settings: settings.clone(),
            };
            checkpoint::save_step(&saves.root, saves.keep, &opts.files, runner.host()?, &state)?;
        }
        if stop {
            out.interrupted = true;
            break;
        }
    }
    progress.finish();
    out.seconds = start.elapsed().as_secs_f64();
    out.tokens = tokens_per_step * out.steps_done as f64;
    out.history = history;
    Ok(out)
}

/// Reads the losses of steps before `before` (1-based) from a JSON-lines log, so a resumed
/// run's picture shows the whole run.
fn history_from_log(path: &Path, before: u64) -> LossHistory {
    let mut h = LossHistory::default();
    let Ok(text) = std::fs::read_to_string(path) else {
        return h;
    };
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(step) = v["step"].as_u64().map(|s| s + 1) else {
            continue;
        };
        if step > before {
            continue;
        }
        if let Some(l) = v["loss"].as_f64() {
            h.train.push((step, l));
        }
        if let Some(l) = v["val_loss"].as_f64() {
            h.validation.push((step, l));
        }
    }
    h
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let device = crate::device::select(args.device)?;
    if args.save_every.is_some() && args.save.is_none() {
        return Err(CliError::InvalidInput(
            "--save-every needs --save DIR (step folders go into DIR)".into(),
        )
        .into());
    }
    if args.eval_every.is_some() && args.val_fraction <= 0.0 {
        return Err(CliError::InvalidInput(
            "--eval-every needs held-out data: give --val-fraction".into(),
        )
        .into());
    }
    if let Some(p) = &args.plot {
        plot::check_picture_path(p)?;
    }
    // Resuming reads the weights from the checkpoint, which is itself a model folder.
    let resume_dir = args.resume.as_deref().map(checkpoint::resolve_resume);
    let model_path = resume_dir.as_deref().unwrap_or(&args.model);
    let model = Model::load(model_path)?;
    let config_json = std::fs::read_to_string(&model.config().file)
        .with_context(|| format!("cannot read `{}`", model.config().file.display()))?;
    let files = CheckpointFiles::new(config_json, model.config().file.parent());
    let resume = resume_dir
        .as_deref()
        .map(checkpoint::load_resume_state)
        .transpose()?;
    if let Some(dir) = &resume_dir {
        println!("resume      {}", dir.display());
    }

    let mut data_options = DataOptions {
        batch: args.batch,
        seq: args.seq,
        val_fraction: args.val_fraction,
    };
    let (plan, mut data) = match &args.plan {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                CliError::InvalidInput(format!("cannot read plan `{}`: {e}", path.display()))
            })?;
            let plan = TrainingPlan::from_json(&text)
                .map_err(|e| CliError::InvalidInput(format!("`{}`: {e}", path.display())))?;
            let objective = plan_objective(&plan)?;
            data_options.batch = Some(plan.settings.batch);
            data_options.seq = Some(plan.settings.seq);
            let data = Data::open(&args.data, &model, objective, &data_options)?;
            (plan, data)
        }
        None => {
            let objective = args.training.objective(Some(&model))?;
            let data = Data::open(&args.data, &model, objective, &data_options)?;
            (compile_plan(&args, &model, data.shape())?, data)
        }
    };
    println!("data        {}", data.describe());
    println!("{}", memory_line(&plan));
    if args.eval_every.is_some() && !data.has_validation() {
        return Err(CliError::InvalidInput("--eval-every: no held-out data".into()).into());
    }

    let params = if model.checkpoint().is_some() {
        model.load_params()?
    } else {
        eprintln!("weights: initialized from the config (seed {INIT_SEED:#x})");
        model.init_params(INIT_SEED)
    };
    let settings = plan.settings.clone();
    let mut runner = Trainer::new(plan, &|name| params.get(name).cloned(), &device)?;
    drop(params);
    runner.set_timing(args.profile);
    if let Some(bytes) = runner.allocated_bytes() {
        println!(
            "memory      {} ({bytes} bytes) allocated on the device for the plan",
            castor_ir::human_bytes(bytes)
        );
    }
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

    let log = match &args.log {
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
    let history = match &args.log {
        Some(path) if first_step > 0 => history_from_log(path, first_step),
        _ => LossHistory::default(),
    };
    let print_every = args
        .print_every
        .unwrap_or_else(|| (args.steps / 20).max(1))
        .max(1);
    let (batch, seq) = (settings.batch, settings.seq);
    println!(
        "training    {} steps of {} x [{batch}, {seq}] tokens, {}, objective {}",
        args.steps, settings.grad_accum, settings.precision, settings.objective
    );
    if let Some(root) = &args.save {
        checkpoint::clean_stale(root);
    }
    catch_interrupts();
    let title = format!(
        "{} on {} ({})",
        model.architecture(),
        args.data
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        settings.precision
    );
    let mut opts = LoopOptions {
        first_step,
        steps: args.steps,
        lr: LrSchedule {
            peak: args.training.lr,
            warmup: args.warmup,
            schedule: args.schedule,
            min_lr: args.min_lr,
            total: args.total_steps.unwrap_or(first_step + args.steps),
        },
        print_every,
        eval_every: args.eval_every.unwrap_or(0),
        eval_batches: args.eval_batches,
        log,
        plot: args.plot.clone().map(|p| (p, title)),
        saves: match (&args.save, args.save_every) {
            (Some(root), Some(every)) => Some(Saves {
                root: root.clone(),
                every: every.max(1),
                keep: args.keep,
            }),
            _ => None,
        },
        files,
        input_names: model.input_names(),
        label: "train".into(),
    };
    let out = train_loop(&mut runner, &mut data, &mut opts, history)?;
    if let Some(r) = &out.last {
        println!(
            "done        {} steps in {:.2} s ({:.0} tokens/s); final loss {:.4}; {} skipped; loss scale {}",
            out.steps_done,
            out.seconds,
            out.tokens / out.seconds.max(1e-9),
            r.loss,
            out.skipped,
            r.next_loss_scale
        );
    }
    if let Some((_, v)) = out.history.validation.last() {
        println!(
            "validation  loss {v:.4} at step {}",
            out.evaluated_at.unwrap_or(0)
        );
    }
    if let Some(path) = &args.plot {
        plot::write_loss_curve(
            path,
            &opts.plot.as_ref().map(|p| p.1.clone()).unwrap_or_default(),
            &out.history,
        )?;
        println!("plot        {}", path.display());
    }
    let step = first_step + out.steps_done;
    if let Some(dir) = &args.save {
        let state = TrainerState {
            step,
            data_position: data.position(),
            settings,
        };
        checkpoint::save(dir, &opts.files, runner.host()?, &state)?;
        println!("saved       {}", dir.display());
    }
    if out.interrupted {
        match &args.save {
            Some(dir) => println!(
                "interrupted after step {step}: checkpoint saved; continue with --resume {}",
                dir.display()
            ),
            None => println!("interrupted after step {step}; nothing saved (no --save DIR)"),
        }
    }
    Ok(())
}

/// The plan's planned memory per step (from the plan alone, so a plan file reports it too).
fn memory_line(plan: &TrainingPlan) -> String {
    use castor_ir::human_bytes;
    let a = castor_passes::memory::Anatomy::of_plan(plan);
    format!(
        "memory      {} planned per step: state {}, arena {} (saved activations {})",
        human_bytes(a.total()),
        human_bytes(a.persistent()),
        human_bytes(a.memory.arena_bytes),
        human_bytes(a.saved_activations)
    )
}

/// The objective a plan was built for.
fn plan_objective(plan: &TrainingPlan) -> anyhow::Result<castor_models::Objective> {
    Ok(plan.settings.objective.parse().map_err(|_| {
        CliError::InvalidInput(format!(
            "the plan's loss is `{}`, not a model objective (lm, mlm, sum): plans compiled \
             from IR files cannot be trained on a model's data",
            plan.settings.objective
        ))
    })?)
}

/// Compiles the training plan for the model with the command's flags, for batches of
/// `shape` = (batch, seq).
fn compile_plan(
    args: &Args,
    model: &Model,
    (batch, seq): (usize, usize),
) -> anyhow::Result<TrainingPlan> {
    let objective = args.training.objective(Some(model))?;
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

/// Stops the run when a dynamic loss scale fell below its minimum.
fn check_loss_scale(min_scale: Option<f64>, report: &StepReport, step: u64) -> anyhow::Result<()> {
    match min_scale {
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
