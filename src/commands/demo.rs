//! `castor demo`: castor's main job on an embedded model, with no files and no GPU.
//!
//! Builds the embedded tiny GPT-2, prints what the compiler decides for a BF16 and an FP16
//! training step (precision table, casts, loss scaling, recomputation, persistent memory),
//! trains it on the embedded corpus, samples text before and after (KV-cache decoding, as
//! `castor generate` does), and writes the report page, the loss curve, the memory anatomy
//! and a checkpoint into an output folder.

use crate::anatomy::{anatomy, AnatomyRow};
use crate::generate::{Generator, Sampling};
use crate::html::Report;
use crate::plot::{self, AnatomyBar, LossHistory};
use crate::precision::PrecisionArgs;
use crate::report::{model_summary, printable_byte, thousands};
use crate::rng::Rng;
use crate::training::checkpoint::{self, CheckpointFiles};
use crate::training::data::Data;
use crate::training::step_loop::{self, LoopOptions, LrSchedule, Schedule, StateTemplate};
use crate::training::trainer::Trainer;
use crate::training::TrainingArgs;
use anyhow::Context;
use castor_ir::{Graph, Tensor, TrainingPlan};
use castor_models::{Config, Model, Objective};
use castor_passes::{precision_summary, Precision};
use castor_runtime::ExecutorKind;
use castor_runtime::PlanRunner;
use clap::Parser;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The embedded model: a tiny byte-level GPT-2 (256-token vocabulary, so any text is input).
pub const TINY_GPT2_CONFIG: &str = include_str!("../../assets/tiny-gpt2.json");

/// The embedded training text: the project's own documentation.
pub const CORPUS: &str = include_str!("../../assets/corpus.txt");

/// Seed of the deterministic initialization.
pub const DEMO_SEED: u64 = 0x00ca_5709;

/// Seed of the sampler.
const SAMPLE_SEED: u64 = 0x5eed;

/// What the samples start with.
const PROMPT: &str = "The compiler ";

#[derive(clap::Args)]
pub struct Args {
    /// Where to write the pictures, the log and the checkpoint.
    #[arg(long, value_name = "DIR", default_value = "castor-demo")]
    pub out: PathBuf,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// The precision the demo trains in (all are compiled and reported).
    #[arg(long, default_value = "bf16", value_parser = crate::precision::parse_precision)]
    pub precision: Precision,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens (bytes) per sequence.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Where to train: `auto` (CUDA when a device is present, else the CPU), `cpu`, `cuda`,
    /// or `emulate` (the CUDA program on the host emulator: slow, no GPU needed).
    #[arg(long, value_enum, default_value_t = crate::commands::eval::Device::Auto)]
    pub device: crate::commands::eval::Device,
}

/// The embedded tiny GPT-2 and its deterministic initial weights.
pub fn tiny_gpt2() -> anyhow::Result<(Model, HashMap<String, Tensor>)> {
    let config = Config::parse(TINY_GPT2_CONFIG, Path::new("<embedded tiny-gpt2>"))?;
    let model = Model::from_config(config)?;
    let params = model.init_params(DEMO_SEED);
    Ok((model, params))
}

/// The training flags `castor train` would use on the corpus, with the demo's learning rate.
#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    training: TrainingArgs,
    #[command(flatten)]
    precision: PrecisionArgs,
}

fn flags(precision: Precision) -> anyhow::Result<Flags> {
    let p = precision.to_string();
    Ok(Flags::try_parse_from([
        "demo",
        "--precision",
        &p,
        "--lr",
        "2e-3",
        "--unpadded",
    ])?)
}

/// A compiled training step: the precision-compiled loss graph and its plan.
struct Compiled {
    precision: Precision,
    loss_graph: Graph,
    plan: TrainingPlan,
    summary: String,
}

fn compile(
    model: &Model,
    precision: Precision,
    batch: usize,
    seq: usize,
    executor: ExecutorKind,
) -> anyhow::Result<Compiled> {
    let f = flags(precision)?;
    let loss_graph = model.build_loss_graph(batch, seq, Objective::Lm)?;
    castor_ir::verify(&loss_graph).context("the front end built an invalid graph")?;
    let settings = f.training.settings(precision, Objective::Lm, batch, seq)?;
    // The settings carry the plan's precision; the flags, the policy's rules.
    let compiled = f
        .precision
        .for_plan(&settings)
        .compile(loss_graph, Some(model), None, false)?;
    let (plan, report) = crate::memory::pipeline(executor).build(&compiled.graph, settings)?;
    Ok(Compiled {
        precision,
        loss_graph: compiled.graph,
        plan,
        summary: report.summary,
    })
}

/// The compile report of one precision: table, casts, loss scaling, remat, memory.
fn print_report(c: &Compiled, params: u64, executor: ExecutorKind) {
    let summary = precision_summary(&c.loss_graph, c.precision.low());
    outln!();
    outln!(
        "compile     {} training step: {}",
        c.precision,
        summary.headline()
    );
    for line in summary.table_lines() {
        outln!("              {line}");
    }
    outln!("plan        {}", c.summary);
    let scaling = match &c.plan.settings.loss_scaling {
        castor_ir::LossScaling::None => "none (bf16 has f32's range)".to_string(),
        castor_ir::LossScaling::Static { scale } => format!("static {scale}"),
        castor_ir::LossScaling::Dynamic {
            init_scale,
            growth_interval,
            ..
        } => format!(
            "dynamic: start {init_scale}, x2 after {growth_interval} clean steps, x0.5 and skip on overflow"
        ),
    };
    outln!("loss scale  {scaling}");
    outln!("remat       none (every activation is kept for the backward pass)");
    outln!("memory      planned peak of one step: persistent state by role, then the arena (bytes/param vs. the usual 18 of mixed-precision AdamW for the state)");
    let mut total = 0;
    for row in anatomy(&c.plan, executor) {
        total += row.bytes;
        outln!("              {}", memory_row(&row, params));
    }
    outln!(
        "              {:<28} {:>12} bytes",
        "total",
        thousands(total)
    );
}

fn memory_row(row: &AnatomyRow, params: u64) -> String {
    let per = if row.estimate {
        "(upper bound)".to_string()
    } else {
        format!(
            "{:>6.2} bytes/param",
            row.bytes as f64 / params.max(1) as f64
        )
    };
    format!("{:<28} {:>12} bytes  {per}", row.what, thousands(row.bytes))
}

/// What the samples are: top-k sampling at temperature 0.7 with a fixed seed, so the same
/// weights give the same line.
const SAMPLING: Sampling = Sampling {
    temperature: 0.7,
    top_k: 20,
    top_p: 1.0,
};

/// Continues `prompt` for up to `max_new` bytes with the runner's weights, stopping at a
/// newline: KV-cache decoding, as `castor generate` runs it.
fn sample(
    model: &Model,
    precision: Precision,
    runner: &PlanRunner,
    prompt: &str,
    max_new: usize,
) -> anyhow::Result<String> {
    let f = flags(precision)?;
    let mut generator = Generator::new(model, f.precision);
    let tokens: Vec<i64> = prompt.bytes().map(i64::from).collect();
    let new = generator.generate(
        &tokens,
        max_new,
        &SAMPLING,
        &mut Rng::new(SAMPLE_SEED),
        &|name| runner.state(name),
        &|t| t == u32::from(b'\n'),
        &mut |_| {},
    )?;
    Ok(tokens
        .iter()
        .map(|&t| t as u32)
        .chain(new)
        .map(printable_byte)
        .collect())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let start = Instant::now();
    crate::outputs::check_folder("--out", &args.out)?;
    // Said once, on stdout, with the run's other facts.
    let (device, said) = crate::device::resolve(args.device)?;
    let executor = device;
    outln!(
        "device      {}",
        match device {
            ExecutorKind::Cuda => said.unwrap_or_else(|| "cuda".into()),
            ExecutorKind::Emulate => {
                "emulate (the CUDA program on the host emulator)".to_string()
            }
            ExecutorKind::Cpu => format!("cpu ({})", crate::device::why_cpu()),
        }
    );
    let (mut model, params) = tiny_gpt2()?;
    let (batch, seq) = (args.batch, args.seq.min(model.max_positions()));
    let graph = model.build_graph(batch, seq)?;
    // The corpus is cut into windows, which keep every key: the plan `castor train` compiles
    // for a token stream.
    model.set_unpadded(true)?;
    crate::out!(
        "{}",
        model_summary(
            "embedded tiny-gpt2 (deterministic init)",
            &model,
            &graph,
            batch,
            seq
        )
    );

    // What the compiler decides, in each precision.
    let mut compiled = Vec::new();
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        compiled.push(compile(&model, precision, batch, seq, executor)?);
    }
    let n_params = model.parameter_count();
    for c in compiled.iter().filter(|c| c.precision.low().is_some()) {
        print_report(c, n_params, executor);
    }
    let out = &args.out;
    std::fs::create_dir_all(out)
        .with_context(|| format!("cannot create the output folder `{}`", out.display()))?;
    let memory_svg = out.join("memory.svg");
    let bars: Vec<AnatomyBar> = compiled
        .iter()
        .map(|c| AnatomyBar {
            label: c.precision.to_string(),
            // Every row, zeros too, so each row keeps its colour; the 16 bytes of step and
            // loss-scale state would not show.
            segments: anatomy(&c.plan, executor)
                .into_iter()
                .filter(|r| r.what != castor_ir::StateRole::Control.describe())
                .map(|r| (r.what, r.bytes))
                .collect(),
        })
        .collect();
    plot::write_anatomy(
        &memory_svg,
        &format!(
            "Memory of one training step: tiny GPT-2, {} parameters, batch {batch} x {seq}",
            thousands(n_params)
        ),
        &bars,
        "Persistent state from the training plan; activations and temporaries: the memory \
         planner's arena (no recomputation). AdamW on F32 master weights.",
    )?;

    // Train.
    let trained = compiled
        .into_iter()
        .find(|c| c.precision == args.precision)
        .context("the demo compiles every precision it trains")?;
    let plan = trained.plan.clone();
    let settings = plan.settings.clone();
    let mut runner = Trainer::new(plan, &|name| params.get(name).cloned(), device, None)?;
    drop(params);
    outln!();
    outln!(
        "sample      before training: \"{}\"",
        sample(&model, args.precision, runner.host()?, PROMPT, 60)?
    );
    let tokens: Vec<i64> = CORPUS.bytes().map(i64::from).collect();
    // Windows in order, as PyTorch's reference curve of this model reads them
    // (tests/fixtures/convergence).
    let mut data = Data::from_tokens(tokens, batch, seq, 0.1, "the embedded corpus".into())?;
    let on = match device {
        ExecutorKind::Cpu => "the CPU executor".to_string(),
        _ => runner.device(),
    };
    outln!(
        "training    {} steps of [{batch}, {seq}] bytes of {}, {} on {on}",
        args.steps,
        data.describe(),
        args.precision,
    );
    let log_path = out.join("train.jsonl");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("cannot create `{}`", log_path.display()))?;
    let loss_svg = out.join("loss.svg");
    let report_path = out.join("report.html");
    let title = format!(
        "Training the embedded tiny GPT-2 on the project's docs ({}, {})",
        args.precision,
        match device {
            ExecutorKind::Cuda => "CUDA",
            ExecutorKind::Emulate => "CUDA program on the emulator",
            ExecutorKind::Cpu => "CPU",
        }
    );
    let mut report = Report::new(report_path.clone(), &title);
    report.fact(
        "model",
        "embedded tiny GPT-2 (GPT2LMHeadModel, deterministic init)",
    );
    report.fact("data", &data.describe());
    report.fact("device", &on);
    let anatomy = crate::memory::anatomy(executor, &trained.plan);
    report.training_plan(
        &trained.plan,
        Some(&precision_summary(
            &trained.loss_graph,
            args.precision.low(),
        )),
        &anatomy,
        executor,
    );
    let gpu = castor_passes::cost::GpuSpec::default();
    report.verdict = crate::training::fit::MemoryTarget::host().map(|target| {
        let on_host = crate::memory::anatomy(ExecutorKind::Cpu, &trained.plan);
        crate::training::fit::verdict(&trained.plan, &on_host, target, &gpu, None, &|_| {
            anyhow::bail!("the demo fits")
        })
    });
    report.cost(&trained.plan, &gpu);
    step_loop::catch_interrupts();
    let mut opts = LoopOptions {
        first_step: 0,
        steps: args.steps,
        lr: LrSchedule {
            peak: 2e-3,
            warmup: (args.steps / 10).min(20),
            schedule: Schedule::Cosine,
            min_lr: 1e-4,
            total: args.steps,
        },
        print_every: (args.steps / 5).max(1),
        eval_every: (args.steps / 5).max(1),
        eval_batches: 4,
        log: Some(log),
        plot: Some((loss_svg.clone(), title)),
        report: Some(report),
        saves: None,
        files: CheckpointFiles::new(TINY_GPT2_CONFIG.to_string(), None),
        state: StateTemplate {
            settings,
            flags: serde_json::Value::Null,
            data_tokens: data.training_tokens(),
        },
        input_names: model.input_names(),
        dropout_seed: 0,
        label: "demo".into(),
        profile_last_step: false,
        samples: None,
        hooks: Default::default(),
    };
    let run = step_loop::train_loop(&mut runner, &mut data, &mut opts, LossHistory::default())?;
    let first = run.history.train.first().map_or(f64::NAN, |p| p.1);
    let last = run
        .history
        .train
        .iter()
        .rev()
        .take(10)
        .map(|p| p.1)
        .sum::<f64>()
        / run.history.train.len().clamp(1, 10) as f64;
    let mut outcome = vec![format!(
        "trained     {} steps in {:.1} s ({:.0} tokens/s): loss {first:.3} -> {last:.3} (mean of the last 10 steps)",
        run.steps_done,
        run.seconds,
        run.tokens / run.seconds.max(1e-9)
    )];
    if let Some((step, v)) = run.history.validation.last() {
        outcome.push(format!(
            "validation  loss {v:.3} on held-out text at step {step}"
        ));
    }
    outcome.push(format!(
        "sample      after training:  \"{}\"",
        sample(&model, args.precision, runner.host()?, PROMPT, 60)?
    ));
    for line in &outcome {
        outln!("{line}");
    }
    if let Some(report) = &mut opts.report {
        report.outcome = outcome;
        report.write(Some(&run.history))?;
    }

    let ckpt = out.join("checkpoint");
    let state = opts.state.at(run.steps_done, &data);
    checkpoint::save_folder_atomically(&ckpt, &opts.files, runner.host()?, &state)?;
    outln!();
    outln!(
        "wrote       {}  (the run's report page)",
        report_path.display()
    );
    outln!("            {}  (loss curve)", loss_svg.display());
    outln!("            {}  (memory anatomy)", memory_svg.display());
    outln!(
        "            {}  (one JSON line per step)",
        log_path.display()
    );
    outln!(
        "            {}  (Hugging Face folder: GPT2LMHeadModel.from_pretrained loads it; castor \
         generate continues text with it)",
        ckpt.display()
    );
    outln!(
        "next        fine-tune it with LoRA adapters, saved as a PEFT adapter folder: castor \
         train {} --data TEXT --lora-rank 8 --lora-targets c_attn,c_proj,c_fc --save DIR",
        ckpt.display()
    );
    outln!("            with its frozen base in 4 bits, as QLoRA: add --base nf4");
    outln!("done        in {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}
