//! `castor compile`: run the precision passes and show what they decided.

use crate::precision::PrecisionArgs;
use crate::report::thousands;
use crate::training::TrainingArgs;
use anyhow::Context;
use castor_ir::{text, verify, Graph};
use castor_models::Model;
use castor_passes::{explain, precision_summary, TrainingPipeline};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// The precision report (always printed to stdout).
    Summary,
    /// The compiled graph's IR text.
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
    /// What to write: the summary, the IR text or a DOT graph.
    #[arg(long, value_enum, default_value_t = Emit::Summary)]
    pub emit: Emit,
    /// Write the emitted IR or DOT here instead of stdout.
    #[arg(short = 'o', long = "out", value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Explain the dtype decisions of the nodes whose names match GLOB (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub explain: Vec<String>,
    /// Print the IR after the named pass (`input`, `classify`, `autocast`, `fold_casts`; with
    /// --train also `autodiff`, `accumulate`, `optimizer`, `remat`, `fusion`).
    #[arg(long, value_name = "PASS")]
    pub dump_after: Option<String>,
    /// Run the IR verifier after every pass (always on in debug builds).
    #[arg(long)]
    pub verify: bool,
    /// Batch size of the graph built from a model.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Sequence length of the graph (default: the model's maximum).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Compile a training step (loss, backward, optimizer, loss scaling, memory plan) rather
    /// than the forward pass. For an IR file, its first output is the loss. Implied by
    /// `--emit plan` and by a `--remat` mode other than `none`.
    #[arg(long)]
    pub train: bool,
    #[command(flatten)]
    pub training: TrainingArgs,
    /// The target GPU of the cost model: a JSON or TOML file with `name`,
    /// `low_precision_flops`, `tf32_flops`, `f32_flops`, `memory_bandwidth` (per second) and
    /// optionally `memory_bytes`. Default: H100 SXM.
    #[arg(long, value_name = "FILE")]
    pub gpu: Option<PathBuf>,
}

/// The cost model's GPU: `--gpu FILE` or the H100 SXM default.
fn gpu_spec(path: Option<&std::path::Path>) -> anyhow::Result<castor_passes::cost::GpuSpec> {
    let Some(path) = path else {
        return Ok(castor_passes::cost::GpuSpec::default());
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        crate::CliError::InvalidInput(format!("cannot read `{}`: {e}", path.display()))
    })?;
    Ok(castor_passes::cost::GpuSpec::parse(
        &text,
        &format!("`{}`", path.display()),
    )?)
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
    let model = Model::load(path)?;
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
    // Recomputation only means something for a training step, so asking for it asks for one.
    let train = args.train
        || matches!(args.emit, Emit::Plan | Emit::Cuda)
        || args.training.remat != castor_ir::Remat::None;
    let gpu = gpu_spec(args.gpu.as_deref())?;
    let Input {
        graph,
        what,
        batch,
        seq,
        model,
    } = load_graph(&args, train)?;
    // --dump-after names a precision pass or, for a training step, a training-build pass.
    let training = TrainingPipeline::default();
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
        .compile(graph, dump_precision, args.verify)
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

    println!("model       {} ({what})", args.model.display());
    println!("precision   {}", args.precision.precision);
    for r in policy.name_rules() {
        println!("rule        {}", r.describe(policy.precision.low()));
    }
    for (pass, report) in &out.reports {
        println!("pass        {pass:<11} {}", report.summary);
    }
    let summary = precision_summary(&out.graph, args.precision.precision.low());
    println!();
    println!("{}", summary.headline());
    for line in summary.table_lines() {
        println!("  {line}");
    }
    for glob in &args.explain {
        let lines = explain(&out.graph, glob);
        if lines.is_empty() {
            println!("\nexplain '{glob}': no node matches");
        }
        for l in lines {
            println!("\n{l}");
        }
    }
    if let Some(dump) = &out.dump {
        println!("\n# IR after {}", args.dump_after.as_deref().unwrap_or(""));
        print!("{dump}");
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
        let mut pipeline = training.dump_after(dump_training)?;
        if args.verify {
            pipeline = pipeline.verify_each(true);
        }
        let built = pipeline.run(&out.graph, settings)?;
        println!();
        for (pass, report) in &built.reports {
            println!("pass        {pass:<11} {}", report.summary);
        }
        print_training(&built.plan);
        print_memory_and_cost(&built.plan, &gpu);
        if let Some(dump) = &built.dump {
            println!("\n# IR after {}", args.dump_after.as_deref().unwrap_or(""));
            print!("{dump}");
        }
        Some(built.plan)
    } else {
        None
    };
    let emitted = match (args.emit, &plan) {
        (Emit::Summary, _) => None,
        (Emit::Ir, Some(plan)) => Some(format!(
            "# micro step: forward and backward of one micro-batch\n{}\n# optimizer step\n{}",
            text::print(&plan.micro_step),
            text::print(&plan.optimizer_step)
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
            println!("\nwrote {}", path.display());
        }
        (Some(text), None) => {
            println!();
            print!("{text}");
        }
        (None, Some(_)) => {
            return Err(crate::CliError::InvalidInput(
                "-o needs --emit ir, dot, plan or cuda".into(),
            )
            .into());
        }
        (None, None) => {}
    }
    Ok(())
}

/// The plan's optimizer and loss scaling, and its persistent state by role.
fn print_training(plan: &castor_ir::TrainingPlan) {
    use castor_ir::{LossScaling, OptimizerKind};
    let s = &plan.settings;
    let optimizer = match s.optimizer {
        OptimizerKind::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => format!("AdamW (betas {beta1}, {beta2}; eps {eps:e}; weight decay {weight_decay})"),
        OptimizerKind::Sgd {
            momentum,
            weight_decay,
        } => format!("SGD (momentum {momentum}; weight decay {weight_decay})"),
    };
    let clip = if s.max_grad_norm > 0.0 {
        format!(", clip global norm at {}", s.max_grad_norm)
    } else {
        String::new()
    };
    println!(
        "optimizer   {optimizer} on F32 master weights{clip}; objective {}; {} micro-batch(es) per step",
        s.objective, s.grad_accum
    );
    let scaling = match &s.loss_scaling {
        LossScaling::None => "none".to_string(),
        LossScaling::Static { scale } => format!("static {scale}"),
        LossScaling::Dynamic {
            init_scale,
            growth_interval,
            hysteresis,
            max_scale,
            min_scale,
            ..
        } => format!(
            "dynamic: init {init_scale}, x2 after {growth_interval} clean steps, x0.5 on overflow \
             (hysteresis {hysteresis}), max {max_scale}, error below {min_scale}"
        ),
    };
    println!("loss scale  {scaling}");
}

/// The remat decisions, the memory anatomy (persistent state by role, saved activations, the
/// planned arena) and the cost model's estimate of the step.
fn print_memory_and_cost(plan: &castor_ir::TrainingPlan, gpu: &castor_passes::cost::GpuSpec) {
    use castor_passes::{cost::StepCost, memory::Anatomy, remat};
    let (names, cost) = remat::recomputed(&plan.micro_step, gpu);
    let groups = remat::group_counts(&plan.micro_step, &names);
    println!(
        "remat       {}: {} value(s) recomputed in the backward part, +{:.3} GFLOP",
        plan.settings.remat,
        names.len(),
        cost.flops / 1e9
    );
    for (group, count) in &groups {
        println!("  recompute {group} x{count}");
    }
    println!();
    for line in crate::report::anatomy_lines(&Anatomy::of_plan(plan)) {
        println!("{line}");
    }
    println!();
    println!("cost model (roofline estimate)");
    for line in crate::report::cost_lines(&StepCost::of_plan(plan, gpu)) {
        println!("{line}");
    }
    println!();
    println!("{}", cuda_line(plan));
}

/// What the CUDA executor would run for one step: kernel launches, cuBLAS products, copies
/// and memsets per run, the kernel modules to compile, and the arena as the executor places
/// it (live ranges per kernel, so fused values take no memory), or why it cannot run it.
fn cuda_line(plan: &castor_ir::TrainingPlan) -> String {
    use castor_runtime::cuda::{lower::lower_plan, program::Command};
    match lower_plan(plan) {
        Ok(p) => {
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
            format!(
                "cuda        {launches} kernel launches, {gemms} cuBLAS products, {other} copies/memsets \
                 per step; {} modules; arena {} at kernel granularity",
                p.modules.len(),
                castor_ir::human_bytes(p.arena_bytes)
            )
        }
        Err(e) => format!("cuda        cannot run on the CUDA executor: {e}"),
    }
}
