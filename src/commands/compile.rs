//! `castor compile`: run the precision passes and show what they decided.

use crate::fit::{self, MemoryTarget};
use crate::html::{self, Report};
use crate::memory::Executor;
use crate::out::Stream;
use crate::precision::PrecisionArgs;
use crate::report::thousands;
use crate::training::TrainingArgs;
use anyhow::Context;
use castor_ir::{text, verify, Graph};
use castor_models::Model;
use castor_passes::memory::Anatomy;
use castor_passes::{explain, precision_summary};
use castor_runtime::cuda::lower::{lower_plan, LowerError};
use castor_runtime::cuda::memory::step_memory;
use castor_runtime::cuda::program::Program;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// The precision report (and for --train the plan's memory, fit and cost).
    Summary,
    /// The compiled graph's IR text (for --train: the micro step and the optimizer step).
    Ir,
    /// A Graphviz picture of the compiled graph, coloured by dtype, casts as diamonds.
    Dot,
    /// The training plan as JSON (implies --train), which `castor train --plan` runs.
    Plan,
    /// The CUDA executor's program for the training step (implies --train): every kernel
    /// launch with its grid and arguments, every cuBLAS product, the buffers. No GPU needed.
    Cuda,
}

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder, a bare config.json (no weights needed), or an IR text file (.ir).
    pub model: PathBuf,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    #[command(flatten)]
    pub classifier: crate::classifier::ClassifierArgs,
    /// What to write: `summary` (the report), `ir` (the compiled IR text), `dot` (a Graphviz
    /// graph coloured by dtype), `plan` (the training plan as JSON, for `castor train
    /// --plan`) or `cuda` (the CUDA program of the training step). Without -o the result goes
    /// to stdout alone and the report to stderr.
    #[arg(long, value_enum, default_value_t = Emit::Summary, help_heading = "Output")]
    pub emit: Emit,
    /// Write the emitted IR, DOT, plan or CUDA listing here instead of stdout.
    #[arg(
        short = 'o',
        long = "out",
        value_name = "FILE",
        help_heading = "Output"
    )]
    pub out: Option<PathBuf>,
    /// Write the report page here (with --train): one self-contained HTML file with the
    /// memory anatomy, the fit verdict, the precision table and the cost estimate.
    #[arg(long, value_name = "FILE.html", help_heading = "Output")]
    pub report: Option<PathBuf>,
    /// Explain the dtype decisions of the nodes whose names match GLOB (repeatable).
    #[arg(long, value_name = "GLOB", help_heading = "Output")]
    pub explain: Vec<String>,
    /// Print the IR after the named pass (`input`, `classify`, `autocast`, `fold_casts`; with
    /// --train also `classifier`, `autodiff`, `classifier_step`, `epilogue`, `accumulate`,
    /// `optimizer`, `remat`, `fusion`).
    #[arg(long, value_name = "PASS", help_heading = "Output")]
    pub dump_after: Option<String>,
    /// Run the IR verifier after every pass (always on in debug builds).
    #[arg(long, help_heading = "Output")]
    pub verify: bool,
    /// Batch size of the graph built from a model.
    #[arg(long, default_value_t = 1, help_heading = "Shape")]
    pub batch: usize,
    /// Sequence length of the graph (default: the model's maximum).
    #[arg(long, help_heading = "Shape")]
    pub seq: Option<usize>,
    /// Compile a training step (loss, backward, optimizer, loss scaling, memory plan) rather
    /// than the forward pass. For an IR file, its first output is the loss. Implied by
    /// `--emit plan|cuda`, `--report`, a `--remat` mode other than `none`, `--classifier
    /// fused` and `--epilogues fused`.
    #[arg(long, help_heading = "Training step")]
    pub train: bool,
    #[command(flatten)]
    pub training: TrainingArgs,
    /// The target GPU of the cost model and the fit verdict: a name (h100, h100-pcie, h200,
    /// a100, a100-40gb, l40s, l4, a10, rtx-4090, rtx-3090) or a JSON/TOML spec file with
    /// `name`, `low_precision_flops`, `tf32_flops`, `f32_flops`, `memory_bandwidth` (per
    /// second) and `memory_bytes`. Default: this machine's GPU for the verdict when there is
    /// one, and the H100 SXM.
    #[arg(long, value_name = "NAME|FILE", help_heading = "Device")]
    pub gpu: Option<String>,
}

/// What `compile` works on.
struct Input {
    /// The forward pass, or the loss for `--train`.
    graph: Graph,
    /// One line about where it came from.
    what: String,
    batch: usize,
    seq: usize,
    /// The model, when the input was not an IR file.
    model: Option<Model>,
}

/// The graph to compile of a model path or an IR file.
fn load_graph(args: &Args, train: bool) -> anyhow::Result<Input> {
    let (path, batch) = (args.model.as_path(), args.batch);
    if path.extension().is_some_and(|e| e == "ir") {
        let src = std::fs::read_to_string(path).map_err(|e| {
            crate::CliError::InvalidInput(format!("cannot read `{}`: {e}", path.display()))
        })?;
        let g = text::parse(&src).with_context(|| format!("`{}`", path.display()))?;
        verify(&g).with_context(|| format!("`{}`", path.display()))?;
        let what = format!("IR file, {} nodes", g.num_nodes());
        // An IR file's shapes are fixed: the model line, when there is one, says for what.
        let (batch, seq) = match g.shape {
            Some(s) => (s.batch, s.seq),
            None => (batch, args.seq.unwrap_or(0)),
        };
        return Ok(Input {
            graph: g,
            what,
            batch,
            seq,
            model: None,
        });
    }
    let mut model = args.classifier.load(path)?;
    model.set_attention(args.precision.attention.into());
    crate::report::warn_unused(&model);
    let seq = args.seq.unwrap_or_else(|| model.max_positions());
    let g = if train {
        let objective = args.training.objective(Some(&model))?;
        model.build_loss_graph(batch, seq, objective)?
    } else {
        model.build_graph(batch, seq)?
    };
    let what = format!(
        "{} ({}), {} parameters, batch {batch} x seq {seq}",
        model.architecture(),
        model.family().model_type(),
        thousands(model.parameter_count())
    );
    Ok(Input {
        graph: g,
        what,
        batch,
        seq,
        model: Some(model),
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // Outputs are checked before any work.
    if let Some(path) = &args.out {
        if args.emit == Emit::Summary {
            return Err(crate::CliError::InvalidInput(
                "-o needs --emit ir, dot, plan or cuda".into(),
            )
            .into());
        }
        crate::outputs::check_file("-o", path)?;
    }
    if let Some(path) = &args.report {
        html::check_report_path(path)?;
        crate::outputs::check_file("--report", path)?;
    }
    // Recomputation, the fused classifier and epilogues only mean something for a training
    // step, so asking for one of them asks for one.
    let train = args.train
        || matches!(args.emit, Emit::Plan | Emit::Cuda)
        || args.training.remat != castor_ir::Remat::None
        || !args.training.classifier.is_eager()
        || !args.training.epilogues.is_eager()
        || args.training.lora_rank.is_some()
        || args.report.is_some();
    // A result on stdout goes there alone; the report then goes to stderr.
    let say = if args.emit != Emit::Summary && args.out.is_none() {
        Stream::Stderr
    } else {
        Stream::Stdout
    };
    let gpu = fit::gpu_spec(args.gpu.as_deref())?;
    let Input {
        graph,
        what,
        batch,
        seq,
        model,
    } = load_graph(&args, train)?;
    let lora = match train {
        true => args.training.lora(model.as_ref().map(|m| m.family()))?,
        false => None,
    };
    args.training.check_base(lora.as_ref())?;
    let (graph, lora_report) = crate::training::with_adapters(graph, lora.as_ref())?;
    // --dump-after names a precision pass or, for a training step, a training-build pass.
    let training = Executor::Cuda.pipeline();
    let dump_training = args
        .dump_after
        .as_deref()
        .filter(|n| train && training.pass_names().contains(n));
    let dump_precision = args
        .dump_after
        .as_deref()
        .filter(|_| dump_training.is_none());
    let out = args
        .precision
        .compile(graph, model.as_ref(), dump_precision, args.verify)
        .map_err(|e| match e.downcast_ref::<castor_passes::PassError>() {
            Some(castor_passes::PassError::UnknownPass { name, available }) if train => {
                castor_passes::PassError::UnknownPass {
                    name: name.clone(),
                    available: format!(
                        "{available}; training: {}",
                        training.pass_names().join(", ")
                    ),
                }
                .into()
            }
            _ => e,
        })?;
    let policy = args.precision.policy()?;

    toln!(say, "model       {} ({what})", args.model.display());
    toln!(say, "precision   {}", args.precision.precision);
    for r in policy.name_rules() {
        toln!(say, "rule        {}", r.describe(policy.precision.low()));
    }
    if let Some(report) = &lora_report {
        toln!(say, "pass        {:<11} {}", "lora", report.summary);
    }
    for (pass, report) in &out.reports {
        toln!(say, "pass        {pass:<11} {}", report.summary);
    }
    let summary = precision_summary(&out.graph, args.precision.precision.low());
    toln!(say);
    toln!(say, "{}", summary.headline());
    for line in summary.table_lines() {
        toln!(say, "  {line}");
    }
    for glob in &args.explain {
        let lines = explain(&out.graph, glob);
        if lines.is_empty() {
            toln!(say, "\nexplain '{glob}': no node matches");
        }
        for l in lines {
            toln!(say, "\n{l}");
        }
    }
    if let Some(dump) = &out.dump {
        toln!(
            say,
            "\n# IR after {}",
            args.dump_after.as_deref().unwrap_or("")
        );
        say.write(format_args!("{dump}"));
    }
    let plan = if train {
        let objective = args.training.objective(model.as_ref())?;
        let mut settings =
            args.training
                .settings(args.precision.precision, objective, batch, seq)?;
        if model.is_none() {
            // An IR file's loss is its first output, whatever --objective says.
            settings.objective = "first-output".into();
        }
        settings.lora = lora;
        let mut pipeline = training.dump_after(dump_training)?;
        if args.verify {
            pipeline = pipeline.verify_each(true);
        }
        let built = pipeline.run(&out.graph, settings)?;
        toln!(say);
        for (pass, report) in &built.reports {
            toln!(say, "pass        {pass:<11} {}", report.summary);
        }
        toln!(
            say,
            "optimizer   {}",
            crate::report::optimizer_text(&built.plan.settings)
        );
        toln!(
            say,
            "loss scale  {}",
            crate::report::loss_scaling_text(&built.plan.settings)
        );
        // The step lowered once: its allocation is the anatomy's memory, its commands the
        // cuda line.
        let lowered = lower_plan(&built.plan);
        let anatomy = match &lowered {
            Ok(program) => Anatomy::with_memory(&built.plan, step_memory(&built.plan, program)),
            Err(_) => Executor::Cuda.anatomy(&built.plan),
        };
        print_memory_and_cost(say, &built.plan, &anatomy, &lowered, &gpu);
        if let Some(dump) = &built.dump {
            toln!(
                say,
                "\n# IR after {}",
                args.dump_after.as_deref().unwrap_or("")
            );
            say.write(format_args!("{dump}"));
        }
        let plan = built.plan;
        let target = match &args.gpu {
            Some(_) => MemoryTarget::of_spec(&gpu, "--gpu"),
            None => MemoryTarget::this_gpu()
                .or_else(|| MemoryTarget::of_spec(&gpu, "default target; --gpu names another")),
        };
        let verdict = target.map(|target| {
            fit::verdict(&plan, &anatomy, target, &gpu, &|settings| {
                replan(&args, model.as_ref(), &out.graph, &settings)
            })
        });
        if let Some(v) = &verdict {
            toln!(say);
            for line in v.lines() {
                toln!(say, "{line}");
            }
        }
        if let Some(path) = &args.report {
            let mut r = Report::new(
                path.clone(),
                &format!("Training step plan: {}", args.model.display()),
            );
            r.fact("model", &format!("{} ({what})", args.model.display()));
            r.training_plan(&plan, Some(&summary), &anatomy, Executor::Cuda);
            r.verdict = verdict.clone();
            r.cost(&plan, &gpu);
            r.write(None)?;
            toln!(say, "\nreport      {}", path.display());
        }
        Some(plan)
    } else {
        None
    };
    let emitted = match (args.emit, &plan) {
        (Emit::Summary, _) => None,
        (Emit::Ir, Some(plan)) => Some(format!(
            "# micro step: forward and backward of one micro-batch\n{}\n# optimizer step\n{}\n{}",
            text::print(&plan.micro_step),
            text::print(&plan.optimizer_step),
            units_text(plan)
        )),
        (Emit::Ir, None) => Some(text::print(&out.graph)),
        (Emit::Dot, Some(plan)) => Some(castor_ir::to_dot(&plan.micro_step)),
        (Emit::Dot, None) => Some(castor_ir::to_dot(&out.graph)),
        (Emit::Plan, Some(plan)) => Some(plan.to_json()),
        (Emit::Cuda, Some(plan)) => Some(
            castor_runtime::cuda::lower::lower_plan(plan)
                .map_err(|e| crate::CliError::InvalidInput(format!("--emit cuda: {e}")))?
                .listing(),
        ),
        (Emit::Plan | Emit::Cuda, None) => None,
    };
    match (emitted, &args.out) {
        (Some(text), Some(path)) => {
            castor_models::write_atomically(path, text.as_bytes())?;
            toln!(say, "\nwrote {}", path.display());
        }
        (Some(text), None) => crate::out!("{text}"),
        (None, _) => {}
    }
    Ok(())
}

/// The plan of other settings for the fit verdict: the same model and policy compiled again
/// for the settings' micro-batch, or (an IR file, or the same micro-batch) the compiled graph
/// itself.
fn replan(
    args: &Args,
    model: Option<&Model>,
    compiled: &Graph,
    settings: &castor_ir::TrainSettings,
) -> anyhow::Result<castor_ir::TrainingPlan> {
    let graph = match model {
        Some(m) if settings.batch != args.batch => {
            let objective = settings
                .objective
                .parse()
                .map_err(crate::CliError::InvalidInput)?;
            let loss = m.build_loss_graph(settings.batch, settings.seq, objective)?;
            args.precision.compile(loss, model, None, false)?.graph
        }
        None if settings.batch != args.batch => anyhow::bail!("an IR file has one batch size"),
        _ => compiled.clone(),
    };
    Ok(Executor::Cuda
        .pipeline()
        .run(&graph, settings.clone())?
        .plan)
}

/// The remat decisions, the memory anatomy (persistent state by role, saved activations, the
/// planned arena) and the cost model's estimate of the step.
fn print_memory_and_cost(
    say: Stream,
    plan: &castor_ir::TrainingPlan,
    anatomy: &Anatomy,
    lowered: &Result<Program, LowerError>,
    gpu: &castor_passes::cost::GpuSpec,
) {
    use castor_passes::{cost::StepCost, remat};
    let (names, cost) = remat::recomputed(&plan.micro_step, gpu);
    let groups = remat::group_counts(&plan.micro_step, &names);
    toln!(
        say,
        "remat       {}: {} value(s) recomputed in the backward part, +{:.3} GFLOP",
        plan.settings.remat,
        names.len(),
        cost.flops / 1e9
    );
    for (group, count) in &groups {
        toln!(say, "  recompute {group} x{count}");
    }
    toln!(say);
    for line in crate::report::anatomy_lines(anatomy, &plan.settings) {
        toln!(say, "{line}");
    }
    toln!(say);
    toln!(say, "cost model (roofline estimate)");
    for line in crate::report::cost_lines(&StepCost::of_plan(plan, gpu)) {
        toln!(say, "{line}");
    }
    toln!(say);
    toln!(say, "{}", cuda_line(plan, lowered, gpu));
}

/// The plan's kernel units as comment lines after its graphs (see [`castor_ir::KernelUnit`]).
fn units_text(plan: &castor_ir::TrainingPlan) -> String {
    let mut out =
        String::from("# kernel units: what runs as one kernel (a node in no unit runs alone)\n");
    for unit in &plan.kernel_units {
        for line in unit.to_string().lines() {
            out.push_str("# ");
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// What the CUDA executor would run for one step: kernel launches, cuBLAS products, copies
/// and memsets per run, the kernel modules to compile, the arena as the executor places it
/// (live ranges per kernel, so fused values take no memory) and the program's roofline on
/// `gpu` (kernel units as they run); or why it cannot run it.
fn cuda_line(
    plan: &castor_ir::TrainingPlan,
    lowered: &Result<Program, LowerError>,
    gpu: &castor_passes::cost::GpuSpec,
) -> String {
    use castor_runtime::cuda::{program::Command, roofline::roofline_of};
    match lowered
        .clone()
        .and_then(|p| Ok((roofline_of(plan, &p, gpu)?, p)))
    {
        Ok((r, p)) => {
            let count = |f: &dyn Fn(&Command) -> bool| -> usize {
                p.runs
                    .iter()
                    .flat_map(|r| r.commands.iter())
                    .filter(|c| f(c))
                    .count()
            };
            let launches = count(&|c| matches!(c, Command::Launch(_)));
            let gemms = count(&|c| matches!(c, Command::Gemm(_)));
            let other = count(&|c| matches!(c, Command::Copy { .. } | Command::Memset { .. }));
            let mfu = r
                .mfu()
                .map_or("MFU n/a".to_string(), |m| format!("MFU {:.1}%", 100.0 * m));
            format!(
                "cuda        {launches} kernel launches, {gemms} cuBLAS products, {other} copies/memsets \
                 per step; {} modules; arena {} at kernel granularity; program roofline \
                 {:.3} ms per step, {:.0} tokens/s, {mfu} (kernel units at peak, {:.0} µs per \
                 command)",
                p.modules.len(),
                castor_ir::human_bytes(p.arena_bytes),
                r.seconds() * 1e3,
                r.tokens_per_second(),
                castor_runtime::cuda::roofline::LAUNCH_SECONDS * 1e6
            )
        }
        Err(e) => format!("cuda        cannot run on the CUDA executor: {e}"),
    }
}
