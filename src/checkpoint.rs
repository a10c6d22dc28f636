//! Training checkpoints: a Hugging Face model folder plus what resuming needs.
//!
//! - `config.json`: the model's config, as given.
//! - `model.safetensors`: the F32 master weights under their checkpoint names (the input's
//!   names and layout; tied weights stored once, as transformers writes them).
//! - `optimizer.safetensors`: optimizer moments, step count and loss-scaler state, under
//!   their plan state names.
//! - `trainer_state.json`: the loop's step, the data position and the plan's settings.
//!
//! Every file is written to a temporary name, synced and renamed, so an interrupted save
//! leaves the previous file whole.

use castor_ir::{StateRole, Tensor, TrainSettings};
use castor_models::{write_atomically, write_safetensors, SafetensorsFile};
use castor_runtime::PlanRunner;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const TRAINER_STATE: &str = "trainer_state.json";
pub const OPTIMIZER_STATE: &str = "optimizer.safetensors";

#[derive(Debug, Serialize, Deserialize)]
pub struct TrainerState {
    /// Loop steps completed (skipped optimizer steps included).
    pub step: u64,
    /// Index of the next token window in the data stream.
    pub data_position: usize,
    pub settings: TrainSettings,
}

/// Writes a checkpoint of `runner` into `dir` (created if needed).
pub fn save(
    dir: &Path,
    config_json: &str,
    runner: &PlanRunner,
    state: &TrainerState,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow::anyhow!("cannot create checkpoint folder `{}`: {e}", dir.display()))?;
    let plan = runner.plan();
    let by_role = |roles: &[StateRole]| -> Vec<(&str, &Tensor)> {
        runner
            .state_entries()
            .into_iter()
            .filter(|(name, _)| {
                plan.state_spec(name)
                    .is_some_and(|s| roles.contains(&s.role))
            })
            .collect()
    };
    // Model weights last: a reader that finds them finds the rest of this checkpoint too.
    write_atomically(&dir.join("config.json"), config_json.as_bytes())?;
    write_safetensors(
        &dir.join(OPTIMIZER_STATE),
        &by_role(&[StateRole::OptimizerState, StateRole::Control]),
    )?;
    let json = serde_json::to_string_pretty(state)?;
    write_atomically(&dir.join(TRAINER_STATE), json.as_bytes())?;
    write_safetensors(
        &dir.join("model.safetensors"),
        &by_role(&[StateRole::Master]),
    )?;
    Ok(())
}

/// Reads the optimizer state and the trainer state of a checkpoint folder.
pub fn load_resume_state(dir: &Path) -> anyhow::Result<(Vec<(String, Tensor)>, TrainerState)> {
    let text = std::fs::read_to_string(dir.join(TRAINER_STATE)).map_err(|e| {
        crate::CliError::InvalidInput(format!(
            "`{}` is not a castor training checkpoint (no {TRAINER_STATE}: {e})",
            dir.display()
        ))
    })?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
        crate::CliError::InvalidInput(format!("`{}`: {e}", dir.join(TRAINER_STATE).display()))
    })?;
    let file = SafetensorsFile::open(dir.join(OPTIMIZER_STATE))?;
    let names: Vec<String> = file.names().map(str::to_string).collect();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let t = file.tensor_f32(&name)?;
        tensors.push((name, t));
    }
    Ok((tensors, state))
}
