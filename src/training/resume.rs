//! Flags against what a run is bound to: a resumed checkpoint or a compiled plan.
//!
//! A resumed run continues as it was started: every flag that decides what it computes
//! (precision policy, training step, shapes, schedule, data order) comes from the checkpoint
//! unless it is given, and a given flag that disagrees with the checkpoint is an error naming
//! the flag and both values. A plan (`--plan`) fixes its settings the same way. The model a
//! resumed checkpoint holds must be the one MODEL names. Nothing here is silent.

use super::args::{Args, RunArgs};
use crate::given::Given;
use crate::precision::PrecisionArgs;
use crate::training::TrainingArgs;
use crate::CliError;
use castor_ir::{show_value as show, Setting, TrainSettings};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::Path;

/// The flags that decide what a run computes, as a checkpoint records them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunFlags {
    pub precision: PrecisionArgs,
    pub training: TrainingArgs,
    pub run: RunArgs,
}

/// Flags a resumed run may change: `--steps` is where it trains until.
const FREE: [&str; 1] = ["steps"];

impl RunFlags {
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// The flags of a run resumed from `dir`, whose checkpoint recorded `saved`: each flag
    /// from the checkpoint unless given; a given flag that differs is an error.
    pub fn merged_with(
        &self,
        saved: &Value,
        given: &Given,
        dir: &Path,
    ) -> anyhow::Result<RunFlags> {
        let Value::Object(saved) = saved else {
            // A checkpoint without recorded flags: the settings check decides.
            return Ok(self.clone());
        };
        let Value::Object(mut ours) = self.to_json() else {
            return Ok(self.clone());
        };
        for (group, values) in ours.iter_mut() {
            let (Value::Object(values), Some(Value::Object(theirs))) = (values, saved.get(group))
            else {
                continue;
            };
            merge_group(values, theirs, given, dir)?;
        }
        Ok(serde_json::from_value(Value::Object(ours)).map_err(|e| {
            CliError::InvalidInput(format!(
                "`{}`: the run's recorded flags cannot be read: {e}",
                dir.join(crate::training::checkpoint::TRAINER_STATE)
                    .display()
            ))
        })?)
    }
}

fn merge_group(
    ours: &mut Map<String, Value>,
    theirs: &Map<String, Value>,
    given: &Given,
    dir: &Path,
) -> anyhow::Result<()> {
    for (key, value) in ours.iter_mut() {
        let Some(recorded) = theirs.get(key) else {
            continue;
        };
        if !given.has(key) {
            *value = recorded.clone();
        } else if value != recorded && !FREE.contains(&key.as_str()) {
            let flag = Given::flag(key);
            return Err(CliError::InvalidInput(format!(
                "{flag} {} disagrees with the run being resumed: `{}` was trained with {flag} \
                 {}; leave the flag out to continue the run as it was started, or start a new \
                 run",
                show(value),
                dir.display(),
                show(recorded)
            ))
            .into());
        }
    }
    Ok(())
}

/// config.json as JSON, without the keys that say where or with what it was saved.
fn config_value(path: &Path) -> Option<Map<String, Value>> {
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(file).ok()?;
    let Value::Object(mut m) = serde_json::from_str(&text).ok()? else {
        return None;
    };
    for k in ["_name_or_path", "transformers_version", "torch_dtype"] {
        m.remove(k);
    }
    Some(m)
}

/// MODEL must be the model the checkpoint in `dir` holds: their configs may differ only in
/// where they were saved.
pub fn check_same_model(model: &Path, dir: &Path) -> anyhow::Result<()> {
    let (Some(ours), Some(theirs)) = (config_value(model), config_value(dir)) else {
        // Unreadable configs are reported when the model is loaded.
        return Ok(());
    };
    let mut keys: Vec<&String> = ours.keys().chain(theirs.keys()).collect();
    keys.sort();
    keys.dedup();
    let differences: Vec<String> = keys
        .into_iter()
        .filter(|k| ours.get(*k) != theirs.get(*k))
        .map(|k| {
            let v = |m: &Map<String, Value>| m.get(k).map_or("(absent)".into(), show);
            format!(
                "{k}: {} in the checkpoint, {} in MODEL",
                v(&theirs),
                v(&ours)
            )
        })
        .collect();
    if differences.is_empty() {
        return Ok(());
    }
    Err(CliError::InvalidInput(format!(
        "--resume `{}` holds another model than MODEL `{}` ({}); give the model the run was \
         started with, or the checkpoint folder itself",
        dir.display(),
        model.display(),
        differences.join("; ")
    ))
    .into())
}

/// The flags that feed each plan setting. The match is exhaustive: a new setting does not
/// compile until it says which flags set it.
fn flags_of(setting: Setting) -> &'static [&'static str] {
    match setting {
        Setting::Precision => &["precision"],
        Setting::Objective => &["objective"],
        Setting::Batch => &["batch"],
        Setting::Seq => &["seq"],
        Setting::GradAccum => &["grad_accum"],
        Setting::Optimizer => &[
            "optimizer",
            "beta1",
            "beta2",
            "eps",
            "weight_decay",
            "momentum",
            "clip_threshold",
            "decay_rate",
            "warmup_init",
            // Adafactor takes its relative step exactly when no rate is given.
            "lr",
        ],
        Setting::OptimizerState => &["optimizer_state"],
        Setting::UpdateInBackward => &["update_in_backward"],
        Setting::MaxGradNorm => &["grad_clip"],
        Setting::LossScaling => &[
            "loss_scale",
            "init_scale",
            "growth_interval",
            "hysteresis",
            "min_scale",
        ],
        Setting::Frozen => &["freeze"],
        Setting::NoDecay => &["no_decay"],
        Setting::ParamGradsInComputeDtype => &["param_grads"],
        Setting::Remat => &["remat"],
        Setting::Classifier => &["classifier"],
        Setting::Epilogues => &["epilogues"],
        // Checked against `--adapter` and the `--lora-*` flags where the plan is read
        // (`plan::plan_and_data`), which also knows the adapter folder's settings.
        Setting::Lora => &[],
        Setting::Parallel => &["world_size", "zero"],
        Setting::Packed => &["pack"],
        // `castor train` takes unpadded rows for token streams unasked: only a typed
        // `--unpadded` is compared.
        Setting::Unpadded => &["unpadded"],
        Setting::Dropout => &["dropout"],
    }
}

/// `--plan`: the plan decides every setting; a flag that disagrees with it is an error naming
/// the setting and both values, and the precision policy flags (compiled into the plan's
/// graphs) cannot be given at all.
pub fn check_plan_flags(
    plan: &TrainSettings,
    args: &Args,
    given: &Given,
    path: &Path,
) -> anyhow::Result<()> {
    for id in ["keep_f32", "force_low", "policy", "attention", "residual"] {
        if given.has(id) {
            return Err(CliError::InvalidInput(format!(
                "{} cannot change the plan `{}`: its graphs are compiled with it; give the \
                 flag to `castor compile --emit plan` instead",
                Given::flag(id),
                path.display()
            ))
            .into());
        }
    }
    let objective = match args.training.objective.as_str() {
        "auto" => plan.objective.parse().map_err(CliError::InvalidInput)?,
        other => other.parse().map_err(CliError::InvalidInput)?,
    };
    let ours = args.training.settings(
        args.precision.precision,
        objective,
        args.run.batch.unwrap_or(plan.batch),
        args.run.seq.unwrap_or(plan.seq),
    )?;
    for d in ours.differences(plan) {
        let Some(flag) = flags_of(d.setting).iter().find(|f| given.has(f)) else {
            continue;
        };
        return Err(CliError::InvalidInput(format!(
            "{} disagrees with the plan `{}`: its {} is {}, the flags give {}; leave the flag \
             out (the plan decides it) or compile a new plan",
            Given::flag(flag),
            path.display(),
            d.setting.name(),
            d.theirs,
            d.ours
        ))
        .into());
    }
    Ok(())
}

/// The plan of a resumed run must have the checkpoint's settings; the error names every
/// setting that differs.
pub fn check_settings(
    saved: &TrainSettings,
    current: &TrainSettings,
    dir: Option<&Path>,
) -> anyhow::Result<()> {
    let differences: Vec<String> = saved
        .differences(current)
        .into_iter()
        .map(|d| {
            format!(
                "{}: {} in the checkpoint, {} now",
                d.setting.name(),
                d.ours,
                d.theirs
            )
        })
        .collect();
    if differences.is_empty() {
        return Ok(());
    }
    Err(CliError::InvalidInput(format!(
        "--resume `{}`: the checkpoint was trained with other settings ({}); pass the same \
         flags, or leave them out to take the checkpoint's",
        dir.map(|d| d.display().to_string()).unwrap_or_default(),
        differences.join("; ")
    ))
    .into())
}
