//! Training checkpoints: a Hugging Face model folder plus what resuming needs.
//!
//! - `config.json`: the model's config, as given (and the model's tokenizer files, if any).
//! - `model.safetensors`: the F32 master weights under their checkpoint names (the input's
//!   names and layout; tied weights stored once, as transformers writes them).
//! - `optimizer.safetensors`: optimizer moments, step count, loss-scaler state and FP8
//!   delayed-scaling state (scales and amax histories), under their plan state names.
//! - `trainer_state.json`: the step, the data position, the plan's settings and the run's
//!   flags.
//!
//! Periodic checkpoints (`--save-every`) are folders `DIR/step-000123/`, each written whole
//! into a hidden temporary sibling, synced (files and folder) and renamed into place: a
//! step folder that is visible is complete. Older step folders are removed (`--keep`) only
//! after the new one is in place. The final checkpoint is written into `DIR` itself, file by
//! file, each file atomic, the weights last.

use castor_ir::{StateRole, Tensor, TrainSettings};
use castor_models::{write_atomically, write_safetensors, SafetensorsFile};
use castor_runtime::PlanRunner;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};

pub const TRAINER_STATE: &str = "trainer_state.json";
pub const OPTIMIZER_STATE: &str = "optimizer.safetensors";
pub const MODEL_WEIGHTS: &str = "model.safetensors";

/// Files a Hugging Face checkpoint carries besides config and weights, copied along.
const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "generation_config.json",
];

#[derive(Debug, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps completed (skipped optimizer steps included): the number of the last step.
    pub step: u64,
    /// Token windows of the data stream read so far.
    pub data_position: usize,
    pub settings: TrainSettings,
    /// The flags the run was started with (precision policy, training step, shapes,
    /// schedule, data order), which a resumed run takes unless they are given.
    #[serde(default)]
    pub flags: serde_json::Value,
    /// Training tokens of the data stream (0 for a fixed batch): a resumed run must read
    /// the same data.
    #[serde(default)]
    pub data_tokens: usize,
}

/// What every checkpoint of a run holds besides the runner's state: the config and the
/// tokenizer files, read once when the run starts.
pub struct CheckpointFiles {
    pub config_json: String,
    pub extras: Vec<(String, Vec<u8>)>,
    /// For a plan that trains LoRA adapters: the base they adapt. Its checkpoints are PEFT
    /// adapter folders instead of model folders.
    pub adapter: Option<crate::adapter::AdapterBase>,
}

impl CheckpointFiles {
    /// The config text plus the tokenizer files found in `model_dir` (if any).
    pub fn new(config_json: String, model_dir: Option<&Path>) -> CheckpointFiles {
        let extras = model_dir
            .map(|dir| {
                TOKENIZER_FILES
                    .iter()
                    .filter_map(|name| {
                        std::fs::read(dir.join(name))
                            .ok()
                            .map(|b| (name.to_string(), b))
                    })
                    .collect()
            })
            .unwrap_or_default();
        CheckpointFiles {
            config_json,
            extras,
            adapter: None,
        }
    }
}

/// Writes every file of a checkpoint into the existing folder `dir`, each atomically.
fn write_files(
    dir: &Path,
    files: &CheckpointFiles,
    runner: &PlanRunner,
    state: &TrainerState,
) -> anyhow::Result<()> {
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
    // Model weights last: in a folder written in place, a reader that finds new weights
    // finds the rest of this checkpoint too. Adapters are saved alone, as PEFT saves them:
    // the base is the checkpoint they were trained on.
    if files.adapter.is_none() {
        write_atomically(&dir.join("config.json"), files.config_json.as_bytes())?;
    }
    for (name, bytes) in &files.extras {
        write_atomically(&dir.join(name), bytes)?;
    }
    write_safetensors(
        &dir.join(OPTIMIZER_STATE),
        &by_role(&[
            StateRole::OptimizerState,
            StateRole::Control,
            StateRole::Fp8Scaling,
        ]),
    )?;
    let json = serde_json::to_string_pretty(state)?;
    write_atomically(&dir.join(TRAINER_STATE), json.as_bytes())?;
    match (&files.adapter, &plan.settings.lora) {
        (Some(base), Some(lora)) => {
            crate::adapter::save(dir, lora, base, &by_role(&[StateRole::Master]))?
        }
        _ => write_safetensors(&dir.join(MODEL_WEIGHTS), &by_role(&[StateRole::Master]))?,
    }
    Ok(())
}

/// Writes a checkpoint of `runner` into `dir` (created if needed), file by file.
pub fn save(
    dir: &Path,
    files: &CheckpointFiles,
    runner: &PlanRunner,
    state: &TrainerState,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow::anyhow!("cannot create checkpoint folder `{}`: {e}", dir.display()))?;
    write_files(dir, files, runner, state)
}

/// The name of step `step`'s folder.
pub fn step_folder_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// Writes a checkpoint as the folder `target`, all at once: into a hidden temporary sibling,
/// synced, then renamed. An existing `target` is replaced only once the new one is complete.
pub fn save_folder_atomically(
    target: &Path,
    files: &CheckpointFiles,
    runner: &PlanRunner,
    state: &TrainerState,
) -> anyhow::Result<()> {
    let parent = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| anyhow::anyhow!("`{}` is not a folder name", target.display()))?;
    let pid = std::process::id();
    let tmp = parent.join(format!(".{name}.tmp-{pid}"));
    let ctx = |what: &str, p: &Path, e: std::io::Error| {
        anyhow::anyhow!("cannot {what} `{}`: {e}", p.display())
    };
    std::fs::create_dir_all(parent).map_err(|e| ctx("create", parent, e))?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| ctx("remove", &tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| ctx("create", &tmp, e))?;
    if let Err(e) = write_files(&tmp, files, runner, state) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| ctx("sync", &tmp, e))?;
    let old = parent.join(format!(".{name}.old-{pid}"));
    let replaced = target.exists();
    if replaced {
        std::fs::rename(target, &old).map_err(|e| ctx("move aside", target, e))?;
    }
    std::fs::rename(&tmp, target).map_err(|e| ctx("rename into place", target, e))?;
    File::open(parent)
        .and_then(|f| f.sync_all())
        .map_err(|e| ctx("sync", parent, e))?;
    if replaced {
        std::fs::remove_dir_all(&old).map_err(|e| ctx("remove", &old, e))?;
    }
    Ok(())
}

/// The complete step folders `root/step-NNNNNN/`, oldest first.
pub fn step_folders(root: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// Writes `root/step-NNNNNN/` atomically, then removes all but the newest `keep` step folders
/// (`keep` 0 keeps them all). Returns the new folder.
pub fn save_step(
    root: &Path,
    keep: usize,
    files: &CheckpointFiles,
    runner: &PlanRunner,
    state: &TrainerState,
) -> anyhow::Result<PathBuf> {
    let target = root.join(step_folder_name(state.step));
    save_folder_atomically(&target, files, runner, state)?;
    if keep > 0 {
        let all = step_folders(root);
        let excess = all.len().saturating_sub(keep);
        for (step, path) in all.into_iter().take(excess) {
            // Out of sight first, so a half-removed folder never looks like a checkpoint.
            let doomed = root.join(format!(
                ".{}.del-{}",
                step_folder_name(step),
                std::process::id()
            ));
            std::fs::rename(&path, &doomed).map_err(|e| {
                anyhow::anyhow!("cannot remove old checkpoint `{}`: {e}", path.display())
            })?;
            let _ = std::fs::remove_dir_all(&doomed);
        }
    }
    Ok(target)
}

/// Removes what interrupted saves left in `root`: hidden temporary and half-removed folders.
pub fn clean_stale(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".step-") && (name.contains(".tmp-") || name.contains(".del-")) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The checkpoint `--resume DIR` means: DIR itself, or its newest step folder when that is
/// further along (or DIR holds only step folders).
pub fn resolve_resume(dir: &Path) -> PathBuf {
    let own = read_trainer_state(dir).ok().map(|s| s.step);
    match step_folders(dir).last() {
        Some((step, path)) if own.is_none_or(|s| *step > s) => path.clone(),
        _ => dir.to_path_buf(),
    }
}

/// Parses `dir/trainer_state.json`.
pub fn read_trainer_state(dir: &Path) -> anyhow::Result<TrainerState> {
    let text = std::fs::read_to_string(dir.join(TRAINER_STATE)).map_err(|e| {
        crate::CliError::InvalidInput(format!(
            "`{}` is not a castor training checkpoint (no {TRAINER_STATE}: {e})",
            dir.display()
        ))
    })?;
    Ok(serde_json::from_str(&text).map_err(|e| {
        crate::CliError::InvalidInput(format!("`{}`: {e}", dir.join(TRAINER_STATE).display()))
    })?)
}

/// Reads the optimizer state and the trainer state of a checkpoint folder.
pub fn load_resume_state(dir: &Path) -> anyhow::Result<(Vec<(String, Tensor)>, TrainerState)> {
    let state = read_trainer_state(dir)?;
    if dir.join(crate::adapter::CONFIG).is_file() {
        return Err(crate::CliError::InvalidInput(format!(
            "--resume `{}`: a LoRA adapter checkpoint cannot be resumed yet; continue training \
             it with `castor train BASE --adapter {}` (its optimizer moments start over)",
            dir.display(),
            dir.display()
        ))
        .into());
    }
    let file = SafetensorsFile::open(dir.join(OPTIMIZER_STATE))?;
    let names: Vec<String> = file.names().map(str::to_string).collect();
    let mut tensors = Vec::with_capacity(names.len());
    // Each entry in its stored dtype (F32, BF16 moments, 8-bit codes), as the plan holds it.
    for name in names {
        let t = file.tensor(&name)?;
        tensors.push((name, t));
    }
    Ok((tensors, state))
}
