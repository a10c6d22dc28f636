//! The plan a run trains (compiled for the data's shape, or read from `--plan` and checked
//! against the flags), the data opened for its shape, and whether it fits the device.

use super::args::Args;
use super::data::{Data, DataOptions};
use super::fit::{self, MemoryTarget};
use super::resume;
use crate::given::Given;
use crate::precision::PrecisionArgs;
use crate::CliError;
use anyhow::Context;
use castor_ir::{LoraSettings, TrainSettings, TrainingPlan};
use castor_models::Model;
use castor_runtime::ExecutorKind;

/// The adapters this run trains: an adapter folder to continue (`--adapter`, its settings
/// with `--base`), or those the `--lora-*` flags ask for; flags that disagree with the folder
/// are an error.
pub(super) fn lora_settings(
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
pub(super) fn plan_and_data(
    args: &Args,
    given: &Given,
    model: &mut Model,
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
        loss_on: args.run.loss_on,
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
            model.set_packed(plan.settings.packed)?;
            model.set_dropout(plan.settings.dropout);
            let options = DataOptions {
                batch: Some(plan.settings.batch),
                seq: Some(plan.settings.seq),
                plan: Some(path.clone()),
                ..data_options
            };
            let data = Data::open(&args.data, model, objective, &options)?;
            if plan.settings.unpadded && !data.is_token_stream() {
                return Err(CliError::InvalidInput(format!(
                    "the plan `{}` was compiled for unpadded rows (token windows: it reads no \
                     attention mask), but `{}` is not a token stream; compile a plan without \
                     --unpadded",
                    path.display(),
                    args.data.display()
                ))
                .into());
            }
            // After the data is open: a batch file is read with its mask, and refused above.
            model.set_unpadded(plan.settings.unpadded)?;
            (CompiledPlan::from_file(plan), data)
        }
        None => {
            let objective = args.training.training_objective(model)?;
            model.set_packed(args.training.pack)?;
            model.set_dropout(args.training.dropout);
            let data = Data::open(&args.data, model, objective, &data_options)?;
            model.set_unpadded(unpadded_rows(args, model, &data)?)?;
            let (batch, seq) = data.shape();
            let mut settings =
                args.training
                    .settings(args.precision.precision, objective, batch, seq)?;
            settings.unpadded = model.unpadded();
            settings.lora = lora.clone();
            (
                compile_plan(&args.precision, model, settings, true, executor)?,
                data,
            )
        }
    })
}

/// Whether the plan compiled for `data` takes unpadded rows: windows of a token stream keep
/// every key, so a causal LM's plan reads no mask for them, told or not; `--unpadded` with
/// other data is an error.
fn unpadded_rows(args: &Args, model: &Model, data: &Data) -> anyhow::Result<bool> {
    let stream = data.is_token_stream();
    if args.training.unpadded && !stream {
        return Err(CliError::InvalidInput(format!(
            "--unpadded is for windows of a token stream, whose rows keep every key; `{}` is \
             not one (its rows may be padded): leave --unpadded out",
            args.data.display()
        ))
        .into());
    }
    Ok(args.training.unpadded || (stream && model.unpaddable() && !model.packed()))
}

/// The fit verdict (the planned peak against the device's memory, and the changes that would
/// fit), printed; the cost model's GPU with it.
pub(super) fn fit_verdict(
    args: &Args,
    model: &Model,
    planned: &CompiledPlan,
    anatomy: &castor_passes::memory::Anatomy,
    executor: ExecutorKind,
) -> anyhow::Result<(castor_passes::cost::GpuSpec, Option<fit::Verdict>)> {
    let gpu = fit::gpu_spec(args.gpu.as_deref())?;
    let target = match executor {
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

/// The plan's planned memory per step (from the plan alone, so a plan file reports it too).
pub(super) fn memory_line(a: &castor_passes::memory::Anatomy) -> String {
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
        if let Some((_, report)) = compiled.reports.iter().find(|(p, _)| *p == "fp8") {
            outln!("fp8         {}", report.summary);
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
