//! One training run as named phases: [`start`] (where this process runs and what it
//! continues), [`load_model`], [`plan`] (the plan, the data and the fit verdict),
//! [`executor`] (the weights on the chosen executor), [`loop_options`], the step loop, and
//! [`finish`] (outcome, checkpoint, pictures). Step numbers are 1-based everywhere (console,
//! log, picture, report, `trainer_state.json`), and `--steps` is the step a run trains until,
//! as transformers' `max_steps`: a resumed run continues to it.

use super::args::{check_outputs, check_run_flags, schedule, Args};
use super::checkpoint::{self, CheckpointFiles};
use super::data::Data;
use super::fit;
use super::launcher::Launch;
use super::plan::{fit_verdict, lora_settings, memory_line, plan_and_data, CompiledPlan};
use super::resume::{self, RunFlags};
use super::step_loop::{
    history_from_log, redraw, train_loop, Hooks, LoopOptions, LoopOutcome, LrSchedule, Saves,
    StateTemplate,
};
use super::trainer::Trainer;
use super::weights::{initial_weights, nf4_error};
use crate::given::Given;
use crate::html::Report;
use crate::plot::LossHistory;
use crate::CliError;
use anyhow::Context;
use castor_ir::LoraSettings;
use castor_models::Model;
use castor_runtime::ExecutorKind;
use std::path::PathBuf;

/// Runs a training step loop, phase by phase; `hooks` see every logged step and can stop the
/// run (which then saves as Ctrl-C does). Installs no signal handler.
pub fn train(mut args: Args, given: &Given, hooks: Hooks) -> anyhow::Result<TrainOutcome> {
    let mut start = start(&mut args, given)?;
    let mut loaded = load_model(&args, &start)?;
    let mut planned = plan(&args, given, &start, &mut loaded)?;
    let (mut runner, non_finite) = executor(&args, &mut start, &loaded, &mut planned)?;
    let (mut opts, history) = loop_options(&args, &start, loaded, &planned, &runner, hooks)?;
    let out = train_loop(&mut runner, &mut planned.data, &mut opts, history)?;
    finish(
        &args,
        &start,
        &mut runner,
        &planned.data,
        &mut opts,
        out,
        &non_finite,
    )
}

/// Where and as what this process trains, and the run it continues.
struct Start {
    /// The group a launcher started this process in (only rank 0 writes files).
    launch: Option<Launch>,
    device: ExecutorKind,
    /// The checkpoint `--resume` continues (its newest step folder), and its state until
    /// the executor takes it.
    resume_dir: Option<PathBuf>,
    resume: Option<Resumed>,
    /// The step the run starts after (0 for a new run) and the step it trains until.
    first_step: u64,
    total: u64,
}

/// Phase 1: the launched group, the device, the flags checked, the resumed run's flags
/// merged into `args`, the steps.
fn start(args: &mut Args, given: &Given) -> anyhow::Result<Start> {
    // A process a launcher started as one rank of several trains that rank of the plan (on
    // its GPU with NCCL, or on the CPU over TCP); only rank 0 writes files.
    let launch = super::launcher::from_env(&|k| std::env::var(k).ok())?.filter(|l| l.is_group());
    check_outputs(args)?;
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
    check_run_flags(args, device)?;
    let (resume_dir, resume) = resumed(args, given)?;
    if let (Some(l), None) = (&launch, &args.plan) {
        args.training.world_size = l.world_size(args.training.world_size)?;
    }
    let first_step = resume.as_ref().map_or(0, |(_, t)| t.step);
    let total = schedule(args, first_step, resume.is_some())?;
    Ok(Start {
        launch,
        device,
        resume_dir,
        resume,
        first_step,
        total,
    })
}

/// The model a run trains and what its checkpoints hold besides the weights.
struct Loaded {
    model: Model,
    files: CheckpointFiles,
    /// The PEFT adapter `--adapter` continues.
    adapter: Option<crate::adapter::Loaded>,
    /// The adapters the run trains (from `--adapter` or the `--lora-*` flags).
    lora: Option<LoraSettings>,
}

/// Phase 2: the model (a resumed run's from its checkpoint), its config as checkpoints save
/// it, and the adapters.
fn load_model(args: &Args, start: &Start) -> anyhow::Result<Loaded> {
    let model_path = start.resume_dir.as_deref().unwrap_or(&args.model);
    let mut model = args.classifier.load(model_path)?;
    model.set_attention(args.precision.attention.into());
    crate::report::warn_unused(&model);
    let config_json = std::fs::read_to_string(&model.config().file)
        .with_context(|| format!("cannot read `{}`", model.config().file.display()))?;
    let config_json = args.classifier.saved_config(&model, config_json)?;
    let files = CheckpointFiles::new(config_json, model.config().file.parent());
    let adapter = match &args.adapter {
        Some(dir) => Some(crate::adapter::load(dir)?),
        None => None,
    };
    let lora = lora_settings(args, &model, adapter.as_ref())?;
    if args.plan.is_none() {
        args.training.check_base(lora.as_ref())?;
    }
    if let Some(dir) = &start.resume_dir {
        outln!("resume      {} (step {})", dir.display(), start.first_step);
    }
    Ok(Loaded {
        model,
        files,
        adapter,
        lora,
    })
}

/// A run's plan with the data for its shape and what it costs.
struct Planned {
    compiled: CompiledPlan,
    data: Data,
    anatomy: castor_passes::memory::Anatomy,
    /// The GPU the cost model and the report judge the plan on.
    gpu: castor_passes::cost::GpuSpec,
    verdict: Option<fit::Verdict>,
}

/// Phase 3: the plan and the data, the planned memory, and whether it fits (before the
/// weights are even read).
fn plan(args: &Args, given: &Given, start: &Start, loaded: &mut Loaded) -> anyhow::Result<Planned> {
    let executor = start.device;
    let (compiled, data) = plan_and_data(args, given, &mut loaded.model, &loaded.lora, executor)?;
    // A plan that trains adapters saves them as a PEFT adapter folder.
    if compiled.plan.settings.lora.is_some() {
        loaded.files.adapter = Some(crate::adapter::AdapterBase::of(&loaded.model, &args.model));
    }
    if given.has("loss_on") && !matches!(data, Data::Sft(_)) {
        return Err(CliError::InvalidInput(format!(
            "--loss-on chooses the tokens of SFT examples (a .jsonl of `messages` or \
             `prompt`/`completion` lines); `{}` is not such data",
            args.data.display()
        ))
        .into());
    }
    outln!("data        {}", data.describe());
    let anatomy = crate::memory::anatomy(executor, &compiled.plan);
    outln!("{}", memory_line(&anatomy));
    if args.eval_every.is_some() && !data.has_validation() {
        return Err(CliError::InvalidInput("--eval-every: no held-out data".into()).into());
    }
    let (gpu, verdict) = fit_verdict(args, &loaded.model, &compiled, &anatomy, executor)?;
    Ok(Planned {
        compiled,
        data,
        anatomy,
        gpu,
        verdict,
    })
}

/// Phase 4: the weights on the executor `--device` chose (after this rank joined its group),
/// the resumed state restored into it and the data moved to where the run stopped; with the
/// NaN/Inf the weights hold, said as `eval` says it.
fn executor(
    args: &Args,
    start: &mut Start,
    loaded: &Loaded,
    planned: &mut Planned,
) -> anyhow::Result<(Trainer, String)> {
    let plan = &planned.compiled.plan;
    let (params, non_finite) = initial_weights(args, &loaded.model, plan, loaded.adapter.as_ref())?;
    if let Some(line) = nf4_error(plan, &params) {
        outln!("{line}");
    }
    // The group meets once this rank has its plan and weights: each rank stops with its own
    // errors first, and a rank that never arrives is named by rank 0.
    let launched = match &start.launch {
        Some(l) => Some(join_group(l, start.device)?),
        None => None,
    };
    let mut runner = Trainer::new(
        plan.clone(),
        &|name| params.get(name).cloned(),
        start.device,
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
    if let Some(resume) = start.resume.take() {
        restore(
            &mut runner,
            &mut planned.data,
            resume,
            args,
            start.resume_dir.as_deref(),
        )?;
    }
    Ok((runner, non_finite))
}

/// Phase 5: what the loop does besides stepping (schedule, log, evaluations, saves, report),
/// and the loss history a resumed run's log already holds.
fn loop_options(
    args: &Args,
    start: &Start,
    loaded: Loaded,
    planned: &Planned,
    runner: &Trainer,
    hooks: Hooks,
) -> anyhow::Result<(LoopOptions, LossHistory)> {
    let (first_step, total) = (start.first_step, start.total);
    let plan = &planned.compiled.plan;
    let settings = plan.settings.clone();
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
    let model = &loaded.model;
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
        r.fact("data", &planned.data.describe());
        r.fact("device", &runner.device());
        let summary = planned.compiled.summary.as_ref();
        r.training_plan(plan, summary, &planned.anatomy, start.device);
        r.verdict = planned.verdict.clone();
        r.cost(plan, &planned.gpu);
        r
    });
    let samples = match &args.sample_prompts {
        Some(path) => {
            if plan
                .settings
                .lora
                .as_ref()
                .is_some_and(|l| !l.base.is_compute())
            {
                return Err(CliError::InvalidInput(
                    "--sample-prompts decodes with the weights in their checkpoint form; a \
                     quantized base (--base nf4) has none yet"
                        .into(),
                )
                .into());
            }
            let model_path = start.resume_dir.as_deref().unwrap_or(&args.model);
            Some(super::samples::Samples::open(
                path,
                model_path,
                args.precision.clone(),
                plan.settings.lora.clone(),
                args.sample_tokens,
            )?)
        }
        None => None,
    };
    let flags = RunFlags {
        precision: args.precision.clone(),
        training: args.training.clone(),
        run: args.run.clone(),
    }
    .to_json();
    let opts = LoopOptions {
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
        files: loaded.files,
        state: StateTemplate {
            settings,
            flags,
            data_tokens: planned.data.training_tokens(),
        },
        input_names: model.input_names(),
        dropout_seed: args.run.seed,
        label: "train".into(),
        profile_last_step: args.profile_kernels.is_some(),
        samples,
        hooks,
    };
    Ok((opts, history))
}

/// Phase 6: the kernel profile, the outcome lines, the final checkpoint, the last picture
/// and report, and a run that trained nothing named as the error it is.
fn finish(
    args: &Args,
    start: &Start,
    runner: &mut Trainer,
    data: &Data,
    opts: &mut LoopOptions,
    out: LoopOutcome,
    non_finite: &str,
) -> anyhow::Result<TrainOutcome> {
    let first_step = start.first_step;
    if let (Some(path), Some(profile)) = (&args.profile_kernels, runner.take_kernel_profile()) {
        // Each kind beside its program roofline on this GPU (the H100's where it is unknown).
        let device = runner.device();
        let gpu = castor_passes::gpus::of_device(&device).unwrap_or_default();
        let units = castor_runtime::cuda::roofline::unit_times(runner.plan(), &gpu).ok();
        write_kernel_profile(
            path,
            &profile,
            step_of_profile(first_step, out.steps_done),
            units.as_ref().map(|u| (u, gpu.name.as_str())),
        )?;
    }
    let step = first_step + out.steps_done;
    let mut outcome = outcome_lines(&out, &opts.state.settings.objective);
    let delayed = delayed_casts(runner)?;
    outcome.extend(crate::report::delayed_scaling_line(&delayed));
    for line in &outcome {
        outln!("{line}");
    }
    if let Some(dir) = &args.save {
        let state = opts.state.at(step, data);
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
        report.delayed_casts = delayed;
    }
    redraw(opts, &out.history);
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
    if let Some(why) = every_step_skipped(&out, &opts.state.settings, non_finite) {
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

/// The delayed-scaling casts with their state at the end of the run (none unless the plan
/// is `fp8:delayed`).
fn delayed_casts(runner: &mut Trainer) -> anyhow::Result<Vec<crate::report::DelayedCast>> {
    if !runner.plan().settings.precision.is_delayed() {
        return Ok(Vec::new());
    }
    let host = runner.host()?;
    let entries = host.state_entries();
    Ok(crate::report::delayed_casts(host.plan(), |name| {
        entries
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, t)| t.as_f32())
            .map(<[f32]>::to_vec)
    }))
}

/// The `done` and `validation` lines of a finished run (printed, and the report's outcome).
fn outcome_lines(out: &LoopOutcome, objective: &str) -> Vec<String> {
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
            .or_else(|| {
                super::step_loop::perplexity(objective, *v).map(|p| format!(", perplexity {p:.2}"))
            })
            .unwrap_or_default();
        outcome.push(format!(
            "validation  loss {v:.4}{accuracy} at step {}",
            out.evaluated_at.unwrap_or(0)
        ));
    }
    outcome
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

/// Joins the launched group: its connections, and on GPUs this rank's NCCL communicator.
fn join_group(
    l: &crate::training::launcher::Launch,
    device: ExecutorKind,
) -> anyhow::Result<crate::training::trainer::Launched> {
    let mut group = l.join()?;
    let nccl = match device {
        ExecutorKind::Cuda => Some(l.nccl_rank(&mut group)?),
        _ => None,
    };
    Ok(crate::training::trainer::Launched { group, nccl })
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

/// Why a run whose every step was skipped trained nothing, unless dynamic loss scaling is
/// still backing off from too high a scale (what it is for: a finite loss whose scaled
/// gradients overflowed).
fn every_step_skipped(
    out: &crate::training::step_loop::LoopOutcome,
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
    roofline: Option<(&castor_runtime::cuda::roofline::UnitTimes, &str)>,
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
