//! `castor train`: compile a training plan (or read one), check it against the flags, the
//! resumed checkpoint and the device's memory, and run it in the loop `castor demo` shares
//! (`crate::train_loop`). Step numbers are 1-based everywhere (console, log, picture,
//! report, `trainer_state.json`), and `--steps` is the step a run trains until, as
//! transformers' `max_steps`: a resumed run continues to it.

use crate::checkpoint::{self, CheckpointFiles};
use crate::commands::eval::Device;
use crate::data::{Data, DataOptions, DataOrder};
use crate::fit::{self, MemoryTarget};
use crate::given::Given;
use crate::html::{self, Report};
use crate::plot::{self, LossHistory};
use crate::precision::PrecisionArgs;
use crate::resume::{self, RunFlags};
pub use crate::train_loop::Hooks;
use crate::train_loop::{
    catch_interrupts, history_from_log, redraw, train_loop, LoopOptions, LrSchedule, Saves,
    Schedule, StateTemplate,
};
use crate::trainer::Trainer;
use crate::training::TrainingArgs;
use crate::CliError;
use anyhow::Context;
use castor_ir::{LoraSettings, TrainSettings, TrainingPlan};
use castor_models::Model;
use castor_runtime::ExecutorKind;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Seed of the initialization of config-only models.
const INIT_SEED: u64 = 0x00ca_5709;

/// The flags that decide what a run computes besides the step itself: how long, on what
/// shapes, with which schedule, over which windows. A resumed run takes them from its
/// checkpoint unless they are given (and a given value that differs is an error).
#[derive(clap::Args, Clone, Debug, Serialize, Deserialize)]
#[command(next_help_heading = "Run")]
pub struct RunArgs {
    /// The step to train until: the total number of optimizer steps, as transformers'
    /// max_steps (a resumed run continues to it; required unless resuming).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Sequences per micro-batch (token streams; default 8).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence (token streams; default 64, or the model's positions if fewer;
    /// more than the model's positions is an error).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Learning-rate warmup steps (linear from 0).
    #[arg(long, default_value_t = 0, help_heading = "Learning-rate schedule")]
    pub warmup: u64,
    #[arg(long, value_enum, default_value_t = Schedule::Constant, help_heading = "Learning-rate schedule")]
    pub schedule: Schedule,
    /// Length of the learning-rate schedule in steps (default: --steps).
    #[arg(long, help_heading = "Learning-rate schedule")]
    pub total_steps: Option<u64>,
    /// The final learning rate of the cosine schedule.
    #[arg(long, default_value_t = 0.0, help_heading = "Learning-rate schedule")]
    pub min_lr: f64,
    /// Hold out this fraction of the token stream (its end) for validation.
    #[arg(long, default_value_t = 0.0, value_name = "F", help_heading = "Data")]
    pub val_fraction: f64,
    /// The order token windows are read in: `shuffle` (a seeded permutation, new every pass
    /// over the data) or `sequential`.
    #[arg(long, value_enum, default_value_t = DataOrder::Shuffle, help_heading = "Data")]
    pub data_order: DataOrder,
    /// Seed of the window order and of masked-LM masking.
    #[arg(long, default_value_t = 0, help_heading = "Data")]
    pub seed: u64,
}

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder, or a bare config.json (weights initialized with a fixed seed).
    pub model: PathBuf,
    /// Training data: a safetensors batch (`input_ids` [B, T], optional `labels`; the same
    /// batch every step), a token file (.bin: llm.c's format, or nanoGPT's raw u16 tokens),
    /// or text tokenized with the model's tokenizer: a text file (one document), a folder of
    /// text files (one document each) or a .jsonl file (one `text` per line).
    #[arg(long, help_heading = "Data")]
    pub data: PathBuf,
    /// Labelled validation examples (.jsonl or .csv, as --data for a classifier): the loss and
    /// accuracy are reported on them at --eval-every and at the end (instead of
    /// --val-fraction).
    #[arg(long, value_name = "FILE", help_heading = "Data")]
    pub validation: Option<PathBuf>,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    #[command(flatten)]
    pub classifier: crate::classifier::ClassifierArgs,
    #[command(flatten)]
    pub training: TrainingArgs,
    /// Continue training a PEFT LoRA adapter (a folder with adapter_config.json and
    /// adapter_model.safetensors): its r, lora_alpha and target_modules shape the adapters
    /// and its weights start them. --save then writes the adapter in the same format.
    #[arg(long, value_name = "DIR", help_heading = "LoRA")]
    pub adapter: Option<PathBuf>,
    /// Run a plan written by `castor compile --emit plan` instead of compiling one (flags
    /// that disagree with the plan are an error).
    #[arg(long, value_name = "PLAN.json", help_heading = "Run")]
    pub plan: Option<PathBuf>,
    /// Evaluate the validation loss every N steps (and at the end; needs --val-fraction).
    #[arg(long, value_name = "N", help_heading = "Data")]
    pub eval_every: Option<u64>,
    /// Micro-batches of held-out windows per evaluation (at most).
    #[arg(long, default_value_t = 8, value_name = "N", help_heading = "Data")]
    pub eval_batches: usize,
    #[arg(long, value_enum, default_value_t = Device::Auto, help_heading = "Device")]
    pub device: Device,
    /// The GPU the fit verdict checks the plan against when training on the CPU: a name
    /// (h100, h200, a100, a100-40gb, l4, rtx-4090, ...) or a spec file. Default: the host's
    /// memory; on CUDA always the GPU's own.
    #[arg(long, value_name = "NAME|FILE", help_heading = "Device")]
    pub gpu: Option<String>,
    /// Time each logged step's runs on the GPU (CUDA events around the micro steps and the
    /// optimizer step), written to the JSON log as `micro_steps_ms` and `optimizer_step_ms`.
    #[arg(long, help_heading = "Device")]
    pub profile: bool,
    /// Profile the last step kernel by kernel (CUDA only): its commands are issued one by one
    /// between CUDA events; prints the kinds of command that took the most device time and
    /// writes every command to FILE as CSV (run, index, what, node, size, ms).
    #[arg(long, value_name = "FILE", help_heading = "Device")]
    pub profile_kernels: Option<PathBuf>,
    /// Write a checkpoint here at the end (a Hugging Face folder plus optimizer state).
    #[arg(long, value_name = "DIR", help_heading = "Outputs")]
    pub save: Option<PathBuf>,
    /// Also write a checkpoint every N steps, as the folder DIR/step-NNNNNN/ (needs --save).
    #[arg(long, value_name = "N", help_heading = "Outputs")]
    pub save_every: Option<u64>,
    /// Keep only the newest K step folders (0 keeps all).
    #[arg(long, default_value_t = 0, value_name = "K", help_heading = "Outputs")]
    pub keep: usize,
    /// Continue from a checkpoint written by --save (its newest step folder, when that is
    /// further along): model, optimizer, scaler, data position, and the run's flags.
    #[arg(long, value_name = "DIR", help_heading = "Outputs")]
    pub resume: Option<PathBuf>,
    /// Append one JSON line per step here.
    #[arg(long, value_name = "FILE.jsonl", help_heading = "Outputs")]
    pub log: Option<PathBuf>,
    /// Draw the loss curve here (SVG), redrawn at every evaluation and printed line.
    #[arg(long, value_name = "FILE.svg", help_heading = "Outputs")]
    pub plot: Option<PathBuf>,
    /// Write the run's report here: one self-contained HTML page (loss and validation curves,
    /// learning rate and loss scale, memory anatomy, precision, fit verdict).
    #[arg(long, value_name = "FILE.html", help_heading = "Outputs")]
    pub report: Option<PathBuf>,
    /// Print a line every N steps (default: about 20 lines per run).
    #[arg(long, help_heading = "Outputs")]
    pub print_every: Option<u64>,
}

/// Checks every output path before any work.
fn check_outputs(args: &Args) -> anyhow::Result<()> {
    if let Some(dir) = &args.save {
        crate::outputs::check_folder("--save", dir)?;
    }
    if let Some(path) = &args.log {
        crate::outputs::check_file("--log", path)?;
    }
    if let Some(path) = &args.plot {
        // Where first (a folder given as the picture is an output error), then the kind.
        crate::outputs::check_file("--plot", path)?;
        plot::check_picture_path(path)?;
    }
    if let Some(path) = &args.report {
        crate::outputs::check_file("--report", path)?;
        html::check_report_path(path)?;
    }
    if let Some(path) = &args.profile_kernels {
        crate::outputs::check_file("--profile-kernels", path)?;
    }
    Ok(())
}

pub fn run(args: Args, given: &Given) -> anyhow::Result<()> {
    // Ctrl-C finishes the step, saves and stops (a second one stops at once).
    catch_interrupts();
    match train(args, given, Hooks::default())?.interrupted {
        true => Err(crate::Interrupted.into()),
        false => Ok(()),
    }
}

/// What a run did, for callers that go on from it.
#[derive(Clone, Debug)]
pub struct TrainOutcome {
    /// The step the run ended at (1-based; a resumed run counts its earlier steps).
    pub step: u64,
    /// Steps this run took.
    pub steps_done: u64,
    /// The last step's loss, when a step ran.
    pub final_loss: Option<f64>,
    /// The last validation loss and the step it was computed at.
    pub validation: Option<(u64, f64)>,
    /// Steps skipped for non-finite gradients.
    pub skipped: u64,
    pub seconds: f64,
    pub tokens_per_second: f64,
    /// Stopped early by Ctrl-C or by a hook.
    pub interrupted: bool,
    /// Where the final checkpoint went (`--save`).
    pub saved: Option<PathBuf>,
    /// Every step's training loss (1-based step, loss), this run's and the resumed ones'.
    pub losses: Vec<(u64, f64)>,
}

/// Runs a training step loop the way [`run`] does; `hooks` see every logged step and can stop
/// the run (which then saves as Ctrl-C does). Installs no signal handler.
pub fn train(mut args: Args, given: &Given, hooks: Hooks) -> anyhow::Result<TrainOutcome> {
    // A process a launcher started as one rank of several trains that rank of the plan (on
    // its GPU with NCCL, or on the CPU over TCP); only rank 0 writes files.
    let launch = crate::launcher::from_env(&|k| std::env::var(k).ok())?.filter(|l| l.is_group());
    check_outputs(&args)?;
    let device = crate::device::select(args.device)?;
    if let Some(l) = &launch {
        l.check_device(device)?;
        if l.rank != 0 {
            args.log = None;
            args.plot = None;
            args.report = None;
            args.profile_kernels = None;
        }
    }
    let executor = device;
    check_run_flags(&args, device)?;

    let (resume_dir, resume) = resumed(&mut args, given)?;
    if let (Some(l), None) = (&launch, &args.plan) {
        args.training.world_size = l.world_size(args.training.world_size)?;
    }
    let first_step = resume.as_ref().map_or(0, |(_, t)| t.step);
    let total = schedule(&mut args, first_step, resume.is_some())?;

    let model_path = resume_dir.as_deref().unwrap_or(&args.model);
    let mut model = args.classifier.load(model_path)?;
    model.set_attention(args.precision.attention.into());
    crate::report::warn_unused(&model);
    let config_json = std::fs::read_to_string(&model.config().file)
        .with_context(|| format!("cannot read `{}`", model.config().file.display()))?;
    let config_json = args.classifier.saved_config(&model, config_json)?;
    let mut files = CheckpointFiles::new(config_json, model.config().file.parent());
    // An adapter to continue, and what a LoRA checkpoint's config records of the base.
    let adapter = match &args.adapter {
        Some(dir) => Some(crate::adapter::load(dir)?),
        None => None,
    };
    let lora = lora_settings(&args, &model, adapter.as_ref())?;
    if args.plan.is_none() {
        args.training.check_base(lora.as_ref())?;
    }
    if let Some(dir) = &resume_dir {
        outln!("resume      {} (step {first_step})", dir.display());
    }

    let (planned, mut data) = plan_and_data(&args, given, &model, &lora, executor)?;
    // A plan that trains adapters saves them as a PEFT adapter folder.
    if planned.plan.settings.lora.is_some() {
        files.adapter = Some(crate::adapter::AdapterBase::of(&model, &args.model));
    }
    outln!("data        {}", data.describe());
    let anatomy = crate::memory::anatomy(executor, &planned.plan);
    outln!("{}", memory_line(&anatomy));
    if args.eval_every.is_some() && !data.has_validation() {
        return Err(CliError::InvalidInput("--eval-every: no held-out data".into()).into());
    }

    // Will it fit? Checked before the weights are even read.
    let (gpu, verdict) = fit_verdict(&args, device, &model, &planned, &anatomy, executor)?;

    let (params, non_finite) = initial_weights(&args, &model, &planned.plan, adapter.as_ref())?;
    if let Some(line) = nf4_error(&planned.plan, &params) {
        outln!("{line}");
    }
    let settings = planned.plan.settings.clone();
    // The group meets once this rank has its plan and weights: each rank stops with its own
    // errors first, and a rank that never arrives is named by rank 0.
    let launched = match &launch {
        Some(l) => Some(join_group(l, device)?),
        None => None,
    };
    let mut runner = Trainer::new(
        planned.plan.clone(),
        &|name| params.get(name).cloned(),
        device,
        launched,
    )?;
    drop(params);
    runner.set_timing(args.profile);
    if let Some(bytes) = runner.allocated_bytes() {
        outln!(
            "memory      {} ({bytes} bytes) allocated on the device for the plan",
            castor_ir::human_bytes(bytes)
        );
    }
    if let Some(attention) = runner.attention() {
        outln!("attention   {attention}");
    }
    if let Some(resume) = resume {
        restore(&mut runner, &mut data, resume, &args, resume_dir.as_deref())?;
    }

    let (log, history) = open_log(args.log.as_deref(), first_step)?;
    let steps = total - first_step;
    let print_every = args
        .print_every
        .unwrap_or_else(|| (steps / 20).max(1))
        .max(1);
    announce(&settings, first_step, total);
    if let (Some(root), true) = (&args.save, runner.writes_files()) {
        checkpoint::clean_stale(root);
    }
    let title = format!(
        "{} on {} ({})",
        model.architecture(),
        args.data
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        settings.precision
    );
    let report = args.report.as_ref().map(|path| {
        let mut r = Report::new(path.clone(), &title);
        r.fact(
            "model",
            &format!("{} ({})", args.model.display(), model.architecture()),
        );
        r.fact("data", &data.describe());
        r.fact("device", &runner.device());
        r.training_plan(&planned.plan, planned.summary.as_ref(), &anatomy, executor);
        r.verdict = verdict.clone();
        r.cost(&planned.plan, &gpu);
        r
    });
    let flags = RunFlags {
        precision: args.precision.clone(),
        training: args.training.clone(),
        run: args.run.clone(),
    }
    .to_json();
    let mut opts = LoopOptions {
        first_step,
        steps,
        lr: LrSchedule {
            peak: args.training.lr(),
            warmup: args.run.warmup,
            schedule: args.run.schedule,
            min_lr: args.run.min_lr,
            total: args.run.total_steps.unwrap_or(total),
        },
        print_every,
        eval_every: args.eval_every.unwrap_or(0),
        eval_batches: args.eval_batches,
        log,
        plot: args.plot.clone().map(|p| (p, title)),
        report,
        saves: match (&args.save, args.save_every) {
            (Some(root), Some(every)) => Some(Saves {
                root: root.clone(),
                every: every.max(1),
                keep: args.keep,
            }),
            _ => None,
        },
        files,
        state: StateTemplate {
            settings,
            flags,
            data_tokens: data.training_tokens(),
        },
        input_names: model.input_names(),
        label: "train".into(),
        profile_last_step: args.profile_kernels.is_some(),
        hooks,
    };
    let out = train_loop(&mut runner, &mut data, &mut opts, history)?;
    if let (Some(path), Some(profile)) = (&args.profile_kernels, runner.take_kernel_profile()) {
        // Each kind beside its program roofline on this GPU (the H100's where it is unknown).
        let device = runner.device();
        let gpu = castor_passes::gpus::of_device(&device).unwrap_or_default();
        let units = castor_runtime::cuda::roofline::unit_seconds(runner.plan(), &gpu).ok();
        write_kernel_profile(
            path,
            &profile,
            step_of_profile(first_step, out.steps_done),
            units.as_ref().map(|u| (u, gpu.name.as_str())),
        )?;
    }
    let step = first_step + out.steps_done;
    let mut outcome = Vec::new();
    if let Some(r) = &out.last {
        outcome.push(format!(
            "done        {} steps in {:.2} s ({:.0} tokens/s); final loss {:.4}; {} skipped; loss scale {}",
            out.steps_done,
            out.seconds,
            out.tokens / out.seconds.max(1e-9),
            r.loss,
            out.skipped,
            castor_runtime::LossScale(r.next_loss_scale)
        ));
    }
    if let Some((_, v)) = out.history.validation.last() {
        let accuracy = out
            .accuracy
            .map(|a| format!(", accuracy {:.1}%", a * 100.0))
            .unwrap_or_default();
        outcome.push(format!(
            "validation  loss {v:.4}{accuracy} at step {}",
            out.evaluated_at.unwrap_or(0)
        ));
    }
    for line in &outcome {
        outln!("{line}");
    }
    if let Some(dir) = &args.save {
        let state = opts.state.at(step, &data);
        // Every rank of a launched group gathers the state; rank 0 writes it.
        let writes = runner.writes_files();
        let host = runner.host()?;
        if writes {
            checkpoint::save(dir, &opts.files, host, &state)?;
            outln!("saved       {}", dir.display());
        }
    }
    if let Some(report) = &mut opts.report {
        report.outcome = outcome;
    }
    redraw(&opts, &out.history);
    if let Some(path) = &args.plot {
        outln!("plot        {}", path.display());
    }
    if let Some(path) = &args.report {
        outln!("report      {}", path.display());
    }
    if out.interrupted {
        match &args.save {
            Some(dir) => outln!(
                "interrupted after step {step}: checkpoint saved; continue with --resume {}",
                dir.display()
            ),
            None => outln!("interrupted after step {step}; nothing saved (no --save DIR)"),
        }
    }
    if let Some(why) = every_step_skipped(&out, &opts.state.settings, &non_finite) {
        return Err(castor_runtime::RuntimeError::EveryStepSkipped {
            steps: out.steps_done,
            why,
        }
        .into());
    }
    Ok(TrainOutcome {
        step,
        steps_done: out.steps_done,
        final_loss: out.last.as_ref().map(|r| f64::from(r.loss)),
        validation: out.history.validation.last().copied(),
        skipped: out.skipped,
        seconds: out.seconds,
        tokens_per_second: out.tokens / out.seconds.max(1e-9),
        interrupted: out.interrupted,
        saved: args.save.clone(),
        losses: out.history.train.clone(),
    })
}

/// The flags that need another flag or device, checked before any work.
/// The step to train until (`--steps`), checked against a resumed run's `first_step`; fixes
/// the schedule's length, which travels with the run's checkpoints.
fn schedule(args: &mut Args, first_step: u64, resuming: bool) -> anyhow::Result<u64> {
    if args.eval_every.is_some() && args.run.val_fraction <= 0.0 && args.validation.is_none() {
        return Err(CliError::InvalidInput(
            "--eval-every needs held-out data: give --val-fraction (or --validation FILE)".into(),
        )
        .into());
    }
    let total = args.run.steps.ok_or_else(|| {
        CliError::InvalidInput(
            "--steps N is required: the step to train until (as transformers' max_steps)".into(),
        )
    })?;
    if total <= first_step && resuming {
        return Err(CliError::InvalidInput(format!(
            "--steps {total}: the checkpoint is at step {first_step} already; --steps is the \
             total (the step to train until), so give more than {first_step}"
        ))
        .into());
    }
    args.run.total_steps = Some(args.run.total_steps.unwrap_or(total));
    Ok(total)
}

/// Joins the launched group: its connections, and on GPUs this rank's NCCL communicator.
fn join_group(
    l: &crate::launcher::Launch,
    device: ExecutorKind,
) -> anyhow::Result<crate::trainer::Launched> {
    let mut group = l.join()?;
    let nccl = match device {
        ExecutorKind::Cuda => Some(l.nccl_rank(&mut group)?),
        _ => None,
    };
    Ok(crate::trainer::Launched { group, nccl })
}

/// A resumed run's state entries and trainer state.
type Resumed = (Vec<(String, castor_ir::Tensor)>, checkpoint::TrainerState);

/// Continues a resumed run: the same settings and data as the checkpoint's, its state in the
/// runner, the data where it stopped.
fn restore(
    runner: &mut Trainer,
    data: &mut Data,
    (state, trainer): Resumed,
    args: &Args,
    dir: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    resume::check_settings(&trainer.settings, &runner.plan().settings, dir)?;
    if trainer.data_tokens != 0 && trainer.data_tokens != data.training_tokens() {
        return Err(CliError::InvalidInput(format!(
            "--resume: the checkpoint was trained on {} training tokens, but `{}` gives {}: \
             resume on the same data",
            trainer.data_tokens,
            args.data.display(),
            data.training_tokens()
        ))
        .into());
    }
    runner.restore(state)?;
    data.seek(trainer.data_position);
    Ok(())
}

/// The JSON log, opened to append, and the loss history a resumed run's log already holds.
fn open_log(
    path: Option<&std::path::Path>,
    first_step: u64,
) -> anyhow::Result<(Option<std::fs::File>, LossHistory)> {
    let Some(path) = path else {
        return Ok((None, LossHistory::default()));
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| CliError::Output(format!("--log `{}`: cannot open: {e}", path.display())))?;
    let history = if first_step > 0 {
        history_from_log(path, first_step)
    } else {
        LossHistory::default()
    };
    Ok((Some(log), history))
}

/// The `training` line: which steps run, of what.
fn announce(settings: &castor_ir::TrainSettings, first_step: u64, total: u64) {
    if total == first_step {
        outln!("training    none (--steps 0): the initial weights are what a --save keeps");
        return;
    }
    let (batch, seq) = (settings.batch, settings.seq);
    let ranks = match settings.parallel.world_size {
        0 | 1 => String::new(),
        n => format!(" on each of {n} ranks (ZeRO-{})", settings.parallel.zero),
    };
    outln!(
        "training    steps {}..{total} of {} x [{batch}, {seq}] tokens{ranks}, {}, objective {}",
        first_step + 1,
        settings.grad_accum,
        settings.precision,
        settings.objective
    );
}

fn check_run_flags(args: &Args, device: ExecutorKind) -> anyhow::Result<()> {
    if args.profile_kernels.is_some() && !matches!(device, ExecutorKind::Cuda) {
        let here = match device {
            ExecutorKind::Emulate => "the emulator",
            _ => "the CPU",
        };
        return Err(CliError::DeviceUnavailable(format!(
            "--profile-kernels times each command on the GPU's clock: it needs --device cuda \
             (this run is on {here}, which has none)"
        ))
        .into());
    }
    if args.save_every.is_some() && args.save.is_none() {
        return Err(CliError::InvalidInput(
            "--save-every needs --save DIR (step folders go into DIR)".into(),
        )
        .into());
    }
    Ok(())
}

/// The checkpoint `--resume` continues (its newest step folder) and its state; the run's
/// flags are taken from it unless given. Resuming reads the weights from the checkpoint,
/// which is itself a model folder.
#[allow(clippy::type_complexity)]
fn resumed(args: &mut Args, given: &Given) -> anyhow::Result<(Option<PathBuf>, Option<Resumed>)> {
    let resume_dir = args.resume.as_deref().map(checkpoint::resolve_resume);
    let resume = match &resume_dir {
        Some(dir) => {
            resume::check_same_model(&args.model, dir)?;
            let (state, trainer) = checkpoint::load_resume_state(dir)?;
            let flags = RunFlags {
                precision: args.precision.clone(),
                training: args.training.clone(),
                run: args.run.clone(),
            };
            let merged = flags.merged_with(&trainer.flags, given, dir)?;
            args.precision = merged.precision;
            args.training = merged.training;
            args.run = merged.run;
            Some((state, trainer))
        }
        None => None,
    };
    Ok((resume_dir, resume))
}

/// The adapters this run trains: an adapter folder to continue (`--adapter`, its settings
/// with `--base`), or those the `--lora-*` flags ask for; flags that disagree with the folder
/// are an error.
fn lora_settings(
    args: &Args,
    model: &Model,
    adapter: Option<&crate::adapter::Loaded>,
) -> anyhow::Result<Option<LoraSettings>> {
    Ok(match (adapter, args.training.lora(Some(model.family()))?) {
        (
            Some(crate::adapter::Loaded {
                lora: from_file, ..
            }),
            Some(given),
        ) if (LoraSettings {
            base: given.base,
            ..from_file.clone()
        }) != given =>
        {
            return Err(CliError::InvalidInput(format!(
                "--adapter has r={}, lora_alpha={}, target_modules {:?}; --lora-* flags ask \
                 for r={}, alpha={}, targets {:?}: leave them out to continue the adapter",
                from_file.rank,
                from_file.alpha,
                from_file.targets,
                given.rank,
                given.alpha,
                given.targets
            ))
            .into())
        }
        // An adapter file does not say how the base was stored: --base does.
        (Some(loaded), _) => Some(LoraSettings {
            base: args.training.base,
            ..loaded.lora.clone()
        }),
        (None, given) => given,
    })
}

/// The plan (read from `--plan`, checked against the flags, or compiled for the data's shape)
/// and the data, opened for the plan's shape.
fn plan_and_data(
    args: &Args,
    given: &Given,
    model: &Model,
    lora: &Option<LoraSettings>,
    executor: ExecutorKind,
) -> anyhow::Result<(CompiledPlan, Data)> {
    let data_options = DataOptions {
        batch: args.run.batch,
        seq: args.run.seq,
        val_fraction: args.run.val_fraction,
        order: args.run.data_order,
        seed: args.run.seed,
        validation: args.validation.clone(),
        plan: None,
    };
    Ok(match &args.plan {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                CliError::InvalidInput(format!("cannot read plan `{}`: {e}", path.display()))
            })?;
            let plan = TrainingPlan::from_json(&text)
                .map_err(|e| CliError::InvalidInput(format!("`{}`: {e}", path.display())))?;
            resume::check_plan_flags(&plan.settings, args, given, path)?;
            let asked = args.adapter.is_some()
                || args.training.lora_rank.is_some()
                || !args.training.base.is_compute();
            let plan_base = plan.settings.lora.as_ref().map(|l| l.base);
            let base_differs = plan_base.is_some_and(|b| b != args.training.base)
                || (plan_base.is_none() && !args.training.base.is_compute());
            if asked && (*lora != plan.settings.lora || base_differs) {
                let show = |l: &Option<castor_ir::LoraSettings>| match l {
                    Some(l) => format!(
                        "r={}, alpha={}, targets {}, base {:?}",
                        l.rank,
                        l.alpha,
                        l.targets.join(","),
                        l.base
                    ),
                    None => "none".into(),
                };
                return Err(CliError::InvalidInput(format!(
                    "--adapter/--lora-* disagree with the plan `{}`: its adapters are {}, the \
                     flags give {}; leave them out (the plan decides) or compile a new plan",
                    path.display(),
                    show(&plan.settings.lora),
                    show(lora)
                ))
                .into());
            }
            let objective = plan_objective(&plan)?;
            let options = DataOptions {
                batch: Some(plan.settings.batch),
                seq: Some(plan.settings.seq),
                plan: Some(path.clone()),
                ..data_options
            };
            let data = Data::open(&args.data, model, objective, &options)?;
            (CompiledPlan::from_file(plan), data)
        }
        None => {
            let objective = args.training.training_objective(model)?;
            let data = Data::open(&args.data, model, objective, &data_options)?;
            let (batch, seq) = data.shape();
            let mut settings =
                args.training
                    .settings(args.precision.precision, objective, batch, seq)?;
            settings.lora = lora.clone();
            (
                compile_plan(&args.precision, model, settings, true, executor)?,
                data,
            )
        }
    })
}

/// The fit verdict (the planned peak against the device's memory, and the changes that would
/// fit), printed; the cost model's GPU with it.
fn fit_verdict(
    args: &Args,
    device: ExecutorKind,
    model: &Model,
    planned: &CompiledPlan,
    anatomy: &castor_passes::memory::Anatomy,
    executor: ExecutorKind,
) -> anyhow::Result<(castor_passes::cost::GpuSpec, Option<fit::Verdict>)> {
    let gpu = fit::gpu_spec(args.gpu.as_deref())?;
    let target = match device {
        ExecutorKind::Cuda => MemoryTarget::this_gpu(),
        _ => match &args.gpu {
            Some(_) => MemoryTarget::of_spec(&gpu, "--gpu"),
            None => MemoryTarget::host(),
        },
    };
    let verdict = target.map(|target| {
        let this = &planned.plan;
        // Laid out again only when the target's executor is another (the CPU, judged
        // against a GPU's memory).
        let on_target = if target.executor == executor {
            anatomy.clone()
        } else {
            crate::memory::anatomy(target.executor, this)
        };
        if planned.summary.is_none() {
            // A plan from a file is not recompiled with other settings here.
            fit::verdict(this, &on_target, target, &gpu, None, &|_| {
                anyhow::bail!("plans from files are not recompiled")
            })
        } else {
            fit::verdict(
                this,
                &on_target,
                target,
                &gpu,
                Some(model.family()),
                &|settings| {
                    compile_plan(&args.precision, model, settings, false, executor).map(|c| c.plan)
                },
            )
        }
    });
    if let Some(v) = &verdict {
        for line in v.lines() {
            outln!("{line}");
        }
    }
    Ok((gpu, verdict))
}

/// The weights the run starts from (the checkpoint's, or initialized from the config; the
/// adapters from `--adapter` or initialized), and the NaN/Inf they hold, said as `eval` says
/// it.
fn initial_weights(
    args: &Args,
    model: &Model,
    plan: &TrainingPlan,
    adapter: Option<&crate::adapter::Loaded>,
) -> anyhow::Result<(std::collections::HashMap<String, castor_ir::Tensor>, String)> {
    let mut params = if model.checkpoint().is_some() {
        model.load_params()?
    } else {
        errln!("weights: initialized from the config (seed {INIT_SEED:#x})");
        model.init_params(INIT_SEED)
    };
    if plan.settings.lora.is_some() {
        let adapters: Vec<(String, castor_ir::TensorType)> = plan
            .state
            .iter()
            .filter(|s| s.role == castor_ir::StateRole::Master)
            // A rank's state table holds shards: the adapters start whole.
            .map(|s| {
                (
                    s.name.clone(),
                    s.shard_of.clone().unwrap_or_else(|| s.ty.clone()),
                )
            })
            .collect();
        params.extend(crate::adapter::initial(
            &adapters,
            adapter.map(|a| &a.tensors),
            args.adapter.as_deref(),
            args.run.seed ^ INIT_SEED,
        )?);
    }
    // As eval does: a checkpoint holding NaN or Inf trains nothing, every step is skipped.
    let found = model.check_finite(&params, false)?;
    let non_finite = match found.is_empty() {
        true => String::new(),
        false => castor_models::finite::describe_non_finite(&found),
    };
    if !non_finite.is_empty() {
        errln!("warning: NaN or Inf in {non_finite} (every step they reach will be skipped)");
    }
    Ok((params, non_finite))
}

/// Why a run whose every step was skipped trained nothing, unless dynamic loss scaling is
/// still backing off from too high a scale (what it is for: a finite loss whose scaled
/// gradients overflowed).
fn every_step_skipped(
    out: &crate::train_loop::LoopOutcome,
    settings: &castor_ir::TrainSettings,
    non_finite: &str,
) -> Option<String> {
    let last = out.last.as_ref()?;
    if out.skipped < out.steps_done {
        return None;
    }
    let dynamic = matches!(
        settings.loss_scaling,
        castor_ir::LossScaling::Dynamic { .. }
    );
    if !non_finite.is_empty() {
        return Some(format!("the checkpoint holds NaN or Inf in {non_finite}"));
    }
    if !last.loss.is_finite() {
        return Some(
            "the loss was NaN or Inf (check the data's labels and the learning rate)".into(),
        );
    }
    (!dynamic).then(|| {
        "the gradients were NaN or Inf at every step (lower the learning rate, or train in \
         bf16 or fp32)"
            .into()
    })
}

/// The step `--profile-kernels` profiled: the last one run.
fn step_of_profile(first_step: u64, steps_done: u64) -> u64 {
    first_step + steps_done
}

/// Prints the kinds of command that took the most device time in the profiled step and
/// writes every command to `path` as CSV.
fn write_kernel_profile(
    path: &std::path::Path,
    profile: &castor_runtime::cuda::profile::KernelProfile,
    step: u64,
    roofline: Option<(&std::collections::HashMap<String, f64>, &str)>,
) -> anyhow::Result<()> {
    std::fs::write(path, profile.to_csv(roofline.map(|(u, _)| u))).map_err(|e| {
        CliError::Output(format!(
            "--profile-kernels `{}`: cannot write: {e}",
            path.display()
        ))
    })?;
    outln!(
        "kernels     step {step}, {} commands issued one by one, {:.3} ms of device time:",
        profile.commands.len(),
        profile.total_ms()
    );
    if let Some((_, gpu)) = roofline {
        outln!("              (roofline: each command's kernel unit at the {gpu}'s peak, plus 1 µs a command)");
    }
    for line in profile.table_against(15, roofline.map(|(u, _)| u)).lines() {
        outln!("              {line}");
    }
    outln!("profile     {}", path.display());
    Ok(())
}

/// The plan's planned memory per step (from the plan alone, so a plan file reports it too).
fn memory_line(a: &castor_passes::memory::Anatomy) -> String {
    use castor_ir::human_bytes;
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

/// A training plan with what its report shows.
pub struct CompiledPlan {
    pub plan: TrainingPlan,
    /// What the precision passes decided (not known for a plan read from a file).
    pub summary: Option<castor_passes::PrecisionSummary>,
}

impl CompiledPlan {
    /// A plan read from a file.
    pub fn from_file(plan: TrainingPlan) -> CompiledPlan {
        CompiledPlan {
            plan,
            summary: None,
        }
    }
}

/// Compiles the training plan of `model` for `settings` (their batch and seq) under the
/// precision flags; `say` prints what the passes decided.
pub fn compile_plan(
    precision: &PrecisionArgs,
    model: &Model,
    settings: TrainSettings,
    say: bool,
    executor: ExecutorKind,
) -> anyhow::Result<CompiledPlan> {
    let objective: castor_models::Objective =
        settings.objective.parse().map_err(CliError::InvalidInput)?;
    let loss_graph = model.build_loss_graph(settings.batch, settings.seq, objective)?;
    castor_ir::verify(&loss_graph).context("the front end built an invalid graph")?;
    let (loss_graph, lora) = crate::training::with_adapters(loss_graph, settings.lora.as_ref())?;
    if let (true, Some(report)) = (say, &lora) {
        outln!("lora        {}", report.summary);
    }
    // The settings carry the plan's precision; the flags, the policy's rules.
    let precision = precision.for_plan(&settings);
    let compiled = precision.compile(loss_graph, Some(model), None, false)?;
    if say {
        if let Some((_, report)) = compiled.reports.iter().find(|(p, _)| *p == "autocast") {
            outln!("precision   {} ({})", precision.precision, report.summary);
        }
    }
    let summary = castor_passes::precision_summary(&compiled.graph, precision.precision.low());
    let (plan, report) = crate::memory::pipeline(executor).build(&compiled.graph, settings)?;
    if say {
        outln!("plan        {}", report.summary);
    }
    Ok(CompiledPlan {
        plan,
        summary: Some(summary),
    })
}

/// `--base nf4`: how far the quantized base is from the checkpoint's weights, over all of
/// them (`||W - W'|| / ||W||`, `W'` the dequantized weights the products read) and for the
/// worst one.
fn nf4_error(
    plan: &TrainingPlan,
    params: &std::collections::HashMap<String, castor_ir::Tensor>,
) -> Option<String> {
    use rayon::prelude::*;
    let mut names: Vec<&str> = plan
        .state
        .iter()
        .filter_map(|s| match &s.init {
            castor_ir::StateInit::Nf4 { tensor, .. } => Some(tensor.as_str()),
            _ => None,
        })
        .collect();
    names.dedup();
    if names.is_empty() {
        return None;
    }
    let errors: Vec<(&str, f64, f64)> = names
        .par_iter()
        .filter_map(|&n| {
            let values = params.get(n)?.as_f32()?;
            let (e, w) = castor_ir::nf4::squared_error(values, castor_ir::nf4::NF4_BLOCK);
            Some((n, e, w))
        })
        .collect();
    let (e, w) = errors
        .iter()
        .fold((0.0, 0.0), |(a, b), &(_, e, w)| (a + e, b + w));
    let worst = errors
        .iter()
        .map(|&(n, e, w)| (n, (e / w.max(f64::MIN_POSITIVE)).sqrt()))
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    Some(format!(
        "nf4         {} base weights quantized: relative error {:.4} over all of them \
         (||W - W'|| / ||W||), worst {:.4} (`{}`)",
        errors.len(),
        (e / w.max(f64::MIN_POSITIVE)).sqrt(),
        worst.1,
        worst.0
    ))
}
