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
use castor_ir::TrainSettings;
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

/// A flag value for people: strings bare, lists comma-separated.
fn show(v: &Value) -> String {
    match v {
        Value::Null => "(not set)".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) if a.is_empty() => "(none)".into(),
        Value::Array(a) => a.iter().map(show).collect::<Vec<_>>().join(", "),
        other => other.to_string(),
    }
}

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

/// Which flags feed each plan setting.
const SETTING_FLAGS: [(&str, &[&str]); 16] = [
    ("precision", &["precision"]),
    ("objective", &["objective"]),
    ("batch", &["batch"]),
    ("seq", &["seq"]),
    ("grad_accum", &["grad_accum"]),
    (
        "optimizer",
        &[
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
    ),
    ("optimizer_state", &["optimizer_state"]),
    ("update_in_backward", &["update_in_backward"]),
    ("max_grad_norm", &["grad_clip"]),
    (
        "loss_scaling",
        &[
            "loss_scale",
            "init_scale",
            "growth_interval",
            "hysteresis",
            "min_scale",
        ],
    ),
    ("frozen", &["freeze"]),
    ("no_decay", &["no_decay"]),
    ("param_grads_in_compute_dtype", &["param_grads"]),
    ("remat", &["remat"]),
    ("classifier", &["classifier"]),
    ("epilogues", &["epilogues"]),
];

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
    let (Value::Object(ours), Value::Object(theirs)) = (
        serde_json::to_value(&ours).unwrap_or(Value::Null),
        serde_json::to_value(plan).unwrap_or(Value::Null),
    ) else {
        return Ok(());
    };
    for (setting, flags) in SETTING_FLAGS {
        let Some(flag) = flags.iter().find(|f| given.has(f)) else {
            continue;
        };
        let (a, b) = (ours.get(setting), theirs.get(setting));
        if a != b {
            let v = |x: Option<&Value>| x.map_or("(none)".into(), show);
            return Err(CliError::InvalidInput(format!(
                "{} disagrees with the plan `{}`: its {setting} is {}, the flags give {}; leave \
                 the flag out (the plan decides it) or compile a new plan",
                Given::flag(flag),
                path.display(),
                v(b),
                v(a)
            ))
            .into());
        }
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
    let (Value::Object(a), Value::Object(b)) = (
        serde_json::to_value(saved).unwrap_or(Value::Null),
        serde_json::to_value(current).unwrap_or(Value::Null),
    ) else {
        return Ok(());
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let differences: Vec<String> = keys
        .into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let v = |m: &Map<String, Value>| m.get(k).map_or("(none)".into(), show);
            format!("{k}: {} in the checkpoint, {} now", v(&a), v(&b))
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
