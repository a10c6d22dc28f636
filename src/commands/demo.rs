//! `castor demo`: castor's main job on an embedded model, with no files and no GPU.
//!
//! Builds the embedded tiny GPT-2, prints what the compiler decides for a BF16 and an FP16
//! training step (precision table, casts, loss scaling, recomputation, persistent memory),
//! trains it on the embedded corpus, samples text before and after, and writes the loss
//! curve, the memory anatomy and a checkpoint into an output folder.

use crate::anatomy::{anatomy, AnatomyRow};
use crate::checkpoint::{self, CheckpointFiles, TrainerState};
use crate::commands::train::{self, LoopOptions, LrSchedule, Schedule};
use crate::data::Data;
use crate::plot::{self, AnatomyBar, LossHistory};
use crate::precision::PrecisionArgs;
use crate::report::{model_summary, thousands};
use crate::trainer::Trainer;
use crate::training::TrainingArgs;
use anyhow::Context;
use castor_ir::{DType, Graph, Tensor, TrainingPlan};
use castor_models::{Config, Model, Objective};
use castor_passes::{build_training_plan, precision_summary, Precision};
use castor_runtime::cpu::CpuExecutor;
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
    #[arg(long, default_value = "bf16", value_parser = parse_precision)]
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

fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
}

/// The embedded tiny GPT-2 and its deterministic initial weights.
pub fn tiny_gpt2() -> anyhow::Result<(Model, HashMap<String, Tensor>)> {
    let config = Config::parse(TINY_GPT2_CONFIG, Path::new("<embedded tiny-gpt2>"))?;
    let model = Model::from_config(config)?;
    let params = model.init_params(DEMO_SEED);
    Ok((model, params))
}

/// The training flags `castor train` would use, with the demo's learning rate.
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
) -> anyhow::Result<Compiled> {
    let f = flags(precision)?;
    let loss_graph = model.build_loss_graph(batch, seq, Objective::Lm)?;
    castor_ir::verify(&loss_graph).context("the front end built an invalid graph")?;
    let compiled = f.precision.compile(loss_graph, None, false)?;
    let settings = f.training.settings(precision, Objective::Lm, batch, seq)?;
    let (plan, report) = build_training_plan(&compiled.graph, settings)?;
    Ok(Compiled {
        precision,
        loss_graph: compiled.graph,
        plan,
        summary: report.summary,
    })
}

/// The compile report of one precision: table, casts, loss scaling, remat, memory.
fn print_report(c: &Compiled, params: u64) {
    let summary = precision_summary(&c.loss_graph, c.precision.low());
    println!();
    println!(
        "compile     {} training step: {}",
        c.precision,
        summary.headline()
    );
    for line in summary.table_lines() {
        println!("              {line}");
    }
    println!("plan        {}", c.summary);
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
    println!("loss scale  {scaling}");
    println!("remat       none (every activation is kept for the backward pass)");
    println!("memory      planned peak of one step: persistent state by role, then the arena (bytes/param vs. the usual 18 of mixed-precision AdamW for the state)");
    let mut total = 0;
    for row in anatomy(&c.plan) {
        total += row.bytes;
        println!("              {}", memory_row(&row, params));
    }
    println!(
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

/// A deterministic random source for sampling (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A text generator: the forward graph for one window, run once per new byte.
struct Sampler {
    graph: Graph,
    window: usize,
}

impl Sampler {
    fn new(model: &Model, precision: Precision, window: usize) -> anyhow::Result<Sampler> {
        let graph = model.build_graph(1, window)?;
        let graph = flags(precision)?
            .precision
            .compile(graph, None, false)?
            .graph;
        Ok(Sampler { graph, window })
    }

    /// Continues `prompt` for up to `max_new` bytes, stopping at a newline: top-k sampling
    /// at temperature 0.7 with a fixed seed, so the same weights give the same line.
    fn sample(&self, runner: &PlanRunner, prompt: &str, max_new: usize) -> anyhow::Result<String> {
        let mut tokens: Vec<i64> = prompt.bytes().map(i64::from).collect();
        let mut rng = Rng(SAMPLE_SEED);
        let executor = CpuExecutor::new();
        let t = self.window;
        for _ in 0..max_new {
            // The last `t` bytes, left-aligned: causal attention never looks at the padding.
            let ctx = &tokens[tokens.len().saturating_sub(t)..];
            let n = ctx.len();
            let mut ids = ctx.to_vec();
            ids.resize(t, 0);
            let inputs: HashMap<&str, Tensor> = [
                ("input_ids", Tensor::from_i64(DType::I64, [1, t], ids)),
                (
                    "attention_mask",
                    Tensor::from_i64(DType::I64, [1, t], vec![1; t]),
                ),
            ]
            .into_iter()
            .collect();
            let bind = |name: &str| inputs.get(name).or_else(|| runner.state(name));
            let outputs = executor.run(&self.graph, &bind)?;
            let logits = outputs
                .first()
                .and_then(|x| x.as_f32())
                .context("the forward graph has no float output")?;
            let vocab = logits.len() / t;
            let row = &logits[(n - 1) * vocab..n * vocab];
            let next = sample_top_k(row, 20, 0.7, &mut rng);
            if next == i64::from(b'\n') {
                break;
            }
            tokens.push(next);
        }
        Ok(printable(&tokens))
    }
}

fn sample_top_k(logits: &[f32], k: usize, temperature: f64, rng: &mut Rng) -> i64 {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.truncate(k.max(1));
    let max = f64::from(logits[idx[0]]);
    let weights: Vec<f64> = idx
        .iter()
        .map(|&i| ((f64::from(logits[i]) - max) / temperature).exp())
        .collect();
    let mut r = rng.next_f64() * weights.iter().sum::<f64>();
    for (&i, w) in idx.iter().zip(&weights) {
        r -= w;
        if r <= 0.0 {
            return i as i64;
        }
    }
    idx[0] as i64
}

/// Bytes as text, with anything unprintable shown as `·`.
fn printable(tokens: &[i64]) -> String {
    tokens
        .iter()
        .map(|&t| match u8::try_from(t) {
            Ok(b) if (0x20..0x7f).contains(&b) => b as char,
            _ => '·',
        })
        .collect()
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let start = Instant::now();
    let device = crate::device::select(args.device)?;
    println!(
        "device      {}",
        match &device {
            crate::device::Selected::Cuda(d) => format!("cuda ({d})"),
            crate::device::Selected::Emulated => {
                "emulate (the CUDA program on the host emulator)".to_string()
            }
            crate::device::Selected::Cpu => format!("cpu ({})", crate::device::why_cpu()),
        }
    );
    let (model, params) = tiny_gpt2()?;
    let (batch, seq) = (args.batch, args.seq.min(model.max_positions()));
    let graph = model.build_graph(batch, seq)?;
    print!(
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
        compiled.push(compile(&model, precision, batch, seq)?);
    }
    let n_params = model.parameter_count();
    for c in compiled.iter().filter(|c| c.precision.low().is_some()) {
        print_report(c, n_params);
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
            segments: anatomy(&c.plan)
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
    let plan = compiled
        .into_iter()
        .find(|c| c.precision == args.precision)
        .context("the demo compiles every precision it trains")?
        .plan;
    let settings = plan.settings.clone();
    let mut runner = Trainer::new(plan, &|name| params.get(name).cloned(), &device)?;
    drop(params);
    let sampler = Sampler::new(&model, args.precision, seq)?;
    println!();
    println!(
        "sample      before training: \"{}\"",
        sampler.sample(runner.host()?, PROMPT, 60)?
    );
    let tokens: Vec<i64> = CORPUS.bytes().map(i64::from).collect();
    let mut data = Data::from_tokens(tokens, batch, seq, 0.1, "the embedded corpus".into())?;
    println!(
        "training    {} steps of [{batch}, {seq}] bytes of {}, {} on {}",
        args.steps,
        data.describe(),
        args.precision,
        if runner.device() == "cpu" {
            "the CPU executor".to_string()
        } else {
            runner.device()
        }
    );
    let log_path = out.join("train.jsonl");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("cannot create `{}`", log_path.display()))?;
    let loss_svg = out.join("loss.svg");
    train::catch_interrupts();
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
        plot: Some((
            loss_svg.clone(),
            format!(
                "Training the embedded tiny GPT-2 on the project's docs ({}, {})",
                args.precision,
                match runner.device().split(' ').next() {
                    Some("cuda") => "CUDA",
                    Some("emulate") => "CUDA program on the emulator",
                    _ => "CPU",
                }
            ),
        )),
        saves: None,
        files: CheckpointFiles::new(TINY_GPT2_CONFIG.to_string(), None),
        input_names: model.input_names(),
        label: "demo".into(),
    };
    let run = train::train_loop(&mut runner, &mut data, &mut opts, LossHistory::default())?;
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
    println!(
        "trained     {} steps in {:.1} s ({:.0} tokens/s): loss {first:.3} -> {last:.3} (mean of the last 10 steps)",
        run.steps_done,
        run.seconds,
        run.tokens / run.seconds.max(1e-9)
    );
    if let Some((step, v)) = run.history.validation.last() {
        println!("validation  loss {v:.3} on held-out text at step {step}");
    }
    println!(
        "sample      after training:  \"{}\"",
        sampler.sample(runner.host()?, PROMPT, 60)?
    );

    let ckpt = out.join("checkpoint");
    let state = TrainerState {
        step: run.steps_done,
        data_position: data.position(),
        settings,
    };
    checkpoint::save_folder_atomically(&ckpt, &opts.files, runner.host()?, &state)?;
    println!();
    println!("wrote       {}  (loss curve)", loss_svg.display());
    println!("            {}  (memory anatomy)", memory_svg.display());
    println!(
        "            {}  (one JSON line per step)",
        log_path.display()
    );
    println!(
        "            {}  (Hugging Face folder: GPT2LMHeadModel.from_pretrained loads it)",
        ckpt.display()
    );
    println!("done        in {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}
