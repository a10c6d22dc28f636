//! `castor compile`: run the precision passes and show what they decided.

use crate::given::Given;
use crate::html::{self, Report};
use crate::out::Stream;
use crate::precision::PrecisionArgs;
use crate::report::thousands;
use crate::training::fit::{self, MemoryTarget};
use crate::training::TrainingArgs;
use anyhow::Context;
use castor_ir::{text, verify, Graph};
use castor_models::Model;
use castor_passes::memory::Anatomy;
use castor_passes::{explain, precision_summary};
use castor_runtime::cuda::lower::{lower_plan, LowerError};
use castor_runtime::cuda::memory::step_memory;
use castor_runtime::cuda::program::Program;
use castor_runtime::ExecutorKind;
use std::fmt::Write;
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
    /// `optimizer`, `fp8_scaling`, `fp8_weights`, `nf4`, `parallel`, `remat`, `fusion`).
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
    /// fused`, `--epilogues fused` and a `--dropout` other than `off`.
    #[arg(long, help_heading = "Training step")]
    pub train: bool,
    #[command(flatten)]
    pub training: TrainingArgs,
    /// The target GPU of the cost model and the fit verdict: a name (h100, h100-pcie, h200,
    /// a100, a100-40gb, l40s, l4, a10, rtx-4090, rtx-3090) or a JSON/TOML spec file with
    /// `name`, `low_precision_flops`, `tf32_flops`, `f32_flops`, `memory_bandwidth` (per
    /// second), `memory_bytes` and `interconnect` (`link_bandwidth`, `network_bandwidth` per
    /// GPU and second, `gpus_per_node`). Default: this machine's GPU for the verdict when
    /// there is one, and the H100 SXM.
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

/// Warns when an IR file already holds values of a 16-bit dtype other than `low`, the one
/// asked for: its values were rounded once, and compiling again rounds them a second time.
fn warn_if_compiled(g: &Graph, path: &std::path::Path, low: Option<castor_ir::DType>) {
    use castor_ir::DType;
    let Some(low) = low else { return };
    let other = match low {
        DType::BF16 => DType::F16,
        DType::F16 => DType::BF16,
        _ => return,
    };
    let rounded = g
        .nodes()
        .flat_map(|(_, n)| n.outputs.iter())
        .filter(|&&v| g.ty(v).dtype == other)
        .count();
    if rounded > 0 {
        crate::errln!(
            "warning: `{}` is already compiled: {rounded} value(s) are {other}, and compiling \
             to {low} rounds them again; compile the F32 source IR instead",
            path.display()
        );
    }
}

/// The graph to compile of a model path or an IR file.
fn load_graph(args: &Args, train: bool) -> anyhow::Result<Input> {
    let (path, batch) = (args.model.as_path(), args.batch);
    if path.extension().is_some_and(|e| e == "ir") {
        let src = std::fs::read_to_string(path).map_err(|e| {
            crate::CliError::InvalidInput(format!("cannot read `{}`: {e}", path.display()))
        })?;
        // An IR file's graph is built already: the flags that shape a model's graph cannot
        // apply to it.
        for (given, flag) in [
            (args.training.pack, "--pack"),
            (args.training.unpadded, "--unpadded"),
        ] {
            if given {
                return Err(crate::CliError::InvalidInput(format!(
                    "{flag} shapes the graph built from a model; `{}` is an IR file, whose \
                     graph is fixed: leave {flag} out",
                    path.display()
                ))
                .into());
            }
        }
        let g = text::parse(&src).with_context(|| format!("`{}`", path.display()))?;
        verify(&g).with_context(|| format!("`{}`", path.display()))?;
        warn_if_compiled(&g, path, args.precision.precision.low());
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
    model.set_packed(args.training.pack)?;
    model.set_unpadded(args.training.unpadded)?;
    if train {
        model.set_dropout(args.training.dropout);
    }
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

pub fn run(args: Args, given: &Given) -> anyhow::Result<()> {
    check_outputs(&args)?;
    // A result on stdout goes there alone; the report then goes to stderr.
    let say = if args.emit != Emit::Summary && args.out.is_none() {
        Stream::Stderr
    } else {
        Stream::Stdout
    };
    let compiled = compile(&args, given)?;
    say.write(format_args!("{}", compiled.report));
    match (compiled.emit(args.emit)?, &args.out) {
        (Some(text), Some(path)) => {
            castor_models::write_atomically(path, text.as_bytes())?;
            toln!(say, "\nwrote {}", path.display());
        }
        (Some(text), None) => crate::out!("{text}"),
        (None, _) => {}
    }
    Ok(())
}

/// Checks `-o` and `--report` before any work.
pub fn check_outputs(args: &Args) -> anyhow::Result<()> {
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
        // Where first (a folder given as the page is an output error), then the kind.
        crate::outputs::check_file("--report", path)?;
        html::check_report_path(path)?;
    }
    Ok(())
}

/// Whether these arguments ask for a training step: recomputation, the fused classifier and
/// epilogues, dropout, adapters and the report page only mean something for one, so asking
/// for one of them asks for one (a forward pass is evaluation, where dropout is off). The
/// classifier and epilogues are fused by default: only giving `--classifier fused` or
/// `--epilogues fused` on the command line asks.
fn wants_training(args: &Args, given: &Given) -> bool {
    args.train
        || matches!(args.emit, Emit::Plan | Emit::Cuda)
        || args.training.remat != castor_ir::Remat::None
        || (given.has("classifier") && !args.training.classifier.is_eager())
        || (given.has("epilogues") && !args.training.epilogues.is_eager())
        || (given.has("dropout") && !args.training.dropout.is_off())
        || args.training.lora_rank.is_some()
        || args.report.is_some()
}

/// Runs the passes `args` ask for and writes the report page (`--report`); the report text
/// is returned, not printed. Output paths are the caller's to check first.
pub fn compile(args: &Args, given: &Given) -> anyhow::Result<Compiled> {
    let train = wants_training(args, given);
    let mut r = String::new();
    let gpu = fit::gpu_spec(args.gpu.as_deref())?;
    let Input {
        graph,
        what,
        batch,
        seq,
        model,
    } = load_graph(args, train)?;
    let lora = match train {
        true => args.training.lora(model.as_ref().map(|m| m.family()))?,
        false => None,
    };
    args.training.check_base(lora.as_ref())?;
    let (graph, lora_report) = crate::training::with_adapters(graph, lora.as_ref())?;
    // --dump-after names a precision pass or, for a training step, a training-build pass.
    let training = crate::memory::pipeline(ExecutorKind::Cuda);
    let dump_training = args
        .dump_after
        .as_deref()
        .filter(|n| train && training.pass_names().contains(n));
    let dump_precision = args
        .dump_after
        .as_deref()
        .filter(|_| dump_training.is_none());
    // A training step's settings carry its precision; the flags, the policy's rules.
    let settings = match train {
        true => Some(plan_settings(args, model.as_ref(), batch, seq, lora)?),
        false => None,
    };
    let precision = match &settings {
        Some(s) => args.precision.for_plan(s),
        None => args.precision.clone(),
    };
    let out = precision
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
    let policy = precision.policy()?;

    writeln!(r, "model       {} ({what})", args.model.display())?;
    writeln!(r, "precision   {}", precision.precision)?;
    for rule in policy.name_rules() {
        writeln!(r, "rule        {}", rule.describe(policy.precision.low()))?;
    }
    if let Some(report) = &lora_report {
        writeln!(r, "pass        {:<11} {}", "lora", report.summary)?;
    }
    for (pass, report) in &out.reports {
        writeln!(r, "pass        {pass:<11} {}", report.summary)?;
    }
    let summary = precision_summary(&out.graph, precision.precision.low());
    writeln!(r)?;
    writeln!(r, "{}", summary.headline())?;
    for line in summary.table_lines() {
        writeln!(r, "  {line}")?;
    }
    for glob in &args.explain {
        let lines = explain(&out.graph, glob);
        if lines.is_empty() {
            // As a --keep-f32 glob that matches nothing: an error with the nearest names.
            let names: Vec<&str> = out
                .graph
                .nodes()
                .filter_map(|(_, n)| n.outputs.first().map(|&v| out.graph.name(v)))
                .collect();
            let hints: Vec<String> = castor_passes::names::suggest(glob, names.iter().copied())
                .into_iter()
                .map(|s| format!("`{s}`"))
                .collect();
            return Err(crate::CliError::InvalidInput(format!(
                "--explain '{glob}' matches no node name; did you mean {}?",
                hints.join(" or ")
            ))
            .into());
        }
        for l in lines {
            writeln!(r, "\n{l}")?;
        }
    }
    if let Some(dump) = &out.dump {
        writeln!(
            r,
            "\n# IR after {}",
            args.dump_after.as_deref().unwrap_or("")
        )?;
        write!(r, "{dump}")?;
    }
    let plan = if let Some(settings) = settings {
        let mut pipeline = training.dump_after(dump_training)?;
        if args.verify {
            pipeline = pipeline.verify_each(true);
        }
        let built = pipeline.run(&out.graph, settings)?;
        writeln!(r)?;
        for (pass, report) in &built.reports {
            writeln!(r, "pass        {pass:<11} {}", report.summary)?;
        }
        writeln!(
            r,
            "optimizer   {}",
            crate::report::optimizer_text(&built.plan.settings)
        )?;
        writeln!(
            r,
            "loss scale  {}",
            crate::report::loss_scaling_text(&built.plan.settings)
        )?;
        // The step lowered once: its allocation is the anatomy's memory, its commands the
        // cuda line.
        let (anatomy, lowered) = anatomy_of(&built.plan);
        r.push_str(&memory_and_cost(&built.plan, &anatomy, &lowered, &gpu)?);
        if let Some(dump) = &built.dump {
            writeln!(
                r,
                "\n# IR after {}",
                args.dump_after.as_deref().unwrap_or("")
            )?;
            write!(r, "{dump}")?;
        }
        let plan = built.plan;
        let target = match &args.gpu {
            Some(_) => MemoryTarget::of_spec(&gpu, "--gpu"),
            None => MemoryTarget::this_gpu()
                .or_else(|| MemoryTarget::of_spec(&gpu, "default target; --gpu names another")),
        };
        let verdict = target.map(|target| {
            let family = model.as_ref().map(Model::family);
            fit::verdict(&plan, &anatomy, target, &gpu, family, &|settings| {
                replan(args, model.as_ref(), &out.graph, &plan.settings, &settings)
            })
        });
        if let Some(v) = &verdict {
            writeln!(r)?;
            for line in v.lines() {
                writeln!(r, "{line}")?;
            }
        }
        if let Some(path) = &args.report {
            let mut page = Report::new(
                path.clone(),
                &format!("Training step plan: {}", args.model.display()),
            );
            page.fact("model", &format!("{} ({what})", args.model.display()));
            page.training_plan(&plan, Some(&summary), &anatomy, ExecutorKind::Cuda);
            page.verdict = verdict.clone();
            page.cost(&plan, &gpu);
            page.write(None)?;
            writeln!(r, "\nreport      {}", path.display())?;
        }
        Some((plan, anatomy))
    } else {
        None
    };
    Ok(Compiled {
        report: r,
        graph: out.graph,
        low: precision.precision.low(),
        plan,
        gpu,
    })
}

/// The settings of `compile --train`: the flags' (an IR file's loss is its first output,
/// whatever `--objective` says).
fn plan_settings(
    args: &Args,
    model: Option<&Model>,
    batch: usize,
    seq: usize,
    lora: Option<castor_ir::LoraSettings>,
) -> anyhow::Result<castor_ir::TrainSettings> {
    let objective = args.training.objective(model)?;
    let mut settings = args
        .training
        .settings(args.precision.precision, objective, batch, seq)?;
    if model.is_none() {
        settings.objective = "first-output".into();
    }
    settings.lora = lora;
    Ok(settings)
}

/// The plan of other settings for the fit verdict: from `compiled` (the graph of `original`)
/// when the graph stays the same, else from the model's graph built and compiled again for
/// the settings' micro-batch, adapters or precision (an IR file has one of each).
fn replan(
    args: &Args,
    model: Option<&Model>,
    compiled: &Graph,
    original: &castor_ir::TrainSettings,
    settings: &castor_ir::TrainSettings,
) -> anyhow::Result<castor_ir::TrainingPlan> {
    let same_graph = settings.batch == original.batch
        && settings.lora == original.lora
        && settings.precision == original.precision;
    let graph = match model {
        Some(m) if !same_graph => {
            let objective = settings
                .objective
                .parse()
                .map_err(crate::CliError::InvalidInput)?;
            let loss = m.build_loss_graph(settings.batch, settings.seq, objective)?;
            let (loss, _) = crate::training::with_adapters(loss, settings.lora.as_ref())?;
            args.precision
                .for_plan(settings)
                .compile(loss, model, None, false)?
                .graph
        }
        None if !same_graph => {
            anyhow::bail!("an IR file has one batch size, one precision and no adapters")
        }
        _ => compiled.clone(),
    };
    Ok(crate::memory::pipeline(ExecutorKind::Cuda)
        .run(&graph, settings.clone())?
        .plan)
}

/// The remat decisions, the memory anatomy (persistent state by role, saved activations, the
/// planned arena) and the cost model's estimate of the step.
fn memory_and_cost(
    plan: &castor_ir::TrainingPlan,
    anatomy: &Anatomy,
    lowered: &Result<Program, LowerError>,
    gpu: &castor_passes::cost::GpuSpec,
) -> Result<String, std::fmt::Error> {
    use castor_passes::{cost::StepCost, remat};
    let mut r = String::new();
    let (names, cost) = remat::recomputed(&plan.micro_step, gpu);
    let groups = remat::group_counts(&plan.micro_step, &names);
    writeln!(
        r,
        "remat       {}: {} value(s) recomputed in the backward part, +{:.3} GFLOP",
        plan.settings.remat,
        names.len(),
        cost.flops / 1e9
    )?;
    for (group, count) in &groups {
        writeln!(r, "  recompute {group} x{count}")?;
    }
    writeln!(r)?;
    for line in crate::report::anatomy_lines(anatomy, &plan.settings) {
        writeln!(r, "{line}")?;
    }
    writeln!(r)?;
    writeln!(r, "cost model (roofline estimate)")?;
    for line in crate::report::cost_lines(&StepCost::of_plan(plan, gpu)) {
        writeln!(r, "{line}")?;
    }
    writeln!(r)?;
    writeln!(r, "{}", cuda_line(plan, lowered, gpu))?;
    Ok(r)
}

/// The step's memory anatomy, its allocation as the CUDA executor lays out the lowered
/// program (the node-level model when the plan does not lower), and the lowering itself.
fn anatomy_of(plan: &castor_ir::TrainingPlan) -> (Anatomy, Result<Program, LowerError>) {
    let lowered = lower_plan(plan);
    let anatomy = match &lowered {
        Ok(program) => Anatomy::with_memory(plan, step_memory(plan, program)),
        Err(_) => crate::memory::anatomy(ExecutorKind::Cuda, plan),
    };
    (anatomy, lowered)
}

/// What `compile` produced: the report it prints and what the report was made from.
pub struct Compiled {
    /// The report, as the CLI prints it.
    pub report: String,
    /// The graph after the precision passes (for a training step, the loss graph).
    pub graph: Graph,
    /// The precision's low dtype (none for fp32 and tf32).
    pub low: Option<castor_ir::DType>,
    /// The training plan and its memory anatomy, for a training step.
    pub plan: Option<(castor_ir::TrainingPlan, Anatomy)>,
    /// The GPU of the cost model.
    pub gpu: castor_passes::cost::GpuSpec,
}

/// The file [`Compiled::save`] writes: the report, the compiled graph as IR text and the
/// training plan as `--emit plan` writes it, so a loaded plan is the one saved.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedPlan {
    format: String,
    report: String,
    low: Option<String>,
    graph: String,
    training_plan: Option<serde_json::Value>,
    gpu: castor_passes::cost::GpuSpec,
}

const SAVED_PLAN_FORMAT: &str = "castor-compiled-plan/1";

impl Compiled {
    /// The precision summary: converted nodes, casts, the table by class.
    pub fn summary(&self) -> castor_passes::PrecisionSummary {
        precision_summary(&self.graph, self.low)
    }

    /// The cost model's estimate of the training step.
    pub fn cost(&self) -> Option<castor_passes::cost::StepCost> {
        self.plan
            .as_ref()
            .map(|(plan, _)| castor_passes::cost::StepCost::of_plan(plan, &self.gpu))
    }

    /// What `--emit` writes: none for `summary`, and none for `plan` and `cuda` without a
    /// training step.
    pub fn emit(&self, emit: Emit) -> anyhow::Result<Option<String>> {
        let plan = self.plan.as_ref().map(|(plan, _)| plan);
        Ok(match (emit, plan) {
            (Emit::Summary, _) => None,
            (Emit::Ir, Some(plan)) => Some(format!(
                "# micro step: forward and backward of one micro-batch\n{}\n# optimizer step\n{}\n{}",
                text::print(&plan.micro_step),
                text::print(&plan.optimizer_step),
                units_text(plan)
            )),
            (Emit::Ir, None) => Some(text::print(&self.graph)),
            (Emit::Dot, Some(plan)) => Some(castor_ir::to_dot(&plan.micro_step)),
            (Emit::Dot, None) => Some(castor_ir::to_dot(&self.graph)),
            (Emit::Plan, Some(plan)) => Some(plan.to_json()),
            (Emit::Cuda, Some(plan)) => Some(
                lower_plan(plan)
                    .map_err(|e| crate::CliError::InvalidInput(format!("--emit cuda: {e}")))?
                    .listing(),
            ),
            (Emit::Plan | Emit::Cuda, None) => None,
        })
    }

    /// Writes everything [`Compiled::load`] needs to give this plan back (atomically).
    pub fn save(&self, path: &std::path::Path) -> anyhow::Result<()> {
        let saved = SavedPlan {
            format: SAVED_PLAN_FORMAT.into(),
            report: self.report.clone(),
            low: self.low.map(|d| d.to_string()),
            graph: text::print(&self.graph),
            training_plan: match &self.plan {
                Some((plan, _)) => Some(serde_json::from_str(&plan.to_json())?),
                None => None,
            },
            gpu: self.gpu.clone(),
        };
        let json = serde_json::to_string(&saved)?;
        castor_models::write_atomically(path, json.as_bytes())?;
        Ok(())
    }

    /// Reads a plan [`Compiled::save`] wrote.
    pub fn load(path: &std::path::Path) -> anyhow::Result<Compiled> {
        let bad = |m: String| crate::CliError::InvalidInput(format!("`{}`: {m}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read: {e}")))?;
        let saved: SavedPlan = serde_json::from_str(&text)
            .map_err(|e| bad(format!("not a saved castor plan: {e}")))?;
        if saved.format != SAVED_PLAN_FORMAT {
            return Err(bad(format!(
                "format `{}`, this castor reads `{SAVED_PLAN_FORMAT}`",
                saved.format
            ))
            .into());
        }
        let low = match saved.low {
            Some(d) => Some(d.parse().map_err(|e: String| bad(e))?),
            None => None,
        };
        let graph = text::parse(&saved.graph).with_context(|| format!("`{}`", path.display()))?;
        verify(&graph).with_context(|| format!("`{}`", path.display()))?;
        let plan = match saved.training_plan {
            Some(json) => {
                let plan = castor_ir::TrainingPlan::from_json(&json.to_string())
                    .with_context(|| format!("`{}`", path.display()))?;
                let (anatomy, _) = anatomy_of(&plan);
                Some((plan, anatomy))
            }
            None => None,
        };
        Ok(Compiled {
            report: saved.report,
            graph,
            low,
            plan,
            gpu: saved.gpu,
        })
    }
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
                    .flat_map(|r| r.issued())
                    .filter(|c| f(c))
                    .count()
            };
            let launches = count(&|c| matches!(c, Command::Launch(_)));
            let gemms = count(&|c| matches!(c, Command::Gemm(_)));
            let other = count(&|c| matches!(c, Command::Copy { .. } | Command::Memset { .. }));
            let collectives = count(&|c| {
                matches!(c, Command::Collective { op, .. }
                    if op.class() == castor_ir::OpClass::Communication)
            });
            let mfu = r
                .mfu()
                .map_or("MFU n/a".to_string(), |m| format!("MFU {:.1}%", 100.0 * m));
            let nccl = match collectives {
                0 => String::new(),
                n => format!(", {n} NCCL collectives (one process per GPU under a launcher)"),
            };
            format!(
                "cuda        {launches} kernel launches, {gemms} cuBLAS products, {other} copies/memsets{nccl} \
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
