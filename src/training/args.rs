//! The flags of `castor train` (and of the Python package's `train`), and the checks that
//! need nothing but the flags: outputs writable, flags that need another flag or a device,
//! the step to train until.

use super::data::sft::LossOn;
use super::data::DataOrder;
use super::step_loop::Schedule;
use super::TrainingArgs;
use crate::commands::eval::Device;
use crate::html;
use crate::plot;
use crate::precision::PrecisionArgs;
use crate::CliError;
use castor_runtime::ExecutorKind;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
    /// SFT data (conversations, prompt-completion pairs): take the loss on the `completion`
    /// (what the assistant says; TRL's completion_only_loss / assistant_only_loss) or on
    /// `all` tokens.
    #[arg(long, value_enum, default_value_t = LossOn::Completion, help_heading = "Data")]
    #[serde(default)]
    pub loss_on: LossOn,
}

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder, or a bare config.json (weights initialized with a fixed seed).
    pub model: PathBuf,
    /// Training data: a safetensors batch (`input_ids` [B, T], optional `labels`; the same
    /// batch every step), a token file (.bin: llm.c's format, or nanoGPT's raw u16 tokens),
    /// text tokenized with the model's tokenizer: a text file (one document), a folder of
    /// text files (one document each) or a .jsonl file (one `text` per line), or SFT examples:
    /// a .jsonl file of `messages` conversations or `prompt`/`completion` pairs (see
    /// --loss-on).
    #[arg(long, help_heading = "Data")]
    pub data: PathBuf,
    /// Labelled validation examples (.jsonl or .csv, as --data for a classifier): the loss and
    /// accuracy are reported on them at --eval-every and at the end (instead of
    /// --val-fraction).
    #[arg(
        long,
        value_name = "FILE",
        visible_alias = "val-data",
        help_heading = "Data"
    )]
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
    /// Prompts to answer at each evaluation (and at the end), one per line: through the
    /// model's chat template when it has one (as `generate --chat`), else continued as text;
    /// greedy, printed, logged (`samples`) and shown in the report.
    #[arg(long, value_name = "FILE", help_heading = "Data")]
    pub sample_prompts: Option<PathBuf>,
    /// Tokens per sample answer at most.
    #[arg(
        long,
        default_value_t = 48,
        value_name = "N",
        requires = "sample_prompts",
        help_heading = "Data"
    )]
    pub sample_tokens: usize,
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
pub(super) fn check_outputs(args: &Args) -> anyhow::Result<()> {
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

/// The flags that need another flag or device, checked before any work.
pub(super) fn check_run_flags(args: &Args, device: ExecutorKind) -> anyhow::Result<()> {
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

/// The step to train until (`--steps`), checked against a resumed run's `first_step`; fixes
/// the schedule's length, which travels with the run's checkpoints.
pub(super) fn schedule(args: &mut Args, first_step: u64, resuming: bool) -> anyhow::Result<u64> {
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
